"""Multi-step decode, the runner's side (the scheduler's, and why: engine/multi_step.py): several decode steps of the
same requests in a row, each sampled token fed back as the next input. A mixin of ModelRunner; it uses the runner's
model, KV caches, sampler, input building (engine/step_inputs.py) and sampling rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.engine.step_types import SampledTokens, SchedulerOutput, StepResult
from tokenmill.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.request import Request


class MultiStepRunner:
    """ModelRunner's multi-step decode: `execute` hands it a SchedulerOutput with `num_steps` > 1."""

    def _execute_run(self, out: SchedulerOutput) -> StepResult:
        """Multi-step decode: `out.num_steps` decode steps of the same requests in a row, each sampled token the
        next step's input, their KV slots allocated by the scheduler; no scheduling, output processing or
        detokenizing between them. Each token is sampled as a step of its own would sample it (the same rows:
        penalties and min_tokens over the output so far, the generator of its position). Stops early once every
        request has ended (EOS, stop id), or after a step whose sampling failed (what was sampled stays)."""
        scheduled, steps = out.scheduled, out.num_steps
        reqs = [s.request for s in scheduled]
        starts = [r.num_computed_tokens for r in reqs]
        width = max(starts) + steps
        tables = self._block_tables([r.block_ids for r in reqs], width)
        # a hybrid KV layout: the window layers' tables too, each row as it stands for the whole run (a window page
        # goes back only after the run)
        window_tables = [self._block_tables([self._window_row(r, t) for r in reqs], width)
                         for t in range(self.kv_layout.num_window_tables)]
        positions = self._long(starts)  # of each row's token this step feeds
        input_ids = self._long([r.tokens_with_spec(p, p + 1)[0] for r, p in zip(reqs, starts)])
        if all(_plain_greedy(r) for r in reqs) and not window_tables:  # the backend may run them all at once
            stop_ids = [request_stop_ids(r) for r in reqs]
            width = max(1, *map(len, stop_ids))
            tokens = self.model.decode_greedy(input_ids, positions, tables, self.kv_caches, steps,
                                              self._long([ids + [-1] * (width - len(ids)) for ids in stop_ids]))
            if tokens is not None:
                columns = tokens.t().tolist()
                return StepResult(sampled={r.request_id: SampledTokens(t) for r, t in zip(reqs, columns)})
        new: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[dict[int, float]] | None] = [
            [] if r.params.logprobs is not None else None for r in reqs]
        failed: dict[str, str] = {}
        ended = [False] * len(reqs)
        for _ in range(steps):
            logits = self._step_logits(input_ids, positions, tables, window_tables)
            rows = [self._step_row(r, r.output_token_ids + mine) for r, mine in zip(reqs, new)]
            try:
                results = self.sampler(logits, rows)
            except Exception:  # noqa: BLE001 - as execute: the requests at fault fail, the others keep this token
                step = self._sample_one_by_one(logits, rows, scheduled)
                failed = step.failed
                results = [(t.token_ids[0], t.logprobs[0] if t.logprobs else None)
                           if (t := step.sampled.get(r.request_id)) is not None else None for r in reqs]
            for i, (r, got) in enumerate(zip(reqs, results)):
                if got is None or ended[i]:
                    continue
                new[i].append(got[0])
                if logprobs[i] is not None:
                    logprobs[i].append(got[1])
                ended[i] = r.would_stop(got[0], len(r.output_token_ids) + len(new[i]))
            if failed or all(ended):
                break
            input_ids, positions = self._long([mine[-1] if mine else 0 for mine in new]), positions + 1
        result = StepResult(failed=failed)
        for r, mine, lps in zip(reqs, new, logprobs):
            if r.request_id not in failed:
                result.sampled[r.request_id] = SampledTokens(mine, lps)
        return result

    def _step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     window_tables: list[torch.Tensor]) -> torch.Tensor:
        """Logits of one decode step of one token per row at `positions`, their slots in `tables` (and a hybrid
        KV layout's window layers' in `window_tables`): the model's whole-model path where its backend has one,
        else forward and compute_logits."""
        if not window_tables:
            logits = self.model.decode_logits(input_ids, positions, tables, self.kv_caches)
            if logits is not None:
                return logits
        bs, rows = self.block_size, torch.arange(len(input_ids), device=self.device)
        metas = [AttentionMetadata(slot_mapping=t.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs
                                   + positions % bs, num_paged_tokens=len(input_ids), block_tables=t, q_rows=rows,
                                   kv_lens=positions + 1) for t in [tables, *window_tables]]
        meta = metas[0]
        if window_tables:
            meta.layer_meta = [metas[t] for t in self.kv_layout.layer_tables]
        return self.model.compute_logits(self.model(input_ids, positions, meta, self.kv_caches))


def request_stop_ids(req: Request) -> list[int]:
    """The token ids that end a request past min_tokens: its stop_token_ids, and EOS unless it ignores EOS."""
    p = req.params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)))


def _plain_greedy(req: Request) -> bool:
    """Greedy with nothing on top: no penalty or logit bias, no logprobs, past min_tokens (no stop id held back):
    each token is the first argmax of the raw logits, and it ends the request if it is a stop id."""
    p = req.params
    return p.greedy and p.logprobs is None and not p.adjusts_logits and len(req.output_token_ids) >= p.min_tokens
