"""Phi-3 / Phi-4-mini: the Llama layer. What differs is read elsewhere, so the model is Llama's:
- the checkpoint fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) as our Linear layers do; the checkpoint
  reads them as the row blocks of their parts (model/checkpoint.py fused_parts), so tensor parallelism and the
  weight formats see the usual q/k/v and gate/up shards;
- Phi-4-mini rotates only the first `partial_rotary_factor` of each head (ModelConfig.rotary_dim; the backends'
  rotary_and_write_kv rotates what the cos/sin tables cover);
- long-rope scaling (short and long factors, a cos/sin scale): layers.rope_frequencies.
"""

from __future__ import annotations

from tokenmill.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Full rotary (Phi-3-mini) keeps the backends' whole-layer kernels; partial rotary turns them off
    (LlamaForCausalLM.__init__)."""
