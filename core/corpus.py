"""Real text, available offline on every CPython: for workload prompts and calibration data.

Prose: the Python reference documentation shipped in `pydoc_data.topics` (~465 KB of English).
Code: Python standard-library source files. Prompts are windows of the tokenized corpus, so a
prompt of N tokens is exactly N tokens of real text.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from pathlib import Path

CODE_MODULES = ("argparse.py", "json/decoder.py", "collections/__init__.py", "dataclasses.py", "functools.py",
                "inspect.py", "pathlib.py", "typing.py", "textwrap.py", "heapq.py")


def prose_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def code_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((stdlib / m).read_text(encoding="utf-8") for m in CODE_MODULES if (stdlib / m).exists())


@functools.lru_cache(maxsize=8)
def _corpus_ids(tokenizer, kind: str) -> tuple[int, ...]:
    text = code_text() if kind == "code" else prose_text()
    return tuple(tokenizer.encode(text, add_special_tokens=False))


class PromptSource:
    """Prompts of exact token lengths cut from a real corpus, reproducibly from a seed."""

    def __init__(self, tokenizer, kind: str = "prose", seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.ids = _corpus_ids(tokenizer, kind)
        self.rng = random.Random(seed)

    def prompt(self, num_tokens: int) -> list[int]:
        n = len(self.ids)
        if num_tokens <= n:
            start = self.rng.randrange(0, n - num_tokens + 1)
            return list(self.ids[start : start + num_tokens])
        reps = -(-num_tokens // n)  # longer than the corpus: wrap around
        return list((self.ids * reps)[:num_tokens])
