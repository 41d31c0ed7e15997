"""Paged attention over a flat ragged batch.

The flat batch holds first the tokens that read earlier context from the cache ("paged" tokens: decodes and
later chunks of a chunked prefill), then first chunks of prompts ("fresh" prefills, whose whole context is in
the batch itself). New K/V are written into the block-structured cache through `slot_mapping`. Paged tokens
read their context through their request's block table, each seeing `kv_len` keys (causal within a chunk);
fresh prefills attend causally over their own new K/V. Nothing is padded to the longest request.

Two backends compute paged tokens: the C++ CPU kernel (model/csrc) and a plain-PyTorch reference it is tested
against, which the engine falls back to when the kernel cannot be built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import paged_attention_kernel


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) for each new token
    num_paged_tokens: int = 0  # the first rows of the batch
    block_tables: torch.Tensor | None = None  # [R, max_blocks] for requests with paged tokens
    q_rows: torch.Tensor | None = None  # [num_paged_tokens] row of block_tables per paged token
    kv_lens: torch.Tensor | None = None  # [num_paged_tokens] keys each paged token sees (itself included)
    fresh_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) rows of fresh prefills
    use_kernel: bool = True


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kvh, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, q_rows: torch.Tensor, kv_lens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [P, H, D] -> [P, H, D]: gather each token's context through its block table, mask past kv_len."""
    p, kvh, hd = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    tables = block_tables[q_rows]  # [P, max_blocks]
    keys = k_cache[tables].view(p, -1, kvh, hd).transpose(1, 2)
    values = v_cache[tables].view(p, -1, kvh, hd).transpose(1, 2)
    mask = (torch.arange(keys.shape[2], device=q.device).unsqueeze(0) < kv_lens.unsqueeze(1)).view(p, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for the new tokens, already written to the caches [blocks, block_size, KVH, D]
    (write_kv, or the fused rotary_write_kv kernel). Returns [T, H, D]."""
    scale = q.shape[-1] ** -0.5
    p = meta.num_paged_tokens
    kernel = paged_attention_kernel() if meta.use_kernel and q.device.type == "cpu" else None
    paged_out = None
    if p:
        args = (q[:p].contiguous(), k_cache, v_cache, meta.block_tables, meta.q_rows, meta.kv_lens, scale)
        paged_out = kernel(*args) if kernel is not None else paged_attention_reference(*args)
        if not meta.fresh_spans:
            return paged_out
    out = torch.empty_like(q)
    if paged_out is not None:
        out[:p] = paged_out
    for start, end in meta.fresh_spans:
        # 4-D [1, heads, tokens, dim]: with 3-D inputs torch takes its unfused math path on CPU (3x slower)
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                        enable_gqa=True)[0].transpose(0, 1)
    return out
