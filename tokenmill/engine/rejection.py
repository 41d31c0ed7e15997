"""Rejection sampling for drafts drawn from a distribution q (a draft model's): accept draft x with probability
min(1, p(x) / q(x)); at the first rejection draw from the residual max(0, p - q), renormalised; if every draft is
accepted, draw one more token from p. The output is distributed exactly as sampling from p token by token
(Leviathan et al. 2023, Chen et al. 2023). p and q are both after temperature, top-k, top-p and min-p
(engine/sampler.py Sampler.probabilities), applied the same way.

Drafts with no q (a point mass: n-gram drafts, greedy drafts) need none of this: engine/runner.py `verify` samples
each position from p and accepts while the draw equals the draft, which is the same rule for q = one-hot.
"""

from __future__ import annotations

import torch

from tokenmill.engine.sampler import draw


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generators: list[torch.Generator]) -> list[int]:
    """p [d+1, V] target probabilities (row j: the position of draft j, then the bonus row), q [d, V] the draft's,
    `drafts` the d draft tokens, one generator per row (its first uniform decides acceptance, the next draws the
    replacement). Returns the accepted drafts and one more token."""
    d = len(drafts)
    if d:
        ids = torch.tensor(drafts, device=p.device)
        rows = torch.arange(d, device=p.device)
        p_x, q_x = p[rows, ids].double(), q[rows, ids].double()
        u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=p.device) for g in generators[:d]])
        ok = (u * q_x <= p_x) & (p_x > 0)  # u < p/q, without dividing; a token p forbids is never kept
        rejected = (~ok).nonzero()
        accepted = int(rejected[0]) if len(rejected) else d
    else:
        accepted = 0
    if accepted < d:
        residual = (p[accepted] - q[accepted]).clamp_(min=0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: the residual is empty, p itself is exact
            residual = p[accepted].clone()
        token = int(draw(residual.unsqueeze(0), [generators[accepted]])[0])
    else:
        token = int(draw(p[d:d + 1], [generators[d]])[0])
    return drafts[:accepted] + [token]
