"""Logits -> next tokens for a batch of requests, each with its own sampling parameters.

Order: penalties (repetition on prompt+output, presence/frequency on output), min_tokens masking, then greedy
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

import torch

from tokenmill.sampling_params import SamplingParams


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


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min_p x the top probability.
    logits [R, V] already divided by temperature; top_k [R] (0 = off), top_p [R], min_p [R]."""
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[1]).clamp(max=logits.shape[1])
        kth = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        logits = torch.where(logits < kth, neg_inf, logits)
    if bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p.unsqueeze(1)
        drop_sorted[:, 0] = False  # the top token always stays, even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=1)
        floor = probs.max(dim=1, keepdim=True).values * min_p.unsqueeze(1)
        logits = torch.where(probs < floor, neg_inf, logits)
    return logits


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


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[tuple[int, dict[int, float] | None]]:
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=1) if any(want_logprobs) else None
        if any(r.params.has_penalties or r.blocked_token_ids for r in rows):
            logits = logits.clone()
            if any(r.params.has_penalties for r in rows):
                apply_penalties(logits, rows)
                # a tiny repetition penalty can push logits past float32's range: keep them finite
                logits = logits.nan_to_num(nan=float("nan"), posinf=torch.finfo(torch.float32).max)
            mask_blocked(logits, rows)

        tokens = logits.argmax(dim=1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            dev = logits.device
            sub = logits[torch.tensor(random_rows, device=dev)]
            if not bool(torch.isfinite(sub.max(dim=1).values).all()) or bool(sub.isnan().any()):
                raise SamplingError("the model produced non-finite logits")
            sub = (sub - sub.max(dim=1, keepdim=True).values) / torch.tensor(
                [rows[i].params.temperature for i in random_rows], device=dev).unsqueeze(1)
            sub = filter_logits(
                sub,
                torch.tensor([rows[i].params.top_k for i in random_rows], device=dev),
                torch.tensor([rows[i].params.top_p for i in random_rows], dtype=torch.float32, device=dev),
                torch.tensor([rows[i].params.min_p for i in random_rows], dtype=torch.float32, device=dev),
            )
            probs = sub.softmax(dim=1)
            for j, i in enumerate(random_rows):
                tokens[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]

        token_list = tokens.tolist()
        results = []
        for i, (r, t) in enumerate(zip(rows, token_list)):
            lp = top_logprobs(raw_logprobs[i], t, r.params.logprobs) if want_logprobs[i] else None
            results.append((t, lp))
        return results
