"""BlockPool: ref-counted block ids and a free list (plain Python: the tensors that hold K/V live in the model
runner; here a block is only an id)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns block ids 0..num_blocks-1. A block is in use while its ref count is above 0 (one count per request
    holding it). At 0 it is free, unless the prefix cache holds it: then it stays out of the free list, reusable by
    a later request with the same prefix, until the cache evicts it (`uncache`)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these cached blocks (a prefix-cache hit)."""
        for b in blocks:
            assert self.cached[b], f"block {b} shared but not cached"
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; uncached blocks reaching 0 go back to the free list (tail-first,
        so the blocks at the end of a sequence are reused first)."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released while free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0 and not self.cached[b]:
                self._free.append(b)

    def mark_cached(self, blocks: list[int]) -> None:
        for b in blocks:
            self.cached[b] = True

    def uncache(self, blocks: list[int]) -> None:
        """Blocks the prefix cache evicted: unreferenced, so they are free now."""
        for b in blocks:
            assert self.cached[b] and self.ref_counts[b] == 0, f"evicted block {b} is in use"
            self.cached[b] = False
            self._free.append(b)

    def num_held_blocks(self) -> int:
        """Blocks some request references or that are neither free nor cached: with no request in flight, each
        is a leak (O(blocks): asked when the engine goes idle, not every step)."""
        free = set(self._free)
        return sum(1 for b in range(self.num_blocks) if self.ref_counts[b] > 0 or not (self.cached[b] or b in free))

    def check_whole(self) -> None:
        """Invariant when idle: every block free or cached, none counted twice, no references left."""
        cached = [b for b in range(self.num_blocks) if self.cached[b]]
        assert len(self._free) == len(set(self._free)), "a block listed free twice"
        assert not set(self._free) & set(cached), "a block both free and cached"
        assert len(self._free) + len(cached) == self.num_blocks, (
            f"{self.num_blocks - len(self._free) - len(cached)} blocks leaked")
        assert not any(self.ref_counts), "references left with nothing running"
