"""The C++ CPU kernels against the torch code they replace: skinny linear, oneDNN prepacked linear, RMSNorm (with
the fused residual add), rotary + KV-cache write, SiLU-and-multiply; float32 and bfloat16, odd sizes."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.backends import CpuBackend
from tokenmill.model.backends.reference import apply_rotary, rms_norm, write_kv
from tokenmill.model.cpu_kernels import _extension
from tokenmill.model.layers import RMSNorm, RotaryEmbedding
from tokenmill.model.linear import Linear, prepack_weight

ops = _extension()
HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
# Only a machine without a compiler may skip: where one exists, a kernel that fails to build is a failure.
pytestmark = pytest.mark.skipif(ops is None and not HAVE_COMPILER,
                                reason="no C++ compiler: the torch reference is what runs")


def test_kernels_build_where_a_compiler_exists():
    assert ops is not None, "the C++ kernels failed to build; see the warning logged by tokenmill.model.cpu_kernels"


def test_each_cpu_gets_its_own_build(monkeypatch):
    """Built with -march=native: a build from another CPU (a shared cache, an image) must never be loaded here."""
    from tokenmill.model import cpu_kernels

    assert ops.__name__ == cpu_kernels.build_name()
    assert ops.__name__.startswith(f"tokenmill_cpu_kernels_{cpu_kernels.cpu_tag()}_")
    tags = []
    for flags in ("fpu sse2 avx avx2 fma", "fpu sse2 avx avx2 fma avx512f avx512_bf16", "fpu sse2 avx avx2 fma"):
        fake = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n"
        monkeypatch.setattr(cpu_kernels.Path, "read_text", lambda self, *a, _f=fake, **k: _f)
        tags.append(cpu_kernels.cpu_tag())
    assert tags[0] != tags[1] and tags[0] == tags[2]


DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype, terms: int = 1):
    """float32: summation order differs from BLAS, so allow for `terms` accumulated products."""
    return dict(atol=1e-6 * max(terms, 10), rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(133, 77), (960, 576), (64, 8)])
def test_skinny_linear_matches_f_linear(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
    torch.testing.assert_close(ops.skinny_linear(x, w, None), F.linear(x, w), **tol(dtype, k))
    torch.testing.assert_close(ops.skinny_linear(x, w, b), F.linear(x, w, b), **tol(dtype, k))


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("m", [1, 5, 8, 64, 300])
@pytest.mark.parametrize("n,k", [(133, 77), (960, 576), (64, 8)])
def test_prepacked_linear_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,)))
    packed = prepack_weight(w)
    assert packed is not None and packed.is_mkldnn  # float32 on a CPU always has a oneDNN kernel
    backend = CpuBackend(ops)
    for bias in (None, b):
        layer = SimpleNamespace(weight=w, bias=bias, packed_weight=packed)
        torch.testing.assert_close(backend.linear(x, layer), F.linear(x, w, bias), **tol(torch.float32, k))


@needs_onednn
def test_prepacked_module_keeps_its_plain_weight_and_state_dict():
    layer = Linear(16, 24, bias=True, backend=CpuBackend(ops))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.packed_weight = prepack_weight(layer.weight)
    assert layer.packed_weight.is_mkldnn
    assert layer.state_dict().keys() == before.keys()
    x = torch.randn(9, 16)
    torch.testing.assert_close(layer(x), F.linear(x, before["weight"], before["bias"]), **tol(torch.float32, 16))


def test_prepack_declines_other_devices():
    assert prepack_weight(torch.randn(4, 4, device="meta")) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_and_fused_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x, residual = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(rows, 96, generator=g).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), rms_norm(x, norm.weight, 1e-5), **tol(dtype))
        want_residual = residual + x
        want = rms_norm(want_residual, norm.weight, 1e-5)
        got = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(residual, want_residual)  # the add rounds exactly as torch's does
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_with_a_float32_scale_rounds_once(dtype, rows):
    """Gemma's (1 + w) norms: x / rms(x) * scale in float32, one rounding to x's dtype (Backend's torch form), rows
    read with a stride (the q/k heads of a fused projection)."""
    from tokenmill.model.backends.base import Backend

    g = torch.Generator().manual_seed(rows)
    scale = 1 + torch.randn(96, generator=g)
    wide = torch.randn(rows, 128, generator=g).to(dtype)
    x = wide[:, 16:112]  # strided rows
    want = Backend.rms_norm_float_scale(None, x, scale, 1e-6)  # the torch ops (x's dtype is not scale's)
    got = ops.rms_norm_f32_scale(x, scale, 1e-6)
    # only the float32 sum's order differs: a value off by one step of x's dtype at most, few of them
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert ((got.float() - want.float()).abs() <= step * want.float().abs()).all()
    assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv_matches_apply_rotary_and_write_kv(dtype):
    g = torch.Generator().manual_seed(3)
    t, heads, kv_heads, hd, bs = 7, 6, 2, 32, 4
    rotary = RotaryEmbedding(hd, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 6, 7, 30, 31, 63])
    cos, sin = rotary.tables(positions, dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    slots = torch.randperm(10 * bs, generator=g)[:t]
    caches = [torch.zeros(10, bs, kv_heads, hd, dtype=dtype) for _ in range(4)]

    q, k, v = (y.reshape(t, -1, hd) for y in qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1))
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    write_kv(caches[0], caches[1], want_k, v, slots)

    got = qkv.clone()
    ops.rotary_write_kv(got, heads, kv_heads, cos.view(t, -1), sin.view(t, -1), caches[2], caches[3], slots)
    got_q, got_k, got_v = got.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    torch.testing.assert_close(got_q.reshape(t, heads, hd), want_q, **tol(dtype))
    torch.testing.assert_close(got_k.reshape(t, kv_heads, hd), want_k, **tol(dtype))
    assert torch.equal(got_v, qkv[:, (heads + kv_heads) * hd:])
    torch.testing.assert_close(caches[2], caches[0], **tol(dtype))
    assert torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1539])  # 1539: a tail past the 8-wide vector loop
def test_silu_mul(dtype, width):
    gate_up = torch.randn(9, 2 * width, generator=torch.Generator().manual_seed(4)) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -88.5, -30.0, 30.0, 88.5, 200.0])  # exp overflow and underflow
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, **tol(dtype))


@needs_onednn
def test_reloading_weights_drops_stale_packed_copies(tmp_path):
    from tests.models.tiny import make_tiny_model
    from tokenmill.model.llama import LlamaForCausalLM
    from tokenmill.model.loader import load_model_config, load_weights

    path = make_tiny_model(tmp_path, arch="llama", num_layers=1)
    cfg = load_model_config(path)
    backend = CpuBackend(ops)
    model = LlamaForCausalLM(cfg, backend)
    model.load_hf_weights(load_weights(path, cfg))
    assert backend.prepack(model)
    linears = model.linear_layers()
    assert all(m.packed_weight is not None for m in linears)
    model.load_hf_weights(load_weights(path, cfg))
    assert all(m.packed_weight is None for m in linears)
    assert model.backend_cache == {}


# ---- the packed bfloat16 matmuls (csrc/bf16_linear.cpp) -------------------------------------------------------

BF16_KERNEL = ops.bf16_kernel() if ops is not None else ""
# Each kernel runs where the CPU has its instructions; elsewhere it is not built, and saying so is the truth.
BF16_KERNELS = [pytest.param("amx_linear", marks=pytest.mark.skipif(BF16_KERNEL != "amx", reason="no AMX-BF16 here")),
                pytest.param("dpbf16_linear",
                             marks=pytest.mark.skipif(BF16_KERNEL == "", reason="no AVX512-BF16 here"))]


@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (48, 64), (16, 32), (1040, 96)])
def test_packed_bf16_linear_matches_f_linear(kernel, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = ((torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16) for s in ((m, k), (n, k), (n,)))
    packed = ops.bf16_pack(w)
    assert packed.shape == (n // 16, k // 32, 16, 32)
    fn = getattr(ops, kernel)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        # float32 accumulation, one bfloat16 rounding of the result: within a bfloat16 ulp of the exact value
        torch.testing.assert_close(fn(x, packed, bias).float(), ref, atol=1e-3 * k ** 0.5, rtol=8e-3)
    strided = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, :k]
    assert torch.equal(fn(strided, packed, None), fn(strided.contiguous(), packed, None))


@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_packed_bf16_linear_rows_do_not_depend_on_the_batch(kernel):
    """The property oneDNN lacks (a row in a batch of <= 32 and of >= 33 comes out different): each row's
    result is bit for bit the same alone, in any batch size, at any position."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 576, generator=g).to(torch.bfloat16)
    packed = ops.bf16_pack((torch.randn(960, 576, generator=g) * 0.05).to(torch.bfloat16))
    fn = getattr(ops, kernel)
    alone = torch.cat([fn(x[i:i + 1], packed, None) for i in range(130)])
    for m in (2, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 130):
        assert torch.equal(fn(x[:m], packed, None), alone[:m]), f"batch of {m}"
    order = torch.randperm(130, generator=g)
    assert torch.equal(fn(x[order], packed, None), alone[order])


def test_prepack_picks_the_bf16_tiles_where_they_fit():
    backend = CpuBackend(ops, BF16_KERNEL)
    fits, odd = torch.randn(64, 96).to(torch.bfloat16), torch.randn(40, 96).to(torch.bfloat16)
    if BF16_KERNEL:
        assert backend.pack_weight(fits).shape == (4, 3, 16, 32)
    odd_packed = backend.pack_weight(odd)  # 40 features: not whole 16-feature tiles, so oneDNN's or none
    assert odd_packed is None or odd_packed.is_mkldnn
    assert backend.pack_weight(torch.randn(64, 96)) is None or backend.pack_weight(torch.randn(64, 96)).is_mkldnn
    x = torch.randn(7, 96).to(torch.bfloat16)
    for w in (fits, odd):
        layer = SimpleNamespace(weight=w, bias=None, packed_weight=backend.pack_weight(w))
        torch.testing.assert_close(backend.linear(x, layer).float(), F.linear(x, w).float(), atol=0.1, rtol=2e-2)


@pytest.mark.skipif(BF16_KERNEL == "", reason="no AMX or AVX512-BF16 here: no packed bfloat16 weights")
@pytest.mark.parametrize("m", [1, 5, 16, 33, 130])
@pytest.mark.parametrize("i,k", [(48, 64), (1536, 576)])
def test_gate_up_pairs_apply_silu_bit_for_bit_as_the_separate_ops(m, i, k):
    """bf16_pack_gate_up + amx_linear_silu == silu_mul(amx_linear(bf16_pack)), bit for bit; and the same pairs
    still give the plain [gate | up] product through CpuBackend.linear."""
    g = torch.Generator().manual_seed(m + i)
    w = (torch.randn(2 * i, k, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    pairs = ops.bf16_pack_gate_up(w)
    assert pairs.shape == (i // 16, 2, k // 32, 16, 32)
    plain = ops.bf16_linear(x, ops.bf16_pack(w), None)
    assert torch.equal(ops.bf16_linear_silu(x, pairs), ops.silu_mul(plain))
    backend = CpuBackend(ops, BF16_KERNEL)
    layer = SimpleNamespace(weight=w, bias=None, packed_weight=backend.pack_weight(w, silu_pairs=True))
    assert layer.packed_weight.dim() == 5
    assert torch.equal(backend.linear(x, layer), plain)
    assert torch.equal(backend.gate_up_silu(x, layer), ops.silu_mul(plain))


@pytest.mark.skipif(BF16_KERNEL == "", reason="no bfloat16 matmul kernel on this CPU")
def test_bf16_tile_packing_releases_the_plain_weights_and_reloads(tmp_path):
    """Where the tile copy serves every row count, the plain copy is not kept (the weights are held once); the
    tied LM head's tiles serve the embedding's lookups too, so the table goes as well, and loading again brings
    the plain weights back."""
    from tests.models.tiny import make_tiny_model
    from tokenmill.model.llama import LlamaForCausalLM
    from tokenmill.model.loader import load_model_config, load_weights

    path = make_tiny_model(tmp_path, arch="llama", num_layers=1)
    cfg = load_model_config(path)
    backend = CpuBackend(ops, BF16_KERNEL)
    model = LlamaForCausalLM(cfg, backend, torch.bfloat16)
    model.load_hf_weights(load_weights(path, cfg, torch.bfloat16))
    x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16)
    qkv = model.layers[0].self_attn.qkv_proj
    before = F.linear(x, qkv.weight)
    ids = torch.tensor([0, 7, cfg.vocab_size - 1])
    rows = model.embed_tokens(ids)
    assert backend.prepack(model)
    assert qkv.weight.is_meta and qkv.packed_weight.dim() == 4
    assert model.embed_tokens.weight.is_meta and model.tied_head.packed_weight.dim() == 4
    assert torch.equal(model.embed_tokens(ids), rows)
    torch.testing.assert_close(qkv(x), before, atol=0.05, rtol=2e-2)
    model.load_hf_weights(load_weights(path, cfg, torch.bfloat16))
    assert not any(p.is_meta for p in model.parameters()) and qkv.packed_weight is None
    assert torch.equal(F.linear(x, qkv.weight), before)


# ---- the float32 panel matmul (csrc/f32_linear.cpp) -------------------------------------------------------------

needs_f32_panels = pytest.mark.skipif(ops is None or not ops.f32_panels_available(), reason="no AVX2/FMA here")


@needs_f32_panels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 33, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (48, 77), (16, 5)])
def test_f32_panel_linear_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n,)))
    packed = ops.f32_pack(w)
    assert packed.shape == (n // 16, k, 16)
    for bias in (None, b):
        torch.testing.assert_close(ops.f32_linear(x, packed, bias), F.linear(x, w, bias), **tol(torch.float32, k))
    strided = torch.randn(m, 2 * k, generator=g)[:, :k]
    assert torch.equal(ops.f32_linear(strided, packed, None), ops.f32_linear(strided.contiguous(), packed, None))


@needs_f32_panels
def test_f32_panel_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 576, generator=g)
    packed = ops.f32_pack(torch.randn(960, 576, generator=g))
    alone = torch.cat([ops.f32_linear(x[i:i + 1], packed, None) for i in range(70)])
    for m in (2, 4, 7, 8, 9, 16, 33, 70):
        assert torch.equal(ops.f32_linear(x[:m], packed, None), alone[:m]), f"batch of {m}"
    order = torch.randperm(70, generator=g)
    assert torch.equal(ops.f32_linear(x[order], packed, None), alone[order])


@needs_f32_panels
def test_batch_invariant_backend_packs_float32_into_panels_and_holds_them_once():
    backend, plain = CpuBackend(ops, BF16_KERNEL, f32_panels=True), CpuBackend(ops, BF16_KERNEL)
    w = torch.randn(64, 40)
    assert backend.pack_weight(w).shape == (4, 40, 16)
    assert plain.pack_weight(w) is None or plain.pack_weight(w).is_mkldnn  # oneDNN's, beside the plain weight
    layer = Linear(40, 64, bias=True, backend=backend)
    x = torch.randn(6, 40)
    before = F.linear(x, layer.weight, layer.bias)
    model = SimpleNamespace(linear_layers=lambda: [layer], backend_cache={})
    assert backend.prepack(model) and layer.weight.is_meta
    torch.testing.assert_close(layer(x), before, **tol(torch.float32, 40))


def test_a_lock_left_by_a_killed_process_does_not_block_the_next_start(tmp_path):
    """torch's build lock, left behind by a process killed while loading the kernels, must not make a later start
    wait forever: a build already made for this CPU and these sources is imported without it."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from tokenmill.model.cpu_kernels import build_name

    lock = Path(_get_build_directory(build_name(), False)) / "lock"
    lock.touch()
    try:
        code = "from tokenmill.model.cpu_kernels import _extension; print(_extension() is not None)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
        assert out.stdout.strip() == "True", out.stderr[-2000:]
    finally:
        lock.unlink(missing_ok=True)
