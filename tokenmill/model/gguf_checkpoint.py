"""A llama.cpp GGUF file as a tokenmill model: its ModelConfig from the `{arch}.*` metadata, and its tensors under
Hugging Face parameter names (a Checkpoint), in HF's rotary row order."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.checkpoint import Checkpoint
from tokenmill.quant.gguf import GGUFFile
from tokenmill.quant.gguf_blocks import GGMLBlocks, kept_gguf_type

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file: each read dequantizes one tensor (a chunk of rows at a time when `dtype` is not
    float32, quant/gguf_blocks.py) and undoes llama.cpp's rotary row order for llama q/k."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype):
        self._gguf = gguf = GGUFFile.open(path)
        arch, _ = gguf_architecture(gguf)
        self._names: dict[str, str] = {}  # HF name -> GGUF name
        self._rope_heads: dict[str, int] = {}  # HF name -> heads, for the rows llama.cpp permuted
        for name in gguf.tensors:
            hf_name = hf_name_for_gguf(name)
            if hf_name is None:
                raise ModelLoadError(f"GGUF file {path} holds tensor {name!r}, which tokenmill cannot map to a "
                                     f"{config.architecture} parameter")
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            self._names[hf_name] = name
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                self._rope_heads[hf_name] = config.num_heads if ".attn_q." in name else config.num_kv_heads
        super().__init__(path, config, dtype, {n: gguf.tensors[g].shape for n, g in self._names.items()})

    def _read(self, name: str) -> torch.Tensor:
        w = self._gguf.read_tensor(self._names[name], self.dtype)
        heads = self._rope_heads.get(name)
        return w if heads is None else unpermute_rope_rows(w, heads)

    def blocks(self, name: str) -> torch.Tensor | GGMLBlocks:
        """A 2-D tensor of a type kept at run time (quant/gguf_linear.py) as its raw blocks, rows in HF order;
        any other tensor dequantized, as `self[name]`."""
        info = self._gguf.tensors[self._names[name]]
        if len(info.shape) != 2 or not kept_gguf_type(info.ggml_type):
            return self[name]
        rows = self._gguf.read_raw(info.name).view(info.shape[0], -1)
        heads = self._rope_heads.get(name)
        return GGMLBlocks(info.ggml_type, rows if heads is None else unpermute_rope_rows(rows, heads), info.shape)
