"""SmolLM3: the Llama layer, but some layers (config `no_rope_layers`, ModelConfig.nope_layers) attend without
rotary: "NoPE" layers, whose q and k carry no position (the causal mask alone orders the tokens)."""

from __future__ import annotations

from tokenmill.model.llama import Attention, DecoderLayer, LlamaForCausalLM


class SmolLM3Attention(Attention):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.rope = layer_idx not in cfg.nope_layers


class SmolLM3DecoderLayer(DecoderLayer):
    attention_class = SmolLM3Attention


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """The backends' whole-layer kernels rotate every layer: with NoPE layers the layers run op by op."""

    layer_class = SmolLM3DecoderLayer

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        if cfg.nope_layers:
            self.whole_layer_kernels = False
