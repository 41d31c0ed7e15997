"""Context parallelism: the log-sum-exp arithmetic alone; ring attention and the sharded-cache attention over real
gloo ranks against full attention (odd lengths, several sequences, across block boundaries); then the engine with C
ranks against one process, greedy and float32 token for token (chunked prefill, prefix caching, preemption, n > 1,
first chunks by ring attention or through the cache), a context one rank's KV memory cannot hold, a rank killed
mid-request, and layouts refused at start-up."""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import socket

import pytest
import torch
import torch.nn.functional as F

from tests.models.tiny import make_tiny_model
from tests.parallel.test_tensor_parallel import (
    dying_rank_stops_the_engine,
    prompts,
    run,
    smollm2,
    smollm2_requests,
)
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.admission import ContextLimits, admit
from tokenmill.engine.core import EngineCore
from tokenmill.errors import ConfigError, ContextTooLong
from tokenmill.model.attention import AttentionMetadata
from tokenmill.parallel import ring
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


# ---- the arithmetic --------------------------------------------------------------------------------------------
def full_attention(q, k, v, mask, scale):
    """The reference: one softmax over every visible key (grouped queries expanded)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_partial_attentions_over_split_keys_merge_to_full_attention(pieces, monkeypatch):
    monkeypatch.setattr(ring, "MAX_SCORES", 300)  # several query tiles
    g = torch.Generator().manual_seed(pieces)
    q, k, v = torch.randn(23, 6, 8, generator=g), torch.randn(41, 2, 8, generator=g), torch.randn(41, 2, 8, generator=g)
    mask = torch.rand(23, 41, generator=g) < 0.6
    mask[:, 0] = True  # every query sees some key
    cuts = torch.linspace(0, 41, pieces + 1).long().tolist()
    parts = [ring.partial_attention(q, k[a:b], v[a:b], mask[:, a:b], 0.3) for a, b in itertools.pairwise(cuts)]
    out, lse = ring.merge_many(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
    torch.testing.assert_close(out, full_attention(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)
    group_k = k.repeat_interleave(3, dim=1)
    scores = (torch.einsum("qhd,khd->qhk", q, group_k) * 0.3).masked_fill(~mask.unsqueeze(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu", "plain-torch"])
def test_both_paths_agree_with_full_attention_and_blind_rows(fused, monkeypatch):
    monkeypatch.setattr(ring, "_fused", lambda q: fused and q.device.type == "cpu")
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(9, 6, 8, generator=g), torch.randn(12, 3, 8, generator=g), torch.randn(12, 3, 8, generator=g)
    mask = torch.rand(9, 12, generator=g) < 0.5
    mask[:, 3], mask[4] = True, False  # row 4 sees nothing
    out, lse = ring.partial_attention(q, k, v, mask, 0.4)
    seen = torch.arange(9) != 4
    torch.testing.assert_close(out[seen], full_attention(q, k, v, mask, 0.4)[seen], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and (lse[4] == float("-inf")).all()


@pytest.mark.parametrize("strict", [False, True])
def test_a_causal_hop_is_the_masked_attention_it_stands_for(strict):
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g)
    mask = torch.ones(7, 8, dtype=torch.bool).tril(-1 if strict else 0)
    want_out, want_lse = ring._masked_attention(q, k, v, mask, 0.5)
    out, lse = ring.causal_attention(q, k, v, 0.5, strict)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)  # -inf where a row sees nothing, on both


def test_a_piece_with_no_visible_key_is_the_identity_of_merge():
    q, k, v = torch.randn(3, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    out, lse = ring.partial_attention(q, k, v, torch.zeros(3, 5, dtype=torch.bool), 1.0)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()
    o2, s2 = ring.partial_attention(q, k, v, torch.ones(3, 5, dtype=torch.bool), 1.0)
    merged, merged_lse = ring.merge(out, lse, o2, s2)
    torch.testing.assert_close(merged, o2)
    torch.testing.assert_close(merged_lse, s2)


# ---- ring attention and the sharded cache over real ranks ----------------------------------------------------------
def _rank_main(rank: int, size: int, init: str, lengths: list[int], cached: list[int], block: int,
               replicate: bool, queue) -> None:
    """One rank: the step's fresh sequences by ring attention, then paged queries (`cached[i]` tokens of sequence i
    already in the caches, its rest new; striped over the ranks or all on each) over the sharded caches; rank 0
    puts both outputs in the queue."""
    from tokenmill.model.backends.reference import write_kv
    from tokenmill.parallel.context import ContextParallel, shard_step
    from tokenmill.parallel.group import RankGroup

    group = RankGroup(rank, size, init, "gloo", timeout_s=60)
    try:
        cp = ContextParallel(group, block, num_blocks=63)  # block 63: the spare
        heads, kvh, dim = 4, 2, 8
        g = torch.Generator().manual_seed(0)  # the same tensors on every rank
        total = sum(lengths)
        q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kvh, kvh))
        # fresh: every sequence's whole prompt in one step
        positions = torch.cat([torch.arange(n) for n in lengths])
        spans, row = [], 0
        for n in lengths:
            spans.append((row, row + n))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.zeros(total, dtype=torch.long), fresh_spans=spans)
        _, _, local = shard_step(cp, torch.zeros(total, dtype=torch.long), positions, meta)
        mine = local.context.rows[rank]
        ring_out = local.context.ring_attention(q[mine], k[mine], v[mine], dim ** -0.5)
        fresh = group.gather_rows_to_driver(ring_out, local.context.rows, total)
        # paged: each sequence's K/V in the caches (blocks 3, 5, ... in a virtual block table), queries for its
        # last len - cached tokens
        blocks_per_seq = math.ceil(max(lengths) / (block * size))
        caches = [torch.zeros(64, block, kvh, dim) for _ in range(2)]
        slots, tables, q_rows, q_pos, q_idx = [], [], [], [], []
        for i, (n, (start, _)) in enumerate(zip(lengths, spans)):
            table = [3 + 2 * (i * blocks_per_seq + b) for b in range(blocks_per_seq)]
            tables.append(table)
            slots += [table[p // (block * size)] * block * size + p % (block * size) for p in range(n)]
            q_rows += [i] * (n - cached[i])
            q_pos += list(range(cached[i], n))
            q_idx += list(range(start + cached[i], start + n))
        # first write every token's K/V where this rank keeps it (as the model's layers do for their own rows)
        all_pos = torch.cat([torch.arange(n) for n in lengths])
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_paged_tokens=total,
                                 block_tables=torch.tensor(tables), q_rows=torch.tensor(
                                     [i for i, n in enumerate(lengths) for _ in range(n)]),
                                 kv_lens=all_pos + 1)
        _, _, local = shard_step(cp, torch.zeros(total, dtype=torch.long), all_pos, meta)
        mine = local.context.rows[rank]
        write_kv(caches[0], caches[1], k[mine], v[mine], local.slot_mapping)
        # then the paged queries alone
        p = len(q_idx)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots)[q_idx], num_paged_tokens=p,
                                 block_tables=torch.tensor(tables), q_rows=torch.tensor(q_rows),
                                 kv_lens=torch.tensor(q_pos) + 1)
        _, _, local = shard_step(cp, torch.zeros(p, dtype=torch.long), torch.tensor(q_pos), meta, replicate)
        shard = local.context
        paged_out = shard.attend_paged(q[q_idx][shard.rows[rank]], *caches, dim ** -0.5)
        paged = group.gather_rows_to_driver(paged_out[shard.sent_from:], shard.sent, p)
        if rank == 0:
            queue.put((fresh, paged, q_idx))
    finally:
        group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size, lengths, cached, replicate", [
    (2, [1, 7, 33], [0, 3, 17], False),  # a one-token sequence, odd lengths, cached parts that end mid-block
    (2, [1, 7, 33], [0, 6, 31], True),  # decode-like: each rank computes every paged query
    (3, [2, 29, 16, 5], [1, 28, 0, 4], False),  # three ranks: some own no token of a sequence
])
def test_ring_and_sharded_cache_attention_match_full_attention(size, lengths, cached, replicate):
    ctx = mp.get_context("spawn")
    queue, init = ctx.Queue(), f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, size, init, lengths, cached, 4, replicate, queue)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        fresh, paged, q_idx = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8, generator=g) for h in (4, 2, 2))
    expected, row = torch.empty_like(q), 0
    for n in lengths:  # causal attention within each sequence
        expected[row:row + n] = full_attention(q[row:row + n], k[row:row + n], v[row:row + n],
                                               torch.ones(n, n, dtype=torch.bool).tril(), 8 ** -0.5)
        row += n
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged, expected[q_idx], rtol=1e-5, atol=1e-5)


# ---- the engine ----------------------------------------------------------------------------------------------------
def core(model, cp: int, *, chunk: int = 2048, num_blocks: int | None = None, prefix: bool = True,
         batch_invariant: bool = True, headroom: float = 0.7, max_len: int | None = None) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), dtype="float32", quantization="none", context_parallel_size=cp,
                                   num_threads=1,
                                   batch_invariant=batch_invariant,
                                   cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4, num_blocks=num_blocks,
                                                     enable_prefix_caching=prefix),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=chunk, new_token_ratio=headroom,
                                                             max_model_len=max_len)))


def same_as_one_process(model, cp: int, requests, ref_kw=None, replicate_max: int | None = None,
                        check=None, **kw) -> EngineCore:
    ref = run(core(model, 1, **(ref_kw or kw)), requests)
    engine = core(model, cp, **kw)
    if replicate_max is not None:  # rank 0 decides, per step, whether every rank computes the paged rows
        engine.runner.cp.replicate_max = replicate_max
    try:
        assert run(engine, requests) == ref
        if check is not None:
            check(engine)
    finally:
        engine.close()
    return engine


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cp"), num_heads=4, num_kv_heads=2, vocab_size=256)


def mixed_requests():
    shared = prompts(1, (41,), seed=1)[0]
    requests = {f"g{i}": (p, GREEDY) for i, p in enumerate(prompts(4, (1, 6, 37, 70)))}
    requests |= {f"s{i}": (shared + [7 + i], GREEDY) for i in range(2)}  # the second hits the first's blocks
    requests |= {f"n#{i}": (shared, SamplingParams(max_tokens=8, temperature=1.0, seed=3 + i, ignore_eos=True))
                 for i in range(2)}
    return requests


@pytest.mark.parametrize("batch_invariant, replicate_max", [(True, 0), (True, 32), (False, 0), (False, 32)],
                         ids=["through-the-cache", "through-the-cache-decodes-replicated", "ring",
                              "ring-decodes-replicated"])
def test_two_ranks_give_one_process_output_with_chunks_prefix_hits_and_samples(gqa, batch_invariant, replicate_max):
    same_as_one_process(gqa, 2, mixed_requests(), chunk=16, batch_invariant=batch_invariant,
                        replicate_max=replicate_max)


def test_two_ranks_over_gloo_alone(gqa, monkeypatch):
    """Without the shared-memory collectives (as across hosts): the same output."""
    monkeypatch.setenv("TOKENMILL_SHM_COLLECTIVES", "0")  # the worker ranks inherit it
    def over_gloo(engine: EngineCore) -> None:
        assert engine.executor.ranks.group.local is None

    same_as_one_process(gqa, 2, mixed_requests(), chunk=16, replicate_max=0, check=over_gloo)


def test_three_ranks_with_whole_prompts_in_one_step(gqa):
    engine = same_as_one_process(gqa, 3, mixed_requests(), batch_invariant=False)
    assert "context parallel: 3 ranks" in engine.startup_summary()


def test_two_ranks_preempt_and_recompute_to_the_same_output(gqa):
    requests = {f"r{i}": (p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts(3, (30,), seed=2))}
    # 20 blocks of 8 tokens (4 on each rank) against one process's 40 blocks of 4: the same token capacity
    engine = same_as_one_process(gqa, 2, requests, ref_kw={"num_blocks": 40, "prefix": False, "headroom": 0.0},
                                 num_blocks=20, prefix=False, headroom=0.0)
    assert engine.scheduler.num_preemptions > 0


def test_a_context_one_rank_cannot_hold_serves_on_two(gqa):
    """8 blocks of 4 tokens per rank: one rank holds 32 tokens, two ranks 64; a 50-token prompt and its 12 tokens
    fit only across two (and give what one process with room for them gives)."""
    prompt = prompts(1, (50,), seed=4)[0]

    def admitted(engine: EngineCore) -> int:
        limits = ContextLimits(64, 256, engine.cache_info.token_capacity)
        return admit(prompt, 12, limits)

    alone = core(gqa, 1, num_blocks=8, max_len=64)
    with pytest.raises(ContextTooLong, match="capacity of 32 tokens.*--context-parallel-size"):
        admitted(alone)
    engine = same_as_one_process(gqa, 2, {"r": (prompt, GREEDY)}, ref_kw={"max_len": 64}, num_blocks=8, max_len=64)
    assert admitted(engine) == 12 and engine.cache_info.token_capacity == 64


def test_a_rank_that_dies_mid_request_stops_the_engine_within_seconds(gqa):
    dying_rank_stops_the_engine(core(gqa, 2, chunk=8))


def test_layouts_are_refused_naming_the_flag(gqa):
    with pytest.raises(ConfigError, match="--context-parallel-size does not combine with --tensor-parallel-size"):
        EngineConfig(context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size must be an integer in"):
        EngineConfig(context_parallel_size=0)
    with pytest.raises(ConfigError, match="do not combine with --speculative-config"):
        EngineConfig(context_parallel_size=2, speculative={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_smollm2_on_two_ranks_gives_one_process_greedy_output():
    requests = smollm2_requests()
    ref = run(smollm2(), requests)
    cp2 = smollm2(context_parallel_size=2)
    try:
        assert run(cp2, requests) == ref
        # `tokenmill plan --cp 2` and the engine agree per rank: half of each token's KV, the whole weights
        from tokenmill.cli import build_parser
        from tokenmill.plan import build_report

        plan = build_report(build_parser().parse_args(
            ["plan", "--gpu", "cpu", "--cp", "2", "--dtype", "fp32", "--kv-dtype", "fp32"])).plan
        assert cp2.cache_info.kv_bytes_per_token / 2 == plan.kv_bytes_per_token_per_gpu
        params = sum(p.numel() * p.element_size() for p in cp2.runner.model.parameters())
        assert abs(params - plan.weights_bytes_per_gpu) / plan.weights_bytes_per_gpu < 0.005
    finally:
        cp2.close()


def test_every_rank_keeps_the_gguf_blocks_where_tensor_parallel_ranks_cannot():
    from tokenmill.engine.model_spec import ModelSpec

    # every context-parallel rank holds the whole model: the file's blocks as they are; tensor-parallel ranks slice
    assert ModelSpec.resolve(EngineConfig(context_parallel_size=2, quantization="gguf")).quantization == "gguf"
    with pytest.raises(ConfigError, match="cannot split"):
        ModelSpec.resolve(EngineConfig(tensor_parallel_size=3, quantization="gguf"))


def test_full_attention_reference_is_sdpa():
    """The test's own reference agrees with torch's attention (so the tests above compare against the truth)."""
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(full_attention(q, k, v, mask, 8 ** -0.5), sdpa, rtol=1e-5, atol=1e-5)


def test_the_offline_llm_takes_the_parallel_sizes(gqa):
    """vLLM's `LLM(model, tensor_parallel_size=2)` is a real flag here, as is context_parallel_size."""
    from tokenmill import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts(1, (20,))[0]}  # the tiny model's 256-token vocabulary
    ref = LLM(str(gqa), dtype="float32", kv_cache_memory=4 << 20).generate(prompt, params,
                                                                           use_tqdm=False)[0].outputs[0].token_ids
    for sizes in ({"tensor_parallel_size": 2}, {"context_parallel_size": 2}):
        llm = LLM(str(gqa), dtype="float32", kv_cache_memory=4 << 20, num_threads=1, **sizes)
        try:
            assert llm.engine.core.executor.ranks is not None
            assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == ref
        finally:
            llm.engine.core.close()
