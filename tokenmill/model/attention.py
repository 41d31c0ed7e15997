"""Paged attention over a flat ragged batch, in plain PyTorch (the reference backend).

The batch holds decode tokens first (one per request), then prefill chunks. New K/V are written into the
block-structured cache through `slot_mapping`; attention then reads each request's context through its
block table. Nothing is padded to the longest request in the token dimension; decodes share one batched
attention call over their gathered contexts (masked past each request's length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's prefill chunk: query rows [start, end) of the flat batch, `context_len` tokens already
    cached before this chunk."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor | None = None  # needed only when context_len > 0
    mask: torch.Tensor | None = None  # [n, context_len + n] bool, causal with offset


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) for each new token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kvh, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens; caches [blocks, block_size, KVH, D]. Returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    kvh, hd = k.shape[1], k.shape[2]
    d = meta.num_decodes
    if d:
        kd = k_cache[meta.decode_block_tables].view(d, -1, kvh, hd).transpose(1, 2)
        vd = v_cache[meta.decode_block_tables].view(d, -1, kvh, hd).transpose(1, 2)
        res = F.scaled_dot_product_attention(q[:d].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask,
                                             enable_gqa=True)
        out[:d] = res.squeeze(2)
    for span in meta.prefills:
        qs = q[span.start:span.end].transpose(0, 1)
        if span.context_len == 0:
            ks, vs = k[span.start:span.end].transpose(0, 1), v[span.start:span.end].transpose(0, 1)
            res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            total = span.context_len + (span.end - span.start)
            ks = k_cache[span.block_ids].view(-1, kvh, hd)[:total].transpose(0, 1)
            vs = v_cache[span.block_ids].view(-1, kvh, hd)[:total].transpose(0, 1)
            res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
        out[span.start:span.end] = res.transpose(0, 1)
    return out
