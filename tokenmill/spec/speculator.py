"""Who speculates each step, and how far: the engine core asks after every step, the proposer guesses, and the
drafts ride on the requests (`Request.spec_token_ids`) into the next step's schedule.

Rules, plain Python:
- only a request that is decoding (its prompt done) and has not opted out (`SamplingParams.speculate`);
- never past the request's end: k <= max_tokens - tokens out - 1, so a verify pass never samples past max_tokens;
- pause while more than `disable_by_batch_size` requests run: verifying k drafts costs k more tokens of compute
  per request, which a large batch (compute-bound) no longer has to spare;
- per request, k follows its acceptance: a request whose drafts keep failing proposes fewer (down to one, so it
  can recover), one whose drafts are accepted goes back up to the configured k.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.config import SpeculativeConfig
from tokenmill.request import Request
from tokenmill.spec.ngram import propose_ngram

# Default pause threshold: on 2 CPU cores a decode step of 8 requests is already compute-bound at 5 tokens each
# (BENCHMARKS.md, speculative decoding); above it speculation costs throughput.
DEFAULT_MAX_BATCH = 8


class Proposer(Protocol):
    lookahead: int  # KV slots past the scheduled tokens the proposer writes (a draft model's own KV)

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]: ...
    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    lookahead = 0

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [propose_ngram(r.prompt_token_ids + r.output_token_ids, k, self.min_n, self.max_n)
                for r, k in zip(requests, ks)]

    def forget(self, request_id: str) -> None:
        pass


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config, self.proposer = config, proposer
        self.max_batch = config.disable_by_batch_size or DEFAULT_MAX_BATCH
        self.k: dict[str, int] = {}  # per request: how many drafts it proposes now (adaptive)

    def describe(self) -> str:
        c = self.config
        how = (f"n-gram prompt lookup (n {c.prompt_lookup_min}..{c.prompt_lookup_max})" if c.method == "ngram"
               else f"draft model {c.model}" + (f" ({c.quantization})" if c.quantization else ""))
        return (f"speculative decoding: {how}, up to {c.num_speculative_tokens} draft tokens a step; paused while "
                f"more than {self.max_batch} requests run")

    @property
    def lookahead(self) -> int:
        return self.proposer.lookahead

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of the running requests that should speculate in the next step."""
        if len(running) > self.max_batch:
            return
        chosen, ks = [], []
        for r in running:
            if r.status.finished or not r.params.speculate or r.num_tokens - r.num_computed_tokens != 1:
                continue
            k = min(self.k.get(r.request_id, self.config.num_speculative_tokens),
                    r.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                chosen.append(r)
                ks.append(k)
        if chosen:
            for r, drafts in zip(chosen, self.proposer.propose(chosen, ks)):
                r.spec_token_ids = drafts

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """After a verify pass: all accepted -> one more draft next time (up to k); none -> half as many."""
        if not num_drafts:
            return
        k = self.k.get(request_id, self.config.num_speculative_tokens)
        if num_accepted == num_drafts:
            k = min(k + 1, self.config.num_speculative_tokens)
        elif num_accepted == 0:
            k = max(1, k // 2)
        self.k[request_id] = k

    def forget(self, request_id: str) -> None:
        self.k.pop(request_id, None)
        self.proposer.forget(request_id)


def build_speculator(config: SpeculativeConfig, core: object) -> Speculator:
    """The speculator for `config`; a draft model is loaded beside the engine core's target (spec/draft_model.py)."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    from tokenmill.spec.draft_model import DraftModelProposer

    return Speculator(config, DraftModelProposer.for_engine(config, core))
