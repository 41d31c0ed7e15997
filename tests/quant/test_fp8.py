"""Weight-only FP8 (tokenmill/quant/fp8.py) on the 8-bit tile kernel (csrc/int8_linear.cpp): e4m3 bytes widen to
bfloat16 exactly, the quantizer keeps to normal numbers, and the product matches dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.tiny import make_tiny_model
from tests.quant.common import KV, tiny_batch_and_dense
from tokenmill import LLM
from tokenmill.model.backends import TorchBackend
from tokenmill.model.cpu_kernels import _extension
from tokenmill.quant.fp8 import E4M3_MAX, E4M3_MIN_NORMAL, Fp8LinearMethod, dequantize_fp8, quantize_fp8

ops = _extension()
TILES = ops is not None and ops.bf16_kernel() != ""  # AMX tiles or AVX512-BF16
needs_tiles = pytest.mark.skipif(not TILES,
                                 reason="the FP8 tile kernel runs on AMX or AVX512-BF16; elsewhere the reference")


def test_quantize_fp8_keeps_to_normal_numbers_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=g)
    w[0, :8] = torch.tensor([1e-9, -1e-9, 0.0, 3.0, 1e-4, -2e-4, 4e-3, -5e-3])  # tiny ones beside a large one
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= E4M3_MAX
    bits = q.view(torch.uint8)
    assert not ((bits & 0x78) == 0).logical_and((bits & 0x7F) != 0).any()  # no subnormal codes
    v = (q.float() * 1).abs()
    assert ((v == 0) | (v >= E4M3_MIN_NORMAL)).all()
    err = (dequantize_fp8(q, scale) - w).abs()
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value's power of two; tiny ones round to 0 or 2^-6
    assert (err <= w.abs() / 16 + E4M3_MIN_NORMAL * scale[:, None]).all()


@needs_tiles
def test_every_e4m3_code_widens_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    normal = ((codes & 0x7F) != 0x7F) & (((codes & 0x78) != 0) | ((codes & 0x7F) == 0))
    values = codes[normal].view(torch.float8_e4m3fn)  # every code but NaN and subnormals
    w = values.repeat(8)[: 16 * 32 * 3].view(16, 96)
    picked = ops.fp8_linear(torch.eye(96).bfloat16(), ops.fp8_pack(w), torch.ones(16), None)  # row k = column k
    assert torch.equal(picked.t().float(), w.float())


@needs_tiles
@pytest.mark.parametrize("m", [1, 5, 17, 33, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (48, 64), (1040, 1536)])
def test_fp8_linear_matches_dequantize_then_matmul(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q, scale = quantize_fp8(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        ref = F.linear(x.float(), dequantize_fp8(q, scale), None if b is None else b.float())
        torch.testing.assert_close(ops.fp8_linear(x, ops.fp8_pack(q), scale, b).float(), ref, atol=1e-3 * k ** 0.5,
                                   rtol=8e-3)
    alone = torch.cat([ops.fp8_linear(x[i:i + 1], ops.fp8_pack(q), scale, None) for i in range(m)])
    assert torch.equal(ops.fp8_linear(x, ops.fp8_pack(q), scale, None), alone)  # batch-invariant


@needs_tiles
def test_fp8_gate_up_pairs_apply_silu_bit_for_bit_as_the_separate_ops():
    g = torch.Generator().manual_seed(4)
    q, scale = quantize_fp8(torch.randn(2 * 64, 96, generator=g))
    x = torch.randn(37, 96, generator=g).to(torch.bfloat16)
    plain = ops.fp8_linear(x, ops.fp8_pack(q), scale, None)
    assert torch.equal(ops.fp8_linear_silu(x, ops.fp8_pack_gate_up(q), scale), ops.silu_mul(plain))


def test_reference_fp8_linear_is_the_dequantized_product():
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_fp8(torch.randn(40, 24, generator=g))
    x, bias = torch.randn(5, 24, generator=g), torch.randn(40, generator=g)
    layer = type("L", (), {"qweight": q, "weight_scale": scale, "bias": bias})()
    torch.testing.assert_close(TorchBackend().fp8_linear(x, layer), F.linear(x, dequantize_fp8(q, scale), bias))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_tiles)])
def test_fp8_model_tracks_the_dense_model(tmp_path, dtype):
    """A whole model with FP8 weights: its first greedy token and logprob agree with the dense model's to FP8
    noise, batched outputs equal the same requests run alone, and no block leaks."""
    path, batch, params, dense = tiny_batch_and_dense(tmp_path, dtype, max_tokens=8)
    llm = LLM(path, dtype=dtype, quantization="fp8", kv_cache_memory=KV)
    assert "fp8" in llm.engine.core.runner.weight_summary()
    fp8 = llm.generate(batch, params, use_tqdm=False)
    for a, b in zip(dense, fp8):
        ta, tb = a.outputs[0], b.outputs[0]
        assert abs(ta.logprobs[0][ta.token_ids[0]] - tb.logprobs[0][ta.token_ids[0]]) < 0.15
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in batch]
    assert [o.token_ids for o in alone] == [o.outputs[0].token_ids for o in fp8]
    llm.engine.core.check_idle_invariants()


@pytest.mark.parametrize("tied", [True, False])
def test_fp8_keeps_the_lm_head_dense(tmp_path, tied):
    """As vLLM's fp8: every decoder matmul is e4m3, the LM head (a tied embedding included) stays in the model's
    dtype, so the logits are the dense head's product of the same hidden states, bit for bit."""
    path = make_tiny_model(tmp_path, vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4,
                           num_kv_heads=2, tie_word_embeddings=tied)
    model, dense = (LLM(str(path), dtype="float32", quantization=q, kv_cache_memory=KV).engine.core.runner.model
                    for q in ("fp8", None))
    assert all(isinstance(m.method, Fp8LinearMethod) for m in model.layers[0].modules() if hasattr(m, "method"))
    head = model.tied_head if tied else model.lm_head
    assert not isinstance(head.method, Fp8LinearMethod) and head.weight.dtype == torch.float32
    assert not hasattr(head, "qweight")
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), dense.compute_logits(hidden), rtol=0, atol=0)
    assert model.embed_tokens.weight.dtype == torch.float32  # lookups read the dense table
