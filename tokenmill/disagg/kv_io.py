"""A sequence's KV between the cache's pages and a transfer: host copies, token-major ([tokens, layers, 2, kv
heads, head dim], the order the connectors stream), gathered from and scattered to the slots of its blocks."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.disagg.transfer import TransferLayout


class PagedCache(Protocol):
    """What of a model's cache the transfer touches (engine/cache_tensors.py CacheTensors)."""

    def paged_layers(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]: ...

    def slot_index(self, block_ids: list[int], start: int, end: int) -> torch.Tensor: ...


def read_tokens(cache: PagedCache, layout: TransferLayout, block_ids: list[int], start: int,
                end: int) -> torch.Tensor:
    """A host copy of tokens [start, end)'s K/V."""
    slots = cache.slot_index(block_ids, start, end)
    heads, dim = layout.num_kv_heads, layout.head_dim
    layers = cache.paged_layers()
    k0 = layers[0][1][0]
    out = torch.empty((end - start, layout.num_layers, 2, heads, dim), dtype=k0.dtype, device=k0.device)
    with torch.inference_mode():
        for layer, (k, v) in layers:
            out[:, layer, 0] = k.view(-1, heads, dim).index_select(0, slots)
            out[:, layer, 1] = v.view(-1, heads, dim).index_select(0, slots)
    return out.cpu()


def write_tokens(cache: PagedCache, layout: TransferLayout, block_ids: list[int], start: int,
                 kv: torch.Tensor) -> None:
    """Write `kv` (as read_tokens gives it) at tokens [start, start + len(kv))."""
    slots = cache.slot_index(block_ids, start, start + len(kv))
    heads, dim = layout.num_kv_heads, layout.head_dim
    with torch.inference_mode():
        kv = kv.to(slots.device)
        for layer, (k, v) in cache.paged_layers():
            k.view(-1, heads, dim).index_copy_(0, slots, kv[:, layer, 0])
            v.view(-1, heads, dim).index_copy_(0, slots, kv[:, layer, 1])
