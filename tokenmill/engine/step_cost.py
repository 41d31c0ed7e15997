"""What a step costs on this machine, now: step time ~ fixed + per_token x tokens + per_pair x attention pairs,
fitted online by exponentially weighted least squares from the engine's own measured steps. Plain Python.

A chunk of n new tokens after c computed ones attends over n c + n (n + 1) / 2 (query, key) pairs: the linear layers
cost the same per token wherever it sits, attention costs more the deeper into its context a token is. Without the
pair term a chunk deep into a 4,000-token prompt was predicted ~40% too cheap (BENCHMARKS.md, SLO section), so steps
sized to an ITL target overran it.

The scheduler asks it how many tokens a chunk may have within an inter-token latency target; the speculator asks
whether a draft token pays for itself. A step of R decode tokens yields R tokens in fixed + per_token R seconds
(pairs aside); k drafts per request add per_token R k seconds (and a proposer's own time d per draft position) and
yield accepted tokens at the acceptance rate alpha. Speculating raises tokens/s exactly when
    alpha > (per_token R + d) / (fixed + per_token R),
the share of the step that grows with its tokens. A small batch is mostly fixed cost (weights read once, Python,
kernel launches), so even poor drafts pay; a compute-bound batch needs drafts that are nearly always right.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

DECAY = 0.98  # each step weighs 2% less than the next: the fit follows the last ~50 steps
MIN_STEPS = 8
KILO = 1e-3  # pairs are fitted in thousands, so the normal equations stay well scaled
OVERRUN_WINDOW = 128  # the last this many sized steps calibrate the overrun
OVERRUN_QUANTILE = 0.9


def attention_pairs(num_new: int, num_computed: int) -> int:
    """(query, key) pairs a chunk of `num_new` tokens after `num_computed` cached ones attends over (causal)."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """A fitted step cost: seconds = fixed + per_token tokens + per_pair attention pairs. `overrun` is how much
    longer than that a sized step took at the OVERRUN_QUANTILE of recent ones (>= 1): steps vary around the fit
    (measured: actual / predicted p90 1.2 on steps mixing decodes with a long prompt's chunks), so a step sized to
    stay within a latency target divides the target by it."""

    fixed: float
    per_token: float
    per_pair: float = 0.0
    overrun: float = 1.0

    def seconds(self, tokens: int, pairs: int = 0) -> float:
        return self.fixed + self.per_token * tokens + self.per_pair * pairs

    def chunk_seconds(self, num_new: int, num_computed: int) -> float:
        """What one request's chunk adds to a step (the fixed cost aside)."""
        return self.per_token * num_new + self.per_pair * attention_pairs(num_new, num_computed)

    def max_chunk_within(self, seconds: float, num_computed: int) -> int:
        """The most tokens a chunk starting after `num_computed` tokens can have and add at most `seconds`."""
        if seconds <= 0:
            return 0
        if math.isinf(seconds):
            return 1 << 30
        a, b = self.per_pair / 2, self.per_token + self.per_pair * (num_computed + 0.5)
        if a <= 0:
            return int(seconds / b + 1e-9) if b > 0 else 1 << 30
        return max(int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a) + 1e-9), 0)


class StepCostModel:
    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop every step seen (a warm-up's first steps time a kernel build, not a step)."""
        # weighted sums of 1, tokens x, kilo-pairs p, seconds y and their products
        self._s = dict.fromkeys(("w", "x", "p", "y", "xx", "xp", "pp", "xy", "py"), 0.0)
        self._steps = 0
        self._fit: StepCost | None = None
        self._ratios: deque[float] = deque(maxlen=OVERRUN_WINDOW)  # actual / predicted of recent sized steps

    def observe(self, num_tokens: int, seconds: float, pairs: int = 0) -> None:
        if self._fit is not None:
            predicted = self._fit.seconds(num_tokens, pairs)
            if predicted > 2 * self._fit.fixed:  # a step whose size mattered, not one of the fixed cost alone
                self._ratios.append(seconds / predicted)
        x, p, y = float(num_tokens), pairs * KILO, seconds
        new = {"w": 1.0, "x": x, "p": p, "y": y, "xx": x * x, "xp": x * p, "pp": p * p, "xy": x * y, "py": p * y}
        s = self._s
        for k, v in new.items():
            s[k] = DECAY * s[k] + v
        self._steps += 1
        if self._steps >= MIN_STEPS:
            fit = self._fit_with_pairs() or self._fit_tokens_only() or self._fit
            self._fit = replace(fit, overrun=self._overrun()) if fit is not None else None

    def _overrun(self) -> float:
        if len(self._ratios) < 16:
            return 1.0
        ratios = sorted(self._ratios)
        return max(1.0, ratios[int(OVERRUN_QUANTILE * (len(ratios) - 1))])

    def _fit_tokens_only(self) -> StepCost | None:
        s = self._s
        var = s["w"] * s["xx"] - s["x"] * s["x"]
        if var <= 1e-6 * s["w"] * s["xx"]:  # token counts did not vary enough to fit a slope
            return None
        per_token = max((s["w"] * s["xy"] - s["x"] * s["y"]) / var, 0.0)
        return StepCost(max((s["y"] - per_token * s["x"]) / s["w"], 0.0), per_token)

    def _fit_with_pairs(self) -> StepCost | None:
        """The three-term fit, when tokens and pairs varied independently enough and every term came out >= 0."""
        s = self._s
        a = [[s["w"], s["x"], s["p"]], [s["x"], s["xx"], s["xp"]], [s["p"], s["xp"], s["pp"]]]
        det = _det3(a)
        if s["pp"] <= 0 or det <= 1e-6 * s["w"] * s["xx"] * s["pp"]:
            return None
        rhs = [s["y"], s["xy"], s["py"]]
        coef = []
        for col in range(3):  # Cramer's rule
            m = [row[:] for row in a]
            for r in range(3):
                m[r][col] = rhs[r]
            coef.append(_det3(m) / det)
        fixed, per_token, per_kilo_pair = coef
        if min(coef) < 0:
            return None
        return StepCost(fixed, per_token, per_kilo_pair * KILO)

    @property
    def fitted(self) -> StepCost | None:
        """The fitted cost, or None before enough varied steps were seen."""
        return self._fit

    def break_even_acceptance(self, num_tokens: int, proposer_seconds: float = 0.0) -> float:
        """The acceptance rate above which a draft token raises tokens/s in a step of `num_tokens` decode tokens
        (0 while nothing is known: speculate, and learn)."""
        if self._fit is None:
            return 0.0
        step = self._fit.seconds(num_tokens)
        return (self._fit.per_token * num_tokens + proposer_seconds) / step if step > 0 else 0.0


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


# a step may always take this long, however fast its decodes alone are (--max-decode-slowdown): a gap between tokens
# this short goes unnoticed in a stream, and a prompt beside one or two fast decodes still gets a useful chunk
DECODE_STEP_FLOOR_S = 0.05


def stretched_step_seconds(cost: StepCost | None, slowdown: float | None, decode_tokens: int,
                           decode_pairs: int) -> float | None:
    """How long, as the fit predicts it, a step that carries prompt chunks beside decodes (`decode_tokens` tokens
    attending over `decode_pairs` pairs) may take under --max-decode-slowdown: `slowdown` times what the decodes
    alone take, less the fit's recent overrun (as an ITL target is: sized steps ran up to ~1.2x their prediction, and
    the limit is on what they take), and at least DECODE_STEP_FLOOR_S. None: no limit (no slowdown set, no
    decodes, or no fit yet)."""
    if cost is None or not slowdown or decode_tokens <= 0:
        return None
    return max(slowdown * cost.seconds(decode_tokens, decode_pairs) / cost.overrun, DECODE_STEP_FLOOR_S)


def predict_ttft(prompt_tokens: int, ahead: list[int], running: int, running_context: int, cost: StepCost | None,
                 step_seconds: float | None, max_tokens: int) -> float | None:
    """Seconds until a new prompt's first token. The prompts ahead of it (`ahead`: the tokens each still has to
    compute) and then its own fill steps in order; each step also carries the running requests' decodes (one token
    each, `running_context` tokens of context between them) and at most `max_tokens` tokens, or under an ITL target
    what fits in `step_seconds`. A step costs what the fit says; None before a fit."""
    if cost is None:
        return None
    decodes = cost.seconds(running, running_context)
    room = (max_tokens - running, step_seconds - decodes if step_seconds is not None else math.inf)
    total, (tokens_left, seconds_left) = 0.0, room
    fresh = True  # the current step carries nothing besides the decodes yet
    for todo in [*ahead, prompt_tokens]:
        done = 0
        while done < todo:
            n = min(todo - done, tokens_left, cost.max_chunk_within(seconds_left, done))
            if n <= 0 and fresh:
                n = 1  # a step always moves the queue
            if n <= 0:  # this step is full: the next one
                total += decodes
                (tokens_left, seconds_left), fresh = room, True
                continue
            chunk = cost.chunk_seconds(n, done)
            total += chunk
            tokens_left, seconds_left, fresh, done = tokens_left - n, seconds_left - chunk, False, done + n
    return total + decodes  # the step that computes the prompt's last chunk
