"""A draft model proposes k tokens autoregressively: a smaller model with the target's vocabulary, or the target
itself at lower precision (`"quantization": "int4"`, a self-draft).

It shares the target's block tables: its own KV tensors (one per draft layer, as many blocks as the target's
pool), written at the same block ids, so the KV cache manager needs no second pool. Per request it remembers the
tokens its KV holds; each step it catches up on what the target committed since (the whole prompt the first time,
then the accepted drafts and the target's token), then feeds its own drafts back, k - 1 forward passes more.
It writes KV up to k - 1 positions past the target's tokens: `lookahead` = k slots the scheduler allocates ahead.

Greedy requests get the draft's argmax (verified as point masses, engine/runner.py `verify`); sampling requests
draw from the draft's distribution q with the target's sampling parameters applied the same way, and keep q for
the rejection sampler (engine/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.sampler import Sampler, SamplingRow, draw
from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig
from tokenmill.request import Request

if TYPE_CHECKING:
    from tokenmill.engine.runner import ModelRunner

DRAFT_SEED_SALT = 0x5DEECE66D  # the draft's draws use other seeds than the target's at the same position


def check_draft_config(draft: ModelConfig, target: ModelConfig, path: str) -> None:
    """Refuse a draft the target cannot verify: another vocabulary, or a shorter context."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-config: the draft model {path} has a vocabulary of {draft.vocab_size} "
                          f"tokens, the target {target.vocab_size}; a draft must share the target's tokenizer")


def last_logits(runner: ModelRunner, spans: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """The logits of each span's last token, a span being (block ids, first position, its tokens): the draft's
    own forward passes, beside the target's steps, reading and writing K/V through the shared block tables."""
    inputs, last_rows = runner.span_inputs(spans)
    return runner.logits(runner.forward(inputs)[last_rows])


@dataclass
class DraftTarget:
    """What a draft model needs of the engine it drafts for: the target's runner (its device, dtype and per-request
    generators), its model config (the draft must share its vocabulary), the KV pool's shape (the draft's KV sits at
    the same block ids) and the engine's seed."""

    runner: ModelRunner
    config: ModelConfig
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype | None
    seed: int = 0


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the draft holds, from position 0


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, target: ModelRunner, k: int):
        self.runner, self.target, self.lookahead = runner, target, k
        self.sampler = Sampler()
        self.states: dict[str, _DraftState] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # q of the last drafts drawn, by request (the speculator's)

    @classmethod
    def load(cls, config: SpeculativeConfig, target: DraftTarget) -> DraftModelProposer:
        """Load the draft model of `config` beside `target`, on its device and in its dtype."""
        from tokenmill.engine.runner import ModelRunner
        from tokenmill.model.loader import load_model_config, load_weights, resolve_model_path
        from tokenmill.quant.methods import resolve_quantization

        path = resolve_model_path(config.model)
        cfg = load_model_config(path)
        check_draft_config(cfg, target.config, str(config.model))
        dtype, device = target.runner.dtype, target.runner.device
        quant = resolve_quantization(config.quantization, path, dtype, device)
        runner = ModelRunner(cfg, load_weights(path, cfg, dtype), dtype, str(device), target.num_blocks,
                             target.block_size, target.seed, batch_invariant=True, quantization=quant,
                             kv_dtype=target.kv_dtype)
        return cls(runner, target.runner, config.lookahead)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.draft_probs.pop(request_id, None)

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """k drafts per request (ks), after catching the draft's KV up with each request's committed tokens."""
        spans, states = [], []
        for r in requests:
            st = self.states.setdefault(r.request_id, _DraftState())
            tokens = r.prompt_token_ids + r.output_token_ids
            valid = _common_prefix(st.tokens, tokens)
            valid = min(valid, len(tokens) - 1)  # the last token is fed (its logits give the first draft)
            st.tokens = tokens[:valid]
            spans.append((r.block_ids, valid, tokens[valid:]))
            states.append(st)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(ks)):
            logits = last_logits(self.runner, [spans[i] for i in active])
            for i, (b, start, toks) in zip(active, [spans[i] for i in active]):
                states[i].tokens.extend(toks)
            rows = [self._row(requests[i], drafts[i]) for i in active]
            chosen, q = self._choose(logits, rows, [requests[i] for i in active])
            for j, i in enumerate(active):
                drafts[i].append(chosen[j])
                if q is not None and not requests[i].params.greedy:
                    probs[i].append(q[j])
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
            for i in active:  # feed the draft token just chosen, at the next position
                spans[i] = (requests[i].block_ids, len(states[i].tokens), [drafts[i][-1]])
        for r, q_rows in zip(requests, probs):
            if q_rows:
                self.draft_probs[r.request_id] = torch.stack(q_rows)
            else:
                self.draft_probs.pop(r.request_id, None)
        return drafts

    def _row(self, request: Request, drafts: list[int]) -> SamplingRow:
        p = request.params
        output = request.output_token_ids + drafts
        blocked = None
        if len(output) < p.min_tokens:
            blocked = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids)))
        gen = None
        if not p.greedy:
            gen = self.target.position_generator(request.request_id, p.seed, len(output), salt=DRAFT_SEED_SALT)
        return SamplingRow(p, request.prompt_token_ids, output, gen, blocked)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], requests: list[Request]
                ) -> tuple[list[int], torch.Tensor | None]:
        """The draft tokens (argmax for greedy rows, a draw from q otherwise) and q for the rows that draw."""
        if all(r.params.greedy for r in rows):
            return logits.float().max(dim=1).indices.tolist(), None
        q = self.sampler.probabilities(logits, rows)
        tokens = q.max(dim=1).indices  # greedy rows are one-hot already
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens[sampling] = draw(q[sampling], [rows[i].generator for i in sampling])
        return tokens.tolist(), q


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
