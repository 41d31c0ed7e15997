"""The C++ paged-attention kernel against a per-token PyTorch reference, and each backend's `paged_attention` end
to end (write_kv, paged tokens, fresh prefill spans) against naive causal attention over each request's full K/V."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.backends.reference import write_kv
from tokenmill.model.cpu_kernels import _extension, paged_attention_kernel

NUM_KV_HEADS = 2
PAD_BLOCK_FILL = 100.0  # block 0 (padding) holds loud values: reading it past kv_len changes the result


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, q_rows: torch.Tensor, kv_lens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [P, H, D] -> [P, H, D]: gather each token's context through its block table, mask past kv_len. The
    engine's former torch path (one gather per token): slow, but simple enough to be the oracle here."""
    p, kvh, hd = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    tables = block_tables[q_rows]  # [P, max_blocks]
    keys = k_cache[tables].view(p, -1, kvh, hd).transpose(1, 2)
    values = v_cache[tables].view(p, -1, kvh, hd).transpose(1, 2)
    mask = (torch.arange(keys.shape[2], device=q.device).unsqueeze(0) < kv_lens.unsqueeze(1)).view(p, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


def test_kernel_builds_on_this_machine():
    assert not os.environ.get("TOKENMILL_NO_KERNELS"), "TOKENMILL_NO_KERNELS disables the kernel under test"
    assert paged_attention_kernel() is not None


def make_paged_batch(seed: int, dtype: torch.dtype, group: int, head_dim: int, block_size: int,
                     contexts: list[tuple[int, int]], extra_pad_columns: int = 1, q_gain: float = 2.0):
    """Random caches and a ragged batch. `contexts` holds (context_len, chunk) per request: its last `chunk`
    tokens are queries with kv_lens context_len - chunk + 1 .. context_len (a chunked prefill; chunk 1 is a
    decode). Each request gets random, non-contiguous blocks (never block 0); block tables are padded with
    block 0, plus `extra_pad_columns` all-padding columns."""
    g = torch.Generator().manual_seed(seed)
    heads = NUM_KV_HEADS * group
    max_blocks = max(-(-ctx // block_size) for ctx, _ in contexts) + extra_pad_columns
    num_blocks = 1 + sum(-(-ctx // block_size) for ctx, _ in contexts) + 7  # a few blocks nobody uses
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=g)
    k_cache[0] = PAD_BLOCK_FILL
    v_cache[0] = -PAD_BLOCK_FILL
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, q_rows, kv_lens = [], [], []
    for row, (ctx, chunk) in enumerate(contexts):
        assert 1 <= chunk <= ctx
        n = -(-ctx // block_size)
        blocks, free = free[:n], free[n:]
        tables.append(blocks + [0] * (max_blocks - n))
        q_rows += [row] * chunk
        kv_lens += list(range(ctx - chunk + 1, ctx + 1))
    q = q_gain * torch.randn(len(q_rows), heads, head_dim, generator=g)
    index = [torch.tensor(x, dtype=torch.long) for x in (tables, q_rows, kv_lens)]
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), *index, head_dim ** -0.5)


def contexts_for(block_size: int) -> list[tuple[int, int]]:
    """Decodes and prefill chunks whose kv_lens include 1, exact multiples of the block size and lengths just
    past one, with several query tokens on the same block-table row."""
    bs = block_size
    return [
        (1, 1),  # a one-token prompt: kv_len 1
        (2 * bs, 1),  # a decode ending exactly on a block boundary
        (3 * bs + 1, 1),  # one token into a new block
        (2 * bs + 5, bs + 3),  # a chunk that crosses block boundaries, kv_lens growing by one per token
        (bs, bs),  # a whole first block as one chunk: kv_lens 1..bs
        (17, 4),
    ]


def naive_paged(q, k_cache, v_cache, block_tables, q_rows, kv_lens, scale) -> torch.Tensor:
    """Loop-by-loop float64 attention, independent of both implementations under test."""
    p, heads, hd = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    group = heads // kvh
    out = torch.empty(p, heads, hd, dtype=torch.float64)
    for t in range(p):
        n = int(kv_lens[t])
        table = block_tables[q_rows[t]]
        slots = [int(table[i // bs]) * bs + i % bs for i in range(n)]
        keys = k_cache.reshape(-1, kvh, hd)[slots].double()
        values = v_cache.reshape(-1, kvh, hd)[slots].double()
        for h in range(heads):
            s = keys[:, h // group] @ q[t, h].double() * scale
            out[t, h] = s.softmax(0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 36])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 12])  # 12: past the register-blocked kernels' limit of 8
def test_kernel_matches_reference_float32(group, head_dim, block_size):
    kernel = paged_attention_kernel()
    assert kernel is not None
    args = make_paged_batch(1000 * group + head_dim + block_size, torch.float32, group, head_dim, block_size,
                            contexts_for(block_size))
    got = kernel(*args)
    ref = paged_attention_reference(*args)
    assert got.shape == ref.shape == args[0].shape
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_naive_loop(group, block_size):
    """The reference itself is right (so kernel == reference means kernel == attention)."""
    args = make_paged_batch(7 + group + block_size, torch.float32, group, 64, block_size,
                            contexts_for(block_size))
    torch.testing.assert_close(paged_attention_reference(*args).double(), naive_paged(*args), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_matches_reference_bfloat16(group, head_dim, block_size):
    kernel = paged_attention_kernel()
    args = make_paged_batch(77 + group + head_dim + block_size, torch.bfloat16, group, head_dim, block_size,
                            contexts_for(block_size))
    got = kernel(*args)
    assert got.dtype == torch.bfloat16 and got.shape == args[0].shape
    # The kernel computes in float32 from bf16 inputs and rounds once: within ~1 bf16 ulp of exact.
    exact = paged_attention_reference(*(a.float() if a.is_floating_point() else a for a in args[:6]), args[6])
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)
    # And close to the reference run in bf16 throughout (which rounds more often).
    torch.testing.assert_close(got.float(), paged_attention_reference(*args).float(), atol=6e-2, rtol=5e-2)


def test_kernel_large_scores_are_stable():
    """Scores in the hundreds: an online softmax without the running max would overflow exp."""
    kernel = paged_attention_kernel()
    args = make_paged_batch(3, torch.float32, 2, 64, 16, contexts_for(16), q_gain=60.0)
    got = kernel(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), naive_paged(*args), atol=1e-4, rtol=1e-4)


def test_kernel_ignores_padding_and_unused_blocks():
    """Changing block 0 (padding) and blocks no table references leaves the output bit-identical."""
    kernel = paged_attention_kernel()
    q, kc, vc, tables, rows, lens, scale = make_paged_batch(5, torch.float32, 3, 64, 16, contexts_for(16))
    before = kernel(q, kc, vc, tables, rows, lens, scale)
    used = set(tables[tables != 0].tolist())
    for b in range(kc.shape[0]):
        if b not in used:
            kc[b] = -kc[b] * 3 + 1
            vc[b] = vc[b] * 5 - 2
    after = kernel(q, kc, vc, tables, rows, lens, scale)
    assert torch.equal(before, after)


# ---- paged_attention end to end ---------------------------------------------------------------------------


def naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [n, H, D] at positions offset..offset+n-1 over full k/v [L, KVH, D] (L = offset + n): plain causal
    softmax attention in float64, GQA by repeating each KV head for its group of query heads."""
    heads, kvh = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(heads // kvh, dim=1)
    vv = v.double().repeat_interleave(heads // kvh, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        pos = offset + i
        s = torch.einsum("hd,lhd->hl", q[i].double(), kk[: pos + 1]) * q.shape[-1] ** -0.5
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), vv[: pos + 1])
    return out


BACKENDS = {"cpu": lambda: CpuBackend(_extension()), "torch": TorchBackend}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_end_to_end_equals_full_causal(backend, block_size, group):
    g = torch.Generator().manual_seed(11 + block_size + group)
    heads, hd = NUM_KV_HEADS * group, 64
    # (tokens already in the cache, new tokens this step); computed == 0 and new > 1 is a fresh prefill.
    requests = [(37, 1), (20, 12), (0, 9), (0, 1), (2 * block_size, 1), (0, 16), (block_size, block_size)]
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, hd)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    full = []  # per request: all its K, V, and its new queries
    for computed, new in requests:
        total = computed + new
        n = -(-total // block_size)
        blocks, free = free[:n], free[n:]
        k = torch.randn(total, NUM_KV_HEADS, hd, generator=g)
        v = torch.randn(total, NUM_KV_HEADS, hd, generator=g)
        q = 2 * torch.randn(new, heads, hd, generator=g)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        write_kv(k_cache, v_cache, k[:computed], v[:computed], slots[:computed])  # earlier steps' K/V
        full.append({"computed": computed, "new": new, "blocks": blocks, "k": k, "v": v, "q": q,
                     "slots": slots})

    paged = [r for r in full if r["computed"] > 0 or r["new"] == 1]
    fresh = [r for r in full if r["computed"] == 0 and r["new"] > 1]
    ordered = paged + fresh
    max_blocks = max(len(r["blocks"]) for r in paged)
    tables = torch.tensor([r["blocks"] + [0] * (max_blocks - len(r["blocks"])) for r in paged])
    q_rows = torch.tensor([i for i, r in enumerate(paged) for _ in range(r["new"])])
    kv_lens = torch.tensor([n for r in paged for n in range(r["computed"] + 1, r["computed"] + r["new"] + 1)])
    spans, row = [], len(q_rows)
    for r in fresh:
        spans.append((row, row + r["new"]))
        row += r["new"]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([r["slots"][r["computed"]:] for r in ordered]), num_paged_tokens=len(q_rows),
        block_tables=tables, q_rows=q_rows, kv_lens=kv_lens, fresh_spans=spans)
    q = torch.cat([r["q"] for r in ordered])
    k_new = torch.cat([r["k"][r["computed"]:] for r in ordered])
    v_new = torch.cat([r["v"][r["computed"]:] for r in ordered])

    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    out = BACKENDS[backend]().paged_attention(q, k_new, v_new, k_cache, v_cache, meta)

    assert out.shape == q.shape
    row = 0
    for r in ordered:
        want = naive_causal(r["q"], r["k"], r["v"], r["computed"])
        torch.testing.assert_close(out[row: row + r["new"]].double(), want, atol=1e-5, rtol=1e-5)
        row += r["new"]
        # Every token's K/V, old and new, now sits in the cache at its slot.
        assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, hd)[r["slots"]], r["k"])
        assert torch.equal(v_cache.view(-1, NUM_KV_HEADS, hd)[r["slots"]], r["v"])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_attention_only_paged_tokens_and_only_fresh_spans(backend):
    """The two one-kind batches (all decodes; all fresh prefills) take their short paths correctly."""
    paged_attention = BACKENDS[backend]().paged_attention
    g = torch.Generator().manual_seed(2)
    bs, hd, heads = 16, 64, 4
    k_cache = torch.zeros(8, bs, NUM_KV_HEADS, hd)
    v_cache = torch.zeros_like(k_cache)
    # Only fresh: two prompts of 5 and 3 tokens in blocks 3 and 6.
    k = torch.randn(8, NUM_KV_HEADS, hd, generator=g)
    v = torch.randn(8, NUM_KV_HEADS, hd, generator=g)
    q = torch.randn(8, heads, hd, generator=g)
    slots = torch.tensor([3 * bs + i for i in range(5)] + [6 * bs + i for i in range(3)])
    meta = AttentionMetadata(slot_mapping=slots, fresh_spans=[(0, 5), (5, 8)])
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(out[:5].double(), naive_causal(q[:5], k[:5], v[:5], 0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[5:].double(), naive_causal(q[5:], k[5:], v[5:], 0), atol=1e-5, rtol=1e-5)
    # Only paged: one decode token for each, at positions 5 and 3.
    k2 = torch.randn(2, NUM_KV_HEADS, hd, generator=g)
    v2 = torch.randn(2, NUM_KV_HEADS, hd, generator=g)
    q2 = torch.randn(2, heads, hd, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.tensor([3 * bs + 5, 6 * bs + 3]), num_paged_tokens=2,
                             block_tables=torch.tensor([[3], [6]]), q_rows=torch.tensor([0, 1]),
                             kv_lens=torch.tensor([6, 4]))
    write_kv(k_cache, v_cache, k2, v2, meta.slot_mapping)
    out2 = paged_attention(q2, k2, v2, k_cache, v_cache, meta)
    full_k = [torch.cat([k[:5], k2[:1]]), torch.cat([k[5:], k2[1:]])]
    full_v = [torch.cat([v[:5], v2[:1]]), torch.cat([v[5:], v2[1:]])]
    for i, pos in enumerate([5, 3]):
        want = naive_causal(q2[i:i + 1], full_k[i], full_v[i], pos)
        torch.testing.assert_close(out2[i:i + 1].double(), want, atol=1e-5, rtol=1e-5)


# ---- the bf16 dot-product kernel (csrc/tile_attention.cpp: AMX tiles, else AVX512-BF16): bfloat16 caches, 16-token
# blocks ------------------------------------------------------------------------------------------------------------

TILE_ATTENTION = _extension() is not None and _extension().tile_attention_applies(16, 64, 9, 3)
needs_tiles = pytest.mark.skipif(not TILE_ATTENTION,
                               reason="no AMX or AVX512-BF16 on this CPU: paged attention runs the vector kernel")


def test_tile_attention_applies_where_the_cpu_has_bf16_dot_products():
    ops = _extension()
    assert ops.tile_attention_applies(16, 64, 9, 3) == (ops.bf16_kernel() != "")
    assert ops.amx_attention_applies(16, 64, 9, 3) == (ops.bf16_kernel() == "amx")
    for applies in (ops.tile_attention_applies, ops.amx_attention_applies):
        assert not applies(32, 64, 9, 3)  # tiles hold 16 keys
        assert not applies(16, 80, 8, 2)  # head_dim in 32-element tile rows
        assert not applies(16, 64, 34, 2)  # at most 16 query heads per tile


@needs_tiles
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 4), (64, 1), (32, 16)])
def test_tile_attention_rows_do_not_depend_on_their_tile(head_dim, group):
    """A prefill chunk's tokens share tiles of up to 16 / group tokens; each token's output is bit-identical
    to the token computed alone (a decode), and to the chunk split at other points."""
    kernel = paged_attention_kernel()
    contexts = [(2 * 16 + 5, 19), (40, 1), (16, 16), (70, 33)]
    q, kc, vc, tables, rows, lens, scale = make_paged_batch(11 + group, torch.bfloat16, group, head_dim, 16, contexts)
    together = kernel(q, kc, vc, tables, rows, lens, scale)
    alone = torch.cat([kernel(q[t:t + 1], kc, vc, tables, rows[t:t + 1], lens[t:t + 1], scale)
                       for t in range(q.shape[0])])
    assert torch.equal(together, alone)
    split = torch.cat([kernel(q[a:b], kc, vc, tables, rows[a:b], lens[a:b], scale)
                       for a, b in ((0, 7), (7, 20), (20, 38), (38, q.shape[0]))])
    assert torch.equal(together, split)
    exact = naive_paged(q, kc, vc, tables, rows, lens, scale)
    torch.testing.assert_close(together.double(), exact, atol=2e-2, rtol=1e-2)


@needs_tiles
def test_tile_attention_agrees_with_the_vector_kernel():
    """Tiles round the probabilities to bfloat16 before P.V (as PyTorch's CPU flash attention does); the vector
    kernel keeps them in float32. Both stay within a bfloat16 rounding or two of each other."""
    ops = _extension()
    args = make_paged_batch(31, torch.bfloat16, 3, 64, 16, contexts_for(16))
    tiles, vectors = ops.paged_attention(*args), ops.paged_attention_vectors(*args)
    assert not torch.equal(tiles, vectors)  # really two kernels
    torch.testing.assert_close(tiles.float(), vectors.float(), atol=2e-2, rtol=2e-2)


@needs_tiles
def test_tile_attention_never_reads_stale_slots_of_a_partial_block():
    """Cache slots past kv_len in a request's last block hold whatever was there (here NaN and huge values):
    the output does not change."""
    kernel = paged_attention_kernel()
    q, kc, vc, tables, rows, lens, scale = make_paged_batch(21, torch.bfloat16, 3, 64, 16, [(21, 5), (35, 1)])
    before = kernel(q, kc, vc, tables, rows, lens, scale)
    for row, ctx in ((0, 21), (1, 35)):
        block = int(tables[row, (ctx - 1) // 16])
        kc[block, ctx % 16:] = float("nan")
        vc[block, ctx % 16:] = float("nan")
    assert torch.equal(kernel(q, kc, vc, tables, rows, lens, scale), before)
    kc[int(tables[1, 2]), 3:] = 3e38
    assert torch.equal(kernel(q, kc, vc, tables, rows, lens, scale), before)


@needs_tiles
def test_tile_attention_large_scores_are_stable():
    kernel = paged_attention_kernel()
    args = make_paged_batch(3, torch.bfloat16, 3, 64, 16, contexts_for(16), q_gain=60.0)
    got = kernel(*args)
    assert torch.isfinite(got.float()).all()
    exact = naive_paged(*(a.float() if a.is_floating_point() else a for a in args[:6]), args[6])
    torch.testing.assert_close(got.double(), exact, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_work_split_over_threads_changes_no_output(dtype):
    """The threads share tiles by cost (a long context's tokens weigh more than a short one's), not by count: with
    contexts from 1 token to 40 blocks, each thread count from 1 to 3 gives every row, bit for bit, and each
    matches the reference (no tile dropped or computed twice)."""
    kernel = paged_attention_kernel()
    contexts = [(1 + 37 * i, 1) for i in range(18)] + [(640, 40), (90, 90), (3, 2)]
    args = make_paged_batch(5, dtype, 3, 64, 16, contexts)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel(*args))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].double(), naive_paged(*args), atol=2e-2, rtol=1e-2)
