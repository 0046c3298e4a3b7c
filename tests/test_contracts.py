"""Contracts checked at load, and the example package's allocator and attention backend at work.

docs/architecture.md promises that a scheduler, a cache allocator and an attention backend each
take under 50 lines against `core.api`; the example package is that proof, and here it serves.
"""

from pathlib import Path

import pytest

from core.api import CacheConfig, CacheStats, hookimpl
from core.engine.engine import Engine
from core.engine.registry import Registry, plugin_manager
from core.engine.types import SamplingParams
from core.errors import ConfigError
from plugins.cache.paged import PagedCacheConfig
from tests.tiny import tiny_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "servelab-plugin-example"
PROMPTS = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 90)), [9] * 33, list(range(200, 240))]


@pytest.fixture(scope="module")
def registry(example_plugin):
    example = example_plugin
    pm = plugin_manager()
    if not pm.is_registered(example):
        pm.register(example, name="servelab_plugin_example")
    return Registry(pm)


def _engine(path, registry, **kw):
    cfg = tiny_config(path, scheduler="continuous", max_num_batched_tokens=32)
    for kind, section in kw.items():
        setattr(cfg, kind, section)
    return Engine(cfg, registry=registry)


def _greedy(engine, prompts=PROMPTS, n=1):
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, n=n))
    return [[o.token_ids for o in r.outputs] for r in outs]


def test_the_example_components_are_each_under_50_lines():
    for name in ("sjf.py", "freelist.py", "dense_attention.py"):
        lines = (EXAMPLE / "servelab_plugin_example" / name).read_text().count("\n")
        assert lines < 50, (name, lines)


def test_a_third_party_attention_backend_with_its_own_kv_layout_gives_the_same_tokens(tiny_dirs, registry):
    paged = PagedCacheConfig(name="paged", block_size=8, memory_gb=0.01)
    ref = _greedy(_engine(tiny_dirs["llama"], registry, cache=paged))
    e = _engine(tiny_dirs["llama"], registry, cache=paged, attention=registry.config("attention", {"name": "dense"}))
    assert e.backend.kv_caches[0][0].shape[1:] == (8, 2, 16)  # token-major blocks: its layout, not ours
    assert _greedy(e) == ref
    st = e.allocator.stats()
    assert st.num_free_blocks == st.num_blocks


def test_a_third_party_allocator_without_fork_serves_n_samples_by_separate_prefills(tiny_dirs, registry):
    ref = _greedy(_engine(tiny_dirs["llama"], registry, cache=PagedCacheConfig(name="paged", memory_gb=0.01)), n=3)
    e = _engine(tiny_dirs["llama"], registry, cache=registry.config("cache", {"name": "freelist", "block_size": 4}))
    prefill = []

    class Log:
        @hookimpl
        def servelab_step_finished(self, step_stats):
            prefill.append(step_stats.num_prefill_tokens)

    e.registry.pm.register(log := Log())
    try:
        assert _greedy(e, n=3) == ref
    finally:
        e.registry.pm.unregister(log)
    assert sum(prefill) == 3 * sum(len(p) for p in PROMPTS)  # no fork: every sample prefills its prompt
    assert e.allocator.stats().num_free_blocks == e.allocator.num_blocks


class _NoFree:
    capabilities = frozenset()

    def __init__(self, config, spec, max_num_seqs):
        self.spec, self.num_blocks, self.block_size = spec, 4, 16

    def can_admit(self, seq):
        return True

    def match_prefix(self, seq):
        return 0

    def allocate(self, seq, n):
        return True

    def block_table(self, seq):
        return [0]

    def stats(self):
        return CacheStats(4, 4, 16)


class _ForkLess(_NoFree):
    capabilities = frozenset({"fork"})

    def free(self, seq):
        pass


class _Unknown(_ForkLess):
    capabilities = frozenset({"teleport"})


class _BadPlugin:
    @hookimpl
    def servelab_cache_allocators(self):
        return {"nofree": _NoFree, "forkless": _ForkLess, "unknown": _Unknown}


@pytest.mark.parametrize("name, message", [
    ("nofree", "cache 'nofree' (from bad) lacks free (required of every cache)"),
    ("forkless", "cache 'forkless' (from bad) lacks fork (for its capability 'fork')"),
    ("unknown", "cache 'unknown' (from bad) declares unknown capability teleport; known: fork, copy_on_write, "
                "truncate, describe"),
])
def test_a_component_missing_a_member_is_refused_by_name_when_built(tiny_dirs, name, message):
    pm = plugin_manager()
    pm.register(_BadPlugin(), name="bad")
    cfg = tiny_config(tiny_dirs["llama"])
    cfg.cache = CacheConfig(name=name)
    with pytest.raises(ConfigError) as e:
        Engine(cfg, registry=Registry(pm))
    assert str(e.value) == message
