"""The AVX2 kernel of kept GGUF blocks (csrc/gguf_avx2.cpp), built wherever the CPU has AVX2, so an AVX-512 machine
tests it too: for bfloat16 x it is the VNNI kernel bit for bit (the same two-part int8 rounding of x, exact integer
sums, the same float32 steps); for float32 x (an AVX2 CPU's models) it is the dequantized weight times x rounded to int8
blocks split in two (each int8 block plus one of what it left), at odd shapes, with and without bias, in gate/up
pairs, whatever the batch and the threads. Every type the
quads layout holds: Q4_0, Q4_1, Q8_0 (its sign moved to x: VPMADDUBSW's pairs would saturate), AWQ's Q4_Z, Q5_0 and
the re-cut K-quants. tests/model/test_isa_builds.py runs it from a build for an AVX2-only CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from tests.quant.test_gguf_linear import (
    AVX2,
    KEPT,
    blocks_of,
    int8_blocks,
    needs_avx2,
    ops,
    split_int8_blocks,
)
from tests.quant.test_kquants import kept_blocks
from tokenmill.formats.gguf_blocks import Q4_Z, dequantize
from tokenmill.model.backends.gguf_tiles import gguf_pack

pytestmark = needs_avx2
QUADS_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, Q4_Z, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K]


def weight(qtype: T | int, n: int, k: int, seed: int) -> tuple[int, torch.Tensor]:
    """(kept type, blocks [n, K/32 * block bytes]) of a random weight: K-quants re-cut, the rest as quantized."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0):
        return kept_blocks(qtype, n, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return int(qtype), blocks_of(w, qtype)


@pytest.mark.parametrize("qtype", QUADS_TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17])
def test_float32_rows_are_the_dequantized_weight_times_x_in_two_int8_blocks(qtype, m):
    n, k = 80, 512  # 5 tiles of 16 features: two column pairs and a lone column
    kept, raw = weight(qtype, n, k, seed=m)
    dense = dequantize(raw, kept, (n, k))
    g = torch.Generator().manual_seed(m + 1)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 32:64] = 0  # an all-zero block: scale 0
    bias = torch.randn(n, generator=g)
    packed = gguf_pack(raw, kept, layout="quads")
    for b in (None, bias):
        got = ops.gguf_avx2_linear(x, packed, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        exact = F.linear(split_int8_blocks(x), dense.double(), None if b is None else b.double())
        # the integer sums are exact: float32 scaling and block-by-block accumulation remain
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
        # and x itself is that close: the float32 product of the dequantized weight, to float32's own error
        dense_product = F.linear(x.double(), dense.double(), None if b is None else b.double())
        torch.testing.assert_close(got.double(), dense_product, rtol=1e-4, atol=1e-4 * exact.abs().max().item())
        one_rounding = F.linear(int8_blocks(x).double(), dense.double(), None if b is None else b.double())
        assert (got.double() - dense_product).abs().max() < (one_rounding - dense_product).abs().max() / 20


@pytest.mark.skipif(KEPT not in ("vnni", "amx"), reason="the VNNI kernel to compare with is built where AVX512-VNNI is")
@pytest.mark.parametrize("qtype", QUADS_TYPES)
def test_bfloat16_rows_are_the_vnni_kernels_bit_for_bit(qtype):
    n, k = 96, 256
    kept, raw = weight(qtype, n, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed, pairs = gguf_pack(raw, kept, layout="quads"), gguf_pack(raw, kept, pairs=True, layout="quads")
    for rows in (1, 2, 4, 13):
        for b in (None, bias):
            assert torch.equal(ops.gguf_avx2_linear(x[:rows], packed, b), ops.gguf_vnni_linear(x[:rows], packed, b))
        assert torch.equal(ops.gguf_avx2_linear_silu(x[:rows], pairs), ops.gguf_vnni_linear_silu(x[:rows], pairs))


@pytest.mark.parametrize("qtype", QUADS_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_batches_and_threads(qtype, dtype):
    """Gate/up pairs give silu_mul of the plain product (rounded where it rounds); a row's result is the same alone,
    in any batch and over 1-3 threads."""
    i, k = 48, 256
    kept, raw = weight(qtype, 2 * i, k, seed=7)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    packed = gguf_pack(raw, kept, layout="quads")
    plain = ops.gguf_avx2_linear(x, packed, None)
    assert torch.equal(ops.gguf_avx2_linear_silu(x, gguf_pack(raw, kept, pairs=True, layout="quads")),
                       ops.silu_mul(plain))
    alone = torch.cat([ops.gguf_avx2_linear(x[r:r + 1], packed, None) for r in range(23)])
    assert torch.equal(plain, alone)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ops.gguf_avx2_linear(x[order], packed, None), alone[order])
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(ops.gguf_avx2_linear(x, packed, None), plain)
    finally:
        torch.set_num_threads(before)


def test_q8_0_extremes_do_not_saturate():
    """Q8_0's largest pair sums: quants -128, 127 against x's -127, 127 (2 x 16256 + ...) and -128s against -127s
    (32512 a pair, just under int16's 32767; q + 128 times x, the unsigned bytes as they are packed, would be
    255 x 127 a product)."""
    n, k = 32, 64
    raw = blocks_of(torch.ones(n, k), T.Q8_0).view(n, k // 32, 34).clone()
    raw[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).expand(n, k // 32, 2)  # d = 1
    raw[: n // 2, :, 2:] = torch.tensor([-128, 127], dtype=torch.int8).repeat(16).view(torch.uint8)
    raw[n // 2:, :, 2:] = torch.full((32,), -128, dtype=torch.int8).view(torch.uint8)
    raw = raw.view(n, -1).contiguous()
    x = torch.stack([torch.tensor([-1.0, 1.0]).repeat(k // 2), torch.full((k,), -1.0)])
    got = ops.gguf_avx2_linear(x, gguf_pack(raw, int(T.Q8_0), layout="quads"), None).double()
    exact = F.linear(split_int8_blocks(x), dequantize(raw, int(T.Q8_0), (n, k)).double())
    assert exact[0, 0] == pytest.approx(2 * 16 * (128 + 127)) and exact[1, -1] == pytest.approx(2 * 32 * 128)
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=0)


def test_refuses_other_shapes_and_dtypes():
    kept, raw = weight(T.Q4_0, 16, 64, seed=0)
    packed = gguf_pack(raw, kept, layout="quads")
    with pytest.raises(RuntimeError, match="input has 32 features"):
        ops.gguf_avx2_linear(torch.zeros(1, 32), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.gguf_avx2_linear(torch.zeros(1, 64, dtype=torch.float16), packed, None)
    with pytest.raises(RuntimeError, match="tiles of"):
        ops.gguf_avx2_linear(torch.zeros(1, 64), packed[..., :100].contiguous(), None)


assert AVX2 or not torch.backends.cpu.get_cpu_capability().startswith("AVX2")
