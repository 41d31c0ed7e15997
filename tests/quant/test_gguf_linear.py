"""GGUF blocks kept at run time (quant/gguf_linear.py, model/backends/gguf_tiles.py, csrc/gguf_linear.cpp,
csrc/gguf_vnni.cpp, csrc/gguf_avx2.cpp): the tile kernel widens blocks to exactly the bfloat16 weights the
dequantize-at-load path loads, so every output is bit for bit the dequantized model's; the VNNI kernel (no AMX)
and the AVX2 one multiply them with x rounded in two int8 blocks (its int8 blocks, then those of what they left), so
their outputs track the dequantized model's to that rounding (and agree with each other bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from tests.model.test_loader import _tiny_gguf
from tests.quant.common import assert_kept_tracks_dense
from tokenmill import LLM, SamplingParams
from tokenmill.formats.awq_format import quantize_groups
from tokenmill.formats.gguf_blocks import Q4_Z, dequantize
from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.backends.cpu_decode import decode_model
from tokenmill.model.backends.gguf_tiles import gguf_pack, gguf_unpack_rows, kernel_dtypes, kernel_layout
from tokenmill.model.cpu_kernels import _extension, cpu_isa

ops = _extension()
TILES = ops is not None and ops.bf16_kernel() != ""  # AMX tiles or AVX512-BF16
needs_tiles = pytest.mark.skipif(not TILES,
                                 reason="the block tile kernel runs on AMX or AVX512-BF16; elsewhere the reference")
KEPT = ops.gguf_kernel() if ops is not None else ""  # amx, vnni, avx2, or "" (the reference)
LAYOUT = kernel_layout(KEPT, T.Q4_1)  # the layout of the types every kernel reads (Q4_0, Q4_1, Q8_0, Q4_Z)
needs_kept = pytest.mark.skipif(not KEPT, reason="no kept-block kernel here (AMX or AVX512-VNNI); the reference")
# the VNNI kernel is built wherever AVX512-VNNI is: an AMX CPU serves the K-quants and Q5_0 on it
needs_vnni = pytest.mark.skipif(KEPT not in ("vnni", "amx"), reason="the VNNI kernel is built where AVX512-VNNI is")
# the AVX2 kernel is built wherever AVX2 is (the VNNI machines' float32 rows take it too)
AVX2 = ops is not None and "avx2" in cpu_isa().split()
needs_avx2 = pytest.mark.skipif(not AVX2, reason="the AVX2 kernel is built where the CPU has AVX2")
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
TILE_TYPES = [*TYPES, Q4_Z]  # and AWQ's groups (formats/awq_format.py), which no GGUF file holds
KV = 64 << 20


def blocks_of(w: torch.Tensor, qtype: T | int) -> torch.Tensor:
    """w [N, K] in GGML blocks, as llama.cpp's converter writes them: [N, K/32 * block bytes] uint8 (Q4_Z: AWQ's
    groups of 32)."""
    if qtype == Q4_Z:
        return quantize_groups(w, 32).to_blocks().data
    raw = quants.quantize(w.numpy(), qtype)
    return torch.from_numpy(raw).view(w.shape[0], -1)


@needs_tiles
@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 33, 100])
def test_kept_blocks_multiply_as_the_dequantized_weight_bit_for_bit(qtype, m):
    g = torch.Generator().manual_seed(m)
    n, k = 80, 96
    raw = blocks_of(torch.randn(n, k, generator=g) * 0.05, qtype)
    dense = dequantize(raw, qtype, (n, k), torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = gguf_pack(raw, qtype)
    assert packed.shape == (n // 16, k // 32, ops.gguf_tile_bytes(qtype))
    for b in (None, bias):
        assert torch.equal(ops.gguf_tiles_linear(x, packed, b), ops.bf16_linear(x, ops.bf16_pack(dense), b))


@needs_tiles
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_kept_gate_up_pairs_apply_silu_as_the_dequantized_pairs(qtype):
    g = torch.Generator().manual_seed(5)
    i, k = 48, 64
    raw = blocks_of(torch.randn(2 * i, k, generator=g) * 0.05, qtype)
    dense = dequantize(raw, qtype, (2 * i, k), torch.bfloat16)
    x = torch.randn(21, k, generator=g).to(torch.bfloat16)
    pairs = gguf_pack(raw, qtype, pairs=True)
    assert pairs.shape == (i // 16, 2, k // 32, ops.gguf_tile_bytes(qtype))
    assert torch.equal(ops.gguf_tiles_linear_silu(x, pairs), ops.bf16_linear_silu(x, ops.bf16_pack_gate_up(dense)))


@needs_kept
@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_kept_gate_up_pairs_give_the_plain_product_and_silu_on_this_cpus_kernel(qtype):
    g = torch.Generator().manual_seed(6)
    i, k = 48, 64
    raw = blocks_of(torch.randn(2 * i, k, generator=g) * 0.05, qtype)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    plain = ops.gguf_linear(x, gguf_pack(raw, qtype, layout=LAYOUT), None)
    pairs = gguf_pack(raw, qtype, pairs=True, layout=LAYOUT)
    assert torch.equal(ops.gguf_linear_silu(x, pairs), ops.silu_mul(plain))
    backend = CpuBackend(ops, ops.bf16_kernel(), gguf_kernel=KEPT)
    assert torch.equal(backend.gguf_linear(x, SimpleNamespace(packed_weight=pairs, bias=None)), plain)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as csrc/gguf_vnni.cpp rounds it: per block of 32, to int8 steps of max|x| / 127 (float32 math)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # a true division (127 / t is 127 * (1 / t))
    return (torch.round(blocks * inv) * (amax / 127)).view(m, k)


def split_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernels see it (csrc/gguf_quads.h quantize_rows): its int8 blocks plus the int8 blocks of what
    they left (the residual in double, as the kernel's one-rounding x - q dx keeps it)."""
    high = int8_blocks(x)
    return high.double() + int8_blocks((x.double() - high.double()).float()).double()


@needs_vnni
@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 100])
def test_vnni_kernel_is_the_dequantized_weight_times_x_in_two_int8_blocks(qtype, m):
    g = torch.Generator().manual_seed(m + 11)
    n, k = 80, 96
    raw = blocks_of(torch.randn(n, k, generator=g) * 0.05, qtype)
    dense = dequantize(raw, qtype, (n, k), torch.float32)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[0, 32:64] = 0  # an all-zero block: scale 0, no division by it
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = gguf_pack(raw, qtype, layout="quads")
    assert packed.shape == (n // 16, k // 32, ops.gguf_tile_bytes(qtype))
    for b in (None, bias):
        exact = F.linear(split_int8_blocks(x), dense.double(), None if b is None else b.double())
        # integer block sums are exact; float32 scaling and one bfloat16 rounding of the result remain
        torch.testing.assert_close(ops.gguf_vnni_linear(x, packed, b).double(), exact, rtol=2 ** -8, atol=1e-4)


@needs_vnni
def test_vnni_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    raw = blocks_of(torch.randn(96, 576, generator=g) * 0.05, T.Q4_1)
    packed = gguf_pack(raw, T.Q4_1, layout="quads")
    x = torch.randn(77, 576, generator=g).to(torch.bfloat16)
    alone = torch.cat([ops.gguf_vnni_linear(x[i:i + 1], packed, None) for i in range(77)])
    for m in (2, 4, 5, 7, 8, 9, 16, 37, 63, 64, 77):  # blocks of 4 rows below 8, of 8 from there
        assert torch.equal(ops.gguf_vnni_linear(x[:m], packed, None), alone[:m])
    order = torch.randperm(77, generator=g)
    assert torch.equal(ops.gguf_vnni_linear(x[order], packed, None), alone[order])


@needs_kept
@pytest.mark.parametrize("m", [1, 8, 64])
def test_column_split_over_threads_changes_no_output(m):
    """The threads take column pairs in guided chunks, a share of what is left each (csrc/tile_gemm.h): with 1, 2
    and 3 threads every output is the same bit for bit, and matches the dense product (no pair dropped or computed
    twice), over 37 column blocks (the last pair 16 wide); the bfloat16 tiles too, where they run."""
    g = torch.Generator().manual_seed(m)
    n, k = 16 * 37, 576
    raw = blocks_of(torch.randn(n, k, generator=g) * 0.05, T.Q4_1)
    dense = dequantize(raw, T.Q4_1, (n, k), torch.bfloat16)
    packed, dense_packed = gguf_pack(raw, T.Q4_1, layout=LAYOUT), ops.bf16_pack(dense) if TILES else None
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    kept, tiles = [], []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            kept.append(ops.gguf_linear(x, packed, None))
            if TILES:
                tiles.append(ops.bf16_linear(x, dense_packed, None))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(kept[0], other) for other in kept[1:])
    assert all(torch.equal(tiles[0], other) for other in tiles[1:])
    exact = F.linear(x.float(), dense.float())
    torch.testing.assert_close(kept[0].float(), exact, atol=0.05, rtol=0.05)  # bfloat16 output
    if TILES:
        torch.testing.assert_close(tiles[0].float(), exact, atol=2e-2, rtol=1e-2)


def test_reference_gguf_linear_is_the_dequantized_product():
    g = torch.Generator().manual_seed(2)
    raw = blocks_of(torch.randn(40, 64, generator=g), T.Q4_1)
    layer = SimpleNamespace(gguf_blocks=raw, gguf_type=int(T.Q4_1), bias=None, in_features=64)
    x = torch.randn(3, 64, generator=g)
    ref = F.linear(x, dequantize(raw, T.Q4_1, (40, 64)))
    torch.testing.assert_close(TorchBackend().gguf_linear(x, layer), ref)


@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("layout", ["tiles", "quads"])
@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.skipif(ops is None, reason="no kernels"))])
def test_unpacked_rows_are_the_packed_rows_blocks(qtype, layout, kernel):
    """A tied embedding reads its rows from the LM head's packed copy: the bytes must be the file's (the byte
    gather in torch ops and in C++)."""
    g = torch.Generator().manual_seed(5)
    raw = blocks_of(torch.randn(48, 96, generator=g), qtype)
    packed = gguf_pack(raw, qtype, layout=layout)
    ids = torch.tensor([0, 5, 17, 47, 5, 31, 16, 15])
    gather = ops.gather_tile_bytes if kernel else None
    assert torch.equal(gguf_unpack_rows(packed, int(qtype), ids, layout, gather), raw[ids])
    assert gguf_unpack_rows(packed, int(qtype), ids[:0], layout, gather).shape == (0, raw.shape[1])
    if kernel:
        with pytest.raises(RuntimeError, match="row 48 of 48"):
            gguf_unpack_rows(packed, int(qtype), torch.tensor([48]), layout, gather)
    with pytest.raises(ValueError, match="without pairs"):
        gguf_unpack_rows(gguf_pack(raw[:32], qtype, pairs=True, layout=layout), int(qtype), ids, layout)


@pytest.mark.skipif(ops is None, reason="no kernels")
@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_decoded_in_cpp_are_the_decoders_bits(qtype, dtype):
    """A kept embedding's lookup decodes its blocks in C++ (ops.gguf_decode_rows): every value must be the one
    formats/gguf_blocks.py's decoders give, in float32 and after its rounding to the model's dtype."""
    from tokenmill.formats.gguf_blocks import decode_rows
    from tokenmill.model.backends.cpu_rows import DECODED_IN_CPP, gguf_tile_rows

    g = torch.Generator().manual_seed(7)
    raw = blocks_of(torch.randn(48, 96, generator=g) * 3, qtype)
    out = torch.empty(raw.shape[0], 96, dtype=dtype)
    ops.gguf_decode_rows(raw, int(qtype), out)
    assert torch.equal(out, decode_rows(raw, int(qtype), 96, dtype))
    assert int(qtype) in DECODED_IN_CPP
    packed = gguf_pack(raw, qtype, layout="quads")
    ids = torch.tensor([[3, 47], [16, 0]])
    lookup = gguf_tile_rows(packed, int(qtype), "quads", dtype, ops.gather_tile_bytes, ops.gguf_decode_rows)
    assert torch.equal(lookup(ids), decode_rows(raw, int(qtype), 96, dtype)[ids])
    with pytest.raises(RuntimeError, match="not 3 blocks"):
        ops.gguf_decode_rows(raw[:, :-1].contiguous(), int(qtype), out)
    with pytest.raises(RuntimeError, match="not type 6"):
        ops.gguf_decode_rows(raw, 6, out)


def test_gguf_pack_needs_whole_tiles():
    raw = blocks_of(torch.randn(24, 32), T.Q8_0)
    with pytest.raises(ValueError, match="16-feature tiles"):
        gguf_pack(raw, T.Q8_0)


@needs_kept
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.skipif(
    torch.float32 not in kernel_dtypes(KEPT), reason="AMX's tiles widen to bfloat16 only"))])
def test_tiny_gguf_kept_tracks_the_dequantized_model(tmp_path, qtype, dtype):
    """Token for token and logprob for logprob on AMX; to int8 rounding of x on VNNI and AVX2 (which float32 models
    take: the whole path, prepack, the C++ decode model, gate/up pairs and the head's row lookups, in float32)."""
    path, _, _ = _tiny_gguf(tmp_path, "llama", qtype, num_heads=4, num_kv_heads=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    g = torch.Generator().manual_seed(0)
    batch = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (5, 19, 40)]
    tokenizer = str(tmp_path / "tiny-llama-0")  # the tiny GGUF carries no vocabulary; its source directory does
    dense = LLM(str(path), tokenizer=tokenizer, dtype=dtype, quantization="none", kv_cache_memory=KV)
    kept = LLM(str(path), tokenizer=tokenizer, dtype=dtype, quantization="gguf", kv_cache_memory=KV)
    layer = kept.engine.core.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.packed_weight.dtype == torch.uint8
    assert layer.mlp.gate_up_proj.packed_weight.dim() == 4  # gate/up pairs with SiLU in the epilogue
    assert kept.engine.core.runner.model.tied_head.packed_weight.dtype == torch.uint8
    model = kept.engine.core.runner.model
    assert model.embed_tokens.weight.is_meta  # lookups decode the kept rows ...
    # ... from the head's packed copy (the file's table is not held a second time), as the dense table has them
    held = [c.cell_contents for c in model.embed_tokens.rows.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert held and all(t.untyped_storage().data_ptr() == model.tied_head.packed_weight.untyped_storage().data_ptr()
                        for t in held)
    ids = torch.tensor([[0, 3, 255], [17, 17, 100]])
    assert torch.equal(model.embed_tokens(ids), dense.engine.core.runner.model.embed_tokens(ids))
    assert_kept_tracks_dense(dense.generate(batch, params, use_tqdm=False),
                             kept.generate(batch, params, use_tqdm=False), exact=KEPT == "amx")
    # whole decode steps in C++, kept head included; but a 4-bit head in AMX's tiles (its nibbles regrouped: no
    # one-gather row lookup, backends/cpu_rows.py) leaves its steps' lookups to Python
    regrouped = kernel_layout(KEPT, qtype) == "tiles" and qtype in (T.Q4_0, T.Q4_1)
    assert (decode_model(ops, model, torch.tensor([1])) is not None) == (not regrouped)
    kept.engine.core.check_idle_invariants()


def test_float_gguf_with_gguf_quantization_stays_dense(tmp_path):
    path, _, _ = _tiny_gguf(tmp_path, "llama", T.F32, num_heads=4, num_kv_heads=2)
    llm = LLM(str(path), tokenizer=str(tmp_path / "tiny-llama-0"), dtype="float32", quantization="gguf",
              kv_cache_memory=KV)
    model = llm.engine.core.runner.model
    assert all(getattr(m, "gguf_type", None) is None for m in model.linear_layers())
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@needs_kept
def test_smollm2_kept_blocks_track_the_dequantized_model(tmp_path):
    """The embedded default: Q4_1 layers and a Q8_0 embedding that is also the LM head."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):", "Owls are birds that"]
    dense = LLM(dtype="bfloat16", quantization="none", kv_cache_memory=KV)
    kept = LLM(dtype="bfloat16", kv_cache_memory=KV)  # the default where the kernel runs
    assert "gguf" in kept.engine.core.runner.weight_summary()
    from tokenmill.engine.runner import weight_bytes

    # Q4_1 layers and the Q8_0 table, held once (the lookups read the packed head): under 0.4 of the dequantized
    # model's bytes (whose table is held once too: its lookups read the packed head's tiles)
    assert weight_bytes(kept.engine.core.runner.model) < 0.4 * weight_bytes(dense.engine.core.runner.model)
    assert_kept_tracks_dense(dense.generate(prompts, params, use_tqdm=False),
                             kept.generate(prompts, params, use_tqdm=False), exact=KEPT == "amx")


def test_gguf_blocks_are_kept_by_default_only_where_their_kernel_runs(tmp_path):
    from tokenmill.model.loader import default_model_path
    from tokenmill.quant.methods import resolve_quantization

    gguf = default_model_path()
    assert resolve_quantization(None, gguf, torch.bfloat16, "cpu") == ("gguf" if KEPT else None)
    # float32 kept by default where the int8 kernels take its rows in two parts (AVX2, VNNI; not AMX's bfloat16
    # tiles); float32 asked for by name is the dequantized reference on every CPU
    assert resolve_quantization(None, gguf, torch.float32, "cpu") == ("gguf" if KEPT in ("avx2", "vnni") else None)
    assert resolve_quantization(None, gguf, torch.float32, "cpu", dtype_asked=True) is None
    assert resolve_quantization("gguf", gguf, torch.float32, "cpu") == "gguf"
    assert resolve_quantization("gguf", gguf, torch.float32, "cpu", dtype_asked=True) == "gguf"
    assert resolve_quantization(None, tmp_path, torch.bfloat16, "cpu") is None  # a Hugging Face directory
    assert resolve_quantization("none", gguf, torch.bfloat16, "cpu") is None
    assert resolve_quantization("int8", gguf, torch.bfloat16, "cpu") == "int8"
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match="not a .gguf file"):
        resolve_quantization("gguf", tmp_path, torch.bfloat16, "cpu")
