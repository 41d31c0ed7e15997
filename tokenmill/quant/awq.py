"""Activation-aware weight quantization (AWQ, Lin et al. 2023): the scale search and the clip search before
round-to-nearest INT4 in groups (formats/awq_format.py).

A weight column that meets large activations matters more to the output than one that meets small ones. AWQ
multiplies each input channel j of a matmul by s_j = mean|x_j|^alpha before quantizing (so the important columns
get finer steps) and divides the layer's input by s_j, which costs nothing at run time: the division folds into
the op before (the RMSNorm weight in front of q/k/v and gate/up; the up rows of gate/up in front of down). alpha
is searched per matmul on calibration activations, minimizing the output error of the quantized product; alpha = 0
is plain round-to-nearest, so the search never does worse than it on the calibration rows. Then each group's range
is narrowed (clipped) where that lowers the group's share of the output error: outliers stop stretching the step
of the whole group. q and k are not clipped (their errors are multiplied together in the attention scores).

Here: `capture_inputs` records each matmul's inputs while the engine prefills calibration text (modules path:
`batch_invariant=False`, float32), `quantize_model` searches, folds the scales into the model's dense weights in
place and returns each matmul weight as Int4Groups under its Hugging Face name (`tokenmill quantize` writes them).
o_proj keeps scale 1: its input comes from v through attention, and with grouped-query heads one v channel feeds
several o channels, so no single fold exists; it is still clipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill.formats.awq_format import Int4Groups, fake_quantize, quantize_groups

GRID = 20  # alphas 0, 1/20, ..., 19/20; clip ratios 1, 0.95, ..., 0.55
MAX_SHRINK = 0.5  # clipping narrows a group's range by at most this much (ratios down to 1 - MAX_SHRINK)
MAX_ROWS = 1024  # calibration rows kept per matmul (a uniform random subset); |x| means use every row
MATMULS = ("qkv", "o", "gate_up", "down")


@dataclass
class Captured:
    """Per matmul key (`{layer}.{qkv|o|gate_up|down}`): a random subset of its input rows and the mean |x| of
    each input channel over every row seen."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    mean_abs: dict[str, torch.Tensor] = field(default_factory=dict)


def capture_inputs(llm: Any, prompts: Sequence[Sequence[int]], max_rows: int = MAX_ROWS, seed: int = 0) -> Captured:
    """Each decoder layer's q/k/v, o, gate/up and down inputs while `llm` (tokenmill.LLM, built with
    batch_invariant=False and no prefix caching, so prompts run module by module; steps that hold only later
    chunks of a prompt take the fused decode path and are not seen) prefills `prompts`, in float32."""
    from tokenmill.sampling_params import SamplingParams

    model = llm.engine.core.runner.model
    total = max(1, sum(len(p) for p in prompts))
    keep = min(1.0, 1.5 * max_rows / total)  # each row kept with this chance: about 1.5 max_rows rows in all
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list[torch.Tensor]] = {}
    sums: dict[str, list] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        # the MLP module's input is gate/up's (a backend may fuse gate/up with SiLU and skip the Linear module)
        modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp, layer.mlp.down_proj)
        for name, module in zip(MATMULS, modules, strict=True):
            key = f"{i}.{name}"

            def hook(_m: nn.Module, args: tuple, key: str = key) -> None:
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                acc = sums.setdefault(key, [torch.zeros(x.shape[1]), 0])
                acc[0] += x.abs().sum(0)
                acc[1] += x.shape[0]
                rows.setdefault(key, []).append(x[torch.rand(x.shape[0], generator=g) < keep])

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                     SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    out = Captured()
    for key, parts in rows.items():
        x = torch.cat(parts)
        out.rows[key] = x[torch.randperm(x.shape[0], generator=g)[:max_rows]] if x.shape[0] > max_rows else x
        out.mean_abs[key] = sums[key][0] / max(sums[key][1], 1)
    return out


def search_scale(w: torch.Tensor, x: torch.Tensor, group: int, mean_abs: torch.Tensor | None = None,
                 grid: int = GRID) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale s minimizing ||x w^T - x (Q(w s) / s)^T||^2 over alpha in [0, 1), with Q
    round-to-nearest INT4 in groups of `group`: (s, the error of plain round-to-nearest, the error with s)."""
    w, x = w.float(), x.float()
    y = x @ w.T
    mean_abs = (x.abs().mean(0) if mean_abs is None else mean_abs.float()).clamp_min(1e-8)
    best_s, best_err, rtn_err = torch.ones_like(mean_abs), float("inf"), float("nan")
    for i in range(grid):
        s = mean_abs.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (fake_quantize(w * s, group) / s).T - y).pow(2).mean().item()
        if i == 0:
            rtn_err = err
        if err < best_err:
            best_s, best_err = s, err
    return best_s, rtn_err, best_err


def search_clip(w: torch.Tensor, x: torch.Tensor, group: int, grid: int = GRID,
                max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """Per feature and group, the range shrink in (1 - max_shrink, 1] minimizing that group's share of the output
    error (x[:, group] @ w[n, group]) over the calibration rows: [N, K/G]."""
    w, x = w.float(), x.float()
    n, k = w.shape
    xg = x.T.reshape(k // group, group, -1)  # [G#, G, R]
    wg = w.reshape(n, k // group, group).transpose(0, 1)  # [G#, N, G]
    exact = torch.bmm(wg, xg)  # [G#, N, R]: each group's share of each output
    best = torch.full((n, k // group), float("inf"))
    shrink = torch.ones(n, k // group)
    for i in range(round(max_shrink * grid)):
        ratio = 1 - i / grid
        wq = fake_quantize(w, group, torch.full((n, k // group), ratio)).reshape(n, k // group, group).transpose(0, 1)
        err = (torch.bmm(wq, xg) - exact).pow(2).mean(-1).T  # [N, G#]
        better = err < best
        best = torch.where(better, err, best)
        shrink = torch.where(better, torch.full_like(shrink, ratio), shrink)
    return shrink


@torch.no_grad()
def quantize_model(model: nn.Module, captured: Captured | None, group: int, method: str = "awq",
                   progress: Callable[[int], None] | None = None) -> tuple[dict[str, Int4Groups],
                                                                                  dict[str, tuple[float, float]]]:
    """Every decoder-layer matmul weight of `model` as INT4 in groups of `group`: `awq` folds the searched scales
    into the model's dense weights (in place; the model computes the same function) and clips, `rtn` rounds the
    weights as they are (no calibration: `captured` may be None). Returns the groups by Hugging Face weight name
    and, for awq, each scale search's (round-to-nearest, AWQ) output error on the calibration rows."""
    if method not in ("awq", "rtn"):
        raise ValueError(f"unknown method {method!r}: awq or rtn")
    if any(m.weight.is_meta for m in model.linear_layers() if not getattr(m, "shares_weight", False)):
        raise ValueError("the model's dense weights were released for packed copies; build the LLM with "
                         "batch_invariant=False (as capture_inputs needs too)")
    report: dict[str, tuple[float, float]] = {}
    quantized: dict[str, Int4Groups] = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        scales = {}
        if method == "awq":
            inter = mlp.down_proj.in_features
            key = f"{i}.down"
            s, rtn, awq = search_scale(mlp.down_proj.weight, captured.rows[key], group, captured.mean_abs[key])
            mlp.down_proj.weight.mul_(s.to(mlp.down_proj.weight.dtype))
            mlp.gate_up_proj.weight[inter:].div_(s.to(mlp.gate_up_proj.weight.dtype).unsqueeze(1))  # up's rows
            scales[key], report[key] = s, (rtn, awq)
            # gate/up's input rows were recorded before up was divided: x is unchanged (it is the norm's output)
            for name, norm in (("qkv", layer.input_layernorm), ("gate_up", layer.post_attention_layernorm)):
                key, proj = f"{i}.{name}", projections[name]
                s, rtn, awq = search_scale(proj.weight, captured.rows[key], group, captured.mean_abs[key])
                proj.weight.mul_(s.to(proj.weight.dtype))
                norm.weight.div_(s.to(norm.weight.dtype))
                scales[key], report[key] = s, (rtn, awq)
        for name, proj in projections.items():
            w = proj.weight.float()
            shrink = None
            if method == "awq":
                key = f"{i}.{name}"
                x = captured.rows[key] / scales[key] if key in scales else captured.rows[key]
                shrink = search_clip(w, x, group)
                if name == "qkv":  # q and k keep their whole range
                    shrink[:attn.qkv_proj.shard_offsets[2]] = 1.0
            groups = quantize_groups(w, group, shrink)
            for shard, hf in enumerate(_hf_names(i, name)):
                at, size = proj.shard_offsets[shard], proj.output_sizes[shard]
                quantized[hf] = Int4Groups(groups.q[at:at + size], groups.scale[at:at + size],
                                           groups.zero[at:at + size], group)
        if progress is not None:
            progress(1)
    return quantized, report


def _hf_names(layer: int, matmul: str) -> list[str]:
    prefix = f"model.layers.{layer}"
    return {"qkv": [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"],
            "o": [f"{prefix}.self_attn.o_proj.weight"],
            "gate_up": [f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"],
            "down": [f"{prefix}.mlp.down_proj.weight"]}[matmul]


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's dense weights under their Hugging Face names (fused projections split back into shards), for
    writing a checkpoint."""
    out = {}
    for name, (module, param, shard) in model.weight_targets().items():
        t = param if shard is None else param.narrow(0, module.shard_offsets[shard], module.output_sizes[shard])
        out[name] = t.detach().contiguous().clone()
    return out
