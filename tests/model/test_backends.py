"""The backend seam: TorchBackend's batched paged attention against the per-token oracle, CpuBackend against
TorchBackend op by op and on a whole model, select_backend's choice, and `ModelRunner(use_kernel=False)` as a true
reference that runs no C++ op."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.model.test_attention import contexts_for, make_paged_batch, paged_attention_reference
from tests.models.tiny import make_tiny_model
from tokenmill.engine.runner import ModelRunner
from tokenmill.model import cpu_kernels
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import CpuBackend, TorchBackend, select_backend
from tokenmill.model.backends.reference import paged_attention_sdpa
from tokenmill.model.layers import RotaryEmbedding
from tokenmill.model.loader import load_model_config, load_weights

ops = cpu_kernels._extension()
needs_kernels = pytest.mark.skipif(ops is None, reason="C++ kernels not built here")
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


# ---- TorchBackend paged attention == the per-token oracle -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_batched_paged_attention_equals_per_token_reference(dtype, group, block_size):
    """Several requests, GQA, decodes and chunk continuations with several paged tokens on one request,
    kv_lens on and off block boundaries, padding block 0 full of loud values."""
    args = make_paged_batch(31 * group + block_size, dtype, group, 64, block_size, contexts_for(block_size))
    got = paged_attention_sdpa(*args)
    want = paged_attention_reference(*args)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **tol(dtype))


def test_batched_paged_attention_tokens_of_a_request_need_not_be_adjacent():
    q, kc, vc, tables, rows, lens, scale = make_paged_batch(9, torch.float32, 2, 64, 16, contexts_for(16))
    perm = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(0))
    got = paged_attention_sdpa(q[perm], kc, vc, tables, rows[perm], lens[perm], scale)
    torch.testing.assert_close(got, paged_attention_reference(q, kc, vc, tables, rows, lens, scale)[perm],
                               atol=1e-5, rtol=1e-5)


# ---- CpuBackend == TorchBackend, op by op -------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_elementwise_ops_match_torch(dtype):
    g = torch.Generator().manual_seed(1)
    cpu, ref = CpuBackend(ops), TorchBackend()
    x, res, w = (torch.randn(*s, generator=g).to(dtype) for s in ((7, 96), (7, 96), (96,)))
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **tol(dtype))
    res_cpu, res_ref = res.clone(), res.clone()
    torch.testing.assert_close(cpu.add_rms_norm(x, res_cpu, w, 1e-5), ref.add_rms_norm(x, res_ref, w, 1e-5),
                               **tol(dtype))
    assert torch.equal(res_cpu, res_ref)  # both added in place, rounding the same way
    gate_up = 3 * torch.randn(7, 2 * 40, generator=g).to(dtype)
    torch.testing.assert_close(cpu.silu_mul(gate_up), ref.silu_mul(gate_up), **tol(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_rotary_and_write_kv_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    t, heads, kvh, hd = 6, 6, 2, 32
    cos, sin = RotaryEmbedding(hd, 64, 10000.0, None).tables(torch.tensor([0, 1, 9, 10, 40, 63]), dtype)
    qkv = torch.randn(t, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    slots = torch.randperm(40, generator=g)[:t]
    results = []
    for backend in (CpuBackend(ops), TorchBackend()):
        caches = [torch.zeros(10, 4, kvh, hd, dtype=dtype) for _ in range(2)]
        q, k, v = backend.rotary_and_write_kv(qkv.clone(), heads, kvh, cos, sin, *caches, slots)
        assert q.shape == (t, heads, hd) and k.shape == v.shape == (t, kvh, hd)
        results.append((q, k, v, *caches))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_paged_attention_matches_torch_on_a_mixed_batch(dtype):
    """Paged tokens (kernel) then a fresh prefill span (SDPA) in one batch."""
    q, kc, vc, tables, rows, lens, _ = make_paged_batch(4, dtype, 3, 64, 16, contexts_for(16))
    p, fresh = q.shape[0], 5
    g = torch.Generator().manual_seed(3)
    q = torch.cat([q, torch.randn(fresh, *q.shape[1:], generator=g).to(dtype)])
    k, v = (torch.randn(p + fresh, kc.shape[2], 64, generator=g).to(dtype) for _ in range(2))
    meta = AttentionMetadata(slot_mapping=torch.zeros(p + fresh, dtype=torch.long), num_paged_tokens=p,
                             block_tables=tables, q_rows=rows, kv_lens=lens, fresh_spans=[(p, p + fresh)])
    got = CpuBackend(ops).paged_attention(q, k, v, kc, vc, meta)
    want = TorchBackend().paged_attention(q, k, v, kc, vc, meta)
    bf16_tol = {"atol": 6e-2, "rtol": 5e-2}  # the kernel rounds once, SDPA in bf16 more often
    torch.testing.assert_close(got, want, **(tol(dtype) if dtype == torch.float32 else bf16_tol))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_linear_matches_torch(rows, packed):
    """Skinny GEMV (<= 4 rows), oneDNN prepacked, or BLAS: the same product."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=g) for s in ((rows, 77), (133, 77), (133,)))
    cpu = CpuBackend(ops)
    layer = SimpleNamespace(weight=w, bias=b, packed_weight=None)
    if packed:
        assert cpu.prepack(SimpleNamespace(linear_layers=lambda: [layer], backend_cache={}))
        assert layer.packed_weight is not None
    torch.testing.assert_close(cpu.linear(x, layer), TorchBackend().linear(x, layer), atol=1e-4, rtol=1e-5)


class Refusing:
    """A stand-in extension whose every op raises: a backend holding it must not call it."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"C++ op {name} called")
        return refuse


def test_cpu_backend_falls_back_to_torch_where_no_kernel_applies():
    """Shapes the kernels do not take (3-D rows) and tensors on another device go to the torch code."""
    cpu, ref = CpuBackend(Refusing()), TorchBackend()
    x, w = torch.randn(2, 3, 16), torch.randn(16)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(cpu.silu_mul(x), ref.silu_mul(x))
    layer = SimpleNamespace(weight=torch.randn(5, 16), bias=None, packed_weight=None)
    torch.testing.assert_close(cpu.linear(x, layer), ref.linear(x, layer))
    meta_x = torch.empty(3, 16, device="meta")
    assert cpu.rms_norm(meta_x, torch.empty(16, device="meta"), 1e-6).device.type == "meta"
    assert cpu.decode_layers(None, meta_x, meta_x, meta_x, AttentionMetadata(slot_mapping=meta_x), []) is None


# ---- whole model: the runner's two backends, and the reference runs no C++ op --------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("backends"), arch="qwen2", num_heads=4, num_kv_heads=2,
                           num_layers=2, vocab_size=256, tie_word_embeddings=True)
    cfg = load_model_config(path)
    return cfg, load_weights(path, cfg)


def two_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A fresh prefill of two prompts (9 and 5 tokens), then a step of only paged tokens: a decode for the first
    and a 3-token chunk continuing the second. Block size 4: kv_lens 10, 6, 7, 8 cross block boundaries.
    Returns each step's logits."""
    bs, blocks = 4, [[3, 7, 1], [5, 2, 9]]

    def slots(r: int, start: int, end: int) -> list[int]:
        return [blocks[r][p // bs] * bs + p % bs for p in range(start, end)]

    def long(v):
        return torch.tensor(v, dtype=torch.long)

    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        meta = AttentionMetadata(slot_mapping=long(slots(0, 0, 9) + slots(1, 0, 5)), fresh_spans=[(0, 9), (9, 14)])
        h1 = runner.model(torch.cat([ids[0, :9], ids[1, :5]]), long(list(range(9)) + list(range(5))), meta,
                          runner.kv_caches)
        meta = AttentionMetadata(slot_mapping=long(slots(0, 9, 10) + slots(1, 5, 8)), num_paged_tokens=4,
                                 block_tables=long(blocks), q_rows=long([0, 1, 1, 1]), kv_lens=long([10, 6, 7, 8]))
        h2 = runner.model(torch.cat([ids[0, 9:10], ids[1, 5:8]]), long([9, 5, 6, 7]), meta, runner.kv_caches)
        return [runner.model.compute_logits(h) for h in (h1, h2)]


def make_runner(tiny, use_kernel: bool) -> ModelRunner:
    cfg, weights = tiny
    return ModelRunner(cfg, weights, torch.float32, "cpu", num_blocks=12, block_size=4, use_kernel=use_kernel)


def test_reference_runner_runs_no_cpp_op(tiny, monkeypatch):
    def no_extension():
        raise AssertionError("the C++ extension was asked for")

    monkeypatch.setattr(cpu_kernels, "_extension", no_extension)
    if ops is not None:  # and the module already loaded refuses every call
        for name in ("paged_attention", "skinny_linear", "rms_norm", "add_rms_norm", "rotary_write_kv",
                     "silu_mul", "DecoderStack"):
            monkeypatch.setattr(ops, name, Refusing().__getattr__(name))
    runner = make_runner(tiny, use_kernel=False)
    assert type(runner.backend) is TorchBackend and not runner.prepacked
    assert all(m.packed_weight is None for m in runner.model.linear_layers())
    logits = two_steps(runner)
    assert all(torch.isfinite(x).all() for x in logits)


@needs_kernels
def test_kernel_runner_matches_reference_runner(tiny):
    fast, ref = make_runner(tiny, use_kernel=True), make_runner(tiny, use_kernel=False)
    assert isinstance(fast.backend, CpuBackend)
    for got, want in zip(two_steps(fast), two_steps(ref)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the second step was all paged tokens: the CPU backend ran its one-call-per-layer path
    assert fast.model.backend_cache


@needs_kernels
def test_cpu_decode_layers_equals_running_the_modules(tiny, monkeypatch):
    fast = make_runner(tiny, use_kernel=True)
    want = two_steps(fast)
    modules_only = make_runner(tiny, use_kernel=True)
    monkeypatch.setattr(modules_only.backend, "decode_layers", lambda *a: None)
    for got, w in zip(two_steps(modules_only), want):
        assert torch.equal(got, w)  # the same kernels in the same order: the same bits


def test_select_backend(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill")
    assert type(select_backend("cpu", use_kernels=False)) is TorchBackend
    assert type(select_backend("meta")) is TorchBackend
    chosen = select_backend("cpu")
    assert isinstance(chosen, CpuBackend) == (ops is not None)
    select_backend("cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend:")]
    assert len(lines) == len(set(lines))  # each choice said once


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])
def test_auto_dtype_takes_the_faster_of_the_two_packed_kernels(monkeypatch, faster):
    """Where both our bfloat16 and float32 packed kernels run, `auto` follows the measured probe; where the
    bfloat16 kernel does not run, it is float32 whatever a probe would say."""
    from tokenmill.model.backends import auto_dtype, dtype_probe

    slow, quick = 9.0, 1.0
    times = {"bfloat16": quick if faster == "bfloat16" else slow, "float32": quick if faster == "float32" else slow}
    monkeypatch.setattr(dtype_probe, "probe_matmul_ms", lambda ops: times)
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda: None)  # no times kept from an earlier start
    both = ops is not None and bool(ops.bf16_kernel()) and ops.f32_panels_available()
    assert auto_dtype("cpu") == (faster if both else "float32")
    assert auto_dtype("cuda") == "bfloat16"
    # a GGUF file kept on the VNNI kernel computes in float32 (its blocks in bfloat16 flipped the quickstart's
    # answer); AMX's tiles and AVX2's float32 follow the rule above
    vnni = ops is not None and ops.gguf_kernel() == "vnni"
    assert auto_dtype("cpu", gguf=True) == ("float32" if vnni else auto_dtype("cpu"))
    assert auto_dtype("cpu", "none", gguf=True) == auto_dtype("cpu")  # dequantized: no kept blocks


def test_dtype_probe_times_both_kernels():
    from tokenmill.model.backends import dtype_probe

    if ops is None or not ops.bf16_kernel():
        pytest.skip("no packed bfloat16 kernel on this CPU: auto is float32 without a probe (tested above)")
    ms = dtype_probe.probe_matmul_ms(ops)
    assert set(ms) == {"bfloat16", "float32"} and all(0 < v < 10_000 for v in ms.values())


def test_probe_times_are_kept_beside_the_build_and_a_bad_file_is_measured_again(monkeypatch, tmp_path):
    from tokenmill.model.backends import dtype_probe

    calls = []
    monkeypatch.setattr(dtype_probe, "probe_matmul_ms", lambda ops: calls.append(ops) or {"bfloat16": 2.0,
                                                                                          "float32": 3.0})
    assert dtype_probe.measured_ms("ops", tmp_path) == {"bfloat16": 2.0, "float32": 3.0} and len(calls) == 1
    assert dtype_probe.measured_ms("ops", tmp_path) == {"bfloat16": 2.0, "float32": 3.0} and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [dtype_probe.CACHE_NAME]  # no scratch file left
    for bad in ("{", '{"bfloat16": 2.0}', '{"bfloat16": 2.0, "float32": -1.0}'):
        (tmp_path / dtype_probe.CACHE_NAME).write_text(bad)
        assert dtype_probe.measured_ms("ops", tmp_path)["float32"] == 3.0
    assert len(calls) == 4
    assert dtype_probe.measured_ms("ops", None) and len(calls) == 5  # nowhere to keep them: measured each time


@pytest.mark.skipif(ops is None or not ops.bf16_kernel(), reason="bf16_pack needs our bfloat16 kernel")
def test_tied_embedding_reads_its_rows_from_the_heads_tiles(tmp_path):
    from tokenmill.model.backends.cpu_rows import tile_rows

    w = torch.randn(96, 64).bfloat16()
    ids = torch.tensor([[0, 95, 17], [16, 15, 40]])
    assert torch.equal(tile_rows(ops.bf16_pack(w))(ids), w[ids])
    assert torch.equal(tile_rows(ops.bf16_pack(w), ops.tile_rows)(ids), w[ids])  # the C++ gather
    q = torch.randint(-127, 128, (96, 64), dtype=torch.int8)  # int8_pack's tiles: the same order, bytes q + 128
    assert torch.equal((ops.tile_rows(ops.int8_pack(q), ids) ^ 0x80).view(torch.int8), q[ids.reshape(-1)])
    with pytest.raises(RuntimeError, match="row 96 of 96"):
        ops.tile_rows(ops.bf16_pack(w), torch.tensor([96]))
    # a tied bfloat16 model releases its table once the head is packed; the lookups give the same rows
    path = make_tiny_model(tmp_path, tie_word_embeddings=True)
    cfg = load_model_config(path)
    runner = ModelRunner(cfg, load_weights(path, cfg, torch.bfloat16), torch.bfloat16, "cpu", num_blocks=8,
                         block_size=16)
    model = runner.model
    if model.tied_head.packed_weight is None or model.tied_head.packed_weight.dim() != 4:
        pytest.skip("the head is not packed in bfloat16 tiles on this CPU")
    dense = load_weights(path, cfg, torch.bfloat16)["model.embed_tokens.weight"]
    assert model.embed_tokens.weight.is_meta
    assert torch.equal(model.embed_tokens(ids), dense[ids])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_attention_and_writes_match_the_reference(dtype):
    """--kv-cache-dtype fp8: the kernels (vector, and AMX tiles for bfloat16) decode e4m3 codes exactly as torch
    widens them, and write them as torch casts (clamped to +-448), whatever the model's dtype."""
    q, kc, vc, tables, rows, lens, _ = make_paged_batch(5, dtype, 3, 64, 16, contexts_for(16))
    kc8, vc8 = (c.float().clamp(-448, 448).to(torch.float8_e4m3fn) for c in (kc, vc))
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.long), num_paged_tokens=q.shape[0],
                             block_tables=tables, q_rows=rows, kv_lens=lens, fresh_spans=[])
    got = CpuBackend(ops).paged_attention(q, q, q, kc8, vc8, meta)
    want = CpuBackend(ops).paged_attention(q, q, q, kc8.to(dtype), vc8.to(dtype), meta)  # the widened cache
    assert torch.equal(got, want)  # the same kernel (AMX tiles for bfloat16 where they run) on the same values
    torch.testing.assert_close(got, TorchBackend().paged_attention(q, q, q, kc8, vc8, meta),
                               **(tol(dtype) if dtype == torch.float32 else {"atol": 6e-2, "rtol": 5e-2}))
    g = torch.Generator().manual_seed(1)
    heads, kvh, d = 4, 2, 32
    qkv = (torch.randn(9, (heads + 2 * kvh) * d, generator=g) * 100).to(dtype)  # some past +-448
    cos, sin = torch.randn(9, 1, d, generator=g).to(dtype), torch.randn(9, 1, d, generator=g).to(dtype)
    slots = torch.tensor([3, 17, 4, 30, 31, 0, 8, 9, 22])
    caches = [[torch.zeros(2, 16, kvh, d, dtype=torch.float8_e4m3fn) for _ in range(2)] for _ in range(2)]
    for backend, (k8, v8) in zip((CpuBackend(ops), TorchBackend()), caches):
        backend.rotary_and_write_kv(qkv.clone(), heads, kvh, cos, sin, k8, v8, slots)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert not a.float().isnan().any()
