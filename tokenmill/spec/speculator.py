"""Who speculates each step, and how far: the engine core asks after every step, the proposer guesses, and the
drafts ride on the requests (`Request.spec_token_ids`) into the next step's schedule.

Rules, plain Python:
- only a request that is decoding (its prompt done) and has not opted out (`SamplingParams.speculate`);
- never past the request's end: k <= max_tokens - tokens out - 1, so a verify pass never samples past max_tokens;
- only where it pays: verifying k drafts costs k more tokens of compute per request. The engine's measured step
  times (engine/step_cost.py) say what acceptance a draft token needs to raise tokens/s at the current batch; a request
  whose recent acceptance is below that does not speculate (every PROBE_EVERY-th step it does once, to measure
  again). A small batch is mostly fixed cost, so speculation almost always pays there; a compute-bound one pauses.
  `disable_by_batch_size` (vLLM's option) is a hard cap on top: no speculation while more requests run;
- per request, k follows its acceptance: a request whose drafts keep failing proposes fewer (down to one, so it
  can recover), one whose drafts are accepted goes back up to the configured k.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.hooks import RequestHooks
from tokenmill.engine.step_cost import StepCostModel
from tokenmill.request import Request

from tokenmill.spec.ngram import propose_ngram

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.engine.step_types import SchedulerOutput, StepResult
    from tokenmill.spec.draft_model import DraftTarget

log = logging.getLogger("tokenmill")

PROBE_EVERY = 16  # a request passed over this many times speculates once, to measure its acceptance again
PRIOR_ACCEPTANCE = 0.5  # a request's acceptance before it has any: the engine's recent average, or this
EMA = 0.3  # weight of the newest verify pass in a request's acceptance estimate


class Proposer(Protocol):
    lookahead: int  # KV slots past the scheduled tokens the proposer writes (a draft model's own KV)
    # by request, the distributions q [drafts, V] its last drafts were drawn from (a draft model sampling), for the
    # rejection sampler; none where drafts are point masses (greedy, n-gram)
    draft_probs: dict[str, Any]

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]: ...
    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    lookahead = 0

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.draft_probs: dict[str, Any] = {}  # always empty: a looked-up draft is a point mass

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [propose_ngram(r.prompt_token_ids + r.output_token_ids, k, self.min_n, self.max_n)
                for r, k in zip(requests, ks)]

    def forget(self, request_id: str) -> None:
        pass


class Speculator(RequestHooks):
    """Also the engine core's hooks (engine/hooks.py): after each step it learns from the verify passes and
    proposes the next drafts of the requests still running; a preempted or ended request is forgotten."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cost: StepCostModel | None = None,
                 scheduler: Scheduler | None = None):
        self.config, self.proposer, self.cost = config, proposer, cost
        self.scheduler = scheduler  # whose running requests speculate (None: a test proposes by hand)
        self._verified: list[tuple[str, int, int]] = []  # this step's verify passes: (request, drafts, accepted)
        self.max_batch = config.disable_by_batch_size  # None: no cap, the cost model decides
        self.k: dict[str, int] = {}  # per request: how many drafts it proposes now (adaptive)
        self.acceptance: dict[str, float] = {}  # per request: recent acceptance rate (EMA)
        self.passed_over: dict[str, int] = {}  # per request: steps it could have speculated and did not
        self.mean_acceptance = PRIOR_ACCEPTANCE  # over all requests (EMA): the prior of a new request
        self.proposer_seconds = 0.0  # the proposer's time per draft position (EMA): a draft model's forward passes

    def describe(self) -> str:
        c = self.config
        how = (f"n-gram prompt lookup (n {c.prompt_lookup_min}..{c.prompt_lookup_max})" if c.method == "ngram"
               else f"draft model {c.model}" + (f" ({c.quantization})" if c.quantization else ""))
        cap = f"; never while more than {self.max_batch} requests run" if self.max_batch else ""
        return (f"speculative decoding: {how}, up to {c.num_speculative_tokens} draft tokens a step, where the "
                f"measured step cost says it pays{cap}")

    @property
    def lookahead(self) -> int:
        return self.proposer.lookahead

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of the running requests that should speculate in the next step."""
        if self.max_batch is not None and len(running) > self.max_batch:
            return
        needed = (self.cost.break_even_acceptance(len(running), self.proposer_seconds)
                  if self.cost is not None else 0.0)
        chosen, ks = [], []
        for r in running:
            if r.status.finished or not r.params.speculate or r.num_tokens - r.num_computed_tokens != 1:
                continue
            k = min(self.k.get(r.request_id, self.config.num_speculative_tokens),
                    r.max_tokens - r.num_output_tokens - 1)
            if k <= 0:
                continue
            rid = r.request_id
            if self.acceptance.get(rid, self.mean_acceptance) < needed:
                self.passed_over[rid] = self.passed_over.get(rid, 0) + 1
                if self.passed_over[rid] < PROBE_EVERY:
                    continue
            self.passed_over.pop(rid, None)
            chosen.append(r)
            ks.append(k)
        if chosen:
            start = time.perf_counter()
            try:
                proposals = self.proposer.propose(chosen, ks)
            except Exception:  # drafts are optional: the step goes on without them, no request fails
                log.exception("the %s proposer failed; these requests decode without drafts this step",
                              self.config.method)
                for r in chosen:
                    self.proposer.forget(r.request_id)  # a draft model recomputes its KV for them from the start
                return
            for r, drafts in zip(chosen, proposals):
                r.spec_token_ids = drafts
            per_position = (time.perf_counter() - start) / max(ks)
            self.proposer_seconds = (1 - EMA) * self.proposer_seconds + EMA * per_position

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """After a verify pass: the request's acceptance estimate moves; all accepted -> one more draft next time
        (up to k); none -> half as many."""
        if not num_drafts:
            return
        rate = num_accepted / num_drafts
        prior = self.acceptance.get(request_id, self.mean_acceptance)
        self.acceptance[request_id] = (1 - EMA) * prior + EMA * rate
        self.mean_acceptance = (1 - EMA / 4) * self.mean_acceptance + EMA / 4 * rate
        k = self.k.get(request_id, self.config.num_speculative_tokens)
        if num_accepted == num_drafts:
            k = min(k + 1, self.config.num_speculative_tokens)
        elif num_accepted == 0:
            k = max(1, k // 2)
        self.k[request_id] = k

    def forget(self, request_id: str) -> None:
        self.k.pop(request_id, None)
        self.acceptance.pop(request_id, None)
        self.passed_over.pop(request_id, None)
        self.proposer.forget(request_id)

    # ---- RequestHooks ------------------------------------------------------------------------------------------
    def before_execute(self, sched: SchedulerOutput) -> None:
        """Hand the runner the distributions of the drafts each request verifies this step (a draft model's, when
        sampling); a request scheduled without its drafts drops them (the next proposal replaces them anyway)."""
        probs = self.proposer.draft_probs
        if probs:
            for s in sched.scheduled:
                q = probs.pop(s.request.request_id, None)
                if q is not None and s.num_spec_tokens:
                    sched.draft_probs[s.request.request_id] = q

    def after_execute(self, sched: SchedulerOutput, result: StepResult) -> None:
        """What each verify pass accepted, read before the scheduler advances the requests (drafts are what a
        chunk computes past the committed tokens)."""
        self._verified = [(s.request.request_id, s.num_spec_tokens, len(got.token_ids) - 1) for s in sched.scheduled
                          if s.num_spec_tokens and (got := result.sampled.get(s.request.request_id)) is not None]

    def after_update(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        for request_id, drafts, accepted in self._verified:
            self.observe(request_id, drafts, accepted)
        self._verified = []
        if self.scheduler is not None:
            self.propose(self.scheduler.running)  # the ended and the preempted have left it
        return []

    def on_preempt(self, request: Request) -> None:
        self.forget(request.request_id)  # its KV is gone: a draft model starts it over

    def on_release(self, request_id: str) -> None:
        self.forget(request_id)

    @property
    def allows_runs(self) -> bool:
        return False  # drafts are proposed and verified step by step

    def check_idle(self) -> None:
        assert not (self.k or self.acceptance or self.passed_over or self.proposer.draft_probs), \
            "speculation state outlived its requests"


def build_speculator(config: SpeculativeConfig, target: DraftTarget | None = None,
                     cost: StepCostModel | None = None, scheduler: Scheduler | None = None) -> Speculator:
    """The speculator for `config`; a draft model is loaded beside the target (spec/draft_model.py)."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config), cost, scheduler)
    from tokenmill.spec.draft_model import DraftModelProposer

    if target is None:
        raise ValueError("a draft model needs its target (DraftTarget)")
    return Speculator(config, DraftModelProposer.load(config, target), cost, scheduler)
