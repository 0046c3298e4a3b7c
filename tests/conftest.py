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
