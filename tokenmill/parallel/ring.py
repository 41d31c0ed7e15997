"""Attention in pieces, merged by log-sum-exp: the arithmetic of context parallelism (parallel/context.py).

Softmax attention over a set of keys can be computed over any partition of them: each part gives an output
(normalised within the part) and the log of its softmax denominator (its log-sum-exp, "lse"), and the parts combine
exactly, weighting each output by exp(its lse - the total's). Ring attention is this over K/V blocks passed rank to
rank; decode under context parallelism is this over the ranks' shards of the KV cache. Everything is float32 here;
callers round once at the end. Plain torch on any device: no collectives (the caller moves the pieces).
"""

from __future__ import annotations

import torch

# scores materialised at once by `partial_attention`: queries are taken in tiles so a long prompt's block of
# queries x keys never holds more than this many floats (64 MiB)
MAX_SCORES = 16 * 2**20
FUSED_MIN_QUERIES = 16  # fewer (decodes): plain matmuls beat the fused kernel's fixed cost


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Q, H, D] over the keys k, v [K, KVH, D] that `mask` [Q, K] (True: visible) lets each
    query see; H is a multiple of KVH (grouped queries). Returns the output [Q, H, D] and the lse [Q, H], float32;
    a query that sees no key gets output 0 and lse -inf (the identity of `merge`)."""
    nq, heads, dim = q.shape
    if nq == 0 or k.shape[0] == 0:
        return no_attention(nq, heads, dim, q.device)
    if _fused(q) and nq >= FUSED_MIN_QUERIES:
        blind = ~mask.any(dim=1)  # the fused kernel needs a visible key per row: give one, then erase the row
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias[blind] = 0
        out, lse = _fused_attention(q, k, v, scale, causal=False, bias=bias)
        out[blind], lse[blind] = 0.0, float("-inf")
        return out, lse
    return _masked_attention(q, k, v, mask, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention where query i sees keys 0..i (strict: 0..i-1): a ring hop of striped prefill, whose
    masks are exactly these (parallel/context.py). The fused path skips the masked half."""
    nq, heads, dim = q.shape
    if strict:  # query i sees keys 0..i-1: queries 1.. over the keys, causally; query 0 sees none
        out, lse = no_attention(nq, heads, dim, q.device)
        if nq > 1:
            out[1:], lse[1:] = causal_attention(q[1:], k, v, scale, strict=False)
        return out, lse
    if nq == 0 or k.shape[0] == 0:
        return no_attention(nq, heads, dim, q.device)
    if _fused(q):
        return _fused_attention(q, k, v, scale, causal=True)
    mask = torch.ones(nq, k.shape[0], dtype=torch.bool, device=q.device).tril_()
    return _masked_attention(q, k, v, mask, scale)


def no_attention(nq: int, heads: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What queries that see no key get: output 0, lse -inf."""
    return (torch.zeros(nq, heads, dim, dtype=torch.float32, device=device),
            torch.full((nq, heads), float("-inf"), dtype=torch.float32, device=device))


def _fused(q: torch.Tensor) -> bool:
    """torch's fused CPU attention returns the lse too (blockwise online softmax, in the model's dtype)."""
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    k, v = k.to(q.dtype), v.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), 0.0, causal, attn_mask=bias, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).contiguous()


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch on any device, float32, queries in tiles of at most MAX_SCORES scores."""
    nq, heads, dim = q.shape
    kvh, nk = k.shape[1], k.shape[0]
    out, lse = no_attention(nq, heads, dim, q.device)
    group = heads // kvh
    keys = k.float().transpose(0, 1).contiguous()  # [KVH, K, D]
    values = v.float().transpose(0, 1).contiguous()
    tile = max(1, MAX_SCORES // (heads * nk))
    for s in range(0, nq, tile):
        e = min(nq, s + tile)
        n = e - s
        qs = q[s:e].float().view(n, kvh, group, dim).transpose(0, 1).reshape(kvh, n * group, dim)
        scores = torch.bmm(qs, keys.transpose(1, 2)).view(kvh, n, group, nk).mul_(scale)
        scores.masked_fill_(~mask[s:e].view(1, n, 1, nk), float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)  # [KVH, Q, G]
        finite = torch.where(torch.isinf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
        probs = scores.sub_(finite.unsqueeze(-1)).exp_()  # masked keys: exp(-inf) = 0
        tile_out = torch.bmm(probs.view(kvh, n * group, nk), values).view(kvh, n, group, dim)
        out[s:e] = tile_out.transpose(0, 1).reshape(n, heads, dim)
        lse[s:e] = tile_lse.transpose(0, 1).reshape(n, heads)
    return out, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys -> their attention over both."""
    return merge_many(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))


def merge_many(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attentions outs [N, Q, H, D], lses [N, Q, H] over N disjoint key sets -> out [Q, H, D], lse [Q, H].
    Merged in a fixed order, so every rank merging the same pieces gets the same bits."""
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no keys anywhere: weights 0, output 0
    weights = (lses - top).exp()  # [N, Q, H]
    total = weights.sum(dim=0)
    out = (outs * weights.unsqueeze(-1)).sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out, top + total.log()
