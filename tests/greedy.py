"""Greedy-output comparison that tells a real mismatch from a genuine near-tie."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Hugging Face `generate`, greedy, never stopping at EOS; returns tokens and the per-step logits."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [s[0].float() for s in out.logits]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_matches_reference(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> None:
    """Token for token, unless the reference itself had its top two logits within NEAR_TIE at the first
    difference (then both continuations are legitimate and the comparison stops there)."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    top2 = ref_logits[i].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at token {i}: ours {ours[i:i + 5]} vs reference {ref[i:i + 5]} (gap {gap:.2e})"
    assert ref_logits[i][ours[i]] >= top2[0] - NEAR_TIE


def assert_same_greedy(a, b) -> None:
    """Two of our CompletionOutputs (generated with logprobs >= 1): same tokens, or a near-tie at the first
    difference, with matching logprobs up to there."""
    i = first_divergence(a.token_ids, b.token_ids)
    if i is None:
        return
    lp = a.logprobs[i]
    vals = sorted(lp.values(), reverse=True)
    gap = vals[0] - vals[1] if len(vals) > 1 else float("inf")
    assert gap < NEAR_TIE, f"diverged at token {i}: {a.token_ids[i:i + 5]} vs {b.token_ids[i:i + 5]} (gap {gap:.2e})"
    for j in range(i):
        ta = a.token_ids[j]
        assert abs(a.logprobs[j][ta] - b.logprobs[j][ta]) < 1e-3
