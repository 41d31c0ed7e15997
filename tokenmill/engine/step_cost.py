"""What a step costs on this machine, now: step time ~ fixed + per_token x tokens, fitted online by exponentially
weighted least squares from the engine's own measured steps. Plain Python.

The scheduler asks it how many tokens a step may carry within an inter-token latency target; the speculator asks
it whether a draft token pays for itself. A step of R decode tokens yields R tokens in
fixed + per_token R seconds; k drafts per request add per_token R k seconds (and a proposer's own time d per draft
position) and yield accepted tokens at the acceptance rate alpha. Speculating raises tokens/s exactly when
    alpha > (per_token R + d) / (fixed + per_token R),
the share of the step that grows with its tokens. A small batch is mostly fixed cost (weights read once, Python,
kernel launches), so even poor drafts pay; a compute-bound batch needs drafts that are nearly always right.
"""

from __future__ import annotations

import math

DECAY = 0.98  # each step weighs 2% less than the next: the fit follows the last ~50 steps
MIN_STEPS = 8


class StepCostModel:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0
        self._fit: tuple[float, float] | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        d, x = DECAY, float(num_tokens)
        self._w, self._x, self._y = d * self._w + 1, d * self._x + x, d * self._y + seconds
        self._xx, self._xy = d * self._xx + x * x, d * self._xy + x * seconds
        self._steps += 1
        var = self._w * self._xx - self._x * self._x
        if self._steps >= MIN_STEPS and var > 1e-6 * self._w * self._xx:  # token counts varied enough to fit
            per_token = max((self._w * self._xy - self._x * self._y) / var, 0.0)
            fixed = max((self._y - per_token * self._x) / self._w, 0.0)
            self._fit = (fixed, per_token)

    @property
    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough varied steps were seen."""
        return self._fit

    def max_tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step can carry and still take at most `seconds` (None: unknown, or no per-token cost)."""
        if self._fit is None or self._fit[1] <= 0:
            return None
        fixed, per_token = self._fit
        return max(int((seconds - fixed) / per_token + 1e-6), 0)

    def predict_ttft(self, prompt_tokens: int, tokens_ahead: int, running: int, budget: int) -> float | None:
        """See predict_ttft; None before a fit."""
        return predict_ttft(prompt_tokens, tokens_ahead, running, self._fit, budget)

    def break_even_acceptance(self, num_tokens: int, proposer_seconds: float = 0.0) -> float:
        """The acceptance rate above which a draft token raises tokens/s in a step of `num_tokens` decode tokens
        (0 while nothing is known: speculate, and learn)."""
        if self._fit is None:
            return 0.0
        fixed, per_token = self._fit
        step = fixed + per_token * num_tokens
        return (per_token * num_tokens + proposer_seconds) / step if step > 0 else 0.0


def predict_ttft(prompt_tokens: int, tokens_ahead: int, running: int, fit: tuple[float, float] | None,
                 budget: int) -> float | None:
    """Seconds until a new prompt's first token: the prompt tokens queued ahead of it and its own go through steps
    of `budget` tokens, of which the running requests' decodes take one each; a step costs what the fit says."""
    if fit is None:
        return None
    fixed, per_token = fit
    total = tokens_ahead + prompt_tokens
    steps = math.ceil(total / max(budget - running, 1))
    return steps * (fixed + per_token * min(budget, total + running))
