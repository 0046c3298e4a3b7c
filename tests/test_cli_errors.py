"""User mistakes get one clear line on stderr, exit status 2, no traceback, nothing left running."""

import subprocess
import sys

import pytest


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "core", *args], capture_output=True, text=True, timeout=timeout)


def _one_clear_line(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("override, needles", [
    ("scheduler=nope", ["scheduler", "'nope'", "static"]),
    ("cache.name=nope", ["cache", "'nope'", "contiguous"]),
    ("quant=nope", ["quant", "'nope'", "none"]),
])
def test_unknown_component(override, needles, tiny_llama):
    _one_clear_line(run_cli("generate", "--prompt", "hi", override, f"model.path={tiny_llama}"), *needles)


def test_missing_model_file():
    _one_clear_line(run_cli("generate", "--prompt", "hi", "model.path=/no/such/model.gguf"), "/no/such/model.gguf")


def test_prompt_longer_than_max_model_len(tiny_llama):
    r = run_cli("generate", "--prompt", "x" * 40, f"model.path={tiny_llama}", "model.max_model_len=16")
    _one_clear_line(r, "40 tokens", "max_model_len is 16")


@pytest.mark.parametrize("flags, needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
])
def test_bad_sampling_flags(flags, needle, tiny_llama):
    _one_clear_line(run_cli("generate", "--prompt", "hi", *flags, f"model.path={tiny_llama}"), needle)


def test_bad_override_gets_hydras_message():
    _one_clear_line(run_cli("plugins", "no_such_key=1"), "no_such_key")
    _one_clear_line(run_cli("plugins", "model.max_model_len=abc"), "max_model_len")
    _one_clear_line(run_cli("plugins", "scheduler=="), "scheduler")


def test_overrides_may_follow_flags():
    from core.cli import main

    # `run.name=...` after `-v` is an override, not a stray argument: the run fails on the variant's bad key
    assert main(["compare", "workload=fixed", "-v", "no_such_key=1", "run.name=x"]) == 2
    r = run_cli("plugins", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


@pytest.mark.parametrize("args, needles", [
    (["serve", "server.port=99999"], ["server.port must be in 1..65535, got 99999"]),
    (["serve", "server.fallback=nope"], ["server.fallback='nope' names no server.models entry"]),
    (["serve", "server.max_queue=0"], ["server.max_queue must be at least 1"]),
    (["serve", "server.shed=true"], ["server.shed=true needs a scheduler that predicts TTFT", "'continuous'"]),
    (["serve", "server.pool_slo={nope:{ttft_s:1}}"], ["server.pool_slo.nope names no pool"]),
    (["serve", "server.pool_slo={chat:{ttft:1}}"], ["server.pool_slo.chat must map ttft_s and/or tpot_s"]),
    (["run", "run.shed=true"], ["run.shed=true needs a scheduler that predicts TTFT"]),
    (["run", "scheduler=slo", "scheduler.tpot_target_s=0"], ["scheduler.tpot_target_s must be positive"]),
    (["run", "workload=nope"], ["workload", "chat_longtail, code_edit, code_longtail, decode_heavy, fixed, long_context, "
                                "shared_prefix, trace, uniform"]),
    (["run", "model.max_model_len=1"], ["model.max_model_len must be at least 2", "got 1"]),
    (["run", "workload.num_requests=0"], ["workload.num_requests must be positive, got 0"]),
    (["run", "workload.arrival=sometimes"], ["workload.arrival", "'sometimes'"]),
    (["bench", "server.port=0"], ["server.port must be in 1..65535, got 0"]),
    (["run", "model.load_format=npz"], ["model.load_format must be auto or dummy, got 'npz'"]),
    (["run", "model.device=tpu"], ["model.device", "'tpu'"]),
])
def test_bad_command_line_values_fail_before_any_model_loads(args, needles):
    r = run_cli(*args, "run.progress=false", timeout=60)
    _one_clear_line(r, *needles)
    assert "KV:" not in r.stdout + r.stderr  # no engine was built (its pool is logged at start-up)


def test_compare_checks_every_variant_before_running_the_first(tiny_llama, tmp_path):
    r = run_cli("compare", f"model.path={tiny_llama}", "workload=fixed", f"run.report_dir={tmp_path}",
                "-v", "scheduler=static", "-v", "scheduler=continuous scheduler.agin_steps=3")
    _one_clear_line(r, "unknown key 'agin_steps'")
    assert "[1/2]" not in r.stdout


def test_a_tiny_max_model_len_runs(tiny_llama, tmp_path):
    r = run_cli("run", f"model.path={tiny_llama}", "model.max_model_len=10", "workload=fixed",
                "workload.num_requests=3", f"run.report_dir={tmp_path}", "run.progress=false", "run.plots=false")
    assert r.returncode == 0, r.stderr[-2000:]
