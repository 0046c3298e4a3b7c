"""The C++ build cache: processes take turns on a lock the kernel frees, and a build killed mid-way
(which leaves torch's lock file behind) does not make every later build wait forever."""

import fcntl
import logging
import os
import signal
import subprocess
import sys

import pytest

from servelab_kernels import cpp_build


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return cpp_build.build_root()


def test_the_root_follows_torch_extensions_dir(root, tmp_path):
    assert root.parent == tmp_path and root.name == f"servelab-py{sys.version_info.major}{sys.version_info.minor}"


def test_the_lock_is_held_while_inside_and_free_after(root):
    with cpp_build.build_directory("k") as where:
        assert where == root / "k" and where.is_dir()
        with open(root / "k.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second process would block here
    with open(root / "k.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_build_killed_mid_way_is_cleared_not_waited_on(root, caplog):
    """A child takes the lock, starts a 'build' (torch's lock file and a half-written object) and
    is killed; the lock is free again at once and the next build starts from an empty directory."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from servelab_kernels import cpp_build\n"
        "with cpp_build.build_directory('k') as where:\n"
        "    (where / 'lock').touch(); (where / 'half.o').write_bytes(b'x')\n"
        "    print('building', flush=True)\n"
        "    time.sleep(3600)\n")], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert child.stdout.readline().strip() == "building"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (root / "k" / "lock").exists()  # what torch's own lock would wait on forever
    with caplog.at_level(logging.WARNING, logger="servelab"), cpp_build.build_directory("k") as where:
        assert list(where.iterdir()) == []
    assert "a killed build of k" in caplog.text


def test_a_finished_build_is_kept(root):
    with cpp_build.build_directory("k") as where:
        (where / "k.so").write_bytes(b"built")
    with cpp_build.build_directory("k") as where:
        assert (where / "k.so").read_bytes() == b"built"
