import os

import torch

# The Triton kernels run on the CPU only in Triton's interpreter, which must be chosen before
# triton is first imported (its @triton.jit decorators read it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

import pytest

from tests.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random model directory per supported architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "llama3", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def default_gguf():
    from core.model.default_model import default_model_path

    return default_model_path()


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "servelab-plugin-example"


@pytest.fixture(scope="session")
def example_plugin():
    """The example third-party package, imported from its source folder (not installed)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import servelab_plugin_example

        yield servelab_plugin_example
    finally:
        sys.path.remove(str(EXAMPLE))


def pytest_sessionstart(session):
    """The C++ kernels built (or loaded from the cache) before any test runs, so that no test's
    subprocess (a CLI run under a timeout, a server, a tensor-parallel rank) compiles them on its
    own clock: on a slow machine three builds take minutes."""
    from servelab_kernels import cpu_attention, cpu_decode, cpu_ops, cpu_quant

    cpu_ops.load()
    cpu_attention.load()
    cpu_quant.ops()
    cpu_decode.load()


def _has_amx() -> bool:
    from servelab_kernels import cpu_quant

    return cpu_quant.amx_ready()


def _has_int_gemm() -> bool:
    from servelab_kernels import cpu_quant

    return cpu_quant.int_gemm_built()


def _has_amx_bf16() -> bool:
    from servelab_kernels import cpu_attention

    return cpu_attention.amx_decode_ready()


def _has_madd_gemm() -> bool:
    from servelab_kernels import int8_pack

    return int8_pack.layout() == "madd"


def _has_avx2_decode() -> bool:
    from servelab_kernels import cpu_attention

    return cpu_attention.avx2_decode_built()


# marker -> (whether this machine has the hardware, what a machine without it lacks)
HARDWARE = {"cuda": (torch.cuda.is_available, "this machine has no CUDA device"),
            "amx": (_has_amx, "this CPU has no AMX-INT8 tiles"),
            "vnni": (_has_int_gemm, "this CPU has no AVX512-VNNI (no q8_gemm_int or q4_gemm_int in its build)"),
            "amx_bf16": (_has_amx_bf16, "this CPU has no AMX-BF16 tiles"),
            "avx2": (_has_avx2_decode, "this CPU is not x86 with AVX2 + FMA and without AVX-512, where the AVX2 "
                                       "decode and prefill kernels are built (AVX-512 CPUs run their own)"),
            "madd": (_has_madd_gemm, "this CPU's INT8 build is not AVX2 without AVX512-VNNI, where the vpmaddwd GEMM "
                                     "over a packed copy (q8_gemm_madd) is built (VNNI CPUs run their own)")}


def pytest_collection_modifyitems(config, items):
    """Tests of hardware this machine lacks (CUDA, AMX) are deselected, not skipped: a skip must mean
    a broken install (see pytest_sessionfinish), and this is no install's fault."""
    config._servelab_deselected = {}
    for marker, (present, _) in HARDWARE.items():
        if present():
            continue
        lacking = [item for item in items if item.get_closest_marker(marker)]
        if lacking:
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
            config.hook.pytest_deselected(items=lacking)
            config._servelab_deselected[marker] = len(lacking)


def pytest_report_collectionfinish(config):
    return [f"{n} {marker.upper()}-only tests deselected: {HARDWARE[marker][1]}"
            for marker, n in getattr(config, "_servelab_deselected", {}).items()]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """A skip exits 0 and hides a missing dependency: every dependency is declared, so any skip fails the run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and exitstatus == 0:
        reporter.write_line(f"error: {len(skipped)} tests were skipped; every dependency is declared, so a skip "
                            "means a broken install:", red=True)
        for rep in skipped:
            reporter.write_line(f"  {rep.nodeid}: {rep.longrepr[-1] if isinstance(rep.longrepr, tuple) else rep.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
