"""The kernels as other CPUs build them. model/cpu_kernels.py builds with -march=native, so the machine that runs the
tests only ever exercises its own instruction-set paths; here the same sources are built for older targets this
CPU can also run (an AVX2-only CPU, an AVX-512 one without BF16) and checked on this machine: they compile, their
float32 and bfloat16 paths agree with torch, the float32 matmul stays batch-invariant, the bfloat16 matmul
refuses cleanly where its instructions are missing (`--dtype auto` then picks float32), and kept GGUF blocks run on
the AVX2 kernel, bit for bit this machine's build of it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from tests.model.isa_jobs import FLAGS, TARGETS, amx_syntax_result, build, wait
from tests.quant.test_gguf_avx2 import weight
from tokenmill.model.backends.gguf_tiles import gguf_pack
from tokenmill.model.backends.reference import paged_attention_sdpa
from tokenmill.model.cpu_kernels import _extension

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kernels_built_for_an_older_cpu_run_correctly_here(target):
    if not TARGETS[target] <= FLAGS:
        pytest.skip(f"this CPU cannot run code built for {target}")
    wait(f"build:{target}")  # the background build, when tests/conftest.py started one; a failed one is redone here
    ops = build(target)
    assert ops.bf16_kernel() == ""  # neither target has AVX512-BF16 or AMX
    with pytest.raises(RuntimeError, match="no AVX512-BF16"):
        ops.bf16_linear(torch.zeros(1, 32, dtype=torch.bfloat16), ops.bf16_pack(torch.zeros(16, 32).bfloat16()), None)

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(960, 576, generator=g), torch.randn(70, 576, generator=g)
    packed = ops.f32_pack(w)
    torch.testing.assert_close(ops.f32_linear(x, packed, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    alone = torch.cat([ops.f32_linear(x[i:i + 1], packed, None) for i in range(70)])
    for m in (2, 3, 4, 5, 8, 9, 33, 70):
        assert torch.equal(ops.f32_linear(x[:m], packed, None), alone[:m]), f"batch of {m}"

    # kept GGUF blocks: the AVX2 kernel (neither target has AVX512-VNNI), float32 and bfloat16 rows, bit for bit the
    # AVX2 kernel of this machine's own build (and so, for bfloat16, the VNNI kernel's where that runs)
    assert ops.gguf_kernel() == "avx2"
    native = _extension()
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0):
        kept, raw = weight(qtype, 64, 256, seed=1)
        packed, pairs = gguf_pack(raw, kept, layout="quads"), gguf_pack(raw, kept, pairs=True, layout="quads")
        for xd in (x[:9, :256].contiguous(), x[:9, :256].bfloat16()):
            assert torch.equal(ops.gguf_linear(xd, packed, None), native.gguf_avx2_linear(xd, packed, None))
            assert torch.equal(ops.gguf_linear_silu(xd, pairs), native.gguf_avx2_linear_silu(xd, pairs))

    t, heads, kv_heads, dim, bs, length = 8, 9, 3, 64, 16, 75
    blocks = t * -(-length // bs)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        k_cache, v_cache = (torch.randn(blocks + 1, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(t, heads, dim, generator=g).to(dtype)
        tables, rows = torch.arange(blocks).view(t, -1), torch.arange(t)
        kv_lens = torch.arange(length - t + 1, length + 1)
        ours = ops.paged_attention(q, k_cache, v_cache, tables, rows, kv_lens, 0.125).float()
        ref = paged_attention_sdpa(q.float(), k_cache.float(), v_cache.float(), tables, rows, kv_lens, 0.125)
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_the_amx_paths_compile():
    """No machine these tests run on need have AMX, so its code paths (the AMX tile matmuls and attention, compiled
    only where the target has AMX) would otherwise go unbuilt until a Sapphire Rapids machine builds them at start-up.
    Checked for errors as GCC compiles them for such a CPU (syntax and template instantiation, no code emitted)."""
    result = amx_syntax_result()
    if "skip" in result:
        pytest.skip(result["skip"])
    failed = result["failed"]
    assert not failed, "\n".join(f"{name}:\n{out}" for name, out in failed.items())
