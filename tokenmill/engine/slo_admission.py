"""The API process's time-to-first-token forecast and what --slo-admission does with it.

The forecast is fed by what the engine core publishes with each step (its measured step cost, the prefills under
way, the running decodes: SchedulerStats) and by what the API process has sent that the core has not started yet;
it learns its bias from each first token. No scheduling policy runs here: the policy's aging rule (engine/policy.py
aged_level) and the step-cost model's arithmetic (engine/step_cost.py) are the same functions the core uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import replace

from tokenmill.config import SchedulerConfig
from tokenmill.engine.output_processor import RequestState
from tokenmill.engine.policy import ITL_STEP_SHARE, aged_level
from tokenmill.engine.step_cost import predict_ttft, stretched_step_seconds
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import ServerOverloaded
from tokenmill.sampling_params import SamplingParams

MODES = ("off", "reject", "degrade")  # --slo-admission: what a request predicted to miss its TTFT target gets
# the prediction's bias (what the engine's step cost does not see: tokenizing, the trip between the processes, the
# output's way back) is learnt per priority from each first token, this much of the latest error at a time, the
# error clipped (a low-priority request passed over for a minute says nothing about the next one's tokenizing)
TTFT_BIAS_RATE = 0.1
TTFT_BIAS_CLIP_S = 0.5


class SloAdmission:
    def __init__(self, config: SchedulerConfig, mode: str = "off"):
        if mode not in MODES:
            raise ValueError(f"slo_admission must be one of {', '.join(MODES)}")
        self.config, self.mode = config, mode
        self.ttft_bias: dict[int, float] = {}  # priority -> seconds the step-cost prediction misses by, learnt

    def predict(self, stats: SchedulerStats, unstarted: Iterable[tuple[int, int, float]], new_tokens: int,
                priority: int = 0, itl_ms: float | None = None) -> float | None:
        """Seconds until the first token of a request with `new_tokens` prompt tokens, from the engine's measured
        step cost: the prompt tokens ahead of it (`unstarted`: (tokens, priority, arrival) of what was sent and not
        started, and the rest of prefills under way; under policy priority only those of requests at its level or
        better, aging counted) and the running decodes, in steps no bigger than an ITL target lets them be (the
        request's, else the server's) or --max-decode-slowdown, plus the bias learnt from earlier first tokens at
        its priority; None until the engine has measured its steps."""
        sc, now = self.config, time.monotonic()
        by_rank = sc.policy == "priority"
        ahead = [t for t, p, arrival in unstarted
                 if not by_rank or aged_level(p, arrival, now, sc.priority_aging_s) <= priority]
        under_way = sum(t for level, t in stats.prefill_tokens_by_level.items() if not by_rank or level <= priority)
        itl_ms = itl_ms or sc.slo_itl_ms
        limits = [ITL_STEP_SHARE * itl_ms / 1e3 if itl_ms else None,
                  stretched_step_seconds(stats.step_cost, sc.max_decode_slowdown, stats.num_running,
                                         stats.running_context_tokens)]
        model = predict_ttft(new_tokens, [under_way, *ahead], stats.num_running, stats.running_context_tokens,
                             stats.step_cost, min((x for x in limits if x is not None), default=None),
                             sc.max_num_batched_tokens)
        return None if model is None else max(model + self.ttft_bias.get(priority, 0.0), 0.0)

    def learn(self, state: RequestState) -> None:
        """A request's first token came: move the prediction's bias toward the error it made."""
        m = state.metrics
        if state.predicted_ttft is None or state.ttft_learned or m.first_token_time is None:
            return
        state.ttft_learned = True
        error = m.first_token_time - m.arrival_time - state.predicted_ttft
        p = state.params.priority
        self.ttft_bias[p] = self.ttft_bias.get(p, 0.0) + TTFT_BIAS_RATE * max(-TTFT_BIAS_CLIP_S,
                                                                              min(error, TTFT_BIAS_CLIP_S))

    def admit(self, params: SamplingParams, predicted: float | None) -> SamplingParams:
        """A request whose predicted TTFT is past its target is refused now (reject: 429 with a Retry-After of the
        predicted wait), or runs one priority level lower (degrade); off: admitted as it is."""
        target = params.slo_ttft_ms or self.config.slo_ttft_ms
        if self.mode == "off" or predicted is None or not target or predicted <= target / 1e3:
            return params
        if self.mode == "degrade":
            return replace(params, priority=params.priority + 1)
        raise ServerOverloaded(f"the predicted time to first token is {predicted:.2f} s, past this request's target "
                               f"of {target:g} ms (slo_ttft_ms); retry later", retry_after=math.ceil(predicted))
