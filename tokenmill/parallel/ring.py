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


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Q, H, D] over the keys k, v [K, KVH, D] that `mask` [Q, K] (True: visible) lets each
    query see; H is a multiple of KVH (grouped queries). Returns the output [Q, H, D] and the lse [Q, H], float32;
    a query that sees no key gets output 0 and lse -inf (the identity of `merge`)."""
    nq, heads, dim = q.shape
    kvh, nk = k.shape[1], k.shape[0]
    out = torch.zeros(nq, heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((nq, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if nq == 0 or nk == 0:
        return out, lse
    group = heads // kvh
    keys = k.float().permute(1, 2, 0).unsqueeze(1)  # [KVH, 1, D, K]
    values = v.float().transpose(0, 1).unsqueeze(1)  # [KVH, 1, K, D]
    tile = max(1, MAX_SCORES // (heads * nk))
    for s in range(0, nq, tile):
        e = min(nq, s + tile)
        qs = q[s:e].float().view(e - s, kvh, group, dim).permute(1, 2, 0, 3)  # [KVH, G, Q, D]
        scores = (qs @ keys).mul_(scale).masked_fill_(~mask[s:e], float("-inf"))  # [KVH, G, Q, K]
        tile_lse = torch.logsumexp(scores, dim=-1)  # [KVH, G, Q]
        finite = torch.where(torch.isinf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
        probs = scores.sub_(finite.unsqueeze(-1)).exp_()  # masked keys: exp(-inf) = 0
        out[s:e] = (probs @ values).permute(2, 0, 1, 3).reshape(e - s, heads, dim)
        lse[s:e] = tile_lse.permute(2, 0, 1).reshape(e - s, heads)
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


def causal_mask(q_pos: torch.Tensor, q_seq: torch.Tensor, k_pos: torch.Tensor, k_seq: torch.Tensor) -> torch.Tensor:
    """[Q, K]: key j is visible to query i iff they belong to the same sequence and j is not after i."""
    return (q_seq.unsqueeze(1) == k_seq.unsqueeze(0)) & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
