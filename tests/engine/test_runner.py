"""ModelRunner on a tiny random model: the flat batch a mixed step becomes (positions, KV slots, block tables),
pipeline micro-batches, KV read/write by token range, per-request state, and multi-step decode against single
steps."""

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tokenmill.engine.multi_step_runner import request_stop_ids
from tokenmill.engine.runner import ModelRunner, position_seed
from tokenmill.engine.step_inputs import MIN_MICRO_BATCH_TOKENS, micro_batches
from tokenmill.engine.step_types import ScheduledRequest, SchedulerOutput
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_model(tmp_path_factory.mktemp("runner"), num_heads=4, num_kv_heads=2, vocab_size=256)
    cfg = load_model_config(path)
    return ModelRunner(cfg, load_weights(path, cfg), torch.float32, "cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK,
                       seed=0, use_kernel=False)


def request(rid: str, prompt: list[int], blocks: list[int], computed: int = 0, output: list[int] | None = None,
            params: SamplingParams = GREEDY) -> Request:
    return Request(rid, prompt, params, params.max_tokens, output_token_ids=list(output or []),
                   num_computed_tokens=computed, block_ids=blocks)


def mixed_step() -> tuple[ScheduledRequest, ScheduledRequest, ScheduledRequest]:
    """A fresh prefill, a decode and a later prefill chunk, scheduled in that order."""
    fresh = ScheduledRequest(request("fresh", [11, 12, 13], [9]), 3)
    decode = ScheduledRequest(request("decode", [1, 2, 3, 4, 5, 6], [5, 2], computed=6, output=[40]), 1)
    chunk = ScheduledRequest(request("chunk", list(range(20, 30)), [7, 3, 1], computed=4), 5)
    return fresh, decode, chunk


def test_inputs_give_each_token_its_position_slot_and_block_table_row(runner):
    """The flat batch: paged spans' tokens first with their block tables, q rows and key counts, then fresh spans."""
    fresh, decode, chunk = mixed_step()
    ids, pos, meta = runner._inputs([(decode, 0, 1), (chunk, 0, 5), (fresh, 0, 3)], num_paged=2)
    assert ids.tolist() == [40, 24, 25, 26, 27, 28, 11, 12, 13]
    assert pos.tolist() == [6, 4, 5, 6, 7, 8, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 12, 13, 14, 15, 4, 36, 37, 38]
    assert meta.num_paged_tokens == 6
    assert meta.block_tables.tolist() == [[5, 2, 0], [7, 3, 1]]  # 9 positions: 3 blocks, padded with block 0
    assert meta.q_rows.tolist() == [0, 1, 1, 1, 1, 1]
    assert meta.kv_lens.tolist() == [7, 5, 6, 7, 8, 9]
    assert meta.fresh_spans == [(6, 9)]


def test_a_span_offset_starts_inside_the_chunk(runner):
    """A micro-batch's second piece of a chunk reads its tokens and slots from where the first piece ended."""
    _, _, chunk = mixed_step()
    ids, pos, meta = runner._inputs([(chunk, 3, 2)], num_paged=1)
    assert ids.tolist() == [27, 28] and pos.tolist() == [7, 8]
    assert meta.slot_mapping.tolist() == [15, 4] and meta.kv_lens.tolist() == [8, 9]


def test_block_tables_pad_and_truncate_to_the_positions_asked(runner):
    """Rows hold exactly the blocks covering the positions: short rows padded with 0, longer ones cut."""
    assert runner._block_tables([[3], [4, 5, 6]], 6).tolist() == [[3, 0], [4, 5]]


def test_execute_feeds_paged_tokens_before_fresh_prefills_and_samples_only_finished_chunks(runner, monkeypatch):
    """Whatever the scheduled order, decodes and later chunks go first; a chunk short of its prompt's end is not
    sampled."""
    seen = []
    forward = runner.model.forward

    def spy(input_ids, positions, meta, kv_caches):
        seen.append((positions.tolist(), meta.num_paged_tokens, list(meta.fresh_spans)))
        return forward(input_ids, positions, meta, kv_caches)

    monkeypatch.setattr(runner.model, "forward", spy)
    fresh, decode, chunk = mixed_step()
    result = runner.execute(SchedulerOutput(scheduled=[fresh, decode, chunk]))
    assert seen == [([6, 4, 5, 6, 7, 8, 0, 1, 2], 6, [(6, 9)])]
    assert set(result.sampled) == {"fresh", "decode"}
    assert all(len(t.token_ids) == 1 and 0 <= t.token_ids[0] < 256 for t in result.sampled.values())


def test_a_prompt_in_two_chunks_samples_what_it_does_in_one(runner):
    """The second chunk reads the first's KV through the block tables: the same greedy token as one prefill."""
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    whole = runner.execute(SchedulerOutput([ScheduledRequest(request("w", prompt, [0, 1, 2]), 9)]))
    first = request("c", prompt, [3, 4, 5])
    assert runner.execute(SchedulerOutput([ScheduledRequest(first, 5)])).sampled == {}
    first.num_computed_tokens = 5
    chunked = runner.execute(SchedulerOutput([ScheduledRequest(first, 4)]))
    assert chunked.sampled["c"].token_ids == whole.sampled["w"].token_ids


class Chunk:
    def __init__(self, n: int):
        self.num_new_tokens = n


@pytest.mark.parametrize("sizes,n,split", [((5, 7, 9), 1, True), ((3, 3), 4, False), ((10,), 4, True),
                                           ((40, 1, 1, 90), 3, False), ((40, 1, 1, 90), 8, True)])
def test_micro_batches_cover_every_chunk_once_in_order(sizes, n, split):
    """Runs, concatenated, are the chunks in order, each cut (if at all) into contiguous pieces; never more than n
    runs, and with splitting none under MIN_MICRO_BATCH_TOKENS when there are more runs than one."""
    chunks = [Chunk(s) for s in sizes]
    runs = micro_batches(chunks, n, split_chunks=split)
    assert 1 <= len(runs) <= n and all(runs)
    pieces = [span for r in runs for span in r]
    for c in chunks:
        mine = [(o, k) for s, o, k in pieces if s is c]
        assert [o for o, _ in mine] == [sum(k for _, k in mine[:i]) for i in range(len(mine))]
        assert sum(k for _, k in mine) == c.num_new_tokens
        assert split or mine == [(0, c.num_new_tokens)]
    order = [s for i, (s, _, _) in enumerate(pieces) if i == 0 or pieces[i - 1][0] is not s]
    assert len(order) == len(chunks) and all(a is b for a, b in zip(order, chunks))
    if split and len(runs) > 1:
        assert all(sum(k for _, _, k in r) >= MIN_MICRO_BATCH_TOKENS - 1 for r in runs)


def test_micro_batches_without_splitting_never_exceed_the_requests():
    """At request boundaries only, two requests make at most two runs however many were asked for."""
    assert len(micro_batches([Chunk(100), Chunk(100)], 8, split_chunks=False)) == 2


def test_an_unseeded_request_keeps_one_base_seed_until_released(runner):
    """Draws for a position repeat while the request lives; release drops its seed, and a new request of the
    same id gets a fresh seed."""
    rid = "unseeded"
    a = runner.position_generator(rid, None, 3).initial_seed()
    assert runner.position_generator(rid, None, 3).initial_seed() == a
    assert runner.position_generator(rid, None, 4).initial_seed() != a
    runner.release(rid)
    assert rid not in runner.base_seeds
    assert runner.position_generator(rid, None, 3).initial_seed() != a
    runner.release(rid)
    runner.release("never-seen")
    assert rid not in runner.base_seeds


def test_a_seeded_request_draws_from_its_seed_and_position_only(runner):
    """A seed in the request's parameters fixes each position's generator and stores nothing per request."""
    gen = runner.position_generator("seeded", 7, 2)
    assert gen.initial_seed() == position_seed(7, 2) and "seeded" not in runner.base_seeds
    assert runner.position_generator("seeded", 7, 2, salt=5).initial_seed() == position_seed(7 ^ 5, 2)
    seeds = {position_seed(7, p) for p in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)


def test_request_stop_ids_are_stop_ids_and_eos_unless_ignored():
    """Multi-step decode stops on these: EOS counts only when the request does not ignore it."""
    eos = frozenset({2})
    r = Request("r", [1], SamplingParams(stop_token_ids=[9, 5, 9]), 4, eos_token_ids=eos)
    assert request_stop_ids(r) == [2, 5, 9]
    r = Request("r", [1], SamplingParams(stop_token_ids=[9], ignore_eos=True), 4, eos_token_ids=eos)
    assert request_stop_ids(r) == [9]


def decode_alone(runner: ModelRunner, req: Request, steps: int) -> list[int]:
    """`steps` single decode steps, each sampled token appended as the scheduler would."""
    got = []
    for _ in range(steps):
        sampled = runner.execute(SchedulerOutput([ScheduledRequest(req, 1)])).sampled[req.request_id].token_ids
        got += sampled
        req.num_computed_tokens += 1
        req.output_token_ids += sampled
    return got


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=4, max_tokens=16, ignore_eos=True)])
def test_multi_step_decode_gives_the_tokens_of_single_steps(runner, params):
    """num_steps > 1: each token fed back as the next input, sampled as a step of its own would sample it."""
    prompt = [17, 23, 5, 8, 99]
    first = runner.execute(SchedulerOutput([ScheduledRequest(request("m", prompt, [8, 9, 10], params=params), 5)]))
    t1 = first.sampled["m"].token_ids
    run = request("m", prompt, [8, 9, 10], computed=5, output=t1, params=params)
    multi = runner.execute(SchedulerOutput([ScheduledRequest(run, 1)], num_steps=4)).sampled["m"].token_ids
    alone = decode_alone(runner, request("m", prompt, [8, 9, 10], computed=5, output=t1, params=params), 4)
    assert multi == alone and len(multi) == 4


def test_multi_step_decode_stops_once_every_request_has_ended(runner):
    """A stop id sampled mid-run ends the run there: no tokens past it."""
    prompt = [17, 23, 5, 8, 99]
    t1 = runner.execute(SchedulerOutput([ScheduledRequest(request("s", prompt, [8, 9, 10]), 5)])).sampled["s"]
    alone = decode_alone(runner, request("s", prompt, [8, 9, 10], computed=5, output=t1.token_ids), 4)
    stop = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[alone[1]])
    run = request("s", prompt, [8, 9, 10], computed=5, output=t1.token_ids, params=stop)
    got = runner.execute(SchedulerOutput([ScheduledRequest(run, 1)], num_steps=4)).sampled["s"].token_ids
    assert got == alone[:alone.index(alone[1]) + 1]
