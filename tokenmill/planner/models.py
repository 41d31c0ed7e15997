"""Model shapes for the planner and its built-in presets (planner/model_files.py reads the others from Hugging Face
config.json directories and GGUF files).

Only the shape matters here (layers, widths, heads, vocabulary, experts), so any Llama-family model (Llama, Mistral,
Qwen2, SmolLM) or mixture of experts (Mixtral, Qwen3-MoE, OLMoE) is described by one dataclass; the parameter
counts are computed from it: the total (what memory holds) and the active ones (what a token computes).
A hybrid (LFM2) names its state layers (planner/layers.py): their own token mixers in place of
attention's, and a fixed state per sequence in place of every token's K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.planner.common import PlanError, weight_bytes_per_param
from tokenmill.planner.layers import StateLayers


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with GQA attention and a SwiGLU MLP; a hybrid's state layers replace
    attention in some of its layers (`state_layers`)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    max_context: int | None = None
    source: str = ""
    default_dtype: str = "bf16"
    # Set for files whose tensors are read (GGUF): the real totals beat the formula.
    file_params: int | None = None
    file_weight_bytes: int | None = None
    file_format: str | None = None  # e.g. "GGUF Q4_1"
    # a mixture of experts: `num_experts` SwiGLU experts of `expert_intermediate_size` columns in `moe_layers` of
    # the layers (None: all), `experts_per_token` of them run for each token; 0 experts: a dense model
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int | None = None
    shared_expert_size: int = 0  # a shared SwiGLU expert every token takes, gated by a [1, hidden] projection
    qk_norm: bool = False  # per-head q and k RMSNorm weights (head_dim each) in each attention layer (LFM2)
    gated_attention: bool = False  # q_proj also gives each head's output gate: twice as wide (Qwen3.5)
    # a hybrid: the layers whose token mixer keeps a fixed state per sequence instead of attention's KV, by
    # kind; every other layer is an attention layer
    state_layers: tuple[StateLayers, ...] = ()

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                           "head_dim", "vocab_size"):
            if getattr(self, field_name) <= 0:
                raise PlanError(f"--model {self.name}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise PlanError(f"--model {self.name}: {self.num_heads} attention heads is not a multiple of "
                            f"{self.num_kv_heads} KV heads")
        indices = [i for s in self.state_layers for i in s.layers]
        if len(set(indices)) != len(indices) or any(not 0 <= i < self.num_layers for i in indices):
            raise PlanError(f"--model {self.name}: state layers {sorted(indices)} are not distinct layers of "
                            f"{self.num_layers}")

    # -- parameter counts -------------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        """q/k/v/o projections (GQA: k and v have num_kv_heads), per-head q/k norms if any, and the 2 norms
        of one block."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q * (2 if self.gated_attention else 1) + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + 2 * h

    @property
    def state_mixer_savings(self) -> int:
        """Parameters the state layers have fewer than attention layers would (their mixers in place of
        attention's projections; negative if they have more)."""
        attention_mixer = self.attention_params - 2 * self.hidden_size
        return sum(len(s.layers) * (attention_mixer - s.mixer_params) for s in self.state_layers)

    @property
    def layer_params(self) -> int:
        """One dense block: attention, 3 SwiGLU matrices, 2 norms."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def moe_layer_count(self) -> int:
        return 0 if not self.num_experts else self.num_layers if self.moe_layers is None else self.moe_layers

    @property
    def expert_params(self) -> int:
        """One expert's 3 SwiGLU matrices."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def moe_layer_params(self) -> int:
        """One mixture-of-experts block: attention, the router, every expert."""
        shared = 3 * self.hidden_size * self.shared_expert_size + self.hidden_size if self.shared_expert_size else 0
        return self.attention_params + self.num_experts * (self.hidden_size + self.expert_params) + shared

    @property
    def computed_params(self) -> int:
        """Embeddings + blocks (a state layer's mixer in place of attention) + final norm + LM head (unless
        tied to the embeddings)."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        moe = self.moe_layer_count
        return (self.embedding_params + (self.num_layers - moe) * self.layer_params + moe * self.moe_layer_params
                - self.state_mixer_savings + self.hidden_size + lm_head)

    @property
    def params(self) -> int:
        return self.file_params if self.file_params is not None else self.computed_params

    def idle_expert_params(self, experts_read: float) -> float:
        """Parameters of the experts a step does not touch when it reads `experts_read` per MoE layer."""
        return self.moe_layer_count * (self.num_experts - experts_read) * self.expert_params

    @property
    def active_params(self) -> int:
        """What one token computes: all but the experts it is not routed to (a dense model: all)."""
        return self.params - round(self.idle_expert_params(self.experts_per_token))

    def experts_read(self, tokens: int) -> float:
        """Experts a step of `tokens` tokens reads per MoE layer, expected under even routing: each expert is
        missed by every token with probability (1 - k / E) ** tokens."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** max(tokens, 1))

    @property
    def decode_params(self) -> int:
        """Parameters a decode step may read: all but an untied input-embedding table (only B rows of
        it are gathered). With tied embeddings the table is the LM head and is read in full."""
        return self.params - (0 if self.tie_word_embeddings else self.embedding_params)

    def decode_params_read(self, batch: int) -> float:
        """Parameters a decode step of `batch` tokens reads: decode_params less the experts none of them uses."""
        return self.decode_params - self.idle_expert_params(self.experts_read(batch))

    @property
    def decode_active_params(self) -> int:
        """Parameters each decoded token multiplies (its k experts, not all)."""
        return self.decode_params - round(self.idle_expert_params(self.experts_per_token))

    @property
    def lm_head_params(self) -> int:
        return self.embedding_params

    @property
    def body_params(self) -> int:
        """Parameters applied to every prompt token in prefill (the LM head runs only on the last)."""
        return self.decode_params - self.lm_head_params

    # -- bytes ------------------------------------------------------------------------------------
    def weight_bytes(self, dtype: str | None) -> int:
        """Weights at `dtype`; None means the model's own format (a GGUF's actual tensor bytes)."""
        if dtype is None and self.file_weight_bytes is not None:
            return self.file_weight_bytes
        return round(self.params * weight_bytes_per_param(dtype or self.default_dtype))

    def dtype_label(self, dtype: str | None) -> str:
        if dtype is None and self.file_format is not None:
            return self.file_format
        return dtype or self.default_dtype

    # -- what a sequence keeps -----------------------------------------------------------------------
    @property
    def attention_layer_count(self) -> int:
        """Layers that keep every token's K and V (all but the state layers)."""
        return self.num_layers - sum(len(s.layers) for s in self.state_layers)

    def attention_layers_in(self, layers: range) -> int:
        """Attention layers among `layers` (a pipeline stage's)."""
        state = {i for s in self.state_layers for i in s.layers}
        return sum(1 for i in layers if i not in state)

    def kv_elements_per_token(self) -> int:
        """K and V, every attention layer, every KV head (GQA: the KV heads, not the query heads)."""
        return 2 * self.attention_layer_count * self.num_kv_heads * self.head_dim

    def state_bytes_in(self, layers: range) -> int:
        """The fixed state one running sequence keeps in the state layers among `layers`, whatever its
        length."""
        return sum(s.state_bytes_in(layers) for s in self.state_layers)

    @property
    def state_bytes_per_sequence(self) -> int:
        """The whole model's state of one running sequence (0 without state layers)."""
        return self.state_bytes_in(range(self.num_layers))


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


# Public config.json numbers; each source is the model's Hugging Face config.json.
PRESETS: dict[str, ModelShape] = {
    # vocab 128256, hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, untied
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, False,
                             max_context=8192, source=_hf("meta-llama/Meta-Llama-3-8B")),
    # vocab 128256, hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads, untied
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, False,
                              max_context=8192, source=_hf("meta-llama/Meta-Llama-3-70B")),
    # vocab 128256, hidden 16384, intermediate 53248, 126 layers, 128 heads, 8 KV heads, untied
    "llama-3.1-405b": ModelShape("llama-3.1-405b", 126, 16384, 53248, 128, 8, 128, 128256, False,
                                 max_context=131072, source=_hf("meta-llama/Llama-3.1-405B")),
    # v0.3: vocab 32768, hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, untied, no sliding
    # window (v0.1's 4096-token sliding window would cap the KV cache; v0.3 dropped it).
    "mistral-7b": ModelShape("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32768, False,
                             max_context=32768, source=_hf("mistralai/Mistral-7B-v0.3")),
    # vocab 152064, hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV heads, q/k/v bias, untied
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152064, False, attention_bias=True,
                             max_context=32768, source=_hf("Qwen/Qwen2.5-7B-Instruct")),
    # vocab 152064, hidden 8192, intermediate 29568, 80 layers, 64 heads, 8 KV heads, q/k/v bias, untied
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 80, 8192, 29568, 64, 8, 128, 152064, False, attention_bias=True,
                              max_context=32768, source=_hf("Qwen/Qwen2.5-72B-Instruct")),
    # vocab 32000, hidden 4096, 32 layers, 32 heads, 8 KV heads, untied; 8 experts of 14336 columns, 2 per token
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32000, False, max_context=32768,
                               source=_hf("mistralai/Mixtral-8x7B-v0.1"), num_experts=8, experts_per_token=2,
                               expert_intermediate_size=14336),
    # vocab 151936, hidden 2048, 48 layers, 32 heads, 4 KV heads x 128, untied; 128 experts of 768 columns, 8 per token
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 128, 151936, False, max_context=40960,
                                source=_hf("Qwen/Qwen3-30B-A3B"), num_experts=128, experts_per_token=8,
                                expert_intermediate_size=768),
    # vocab 50304, hidden 2048, 16 layers, 16 heads, 16 KV heads, untied; 64 experts of 1024 columns, 8 per token
    "olmoe-1b-7b": ModelShape("olmoe-1b-7b", 16, 2048, 1024, 16, 16, 128, 50304, False, max_context=4096,
                              source=_hf("allenai/OLMoE-1B-7B-0924"), num_experts=64, experts_per_token=8,
                              expert_intermediate_size=1024),
    # vocab 49152, hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, tied
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, True,
                               max_context=8192, source=_hf("HuggingFaceTB/SmolLM2-135M")),
    # vocab 49152, hidden 960, intermediate 2560, 32 layers, 15 heads, 5 KV heads, tied
    "smollm2-360m": ModelShape("smollm2-360m", 32, 960, 2560, 15, 5, 64, 49152, True,
                               max_context=8192, source=_hf("HuggingFaceTB/SmolLM2-360M")),
    # vocab 49152, hidden 2048, intermediate 8192, 24 layers, 32 heads, 32 KV heads (no GQA), tied
    "smollm2-1.7b": ModelShape("smollm2-1.7b", 24, 2048, 8192, 32, 32, 64, 49152, True,
                               max_context=8192, source=_hf("HuggingFaceTB/SmolLM2-1.7B")),
}
