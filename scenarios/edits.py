"""The code-editing workload's requests: real code, an edit applied by a rule, the answer copies it.

Each prompt asks to rename the most used identifier in a window of real Python (whole lines of
the standard library's source); the expected answer is the same code with the rename applied, so
almost every output token copies an input token: the case prompt-lookup speculation is made for.
"""

from __future__ import annotations

import collections
import keyword
import re

EDIT_INSTRUCTION = ("Rename `{old}` to `{new}` everywhere in the Python code below. Reply with the whole edited "
                    "code only.\n\n```python\n{code}\n```")
_NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")


def edit_rule(code: str) -> tuple[str, str, str]:
    """The edit a request asks for, applied: its most used identifier (not a keyword or builtin)
    renamed with a `_v2` suffix. Returns (old name, new name, edited code)."""
    import builtins

    skip = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}
    counts = collections.Counter(w for w in _NAME.findall(code) if w not in skip)
    old = counts.most_common(1)[0][0] if counts else "value"
    new = f"{old}_v2"
    return old, new, re.sub(rf"\b{re.escape(old)}\b", new, code)


def edit_request(r, source, tokenizer) -> None:
    """An edit request of about r.prompt_len tokens: whole lines of real code in the instruction,
    as a chat prompt; its output length covers the edited code."""
    overhead = len(tokenizer.encode_chat([{"role": "user", "content": EDIT_INSTRUCTION.format(
        old="name", new="name_v2", code="")}]))
    window = tokenizer.decode(source.prompt(max(16, r.prompt_len - overhead)))
    lines = window.split("\n")
    code = "\n".join(lines[1:-1] if len(lines) > 3 else lines)  # whole lines only
    old, new, edited = edit_rule(code)
    r.prompt_token_ids = tokenizer.encode_chat([{"role": "user",
                                                 "content": EDIT_INSTRUCTION.format(old=old, new=new, code=code)}])
    r.prompt_len = len(r.prompt_token_ids)
    r.output_len = len(tokenizer.encode(edited, add_special_tokens=False)) + 16
