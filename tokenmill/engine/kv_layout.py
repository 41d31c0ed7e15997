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

A layer that keeps a fixed-size state per request instead of keys (model/layer_cache.py "state": a recurrent or
convolution layer of a hybrid model) has no page slot: its state lives in one slot per running request
(engine/state_slots.py), and it reads the step's metadata of table 0 (`state_spans` say where each request is).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.model.layer_cache import LayerCache


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    layer_slots: tuple[int | None, ...]  # per layer: the page slot (cache tensor) holding it; None: a state layer
    layer_tables: tuple[int, ...]  # per layer: 0 the full-attention table (state layers too), 1.. a window table
    window: int | None = None  # keys a window layer sees (None: the uniform layout)
    caches: tuple[LayerCache, ...] = ()  # what each layer keeps, as the model declares it (empty: attention)

    @classmethod
    def uniform(cls, num_layers: int, block_size: int, caches: list[LayerCache] | None = None) -> KVLayout:
        """Every paged layer in a page of its own for every block (window layers keep all their blocks)."""
        caches = caches or [LayerCache.attention()] * num_layers
        paged = [i for i, c in enumerate(caches) if c.paged]
        slots = [paged.index(i) if c.paged else None for i, c in enumerate(caches)]
        return cls(block_size, tuple(slots), (0,) * num_layers, None, tuple(caches))

    @classmethod
    def for_model(cls, num_layers: int, sliding_layers: list[int], window: int | None, block_size: int,
                  max_model_len: int) -> KVLayout:
        """The layout of attention layers, those in `sliding_layers` seeing their last `window` keys."""
        caches = [LayerCache.sliding(window) if window and i in set(sliding_layers) else LayerCache.attention()
                  for i in range(num_layers)]
        return cls.for_layers(caches, block_size, max_model_len)

    @classmethod
    def for_layers(cls, caches: list[LayerCache], block_size: int, max_model_len: int) -> KVLayout:
        """Hybrid where it saves memory: window layers at least as many as the full ones (a window page holds
        `num_slots` of them, so fewer would leave slots empty) and a window shorter than the longest sequence;
        otherwise uniform. State layers take no page either way."""
        local = [i for i, c in enumerate(caches) if c.kind == "window"]
        full = [i for i, c in enumerate(caches) if c.kind == "attention"]
        windows = {caches[i].window for i in local}
        if len(windows) > 1:
            raise ValueError(f"window layers of different windows {sorted(windows)}: one window per model")
        window = windows.pop() if windows else None
        if not window or not full or len(local) < len(full) or window >= max_model_len:
            return cls.uniform(len(caches), block_size, caches)
        slots: list[int | None] = [None] * len(caches)
        tables = [0] * len(caches)
        for i, layer in enumerate(full):
            slots[layer] = i
        for i, layer in enumerate(local):
            slots[layer], tables[layer] = i % len(full), 1 + i // len(full)
        return cls(block_size, tuple(slots), tuple(tables), window, tuple(caches))

    @property
    def hybrid(self) -> bool:
        return self.window is not None

    @property
    def num_layers(self) -> int:
        return len(self.layer_slots)

    @property
    def num_paged_layers(self) -> int:
        """Layers whose keys and values live in the pages (attention and window layers)."""
        return sum(1 for s in self.layer_slots if s is not None)

    @property
    def state_layers(self) -> list[int]:
        """Layers keeping a fixed-size state per request (no pages)."""
        return [i for i, s in enumerate(self.layer_slots) if s is None]

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state, over every state layer."""
        return sum(self.caches[i].state_bytes for i in self.state_layers)

    @property
    def num_slots(self) -> int:
        """Layer slots per page: cache tensors the runner allocates."""
        return max((s for s in self.layer_slots if s is not None), default=-1) + 1

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

    def describe_groups(self) -> str:
        """How many layers each cache group holds, e.g. "6 attention, 12 window (512 tokens), 18 state layers"."""
        window = next((c.window for c in self.caches if c.kind == "window"), None)
        counts = {kind: sum(1 for c in self.caches if c.kind == kind) for kind in ("attention", "window", "state")}
        return ", ".join(f"{n} {kind}" + (f" ({window} tokens)" if kind == "window" else "")
                         for kind, n in counts.items() if n) + " layers"

    def describe(self) -> str:
        if self.window is None:
            return ""
        local = sum(1 for t in self.layer_tables if t)
        return (f"{local} sliding-window layers keep only the blocks of their last {self.window} tokens: pages of "
                f"{self.num_slots} layers, {self.pages_per_block} per block inside the window, 1 after "
                "(--disable-hybrid-kv-cache-manager keeps every block of every layer)")
