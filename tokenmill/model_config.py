"""ModelConfig: the shape of a model, read from config.json or GGUF metadata (plain Python: no torch), and the
architectures tokenmill serves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.family_config import (
    GEMMA3,
    GRANITE_HYBRID,
    LFM2,
    MOE_ARCHITECTURES,
    OLMOE,
    QWEN3_5,
    QWEN3_5_MOE,
    gemma3_hf_fields,
    granite_hybrid_hf_fields,
    hf_gemma3_fields,
    hf_granite_hybrid_fields,
    hf_lfm2_fields,
    hf_max_positions,
    hf_moe_fields,
    hf_nope_layers,
    hf_qwen3_5_fields,
    hf_rope_scaling,
    hf_text_config,
    lfm2_hf_fields,
    moe_hf_fields,
    qwen3_5_hf_fields,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "SmolLM3ForCausalLM", GEMMA3, *MOE_ARCHITECTURES, LFM2, QWEN3_5,
                           GRANITE_HYBRID)
# Architectures of model classes registered from outside the package (model/registry.py register_model), read as
# Llama-family configs -> the weights (HF name -> shape) a config of it needs
REGISTERED_ARCHITECTURES: dict[str, Callable[[ModelConfig], dict[str, tuple[int, ...]]]] = {}
# A base model's architecture (no language-model head: an embedding checkpoint, e.g. Qwen3-Embedding's "Qwen3Model")
# -> its family's; such a model serves embeddings only (ModelConfig.headless)
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
               "Qwen3Model": "Qwen3ForCausalLM"}
# config.json `model_type` -> architecture, for configs without `architectures` (and back, for to_hf_dict)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
               "gemma3_text": GEMMA3, "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "olmoe": OLMOE, "lfm2": LFM2, "qwen3_5_text": QWEN3_5, "qwen3_5_moe_text": QWEN3_5_MOE,
               "granitemoehybrid": GRANITE_HYBRID}


@dataclass
class ModelConfig:
    """Shape of a Llama-family model, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of q and k before rotary: per head (Qwen3's q_norm/k_norm), or whole (OLMoE's)
    partial_rotary_factor: float = 1.0  # the share of head_dim that rotary turns (Phi-4-mini: 0.75)
    nope_layers: list[int] = field(default_factory=list)  # layers without rotary (SmolLM3's NoPE layers)
    # Gemma 3: in `sliding_layers` a token sees its last `sliding_window` keys (itself included), rotated with base
    # `rope_local_theta` (the other layers: rope_theta and rope_scaling); scores scaled by query_pre_attn_scalar**-0.5
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # None: head_dim
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # a base model's checkpoint (BASE_MODELS): no head of its own, its weights named without the "model." prefix;
    # loaded with the embedding as its (tied) head, it serves embeddings only
    headless: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE, OLMoE): each token's MLP is the weighted sum of `num_experts_per_tok`
    # of `num_experts` SwiGLU experts (moe_intermediate_size columns each), picked by a router's softmax, the top
    # weights renormalised to sum to 1 where `norm_topk_prob`; `dense_layers` keep a plain MLP (Qwen3-MoE's
    # mlp_only_layers). num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: list[int] = field(default_factory=list)
    shared_expert_size: int = 0  # Qwen3.5-MoE: a shared SwiGLU expert this wide beside the routed ones, gated
    clip_qkv: float | None = None  # OLMoE: q, k (after their norms) and v clamped to [-clip, clip]
    # expert parallelism: the experts [start, start + count) this rank holds (parallel/layout.py); None: all
    expert_range: tuple[int, int] | None = None
    # LFM2: `conv_layers` are gated short convolutions of width `conv_kernel` instead of attention (a state of the
    # last conv_kernel - 1 inputs per request)
    conv_layers: list[int] = field(default_factory=list)
    conv_kernel: int = 0
    conv_bias: bool = False
    # Qwen3.5: `delta_layers` are Gated DeltaNet linear attention (a recurrent state of delta_value_heads x
    # delta_key_dim x delta_value_dim per request, and the last conv_kernel - 1 inputs of its convolution over q, k
    # and v), each key head serving delta_value_heads / delta_key_heads value heads; its attention layers gate
    # their output and normalise with (1 + w)
    delta_layers: list[int] = field(default_factory=list)
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    # value head h reads key head h % delta_key_heads (llama.cpp's order, which its converter puts the value heads
    # in), not h // (delta_value_heads / delta_key_heads) (the checkpoints')
    delta_tiled_heads: bool = False
    # Granite-4.0-H: `mamba_layers` are Mamba2 (a state of mamba_head_dim x mamba_state per head and per request,
    # and the last conv_kernel - 1 inputs of its convolution over x, B and C), B and C shared by the heads of each of
    # mamba_groups groups; the multipliers scale the embedding, each block's output before the residual add and the
    # attention scores (its scale), and divide the logits
    mamba_layers: list[int] = field(default_factory=list)
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_proj_bias: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES and self.architecture not in REGISTERED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts "
                              f"{self.num_experts}]")
        if self.delta_layers and (not self.delta_key_heads or self.delta_value_heads % self.delta_key_heads):
            raise ConfigError(f"linear_num_value_heads {self.delta_value_heads} is not a multiple of "
                              f"linear_num_key_heads {self.delta_key_heads}")
        if self.mamba_layers and (self.mamba_groups < 1 or self.mamba_heads % self.mamba_groups):
            raise ConfigError(f"mamba_n_heads {self.mamba_heads} is not a multiple of mamba_n_groups {self.mamba_groups}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                              "does not give an even number of rotated dims")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def local_experts(self) -> range:
        """The experts this model (this rank's share of it, under expert parallelism) holds."""
        start, count = self.expert_range or (0, self.num_experts)
        return range(start, start + count)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rotary turns (the rest pass through), as transformers rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def serving(self, max_model_len: int | None) -> ModelConfig:
        """This config for an engine serving sequences of up to `max_model_len` tokens (None: the model's
        positions): long-rope fixes its factor set for that context (model/layers.py rope_frequencies says why)."""
        scaling = self.rope_scaling
        if not scaling or scaling.get("rope_type") != "longrope":
            return self
        served = max_model_len or self.max_position_embeddings
        long = served > scaling["original_max_position_embeddings"]
        return replace(self, rope_scaling={**scaling, "long": long})

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (a multimodal checkpoint's: its text model)."""
        cfg = hf_text_config(cfg)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else MODEL_TYPES.get(cfg.get("model_type", ""), "?")
        headless = arch in BASE_MODELS
        arch = BASE_MODELS.get(arch, arch)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        family = hf_gemma3_fields(cfg) if arch == GEMMA3 else {"rope_scaling": hf_rope_scaling(cfg)}
        if arch == LFM2:
            family.update(hf_lfm2_fields(cfg))
        if arch in (QWEN3_5, QWEN3_5_MOE):
            family.update(hf_qwen3_5_fields(cfg))
        if arch == GRANITE_HYBRID:
            family.update(hf_granite_hybrid_fields(cfg))
        if arch in MOE_ARCHITECTURES:
            family.update(hf_moe_fields(arch, cfg))
        return cls(**{**dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=(cfg.get("intermediate_size") or cfg.get("block_ff_dim")
                               or cfg.get("shared_expert_intermediate_size")),  # Qwen3.5-MoE has no dense MLP
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=hf_max_positions(arch, cfg),
            tie_word_embeddings=headless or cfg.get("tie_word_embeddings", False),
            headless=headless,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", GEMMA3, "Qwen3MoeForCausalLM", OLMOE, LFM2, QWEN3_5, QWEN3_5_MOE),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                                        or 1.0),
            nope_layers=hf_nope_layers(cfg) if arch == "SmolLM3ForCausalLM" else [],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        ), **family})

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json dictionary that from_hf_dict reads back as this config (for writing a model
        directory from a GGUF file, e.g. `tokenmill quantize`)."""
        model_type = {a: t for t, a in MODEL_TYPES.items()}.get(self.architecture, "llama")
        eos = self.eos_token_ids
        family: dict[str, Any] = {}
        if self.partial_rotary_factor != 1.0:
            family["partial_rotary_factor"] = self.partial_rotary_factor
        if self.architecture == "SmolLM3ForCausalLM":
            family["no_rope_layers"] = [int(i not in self.nope_layers) for i in range(self.num_layers)]
        if self.architecture == GEMMA3:
            family = gemma3_hf_fields(self.sliding_window, self.sliding_layers, self.num_layers,
                                      self.rope_local_theta, self.query_pre_attn_scalar)
        if self.architecture == LFM2:
            family = lfm2_hf_fields(self.num_layers, self.conv_layers, self.conv_kernel, self.conv_bias,
                                    self.rms_norm_eps)
        if self.delta_tiled_heads:
            raise ConfigError("a GGUF file's Gated DeltaNet value heads are in llama.cpp's order, which a Hugging "
                              "Face config cannot say: start from the model's Hugging Face directory")
        if self.architecture in (QWEN3_5, QWEN3_5_MOE):
            family = qwen3_5_hf_fields(self.num_layers, self.delta_layers,
                                       (self.delta_key_heads, self.delta_value_heads),
                                       (self.delta_key_dim, self.delta_value_dim), self.conv_kernel,
                                       self.partial_rotary_factor, self.rope_theta)
        if self.architecture == GRANITE_HYBRID:
            family = granite_hybrid_hf_fields(
                self.num_layers, self.mamba_layers, self.mamba_heads, self.mamba_head_dim, self.mamba_state,
                self.mamba_groups, self.conv_kernel, self.conv_bias, self.mamba_proj_bias,
                (self.embedding_multiplier, self.residual_multiplier, self.attention_multiplier or 1.0,
                 self.logits_scaling), not self.nope_layers, self.intermediate_size)
        if self.moe:
            family = {**(family if self.architecture == QWEN3_5_MOE else {}),
                      **moe_hf_fields(self.architecture, self.num_experts, self.num_experts_per_tok,
                                      self.moe_intermediate_size, self.norm_topk_prob, self.dense_layers,
                                      self.clip_qkv)}
            if self.shared_expert_size:
                family["shared_expert_intermediate_size"] = self.shared_expert_size
        return {"architectures": [self.architecture], "model_type": model_type,
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
                "hidden_act": "silu", "bos_token_id": self.bos_token_id,
                "eos_token_id": eos[0] if len(eos) == 1 else (list(eos) or None), **family}

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """K and V elements per token over all layers (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
