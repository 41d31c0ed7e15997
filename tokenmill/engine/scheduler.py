"""Continuous batching with chunked prefill and recompute preemption, scheduling by tokens, not phases.

Each step hands out a token budget in three phases, so that one long prompt cannot hold every step:
  A. Running requests in order: a decode takes one token, an unfinished prefill a chunk of what is left. A prefill
     with more than `long_prefill_token_threshold` (T) tokens left is long: long ones share T tokens here (in
     practice the oldest gets T, so none starves).
  B. Waiting requests, in admission order. A long prompt is admitted, with a first chunk of T, only if it goes
     before every long prefill under way; otherwise it is passed over this step and the requests behind it go on
     being admitted (so a burst of equal long prompts is prefilled one at a time, not all half-done). Long ones go
     in order of their virtual finish, arrival + predicted time of the tokens left (policy.prefill_finish_key):
     fewest tokens left first among prompts that arrive together, but no one is overtaken by later arrivals
     forever.
  C. What budget is left goes back to the long chunks capped in A and B, in the same order (their blocks
     grow by `allocate_slots`; a chunk the pool cannot grow stays as it is: this phase never preempts); if they all
     reach their end, what still remains goes to the long prompts passed over in B, uncapped.
So a short request arriving behind a long prefill starts in the very next step, a mid-sized one finishes its
prompt before the long one does, and with no one else to serve a long prefill still gets the whole budget
(throughput unchanged).
A request whose computed tokens reach its known tokens gets a new token sampled. When blocks run out in phase A,
the most recent arrival is preempted (blocks freed, to be recomputed later), and a step that preempted admits no
one and grows no chunk. With T >= max_num_batched_tokens the first long prefill takes the whole budget as before
sharing existed. The `static` policy admits a fixed batch only when the previous one has fully finished, and its
chunks are not shared (T = the budget). With prefix caching a request's computed tokens start at its cached
prefix, and the waiting queue is ranked by cached prefix length (bounded so no one starves).
Speculative decoding rides on the same rule: a decoding request's known tokens include its draft tokens, so it is
scheduled 1 + k tokens (the budget may cut drafts off); `update` keeps the accepted ones and rolls computed tokens
back over the rejected ones, whose KV slots the next step overwrites. A draft model writes its own KV a few
positions ahead of the target (`lookahead`), so each allocation makes room for that many more.

Multi-step decode (`max_steps` > 1): a few plain decodes may run several tokens in a row (engine/multi_step.py);
`update` then takes several tokens per request, as after a verify pass, and stops at the one that ends a request.

Latency targets and priorities (any policy): while requests with an inter-token latency target decode, a step
carries no more than the measured step cost (engine/step_cost.py) fits within the smallest target: the decodes it
protects are reserved first, and each chunk is costed where it sits in its context. The order of service, of
admission and of preemption is the policy's (engine/policy.py): under `priority` running requests are served and
waiting ones admitted best ranked first, a request short of blocks preempts the worst-ranked one, and the best
waiting request preempts running ones of a worse priority level when it needs a seat or blocks.
Admission keeps KV headroom for decode growth (SGLang's new-token ratio): a request joins only if the pool keeps
room for the prompts under way and `new_token_ratio` of the output tokens running requests may still write; the
ratio decays while nothing is preempted for blocks and goes back up when something is.
"""

from __future__ import annotations

import time
from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.multi_step import run_length
from tokenmill.engine.policy import (
    StepBudget,
    count_skips,
    make_policy,
    prefill_finish_key,
    prefill_tokens_by_level,
    step_budget,
)
from tokenmill.engine.prefix_cache import computed_by_others
from tokenmill.engine.step_cost import StepCost, StepCostModel
from tokenmill.engine.step_types import SampledTokens, ScheduledRequest, SchedulerOutput, SchedulerStats
from tokenmill.request import Request, RequestStatus
from tokenmill.spec_stats import SpecDecodeStats

NEW_TOKEN_RATIO_FLOOR = 1 / 7  # of the configured ratio: where its decay stops (SGLang's 0.7 -> 0.1)
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # steps from the configured ratio down to the floor


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, *, step_cost: StepCostModel | None = None,
                 lookahead: int = 0, spec_stats: SpecDecodeStats | None = None):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefill_tokens_computed = 0  # prompt (and recomputed) tokens run through the model: not cache hits
        self.lookahead = lookahead  # KV slots past the scheduled tokens a draft model writes
        self.max_steps = 1  # multi-step decode: up to this many tokens a step for small decode batches (limit_runs)
        self.spec_stats = spec_stats  # counted in `update` when speculation is on
        self.step_cost = step_cost  # measured step times: a step's size within an ITL target
        self.preemptions_by_cause = {"blocks": 0, "priority": 0}
        self.leaked_blocks = 0
        self._leaks_counted = True  # leaked_blocks counted since the last request came
        self.policy = make_policy(config.policy, config.priority_aging_s)
        self.new_token_ratio = config.new_token_ratio
        # None: a quarter of the budget (three quarters stay for newcomers; a long prefill keeps at least a quarter
        # while others compete, all of it otherwise), and at least one KV block
        self.long_prefill_threshold = (config.long_prefill_token_threshold
                                       or max(config.max_num_batched_tokens // 4, kv.block_size))

    # ---- requests ------------------------------------------------------------------------------------
    def limit_runs(self, max_steps: int) -> None:
        """Multi-step decode: up to `max_steps` decodes in a row this step (1: none; engine/multi_step_hook.py)."""
        self.max_steps = max_steps

    def add_request(self, request: Request) -> None:
        """Queue a request that passed admission (engine/admission.py): it fits the context window and the pool."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._leaks_counted = False

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return None
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.monotonic()
        policy = self.policy
        admitting = policy.admits_while_running  # continuous batching (first come first served, or by rank)
        tokens = self.config.max_num_batched_tokens
        threshold = self.long_prefill_threshold if admitting else tokens
        share = threshold  # what running prefills longer than the threshold may take in phase A
        capped: list[ScheduledRequest] = []  # their chunks, grown in phase C
        self._decay_new_token_ratio()

        if not admitting and not self.running:
            self._form_static_batch(now)
        if policy.ranked and self.waiting:
            self._preempt_for_priority(out, now, threshold)
        cost = self.step_cost.fitted if self.step_cost is not None else None
        budget = (step_budget(self.running, tokens, policy, self.config.max_prefill_tokens_while_decoding, cost,
                              self.config.max_decode_slowdown, len(self.waiting))
                  if admitting else StepBudget(tokens))
        running = policy.order_running(self.running, now)
        short_of_blocks = False
        i = 0
        while i < len(running) and budget.left:  # phase A
            req = running[i]
            start = req.num_computed_tokens
            todo = req.num_tokens_with_spec - start
            n = budget.tokens_that_fit(req, min(todo, share) if todo > threshold else todo, start)
            while not self.kv.allocate_slots(req, n + self.lookahead):
                # the latest arrival (or the worst ranked) among those not yet served this step
                victim = running.pop(i + policy.victim(running[i:], now))
                self._preempt(victim, "blocks")
                out.preempted.append(victim)
                short_of_blocks = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget.take(req, n, start)
                if todo > threshold:
                    share -= n
                    capped.append(out.scheduled[-1])
                i += 1

        if not short_of_blocks:
            queue = list(self.waiting)  # before admission, to count who was overtaken
            passed_over = False
            if admitting:  # phase B
                passed_over = self._admit_waiting(out, budget, now, threshold, capped)
            self._grow(budget, capped)  # phase C
            if passed_over and budget.left and all(s.samples_next_token for s in capped):
                self._admit_waiting(out, budget, now, None, capped)
            count_skips(queue)
        if self.kv.snapshots is not None:  # a hybrid's prefix caching: states copied at block boundaries
            self.kv.plan_snapshots(out.scheduled)
        out.scheduled = [s for s in out.scheduled if s.num_new_tokens]  # chunks phase A left for C, or out of time
        if self.max_steps > 1 and out.scheduled:
            out.num_steps = run_length(out, self.kv, self.max_steps, self.lookahead, bool(self.waiting))
        return out

    def _decay_new_token_ratio(self) -> None:
        top = self.config.new_token_ratio
        step = top * (1 - NEW_TOKEN_RATIO_FLOOR) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = max(self.new_token_ratio - step, top * NEW_TOKEN_RATIO_FLOOR)

    def _preempt_for_priority(self, out: SchedulerOutput, now: float, first_chunk: int) -> None:
        """The best-ranked waiting request takes the place of running ones of a worse level, worst first, while it
        lacks a seat (max_num_seqs) or the blocks of its first chunk."""
        policy = self.policy
        best = self.waiting[policy.admission_order(self.waiting, now, None, None)[0][0]]
        need = self.kv.pages_needed(min(best.num_tokens, first_chunk) + self.lookahead)
        while self.running:
            if len(self.running) < self.config.max_num_seqs and self.kv.num_free_blocks >= need:
                return
            worst = self.running[policy.victim(self.running, now)]
            if not policy.displaces(best, worst, now):
                return
            self._preempt(worst, "priority")
            out.preempted.append(worst)

    def _expected_growth(self, request: Request) -> int:
        """KV token slots a request is expected to still need (KVCacheManager.growth_cost): for its prompt's rest
        and new_token_ratio of the output tokens it may still write."""
        tokens = (max(request.num_prompt_tokens - request.num_computed_tokens, 0)
                  + int(self.new_token_ratio * (request.max_tokens - request.num_output_tokens)))
        return self.kv.growth_cost(request.num_computed_tokens, tokens)

    def _has_headroom(self, request: Request, todo: int, now: float, growth: list[tuple[int, int]]) -> bool:
        """Whether admitting `request` (`todo` tokens to compute) leaves the pool room for the expected growth of
        the running requests it could not displace (those at its priority level or better) and its own; always
        with nothing running or the ratio 0. `growth`: (level, expected growth) of each running request, made once
        per admission pass."""
        if not growth:
            return True
        level = self.policy.level(request, now)
        kept = sum(g for lv, g in growth if lv <= level)
        own = self.kv.growth_cost(request.num_tokens - todo,
                                  todo + int(self.new_token_ratio * (request.max_tokens - request.num_output_tokens)))
        return self.kv.num_free_blocks * self.kv.block_size - kept >= own

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget, now: float, threshold: int | None,
                       capped: list[ScheduledRequest]) -> bool:
        """Admit waiting requests while the budget, the sequence limit, the pool and its headroom for decode growth
        allow; return whether a long prompt was passed over. A prompt longer than `threshold` (None: no limit) gets
        a first chunk of `threshold` tokens if it goes before every capped (long) prefill (prefill_finish_key),
        else it is passed over. A request whose next uncached block a running prefill is computing right now waits a
        step, then shares it instead."""
        prefilling = ([r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
                      if self.kv.prefix_caching else [])
        passed_over = False
        cached_len = self.kv.cached_prefix_len if self.kv.prefix_caching else None
        headroom = bool(self.config.new_token_ratio)
        growth = [(self.policy.level(r, now), self._expected_growth(r)) for r in self.running] if headroom else []
        cost = self.step_cost.fitted if self.step_cost is not None else None
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        for _, req in self.policy.admission_order(self.waiting, now, cached_len, cost):
            if not budget.left or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._adapter_fits(req, adapters):
                continue
            match = self.kv.match(req)
            # cached: the prefix this request will not compute (a cache hit, then KV from a producer)
            cached = (len(match.blocks) * self.kv.block_size if match else 0) + self.kv.num_loaded(req, match)
            if (prefilling and not req.computes_whole_prompt and not req.num_external_tokens
                    and computed_by_others(req, cached, prefilling, self.kv.block_size)):
                continue
            todo = req.num_tokens - cached
            long = threshold is not None and todo > threshold
            if long and any(prefill_finish_key(req, todo, cached, cost) >= self._finish_key(s, cost)
                            for s in capped):  # its turn comes after theirs
                passed_over = True
                continue
            n = budget.tokens_that_fit(req, min(todo, threshold) if long else todo, cached)
            if (n <= 0 or not self._has_headroom(req, todo, now, growth)
                    or not self.kv.admit(req, match, n, self.lookahead)):
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or now
            self.running.append(req)
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            if headroom:
                growth.append((self.policy.level(req, now), self._expected_growth(req)))
            out.scheduled.append(ScheduledRequest(req, n))
            budget.take(req, n, cached)
            if long:
                capped.append(out.scheduled[-1])
            if self.kv.prefix_caching and req.num_tokens - req.num_computed_tokens > 1:
                prefilling.append(req)
        return passed_over

    def _adapter_fits(self, request: Request, adapters: set[str]) -> bool:
        """Whether the running requests' adapters stay within the model's slots (max_loras) with this one's."""
        name = request.lora_name
        return name is None or name in adapters or len(adapters) < self.config.max_loras

    def _grow(self, budget: StepBudget, capped: list[ScheduledRequest]) -> None:
        """Phase C: give the budget left to the capped long prefills in prefill_finish_key order; only the extra
        blocks are allocated, and a chunk the pool cannot grow stays as it is (no preemption here)."""
        cost = self.step_cost.fitted if self.step_cost is not None else None
        for s in sorted(capped, key=lambda s: self._finish_key(s, cost)):
            if not budget.left:
                break
            start = s.request.num_computed_tokens + s.num_new_tokens
            extra = budget.tokens_that_fit(s.request, s.num_left, start)
            if extra > 0 and self.kv.allocate_slots(s.request, s.num_new_tokens + extra + self.lookahead):
                s.num_new_tokens += extra
                budget.take(s.request, extra, start)

    @staticmethod
    def _finish_key(s: ScheduledRequest, cost: StepCost | None) -> float:
        """A capped prefill's prefill_finish_key after this step's chunk."""
        return prefill_finish_key(s.request, s.num_left, s.request.num_computed_tokens + s.num_new_tokens, cost)

    def _form_static_batch(self, now: float) -> None:
        """Static batching: a fixed batch joins together and no one else joins until all of it has ended."""
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if not self._adapter_fits(self.waiting[0], adapters):
                break
            req = self.waiting.popleft()
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            self.kv.admit(req, self.kv.match(req), 0, 0)  # takes only its cached prefix: always fits
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or now
            self.running.append(req)

    def _preempt(self, request: Request, cause: str = "blocks") -> None:
        self.preemptions_by_cause[cause] += 1
        if cause == "blocks" and self.config.new_token_ratio:  # admitted too much: keep more headroom again
            self.new_token_ratio = min(1.0, max(self.config.new_token_ratio, self.new_token_ratio + 0.1))
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.pending_load = None  # never loaded: recomputed like the rest
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward pass ------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, SampledTokens]) -> list[Request]:
        """Advance computed tokens, append sampled tokens; return the requests that finished this step.
        A verify pass (drafts scheduled) brings the accepted drafts and one more token: computed tokens go back
        over the rejected drafts. Tokens past the one that ends a request (EOS, stop id, length) are dropped from
        `sampled` too, so the caller reports only what was appended."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:  # aborted while its step ran
                continue
            self.kv.state_loaded(req)
            drafts = s.num_spec_tokens
            if not drafts and (s.num_new_tokens > 1 or not req.output_token_ids):
                self.num_prefill_tokens_computed += s.num_new_tokens
            req.num_computed_tokens += s.num_new_tokens
            req.spec_token_ids = []
            got = sampled.get(req.request_id)
            if out.num_steps > 1 and got is not None:  # each token after the first was fed back, so computed
                req.num_computed_tokens += len(got.token_ids) - 1
                # a run cut short (its sampling failed) leaves slots allocated for tokens never computed
                self.kv.trim(req, req.num_computed_tokens + 1)
            if drafts:
                accepted = len(got.token_ids) - 1 if got is not None else 0
                req.num_computed_tokens -= drafts - accepted
                # slots of rejected drafts go back; kept: the next token's, and those a draft model writes ahead
                self.kv.trim(req, req.num_computed_tokens + 1 + self.lookahead)
                if self.spec_stats is not None:
                    self.spec_stats.observe(drafts, accepted)
            for i, token in enumerate(got.token_ids if got is not None else ()):
                req.output_token_ids.append(token)
                if req.check_stop():
                    got.truncate(i + 1)
                    # accepted drafts after the end were computed but are not the request's: not cached either
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    self._finish(req)  # caches its full blocks
                    finished.append(req)
                    break
            else:  # accepted drafts are computed but only committed now: cache after appending
                self.kv.cache_blocks(req)
                self.kv.slide_window(req)
        return finished

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str | None = None) -> None:
        """Finish from outside the step (a stop string found by the detokenizer)."""
        req = self.requests.get(request_id)
        if req is not None and not req.status.finished:
            req.status = status
            req.stop_reason = stop_reason
            self._finish(req)

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def stats(self) -> SchedulerStats:
        if not self.requests and not self._leaks_counted:  # idle again: whatever is still held leaked
            self.leaked_blocks, self._leaks_counted = self.kv.pool.num_held_blocks(), True
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
            kv_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions,
            num_prefill_tokens_computed_total=self.num_prefill_tokens_computed,
            prefix_cache=self.kv.prefix_cache_stats(),
            spec_decode=self.spec_stats.copy() if self.spec_stats is not None else None,
            preemptions_by_cause=dict(self.preemptions_by_cause),
            step_cost=self.step_cost.fitted if self.step_cost is not None else None,
            running_context_tokens=sum(r.num_computed_tokens for r in self.running),
            prefill_tokens_by_level=prefill_tokens_by_level(self.running, self.policy),
            new_token_ratio=self.new_token_ratio,
            leaked_blocks=self.leaked_blocks,
            num_requeued=len(requeued := [r for r in self.waiting if r.first_scheduled_time is not None]),
            num_requeued_tokens=sum(r.num_tokens - r.num_computed_tokens for r in requeued),
        )
