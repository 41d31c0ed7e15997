"""A PEFT LoRA adapter directory, read and checked against the base model before any request runs through it.

PEFT saves `adapter_config.json` (rank, alpha, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); the update is y += scaling * B A x with scaling = alpha / r (alpha / sqrt(r) with rsLoRA), r being the
module's own rank (`rank_pattern` may give modules ranks of their own). What this engine cannot apply exactly (DoRA,
trained biases, modules saved whole, embedding or LM-head adapters) is refused by name, never run approximately.
The config part needs no torch: the API process checks an adapter before it accepts it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

    from tokenmill.model_config import ModelConfig

    # {(layer, projection): (A [r, in], scaled B^T [r, out])}: what load_adapter_weights gives
    AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

# the projections an adapter may change, as PEFT names them (our fused qkv_proj / gate_up_proj hold them as parts)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float]

    def scaling(self, rank: int, key: str) -> float:
        """PEFT's scaling of a module with rank `rank` (its `alpha_pattern` entry, if one matches its name)."""
        alpha = next((float(a) for pattern, a in self.alpha_pattern.items()
                      if re.search(rf"(^|\.){pattern}$", key.rsplit(".lora_", 1)[0])), self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _refuse(path: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"LoRA adapter {path}: {why}", param="lora_path")


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's config, checked: InvalidRequest (param lora_path) naming what is wrong."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise _refuse(str(path), f"no {CONFIG_FILE} there (a PEFT LoRA directory: {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not (root / WEIGHTS_FILE).is_file():
        raise _refuse(str(path), f"no {WEIGHTS_FILE} there (save the adapter with safe_serialization=True)")
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _refuse(str(path), f"{CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise _refuse(str(path), f"{CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(str(path), f"peft_type {raw.get('peft_type')!r}: only LORA adapters are served")
    for key, why in (("use_dora", "DoRA's magnitude vectors"), ("fan_in_fan_out", "transposed (Conv1D) weights")):
        if raw.get(key):
            raise _refuse(str(path), f"{key}: {why} are not supported")
    if raw.get("bias", "none") != "none":
        raise _refuse(str(path), f"bias {raw.get('bias')!r}: trained biases are not supported (bias: none only)")
    if raw.get("modules_to_save"):
        raise _refuse(str(path), f"modules_to_save {raw['modules_to_save']}: whole trained modules are not supported")
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _refuse(str(path), f"r must be an integer >= 1 and lora_alpha a number (r={rank!r}, "
                                 f"lora_alpha={alpha!r})")
    ranks = [rank, *(raw.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise _refuse(str(path), f"rank {max(ranks)} is above --max-lora-rank {max_rank}")
    return AdapterConfig(str(path), rank, float(alpha), bool(raw.get("use_rslora")),
                         dict(raw.get("alpha_pattern") or {}))


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of one layer."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


Plan = dict[tuple[int, str], tuple[str, str, int]]  # (layer, projection) -> its lora_A and lora_B names, its rank


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the safetensors header alone (8 bytes of length, then JSON): no tensor read, no
    torch, so the API process checks an adapter as cheaply as the engine."""
    try:
        with open(Path(path) / WEIGHTS_FILE, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _refuse(path, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None


def plan_tensors(path: str, shapes: dict[str, tuple[int, ...]], projections: dict[str, tuple[int, int]],
                 num_layers: int, max_rank: int) -> Plan:
    """Which tensor goes where, every shape checked against the base model's projections (`projections`:
    projection_shapes) and the rank limit: an adapter trained for another model is refused, not run."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.search(key)
        if m is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B matrix of a decoder layer's projection "
                                "(embedding, LM head and other modules are not supported)")
        layer, target, half = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise _refuse(path, f"tensor {key!r} targets {target!r}; supported: {', '.join(TARGETS)}")
        if layer >= num_layers:
            raise _refuse(path, f"tensor {key!r} is for layer {layer}; the base model has {num_layers}")
        halves.setdefault((layer, target), {})[half] = key
    plan: Plan = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {target} has lora_{next(iter(pair))} without its other half")
        a, b = shapes[pair["A"]], shapes[pair["B"]]
        fan_in, fan_out = projections[target]
        rank = a[0] if len(a) == 2 else -1
        if a != (rank, fan_in) or b != (fan_out, rank):
            raise _refuse(path, f"layer {layer} {target}: lora_A {a} / lora_B {b} do not fit the base model's "
                                f"({fan_out} x {fan_in}) projection: an adapter for another model?")
        if rank > max_rank:
            raise _refuse(path, f"layer {layer} {target} has rank {rank}, above --max-lora-rank {max_rank}")
        plan[(layer, target)] = (pair["A"], pair["B"], rank)
    if not plan:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    return plan


def check_adapter(path: str, projections: dict[str, tuple[int, int]], num_layers: int, max_rank: int
                  ) -> AdapterConfig:
    """The whole check of an adapter directory for a base model, reading no tensor (the API process's)."""
    config = read_adapter_config(path, max_rank)
    plan_tensors(config.path, tensor_shapes(config.path), projections, num_layers, max_rank)
    return config


def load_adapter_weights(config: AdapterConfig, model: ModelConfig, max_rank: int) -> AdapterWeights:
    """{(layer, projection): (A [r, in], scaling * B^T [r, out])} in float32, checked as plan_tensors checks: each
    rank-r row of A and of B^T contiguous, as the grouped update reads them (model/lora.py)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(Path(config.path) / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise _refuse(config.path, f"{WEIGHTS_FILE} is not readable: {e}") from None
    plan = plan_tensors(config.path, {k: tuple(t.shape) for k, t in tensors.items()}, projection_shapes(model),
                        model.num_layers, max_rank)
    return {where: (tensors[a].float().contiguous(),
                    (tensors[b].float() * config.scaling(rank, a)).t().contiguous())
            for where, (a, b, rank) in plan.items()}
