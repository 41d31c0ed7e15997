"""A llama.cpp GGUF file as a tokenmill model: its ModelConfig from the `{arch}.*` metadata, and its tensors under
Hugging Face parameter names (a Checkpoint), in HF's rotary row order."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.family_config import lfm2_name, longrope_scaling
from tokenmill.formats.gguf import GGUFFile
from tokenmill.formats.gguf_blocks import GGMLBlocks, dequantize, kept_gguf_type
from tokenmill.formats.kquants import TRANSCODED
from tokenmill.model.checkpoint import Checkpoint, expected_shapes, expert_tensor_name, fused_parts
from tokenmill.model_config import ModelConfig

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "lfm2": "Lfm2ForCausalLM",
                      "qwen35": "Qwen3_5ForCausalLM"}
# whether llama.cpp renormalises a mixture of experts' top weights, by architecture (unless the file says)
_MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False}
# one expert projection of every expert stacked [experts, rows, cols], as llama.cpp stores them
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# llama.cpp's converter reorders q/k rows for ggml's rope of these (LlamaModel and its subclasses), not the others
PERMUTED_QK = ("llama", "smollm3")
# tensors llama.cpp writes that the config reads (Phi-3's long-rope factors), not model weights
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    """(GGUF metadata prefix, HF architecture). llama.cpp files Mistral under `llama`; its name tells."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file {gguf.path} has unsupported architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs are filed as llama)")
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and gguf.get("llama.expert_count"):  # llama.cpp files Mixtral under `llama`, with experts
        hf_arch = "MixtralForCausalLM"
    elif arch == "llama" and "mistral" in str(gguf.get("general.name", "")).lower():
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
    conv: dict[str, Any] = {}
    if arch == "lfm2":  # per layer: 0 where the layer is a short convolution
        counts = [int(n) for n in (num_kv if isinstance(num_kv, list) else [num_kv])]
        conv = {"conv_layers": [i for i, n in enumerate(counts) if n == 0],
                "conv_kernel": int(need("shortconv.l_cache")),
                "conv_bias": any(n.endswith("shortconv.in_proj.bias") for n in gguf.tensors)}
        num_kv = max(counts)
    elif arch == "qwen35":
        conv = _gguf_qwen35_fields(gguf)
    elif isinstance(num_kv, list):
        raise ModelLoadError(f"GGUF file {gguf.path} has per-layer KV head counts, which are not supported")
    head_dim = int(gguf.get(f"{arch}.attention.key_length") or 0)
    rope_dims = gguf.get(f"{arch}.rope.dimension_count")
    partial = 1.0
    if arch == "phi3":  # rope.dimension_count is the rotated part of a head (Phi-4-mini: 96 of 128)
        head_dim = head_dim or hidden // num_heads
        partial = int(rope_dims) / head_dim if rope_dims else 1.0
        if int(head_dim * partial) != (rope_dims or head_dim):
            raise ModelLoadError(f"GGUF file {gguf.path}: rotating {rope_dims} of {head_dim} dims is not supported")
    elif arch == "qwen35":  # rope.dimension_count is the rotated part of a head (a quarter)
        partial = int(rope_dims) / head_dim
    else:
        head_dim = head_dim or int(rope_dims or 0)
    context = int(gguf.get(f"{arch}.context_length", 2048))
    window = gguf.get(f"{arch}.attention.sliding_window") if arch == "phi3" else None
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        embd = gguf.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd else need("vocab_size")
    eos = [gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    if arch == "gemma3" and tokens and "<end_of_turn>" in tokens:  # a chat turn's end, as llama.cpp finds it
        eos.append(tokens.index("<end_of_turn>"))
    layers = int(need("block_count")) - int(gguf.get(f"{arch}.nextn_predict_layers", 0))  # MTP blocks: not run
    family = (_gguf_gemma3_fields(gguf, layers, int(head_dim or hidden // num_heads), hidden // num_heads)
              if arch == "gemma3" else {"rope_scaling": _gguf_rope_scaling(gguf, arch, context)})
    moe = _gguf_moe_fields(gguf, arch, layers) if gguf.get(f"{arch}.expert_count") else {}
    ffn = gguf.get(f"{arch}.feed_forward_length") or moe.get("moe_intermediate_size") or need("feed_forward_length")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=int(head_dim or hidden // num_heads),
        rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        # no sliding-window attention here: serve only lengths Phi-3's window never cuts (0: none)
        max_position_embeddings=min(context, int(window)) if window else context,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=hf_arch == "Qwen2ForCausalLM" or "blk.0.attn_q.bias" in gguf.tensors,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmoe", "lfm2", "qwen35"),
        partial_rotary_factor=partial,
        # llama.cpp has no key for SmolLM3's NoPE layers: it fixes every 4th (src/models/smollm3.cpp), as here
        nope_layers=[i for i in range(layers) if (i + 1) % 4 == 0] if arch == "smollm3" else [],
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
        **family,
        **moe,
        **conv,
    )


def _gguf_qwen35_fields(gguf: GGUFFile) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet from llama.cpp's keys: the recurrent layers (its list, else every layer but each
    full_attention_interval-th), key heads (ssm.group_count) of ssm.state_size dims, value heads (time_step_rank)
    sharing ssm.inner_size, and the value heads in llama.cpp's tiled order where there are more of them."""
    layers = int(gguf.get("qwen35.block_count")) - int(gguf.get("qwen35.nextn_predict_layers", 0))
    recurrent = gguf.get("qwen35.attention.recurrent_layers")
    every = int(gguf.get("qwen35.full_attention_interval", 4))
    delta = ([i for i, r in enumerate(recurrent[:layers]) if r] if isinstance(recurrent, list)
             else [i for i in range(layers) if (i + 1) % every])
    key_heads, value_heads = int(gguf.get("qwen35.ssm.group_count")), int(gguf.get("qwen35.ssm.time_step_rank"))
    return {"delta_layers": delta, "delta_key_heads": key_heads, "delta_value_heads": value_heads,
            "delta_key_dim": int(gguf.get("qwen35.ssm.state_size")),
            "delta_value_dim": int(gguf.get("qwen35.ssm.inner_size")) // value_heads,
            "conv_kernel": int(gguf.get("qwen35.ssm.conv_kernel")), "delta_tiled_heads": key_heads != value_heads}


def _gguf_moe_fields(gguf: GGUFFile, arch: str, layers: int) -> dict[str, Any]:
    """A mixture of experts' fields from llama.cpp's keys: expert counts, an expert's width (its own key, else the
    feed-forward length), whether the top weights are renormalised (the file's key, else what llama.cpp does for the
    architecture), OLMoE's clamp; a layer holding a plain MLP's tensors is a dense one."""
    width = gguf.get(f"{arch}.expert_feed_forward_length") or gguf.get(f"{arch}.feed_forward_length")
    norm = gguf.get(f"{arch}.expert_weights_norm")
    clip = gguf.get(f"{arch}.attention.clamp_kqv")
    return {"num_experts": int(gguf.get(f"{arch}.expert_count")),
            "num_experts_per_tok": int(gguf.get(f"{arch}.expert_used_count", 0)),
            "moe_intermediate_size": int(width or 0),
            "norm_topk_prob": bool(_MOE_NORM_TOPK.get(arch, True) if norm is None else norm),
            "dense_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate.weight" in gguf.tensors],
            "clip_qkv": float(clip) if clip else None}


def _gguf_gemma3_fields(gguf: GGUFFile, layers: int, head_dim: int, head_width: int) -> dict[str, Any]:
    """Gemma 3 as llama.cpp runs it (src/llama-model.cpp), which the file's keys do not all say: every 6th layer
    global and the others local (unless the file lists them), the local ones with base 10000 and the file's window;
    scores scaled by head_dim ** -0.5 (the 27B, 62 layers: (hidden / heads) ** -0.5); linear rope scaling on the
    global layers where the file asks for it."""
    window = gguf.get("gemma3.attention.sliding_window")
    pattern = gguf.get("gemma3.attention.sliding_window_pattern", 6)
    local = ([i for i, f in enumerate(pattern) if f] if isinstance(pattern, list)
             else [i for i in range(layers) if (i + 1) % int(pattern)])
    kind, factor = gguf.get("gemma3.rope.scaling.type"), gguf.get("gemma3.rope.scaling.factor")
    if kind not in (None, "none", "linear"):
        raise ConfigError(f"GGUF file {gguf.path} uses rope scaling {kind!r}; Gemma 3 takes linear only")
    return {"sliding_window": int(window) if window else None, "sliding_layers": local if window else [],
            "rope_local_theta": 10000.0, "query_pre_attn_scalar": float(head_width if layers == 62 else head_dim),
            "rope_scaling": ({"rope_type": "linear", "factor": float(factor)}
                             if kind == "linear" and factor and factor != 1.0 else None)}


def _gguf_rope_scaling(gguf: GGUFFile, arch: str, context: int) -> dict[str, Any] | None:
    """Phi-3's long-rope (its factors stored as two tensors, as llama.cpp's converter writes them); any other
    scaling is refused, rather than run the model with the wrong positions."""
    if arch == "phi3" and "rope_factors_long.weight" in gguf.tensors:
        original = gguf.get(f"{arch}.rope.scaling.original_context_length")
        factors = {f"{k}_factor": gguf.read_tensor(f"rope_factors_{k}.weight").tolist() for k in ("short", "long")}
        try:
            return longrope_scaling({**factors, "attention_factor": gguf.get(f"{arch}.rope.scaling.attn_factor")},
                                    context, original)
        except ConfigError as e:
            raise ModelLoadError(f"GGUF file {gguf.path}: {e}") from None
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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, split by checkpoint.fused_parts
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router (Mixtral's: block_sparse_moe.gate)
}
# Gemma 3's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, not after attention
_GEMMA3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# LFM2's convolution layers; its final norm, which llama.cpp's converter files as token_embd_norm (its HF name:
# embedding_norm)
_LFM2_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv",
                     "shortconv.out_proj": "conv.out_proj"}
# Qwen3.5's: its Gated DeltaNet tensors, with their suffixes (ssm_a, -exp(A_log), has none; ssm_dt.bias is dt_bias)
_QWEN35_LAYER_NAMES = {"attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
                       "attn_gate.weight": "linear_attn.in_proj_z.weight",
                       "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                       "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_dt.bias": "linear_attn.dt_bias",
                       "ssm_a": "linear_attn.A_log", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
                       "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
                       "post_attention_norm.weight": "post_attention_layernorm.weight"}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LFM2_GLOBAL_NAMES = {**_GGUF_GLOBAL_NAMES, "token_embd_norm": "model.norm"}


def hf_name_for_gguf(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown names. Phi-3's
    `ffn_up` holds gate and up stacked (its HF `gate_up_proj`), which checkpoint.fused_parts splits."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if arch == "qwen35" and m and m.group(2) in _QWEN35_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_QWEN35_LAYER_NAMES[m.group(2)]}"
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", base)
    if m:
        names = {"gemma3": _GEMMA3_LAYER_NAMES, "lfm2": _LFM2_LAYER_NAMES}.get(arch, _GGUF_LAYER_NAMES)
        leaf = "mlp.gate_up_proj" if arch == "phi3" and m.group(2) == "ffn_up" else names.get(m.group(2))
        if arch == "llama" and m.group(2) == "ffn_gate_inp":
            leaf = "block_sparse_moe.gate"
        name = f"model.layers.{m.group(1)}.{leaf}.{suffix}" if leaf else None
    else:
        leaf = (_LFM2_GLOBAL_NAMES if arch == "lfm2" else _GGUF_GLOBAL_NAMES).get(base)
        name = f"{leaf}.{suffix}" if leaf else None
    return lfm2_name(name) if arch == "lfm2" and name else name


def _extra_block(name: str, layers: int) -> bool:
    """A tensor of a block past the model's layers: a multi-token-prediction block (Qwen3.5's nextn), not run."""
    m = re.match(r"blk\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= layers


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
    float32, formats/gguf_blocks.py) and undoes llama.cpp's rotary row order for llama q/k, the + 1 its converter
    adds to Gemma 3's and Qwen3.5's norm weights (the file holds 1 + w; transformers' checkpoints and ours, w), and
    Qwen3.5's -exp(A_log). Qwen3.5's value heads stay in the file's order (ModelConfig.delta_tiled_heads)."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype):
        self._gguf = gguf = GGUFFile.open(path)
        arch, _ = gguf_architecture(gguf)
        expected = expected_shapes(config)
        self._names: dict[str, str] = {}  # HF name -> GGUF name
        self._rope_heads: dict[str, int] = {}  # HF name -> heads, for the rows llama.cpp permuted
        self._shifted: set[str] = set()  # HF names of Gemma 3's norm weights, stored + 1
        self._experts: dict[str, int] = {}  # HF name of one expert's projection -> its index in the stacked tensor
        # LFM2's and Qwen3.5's convolution weights, stored [C, K] (the checkpoint's: [C, 1, K])
        self._squeezed: set[str] = set()
        self._decays: set[str] = set()  # Qwen3.5's A_log, stored as -exp(A_log)
        shapes: dict[str, tuple[int, ...]] = {}
        for name in gguf.tensors:
            if name in _CONFIG_TENSORS or _extra_block(name, config.num_layers):
                continue
            stacked = _EXPERT_TENSOR.fullmatch(name)
            if stacked is not None and config.moe:
                info = gguf.tensors[name]
                for e in range(min(info.shape[0], config.num_experts)):
                    hf_name = expert_tensor_name(config, int(stacked.group(1)), e, stacked.group(2))
                    self._names[hf_name], self._experts[hf_name], shapes[hf_name] = name, e, info.shape[1:]
                continue
            hf_name = hf_name_for_gguf(name, arch)
            if hf_name is None or (hf_name not in expected and fused_parts(hf_name, expected) is None
                                   and hf_name != "lm_head.weight"):
                raise ModelLoadError(f"GGUF file {path} holds tensor {name!r}, which tokenmill cannot map to a "
                                     f"{config.architecture} parameter")
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            self._names[hf_name] = name
            if (arch == "gemma3" or arch == "qwen35" and ".ssm_norm." not in name) and name.endswith("norm.weight"):
                self._shifted.add(hf_name)
            if name.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):
                self._squeezed.add(hf_name)
            if arch == "qwen35" and name.endswith(".ssm_a"):
                self._decays.add(hf_name)
            if arch in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
                self._rope_heads[hf_name] = config.num_heads if ".attn_q." in name else config.num_kv_heads
        shapes.update({n: gguf.tensors[g].shape for n, g in self._names.items() if n not in self._experts})
        shapes.update({n: (shapes[n][0], 1, shapes[n][1]) for n in self._squeezed})
        super().__init__(path, config, dtype, shapes)

    def _read(self, name: str) -> torch.Tensor:
        if name in self._experts:  # one expert's slice of the stacked tensor, read and decoded alone
            info = self._gguf.tensors[self._names[name]]
            return dequantize(self._gguf.read_raw(info.name, self._experts[name]), info.ggml_type, info.shape[1:],
                              self.dtype)
        if name in self._shifted:  # 1 + w in float32 (exactly w where w + 1 was exact), then the model's dtype
            return (self._gguf.read_tensor(self._names[name], torch.float32) - 1.0).to(self.dtype)
        if name in self._decays:  # A_log from -exp(A_log), in float32
            return torch.log(-self._gguf.read_tensor(self._names[name], torch.float32)).to(self.dtype)
        w = self._gguf.read_tensor(self._names[name], self.dtype)
        if name in self._squeezed:
            return w.unsqueeze(1)
        heads = self._rope_heads.get(name)
        return w if heads is None else unpermute_rope_rows(w, heads)

    def blocks(self, name: str) -> torch.Tensor | GGMLBlocks:
        """A 2-D tensor of a type kept at run time (quant/gguf_linear.py), or re-cut to be (formats/kquants.py), as
        its raw blocks, rows in HF order; any other tensor dequantized, as `self[name]`."""
        part = self._parts.get(name)  # a block of a fused tensor's rows (Phi-3's q/k/v, gate/up)
        info = self._gguf.tensors[self._names[part[0] if part else name]]
        if name in self._experts:
            if not (kept_gguf_type(info.ggml_type) or int(info.ggml_type) in TRANSCODED):
                return self[name]
            rows = self._gguf.read_raw(info.name, self._experts[name]).view(info.shape[1], -1)
            return GGMLBlocks(info.ggml_type, rows, info.shape[1:])
        if len(info.shape) != 2 or not (kept_gguf_type(info.ggml_type) or int(info.ggml_type) in TRANSCODED):
            return self[name]
        rows = self._gguf.read_raw(info.name).view(info.shape[0], -1)
        if part is not None:
            return GGMLBlocks(info.ggml_type, rows[part[1]:part[1] + part[2]], (part[2], info.shape[1]))
        heads = self._rope_heads.get(name)
        return GGMLBlocks(info.ggml_type, rows if heads is None else unpermute_rope_rows(rows, heads), info.shape)
