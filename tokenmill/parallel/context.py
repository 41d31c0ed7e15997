"""Context parallelism: one model on every rank, each request's tokens and KV split by position across the ranks.

Token p of a sequence belongs to rank p mod C (striped, so under a causal mask every rank has as much attention work
as the others). A rank computes only its tokens' layers and keeps only their K/V: the scheduler's block of
`block_size x C` tokens is `block_size` tokens on each rank, at the same block id, and rank r's tokens of a
sequence lie in its cache in order (its i-th token at block table entry i // block_size, offset i % block_size), so
its cache is an ordinary paged cache of its share. A context C times what one rank's KV memory holds still serves.

Attention needs every earlier token's K/V, which lives on all ranks:
- a prompt's first chunk ("fresh": all its keys are in the step) uses ring attention: each rank's K/V block goes
  round the ring, and each rank attends its queries over every block in turn, merging by log-sum-exp (ring.py);
  the next block's transfer overlaps this block's arithmetic;
- every other token (decodes, later chunks, prompts after a prefix-cache hit: "paged") reads the cache: the step's
  paged queries are gathered on every rank, each rank attends all of them over its own share of the cache, and each
  query's owner merges the C partial results by log-sum-exp. A step of few paged tokens (decodes) has every rank
  compute them all instead, each keeping only its own tokens' K/V: that saves the gathering collective, which costs
  more than those tokens' layers.
Rank 0 schedules, shards each step here like every rank, and gathers the final hidden states of all rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends.reference import gather_blocks
from tokenmill.parallel.group import RankGroup
from tokenmill.parallel.ring import causal_attention, merge, merge_many, no_attention, partial_attention

# a step with at most this many paged tokens (decodes) has every rank compute all of them, writing only its own
# K/V: one collective per layer instead of two (on gloo each costs ~1 ms: BENCHMARKS.md "Context parallelism")
REPLICATE_PAGED_MAX = 32


@dataclass
class ContextParallel:
    """What a rank's runner needs: its group, the blocks of its own cache and their size (the scheduler's / C)
    (one more block beyond them takes the K/V a rank computes but does not keep), and when rank 0 has every rank
    compute a step's paged tokens."""

    group: RankGroup
    block_size: int
    num_blocks: int
    replicate_max: int = REPLICATE_PAGED_MAX

    @property
    def spare_slot(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def describe(self, num_blocks: int) -> str:
        c = self.size
        return (f"context parallel: {c} ranks, each with every layer and 1/{c} of every sequence's tokens and KV "
                f"(position p on rank p mod {c}); a block = {self.block_size} tokens on each rank, "
                f"{num_blocks} blocks per rank")


@dataclass
class PagedGroup:
    """The step's paged queries that read one block-table row: which they are, and how many of this rank's keys
    each sees (the same for every layer, so worked out once per step)."""

    queries: torch.Tensor  # indices among the step's paged rows
    kv_lens: torch.Tensor  # keys of this rank's cache each sees
    blocks: torch.Tensor  # the block ids holding them


@dataclass
class ContextShard:
    """One step as split over the ranks (in AttentionMetadata.context). Every rank computes the same split from
    the step's inputs, so no rank is told another's shapes."""

    cp: ContextParallel
    rows: list[torch.Tensor]  # per rank: the step's rows it computes, in order (paged rows first)
    num_paged: int  # the step's paged rows (the first rows of the step)
    paged: list[torch.Tensor]  # per rank: which of the step's paged rows it computes (replicated: all)
    replicated: bool  # every rank computes every paged row
    sent: list[torch.Tensor]  # per rank: the rows whose final hidden states it sends rank 0 (replicated: the
    sent_from: int  # ... paged ones only from rank 0), from this row of its own on
    groups: list[PagedGroup]  # this rank's share of the cache, per block-table row
    # per rank: where each fresh prefill's tokens lie among its fresh rows ({prefill: (start, end)}), and how many
    fresh: list[dict[int, tuple[int, int]]]
    fresh_counts: list[int]

    @property
    def num_fresh(self) -> int:
        return sum(self.fresh_counts)

    # ---- attention ---------------------------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, num_paged: int) -> torch.Tensor:
        """This rank's rows: q [n, H, D], their k, v [n, KVH, D] (already in the cache), the first `num_paged`
        paged. Every rank calls this in every layer (the collectives inside meet)."""
        scale = q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        if self.num_paged:
            out[:num_paged] = self.attend_paged(q[:num_paged], k_cache, v_cache, scale).to(q.dtype)
        if self.num_fresh:
            out[num_paged:] = self.ring_attention(q[num_paged:], k[num_paged:], v[num_paged:], scale).to(q.dtype)
        return out

    def attend_paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """Decode-style: gather every rank's paged queries (replicated: every rank has them), attend all of them
        over this rank's cache, and merge the ranks' partial results for this rank's queries."""
        group, me = self.cp.group, self.cp.rank
        queries = q if self.replicated else group.all_gather_rows(q, self.paged, self.num_paged)  # [P, H, D]
        out, lse = self.partial_over_cache(queries, k_cache, v_cache, scale)
        pieces = group.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1))  # [C, P, H, D + 1]
        mine = pieces[:, self.paged[me]]
        return merge_many(mine[..., :-1], mine[..., -1])[0]

    def partial_over_cache(self, queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every paged query over the keys of this rank's cache that it sees: output [P, H, D] and lse [P, H]."""
        p, heads, dim = queries.shape
        kvh = k_cache.shape[2]
        out = torch.zeros(p, heads, dim, dtype=torch.float32, device=queries.device)
        lse = torch.full((p, heads), float("-inf"), dtype=torch.float32, device=queries.device)
        for g in self.groups:
            length = int(g.kv_lens.max())
            keys, values = (gather_blocks(c, g.blocks, torch.float32).reshape(-1, kvh, dim)[:length]
                            for c in (k_cache, v_cache))
            mask = torch.arange(length, device=queries.device) < g.kv_lens.unsqueeze(1)
            out[g.queries], lse[g.queries] = partial_attention(queries[g.queries], keys, values, mask, scale)
        return out, lse

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Prefill-style: this rank's fresh queries over every rank's fresh K/V, the blocks passed round the ring
        (rank r sends to r + 1); the transfer of the next block runs while this one is attended. Striped, rank
        r's i-th token of a prompt is at position r + iC, so rank s's j-th is visible to it iff j <= i (s <= r) or
        j < i (s > r): each hop is a causal attention per prompt."""
        group, size, me = self.cp.group, self.cp.size, self.cp.rank
        block, owner = torch.stack([k, v]).contiguous(), me  # [2, n, KVH, D]
        out = lse = None
        for hop in range(size):
            incoming = None
            if hop < size - 1:  # the block the rank before holds now: rank (me - hop - 1)'s
                source = (me - hop - 1) % size
                incoming = block.new_empty((2, self.fresh_counts[source], *block.shape[2:]))
                works = group.shift(block, incoming, tag=hop)
            o, s = no_attention(*q.shape, q.device)
            theirs = self.fresh[owner]
            for prefill, (a, b) in self.fresh[me].items():
                if prefill in theirs:
                    c, d = theirs[prefill]
                    o[a:b], s[a:b] = causal_attention(q[a:b], block[0, c:d], block[1, c:d], scale,
                                                      strict=owner > me)
            out, lse = (o, s) if out is None else merge(out, lse, o, s)
            if incoming is not None:
                for work in works:
                    work.wait()
                block, owner = incoming, source
        return out


def shard_step(cp: ContextParallel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               replicate: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """This rank's part of a step the runner built for the whole model: its token ids, positions and attention
    metadata (cache slots in its own cache, the split in `context`). `replicate`: every rank computes every paged
    row (keeping only its own K/V), the fresh rows still striped."""
    size, me, bs = cp.size, cp.rank, cp.block_size
    owner = positions % size
    striped = [torch.nonzero(owner == r).squeeze(1) for r in range(size)]
    p = meta.num_paged_tokens
    seq = torch.full_like(positions, -1)
    for i, (start, end) in enumerate(meta.fresh_spans):
        seq[start:end] = i
    fresh_rows = [r[r >= p] for r in striped]
    if replicate:
        every = torch.arange(p, device=positions.device)
        rows, paged = [torch.cat([every, f]) for f in fresh_rows], [every] * size
        sent, sent_from = [rows[0], *fresh_rows[1:]], 0 if me == 0 else p
    else:
        rows, paged, sent, sent_from = striped, [r[r < p] for r in striped], striped, 0
    fresh = [seq[f] for f in fresh_rows]
    shard = ContextShard(cp, rows, p, paged, replicate, sent, sent_from, [], [_segments(f) for f in fresh],
                         [len(f) for f in fresh])
    if p:
        # this rank's keys a paged query at position x sees: positions me, me + C, ... up to x
        kv_lens = (positions[:p] - me).div(size, rounding_mode="floor").add_(1).clamp_(min=0)
        for row in range(meta.block_tables.shape[0]):
            queries = torch.nonzero(meta.q_rows == row).squeeze(1)
            lens = kv_lens[queries]
            longest = int(lens.max()) if len(queries) else 0
            if longest:
                shard.groups.append(PagedGroup(queries, lens, meta.block_tables[row, :math.ceil(longest / bs)]))
    mine = rows[me]
    slots = meta.slot_mapping[mine]  # the scheduler's slots: block * (bs * C) + offset in the block
    local = slots.div(bs * size, rounding_mode="floor") * bs + (slots % (bs * size)).div(size, rounding_mode="floor")
    local[owner[mine] != me] = cp.spare_slot  # another rank's token (replicated): its K/V is not kept here
    local_meta = replace(meta, slot_mapping=local, num_paged_tokens=len(paged[me]), block_tables=None,
                         q_rows=None, kv_lens=None, fresh_spans=[], derived={}, context=shard)
    return input_ids[mine], positions[mine], local_meta


def _segments(prefills: torch.Tensor) -> dict[int, tuple[int, int]]:
    """Runs of equal prefill ids (each prefill's rows are adjacent) -> {prefill: (start, end)}."""
    ids, counts = torch.unique_consecutive(prefills, return_counts=True)
    out, start = {}, 0
    for i, n in zip(ids.tolist(), counts.tolist()):
        out[i] = (start, start + n)
        start += n
    return out


def forward(model: torch.nn.Module, cp: ContextParallel, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list, replicate: bool = False) -> torch.Tensor | None:
    """Every rank's part of a step; rank 0 gets the final hidden states of all the step's rows, the others None."""
    ids, pos, local = shard_step(cp, input_ids, positions, meta, replicate)
    hidden = model(ids, pos, local, kv_caches)
    shard = local.context
    return cp.group.gather_rows_to_driver(hidden[shard.sent_from:], shard.sent, len(input_ids))
