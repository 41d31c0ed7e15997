"""A llama.cpp GGUF file's tensors under Hugging Face parameter names (a Checkpoint), in HF's rotary row order; its
ModelConfig comes from model/gguf_config.py."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.family_config import lfm2_name
from tokenmill.formats.gguf import GGUFFile
from tokenmill.formats.gguf_blocks import GGMLBlocks, dequantize, kept_gguf_type
from tokenmill.formats.kquants import TRANSCODED
from tokenmill.model.checkpoint import Checkpoint, expected_shapes, expert_tensor_name, fused_parts
from tokenmill.model.gguf_config import gguf_architecture
from tokenmill.model_config import ModelConfig

# one expert projection of every expert stacked [experts, rows, cols], as llama.cpp stores them
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# llama.cpp's converter reorders q/k rows for ggml's rope of these (LlamaModel and its subclasses), not the others
PERMUTED_QK = ("llama", "smollm3", "granitehybrid")
# tensors llama.cpp writes that the config reads (Phi-3's long-rope factors), not model weights
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


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
# Granite-4.0-H's: its shared MLP and its Mamba2 tensors (ssm_a holds -exp(A_log) as [heads, 1], ssm_d D as
# [heads, 1], ssm_norm the norm's weight as [groups, inner / groups])
_GRANITE_LAYER_NAMES = {"ffn_gate.weight": "shared_mlp.gate_proj.weight", "ffn_up.weight": "shared_mlp.up_proj.weight",
                        "ffn_down.weight": "shared_mlp.output_linear.weight", "ssm_in.weight": "mamba.in_proj.weight",
                        "ssm_in.bias": "mamba.in_proj.bias", "ssm_conv1d.weight": "mamba.conv1d.weight",
                        "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log",
                        "ssm_d": "mamba.D", "ssm_norm.weight": "mamba.norm.weight",
                        "ssm_out.weight": "mamba.out_proj.weight", "ssm_out.bias": "mamba.out_proj.bias"}
# Qwen3.5-MoE's: Qwen3.5's, and its shared expert and the shared expert's gate ([1, hidden] in the file)
_QWEN35MOE_LAYER_NAMES = {**_QWEN35_LAYER_NAMES, "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LFM2_GLOBAL_NAMES = {**_GGUF_GLOBAL_NAMES, "token_embd_norm": "model.norm"}


def hf_name_for_gguf(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown names. Phi-3's
    `ffn_up` holds gate and up stacked (its HF `gate_up_proj`), which checkpoint.fused_parts splits."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    own = {"qwen35": _QWEN35_LAYER_NAMES, "qwen35moe": _QWEN35MOE_LAYER_NAMES,
           "granitehybrid": _GRANITE_LAYER_NAMES}.get(arch, {})
    if m and m.group(2) in own:
        return f"model.layers.{m.group(1)}.{own[m.group(2)]}"
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
        self._decays: set[str] = set()  # Qwen3.5's and Granite-4.0-H's A_log, stored as -exp(A_log)
        # Granite-4.0-H's ssm_a, ssm_d, ssm_norm, Qwen3.5-MoE's shared expert gate: to the HF shape
        self._reshaped: dict[str, tuple[int, ...]] = {}
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
            qwen35 = arch in ("qwen35", "qwen35moe")
            if (arch == "gemma3" or qwen35 and ".ssm_norm." not in name) and name.endswith("norm.weight"):
                self._shifted.add(hf_name)
            if name.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):
                self._squeezed.add(hf_name)
            if name.endswith(".ssm_a"):
                self._decays.add(hf_name)
            if arch == "granitehybrid" and name.endswith((".ssm_a", ".ssm_d", ".ssm_norm.weight")) or \
                    name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp's loader takes it as [hidden] too
                self._reshaped[hf_name] = expected[hf_name]
            if arch in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
                self._rope_heads[hf_name] = config.num_heads if ".attn_q." in name else config.num_kv_heads
        shapes.update({n: gguf.tensors[g].shape for n, g in self._names.items() if n not in self._experts})
        shapes.update({n: (shapes[n][0], 1, shapes[n][1]) for n in self._squeezed})
        shapes.update(self._reshaped)
        super().__init__(path, config, dtype, shapes)

    def _read(self, name: str) -> torch.Tensor:
        if name in self._experts:  # one expert's slice of the stacked tensor, read and decoded alone
            info = self._gguf.tensors[self._names[name]]
            return dequantize(self._gguf.read_raw(info.name, self._experts[name]), info.ggml_type, info.shape[1:],
                              self.dtype)
        if name in self._shifted:  # 1 + w in float32 (exactly w where w + 1 was exact), then the model's dtype
            return (self._gguf.read_tensor(self._names[name], torch.float32) - 1.0).to(self.dtype)
        if name in self._decays:  # A_log from -exp(A_log), in float32
            a = torch.log(-self._gguf.read_tensor(self._names[name], torch.float32))
            return a.reshape(self._reshaped.get(name, a.shape)).to(self.dtype)
        if name in self._reshaped:
            return self._gguf.read_tensor(self._names[name], self.dtype).reshape(self._reshaped[name])
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
