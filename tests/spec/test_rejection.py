"""Rejection sampling (engine/rejection.py): the output follows the target distribution p whatever the draft's q."""

import torch

from tokenmill.engine.rejection import rejection_sample


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit, cells with expected count >= 5 (the rest pooled)."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)]) if (~big).any() else observed[big]
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)]) if (~big).any() else expected[big]
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def gens(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(n)]


def first_tokens(p: torch.Tensor, q: torch.Tensor, trials: int) -> torch.Tensor:
    """The first output token over `trials`, with the draft token drawn from q each time (as a draft model does)."""
    counts = torch.zeros(p.shape[1], dtype=torch.float64)
    g = torch.Generator().manual_seed(123)
    for t in range(trials):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        out = rejection_sample(p, q, [draft], gens(t, 2))
        counts[out[0]] += 1
    return counts


def test_output_follows_p_for_a_good_a_bad_and_a_disjoint_draft():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(2, 12) * 1.5, dim=1)
    drafts = {"close": torch.softmax(torch.log(p) + 0.3 * torch.randn(2, 12), dim=1),
              "uniform": torch.full((2, 12), 1 / 12),
              "disjoint": torch.zeros(2, 12).index_fill_(1, torch.tensor([p[0].argmin()]), 1.0)}
    trials = 3000
    for name, q in drafts.items():
        counts = first_tokens(p, q[:1], trials)
        assert chi2_pvalue(counts, p[0].double() * trials) > 0.01, name


def test_a_draft_equal_to_the_target_is_always_accepted():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(4, 20), dim=1)
    for t in range(50):
        drafts = [int(torch.multinomial(p[j], 1)) for j in range(3)]
        out = rejection_sample(p, p[:3].clone(), drafts, gens(t, 4))
        assert out[:3] == drafts and len(out) == 4


def test_a_token_the_target_forbids_is_never_accepted():
    p = torch.zeros(2, 6)
    p[:, :3] = 1 / 3  # tokens 3..5 impossible (filtered by top-k, say)
    q = torch.full((1, 6), 1 / 6)
    for t in range(100):
        out = rejection_sample(p, q, [4], gens(t, 2))
        assert len(out) == 1 and out[0] < 3


def test_no_drafts_draws_the_bonus_token_from_p():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    assert rejection_sample(p, torch.zeros(0, 3), [], gens(0, 1)) == [1]
