"""Which replica a request should go to so that its prompt's prefix is already in that replica's
prefix cache: the policy behind `parallel.router=prefix`, free of Ray so it is tested on
constructed requests.

A prompt is cut into blocks of `block_chars` characters, each identified by a hash chained over
every block before it (so a block id stands for the whole prefix up to it, as a paged prefix
cache's block hashes do). The index remembers, per block id, which replicas were sent it. A
request's match on a replica is the number of its leading blocks that replica was sent. The
replica with the longest match wins unless it has `max_imbalance` or more ongoing requests than
the least-loaded one (a hot prefix must not pin all traffic to one engine). Otherwise the least
loaded wins, ties to the longer match, then to the replica holding fewer blocks, which spreads
distinct prefixes evenly. This is the cache-aware routing of SGLang's router and of
Ray's PrefixCacheAffinityRouter, kept small.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field


def routing_key(body: object) -> str:
    """The text a request's prefix is read from: a completion's prompt (the first of several;
    token ids as text), or a chat's messages, role and content, in order."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    parts = []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{content or ''}")
    return "".join(parts)


@dataclass
class PrefixAffinity:
    block_chars: int = 256  # about 64 tokens of English text
    max_imbalance: int = 4  # the prefix holder is passed over at this many more ongoing requests than the least loaded
    capacity: int = 100_000  # block ids remembered (least recently used forgotten first)
    _index: OrderedDict = field(default_factory=OrderedDict)  # block id -> {replica: None}
    _held: dict = field(default_factory=dict)  # replica -> blocks remembered for it

    def blocks(self, key: str) -> list[int]:
        ids, prev = [], 0
        for start in range(0, len(key) - self.block_chars + 1, self.block_chars):
            prev = hash((prev, key[start:start + self.block_chars]))
            ids.append(prev)
        return ids

    def rank(self, key: str, load: dict[Hashable, int]) -> list[Hashable]:
        """Every replica of `load` (replica -> ongoing requests), best first."""
        return ranked(*self.choose(key, load))

    def choose(self, key: str, load: dict[Hashable, int]) -> tuple[Hashable | None, list[Hashable]]:
        """(the replica holding the request's prefix if it is not too busy to take it, else None;
        every replica by load, ties to the longer match, then to fewer blocks held)."""
        if not load:
            return None, []
        matches = self.matches(key, list(load))
        by_load = sorted(load, key=lambda r: (load[r], -matches[r], self._held.get(r, 0)))
        best = max(load, key=lambda r: (matches[r], -load[r]))
        if matches[best] > 0 and load[best] - load[by_load[0]] < self.max_imbalance:
            return best, by_load
        return None, by_load

    def matches(self, key: str, replicas: list[Hashable]) -> dict[Hashable, int]:
        """Per replica, the leading blocks of `key` it was sent."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for b in self.blocks(key):
            holders = alive & self._index.get(b, {}).keys()
            if not holders:
                break
            for r in holders:
                out[r] += 1
            alive = holders
        return out

    def record(self, key: str, replica: Hashable) -> None:
        """`replica` was sent `key`: its blocks are (or will shortly be) in that replica's cache."""
        for b in self.blocks(key):
            holders = self._index.pop(b, None)
            if holders is None:
                holders = {}
            if replica not in holders:
                holders[replica] = None
                self._held[replica] = self._held.get(replica, 0) + 1
            self._index[b] = holders  # most recently used last
        while len(self._index) > self.capacity:
            _, old = self._index.popitem(last=False)
            for r in old:
                self._held[r] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica that died or was removed: its cache went with it."""
        for b in [b for b, holders in self._index.items() if replica in holders]:
            del self._index[b][replica]
            if not self._index[b]:
                del self._index[b]
        self._held.pop(replica, None)


def ranked(holder: Hashable | None, by_load: list[Hashable]) -> list[Hashable]:
    """The holder first (if any), then the rest by load."""
    return [holder] + [r for r in by_load if r != holder] if holder is not None else by_load
