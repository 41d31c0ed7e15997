"""The CPU backend's whole-model decode path as C++ objects: a Llama model's decoder layers as one ops.DecoderStack,
and the stack with the embedding, final norm and LM head as one ops.DecodeModel, each built once per model and kept
in model.backend_cache (which the model empties when its weights change; CpuBackend.prepack drops them too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.model.backends.base import LinearWeights
from tokenmill.model.backends.cpu_rows import NativeRows
from tokenmill.model.backends.gguf_tiles import kernel_dtypes

LAYER_WEIGHTS = "cpu.decoder_layer_weights"  # key of this backend's entry in model.backend_cache
LAYER_STACK = "cpu.decoder_stack"  # the same weights as one ops.DecoderStack
DECODE_MODEL = "cpu.decode_model"  # the stack with the embedding, final norm and LM head: one ops.DecodeModel


def decode_model(ops: Any, model: nn.Module, input_ids: torch.Tensor, reach: int = 1) -> Any:
    """The model's ops.DecodeModel, built on first use; None where none can run it, or for inputs off the CPU.
    `reach`: the call reads rotary rows of positions [0, reach): the tables grow to cover them (layers.py
    RotaryEmbedding.cover), and a DecodeModel built on shorter tables is built again."""
    rotary = getattr(model, "rotary", None)
    tables = None
    if rotary is not None:
        rotary.cover(reach)
        tables = rotary.rounded(model.norm.weight.dtype)[0]
    built = model.backend_cache.get(DECODE_MODEL)
    if built is None or (built[0] is not None and built[1] is not tables):
        built = model.backend_cache[DECODE_MODEL] = (_build_decode_model(ops, model), tables)
    return built[0] if input_ids.device.type == "cpu" else None


def _build_decode_model(ops: Any, model: nn.Module) -> Any:
    """ops.DecodeModel for a whole Llama model here (no tensor or pipeline split) whose every part of a step
    has its C++ op: the layers a DecoderStack, the embedding a table or a NativeRows lookup, the LM head a
    packed copy that linear_any runs as the Python head does (or a plain weight); None otherwise."""
    make, stack = getattr(ops, "DecodeModel", None), layer_stack(ops, model)
    if (make is None or stack is None or getattr(model, "tp", None) is not None or not (model.first and model.last)
            or model.rotary is None):
        return None
    emb, norm = model.embed_tokens, model.norm.weight
    if emb.rows is not None and emb.weight.is_meta:
        native = getattr(emb.rows, "native", None)
    else:
        native = NativeRows("dense", emb.weight) if emb.weight.device.type == "cpu" else None
    head = model.lm_head if model.lm_head is not None else model.tied_head
    packed, scale = head.packed_weight, getattr(head, "weight_scale", None)
    quantized = getattr(head, "gguf_type", None) is not None or scale is not None
    if native is None or head.bias is not None or (
            packed is None if quantized or head.weight.is_meta else False):
        return None
    gguf_head = getattr(head, "gguf_type", None) is not None
    if quantized and (packed.dtype not in (torch.uint8, torch.float8_e4m3fn) or norm.dtype not in (
            kernel_dtypes(getattr(ops, "gguf_kernel", str)()) if gguf_head else (torch.bfloat16,))):
        return None  # the Python head takes the reference path there
    empty = torch.empty(0, dtype=norm.dtype)
    lookup = ops.RowLookup(
        native.kind, native.table, native.sources if native.sources is not None else empty.long(),
        native.flip if native.flip is not None else empty.byte(), native.ggml_type,
        native.scale if native.scale is not None else empty.float(), norm)
    cos, sin = model.rotary.rounded(norm.dtype)
    cfg = model.config
    return make(stack, lookup, norm, cfg.rms_norm_eps, head.weight, packed if packed is not None else empty,
                scale if scale is not None and packed is not None else empty, empty,
                cos, sin, cfg.num_heads, cfg.num_kv_heads)


def layer_stack(ops: Any, model: nn.Module, lora_matmul_rows: int = 0) -> Any:
    """The model's layers as one ops.DecoderStack (_layer_weights' tensors, held in C++), built once per model
    and kept in model.backend_cache; None where _layer_weights is, or where the model's layers are not the plain
    Llama layer the stack computes (model.whole_layer_kernels: q/k norms, partial rotary, NoPE layers). A model
    with LoRA slots (model/lora.py) hands them to the stack too, which adds a step's adapter runs after each
    projection (LoRA runs of more than `lora_matmul_rows` rows through matmuls; 0: never)."""
    if LAYER_STACK not in model.backend_cache:
        weights = _layer_weights(model) if getattr(model, "whole_layer_kernels", True) else None
        stack = None if weights is None else ops.DecoderStack(weights)
        if stack is not None and getattr(model, "lora_batch", None) is not None:
            stack.set_lora(*_lora_slots(model), lora_matmul_rows)
        model.backend_cache[LAYER_STACK] = stack
    return model.backend_cache[LAYER_STACK]


def _lora_slots(model: nn.Module) -> tuple[list, list, list, list]:
    """Per layer and projection (qkv, o, gate_up, down): the LoRA slots' A, B, ranks and first columns (empty lists
    where a projection has none), as DecoderStack.set_lora takes them."""
    out: tuple[list, list, list, list] = ([], [], [], [])
    for layer in model.layers:
        projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj]
        slots = [getattr(m, "lora", None) for m in projections]
        for i, field in enumerate(("a", "b", "ranks", "col0s")):
            out[i].append([getattr(s, field) if s is not None else [] for s in slots])
    return out


def _layer_weights(model: nn.Module) -> list[list[torch.Tensor]] | None:
    """Per layer, the 15 tensors a layer of `DecoderStack` takes (csrc/decode_stack.cpp), gathered once per
    model and kept in model.backend_cache (which the model empties when its weights change); None where a
    quantized weight has no packed copy (the C++ layer reads quantized weights only from their packed copies)."""
    if LAYER_WEIGHTS not in model.backend_cache and any(
            (getattr(m, "qweight", None) is not None or getattr(m, "gguf_type", None) is not None)
            and m.packed_weight is None for m in model.linear_layers()):
        model.backend_cache[LAYER_WEIGHTS] = None
    if LAYER_WEIGHTS in model.backend_cache:
        return model.backend_cache[LAYER_WEIGHTS]
    empty = torch.empty(0, dtype=model.norm.weight.dtype, device=model.norm.weight.device)

    def packed(m: LinearWeights) -> torch.Tensor:
        return empty if m.packed_weight is None else m.packed_weight

    def scale(m: LinearWeights) -> torch.Tensor:  # an int8 weight's scales, read beside its packed copy
        s = getattr(m, "weight_scale", None)
        return s if s is not None and m.packed_weight is not None else empty

    model.backend_cache[LAYER_WEIGHTS] = [
        [l.input_layernorm.weight, l.self_attn.qkv_proj.weight,
         l.self_attn.qkv_proj.bias if l.self_attn.qkv_proj.bias is not None else empty,
         l.self_attn.o_proj.weight, l.post_attention_layernorm.weight,
         l.mlp.gate_up_proj.weight, l.mlp.down_proj.weight,
         packed(l.self_attn.qkv_proj), packed(l.self_attn.o_proj), packed(l.mlp.gate_up_proj),
         packed(l.mlp.down_proj), scale(l.self_attn.qkv_proj), scale(l.self_attn.o_proj),
         scale(l.mlp.gate_up_proj), scale(l.mlp.down_proj)] for l in model.layers]
    return model.backend_cache[LAYER_WEIGHTS]
