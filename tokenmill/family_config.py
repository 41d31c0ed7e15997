"""What a config.json says about the model families' variations, read into ModelConfig's fields (config.py) and
shared with the GGUF reader: rope scaling (llama3, Phi-3's long-rope), SmolLM3's NoPE layers, sliding windows
(Gemma 3's local layers; refused or cut to the window elsewhere), mixtures of experts, LFM2's convolution layers.
Plain Python: the API process reads configs without the model stack."""

from __future__ import annotations

import math
from typing import Any

from tokenmill.errors import ConfigError


def hf_max_positions(arch: str, cfg: dict[str, Any]) -> int:
    """max_position_embeddings, within what tokenmill serves exactly: its sliding windows are Gemma 3's (their
    layers and their rotary bases), so a Phi-3 with a window (Phi-3-mini-4k: 2047) serves lengths the window never
    cuts, and a Qwen3 or SmolLM3 that turns its windows on is refused."""
    max_positions = cfg.get("max_position_embeddings", 2048)
    if arch == "Phi3ForCausalLM" and cfg.get("sliding_window"):
        return min(max_positions, cfg["sliding_window"])
    if arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM", QWEN3_MOE) and cfg.get("use_sliding_window"):
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


MIXTRAL, QWEN3_MOE, OLMOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"  # Qwen3.5's layers with experts in every one, and a gated shared expert
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE, OLMOE, QWEN3_5_MOE)


def hf_moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config.json's expert fields, each family's way: Mixtral always renormalises the top
    weights and its experts are intermediate_size wide; Qwen3-MoE's are moe_intermediate_size wide, with dense
    layers where `mlp_only_layers` lists them or `decoder_sparse_step` skips them; OLMoE may clip q, k and v."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts or not cfg.get("num_experts_per_tok"):
        raise ConfigError(f"{arch} config lacks num_experts / num_experts_per_tok")
    layers = cfg["num_hidden_layers"]
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    fields: dict[str, Any] = {"num_experts": int(experts), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                              "moe_intermediate_size": int(width),
                              "norm_topk_prob": True if arch in (MIXTRAL, QWEN3_5_MOE)
                              else bool(cfg.get("norm_topk_prob", False))}
    if arch == QWEN3_5_MOE:  # every layer's experts beside one shared expert, whose output a sigmoid gates
        fields["shared_expert_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
    if arch == QWEN3_MOE:
        step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        fields["dense_layers"] = [i for i in range(layers) if i in only or (i + 1) % step]
    if arch == OLMOE and cfg.get("clip_qkv") is not None:
        fields["clip_qkv"] = float(cfg["clip_qkv"])
    return fields


def moe_hf_fields(arch: str, experts: int, per_token: int, width: int, norm_topk_prob: bool, dense_layers: list[int],
                  clip_qkv: float | None) -> dict[str, Any]:
    """The config.json keys hf_moe_fields reads back (ModelConfig.to_hf_dict)."""
    return {"num_experts": experts, "num_local_experts": experts, "num_experts_per_tok": per_token,
            "moe_intermediate_size": width, "norm_topk_prob": norm_topk_prob, "mlp_only_layers": dense_layers,
            "decoder_sparse_step": 1, "clip_qkv": clip_qkv}


GEMMA3 = "Gemma3ForCausalLM"
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's


def hf_gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ModelConfig fields from its config.json, in either form: the original keys (`rope_theta`,
    `rope_local_base_freq`, `rope_scaling`, `sliding_window_pattern`) or transformers 5's (`rope_parameters` per
    layer type, `layer_types`). Rope scaling (linear only) applies to the global layers, as transformers applies it.
    What tokenmill does not compute (logit softcapping, bidirectional attention, another activation) is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"Gemma 3 with {key} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 with use_bidirectional_attention is not supported (causal attention only)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    params = cfg.get("rope_parameters") or {}
    rope = {"full_attention": {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")},
            "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq")}}
    rope = {kind: params.get(kind) or rope[kind] for kind in rope}
    theta = {kind: float(rope[kind].get("rope_theta") or GEMMA3_DEFAULT_THETA[kind]) for kind in rope}
    kinds = {kind: rope[kind].get("rope_type") or rope[kind].get("type") or "default" for kind in rope}
    if kinds["sliding_attention"] != "default" or kinds["full_attention"] not in ("default", "linear"):
        raise ConfigError(f"Gemma 3 rope scaling {kinds} is not supported (linear on the global layers only)")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # every `sliding_window_pattern`-th layer global, the others local
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = cfg.get("sliding_window")
    return {
        "rope_theta": theta["full_attention"],
        "rope_scaling": ({"rope_type": "linear", "factor": float(rope["full_attention"]["factor"])}
                         if kinds["full_attention"] == "linear" else None),
        "rope_local_theta": theta["sliding_attention"],
        "sliding_window": int(window) if window else None,
        "sliding_layers": [i for i, t in enumerate(types) if t == "sliding_attention"] if window else [],
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        "max_position_embeddings": cfg.get("max_position_embeddings", 131_072),
    }


def gemma3_hf_fields(sliding_window: int | None, sliding_layers: list[int], num_layers: int,
                     rope_local_theta: float | None, query_pre_attn_scalar: float | None) -> dict[str, Any]:
    """The config.json keys hf_gemma3_fields reads back (ModelConfig.to_hf_dict)."""
    return {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "sliding_window": sliding_window,
            "layer_types": ["sliding_attention" if i in sliding_layers else "full_attention"
                            for i in range(num_layers)],
            "rope_local_base_freq": rope_local_theta, "query_pre_attn_scalar": query_pre_attn_scalar}


LFM2 = "Lfm2ForCausalLM"
# Llama-family tensor names -> LFM2's (the fused projections' shards named as checkpoints name them)
LFM2_NAMES = (("self_attn.o_proj.", "self_attn.out_proj."), ("self_attn.q_norm.", "self_attn.q_layernorm."),
              ("self_attn.k_norm.", "self_attn.k_layernorm."), (".input_layernorm.", ".operator_norm."),
              (".post_attention_layernorm.", ".ffn_norm."), (".mlp.gate_proj.", ".feed_forward.w1."),
              (".mlp.up_proj.", ".feed_forward.w3."), (".mlp.down_proj.", ".feed_forward.w2."),
              ("model.norm.", "model.embedding_norm."))


def lfm2_name(llama_name: str) -> str:
    for ours, theirs in LFM2_NAMES:
        llama_name = llama_name.replace(ours, theirs)
    return llama_name


def hf_lfm2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's ModelConfig fields: which layers are short convolutions (`layer_types`, or every layer not in
    `full_attn_idxs`), the convolution's width and bias, and the feed-forward width as Lfm2Config derives it
    (two thirds of `block_ff_dim`, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        types = ["full_attention" if full is None or i in full else "conv" for i in range(layers)]
    width = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            of = cfg.get("block_multiple_of", 256)
            width = of * ((int(multiplier * width) + of - 1) // of)
    rope = cfg.get("rope_parameters") or {}
    return {"intermediate_size": width, "conv_layers": [i for i, t in enumerate(types) if t == "conv"],
            "conv_kernel": int(cfg.get("conv_L_cache", 3)), "conv_bias": bool(cfg.get("conv_bias", False)),
            "rms_norm_eps": cfg.get("norm_eps", 1e-5),
            "rope_theta": float(rope.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
            "tie_word_embeddings": cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))}


def lfm2_hf_fields(num_layers: int, conv_layers: list[int], conv_kernel: int, conv_bias: bool,
                   rms_norm_eps: float) -> dict[str, Any]:
    """The config.json keys hf_lfm2_fields reads back (ModelConfig.to_hf_dict): the width as it is."""
    return {"layer_types": ["conv" if i in conv_layers else "full_attention" for i in range(num_layers)],
            "conv_L_cache": conv_kernel, "conv_bias": conv_bias, "block_auto_adjust_ff_dim": False,
            "norm_eps": rms_norm_eps}


QWEN3_5 = "Qwen3_5ForCausalLM"
# a multimodal Qwen3.5 checkpoint: its text model is served (config.json's text_config, the tensors under
# model.language_model.; the vision tower's and the multi-token-prediction head's left in the file)
QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE_VL = "Qwen3_5MoeForConditionalGeneration"


def hf_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config.json read as its text model's (Qwen3.5's text_config), others as they are."""
    archs = cfg.get("architectures") or []
    moe = archs[:1] == [QWEN3_5_MOE_VL] or cfg.get("model_type") == "qwen3_5_moe"
    if not (moe or archs[:1] == [QWEN3_5_VL] or cfg.get("model_type") == "qwen3_5") or "text_config" not in cfg:
        return cfg
    text = dict(cfg["text_config"])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return {**text, "architectures": [QWEN3_5_MOE if moe else QWEN3_5]}


def hf_qwen3_5_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's ModelConfig fields: which layers are Gated DeltaNet linear attention (`layer_types`, or all but
    every `full_attention_interval`-th), their heads and widths, their convolution's kernel, and the share of
    head_dim rotary turns (a quarter unless said)."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return {"delta_layers": [i for i, t in enumerate(types) if t == "linear_attention"],
            "delta_key_heads": cfg.get("linear_num_key_heads", 16),
            "delta_value_heads": cfg.get("linear_num_value_heads", 32),
            "delta_key_dim": cfg.get("linear_key_head_dim", 128),
            "delta_value_dim": cfg.get("linear_value_head_dim", 128),
            "conv_kernel": cfg.get("linear_conv_kernel_dim", 4),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                                           or 0.25),
            "rope_theta": float(rope.get("rope_theta") or cfg.get("rope_theta") or 10_000_000.0)}


def qwen3_5_hf_fields(num_layers: int, delta_layers: list[int], heads: tuple[int, int], dims: tuple[int, int],
                      conv_kernel: int, partial_rotary_factor: float, rope_theta: float) -> dict[str, Any]:
    """The config.json keys hf_qwen3_5_fields reads back (ModelConfig.to_hf_dict)."""
    return {"layer_types": ["linear_attention" if i in delta_layers else "full_attention" for i in range(num_layers)],
            "linear_num_key_heads": heads[0], "linear_num_value_heads": heads[1], "linear_key_head_dim": dims[0],
            "linear_value_head_dim": dims[1], "linear_conv_kernel_dim": conv_kernel,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta,
                                "partial_rotary_factor": partial_rotary_factor}}


GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# Granite-4.0-H's tensor names for what the Llama modules call otherwise (its shared MLP's gate and up rows are one
# tensor, input_linear, which checkpoint.FUSED_TENSORS splits)
GRANITE_NAMES = (("shared_mlp.down_proj.", "shared_mlp.output_linear."),)


def granite_name(llama_name: str) -> str:
    for ours, theirs in GRANITE_NAMES:
        llama_name = llama_name.replace(ours, theirs)
    return llama_name


def hf_granite_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite-4.0-H's ModelConfig fields: which layers are Mamba2 (`layer_types` "mamba" or "linear_attention"),
    their heads, head width (mamba_d_head, or the inner width / heads), state size, groups, convolution, biases;
    the shared MLP's width; the multipliers (embedding, residual, attention scale, logits divisor); rotary only with
    position_embedding_type "rope". Experts (num_local_experts) are refused here: dense Granite-4.0-H only."""
    if cfg.get("num_local_experts"):
        raise ConfigError("Granite-4.0-H with experts (num_local_experts > 0) is not served yet; its dense models are")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    heads = int(cfg.get("mamba_n_heads", 128))
    inner = int(cfg.get("mamba_expand", 2)) * int(cfg["hidden_size"])
    head_dim = cfg.get("mamba_d_head", "auto")
    return {"mamba_layers": [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")],
            "mamba_heads": heads, "mamba_head_dim": inner // heads if head_dim in (None, "auto") else int(head_dim),
            "mamba_state": int(cfg.get("mamba_d_state", 256)), "mamba_groups": int(cfg.get("mamba_n_groups", 1)),
            "conv_kernel": int(cfg.get("mamba_d_conv", 4)), "conv_bias": bool(cfg.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(cfg.get("mamba_proj_bias", False)),
            "intermediate_size": int(cfg.get("shared_intermediate_size") or cfg["intermediate_size"]),
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
            "nope_layers": [] if cfg.get("position_embedding_type") == "rope" else list(range(layers))}


def granite_hybrid_hf_fields(num_layers: int, mamba_layers: list[int], heads: int, head_dim: int, state: int,
                             groups: int, conv_kernel: int, conv_bias: bool, proj_bias: bool,
                             multipliers: tuple[float, float, float, float], rope: bool,
                             intermediate_size: int) -> dict[str, Any]:
    """The config.json keys hf_granite_hybrid_fields reads back (ModelConfig.to_hf_dict)."""
    embedding, residual, attention, logits = multipliers
    return {"layer_types": ["mamba" if i in mamba_layers else "attention" for i in range(num_layers)],
            "mamba_n_heads": heads, "mamba_d_head": head_dim, "mamba_d_state": state, "mamba_n_groups": groups,
            "mamba_d_conv": conv_kernel, "mamba_conv_bias": conv_bias, "mamba_proj_bias": proj_bias,
            "shared_intermediate_size": intermediate_size, "num_local_experts": 0,
            "embedding_multiplier": embedding, "residual_multiplier": residual, "attention_multiplier": attention,
            "logits_scaling": logits, "position_embedding_type": "rope" if rope else None}
