"""TorchBackend: every op in plain PyTorch, on any device.

It is the reference each fast kernel is tested against, the path `ModelRunner(use_kernel=False)` runs, and the
fallback wherever no faster backend exists (a CPU without a compiler, CUDA until a CUDA backend lands), so its
paged attention is batched per request, not per token: see `paged_attention_sdpa`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.model.backends.base import Backend, LinearWeights

if TYPE_CHECKING:
    from tokenmill.model.attention import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 as the HF reference does, then scale in the model's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the non-interleaved (HF) layout: x [T, heads, D], cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary on the first cos.shape[-1] dims of each head, the rest as they are (partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kvh, hd = k.shape[1], k.shape[2]
    if k_cache.dtype != k.dtype:  # an FP8 cache: e4m3 holds +-448 at most, and a cast past it gives NaN
        limit = torch.finfo(k_cache.dtype).max
        k, v = k.clamp(-limit, limit).to(k_cache.dtype), v.clamp(-limit, limit).to(v_cache.dtype)
        if k_cache.dtype.itemsize == 1:  # torch has no index_copy_ for float8: copy the codes as bytes
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[block_tables] in `dtype` (an FP8 cache gathered as bytes, which torch indexes, then widened)."""
    if cache.dtype == dtype:
        return cache[block_tables]
    if cache.dtype.itemsize == 1:
        return cache.view(torch.uint8)[block_tables].view(cache.dtype).to(dtype)
    return cache[block_tables].to(dtype)


def query_layout(num_requests: int, q_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """For each paged token, its index among its request's queries (tokens of a request need not be adjacent),
    and the most queries any request has. The one host sync of the paged path; computed once per step."""
    counts = torch.bincount(q_rows, minlength=num_requests)
    order = torch.argsort(q_rows, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(q_rows)
    rank[order] = torch.arange(q_rows.shape[0], device=q_rows.device) - starts[q_rows[order]]
    return rank, int(counts.max())


def paged_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, q_rows: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                         layout: tuple[torch.Tensor, int] | None = None, window: int | None = None) -> torch.Tensor:
    """q [P, H, D] -> [P, H, D]. Each request's K/V is gathered once through its block table ([R, L, KVH, D]),
    its queries are padded to the longest request's, and one SDPA call runs with a mask per query: key j is
    visible to a token iff j < its kv_len (causal within a chunk, nothing past the context, no padding blocks)
    and, with a `window`, j >= kv_len - window (a sliding-window layer).
    Gathering per request rather than per token keeps memory and traffic at R x L, not P x L."""
    r, heads, hd, kvh = block_tables.shape[0], q.shape[1], q.shape[2], k_cache.shape[2]
    rank, max_q = layout if layout is not None else query_layout(r, q_rows)
    keys, values = (gather_blocks(c, block_tables, q.dtype).view(r, -1, kvh, hd).transpose(1, 2)  # [R, KVH, L, D]
                    for c in (k_cache, v_cache))
    queries = q.new_zeros(r, max_q, heads, hd)
    queries[q_rows, rank] = q
    # padding queries see one key (never none: an all-masked row is NaN); their outputs are dropped
    lens = torch.ones(r, max_q, dtype=kv_lens.dtype, device=q.device)
    lens[q_rows, rank] = kv_lens
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = key_pos < lens.unsqueeze(-1)  # [R, Q, L]
    if window is not None:
        mask &= key_pos >= lens.unsqueeze(-1) - window
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1),
                                         scale=scale, enable_gqa=True)  # [R, H, Q, D]
    return out.transpose(1, 2)[q_rows, rank]


def fresh_prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int | None = None) -> torch.Tensor:
    """Causal attention of a first prompt chunk over its own k, v: q [n, H, D] -> [n, H, D]; with a `window`,
    token i sees keys i - window < j <= i only."""
    # 4-D [1, heads, tokens, dim]: with 3-D inputs torch takes its unfused math path on CPU (3x slower)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    n = q.shape[0]
    if window is None or window >= n:  # the window cuts nothing here
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    pos = torch.arange(n, device=q.device)
    back = pos.unsqueeze(1) - pos  # [query, key]: how far back the key is
    mask = (back >= 0) & (back < window)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


class TorchBackend(Backend):
    """Plain PyTorch: correct on any device, fast on none in particular."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return rms_norm(residual.add_(x), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_and_write_kv(self, qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping):
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
        if cos is not None:
            q, k = rotate_leading(q, cos, sin), rotate_leading(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, k, v

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None,
                        window: int | None = None) -> torch.Tensor:
        # Paged tokens come first in the batch (model/attention.py), then the fresh prefill spans.
        scale, p = q.shape[-1] ** -0.5 if scale is None else scale, meta.num_paged_tokens
        paged_out = self.attend_paged(q[:p], k_cache, v_cache, meta, scale, window) if p else None
        if not meta.fresh_spans:
            return paged_out if paged_out is not None else torch.empty_like(q)
        out = torch.empty_like(q)
        if paged_out is not None:
            out[:p] = paged_out
        for start, end in meta.fresh_spans:
            out[start:end] = fresh_prefill_sdpa(q[start:end], k[start:end], v[start:end], scale, window)
        return out

    def attend_paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """The paged rows q [P, H, D] of the batch; the per-request query layout is shared by every layer."""
        layout = meta.derived.get("query_layout")
        if layout is None:
            layout = meta.derived["query_layout"] = query_layout(meta.block_tables.shape[0], meta.q_rows)
        return paged_attention_sdpa(q, k_cache, v_cache, meta.block_tables, meta.q_rows, meta.kv_lens, scale,
                                    layout, window)

    def linear(self, x: torch.Tensor, layer: LinearWeights) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def describe(self) -> str:
        return "torch (plain PyTorch reference)"


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, H, D], k, v [T, KVH, D] of the fused projection's output."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
