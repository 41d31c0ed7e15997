"""KVLayout: which pages of the KV pool hold which layer's keys and values (plain Python, no tensors).

A model whose layers all see every key keeps one page per block of `block_size` tokens, holding every layer
("uniform"). A model with sliding-window layers (Gemma 3: five local layers of a 512-token window per global one)
wastes most of that: a local layer never reads a key more than `window` positions back. There the pool is cut
into pages of `num_slots` layer slots (as many as the model has full-attention layers), and a block of tokens
takes one page for its full-attention layers (table 0) and `num_window_tables` pages for its window layers
(tables 1..), which go back to the pool once the block has left every future token's window ("hybrid"). All
pages are the same size, so the two kinds of block share one pool and one free list: short requests use it as
the uniform layout would, long ones hold their window's pages only.

Each layer reads its keys through its table's block table (the runner builds one per table per step) from the
cache tensor of its slot; the layers of one slot share that tensor, each through its own table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    layer_slots: tuple[int, ...]  # per layer: the page slot (cache tensor) holding it
    layer_tables: tuple[int, ...]  # per layer: 0 the full-attention table, 1.. a window table
    window: int | None = None  # keys a window layer sees (None: the uniform layout)

    @classmethod
    def uniform(cls, num_layers: int, block_size: int) -> KVLayout:
        return cls(block_size, tuple(range(num_layers)), (0,) * num_layers)

    @classmethod
    def for_model(cls, num_layers: int, sliding_layers: list[int], window: int | None, block_size: int,
                  max_model_len: int) -> KVLayout:
        """Hybrid where it saves memory: window layers at least as many as the full ones (a window page holds
        `num_slots` of them, so fewer would leave slots empty) and a window shorter than the longest sequence;
        otherwise uniform."""
        local = [i for i in range(num_layers) if i in set(sliding_layers)]
        full = [i for i in range(num_layers) if i not in set(sliding_layers)]
        if not window or not full or len(local) < len(full) or window >= max_model_len:
            return cls.uniform(num_layers, block_size)
        slots, tables = [0] * num_layers, [0] * num_layers
        for i, layer in enumerate(full):
            slots[layer] = i
        for i, layer in enumerate(local):
            slots[layer], tables[layer] = i % len(full), 1 + i // len(full)
        return cls(block_size, tuple(slots), tuple(tables), window)

    @property
    def hybrid(self) -> bool:
        return self.window is not None

    @property
    def num_layers(self) -> int:
        return len(self.layer_slots)

    @property
    def num_slots(self) -> int:
        """Layer slots per page: cache tensors the runner allocates."""
        return max(self.layer_slots) + 1

    @property
    def num_window_tables(self) -> int:
        return max(self.layer_tables)

    @property
    def pages_per_block(self) -> int:
        """Pages a block of tokens takes while it is inside the window."""
        return 1 + self.num_window_tables

    def first_window_block(self, num_computed: int) -> int:
        """The first block any token from position `num_computed` on still reads in a window layer (a token sees
        its last `window` keys, itself included); the blocks before it may go."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def window_span_blocks(self, max_chunk: int) -> int:
        """Most blocks one request holds window pages for at once: its window, and a chunk of up to `max_chunk`
        new tokens (all written before any leaves), straddling block edges."""
        return -(-(self.window - 1 + max_chunk) // self.block_size) + 1

    def token_capacity(self, num_pages: int, max_chunk: int) -> int:
        """Tokens one request may reach in a pool of `num_pages` pages, chunks of at most `max_chunk` tokens."""
        if self.window is None:
            return num_pages * self.block_size
        span = self.window_span_blocks(max_chunk)
        return max((num_pages - self.num_window_tables * span) * self.block_size,
                   num_pages // self.pages_per_block * self.block_size)

    def describe(self) -> str:
        if self.window is None:
            return ""
        local = sum(1 for t in self.layer_tables if t)
        return (f"{local} sliding-window layers keep only the blocks of their last {self.window} tokens: pages of "
                f"{self.num_slots} layers, {self.pages_per_block} per block inside the window, 1 after "
                "(--disable-hybrid-kv-cache-manager keeps every block of every layer)")
