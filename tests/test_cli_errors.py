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
