"""Speculative decoding: the verify rule on constructed logits (greedy and rejection sampling, with
a chi-square test that a broken rule fails), the n-gram lookup, and the engine end to end: the
same greedy tokens as plain decoding for every method, with preemptions, stops and aborts, and no
KV block left behind."""

import pytest
import torch

from core.config import DecoderConfig
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import ConfigError
from plugins.cache.paged import PagedCacheConfig
from plugins.decoders import speculative
from plugins.decoders.proposers import NgramProposer
from plugins.decoders.speculative import SpeculativeDecoderConfig, verify
from tests.tiny import make_tiny_model, tiny_config

V = 6


def peaked(rows: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax is each given token."""
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return logits


def test_greedy_verify_keeps_drafts_up_to_the_first_disagreement():
    # four sequences: a miss at the third draft, no drafts, every draft kept (bonus token), a miss at once
    logits = peaked([3, 4, 7, 1] + [2] + [6, 6, 9] + [2, 5])
    res = verify(logits, [3, 0, 2, 1], [[3, 4, 5], [], [6, 6], [1]], [True] * 4)
    assert res.tokens == [[3, 4, 7], [2], [6, 6, 9], [2]]
    assert res.accepted == [2, 0, 2, 0]


def test_ngram_lookup_takes_the_latest_longest_match():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert NgramProposer.lookup(toks, 3, 1, 3) == [5, 7, 1]  # [1 2 3] last seen at 5..7
    assert NgramProposer.lookup(toks, 2, 1, 3) == [5, 7]
    assert NgramProposer.lookup([1, 2, 3, 4, 2], 2, 2, 3) == []  # [4 2] never seen before
    assert NgramProposer.lookup([1, 2, 3, 4, 2], 2, 1, 3) == [3, 4]  # [2] at 1
    assert NgramProposer.lookup([5], 2, 1, 3) == []


# ---- rejection sampling keeps the target's distribution ----------------------------------------

P1 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
P2 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
Q1 = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.20, 0.10])  # a draft that is often wrong
Q2 = torch.tensor([0.10, 0.30, 0.10, 0.30, 0.10, 0.10])
CRITICAL = 25.7  # chi-square, 5 degrees of freedom, p = 1e-4


def chi_square(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    want = expected.double() / expected.sum() * len(tokens)
    return float(((counts - want) ** 2 / want).sum())


def sample_two_tokens(n: int, deterministic_draft: bool, top_k: int = 0, seed: int = 0):
    """n sequences at one fixed prefix, each with 2 drafts (from Q1, Q2, or fixed tokens as an
    n-gram proposer gives); the target's distributions are P1 then P2 whatever the prefix. Returns
    the first and second emitted tokens; a second token the verify did not emit is drawn from P2
    as the next step would."""
    g = torch.Generator().manual_seed(seed)
    if deterministic_draft:
        d = torch.tensor([[4, 0]] * n)
        probs = [None] * n
    else:
        d = torch.stack([torch.multinomial(Q1, n, True, generator=g), torch.multinomial(Q2, n, True, generator=g)], 1)
        probs = [torch.stack([Q1, Q2])] * n
    logits = torch.stack([P1.log(), P2.log(), torch.zeros(V)]).repeat(n, 1)
    rows = 3 * n
    res = verify(logits, [2] * n, d.tolist(), [False] * n, temperature=torch.ones(rows),
                 top_k=torch.full((rows,), top_k), top_p=torch.ones(rows), draft_probs=probs,
                 uniform=torch.rand(rows, generator=g), noise=torch.empty(rows, V).exponential_(generator=g))
    later = torch.multinomial(P2, n, True, generator=g).tolist()
    first = [t[0] for t in res.tokens]
    second = [t[1] if len(t) > 1 else later[i] for i, t in enumerate(res.tokens)]
    return first, second


@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(deterministic_draft):
    first, second = sample_two_tokens(20000, deterministic_draft)
    assert chi_square(first, P1) < CRITICAL
    assert chi_square(second, P2) < CRITICAL


def test_rejection_sampling_with_top_k_on_both_sides():
    first, _ = sample_two_tokens(20000, False, top_k=3)
    top3 = torch.zeros(V)
    top3[P1.topk(3).indices] = P1[P1.topk(3).indices]
    assert set(first) <= set(P1.topk(3).indices.tolist())
    assert chi_square(first, top3 + 1e-12) < CRITICAL


def test_a_broken_acceptance_rule_fails_the_same_test(monkeypatch):
    # the classic mistake: after a rejection, sample from the target instead of max(p - q, 0)
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    first, _ = sample_two_tokens(20000, False)
    assert chi_square(first, P1) > 10 * CRITICAL


# ---- the engine -----------------------------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 70)), [9] * 33, [40, 41, 42, 43] * 5]


def engine(path, decoder: DecoderConfig, memory_gb=0.01, max_num_seqs=8, max_num_batched_tokens=64) -> Engine:
    cfg = tiny_config(path, scheduler="continuous", max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens)
    cfg.cache = PagedCacheConfig(name="paged", block_size=16, memory_gb=memory_gb)
    cfg.decoder = decoder
    return Engine(cfg)


def spec(method="ngram", **kw) -> SpeculativeDecoderConfig:
    kw.setdefault("prompt_lookup_min", 1)  # the tiny random model rarely repeats a longer n-gram
    return SpeculativeDecoderConfig(name="speculative", method=method, disable_by_batch_size=0, **kw)


def tokens(e: Engine, prompts, params) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in e.generate(prompts, params)]


def stepwise(e: Engine, prompts, params) -> tuple[list[list[int]], int]:
    """Greedy outputs step by step, and how many preemptions the steps made."""
    ids = [e.add_request(p, params) for p in prompts]
    final, preempted = {}, 0
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        preempted += e.last_step.num_preempted if e.last_step else 0
    return [final[i] for i in ids], preempted


def no_leak(e: Engine) -> bool:
    stats = e.allocator.stats()
    return stats.num_free_blocks == stats.num_blocks


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """A second tiny model with the same tokenizer and other weights: a draft that is often wrong."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=1)


@pytest.mark.parametrize("method", ["ngram", "self", "self-int4", "draft-same", "draft-other"])
def test_greedy_speculation_gives_the_plain_tokens(tiny_dirs, other_tiny, method):
    path = tiny_dirs["llama"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = tokens(engine(path, DecoderConfig()), PROMPTS, params)
    cfg = {"ngram": spec(), "self": spec("self", draft_layers=1), "self-int4": spec("self"),
           "draft-same": spec("draft", draft_model=str(path)),
           "draft-other": spec("draft", draft_model=str(other_tiny))}[method]
    e = engine(path, cfg)
    assert tokens(e, PROMPTS, params) == want
    m = e.decoder.metrics()
    assert m["num_draft_tokens"] > 20  # it did speculate
    if method == "draft-same":  # the target as its own draft: every draft holds
        assert m["acceptance_rate"] == 1.0
    assert no_leak(e)
    if method != "ngram":
        draft = e.decoder.proposer.allocator
        assert draft.stats().num_free_blocks == draft.num_blocks  # the draft's KV went back too


def test_a_batch_of_32_with_preemptions_gives_the_plain_tokens(tiny_dirs):
    path = tiny_dirs["llama"]
    prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 5)] * 2 for i in range(32)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    # about 40 blocks of 16 tokens for 32 sequences that grow to ~40 tokens: preemptions certain
    small = dict(memory_gb=0.0003, max_num_seqs=32, max_num_batched_tokens=128)
    plain = engine(path, DecoderConfig(), **small)
    want = [t[0] for t in tokens(plain, prompts, params)]
    e = engine(path, spec(num_speculative_tokens=3), **small)
    got, preempted = stepwise(e, prompts, params)
    assert got == want
    assert preempted > 0
    assert e.decoder.metrics()["num_draft_tokens"] > 0
    assert no_leak(e)


def test_stops_inside_an_accepted_run_cut_it(tiny_dirs):
    path = tiny_dirs["llama"]
    prompt = [PROMPTS[4]]
    base = tokens(engine(path, DecoderConfig()), prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0][0]
    e = engine(path, spec(num_speculative_tokens=6))
    for params, expect in [
        (SamplingParams(max_tokens=5, ignore_eos=True), base[:5]),
        (SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[base[9]]), base[: base.index(base[9]) + 1]),
    ]:
        assert tokens(e, prompt, params)[0][0] == expect
    text = e.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    plain = engine(path, DecoderConfig()).generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    got = e.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert (got[0].outputs[0].text, got[0].outputs[0].finish_reason) == (plain[0].outputs[0].text,
                                                                         plain[0].outputs[0].finish_reason)
    assert no_leak(e)


def test_n_samples_and_an_abort_leave_nothing_behind(tiny_dirs):
    path = tiny_dirs["llama"]
    e = engine(path, spec())
    outs = e.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True, n=3))
    plain = engine(path, DecoderConfig()).generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True, n=3))
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in plain[0].outputs]
    sampled = e.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True, n=3, temperature=0.8, seed=3))
    assert all(len(c.token_ids) == 16 for c in sampled[0].outputs)
    rid = e.add_request(PROMPTS[4], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(6):
        e.step()
    e.abort(rid)
    while e.has_unfinished():
        e.step()
    assert no_leak(e)


def test_speculation_turns_itself_off_for_large_batches(tiny_dirs):
    # the layer-skip draft always has a guess, so any silence is the switch
    e = engine(tiny_dirs["llama"], SpeculativeDecoderConfig(name="speculative", method="self", draft_layers=1,
                                                           disable_by_batch_size=4))
    e.generate(PROMPTS[:4], SamplingParams(max_tokens=12, ignore_eos=True))
    assert e.decoder.metrics()["num_draft_tokens"] == 0
    e.generate(PROMPTS[:1], SamplingParams(max_tokens=12, ignore_eos=True))
    assert e.decoder.metrics()["num_draft_tokens"] > 0


def test_speculative_counts_agree_in_decoder_steps_and_records(tiny_dirs):
    from core.bench.summary import summarize
    from core.engine.records import sequence_record

    e = engine(tiny_dirs["llama"], spec())
    ids = [e.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    seqs = [e.requests[i].seqs[0] for i in ids]
    steps = []
    while e.has_unfinished():
        e.step()
        steps.append(dict(e.last_step.__dict__))
    m = e.decoder.metrics()
    summary = summarize([sequence_record(s).to_dict() for s in seqs], 1.0, steps)["spec_decode"]
    assert 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert sum(m["accepted_per_pos"]) == m["num_accepted_tokens"]
    assert (summary["num_drafts"], summary["num_draft_tokens"], summary["num_accepted_tokens"],
            summary["accepted_per_pos"]) == (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"],
                                             [n for n in m["accepted_per_pos"] if n] + [0] * 0)
    # every emitted token came from a verify's kept drafts, its own token, or a plain decode
    assert sum(s.num_output_tokens for s in seqs) == 24 * len(seqs)


@pytest.mark.parametrize("overrides, message", [
    (dict(method="medusa"), "decoder.method must be one of ngram, draft, self"),
    (dict(method="draft"), "decoder.method=draft needs decoder.draft_model"),
    (dict(method="self", draft_layers=2), "decoder.draft_layers must be between 1 and 1"),
    (dict(method="self", draft_quant="int3"), "quant 'int3'"),
    (dict(num_speculative_tokens=0), "decoder.num_speculative_tokens must be at least 1"),
])
def test_speculative_config_errors_say_what_to_fix(tiny_dirs, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        engine(tiny_dirs["llama"], SpeculativeDecoderConfig(name="speculative", **overrides))


def test_a_draft_with_another_vocabulary_is_refused(tiny_dirs, tmp_path):
    other = make_tiny_model(tmp_path / "m", "llama", vocab_size=300)
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        engine(tiny_dirs["llama"], spec("draft", draft_model=str(other)))


def test_config_group_composes(tiny_dirs):
    from core.bench.run import default_run_name
    from core.config.compose import compose
    from core.engine.components import engine_config
    from scenarios.workloads import WorkloadConfig

    ec = engine_config(compose(["decoder=speculative", "decoder.method=self", "decoder.num_speculative_tokens=3"]))
    assert (ec.decoder.name, ec.decoder.method, ec.decoder.num_speculative_tokens) == ("speculative", "self", 3)
    dtype = ec.model.dtype  # model.dtype=auto, resolved for this machine's CPU
    assert dtype in ("bf16", "fp32")
    assert default_run_name(ec, WorkloadConfig(name="w"), None) == f"w-continuous-paged-none-torch-speculative-self-{dtype}"
    plain = engine_config(compose([]))
    assert default_run_name(plain, WorkloadConfig(name="w"), None) == f"w-continuous-paged-none-torch-{dtype}"


REAL_PROMPTS = ["Rename add to plus in this code and repeat it:\ndef add(a, b):\n    return a + b\n\nAnswer:\n",
                "The capital of France is", "Count: one, two, three, four, five,", "Water boils at"]


def real_engine(decoder, max_num_seqs, memory_gb=None):
    from core.config import EngineConfig, ModelConfig, SchedulerConfig

    cfg = EngineConfig(model=ModelConfig(dtype="fp32", max_model_len=256),
                       scheduler=SchedulerConfig(name="continuous", max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=128), decoder=decoder)
    if memory_gb is not None:
        cfg.cache = PagedCacheConfig(name="paged", block_size=16, memory_gb=memory_gb)
    return Engine(cfg)


@pytest.fixture(scope="module")
def real_plain(default_gguf):
    """Plain greedy outputs of the embedded model (fp32): the four prompts, and 32 prompts in one
    continuous batch whose KV pool (about 430 tokens for 32 sequences growing to ~30) forces preemptions."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    few = [t[0] for t in tokens(real_engine(DecoderConfig(), 4), REAL_PROMPTS, params)]
    many_prompts = [f"{REAL_PROMPTS[i % 4]} {i}" for i in range(32)]
    many, preempted = stepwise(real_engine(DecoderConfig(), 32, memory_gb=0.02), many_prompts,
                               SamplingParams(max_tokens=16, ignore_eos=True))
    assert preempted > 0
    return few, many_prompts, many


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_real_model_greedy_speculation_gives_the_plain_tokens(default_gguf, real_plain, method):
    """The embedded model in fp32, for every method: at batch 1, and in a continuous batch of 32
    with preemptions, the same greedy tokens as plain decoding; no KV block left behind. `draft`
    takes the GGUF file itself (no second model with this tokenizer can be downloaded here)."""
    few, many_prompts, many = real_plain
    cfg = {"ngram": spec(), "self": spec("self"), "draft": spec("draft", draft_model=str(default_gguf))}[method]
    e = real_engine(cfg, 1)
    alone = [e.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
             for p in REAL_PROMPTS[:2]]
    assert alone == few[:2]
    assert e.decoder.metrics()["num_accepted_tokens"] > 5
    e = real_engine(cfg, 32, memory_gb=0.02)
    got, preempted = stepwise(e, many_prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert got == many and preempted > 0
    assert e.decoder.metrics()["num_draft_tokens"] > 0
    assert no_leak(e)
