"""Building the C++ CPU kernels under servelab_kernels/csrc with torch's cpp_extension, once per machine.

Each build is cached under ~/.cache/torch_extensions/servelab-pyXY (or $TORCH_EXTENSIONS_DIR),
keyed by its source, the CPU's flags and the torch version, so a new CPU kind (or
`-DSERVELAB_PORTABLE`, the build machines without AVX-512 get, which the tests also load) compiles
its own copy. A build that fails (no compiler, no Python headers) is remembered and logged once;
callers then fall back to their torch twins. `SERVELAB_NO_CPP=1` turns every C++ kernel off;
`SERVELAB_CPP_MARCH=znver3` (any gcc -march) builds for another CPU than this one, e.g. to run the
AVX2 paths' tests on an AVX-512 machine.

Processes that need the same build at once (a server's tensor-parallel ranks, test subprocesses)
take turns on an advisory lock, which the kernel drops when its holder dies. torch's own lock is a
file that a build killed mid-way (SIGKILL, a subprocess timeout) leaves behind, and every later
build of that name then waits on it forever; under our lock no live build can own it, so it is
removed, with the half-built directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger("servelab")

CSRC = Path(__file__).parent / "csrc"
_built: dict[tuple[str, bool], object] = {}
_failed: set[str] = set()


@functools.cache
def cpu_flags() -> str:
    """/proc/cpuinfo's feature line (x86 `flags`, Arm `Features`) as it reads, part of a build's key;
    the processor's name where there is none."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_features() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty if unreadable."""
    line = cpu_flags()
    return set(line.split(":", 1)[1].split()) if line.startswith(("flags", "Features")) else set()


def has_amx() -> bool:
    """Whether the CPU has AMX tiles for bf16 (oneDNN's GEMMs, and so SDPA's, run on them)."""
    return "amx_bf16" in cpu_features()


def build(stem: str, portable: bool = False, functions: list[str] | None = None, fast_math: bool = True,
          parts: tuple[str, ...] = (), prelude: tuple[str, ...] = ()):
    """csrc/STEM.cpp (after csrc/NAME.cpp for each of `prelude`, then csrc/PART.cpp for each of
    `parts`, as one translation unit) compiled and loaded, or None if it cannot build. With `functions` it is a
    Python module exposing them; without, a library registering torch ops (its namespace is the
    `SERVELAB_NS` macro, which the caller reads back from `namespace(...)`). `fast_math=False` for
    code whose float rounding must match its torch twin's exactly (no fast-math, and no a * b + c
    contracted into one fused multiply-add, which rounds once where torch rounds twice)."""
    key_id = (stem, portable)
    if key_id in _built or stem in _failed or os.environ.get("SERVELAB_NO_CPP") == "1":
        return _built.get(key_id)
    from torch.utils.cpp_extension import load_inline

    source = "\n".join((CSRC / f"{name}.cpp").read_text() for name in (*prelude, stem, *parts))
    exact = "" if fast_math else "exact-nocontract"
    march = os.environ.get("SERVELAB_CPP_MARCH") or "native"
    ident = source + cpu_flags() + torch.__version__ + str(portable) + exact + march
    key = hashlib.sha1(ident.encode()).hexdigest()[:12]
    name = f"servelab_{stem}_{key}"
    flags = ["-O3", f"-march={march}", "-fopenmp", f"-DSERVELAB_NS={namespace(stem, portable)}"]
    flags += ["-ffast-math"] if fast_math else ["-ffp-contract=off"]
    try:
        with build_directory(name) as where:
            module = load_inline(name=name, cpp_sources=[source], functions=functions,
                                 extra_cflags=flags + (["-DSERVELAB_PORTABLE"] if portable else []),
                                 extra_ldflags=["-fopenmp"], verbose=False, is_python_module=functions is not None,
                                 build_directory=str(where))
        _built[key_id] = module if functions is not None else namespace(stem, portable)
    except Exception as e:  # no compiler, no headers: the torch twin serves
        _failed.add(stem)
        log.warning("the C++ kernels of %s did not build (%s); using the torch reference", stem,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _built.get(key_id)


def build_root() -> Path:
    """Where the builds live: torch's extensions root (honouring $TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"servelab-py{sys.version_info.major}{sys.version_info.minor}"  # one ABI a folder


@contextlib.contextmanager
def build_directory(name: str):
    """The build's directory, held under an exclusive lock for as long as the build (or its load)
    runs, with a stale torch lock file cleared first (see the module docstring)."""
    where = build_root() / name
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{name}.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # blocks while another process builds; released if it dies
        try:
            if (where / "lock").exists():
                log.warning("a killed build of %s left %s behind; building it again", name, where)
                shutil.rmtree(where, ignore_errors=True)
            where.mkdir(exist_ok=True)
            yield where
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def namespace(stem: str, portable: bool) -> str:
    """The torch.ops namespace of a library build (one per build, as both may be loaded at once)."""
    return f"servelab_{stem}{'_portable' if portable else ''}"
