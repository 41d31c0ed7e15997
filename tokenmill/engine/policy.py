"""Scheduling policies the scheduler consults (plain Python, no tensors): in what order running requests are served
and waiting ones admitted, whom to preempt, and what one step may carry under inter-token latency targets.

- `FcfsPolicy` (`continuous`): first come first served; with prefix caching and a short queue, longest cached
  prefix first (SGLang's LPM), a request passed over LPM_MAX_SKIPS times going first.
- `StaticPolicy` (`static`): FCFS order, but a fixed batch is admitted only when the previous one has ended.
- `PriorityPolicy` (`priority`): requests ranked by (priority - waited / aging, arrival); best first everywhere.
  Among equal levels, admission goes by TTFT slack: requests that can still meet their target, least slack first,
  then those that cannot (their target is lost, serving them first would make others miss theirs too), then those
  without a target. A waiting request displaces running ones only from a strictly better level, so arrival order
  alone never preempts and no two requests preempt each other back and forth; aging bounds every wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from tokenmill.engine.step_cost import StepCost, attention_pairs, stretched_step_seconds
from tokenmill.request import Request, RequestStatus

LPM_MAX_QUEUE = 128  # longest waiting queue ranked by cached prefix; longer ones are served first come first
LPM_MAX_SKIPS = 16  # a waiting request overtaken this many times is tried first

# of an ITL target, the share a step's model pass may take: the rest goes to scheduling, sampling's host side, the
# output's trip to the API process and the stream (measured at 150 ms: without this margin TPOT p50 came to 165 ms)
ITL_STEP_SHARE = 0.8
# when an ITL target leaves no time at all for prompts (its decodes alone overrun it), a step still gives this many
# prompt tokens, so prefills crawl on instead of waiting for every decode with a target to end
MIN_PROGRESS_TOKENS = 16


def aged_level(priority: int, arrival_time: float, now: float, aging_s: float) -> int:
    """A request's priority level now: it gains a level per `aging_s` since it arrived."""
    return priority - int(max(now - arrival_time, 0.0) / aging_s)


def rank(request: Request, now: float, aging_s: float) -> tuple[int, float]:
    """Policy priority: smaller runs first; among equal levels, the earlier arrival."""
    return aged_level(request.priority, request.arrival_time, now, aging_s), request.arrival_time


def prefill_seconds(request: Request, cost: StepCost | None) -> float:
    """The predicted time of the request's remaining prompt in one step (0 before the cost is known)."""
    if cost is None:
        return 0.0
    todo = max(request.num_tokens - request.num_computed_tokens, 0)
    return cost.fixed + cost.chunk_seconds(todo, request.num_computed_tokens)


def prefill_finish_key(request: Request, left: int, computed: int, cost: StepCost | None) -> float:
    """Which long prefill goes first (the smaller key): the one that would finish its prompt first had it run
    alone from its arrival, arrival + the predicted time of its `left` tokens after `computed` ones. Among prompts
    that arrive together that is the fewest tokens left first, which keeps short prompts' TTFT low; but a prompt
    is overtaken only by ones that arrive before its own virtual finish, so a stream of shorter arrivals cannot
    starve it, as pure fewest-left-first did (ShareGPT at 64 streams: prompts over 500 tokens waited 8 s at the
    median, up to 17 s).
    Before the step cost is fitted: the tokens left."""
    if cost is None:
        return float(left)
    return request.arrival_time + cost.chunk_seconds(left, computed)


def ttft_slack(request: Request, now: float, cost: StepCost | None) -> float:
    """Seconds to spare before the request's TTFT target, after its predicted prefill (inf: no target)."""
    if request.ttft_target is None:
        return float("inf")
    return request.arrival_time + request.ttft_target - now - prefill_seconds(request, cost)


class FcfsPolicy:
    """First come, first served (`--scheduling-policy continuous`)."""

    admits_while_running = True  # continuous batching: waiting requests join running ones every step
    ranked = False

    def level(self, request: Request, now: float) -> int:
        """The request's priority level now (one level for all: first come first served)."""
        return 0

    def order_running(self, running: list[Request], now: float) -> list[Request]:
        return list(running)

    def victim(self, candidates: Sequence[Request], now: float) -> int:
        """Index of the request to preempt when blocks run out: the latest arrival."""
        return len(candidates) - 1

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        """Whether a waiting request may preempt a running one to take its seat or blocks."""
        return False

    def protects(self, request: Request) -> bool:
        """Whether a decoding request's tokens are reserved in a step capped by an ITL target."""
        return True

    def admission_order(self, waiting: Iterable[Request], now: float, cached_prefix_len, cost: StepCost | None,
                        ) -> list[tuple[int, Request]]:
        """Waiting requests with their queue positions, in the order to try them. `cached_prefix_len(request)`
        gives a request's cached prefix length, or is None without prefix caching."""
        order = list(enumerate(waiting))
        if cached_prefix_len is None or len(order) < 2 or len(order) > LPM_MAX_QUEUE:
            return order  # on a long queue ranking costs more than it saves
        cached = {id(r): cached_prefix_len(r) for _, r in order}
        return sorted(order, key=lambda e: (e[1].num_skips < LPM_MAX_SKIPS, -cached[id(e[1])], e[0]))


def count_skips(queue: list[Request]) -> None:
    """After admission: each request of the waiting `queue` that someone later in it went before was overtaken once
    more (the bound on how long the cached-prefix order may pass a request over)."""
    last = max((i for i, r in enumerate(queue) if r.status is RequestStatus.RUNNING), default=0)
    for req in queue[:last]:
        if req.status is not RequestStatus.RUNNING:
            req.num_skips += 1


class StaticPolicy(FcfsPolicy):
    """Static batching (`--scheduling-policy static`), kept so its cost can be measured."""

    admits_while_running = False


class PriorityPolicy(FcfsPolicy):
    """Lower `priority` first, aging bounding waits (`--scheduling-policy priority`)."""

    ranked = True

    def __init__(self, aging_s: float):
        self.aging_s = aging_s

    def rank(self, request: Request, now: float) -> tuple[int, float]:
        return rank(request, now, self.aging_s)

    def level(self, request: Request, now: float) -> int:
        return self.rank(request, now)[0]

    def order_running(self, running: list[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: self.rank(r, now))

    def victim(self, candidates: Sequence[Request], now: float) -> int:
        return max(range(len(candidates)), key=lambda j: self.rank(candidates[j], now))

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        return self.rank(waiting, now)[0] < self.rank(running, now)[0]

    def protects(self, request: Request) -> bool:
        return request.itl_target is not None  # served first when it ranks first; others may wait a step

    def admission_order(self, waiting: Iterable[Request], now: float, cached_prefix_len, cost: StepCost | None,
                        ) -> list[tuple[int, Request]]:
        def key(entry: tuple[int, Request]):
            pos, req = entry
            slack = ttft_slack(req, now, cost)
            group = 0 if 0 <= slack < float("inf") else 1 if slack < 0 else 2  # can meet, cannot, no target
            return self.rank(req, now)[0], group, slack if group == 0 else 0.0, pos
        return sorted(enumerate(waiting), key=key)


def prefill_tokens_by_level(running: list[Request], policy: FcfsPolicy) -> dict[int, int]:
    """Prompt tokens running requests still have to compute, by their priority level now (all level 0 unless the
    policy ranks): what a new request's first token waits behind besides the waiting queue."""
    now, by_level = time.monotonic(), {}
    for r in running:
        todo = r.num_prompt_tokens - r.num_computed_tokens
        if todo > 0:
            level = policy.level(r, now)
            by_level[level] = by_level.get(level, 0) + todo
    return by_level


def make_policy(name: str, aging_s: float) -> FcfsPolicy:
    if name == "priority":
        return PriorityPolicy(aging_s)
    return StaticPolicy() if name == "static" else FcfsPolicy()


class StepBudget:
    """What one step may still carry: tokens, and under an ITL target seconds of predicted step time. The decodes
    the target protects are reserved up front, so they always fit; other chunks get what time is left, costed by
    where they sit in their context (a chunk deep into a long prompt costs more per token)."""

    def __init__(self, tokens: int, seconds: float | None = None, cost: StepCost | None = None,
                 reserved: Iterable[Request] = ()):
        self.tokens = tokens
        self.cost = cost
        self.seconds = seconds if cost is not None else None
        self._reserved: set[str] = set()
        self._moved = False  # a chunk besides the reserved decodes has been given tokens this step
        if self.seconds is not None:
            self.seconds -= cost.fixed
            for r in reserved:
                self._reserved.add(r.request_id)
                self.seconds -= cost.chunk_seconds(1 + len(r.spec_token_ids), r.num_computed_tokens)

    @property
    def left(self) -> bool:
        return self.tokens > 0

    def tokens_that_fit(self, request: Request, n: int, start: int) -> int:
        """The most of `n` tokens of `request`'s chunk starting after `start` computed tokens that fit (nothing is
        taken: see `take`)."""
        n = min(n, self.tokens)
        if self.seconds is None or (request.request_id in self._reserved and start == request.num_computed_tokens):
            return max(n, 0)
        fits = self.cost.max_chunk_within(self.seconds, start)
        if fits <= 0 and not self._moved:
            fits = MIN_PROGRESS_TOKENS
        return max(min(n, fits), 0)

    def take(self, request: Request, n: int, start: int) -> None:
        self.tokens -= n
        if self.seconds is None:
            return
        if request.request_id in self._reserved and start == request.num_computed_tokens:
            self._reserved.discard(request.request_id)  # paid for up front
        else:
            self.seconds -= self.cost.chunk_seconds(n, start)
            self._moved = self._moved or n > 0


def step_budget(running: list[Request], tokens: int, policy: FcfsPolicy, prefill_cap: int | None,
                cost: StepCost | None, slowdown: float | None = None, num_waiting: int = 0) -> StepBudget:
    """The step's budget under the caps that keep decodes' inter-token latency: a fixed number of prompt tokens
    besides them (--max-prefill-tokens-while-decoding); the measured step cost within ITL_STEP_SHARE of the
    smallest ITL target of the requests decoding, less the cost's recent overrun (the decodes policy.protects
    always fit); and within `slowdown` times the decodes' own step (--max-decode-slowdown: every decode fits),
    whichever is tighter. The slowdown grows with the prompts per decode, `slowdown` x (1 + prompts / decodes),
    prompts counting those waiting (`num_waiting`) and those under way: the stretch is paid once by each decode, the
    hold-back by each prompt, so a steady stream of arrivals keeps `slowdown` while a wave of them (a burst, or
    many requests ending at once and their successors arriving) is prefilled in long steps. With a fixed 3x, 64
    ShareGPT streams on Zen 4 waited 10-13 s for a first token (TTFT p50) against 1.6-2.1 s (BENCHMARKS.md, the
    --max-decode-slowdown measurements)."""
    decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
    if not decoding:
        return StepBudget(tokens)
    if prefill_cap is not None:
        tokens = min(tokens, sum(1 + len(r.spec_token_ids) for r in decoding) + prefill_cap)
    if cost is None:
        return StepBudget(tokens)
    seconds, reserved = None, []
    target = min((r.itl_target for r in decoding if r.itl_target), default=None)
    if target is not None:
        seconds, reserved = target * ITL_STEP_SHARE / cost.overrun, [r for r in decoding if policy.protects(r)]
    if slowdown:  # a stretched step costs every decode some ITL, and holding prompts back costs each their TTFT
        slowdown *= 1 + (num_waiting + len(running) - len(decoding)) / len(decoding)
    stretched = slowdown and stretched_step_seconds(  # the sums only when the slowdown is on
        cost, slowdown, sum(1 + len(r.spec_token_ids) for r in decoding),
        sum(attention_pairs(1 + len(r.spec_token_ids), r.num_computed_tokens) for r in decoding))
    if stretched and (seconds is None or stretched < seconds):
        seconds, reserved = stretched, decoding
    return StepBudget(tokens) if seconds is None else StepBudget(tokens, seconds, cost, reserved)


