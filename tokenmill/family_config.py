"""What a config.json says about the model families' variations, read into ModelConfig's fields (config.py) and
shared with the GGUF reader: rope scaling (llama3, Phi-3's long-rope), SmolLM3's NoPE layers, sliding windows.
Plain Python: the API process reads configs without the model stack."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.errors import ConfigError


def hf_max_positions(arch: str, cfg: dict[str, Any]) -> int:
    """max_position_embeddings, within what tokenmill serves exactly: it has no sliding-window attention, so a
    Phi-3 with a window (Phi-3-mini-4k: 2047) serves lengths the window never cuts, and a Qwen3 or SmolLM3 that
    turns its windows on is refused."""
    max_positions = cfg.get("max_position_embeddings", 2048)
    if arch == "Phi3ForCausalLM" and cfg.get("sliding_window"):
        return min(max_positions, cfg["sliding_window"])
    if arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM") and cfg.get("use_sliding_window"):
        raise ConfigError(f"{arch} with use_sliding_window is not supported (no sliding-window attention)")
    return max_positions


def hf_rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling config.json asks for (None: plain rotary); one tokenmill cannot compute is refused."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind in ("longrope", "su"):
        return longrope_scaling(scaling, cfg.get("max_position_embeddings", 2048),
                                scaling.get("original_max_position_embeddings")
                                or cfg.get("original_max_position_embeddings"))
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: llama3, longrope")
    return dict(scaling)


def longrope_scaling(scaling: dict[str, Any], max_positions: int, original: int | None) -> dict[str, Any]:
    """Phi-3's long-rope parameters with everything derived fixed now, as transformers derives it: the factor
    (max / original positions unless given) and the cos/sin scale sqrt(1 + ln factor / ln original)."""
    if original is None or "short_factor" not in scaling or "long_factor" not in scaling:
        raise ConfigError("longrope scaling needs short_factor, long_factor and original_max_position_embeddings")
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]], "factor": float(factor),
            "attention_factor": float(attention), "original_max_position_embeddings": int(original)}


def hf_nope_layers(cfg: dict[str, Any]) -> list[int]:
    """SmolLM3's `no_rope_layers` (1: rotary, 0: none), or its default: every `no_rope_layer_interval`-th layer
    without rotary."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(cfg["num_hidden_layers"])]
    return [i for i, f in enumerate(flags) if not f]
