"""Weight-only INT8 (tokenmill/quant/int8.py, csrc/int8_linear.cpp): the quantizer, the kernel against a
dequantize-then-matmul reference, batch invariance, the fused gate/up epilogue, and whole models whose weights
already lie on the int8 grid (so quantizing them loses nothing and any difference is the kernel's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.cpu_kernels import _extension
from tokenmill.quant.int8 import dequantize_int8, quantize_int8

ops = _extension()
TILES = ops is not None and ops.bf16_kernel() != ""  # AMX tiles or AVX512-BF16
needs_tiles = pytest.mark.skipif(not TILES,
                                 reason="the int8 tile kernel runs on AMX or AVX512-BF16; elsewhere the reference")
KV = 64 << 20


def grid_weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A weight int8 quantization represents exactly: each row q * 2^e with |q| <= 127 and one |q| == 127."""
    q = torch.randint(-127, 128, (n, k), generator=g).float()
    q[torch.arange(n), torch.randint(0, k, (n,), generator=g)] = 127.0
    return q * torch.exp2(torch.randint(-12, -6, (n, 1), generator=g).float())


# ---- the quantizer -------------------------------------------------------------------------------------------

def test_quantize_int8_is_within_half_a_step_and_exact_on_the_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    w[3] = 0.0  # an all-zero row: scale 1, q 0, no division by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() <= 127
    assert (dequantize_int8(q, scale) - w).abs().le(scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(q[3], torch.zeros_like(q[3])) and scale[3] == 1
    exact = grid_weight(32, 64, g)
    assert torch.equal(dequantize_int8(*quantize_int8(exact)), exact)


# ---- the kernel ----------------------------------------------------------------------------------------------

@needs_tiles
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (48, 64), (16, 32), (1040, 1536)])
def test_int8_linear_matches_dequantize_then_matmul(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q, scale = quantize_int8(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = ops.int8_pack(q)
    assert packed.shape == (n // 16, k // 32, 16, 32) and packed.dtype == torch.uint8
    for b in (None, bias):
        ref = F.linear(x.float(), dequantize_int8(q, scale), None if b is None else b.float())
        # float32 sums, one bfloat16 rounding of the result: within a bfloat16 ulp of the exact value
        torch.testing.assert_close(ops.int8_linear(x, packed, scale, b).float(), ref, atol=1e-3 * k ** 0.5,
                                   rtol=8e-3)
    strided = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    assert torch.equal(ops.int8_linear(strided, packed, scale, None),
                       ops.int8_linear(strided.contiguous(), packed, scale, None))


@needs_tiles
def test_int8_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 576, generator=g).to(torch.bfloat16)
    q, scale = quantize_int8(torch.randn(960, 576, generator=g))
    packed = ops.int8_pack(q)
    alone = torch.cat([ops.int8_linear(x[i:i + 1], packed, scale, None) for i in range(130)])
    for m in (2, 5, 7, 8, 9, 16, 17, 32, 33, 64, 130):
        assert torch.equal(ops.int8_linear(x[:m], packed, scale, None), alone[:m]), f"batch of {m}"


@needs_tiles
@pytest.mark.parametrize("m", [1, 17, 70])
def test_int8_gate_up_pairs_apply_silu_bit_for_bit_as_the_separate_ops(m):
    g = torch.Generator().manual_seed(m)
    q, scale = quantize_int8(torch.randn(2 * 96, 64, generator=g))
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    plain = ops.int8_linear(x, ops.int8_pack(q), scale, None)
    assert torch.equal(ops.int8_linear_silu(x, ops.int8_pack_gate_up(q), scale), ops.silu_mul(plain))
    backend = CpuBackend(ops, ops.bf16_kernel())
    packed = backend.pack_int8(q, silu_pairs=True)
    layer = SimpleNamespace(qweight=q, weight_scale=scale, bias=None, packed_weight=packed,
                            pair_scale=backend._pair_order(scale))
    assert torch.equal(backend.int8_linear(x, layer), plain)  # the plain [gate | up] product from the pairs
    assert torch.equal(backend.gate_up_silu(x, layer), ops.silu_mul(plain))


def test_int8_pack_rejects_minus_128_and_odd_shapes():
    if ops is None:
        pytest.skip("no C++ kernels built here")
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        ops.int8_pack(torch.full((16, 32), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="N % 16"):
        ops.int8_pack(torch.zeros(20, 32, dtype=torch.int8))


def test_reference_int8_linear_is_the_dequantized_product():
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_int8(torch.randn(40, 24, generator=g))
    x, bias = torch.randn(5, 24, generator=g), torch.randn(40, generator=g)
    layer = SimpleNamespace(qweight=q, weight_scale=scale, bias=bias)
    ref = F.linear(x, dequantize_int8(q, scale), bias)
    torch.testing.assert_close(TorchBackend().int8_linear(x, layer), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(TorchBackend().int8_linear(x.bfloat16(), layer).float(), ref, atol=0.1, rtol=2e-2)


# ---- whole models ------------------------------------------------------------------------------------------

def grid_model(tmp_path: Path, **kw) -> Path:
    """A tiny random model with every matmul weight (and the tied embedding, which is the LM head) moved onto
    the int8 grid."""
    path = make_tiny_model(tmp_path, vocab_size=512, **kw)
    file = path / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = grid_weight(*t.shape, g) * (t.std() / 40)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 16, 41)]


def test_int8_on_grid_weights_matches_transformers_greedy(tmp_path):
    """float32 compute: int8 weights through torch's int8 matmul, against HF on the same (exactly representable)
    weights, token for token."""
    from transformers import AutoModelForCausalLM

    path = grid_model(tmp_path, num_heads=4, num_kv_heads=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", quantization="int8", kv_cache_memory=KV)
    assert "int8" in llm.engine.core.startup_summary()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts(), outs):
        ref, logits = hf_greedy(hf, p, 24)
        assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    llm.engine.core.check_idle_invariants()


@needs_tiles
def test_int8_tiles_on_grid_weights_track_the_dense_bf16_model(tmp_path):
    """bfloat16 on the tile kernels: the int8 tiles and the dense bfloat16 tiles multiply the same weights (on the grid, with
    power-of-two scales, bfloat16 holds them exactly), so their logprobs agree to bfloat16 noise, and the int8
    model is batch-invariant like the dense one."""
    path = grid_model(tmp_path, num_heads=4, num_kv_heads=2, hidden_size=128, intermediate_size=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    dense = LLM(str(path), dtype="bfloat16", kv_cache_memory=KV)
    int8 = LLM(str(path), dtype="bfloat16", quantization="int8", kv_cache_memory=KV)
    assert int8.engine.core.runner.model.layers[0].mlp.down_proj.packed_weight.dtype == torch.uint8
    batch = [{"prompt_token_ids": p} for p in prompts()]
    a = dense.generate(batch, params, use_tqdm=False)
    b = int8.generate(batch, params, use_tqdm=False)
    for x, y in zip(a, b):
        tx, ty = x.outputs[0], y.outputs[0]
        assert tx.token_ids[0] == ty.token_ids[0]
        assert abs(tx.logprobs[0][tx.token_ids[0]] - ty.logprobs[0][ty.token_ids[0]]) < 0.05
        agree = sum(s == t for s, t in zip(tx.token_ids, ty.token_ids))
        assert agree >= 8, (tx.token_ids, ty.token_ids)
    alone = [int8.generate([p], params, use_tqdm=False)[0].outputs[0] for p in batch]
    for one, together in zip(alone, b):
        assert one.token_ids == together.outputs[0].token_ids
        assert one.logprobs == together.outputs[0].logprobs
    # the tied embedding looks its int8 rows up in the head's packed tiles (no second int8 table), scaled as the
    # int8 table's rows
    model, ids = int8.engine.core.runner.model, torch.tensor([[0, 15, 16], [511, 300, 15]])
    head = model.tied_head
    held = [c.cell_contents for c in model.embed_tokens.rows.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    ptrs = {head.packed_weight.untyped_storage().data_ptr(), head.weight_scale.untyped_storage().data_ptr()}
    assert held and all(t.untyped_storage().data_ptr() in ptrs for t in held)
    q, scale = quantize_int8(dense.engine.core.runner.model.embed_tokens(torch.arange(512)))
    assert torch.equal(model.embed_tokens(ids), (q[ids].float() * scale[ids].unsqueeze(-1)).to(torch.bfloat16))
    int8.engine.core.check_idle_invariants()


def test_int8_weights_take_about_half_the_bytes(tmp_path):
    path = make_tiny_model(tmp_path, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3)
    dense = LLM(str(path), dtype="bfloat16", kv_cache_memory=KV).engine.core.runner
    int8 = LLM(str(path), dtype="bfloat16", quantization="int8", kv_cache_memory=KV).engine.core.runner
    from tokenmill.engine.runner import weight_bytes

    matmul_params = sum(p.numel() for n, p in dense.model.named_parameters() if "proj" in n)
    saved = weight_bytes(dense.model) - weight_bytes(int8.model)
    # each matmul weight: 2 bytes -> 1 byte (+ 4 bytes of scale per output feature), the tied table too (held once:
    # the lookups read the head's int8 tiles)
    assert saved > 0.8 * matmul_params
    assert "int8" in int8.weight_summary()


def test_unknown_quantization_names_the_choices():
    with pytest.raises(ConfigError, match="--quantization must be one of int8"):
        EngineConfig(quantization="int3")
