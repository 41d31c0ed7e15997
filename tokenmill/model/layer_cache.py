"""LayerCache: what one layer of a model keeps between steps, as the model declares it (no tensors, no requests).

Three kinds, each its own cache group in the engine (engine/kv_layout.py):
- "attention": every key and value of the sequence, in paged blocks;
- "window": the keys and values of the last `window` positions only (blocks that leave the window go back);
- "state": a fixed-size state per running request whatever its length (a recurrent or convolution layer's), in
  one slot per request that the layer reads and updates in place as its tokens go through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("attention", "window", "state")
# a state's dtype by name (the API process reads layouts and imports no torch), and its bytes per element
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LayerCache:
    kind: str
    window: int | None = None  # "window": keys a token sees, itself included
    state_shapes: tuple[tuple[int, ...], ...] = ()  # "state": the shape of each tensor one request's slot holds
    state_dtype: str = "float32"  # recurrent state accumulates over the whole sequence: kept in float32

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a layer cache is one of {KINDS}, not {self.kind!r}")
        if (self.kind == "window") != (self.window is not None):
            raise ValueError("a window layer, and only one, names its window")
        if (self.kind == "state") != bool(self.state_shapes):
            raise ValueError("a state layer, and only one, names its state's shapes")
        if self.state_dtype not in STATE_DTYPE_BYTES:
            raise ValueError(f"a state is kept in one of {sorted(STATE_DTYPE_BYTES)}, not {self.state_dtype!r}")

    @classmethod
    def attention(cls) -> LayerCache:
        return cls("attention")

    @classmethod
    def sliding(cls, window: int) -> LayerCache:
        return cls("window", window=window)

    @classmethod
    def state(cls, *shapes: tuple[int, ...], dtype: str = "float32") -> LayerCache:
        return cls("state", state_shapes=tuple(tuple(s) for s in shapes), state_dtype=dtype)

    @property
    def paged(self) -> bool:
        """Keys and values in blocks of tokens (attention and window layers)."""
        return self.kind != "state"

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's slot (0 for a paged layer)."""
        return sum(math.prod(s) for s in self.state_shapes) * STATE_DTYPE_BYTES[self.state_dtype]
