"""Stop strings while streaming, on the real tokenizer: what is streamed is exactly the final text,
and no stop string ever appears in it, whatever the stop strings and however tokens arrive."""

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.engine.output import OutputProcessor, stop_prefix_holdback
from core.engine.types import SamplingParams, Sequence, SequenceStatus

WORDS = ["The", " capital", " of", " France", " is", " Paris", ".", " def", " f", "(x):", " return", " x", " +", " 1",
         "\n", " END", "###", " stop", " ", "ing", " café", " naïve", "!!", " 42", " the", " end"]


@functools.lru_cache(maxsize=1)
def tokenizer():
    from core.model.default_model import default_model_path
    from core.model.loader import load_tokenizer

    return load_tokenizer(default_model_path())


def stream(text_ids: list[int], stops: list[str], splits: list[int]):
    """Feed `text_ids` a few tokens a step, as the engine does; returns (streamed text, final output)."""
    tok = tokenizer()
    seq = Sequence("r", [1, 2, 3], SamplingParams(stop=stops, max_tokens=len(text_ids), ignore_eos=True))
    seq.status = SequenceStatus.RUNNING
    op = OutputProcessor(tok)
    op.add("r", None, [1, 2, 3], [seq])
    state = op.requests["r"]
    streamed, i, step = "", 0, 0
    while i < len(text_ids) and not seq.is_finished:
        k = splits[step % len(splits)]
        chunk, i, step = text_ids[i:i + k], i + k, step + 1
        seq.output_token_ids.extend(chunk)
        if i >= len(text_ids):
            seq.status = SequenceStatus.FINISHED_LENGTH  # what the scheduler does at max_tokens
        _, hits = op.process([(seq, chunk)])
        for _, stop, extra in hits:  # what the scheduler's finish does, dropping the tokens after the stop
            if extra:
                del seq.output_token_ids[-extra:]
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        out = op.output(state)
        streamed += out.deltas.get(0, ("", []))[0]
    return streamed, out.outputs[0], seq


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=30), data=st.data(),
       splits=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_streamed_text_is_the_final_text_and_holds_no_stop_string(words, data, splits):
    text = "".join(words)
    ids = tokenizer().encode(text, add_special_tokens=False)
    full = tokenizer().decode(ids)
    # stop strings: pieces of the text itself (so they do occur, across token boundaries) and strangers
    pieces = st.builds(lambda a, n: full[a:a + n], st.integers(0, max(0, len(full) - 1)), st.integers(1, 6))
    stops = [s for s in data.draw(st.lists(st.one_of(pieces, st.sampled_from(["zz", "END", "\n\n", "!!!"])),
                                           min_size=1, max_size=3)) if s]
    if not stops:
        stops = ["zz"]
    streamed, final, seq = stream(ids, stops, splits)
    assert streamed == final.text
    assert not any(s in final.text for s in stops)
    assert full.startswith(final.text)
    if seq.status is SequenceStatus.FINISHED_STOPPED:  # cut exactly where the stop string begins
        assert full[len(final.text):].startswith(seq.stop_reason)
    else:
        assert final.text == full and not any(s in full for s in stops)


def test_holdback_is_the_longest_end_that_could_begin_a_stop_string():
    assert stop_prefix_holdback("hello wor", ["world"]) == 3
    assert stop_prefix_holdback("hello", ["world"]) == 0
    assert stop_prefix_holdback("ab#", ["##", "#x"]) == 1
    assert stop_prefix_holdback("a<|im", ["<|im_end|>", "m"]) == 4
    assert stop_prefix_holdback("x", []) == 0


def test_a_stop_string_across_tokens_is_never_streamed_in_part():
    tok = tokenizer()
    ids = tok.encode("The answer is Paris. Then", add_special_tokens=False)
    streamed, final, seq = stream(ids, [" Paris."], [1])
    assert streamed == final.text == "The answer is" and seq.stop_reason == " Paris."
