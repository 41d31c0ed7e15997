"""A llama.cpp GGUF file's ModelConfig: the `{arch}.*` metadata keys llama.cpp's converter writes, per family,
read onto ModelConfig's fields (model/gguf_checkpoint.py reads the tensors)."""

from __future__ import annotations

from typing import Any

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.family_config import longrope_scaling
from tokenmill.formats.gguf import GGUFFile
from tokenmill.model_config import ModelConfig

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "lfm2": "Lfm2ForCausalLM",
                      "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                      "granitehybrid": "GraniteMoeHybridForCausalLM"}
# whether llama.cpp renormalises a mixture of experts' top weights, by architecture (unless the file says)
_MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False}


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
    elif arch in ("qwen35", "qwen35moe"):
        conv = _gguf_qwen35_fields(gguf, arch)
    elif arch == "granitehybrid":  # per layer: 0 KV heads where the layer is Mamba2
        counts = [int(n) for n in (num_kv if isinstance(num_kv, list) else [num_kv])]
        conv = _gguf_granite_fields(gguf, counts)
        num_kv = max(counts)
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
    elif arch in ("qwen35", "qwen35moe"):  # rope.dimension_count is the rotated part of a head (a quarter)
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
    return ModelConfig(**{**dict(
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
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmoe", "lfm2", "qwen35", "qwen35moe"),
        partial_rotary_factor=partial,
        # llama.cpp has no key for SmolLM3's NoPE layers: it fixes every 4th (src/models/smollm3.cpp), as here
        nope_layers=[i for i in range(layers) if (i + 1) % 4 == 0] if arch == "smollm3" else [],
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
    ), **family, **moe, **conv})  # a family's own fields over the generic ones


def _gguf_qwen35_fields(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet from llama.cpp's keys: the recurrent layers (its list, else every layer but each
    full_attention_interval-th), key heads (ssm.group_count) of ssm.state_size dims, value heads (time_step_rank)
    sharing ssm.inner_size, and the value heads in llama.cpp's tiled order where there are more of them. Qwen3.5-MoE
    (`qwen35moe`): its shared expert's width too (expert_shared_feed_forward_length), which is also the width
    tokenmill names its intermediate size by, as for the Hugging Face config (no dense MLP)."""
    layers = int(gguf.get(f"{arch}.block_count")) - int(gguf.get(f"{arch}.nextn_predict_layers", 0))
    recurrent = gguf.get(f"{arch}.attention.recurrent_layers")
    every = int(gguf.get(f"{arch}.full_attention_interval", 4))
    delta = ([i for i, r in enumerate(recurrent[:layers]) if r] if isinstance(recurrent, list)
             else [i for i in range(layers) if (i + 1) % every])
    key_heads, value_heads = int(gguf.get(f"{arch}.ssm.group_count")), int(gguf.get(f"{arch}.ssm.time_step_rank"))
    fields = {"delta_layers": delta, "delta_key_heads": key_heads, "delta_value_heads": value_heads,
              "delta_key_dim": int(gguf.get(f"{arch}.ssm.state_size")),
              "delta_value_dim": int(gguf.get(f"{arch}.ssm.inner_size")) // value_heads,
              "conv_kernel": int(gguf.get(f"{arch}.ssm.conv_kernel")), "delta_tiled_heads": key_heads != value_heads}
    shared = gguf.get(f"{arch}.expert_shared_feed_forward_length")
    if arch == "qwen35moe" and shared:
        fields.update(shared_expert_size=int(shared), intermediate_size=int(shared))
    return fields


def _gguf_granite_fields(gguf: GGUFFile, kv_heads: list[int]) -> dict[str, Any]:
    """Granite-4.0-H from llama.cpp's keys: the Mamba2 layers (0 KV heads), ssm.time_step_rank heads sharing
    ssm.inner_size, groups and state size, the convolution (its bias if the file holds one), the shared MLP's
    width (expert_shared_feed_forward_length, else the ffn_gate tensor's), the four multipliers as given (absent:
    off), and no rotary where rope.scaling.finetuned is false (the converter's NoPE)."""
    if gguf.get("granitehybrid.expert_count"):
        raise ConfigError(f"GGUF file {gguf.path}: Granite-4.0-H with experts is not served yet; its dense models are")
    heads = int(gguf.get("granitehybrid.ssm.time_step_rank"))
    mamba = [i for i, n in enumerate(kv_heads) if n == 0]
    width = gguf.get("granitehybrid.expert_shared_feed_forward_length")
    if not width:
        gate = next(t for name, t in gguf.tensors.items() if name.endswith("ffn_gate.weight"))
        width = gate.shape[0]
    rope = gguf.get("granitehybrid.rope.scaling.finetuned", True)
    scale = gguf.get("granitehybrid.attention.scale")
    return {"mamba_layers": mamba, "mamba_heads": heads,
            "mamba_head_dim": int(gguf.get("granitehybrid.ssm.inner_size")) // heads,
            "mamba_state": int(gguf.get("granitehybrid.ssm.state_size")),
            "mamba_groups": int(gguf.get("granitehybrid.ssm.group_count", 1)),
            "conv_kernel": int(gguf.get("granitehybrid.ssm.conv_kernel")),
            "conv_bias": any(n.endswith("ssm_conv1d.bias") for n in gguf.tensors),
            "mamba_proj_bias": any(n.endswith("ssm_in.bias") for n in gguf.tensors),
            "intermediate_size": int(width),
            "embedding_multiplier": float(gguf.get("granitehybrid.embedding_scale") or 1.0),
            "residual_multiplier": float(gguf.get("granitehybrid.residual_scale") or 1.0),
            "attention_multiplier": float(scale) if scale else None,
            "logits_scaling": float(gguf.get("granitehybrid.logit_scale") or 1.0),
            "nope_layers": [] if rope else list(range(len(kv_heads)))}


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
