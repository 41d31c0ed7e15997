"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, for tests that load a tiny model from
GGUF: the metadata every Llama-shaped architecture's converter writes, from the HF config (each test adds its
architecture's own keys and its tensors), and a whole LFM2 file (model, engine and planner tests read it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def llama_like_writer(out: Path, arch: str, cfg: dict[str, Any], name: str, rope_theta: float | None = None) -> Any:
    """A gguf.GGUFWriter for `arch` holding the shape keys (layers, context, widths, heads, norm epsilon, rotary
    base: `rope_theta`, else the config's)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):  # a model with experts only (Qwen3.5-MoE) has none
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if rope_theta is None:
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_rope_freq_base(rope_theta)
    return w


def write(w: Any) -> None:
    """Header, metadata, tensors, in the order a GGUF file holds them."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_lfm2_gguf(model_dir: Path, out: Path, qtype=None) -> Path:
    """A GGUF file of the HF directory's LFM2 as llama.cpp's convert_hf_to_gguf.py (LFM2Model) writes it: KV
    head counts per layer (0 for a convolution layer), shortconv.l_cache, the derived feed-forward width,
    tensor names from gguf-py's map (the final norm as token_embd_norm), the convolution weights squeezed to
    [C, K]; 2-D weights in `qtype` (None: F32)."""
    from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map, quants

    from tokenmill.model.loader import load_model_config

    cfg = json.loads((model_dir / "config.json").read_text())
    ours = load_model_config(model_dir)
    w = GGUFWriter(str(out), "lfm2")
    w.add_name("tiny lfm2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(ours.intermediate_size)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = get_tensor_name_map(MODEL_ARCH.LFM2, cfg["num_hidden_layers"])
    from safetensors.torch import load_file

    for hf_name, tensor in load_file(model_dir / "model.safetensors").items():
        data = tensor.numpy().astype(np.float32)
        if "conv.conv" in hf_name:
            data = data.squeeze(1)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if qtype is not None and data.ndim == 2 and "shortconv.conv" not in name:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    write(w)
    return out


def write_qwen3_5_gguf(model_dir: Path, out: Path, qtype=None) -> Path:
    """A GGUF file of the HF directory's Qwen3.5 as llama.cpp's convert_hf_to_gguf.py (Qwen3_5TextModel, with
    --no-mtp) writes it: the recurrent layers as a list, the ssm.* keys, rope on a quarter of each head; every norm
    weight + 1 but the gated one, A_log as -exp(A_log), the convolution squeezed to [C, K] and kept in F32, and the
    value heads reordered from grouped to tiled (GGUF head h is HF head (h % key heads) * per key + h // key heads)
    in every tensor that has them; other 2-D weights in `qtype` (None: F32). A Qwen3.5-MoE directory gives a
    `qwen35moe` file: the expert keys, each layer's experts stacked [experts, rows, cols] (ffn_*_exps), the shared
    expert (ffn_*_shexp), the router and the shared expert's gate kept in F32."""
    from gguf import MODEL_ARCH, get_tensor_name_map, quants
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    nk, nv, dk, dv = (cfg[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                   "value_head_dim"))
    per_key = nv // nk
    order = np.array([(h % nk) * per_key + h // nk for h in range(nv)])  # GGUF head h <- HF head order[h]

    def heads(x: np.ndarray, width: int, axis: int = 0, skip: int = 0) -> np.ndarray:
        """x with its value heads (`width` wide, after the first `skip` along `axis`) in tiled order."""
        x = np.moveaxis(x, axis, 0)
        lead, rest = x[:skip], x[skip:]
        rest = rest.reshape(nv, width, *rest.shape[1:])[order].reshape(rest.shape)
        return np.moveaxis(np.concatenate([lead, rest]), 0, axis)

    arch = "qwen35moe" if cfg.get("num_experts") else "qwen35"
    w = llama_like_writer(out, arch, cfg, "tiny qwen3.5")
    if arch == "qwen35moe":  # no feed_forward_length: the converter writes the experts' widths only
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_vocab_size(cfg["vocab_size"])  # the converter writes the tokenizer's tokens instead
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(4)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = get_tensor_name_map(MODEL_ARCH.QWEN35MOE if arch == "qwen35moe" else MODEL_ARCH.QWEN35,
                                cfg["num_hidden_layers"])
    tensors = load_file(model_dir / "model.safetensors")
    experts = {}  # (layer, proj) -> every expert's tensor, stacked below as llama.cpp's ffn_*_exps
    for hf_name in [n for n in tensors if ".mlp.experts." in n]:
        _, _, layer, _, _, e, proj, _ = hf_name.split(".")
        experts.setdefault((int(layer), proj), {})[int(e)] = tensors.pop(hf_name).numpy().astype(np.float32)
    for (layer, proj), by_expert in experts.items():
        data = np.stack([by_expert[e] for e in sorted(by_expert)])
        name = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
        w.add_tensor(name, quants.quantize(data, qtype) if qtype is not None else data,
                     raw_dtype=qtype if qtype is not None else None)
    for hf_name, tensor in tensors.items():
        data = tensor.numpy().astype(np.float32)
        leaf = hf_name.rsplit(".", 1)[-1] if "linear_attn." in hf_name else ""
        if hf_name.endswith("norm.weight") and "linear_attn.norm" not in hf_name:
            data = data + 1.0
        if "in_proj_qkv" in hf_name:
            data = heads(data, dv, skip=2 * nk * dk)
        elif any(p in hf_name for p in ("in_proj_z", "in_proj_b", "in_proj_a")) or leaf in ("dt_bias", "A_log"):
            data = heads(data, dv if "in_proj_z" in hf_name else 1)
        elif "conv1d" in hf_name:
            data = heads(data.squeeze(1), dv, skip=2 * nk * dk)
        elif "linear_attn.out_proj" in hf_name:
            data = heads(data, dv, axis=1)
        if leaf == "A_log":
            data = -np.exp(data)
        base = hf_name.replace(".dt_bias", ".dt_proj.bias")
        name = names.get_name(base, try_suffixes=(".weight", ".bias")) or names.get_name(base)
        assert name is not None, hf_name
        if qtype is not None and data.ndim == 2 and "ssm_conv1d" not in name and ".ffn_gate_inp" not in name:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    write(w)
    return out


def write_granite_hybrid_gguf(model_dir: Path, out: Path, qtype=None) -> Path:
    """A GGUF file of the HF directory's Granite-4.0-H (no experts) as llama.cpp's convert_hf_to_gguf.py
    (GraniteHybridModel) writes it: KV head counts per layer (0 for a Mamba2 layer), the ssm.* keys, the four
    multipliers as given, rope.scaling.finetuned false (no rotary); the shared MLP's input_linear split into
    ffn_gate and ffn_up, q and k rows in llama.cpp's rotary order, A_log as -exp(A_log) and D as [heads, 1], the
    gated norm's weight as [groups, inner / groups], the convolution squeezed to [C, K] and kept in F32; other 2-D
    weights in `qtype` (None: F32)."""
    from gguf import MODEL_ARCH, get_tensor_name_map, quants
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    mamba = [t in ("mamba", "linear_attention") for t in cfg["layer_types"]]
    w = llama_like_writer(out, "granitehybrid", {**cfg, "max_position_embeddings": 1 << 20}, "tiny granite-4.0-h")
    w.add_uint32("granitehybrid.expert_shared_feed_forward_length", cfg["shared_intermediate_size"])
    w.add_head_count_kv([0 if m else kv_heads for m in mamba])  # over the scalar, as the converter does
    w.add_float32("granitehybrid.attention.scale", cfg["attention_multiplier"])
    w.add_float32("granitehybrid.embedding_scale", cfg["embedding_multiplier"])
    w.add_float32("granitehybrid.residual_scale", cfg["residual_multiplier"])
    w.add_float32("granitehybrid.logit_scale", cfg["logits_scaling"])
    w.add_rope_dimension_count(hidden // heads)
    w.add_bool("granitehybrid.rope.scaling.finetuned", False)
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_expert_count(0)
    w.add_expert_used_count(0)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = get_tensor_name_map(MODEL_ARCH.GRANITE_HYBRID, cfg["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    for hf_name, tensor in load_file(model_dir / "model.safetensors").items():
        data = tensor.numpy().astype(np.float32)
        prefix, _, leaf = hf_name.rpartition(".")
        if "shared_mlp.input_linear" in hf_name:
            half = data.shape[0] // 2
            layer = prefix.split(".")[2]
            tensors[f"blk.{layer}.ffn_gate.weight"], tensors[f"blk.{layer}.ffn_up.weight"] = data[:half], data[half:]
            continue
        if "shared_mlp.output_linear" in hf_name:
            tensors[f"blk.{prefix.split('.')[2]}.ffn_down.weight"] = data
            continue
        if leaf in ("A_log", "D"):
            data = (-np.exp(data) if leaf == "A_log" else data).reshape(-1, 1)
        elif "mamba.norm" in hf_name:
            data = data.reshape(cfg["mamba_n_groups"], -1)
        elif "conv1d.weight" in hf_name:
            data = data.squeeze(1)
        elif "q_proj" in hf_name or "k_proj" in hf_name:  # llama.cpp's rotary row order, rope or not
            n = heads if "q_proj" in hf_name else kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        base = hf_name.replace(".dt_bias", ".dt_proj.bias")
        name = names.get_name(base, try_suffixes=(".weight", ".bias")) or names.get_name(base)
        assert name is not None, hf_name
        tensors[name] = data
    for name, data in tensors.items():
        if qtype is not None and data.ndim == 2 and "ssm_conv1d" not in name and name.endswith(".weight") \
                and "norm" not in name:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    write(w)
    return out
