"""Recurrent layers' ops in plain PyTorch (float32): the reference a backend's kernels are tested against.

Gated DeltaNet (Qwen3.5's linear attention) keeps, per value head, a matrix S [Dk, Dv] that each token first decays,
then corrects towards its value (the delta rule), then reads with its query:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

(k and q L2-normalised, q also scaled by Dk ** -0.5). A one-token span (a decode) takes that step, batched over the
step's decodes. A longer span (a prompt chunk) takes the chunked form: within a chunk of CHUNK tokens the corrections
depend on each other through a unit lower-triangular system (the WY form of the delta rule's products), solved once
per chunk, and the state carries from chunk to chunk. Both forms give the same values up to rounding; which one a
request's rows take depends on its own span only, so its output does not depend on the rest of the batch. (The CPU
backend's kernel, csrc/recurrent.cpp, takes every span token by token: the step's form throughout.)

Mamba2 (Granite-4.0-H's SSM layers) keeps a matrix [head_dim, state] per head: s <- exp(dt A) s + dt x b^T, read with
c; its reference takes each request's tokens in turn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked form


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                     spans: list[tuple[int, int, int]], tiled: bool = False) -> torch.Tensor:
    """Backend.gated_delta_rule's reference (its docstring says what each argument is)."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    steps = [(start, slot) for start, end, slot in spans if end - start == 1]
    if steps:
        rows = torch.tensor([r for r, _ in steps], device=v.device)
        slots = torch.tensor([s for _, s in steps], device=v.device)
        o, state[slots] = _step(*_float_inputs(q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, tiled),
                                state[slots])
        out[rows] = o.to(v.dtype)
    for start, end, slot in spans:
        if end - start > 1:
            rows = slice(start, end)
            o, state[slot] = _chunked(*_float_inputs(q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias,
                                                     tiled), state[slot])
            out[rows] = o.to(v.dtype)
    return out


def _float_inputs(q, k, v, a, b, a_log, dt_bias, tiled):
    """The delta rule's inputs in float32: q and k normalised (q scaled) and repeated for their value heads (each
    key head's next to each other, or `tiled`: all key heads, again and again), the log decay g and the write
    strength beta [n, Hv]."""
    per_key = v.shape[1] // k.shape[1]
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b).float()  # in the model's dtype first, as transformers rounds it

    def per_value_head(x):
        return x.repeat(1, per_key, 1) if tiled else x.repeat_interleave(per_key, 1)

    qf = per_value_head(_l2_normalised(q.float())) * k.shape[2] ** -0.5
    kf = per_value_head(_l2_normalised(k.float()))
    return qf, kf, v.float(), g, beta


def _step(q, k, v, g, beta, s):
    """One token per row: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], s [B, H, Dk, Dv] -> (o [B, H, Dv], s)."""
    s = s * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def _chunked(q, k, v, g, beta, s):
    """One request's n tokens: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H], s [H, Dk, Dv] -> (o [n, H, Dv], s)."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[1], CHUNK):
        c = slice(c0, c0 + CHUNK)
        qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c]
        n = qc.shape[1]
        cum = g[:, c].cumsum(-1)  # [H, n]: log of the decay from the chunk's start to each token
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # decay[i, j] = exp(cum_i - cum_j) for j <= i (what token j's write has decayed by at token i), else 0
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = kc * bc[..., None]
        # I + the strictly lower part of beta_i (k_i . k_j) decay[i, j]: how earlier writes in the chunk change
        # what token i reads back, and so what it writes
        system = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1) + torch.eye(n, device=q.device)
        fresh = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        reads = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
        corrections = fresh - reads @ s  # [H, n, Dv]: what each token writes, given the state before the chunk
        out[:, c] = (qc * cum.exp()[..., None]) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ corrections
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ corrections
    return out.transpose(0, 1), s


def mamba2_scan(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_log: torch.Tensor,
                d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Backend.mamba2_scan's reference: each request's tokens in turn (the step's form; transformers' chunked SSD
    form gives the same values up to rounding), batched over the heads."""
    heads, groups = x.shape[1], b.shape[1]
    step = -a_log.float().exp()  # A, per head
    delta = F.softplus(dt.float() + dt_bias.float())  # [T, H]
    bh = b.float().repeat_interleave(heads // groups, 1)  # [T, H, N]: each group's B for its heads
    ch = c.float().repeat_interleave(heads // groups, 1)
    xf = x.float()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for start, end, slot in spans:
        s = state[slot]  # [H, P, N]
        for r in range(start, end):
            written = (delta[r][:, None] * xf[r])[:, :, None] * bh[r][:, None, :]  # dt x b^T per head
            s = s * (delta[r] * step).exp()[:, None, None] + written
            out[r] = (s @ ch[r][:, :, None]).squeeze(-1)
        state[slot] = s
    return (out + xf * d.float()[:, None]).to(x.dtype)
