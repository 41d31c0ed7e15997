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
