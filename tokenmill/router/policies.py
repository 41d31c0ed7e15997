"""Which replica gets a request (`--policy`), chosen among the healthy ones not yet tried for it. The prompt is given
as text or as its block names (prefix_index.block_names, computed once per request, off the event loop when large).

- round_robin: in turn.
- least_load: the fewest requests in flight (plus the replica's own waiting queue when it publishes one).
- prefix: the replica that was sent the longest prefix of this prompt (its KV cache most likely still holds it),
  unless the loads are out of balance (the busiest has more than BALANCE_ABS requests more than the idlest and more
  than BALANCE_REL times its load: SGLang's rule), or no replica matches MIN_MATCH_CHARS: then least load. The
  chosen replica is recorded as holding the prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tokenmill.router.prefix_index import BLOCK_CHARS, PrefixIndex
from tokenmill.router.replicas import Replica

POLICIES = ("round_robin", "least_load", "prefix")
BALANCE_ABS = 8
BALANCE_REL = 1.5
MIN_MATCH_CHARS = BLOCK_CHARS


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Replica], prompt: str | Sequence[bytes]) -> Replica:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoad:
    def choose(self, candidates: list[Replica], prompt: str | Sequence[bytes]) -> Replica:
        return min(candidates, key=lambda b: (b.load, b.requests))


class PrefixAware:
    def __init__(self, index: PrefixIndex | None = None):
        self.index = index or PrefixIndex()
        self._least = LeastLoad()

    def choose(self, candidates: list[Replica], prompt: str | Sequence[bytes]) -> Replica:
        loads = [b.load for b in candidates]
        balanced = not (max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads))
        chosen = None
        if balanced and prompt:
            matched = self.index.match(prompt)
            best = max(candidates, key=lambda b: (matched.get(b.url, 0), -b.load))
            if matched.get(best.url, 0) >= MIN_MATCH_CHARS:
                chosen = best
        chosen = chosen or self._least.choose(candidates, prompt)
        if prompt:
            self.index.insert(prompt, chosen.url)
        return chosen


def reads_prompt(*policies: Any) -> bool:
    """Whether any of these policies places a request by its prompt (else the body need not be parsed at all)."""
    return any(getattr(p, "index", None) is not None for p in policies)


def make_policy(name: str) -> RoundRobin | LeastLoad | PrefixAware:
    if name not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix": PrefixAware}[name]()
