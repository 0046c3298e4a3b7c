"""The workload generator: length samples follow their tables, traces round-trip, prompts are exact."""

import numpy as np
import pytest

from core.errors import ConfigError
from scenarios.traces import read_trace, write_trace
from scenarios.workloads import (
    WorkloadConfig,
    arrival_times,
    build_workload,
    ks_distance,
    load_table,
    materialize,
    sample_quantiles,
    table_cdf,
)

TABLES = ["azure_conv_2023", "azure_code_2023", "mooncake_conversation"]


@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("field", ["prompt_tokens", "output_tokens"])
def test_samples_match_their_quantile_table(name, field):
    table = load_table(name)[field]
    assert len(table["probs"]) >= 100 and table["probs"][0] == 0.0 and table["probs"][-1] == 1.0
    assert ks_distance(table, sample_quantiles(table, 5000, np.random.default_rng(1))) < 0.05


def test_ks_distance_sees_a_wrong_distribution():
    table = load_table("azure_conv_2023")["prompt_tokens"]
    shifted = sample_quantiles(table, 5000, np.random.default_rng(1)) * 1.3
    assert ks_distance(table, shifted) > 0.1
    cdf = table_cdf(table, np.array([table["values"][0] - 1, table["values"][-1] + 1]))
    assert cdf.tolist() == [0.0, 1.0]


def test_tables_carry_citation_and_licence():
    for name in TABLES:
        t = load_table(name)
        assert t["citation"] and "licence" in t and t["source"]


def test_chat_workload_is_rescaled_and_fits():
    wl = build_workload(WorkloadConfig(table="azure_conv_2023", num_requests=500), max_model_len=2048)
    assert 0 < wl.scale < 1
    assert all(r.prompt_len + r.output_len <= 2048 and r.prompt_len >= 1 and r.output_len >= 1 for r in wl.requests)
    d = wl.describe()
    # the shape is kept: the median prompt scales with the table's (1020 tokens in the trace)
    assert d["prompt_tokens"]["p50"] == pytest.approx(1020 * wl.scale, rel=0.15)
    assert "Azure" in " ".join(d["notes"])


def test_same_seed_same_workload():
    a = build_workload(WorkloadConfig(table="azure_code_2023", num_requests=50, seed=3), 2048)
    b = build_workload(WorkloadConfig(table="azure_code_2023", num_requests=50, seed=3), 2048)
    assert [(r.prompt_len, r.output_len) for r in a.requests] == [(r.prompt_len, r.output_len) for r in b.requests]


def test_arrival_processes():
    rng = np.random.default_rng(0)
    t = arrival_times(WorkloadConfig(arrival="poisson", rate=10.0), 4000, rng)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert 4000 / t[-1] == pytest.approx(10.0, rel=0.1)
    gaps = np.diff(arrival_times(WorkloadConfig(arrival="gamma", rate=10.0, burstiness=4.0), 20000, rng))
    assert gaps.std() / gaps.mean() == pytest.approx(4.0, rel=0.2)
    assert np.all(arrival_times(WorkloadConfig(arrival="all_at_once"), 5, rng) == 0)
    with pytest.raises(ConfigError, match="arrival"):
        arrival_times(WorkloadConfig(arrival="sometimes"), 5, rng)


@pytest.mark.parametrize("fmt", ["azure", "mooncake"])
def test_trace_round_trips(tmp_path, fmt):
    rows = [{"t": 0.0, "prompt": 100, "output": 7, "hash_ids": [0, 1] if fmt == "mooncake" else None},
            {"t": 0.25, "prompt": 900, "output": 30, "hash_ids": [0, 2] if fmt == "mooncake" else None},
            {"t": 1.5, "prompt": 40, "output": 1, "hash_ids": [3] if fmt == "mooncake" else None}]
    path = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
    write_trace(path, rows, fmt)
    back = read_trace(path)  # format detected from the file
    assert [(r["prompt"], r["output"], r["hash_ids"]) for r in back] == [(r["prompt"], r["output"], r["hash_ids"]) for r in rows]
    assert [r["t"] for r in back] == pytest.approx([r["t"] for r in rows], abs=1e-3)
    cfg = WorkloadConfig(kind="trace", path=str(path), arrival="trace", time_scale=2.0, num_requests=2,
                         length_scale=1.0)
    wl = build_workload(cfg, max_model_len=4096)
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(100, 7), (900, 30)]
    assert [r.arrival_s for r in wl.requests] == pytest.approx([0.0, 0.5], abs=1e-3)


def test_mooncake_hash_ids_become_identical_blocks(tmp_path):
    from core.model.tokenizer import Tokenizer
    from tests.tiny import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path, {})
    rows = [{"t": 0.0, "prompt": 20, "output": 2, "hash_ids": [7, 8]},
            {"t": 0.1, "prompt": 15, "output": 2, "hash_ids": [7, 9]}]
    path = tmp_path / "m.jsonl"
    write_trace(path, rows, "mooncake")
    wl = build_workload(WorkloadConfig(kind="trace", path=str(path), arrival="trace", length_scale=1.0,
                                       block_tokens=10), 4096)
    materialize(wl, tok)
    a, b = (r.prompt_token_ids for r in wl.requests)
    assert len(a) == 20 and len(b) == 15
    assert a[:10] == b[:10] and a[10:20] != b[10:15] + a[15:20]


def test_materialize_gives_exact_lengths_and_shared_prefixes(tmp_path):
    from core.model.tokenizer import Tokenizer
    from tests.tiny import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path, {})
    wl = build_workload(WorkloadConfig(kind="shared_prefix", num_requests=12, num_prefixes=2, prefix_len=64,
                                       suffix_len_min=5, suffix_len_max=9, output_len=4), 512)
    materialize(wl, tok)
    for r in wl.requests:
        assert len(r.prompt_token_ids) == r.prompt_len
    by_prefix = {}
    for r in wl.requests:
        by_prefix.setdefault(r.prefix_id, set()).add(tuple(r.prompt_token_ids[:64]))
    assert all(len(v) == 1 for v in by_prefix.values())
    text = "".join(tok.decode(r.prompt_token_ids) for r in wl.requests)
    assert sum(c.isalpha() for c in text) > len(text) / 3  # real prose, not noise


def test_errors_name_the_value():
    with pytest.raises(ConfigError, match="unknown length table 'nope'"):
        build_workload(WorkloadConfig(table="nope"), 2048)
    with pytest.raises(ConfigError, match="workload.path"):
        build_workload(WorkloadConfig(kind="trace"), 2048)
    with pytest.raises(ConfigError, match="workload.kind"):
        build_workload(WorkloadConfig(kind="mystery"), 2048)


def test_the_edit_rule_renames_the_most_used_identifier():
    from scenarios.edits import edit_rule

    code = "def area(width, height):\n    total = width * height\n    return total + width\n"
    assert edit_rule(code) == ("width", "width_v2",
                               "def area(width_v2, height):\n    total = width_v2 * height\n    return total + width_v2\n")


def test_an_edit_request_quotes_real_code_and_expects_it_back(default_gguf):
    from core.model.loader import load_tokenizer
    from scenarios.edits import edit_rule
    from scenarios.workloads import WorkloadConfig, build_workload, materialize

    tok = load_tokenizer(default_gguf)
    cfg = WorkloadConfig(name="code_edit", kind="edit", text="code", num_requests=4, prompt_len_min=100,
                         prompt_len_max=200)
    w = build_workload(cfg, 2048)
    materialize(w, tok)
    for r in w.requests:
        text = tok.decode(r.prompt_token_ids)
        code = text.split("```python\n", 1)[1].split("\n```", 1)[0]
        old, new, edited = edit_rule(code)
        assert f"Rename `{old}` to `{new}`" in text
        assert r.prompt_len == len(r.prompt_token_ids) and abs(r.prompt_len - 150) <= 60
        assert r.output_len == len(tok.encode(edited, add_special_tokens=False)) + 16
