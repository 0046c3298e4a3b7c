"""The degradation switch as a state machine, on constructed load sequences."""

import pytest

from core.server.config import ServerConfig
from core.server.guards import Degradation
from core.server.metrics import ServerMetrics


def _switch(**cfg):
    metrics = ServerMetrics()
    return Degradation(ServerConfig(degrade_waiting_high=10, degrade_waiting_low=2, degrade_kv_high=0.9,
                                    degrade_kv_low=0.5, **cfg), metrics, "main"), metrics


def _gauge(metrics):
    return metrics.registry.get_sample_value("servelab:degraded", {"model_name": "main"})


def _states(switch, loads):
    out = []
    for waiting, kv in loads:
        switch.update(waiting, kv)
        out.append(switch.on)
    return out


def test_waiting_requests_trigger_it_and_hysteresis_holds_it():
    switch, metrics = _switch()
    loads = [(0, 0.1), (9, 0.1), (10, 0.1), (5, 0.1), (3, 0.1), (2, 0.1), (5, 0.1)]
    assert _states(switch, loads) == [False, False, True, True, True, False, False]
    assert _gauge(metrics) == 0.0


def test_kv_usage_triggers_it_and_both_lows_are_needed_to_release_it():
    switch, metrics = _switch()
    loads = [(0, 0.89), (0, 0.9), (0, 0.6), (1, 0.5), (0, 0.95), (3, 0.4), (2, 0.4)]
    assert _states(switch, loads) == [False, True, True, False, True, True, False]
    assert _gauge(metrics) == 0.0


def test_the_gauge_follows_the_state():
    switch, metrics = _switch()
    switch.update(50, 0.0)
    assert switch.on and _gauge(metrics) == 1.0


@pytest.mark.parametrize("loads", [[(100, 0.99)] * 3, [(0, 1.0), (11, 0.0)]])
def test_disabled_it_never_switches(loads):
    switch, metrics = _switch(degrade_enabled=False)
    assert _states(switch, loads) == [False] * len(loads)
    assert _gauge(metrics) is None  # not even exported
