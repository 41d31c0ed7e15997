"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, for tests that load a tiny model from
GGUF: the metadata every Llama-shaped architecture's converter writes, from the HF config; each test adds its
architecture's own keys and its tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
