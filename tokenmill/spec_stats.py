"""Acceptance counters, as vLLM reports them (drafts, draft tokens, accepted tokens, accepted per position).
Plain Python: the scheduler counts them when it commits a verified step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative since start-up."""

    num_drafts: int = 0  # verify passes of one request that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i (0-based) was accepted
    drafts_per_pos: list[int] = field(default_factory=list)  # [i]: drafts that had a token i

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify pass: `num_draft_tokens` proposed, the first `num_accepted` of them kept."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for counts, n in ((self.drafts_per_pos, num_draft_tokens), (self.accepted_per_pos, num_accepted)):
            counts.extend([0] * (num_draft_tokens - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify pass yields on average: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)]

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos), list(self.drafts_per_pos))

    def describe(self) -> str:
        if not self.num_drafts:
            return "speculative decoding: no drafts verified"
        by_pos = ", ".join(f"{r:.2f}" for r in self.acceptance_by_position())
        return (f"speculative decoding: {self.num_drafts} drafts, {self.num_draft_tokens} draft tokens, "
                f"{self.num_accepted_tokens} accepted ({self.acceptance_rate:.1%}); mean accepted length "
                f"{self.mean_accepted_length:.2f}; acceptance by position {by_pos}")
