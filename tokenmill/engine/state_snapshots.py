"""StateSnapshots: copies of a hybrid model's per-request state taken at block boundaries, so a cached prefix can
bring its recurrent state along (plain Python: a snapshot is a row id of the runner's state tensors, after the
running requests' slots).

A snapshot holds the state after the tokens up to the end of one cached block, and belongs to that block: the radix
tree's block id names one prefix in one namespace, so a prefix hit on a hybrid model ends at the deepest block of the
match that has a snapshot, and the request's slot starts from it. A request asks for a row when a step of it ends at
a block boundary (`take`); the runner copies the slot into the row after the step; the row joins the block once the
block is cached (`attach`), or goes back (`give_back`). Snapshots leave with their blocks (`forget`), and when
every row is in use the least recently used one not about to be read is taken over.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_row: int, num_rows: int):
        self.first_row, self.num_rows = first_row, num_rows
        self._free = list(range(first_row + num_rows - 1, first_row - 1, -1))
        self._by_block: OrderedDict[int, int] = OrderedDict()  # cached block -> its snapshot's row, LRU first
        self._reading: dict[int, int] = {}  # row -> requests about to load it (never taken over)
        self.taken_over = 0  # snapshots dropped to make room (a hit they would have given is lost)

    def row_of(self, block: int) -> int | None:
        return self._by_block.get(block)

    def take(self) -> int | None:
        """A row for a new snapshot: a free one, else the least recently used snapshot's (None: every row is being
        read or written)."""
        if self._free:
            return self._free.pop()
        for block, row in self._by_block.items():
            if row not in self._reading:
                del self._by_block[block]
                self.taken_over += 1
                return row
        return None

    def attach(self, block: int, row: int) -> None:
        """`row` now holds the state after `block`; a block that has a snapshot already keeps it."""
        if block in self._by_block:
            self.give_back(row)
        else:
            self._by_block[block] = row

    def give_back(self, row: int) -> None:
        assert row not in self._free and row not in self._by_block.values(), f"snapshot row {row} freed twice"
        self._free.append(row)

    def read(self, block: int) -> int:
        """The row of `block`'s snapshot, kept until `done_reading` (a request admitted on it loads it next step)."""
        row = self._by_block[block]
        self._by_block.move_to_end(block)
        self._reading[row] = self._reading.get(row, 0) + 1
        return row

    def done_reading(self, row: int) -> None:
        left = self._reading[row] - 1
        if left:
            self._reading[row] = left
        else:
            del self._reading[row]

    def forget(self, blocks: list[int]) -> None:
        """Blocks leaving the cache take their snapshots with them (a block being read is locked in the tree by
        the request reading it, so it never leaves)."""
        for block in blocks:
            row = self._by_block.pop(block, None)
            if row is not None:
                assert row not in self._reading, "an evicted block's snapshot is being read"
                self._free.append(row)

    @property
    def num_attached(self) -> int:
        return len(self._by_block)

    def check_idle(self, cached: set[int]) -> None:
        """With nothing running: no row is being read, every row is free or the snapshot of a cached block."""
        assert not self._reading, f"snapshot rows {sorted(self._reading)} still being read"
        assert all(block in cached for block in self._by_block), "a snapshot outlived its block"
        rows = sorted(self._free + list(self._by_block.values()))
        assert rows == list(range(self.first_row, self.first_row + self.num_rows)), "a snapshot row leaked"
