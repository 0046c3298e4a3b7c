"""Sampling: filters on constructed logits, seeds, stop conditions."""

import math

import pytest
import torch

from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import RequestError
from plugins.decoders.sampling import apply_top_k_top_p, exponential_race, greedy_tokens
from tests.tiny import tiny_config

NEG = float("-inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmaxs_with_the_first_of_a_tie(dtype):
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, NEG, 0.5]], dtype=dtype)
    assert greedy_tokens(logits).tolist() == [1, 0, 3]
    # bf16 rows over a real vocabulary, ties included (bf16 has few values): fp32's argmax of the same numbers
    wide = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    assert torch.equal(greedy_tokens(wide), wide.float().argmax(dim=-1))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG, NEG]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two tokens
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # p = 0.5 exactly reached by the first token alone
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]
    # a tiny p still keeps the most likely token
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_filters_per_row_and_unsorted_input():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False], [True, True, True]]
    kept = out[0, 1].item()
    assert math.isclose(kept, 2.0)


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(tiny_config(tiny_dirs["llama"], max_num_seqs=8))


def _texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_same_seed_same_output(engine):
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    a = _texts(engine.generate(["hello world"], p))
    b = _texts(engine.generate(["hello world"], p))
    c = _texts(engine.generate(["hello world"], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)))
    assert a == b
    assert a != c
    # a seeded request gives the same tokens when batched with others
    mixed = engine.generate(["other prompt", "hello world", "x"], [SamplingParams(max_tokens=5, temperature=1.0), p,
                                                                    SamplingParams(max_tokens=3)])
    assert mixed[1].outputs[0].token_ids == a[0]


def test_top_k_one_is_greedy(engine):
    greedy = _texts(engine.generate(["abc"], SamplingParams(max_tokens=10, ignore_eos=True)))
    topk1 = _texts(engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True)))
    assert greedy == topk1


def test_n_samples(engine):
    out = engine.generate(["abc"], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_max_tokens_and_length_finish(engine):
    out = engine.generate(["abc"], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(engine):
    ref = engine.generate(["abc"], SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = ref[3]
    out = engine.generate(["abc"], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    first = ref.index(stop_at)
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_stop_string_cuts_the_text(engine):
    full = engine.generate(["abc"], SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0]
    text = full.text
    stop = text[5:7]
    assert stop
    out = engine.generate(["abc"], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_dirs):
    engine = Engine(tiny_config(tiny_dirs["llama"]))
    eos = engine.tokenizer.eos_token_ids[0]
    ref = engine.generate(["abc"], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    # make the model's 3rd greedy token the EOS id by treating it as EOS
    engine.tokenizer.eos_token_ids = [ref[2]]
    out = engine.generate(["abc"], SamplingParams(max_tokens=6))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "stop"
    out = engine.generate(["abc"], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref
    engine.tokenizer.eos_token_ids = [eos]


def test_streamed_deltas_add_up_to_the_text(engine):
    rid = engine.add_request("stream me", SamplingParams(max_tokens=15, ignore_eos=True))
    text, ids, final = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            t, i = out.deltas[0]
            text, ids = text + t, ids + i
            final = out
    assert final.request_id == rid and final.finished
    assert ids == final.outputs[0].token_ids
    assert text == final.outputs[0].text == engine.tokenizer.decode(ids)


@pytest.mark.parametrize("kw, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n must"),
])
def test_bad_sampling_params(kw, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kw)


def test_prompt_too_long_is_rejected(engine):
    with pytest.raises(RequestError, match="max_model_len is 128"):
        engine.add_request(list(range(128)))
    assert not engine.has_unfinished()


def test_exponential_race_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    noise = torch.empty(n, 5).exponential_(generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(exponential_race(probs.expand(n, 5), noise), minlength=5).float()
    sigma = (n * probs * (1 - probs)).sqrt()
    assert counts[4] == 0  # a zero-probability token is never drawn
    assert ((counts - n * probs).abs() <= 4 * sigma + 1e-6).all(), counts.tolist()


def test_unseeded_rows_do_not_disturb_a_seeded_one(engine):
    p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = _texts(engine.generate(["seeded"], p))[0]
    crowd = [SamplingParams(max_tokens=12, temperature=1.3, top_k=5) for _ in range(5)]
    mixed = engine.generate(["a", "seeded", "b", "c", "d", "e"], crowd[:1] + [p] + crowd[1:])
    assert mixed[1].outputs[0].token_ids == alone


def test_a_bf16_models_logits_decode_as_their_fp32_copies():
    """The head's bf16 logits go to the decoder as they are (no fp32 copy of the vocabulary rows): the
    decoder's tokens and logprobs must be those of the same numbers upcast, greedy, seeded and filtered."""
    from core.api import DecoderConfig, ScheduledSeq, Sequence
    from plugins.decoders.sampling import SamplingDecoder

    logits = (torch.randn(6, 4096, generator=torch.Generator().manual_seed(11)) * 3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.2, top_k=20, seed=2), SamplingParams(temperature=0.9, top_p=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4, logprobs=2)]

    def decode(x):
        seqs = [ScheduledSeq(Sequence(f"r{i}", [1, 2], p), 1) for i, p in enumerate(params)]
        out = SamplingDecoder(DecoderConfig(), vocab_size=4096, seed=0).accept(x, seqs)
        return [out.token_ids[s.seq.seq_id] for s in seqs], [out.logprobs.get(s.seq.seq_id) for s in seqs]

    tokens, logprobs = decode(logits)
    tokens32, logprobs32 = decode(logits.float())
    assert tokens == tokens32
    assert logprobs == logprobs32
    assert logprobs[0][0]["top"] and logprobs[5][0]["top"]  # the logprobs rows were computed, not skipped
