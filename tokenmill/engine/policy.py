"""Scheduling policy pieces the scheduler consults (plain Python): the rank of a request under
`--scheduling-policy priority`, its TTFT slack, and a step's token budget under inter-token latency caps."""

from __future__ import annotations

from tokenmill.engine.step_cost import StepCostModel
from tokenmill.request import Request

# of an ITL target, the share a step's model pass may take: the rest goes to scheduling, sampling's host side, the
# output's trip to the API process and the stream (measured at 150 ms: without this margin TPOT p50 came to 165 ms)
ITL_STEP_SHARE = 0.8


def rank(request: Request, now: float, aging_s: float) -> tuple[int, float]:
    """Policy priority: smaller runs first. A request gains a level per `aging_s` since it arrived."""
    waited = max(now - request.arrival_time, 0.0)
    return request.priority - int(waited / aging_s), request.arrival_time


def ttft_slack(request: Request, now: float, step_cost: StepCostModel | None) -> float:
    """Seconds to spare before the request's TTFT target, after its predicted prefill (inf: no target)."""
    if request.ttft_target is None:
        return float("inf")
    fit = step_cost.fit if step_cost is not None else None
    prefill = fit[0] + fit[1] * (request.num_tokens - request.num_computed_tokens) if fit else 0.0
    return request.arrival_time + request.ttft_target - now - prefill


def latency_budget(running: list[Request], budget: int, by_rank: bool, prefill_cap: int | None,
                   step_cost: StepCostModel | None) -> int:
    """The step's token budget under the caps that keep decodes' inter-token latency: a fixed number of prompt
    tokens besides them (--max-prefill-tokens-while-decoding), and what the measured step cost fits within
    ITL_STEP_SHARE of the smallest ITL target of the requests decoding. The decodes it protects always fit: all of
    them first come first served; by rank, those with an ITL target (served first when they rank first), so the
    decodes of requests without one may wait a step when the target leaves no room for them."""
    decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
    if not decoding:
        return budget
    protected = [r for r in decoding if r.itl_target] if by_rank else decoding
    decode_tokens = sum(1 + len(r.spec_token_ids) for r in protected)  # drafts included
    if prefill_cap is not None:
        budget = min(budget, sum(1 + len(r.spec_token_ids) for r in decoding) + prefill_cap)
    target = min((r.itl_target for r in decoding if r.itl_target), default=None)
    if target is not None and step_cost is not None:
        fits = step_cost.max_tokens_within(target * ITL_STEP_SHARE)
        if fits is not None:
            budget = min(budget, max(decode_tokens, fits, 1))
    return budget
