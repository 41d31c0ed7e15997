"""The kinds of layer a model has, for the planner: what each holds in parameters and keeps per sequence.

* An attention layer (every layer of a Llama-family model) keeps every token's K and V: the KV cache,
  counted per token from ModelShape's heads and head_dim; its q/k/v/o projections are its token mixer.
* A state layer keeps a fixed-size state per running sequence whatever the sequence's length, and has its
  own token mixer in place of attention's projections. Each kind of state layer in a model is one
  `StateLayers` record: which layers, one layer's mixer parameters, and what one layer keeps per sequence
  as the engine declares it (model/layer_cache.py's LayerCache: the shapes and dtype of its slot), so the
  planner's state is the engine's.

Every layer, whatever its kind, also has its block's two norms and its feed-forward (dense or experts);
ModelShape counts those. Three kinds of state layer, read from config.json by `hf_hybrid_fields` and from
GGUF metadata by `gguf_hybrid_fields`: LFM2's gated short convolutions (`short_convolutions`), Qwen3.5's
Gated DeltaNet (`gated_delta_nets`: a convolution state and a key x value matrix per value head) and
Granite-4.0-H's Mamba2 (`mamba2_mixers`: a convolution state and a head_dim x state matrix per head). Another
hybrid joins with a function like these giving its mixer's parameters and its state's shapes and a branch in each
reader. The recurrences' own FLOPs (a few per state element and token) are not
in the roofline: their projections' dominate.

Plain Python, no torch: `tokenmill plan` answers instantly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.family_config import (
    GRANITE_HYBRID,
    LFM2,
    QWEN3_5,
    QWEN3_5_MOE,
    hf_granite_hybrid_fields,
    hf_lfm2_fields,
    hf_qwen3_5_fields,
)
from tokenmill.model.layer_cache import LayerCache


@dataclass(frozen=True)
class StateLayers:
    """Layers of one state kind: their indices, one layer's token-mixer parameters (its block's norms and
    feed-forward excluded) and the state one layer keeps per running sequence."""

    kind: str  # what they are, as the report names them: "short convolution"
    layers: tuple[int, ...]
    mixer_params: int
    state: LayerCache

    def __post_init__(self) -> None:
        if self.state.kind != "state":
            raise ValueError(f"{self.kind} layers keep a state, not {self.state.kind!r}")

    @property
    def state_bytes_per_layer(self) -> int:
        """One layer's state for one sequence."""
        return self.state.state_bytes

    def state_bytes_in(self, layers: range) -> int:
        """The state one sequence keeps in this kind's layers among `layers` (a pipeline stage's)."""
        return sum(self.state_bytes_per_layer for i in self.layers if i in layers)

    def describe(self) -> str:
        """E.g. '10 short convolution layers x (2, 1024) float32'."""
        shapes = " + ".join(str(s) for s in self.state.state_shapes)
        return f"{len(self.layers)} {self.kind} layers x {shapes} {self.state.state_dtype}"


def short_convolutions(layers: list[int] | tuple[int, ...], hidden: int, kernel: int,
                       bias: bool) -> StateLayers:
    """LFM2's gated short convolution (model/lfm2.py ShortConv): in_proj hidden -> 3 x hidden, a depthwise
    convolution weight [hidden, 1, kernel], out_proj hidden -> hidden (each with a bias if `bias`); it
    keeps the last kernel - 1 inputs of each channel, in float32, as Lfm2ForCausalLM.layer_caches does."""
    params = 3 * hidden * hidden + hidden * kernel + hidden * hidden
    if bias:
        params += 3 * hidden + hidden + hidden
    return StateLayers("short convolution", tuple(layers), params, LayerCache.state((kernel - 1, hidden)))


def gated_delta_nets(layers: list[int] | tuple[int, ...], hidden: int, key_heads: int, value_heads: int,
                     key_dim: int, value_dim: int, kernel: int) -> StateLayers:
    """Qwen3.5's Gated DeltaNet (model/qwen3_5.py GatedDeltaNet): projections to q, k, v (the convolution's
    channels), the gate z and a, b per value head; a depthwise convolution over q, k and v; dt_bias and A_log per
    value head, the gated norm's weight, out_proj. It keeps the convolution's last kernel - 1 inputs and a
    key_dim x value_dim matrix per value head, in float32, as Qwen3_5ForCausalLM.layer_caches does."""
    values = value_heads * value_dim
    channels = 2 * key_heads * key_dim + values
    params = hidden * (channels + values + 2 * value_heads) + channels * kernel + 2 * value_heads + value_dim \
        + values * hidden
    state = LayerCache.state((kernel - 1, channels), (value_heads, key_dim, value_dim))
    return StateLayers("Gated DeltaNet", tuple(layers), params, state)


def mamba2_mixers(layers: list[int] | tuple[int, ...], hidden: int, heads: int, head_dim: int, state: int,
                  groups: int, kernel: int, conv_bias: bool, proj_bias: bool) -> StateLayers:
    """Mamba2 (model/granite_hybrid.py Mamba2Mixer): in_proj to the gate, the convolution's channels (x, B and C)
    and a step per head; the depthwise convolution (with its bias); dt_bias, A_log and D per head; the gated
    norm's weight; out_proj. It keeps the convolution's last kernel - 1 inputs and a head_dim x state matrix per
    head, in float32, as GraniteHybridForCausalLM.layer_caches does."""
    inner = heads * head_dim
    channels = inner + 2 * groups * state
    projected = inner + channels + heads
    params = hidden * projected + channels * kernel + 3 * heads + inner + inner * hidden
    if conv_bias:
        params += channels
    if proj_bias:
        params += projected + hidden
    return StateLayers("Mamba2", tuple(layers), params,
                       LayerCache.state((kernel - 1, channels), (heads, head_dim, state)))


def hf_hybrid_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelShape fields a hybrid's config.json sets beside the Llama-family ones (none for another model):
    LFM2's convolution layers, its feed-forward width and tied embeddings as tokenmill reads them
    (family_config), and its attention layers' per-head q/k norms; Qwen3.5's Gated DeltaNet layers, and its
    attention layers' norms and output gates."""
    if arch in (QWEN3_5, QWEN3_5_MOE) or cfg.get("model_type") in ("qwen3_5_text", "qwen3_5_moe_text"):
        f = hf_qwen3_5_fields(cfg)
        delta = gated_delta_nets(f["delta_layers"], int(cfg["hidden_size"]), f["delta_key_heads"],
                                 f["delta_value_heads"], f["delta_key_dim"], f["delta_value_dim"], f["conv_kernel"])
        width = cfg.get("intermediate_size") or cfg.get("shared_expert_intermediate_size")  # MoE: no dense MLP
        return {"intermediate_size": int(width),
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)), "qk_norm": True,
                "gated_attention": True, "state_layers": (delta,) if delta.layers else ()}
    if arch == GRANITE_HYBRID or cfg.get("model_type") == "granitemoehybrid":
        f = hf_granite_hybrid_fields(cfg)
        mixers = mamba2_mixers(f["mamba_layers"], int(cfg["hidden_size"]), f["mamba_heads"], f["mamba_head_dim"],
                               f["mamba_state"], f["mamba_groups"], f["conv_kernel"], f["conv_bias"],
                               f["mamba_proj_bias"])
        return {"intermediate_size": f["intermediate_size"],
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                "state_layers": (mixers,) if mixers.layers else ()}
    if arch != LFM2 and cfg.get("model_type") != "lfm2":
        return {}
    fields = hf_lfm2_fields(cfg)
    conv = short_convolutions(fields["conv_layers"], int(cfg["hidden_size"]), fields["conv_kernel"],
                              fields["conv_bias"])
    return {"intermediate_size": int(fields["intermediate_size"]),
            "tie_word_embeddings": bool(fields["tie_word_embeddings"]), "qk_norm": True,
            "state_layers": (conv,) if conv.layers else ()}


def gguf_hybrid_fields(arch: str, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The same from a GGUF file's metadata (none for another architecture): llama.cpp files LFM2 as `lfm2` with
    a KV head count per layer, 0 for a convolution layer, and the convolution's width as shortconv.l_cache;
    Qwen3.5 as `qwen35` (`qwen35moe`) with its recurrent layers listed and the ssm.* keys (model/gguf_config.py
    reads the same)."""
    if arch in ("qwen35", "qwen35moe"):
        k = metadata.get
        layers = int(k(f"{arch}.block_count")) - int(k(f"{arch}.nextn_predict_layers", 0))
        recurrent = k(f"{arch}.attention.recurrent_layers")
        every = int(k(f"{arch}.full_attention_interval", 4))
        delta = ([i for i, r in enumerate(recurrent[:layers]) if r] if isinstance(recurrent, list)
                 else [i for i in range(layers) if (i + 1) % every])
        value_heads = int(k(f"{arch}.ssm.time_step_rank"))
        nets = gated_delta_nets(delta, int(k(f"{arch}.embedding_length")), int(k(f"{arch}.ssm.group_count")),
                                value_heads, int(k(f"{arch}.ssm.state_size")),
                                int(k(f"{arch}.ssm.inner_size")) // value_heads, int(k(f"{arch}.ssm.conv_kernel")))
        return {"qk_norm": True, "gated_attention": True, "state_layers": (nets,) if nets.layers else (),
                "shared_expert_size": int(k(f"{arch}.expert_shared_feed_forward_length") or 0)}
    if arch == "granitehybrid":  # per layer: 0 KV heads where the layer is Mamba2
        kv = metadata["granitehybrid.attention.head_count_kv"]
        kv = kv if isinstance(kv, list) else [kv] * int(metadata["granitehybrid.block_count"])
        heads = int(metadata["granitehybrid.ssm.time_step_rank"])
        mixers = mamba2_mixers([i for i, n in enumerate(kv) if not n], int(metadata["granitehybrid.embedding_length"]),
                               heads, int(metadata["granitehybrid.ssm.inner_size"]) // heads,
                               int(metadata["granitehybrid.ssm.state_size"]),
                               int(metadata.get("granitehybrid.ssm.group_count", 1)),
                               int(metadata["granitehybrid.ssm.conv_kernel"]),
                               any(n.endswith("ssm_conv1d.bias") for n in tensor_names),
                               any(n.endswith("ssm_in.bias") for n in tensor_names))
        return {"state_layers": (mixers,) if mixers.layers else ()}
    if arch != "lfm2":
        return {}
    counts = metadata.get("lfm2.attention.head_count_kv")
    counts = counts if isinstance(counts, list) else [counts] * int(metadata["lfm2.block_count"])
    conv = short_convolutions([i for i, n in enumerate(counts) if not n], int(metadata["lfm2.embedding_length"]),
                              int(metadata["lfm2.shortconv.l_cache"]),
                              any(n.endswith("shortconv.in_proj.bias") for n in tensor_names))
    return {"qk_norm": True, "state_layers": (conv,) if conv.layers else ()}


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """The layers of each of `pp` pipeline stages, in order; the first stages get the extra ones."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
