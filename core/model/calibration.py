"""Calibration prompts for activation-aware quantizers: windows of real text, reproducibly.

Three quarters prose (Python's reference docs), one quarter code (stdlib source), both on every
CPython, so calibration needs no download.
"""

from __future__ import annotations

from core.corpus import PromptSource


def calibration_prompts(tokenizer, num_prompts: int, length: int, seed: int = 1234) -> list[list[int]]:
    prose = PromptSource(tokenizer, "prose", seed=seed)
    code = PromptSource(tokenizer, "code", seed=seed)
    n_code = num_prompts // 4
    return [prose.prompt(length) for _ in range(num_prompts - n_code)] + [code.prompt(length) for _ in range(n_code)]
