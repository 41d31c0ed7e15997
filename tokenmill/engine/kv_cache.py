"""BlockPool (ref-counted block ids, a free list) and KVCacheManager (which blocks each request holds).

Plain Python: the tensors that hold K/V live in the model runner; here a block is only an id.
"""

from __future__ import annotations

from collections import deque

from tokenmill.request import Request


class BlockPool:
    """Owns block ids 0..num_blocks-1. A block is free exactly when its ref count is 0."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
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

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go back to the free list (tail-first, so
        the blocks at the end of a sequence are reused first)."""
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} released while free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_whole(self) -> None:
        """Invariant when idle: every block free, none counted twice."""
        assert len(self._free) == len(set(self._free)) == self.num_blocks, (
            f"{self.num_blocks - len(set(self._free))} blocks leaked or double-listed")
        assert not any(self.ref_counts)


class KVCacheManager:
    """Gives each request the blocks its tokens need, one block at a time, and takes them back through
    `free`, the only way blocks return (finish, abort, preemption, error)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and nothing changed) if the pool is short."""
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Idempotent: a second call finds no blocks and does nothing."""
        blocks, request.block_ids = request.block_ids, []
        if blocks:
            self.pool.release(blocks)
