"""Attention metadata: the contract between the model runner, which builds it once per step, and the backends
(model/backends/), which compute attention from it.

The flat batch holds first the tokens that read earlier context from the cache ("paged" tokens: decodes and
later chunks of a chunked prefill), then first chunks of prompts ("fresh" prefills, whose whole context is in
the batch itself). New K/V are written into the block-structured cache through `slot_mapping`. Paged tokens
read their context through their request's block table, each seeing `kv_len` keys (causal within a chunk);
fresh prefills attend causally over their own new K/V. Nothing is padded to the longest request in the batch
itself; a backend may pad internally (the torch one pads each request's queries for one SDPA call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) for each new token
    num_paged_tokens: int = 0  # the first rows of the batch
    block_tables: torch.Tensor | None = None  # [R, max_blocks] for requests with paged tokens
    q_rows: torch.Tensor | None = None  # [num_paged_tokens] row of block_tables per paged token
    kv_lens: torch.Tensor | None = None  # [num_paged_tokens] keys each paged token sees (itself included)
    fresh_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) rows of fresh prefills
    derived: dict[str, Any] = field(default_factory=dict)  # what a backend derives once per step for all layers
    context: Any = None  # context parallelism: how the step is split over the ranks (parallel/context.py)
    # a hybrid KV layout (engine/kv_layout.py): each layer's metadata (its table's slots and block tables); None:
    # every layer reads through this one
    layer_meta: list[AttentionMetadata] | None = None
    # state layers (model/layer_cache.py "state"): per request of the step, in batch order, (first row, end row,
    # its state slot); a slot the runner has zeroed for a request starting at position 0
    state_spans: list[tuple[int, int, int]] = field(default_factory=list)

    def per_layer(self, num_layers: int) -> list[AttentionMetadata]:
        return self.layer_meta if self.layer_meta is not None else [self] * num_layers
