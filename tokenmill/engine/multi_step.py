"""Multi-step decode (`max_steps` > 1, --num-scheduler-steps, as vLLM's), the scheduler's side: a step whose batch is
a few plain decodes (MULTI_STEP_MAX_REQUESTS at most), with no one waiting and no inter-token latency target among
them, runs up to `max_steps` decodes in a row in the runner (engine/multi_step_runner.py), the KV slots of all of
them allocated here first (never by preempting: short of blocks, one step). What it saves is the engine's Python
between tokens (scheduling, output processing, detokenizing); what it costs is tokens arriving in bursts and a
newcomer or an abort waiting for the run to end. Plain Python, like the scheduler."""

from __future__ import annotations

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.step_types import SchedulerOutput

# Multi-step decode (`max_steps` > 1) applies to batches of at most this many decodes: beyond it a step's Python is
# a few percent of its time, while K steps in one go hold back aborts and bursts for K times longer.
MULTI_STEP_MAX_REQUESTS = 8


def run_length(out: SchedulerOutput, kv: KVCacheManager, max_steps: int, lookahead: int,
               anyone_waiting: bool) -> int:
    """How many decode steps this step may run in a row (multi-step decode), their KV slots allocated: up to
    `max_steps` when the batch is a few plain decodes and no one waits (a newcomer would wait for all of
    them), no request has an inter-token latency target (the tokens come in bursts) and none has fewer
    tokens left to write; 1 otherwise, or when the pool is short of the blocks the extra tokens need."""
    if (anyone_waiting or out.preempted or lookahead or len(out.scheduled) > MULTI_STEP_MAX_REQUESTS):
        return 1
    steps = max_steps
    for s in out.scheduled:
        req = s.request
        if (s.num_new_tokens != 1 or s.num_spec_tokens or not s.samples_next_token or not req.output_token_ids
                or req.itl_target is not None):
            return 1
        steps = min(steps, req.max_tokens - len(req.output_token_ids))
    if steps <= 1:
        return 1
    need = sum(kv.pages_to_grow(s.request, steps) for s in out.scheduled)
    if need > kv.num_free_blocks:
        return 1
    for s in out.scheduled:
        kv.allocate_slots(s.request, steps)
    return steps

