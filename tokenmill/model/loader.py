"""Find a model, read its shape (ModelConfig) and its weights under Hugging Face parameter names.

Two on-disk forms are supported: a Hugging Face directory (config.json + *.safetensors) and a llama.cpp
GGUF file. Everything downstream sees one state-dict layout, whichever form the model came in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.paths import SUPPORTED_FORMS, default_model_path, is_gguf, resolve_model_path  # noqa: F401
from tokenmill.quant.gguf import GGUFFile

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def load_model_config(path: Path) -> ModelConfig:
    """The model's shape, from config.json (HF directory) or from the GGUF metadata."""
    path = Path(path)
    if is_gguf(path):
        return gguf_model_config(GGUFFile.open(path))
    cfg = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {e.args[0]!r}") from None
    gen = path / "generation_config.json"  # instruct models often list extra stop ids only here
    if gen.is_file():
        config.eos_token_ids = _merge_ids(config.eos_token_ids, _read_json(gen).get("eos_token_id"))
    return config


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _merge_ids(ids: list[int], extra: int | list[int] | None) -> list[int]:
    extra_list = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([*ids, *extra_list]))


def gguf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    """(GGUF metadata prefix, HF architecture). llama.cpp files Mistral under `llama`; its name tells."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file {gguf.path} has unsupported architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs are filed as llama)")
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(gguf.get("general.name", "")).lower():
        hf_arch = "MistralForCausalLM"
    return arch, hf_arch


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """Map llama.cpp's `{arch}.*` metadata keys onto ModelConfig."""
    arch, hf_arch = gguf_architecture(gguf)

    def need(key: str) -> Any:
        value = gguf.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {gguf.path} lacks the metadata key {arch}.{key}")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    num_kv = gguf.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv, list):
        raise ModelLoadError(f"GGUF file {gguf.path} has per-layer KV head counts, which are not supported")
    head_dim = gguf.get(f"{arch}.attention.key_length") or gguf.get(f"{arch}.rope.dimension_count")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        embd = gguf.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd else need("vocab_size")
    eos = [gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=int(head_dim or hidden // num_heads),
        rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(gguf, arch),
        max_position_embeddings=int(gguf.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=hf_arch == "Qwen2ForCausalLM" or "blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _gguf_rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    """No mapped scaling exists yet: refuse any, rather than run the model with the wrong positions."""
    kind = gguf.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ConfigError(f"GGUF file {gguf.path} uses rope scaling {kind!r}, which tokenmill does not "
                          "support for GGUF models (supported: none; llama3 scaling via a HF directory)")
    if "rope_freqs.weight" in gguf.tensors:
        raise ConfigError(f"GGUF file {gguf.path} carries rope_freqs (llama3-style rope scaling baked into "
                          "a tensor), which tokenmill does not support; use the model's HF directory")
    return None


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by HF name, with its [out_features, in_features] shape."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All parameters under HF names, checked against the config's shapes, in `dtype`."""
    path = Path(path)
    weights = _load_gguf_weights(path, config, dtype) if is_gguf(path) else _load_safetensors(path, config, dtype)
    _check_shapes(path, weights, config)
    return weights


def _check_shapes(path: Path, weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} weights the config needs, e.g. {missing[:4]}")
    wrong = [f"{n}: {tuple(w.shape)} != {expected[n]}" for n, w in weights.items() if tuple(w.shape) != expected[n]]
    if wrong:
        raise ModelLoadError(f"{path} has weights whose shape disagrees with its config: {wrong[:4]}")


def _ignorable_hf_name(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _load_safetensors(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    expected = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        for name, tensor in tensors.items():
            if name in expected:
                weights[name] = tensor.to(dtype)
            elif not _ignorable_hf_name(name, config):
                raise ModelLoadError(f"{file} holds tensor {name!r}, which a {config.architecture} "
                                     "model does not have")
    return weights


def _safetensors_files(path: Path) -> list[Path]:
    """The shards the index names, else every *.safetensors (some repos also ship e.g. a consolidated
    original-format file next to the HF shards; the index tells which set is the HF one)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no weight_map")
    files = [path / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shards that are missing from {path}: {missing[:4]}")
    return files


# GGUF leaf name -> HF leaf name, within `blk.N.` / `model.layers.N.`
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name_for_gguf(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown names."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        leaf = _GGUF_LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{leaf}.{suffix}" if leaf else None
    leaf = _GGUF_GLOBAL_NAMES.get(base)
    return f"{leaf}.{suffix}" if leaf else None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order for llama models.

    convert_hf_to_gguf reorders each head's rows from HF's half-split rotary layout ([x0..x_{d/2}),
    [x_{d/2}..x_d)) into interleaved pairs (x0, x_{d/2}, x1, ...) for ggml's rope. Viewing each head as
    [d/2, 2] rows and swapping those two axes restores HF order (K uses the KV head count). Biases are
    permuted the same way, so this works on 1-D tensors too.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Dequantizing is a few memory-bound elementwise ops per tensor, which gain little from intra-op
    threads, while every parallel region waits for its slowest thread: on a busy 2-core machine loading
    SmolLM2 took 25 s with 2 threads and 1.7 s with 1. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_gguf_weights(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gguf = GGUFFile.open(path)
    arch, _ = gguf_architecture(gguf)
    with _one_torch_thread():
        return _dequantize_all(gguf, arch, config, dtype)


def _dequantize_all(gguf: GGUFFile, arch: str, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    path = gguf.path
    weights: dict[str, torch.Tensor] = {}
    for name in gguf.tensors:
        hf_name = hf_name_for_gguf(name)
        if hf_name is None:
            raise ModelLoadError(f"GGUF file {path} holds tensor {name!r}, which tokenmill cannot map to a "
                                 f"{config.architecture} parameter")
        w = gguf.read_tensor(name)  # float32
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_rope_rows(w, config.num_heads if ".attn_q." in name else config.num_kv_heads)
        weights[hf_name] = w if dtype == torch.float32 else w.to(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights
