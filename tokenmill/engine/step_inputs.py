"""How a step's scheduled chunks become the model's one flat batch: token ids, positions, KV slots, block tables and
attention metadata (model/attention.py), and how a step is cut into pipeline micro-batches. ModelRunner mixes
StepInputs in; runner.py keeps the forward pass and the sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.engine.cache_tensors import token_slots
from tokenmill.engine.step_types import ScheduledRequest
from tokenmill.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.request import Request

Span = tuple[ScheduledRequest, int, int]  # a scheduled chunk, or part of it: (scheduled, offset, tokens)
MIN_MICRO_BATCH_TOKENS = 32  # smaller micro-batches cost more in per-call overhead than the overlap gains


def micro_batches(ordered: list[ScheduledRequest], n: int, split_chunks: bool) -> list[list[Span]]:
    """The step's tokens, in order, cut into at most n runs of about equal tokens (at least
    MIN_MICRO_BATCH_TOKENS each, when there are that many): at request boundaries, or also inside a request's
    chunk with `split_chunks`."""
    total = sum(s.num_new_tokens for s in ordered)
    n = max(1, min(n, total // MIN_MICRO_BATCH_TOKENS if split_chunks else len(ordered), total))
    bounds = [round(k * total / n) for k in range(1, n)]
    runs: list[list[Span]] = [[] for _ in range(n)]
    pos = k = 0
    for s in ordered:
        offset, left = 0, s.num_new_tokens
        while left:
            while k < n - 1 and pos >= bounds[k]:
                k += 1
            take = min(left, bounds[k] - pos) if split_chunks and k < n - 1 else left
            runs[k].append((s, offset, take))
            offset, left, pos = offset + take, left - take, pos + take
    return [r for r in runs if r]


class StepInputs:
    """ModelRunner's input building: tensors on `self.device`, KV slots in blocks of `self.block_size`, the pages
    of each layer as `self.kv_layout` lays them out, state slots where `self.cache` holds state layers."""

    def _inputs(self, spans: list[Span], num_paged: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and attention metadata of these spans' tokens, the first `num_paged` spans read
        through the block tables, the rest fresh prefills."""
        input_ids, positions, slots = [], [], []
        for s, offset, n in spans:
            req, start = s.request, s.request.num_computed_tokens + offset
            input_ids.extend(req.tokens_with_spec(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(token_slots(req.block_ids, start, start + n, self.block_size))
        meta = AttentionMetadata(slot_mapping=self._long(slots))
        if self.cache.has_state:  # each request's rows and its state slot, in batch order
            row = 0
            for s, _, n in spans:
                meta.state_spans.append((row, row + n, s.request.state_slot))
                row += n
        paged, fresh = spans[:num_paged], spans[num_paged:]
        if paged:
            self._paged_metadata(meta, [(s.request.block_ids, s.request.num_computed_tokens + offset, n)
                                        for s, offset, n in paged])
        row = meta.num_paged_tokens
        for _, _, n in fresh:
            meta.fresh_spans.append((row, row + n))
            row += n
        if self.kv_layout.hybrid:
            self._window_metadata(meta, [(s.request, s.request.num_computed_tokens + offset, n)
                                         for s, offset, n in spans], len(paged))
        return self._long(input_ids), self._long(positions), meta

    def span_inputs(self, spans: list[tuple[list[int], int, list[int]]],
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]:
        """Inputs of token spans outside the scheduler's steps, each (block ids, first position, its tokens),
        reading its context through its block table and writing its K/V there; and the row of each span's last
        token."""
        input_ids, positions, slots, last_rows = [], [], [], []
        for block_ids, start, tokens in spans:
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            slots.extend(token_slots(block_ids, start, start + len(tokens), self.block_size))
            last_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata(slot_mapping=self._long(slots))
        self._paged_metadata(meta, [(b, start, len(t)) for b, start, t in spans])
        return (self._long(input_ids), self._long(positions), meta), self._long(last_rows)

    def _window_metadata(self, meta: AttentionMetadata, spans: list[tuple[Request, int, int]],
                         num_paged: int) -> None:
        """A hybrid KV layout (engine/kv_layout.py): the metadata of each window table (its slots and block
        tables; the rest as table 0's), and `meta.layer_meta`, each layer's. A span: a request, its first new
        position, how many new tokens."""
        bs, metas = self.block_size, [meta]
        for t in range(self.kv_layout.num_window_tables):
            rows = [self._window_row(req, t) for req, _, _ in spans]
            slots = [slot for row, (_, start, n) in zip(rows, spans) for slot in token_slots(row, start, start + n, bs)]
            m = AttentionMetadata(slot_mapping=self._long(slots), num_paged_tokens=meta.num_paged_tokens,
                                  q_rows=meta.q_rows, kv_lens=meta.kv_lens, fresh_spans=meta.fresh_spans)
            if num_paged:
                m.block_tables = self._block_tables(rows[:num_paged], meta.block_tables.shape[1] * bs)
            metas.append(m)
        meta.layer_meta = [metas[t] for t in self.kv_layout.layer_tables]

    @staticmethod
    def _window_row(req: Request, table: int) -> list[int]:
        """A request's pages of one window table, block by block, 0 for the blocks released (never read: they
        are outside every window from here on)."""
        first = req.num_window_released
        return [0] * first + [pages[table] for pages in req.window_pages[first:]]

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _paged_metadata(self, meta: AttentionMetadata, spans: list[tuple[list[int], int, int]]) -> None:
        """Block tables (one row per span, padded with block 0, never read past kv_len) and, per token, its row
        and how many keys it sees. A span: a request's block ids, its first new position, how many new tokens."""
        q_rows, kv_lens = [], []
        for i, (_, start, n) in enumerate(spans):
            q_rows.extend([i] * n)
            kv_lens.extend(range(start + 1, start + n + 1))
        meta.num_paged_tokens = len(q_rows)
        meta.block_tables = self._block_tables([ids for ids, _, _ in spans], max(start + n for _, start, n in spans))
        meta.q_rows = self._long(q_rows)
        meta.kv_lens = self._long(kv_lens)

    def _block_tables(self, block_ids: list[list[int]], num_positions: int) -> torch.Tensor:
        """[R, blocks] tables of the blocks holding positions [0, num_positions), padded with block 0 (never read
        past a row's kv_len)."""
        width = -(-num_positions // self.block_size)
        return self._long([ids[:width] + [0] * (width - len(ids[:width])) for ids in block_ids]).view(-1, width)
