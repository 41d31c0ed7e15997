"""Activation-aware weight quantization (AWQ, Lin et al. 2023): the scale search, before round-to-nearest INT4.

A weight column that meets large activations matters more to the output than one that meets small ones. AWQ
multiplies each input channel j of a matmul by s_j = mean|x_j|^alpha before quantizing (so the important columns
get finer steps) and divides the layer's input by s_j, which costs nothing at run time: the division folds into
the op before (the RMSNorm weight in front of q/k/v and gate/up; the up rows of gate/up in front of down). alpha
is searched per matmul on calibration activations, minimizing the output error of the quantized product; alpha = 0
is plain round-to-nearest, so the search never does worse than it on the calibration rows.

Here: `capture_inputs` records each matmul's inputs while the engine prefills calibration text (modules path:
`batch_invariant=False` so first chunks run layer by layer), `apply_awq` searches and folds the scales into the
model's dense weights in place; quantizing them afterwards (`--quantization int4`, tokenmill/quant/int4.py) gives
the AWQ model. o_proj keeps scale 1: its input comes from v through attention, and with grouped-query heads one
v channel feeds several o channels, so no single fold exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.quant.gguf import dequantize
from tokenmill.quant.int4 import Q4_1, quantize_q4_1

GRID = 20  # alphas 0, 1/20, ..., 19/20
MAX_ROWS = 512  # calibration rows kept per matmul (a fixed random subset)


def rtn_int4(w: torch.Tensor) -> torch.Tensor:
    """w as round-to-nearest INT4 (groups of 32) gives it back, in float32."""
    return dequantize(quantize_q4_1(w), Q4_1, tuple(w.shape))


def capture_inputs(llm: Any, prompts: Sequence[Sequence[int]], max_rows: int = MAX_ROWS,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Each decoder layer's q/k/v, gate/up and down inputs while `llm` (tokenmill.LLM, built with
    batch_invariant=False and no prefix caching, so prompts run module by module; steps that hold only later
    chunks take the fused decode path and are not seen) prefills `prompts`: up to `max_rows` rows each, float32."""
    from tokenmill.sampling_params import SamplingParams

    model = llm.engine.core.runner.model
    rows: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        # the MLP module's input is gate/up's (a backend may fuse gate/up with SiLU and skip the Linear module)
        for name, module in (("qkv", layer.self_attn.qkv_proj), ("gate_up", layer.mlp), ("down", layer.mlp.down_proj)):
            key = f"{i}.{name}"

            def hook(_m: nn.Module, args: tuple, key: str = key) -> None:
                rows.setdefault(key, []).append(args[0].detach().float().reshape(-1, args[0].shape[-1]))

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                     SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, parts in rows.items():
        x = torch.cat(parts)
        out[key] = x[torch.randperm(x.shape[0], generator=g)[:max_rows]] if x.shape[0] > max_rows else x
    return out


def search_scale(w: torch.Tensor, x: torch.Tensor, grid: int = GRID) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale s minimizing ||x w^T - x (Q(w s) / s)^T||^2 over alpha in [0, 1): (s, the error
    of plain round-to-nearest, the error with s)."""
    w, x = w.float(), x.float()
    y = x @ w.T
    mean_abs = x.abs().mean(0).clamp_min(1e-8)
    best_s, best_err, rtn_err = torch.ones_like(mean_abs), float("inf"), float("nan")
    for i in range(grid):
        s = mean_abs.pow(i / grid)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (rtn_int4(w * s) / s).T - y).pow(2).mean().item()
        if i == 0:
            rtn_err = err
        if err < best_err:
            best_s, best_err = s, err
    return best_s, rtn_err, best_err


@torch.no_grad()
def apply_awq(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Search and fold AWQ scales into `model`'s dense weights, layer by layer; returns per matmul the output
    error of round-to-nearest and of AWQ on the calibration rows."""
    report = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        inter = mlp.down_proj.in_features
        s, rtn, awq = search_scale(mlp.down_proj.weight, inputs[f"{i}.down"])
        mlp.down_proj.weight.mul_(s.to(mlp.down_proj.weight.dtype))
        mlp.gate_up_proj.weight[inter:].div_(s.to(mlp.gate_up_proj.weight.dtype).unsqueeze(1))  # up's rows
        report[f"{i}.down"] = (rtn, awq)
        # gate/up's input rows were recorded before up was divided: x is unchanged (it is the norm's output)
        for key, proj, norm in ((f"{i}.qkv", attn.qkv_proj, layer.input_layernorm),
                                (f"{i}.gate_up", mlp.gate_up_proj, layer.post_attention_layernorm)):
            s, rtn, awq = search_scale(proj.weight, inputs[key])
            proj.weight.mul_(s.to(proj.weight.dtype))
            norm.weight.div_(s.to(norm.weight.dtype))
            report[key] = (rtn, awq)
    return report


def dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's dense weights under their Hugging Face names (fused projections split back into shards), for
    writing a checkpoint."""
    out = {}
    for name, (module, param, shard) in model.weight_targets().items():
        t = param if shard is None else param.narrow(0, module.shard_offsets[shard], module.output_sizes[shard])
        out[name] = t.detach().contiguous().clone()
    return out
