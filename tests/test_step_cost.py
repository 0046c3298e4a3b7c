"""The online step-cost model: it recovers known costs, follows a change, stays non-negative, and
the engine feeds it every step."""

import numpy as np
import pytest

from core.engine.engine import Engine
from core.engine.step_cost import StepCostModel, StepShape
from core.engine.types import SamplingParams
from tests.tiny import tiny_config

TRUE = {"overhead": 0.012, "tokens": 8e-4, "sampled": 2e-3, "kv_read": 3e-7, "attn_pairs": 2e-9}


def true_time(shape: StepShape, costs=TRUE) -> float:
    return (costs["overhead"] + costs["tokens"] * shape.tokens + costs["sampled"] * shape.sampled
            + costs["kv_read"] * shape.kv_read + costs["attn_pairs"] * shape.attn_pairs)


def random_step(rng) -> StepShape:
    """A mixed step: some decodes over random contexts, maybe one prefill chunk."""
    shape = StepShape()
    for _ in range(rng.integers(0, 48)):
        shape.add(1, int(rng.integers(16, 2048)))
    if rng.random() < 0.5:
        chunk = int(rng.integers(16, 1024))
        shape.add(chunk, chunk + int(rng.integers(0, 1024)), sampled=bool(rng.random() < 0.5))
    return shape if shape.tokens else shape.add(1, 32)


def test_shape_matches_the_engine_stats_formula():
    shape = StepShape().add(1, 100).add(8, 20, sampled=False)
    assert (shape.tokens, shape.sampled, shape.kv_read) == (9, 1, 120)
    assert shape.attn_pairs == pytest.approx(100 + 8 * (20 - 3.5))


def test_recovers_known_costs_from_noisy_steps():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    shapes = [random_step(rng) for _ in range(400)]
    for shape in shapes:
        model.observe(shape, true_time(shape) * (1 + 0.02 * rng.standard_normal()))
    got = model.coefficients()
    for key in ("overhead", "tokens", "sampled"):
        assert got[key] == pytest.approx(TRUE[key], rel=0.1), key
    errors = [abs(model.predict(s) - true_time(s)) / true_time(s) for s in (random_step(rng) for _ in range(100))]
    assert np.median(errors) < 0.03


def test_coefficients_stay_non_negative():
    rng = np.random.default_rng(1)
    model = StepCostModel()
    for _ in range(200):  # time depends on tokens only; the other features are noise around zero
        shape = random_step(rng)
        model.observe(shape, 0.005 + 1e-3 * shape.tokens + 1e-4 * rng.standard_normal())
    assert all(v >= 0 for v in model.coefficients().values())
    assert model.coefficients()["tokens"] == pytest.approx(1e-3, rel=0.05)


def test_follows_a_machine_that_slows_down():
    rng = np.random.default_rng(2)
    model = StepCostModel()
    slow = {**TRUE, "overhead": 0.05}
    for _ in range(300):
        shape = random_step(rng)
        model.observe(shape, true_time(shape))
    for _ in range(1500):  # forgetting 0.998: the old regime weighs e^-3 after 1,500 steps
        shape = random_step(rng)
        model.observe(shape, true_time(shape, slow))
    assert model.coefficients()["overhead"] == pytest.approx(0.05, rel=0.1)


def test_a_hiccup_is_not_learned_from():
    model = StepCostModel()
    rng = np.random.default_rng(3)
    for _ in range(50):
        shape = random_step(rng)
        model.observe(shape, true_time(shape))
    before = model.coefficients()
    shape = StepShape().add(1, 10)
    model.observe(shape, 10 * true_time(shape) + 1.0)
    assert model.num_outliers == 1 and model.coefficients() == before
    assert model.to_dict()["relative_error"]["n"] == 50 - model.min_steps + 1


def test_the_engine_feeds_its_model_every_step(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, scheduler="continuous"))
    model = engine.core.context.cost_model
    assert engine.scheduler.context is engine.core.context  # the scheduler sees the same model
    engine.generate([[5, 6, 7, 8] * 4] * 3, SamplingParams(max_tokens=12, ignore_eos=True))
    assert model.num_steps + model.num_outliers == engine.core.step_count
    last = engine.last_step
    assert model.ready and last.predicted_s is not None and last.predicted_s > 0


def test_predictions_refit_every_few_steps_and_read_outs_are_exact():
    """The solve runs once `refit_every` steps have come in (predictions in between use the last
    fit); reading the coefficients always solves what has been observed."""
    rng = np.random.default_rng(3)
    model, exact = StepCostModel(refit_every=4), StepCostModel(refit_every=1)
    shapes = [random_step(rng) for _ in range(30)]
    for shape in shapes[:20]:
        for m in (model, exact):
            m.observe(shape, true_time(shape))
    probe = shapes[25]
    assert model.predict(probe) == pytest.approx(exact.predict(probe), rel=1e-12)  # 20 = 5 x 4: just refit
    slow = {**TRUE, "overhead": 0.5}
    for shape in shapes[20:23]:  # three more, slower steps: under refit_every
        for m in (model, exact):
            m.observe(shape, true_time(shape, slow))
    stale = model.predict(probe)
    assert stale < exact.predict(probe) - 0.01  # the exact model already sees the slower steps
    assert model.coefficients() == exact.coefficients()
    assert model.predict(probe) == pytest.approx(exact.predict(probe), rel=1e-12)
