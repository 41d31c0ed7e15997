"""Logits -> next tokens for a batch of requests, each with its own sampling parameters.

Order: penalties (repetition on prompt+output, presence/frequency on output), logit_bias (-100: banned), min_tokens
masking, then greedy
argmax, or temperature -> top-k -> top-p -> min-p -> a draw from the request's own generator (so a seeded
request samples the same tokens whatever else is in the batch). Logprobs are of the raw model distribution.
Everything runs on the logits' device (each request's generator lives there too); only the chosen tokens and
their logprobs come back to the host.

The sampler is total: any valid parameters give a token. Filters always keep the most likely token, a mask
that would remove every token is not applied, and temperature divides logits shifted so their maximum is 0
(a tiny temperature then means greedy, not inf / inf). Only logits the model made non-finite raise
(SamplingError), and the runner then fails that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling_params import BAN, SamplingParams

if TYPE_CHECKING:
    from tokenmill.model.backends.base import Backend


@dataclass
class SamplingRow:
    """What the sampler needs of one request (built by the runner, no Request import here)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    blocked_token_ids: list[int] | None = None  # EOS/stop ids while below min_tokens


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, only on rows that ask for a penalty."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                                device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


NUCLEUS_CANDIDATES = 256  # top-p looks at this many most likely tokens first; a full sort only where they fall short


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf, in place) tokens outside top-k, outside the top-p nucleus, or below min_p x the top
    probability. logits [R, V]: each row shifted so its maximum is 0, then divided by temperature (the top token,
    which every filter keeps, stays at 0); top_k [R] (0 = off), top_p [R], min_p [R]."""
    k_rows = (top_k > 0).nonzero().flatten()
    if len(k_rows):  # only the rows that ask: one row without top-k would otherwise make this a full sort
        sub, k = logits[k_rows], top_k[k_rows].clamp(max=logits.shape[1])
        kth = sub.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        logits[k_rows] = sub.masked_fill_(sub < kth, float("-inf"))
    nucleus_rows = (top_p < 1).nonzero().flatten()
    if len(nucleus_rows):
        sub = logits[nucleus_rows]
        logits[nucleus_rows] = sub.masked_fill_(~nucleus(sub, top_p[nucleus_rows]), float("-inf"))
    if bool((min_p > 0).any()):  # p / p_max = exp(logit - 0): below min_p where the logit is below log(min_p)
        logits.masked_fill_(logits < min_p.log().unsqueeze(1), float("-inf"))
    return logits


def nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the smallest set of most likely tokens whose probability reaches top_p (the token that crosses
    it is kept; so is the top token, even when top_p rounds to 0). Exactly what sorting the whole vocabulary
    gives, without sorting it: the NUCLEUS_CANDIDATES most likely tokens (topk, sorted) hold the nucleus of most
    rows; only rows where they do not reach top_p are sorted in full (a sort of [64, 49152] costs ~90 ms on a CPU,
    the candidates ~5 ms)."""
    probs = logits.softmax(dim=1)
    vals, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[1]), dim=1)
    short = (vals.sum(dim=1) < top_p).nonzero().flatten()
    if len(short):  # flat distributions: the nucleus reaches past the candidates
        vals_s, order_s = probs[short].sort(dim=1, descending=True)
        return _keep(probs, vals, order, top_p).index_put_((short,), _keep(probs[short], vals_s, order_s, top_p[short]))
    return _keep(probs, vals, order, top_p)


def _keep(probs: torch.Tensor, vals: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens `order` (most likely first, probabilities `vals`) whose mass strictly above is below top_p."""
    kept = (vals.cumsum(dim=1) - vals) < top_p.unsqueeze(1)
    kept[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, kept)


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first maximal value (as argmax, which Hugging Face's greedy search uses): max's
    indices, documented to be the first (a NaN counts as the maximum). A backend may do it faster
    (Sampler._first_argmax)."""
    return logits.max(dim=1).indices


LOWEST_LOGIT = -80.0  # below the top by this much a token gets no weight (p < 2e-35 x the top's)


def weights_of(logits: torch.Tensor) -> torch.Tensor:
    """exp(logits), in place, for logits whose maximum is 0, with 0 for tokens below LOWEST_LOGIT (filtered ones
    are -inf). The clamp is for speed: exp of -inf or of a value whose result is subnormal takes a slow path,
    5-15x slower per element on x86 (a low temperature spreads most of the vocabulary that far)."""
    low = logits < LOWEST_LOGIT
    return logits.clamp_(min=LOWEST_LOGIT).exp_().masked_fill_(low, 0.0)


DRAW_BLOCK = 256  # draw() finds a token's block of the vocabulary first, then the token inside it


def draw(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `weights` [R, V] (unnormalised probabilities: exp of the max-shifted, temperature-scaled,
    filtered logits, so in [0, 1]), each from its row's generator: one uniform draw u per row, then the first token
    whose cumulative weight exceeds u x the row's total (the inverse CDF). torch.multinomial instead draws one
    exponential per vocabulary entry: at 64 rows x 49,152 that was ~75 ms of a decode step on 2 CPU cores.
    The cumulative sum runs in two levels (block sums, then within the chosen block of DRAW_BLOCK tokens), so no
    token's share of a 150K vocabulary is lost to float32 rounding, at the cost of one pass over `weights`. Each
    row is its own computation: a seeded request draws the same token whatever else is in the batch."""
    rows, vocab = weights.shape
    nb = -(-vocab // DRAW_BLOCK)
    if vocab % DRAW_BLOCK:
        weights = torch.nn.functional.pad(weights, (0, nb * DRAW_BLOCK - vocab))
    blocks = weights.view(rows, nb, DRAW_BLOCK)
    block_cdf = blocks.sum(dim=2).double().cumsum(dim=1)  # [R, nb]
    total = block_cdf[:, -1:].contiguous()
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=weights.device) for g in generators])
    target = u.unsqueeze(1) * total
    # the block where the target falls (u x total may round up to the total: then the last block with weight)
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True), torch.searchsorted(block_cdf, total))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(rows, device=weights.device), block.squeeze(1)].double().cumsum(dim=1)  # [R, B]
    inner_total = inner[:, -1:].contiguous()
    residual = torch.minimum(target - before, inner_total)  # the block's two sums may differ in the last bits
    offset = torch.minimum(torch.searchsorted(inner, residual, right=True), torch.searchsorted(inner, inner_total))
    return (block * DRAW_BLOCK + offset).squeeze(1)


def top_logprobs(logprobs: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The sampled token's logprob and the top-n, as {token_id: logprob} (sampled first)."""
    out = {token: float(logprobs[token])}
    if n:
        vals, ids = logprobs.topk(n)
        for t, v in zip(ids.tolist(), vals.tolist()):
            out.setdefault(t, v)
    return out


class SamplingError(ValueError):
    """The logits of a request cannot be sampled (the model produced NaN or infinity)."""


def mask_blocked(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf on each row's blocked ids (EOS/stop ids below min_tokens), unless that would leave the row
    no token at all (stop ids covering the whole vocabulary): then the row is left as it was."""
    for i, r in enumerate(rows):
        if r.blocked_token_ids:
            ids = torch.tensor(r.blocked_token_ids, dtype=torch.long, device=logits.device)
            ids = ids[ids < logits.shape[1]]
            saved = logits[i, ids].clone()
            logits[i, ids] = float("-inf")
            if not bool((logits[i] > float("-inf")).any()):
                logits[i, ids] = saved


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: each row's logit_bias added to its tokens' logits, -inf for a ban (BAN), unless the bans would leave
    the row no token at all (a structured output constraint allowing only banned tokens): then the bans give way to
    the constraint (the biases still apply)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if not bias:
            continue
        ids = torch.tensor([t for t in bias if t < vocab], dtype=torch.long, device=logits.device)
        vals = torch.tensor([b for t, b in bias.items() if t < vocab], dtype=torch.float32, device=logits.device)
        banned = vals == BAN
        biased = logits[i, ids] + vals
        saved = biased.clone()
        biased[banned] = float("-inf")
        logits[i, ids] = biased
        if banned.any() and not bool((logits[i] > float("-inf")).any()):
            logits[i, ids] = saved


def _adjusted(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """float32 logits after penalties, logit_bias and min_tokens masking (a copy only where a row changes)."""
    logits = logits.float()
    if any(r.params.adjusts_logits or r.blocked_token_ids for r in rows):
        logits = logits.clone()
        if any(r.params.has_penalties for r in rows):
            apply_penalties(logits, rows)
            # a tiny repetition penalty can push logits past float32's range: keep them finite
            logits = logits.nan_to_num(nan=float("nan"), posinf=torch.finfo(torch.float32).max)
        if any(r.params.logit_bias for r in rows):
            apply_logit_bias(logits, rows)
        mask_blocked(logits, rows)
    return logits


def _random_weights(sub: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Unnormalised probabilities of rows that sample: max-shifted, divided by temperature, filtered (top-k,
    top-p, min-p), exponentiated."""
    dev = sub.device
    top = sub.max(dim=1, keepdim=True).values  # NaN anywhere in a row makes its max NaN
    if not bool(torch.isfinite(top).all()):
        raise SamplingError("the model produced non-finite logits")
    sub = torch.sub(sub, top).div_(torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1))
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        sub = filter_logits(
            sub,
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
        )
    return weights_of(sub)


class Sampler:
    def __init__(self, backend: Backend | None = None):
        """`backend`: the model's (model/backends), whose fused kernel computes the weights of rows that sample
        without filters, where it has one; None: torch ops only."""
        self.backend = backend
        self._buffer = torch.empty(0)  # the fused kernel's output, kept: a fresh [R, V] each step pays page faults

    def _first_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """first_argmax, through the backend's kernel where it has one (torch's max scans a row with scalar
        compares: 2.8 ms for 64 x 49,152 on 2 cores, the CPU kernel 0.25 ms)."""
        fast = None if self.backend is None else self.backend.first_argmax(logits)
        return first_argmax(logits) if fast is None else fast

    def _weights(self, sub: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """_random_weights(sub, params), through the backend's fused kernel when no row filters (as vLLM's
        benchmark client asks: temperature 1, nothing else). The result may be this sampler's buffer: it is read
        before the next call."""
        if self.backend is None or any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            return _random_weights(sub, params)
        sub = sub.float().contiguous()
        if self._buffer.numel() < sub.numel() or self._buffer.device != sub.device:
            self._buffer = torch.empty(sub.numel(), device=sub.device)
        out = self._buffer[:sub.numel()].view(sub.shape)
        top = self.backend.sampling_weights(sub, torch.tensor([p.temperature for p in params]), LOWEST_LOGIT, out)
        if top is None:
            return _random_weights(sub, params)
        if not bool(torch.isfinite(top).all()):
            raise SamplingError("the model produced non-finite logits")
        return out

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[R, V] float32: the distribution each row samples from, after every adjustment (greedy rows: one-hot
        on the argmax), so that two models' rows processed the same way can be compared (engine/rejection.py)."""
        logits = _adjusted(logits, rows)
        probs = torch.zeros_like(logits)
        greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            probs[idx, self._first_argmax(logits[idx])] = 1.0
        if random_rows:
            w = self._weights(logits[random_rows], [rows[i].params for i in random_rows])
            probs[random_rows] = w / w.sum(dim=1, keepdim=True)
        return probs

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[tuple[int, dict[int, float] | None]]:
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=1) if any(want_logprobs) else None
        logits = _adjusted(logits, rows)

        dev = logits.device
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            tokens = self._first_argmax(logits)
        else:  # one pass over [R, V] costs ~1 ms at 64 x 49,152 on 2 CPU cores: each one counts
            tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
            greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy]
            if greedy_rows:
                tokens[greedy_rows] = self._first_argmax(logits[greedy_rows])
            sub = logits if len(random_rows) == len(rows) else logits[random_rows]
            weights = self._weights(sub, [rows[i].params for i in random_rows])
            tokens[random_rows] = draw(weights, [rows[i].generator for i in random_rows])

        token_list = tokens.tolist()
        results = []
        for i, (r, t) in enumerate(zip(rows, token_list)):
            lp = top_logprobs(raw_logprobs[i], t, r.params.logprobs) if want_logprobs[i] else None
            results.append((t, lp))
        return results
