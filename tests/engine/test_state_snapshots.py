"""Prefix caching on a hybrid model: states copied at block boundaries (engine/state_snapshots.py) let a cached prefix
bring its recurrent state along. A hit ends at the deepest matched block with a snapshot; the answers stay the
whole-sequence reference's; every snapshot row is free or its block's when nothing runs, also when rows are taken
over and blocks evicted."""

from __future__ import annotations

import pytest

from tests.engine.test_cache_groups import add, assert_greedy_matches, drain, greedy_reference, make_core
from tests.models.toy_hybrid import load_reference, make_toy_hybrid
from tokenmill.engine.state_snapshots import StateSnapshots

BLOCK = 4


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_hybrid(tmp_path_factory.mktemp("snap") / "toy-hybrid", hidden_size=32)


@pytest.fixture(scope="module")
def reference(toy):
    return load_reference(toy)


def test_rows_are_taken_attached_read_and_given_back():
    snaps = StateSnapshots(first_row=3, num_rows=2)
    a, b = snaps.take(), snaps.take()
    assert {a, b} == {3, 4}
    snaps.attach(10, a)
    snaps.attach(11, b)
    assert snaps.row_of(10) == a and snaps.row_of(12) is None
    row = snaps.read(10)  # being read: never taken over; 11 is now the least recently used
    assert snaps.take() == b and snaps.row_of(11) is None and snaps.taken_over == 1
    assert snaps.take() is None  # the one left is being read
    snaps.give_back(b)
    snaps.done_reading(row)
    snaps.attach(10, snaps.take())  # 10 keeps its snapshot: the new row goes back
    snaps.forget([10])
    snaps.check_idle(cached=set())


def drain_one(core, rid, prompt, max_tokens):
    add(core, rid, prompt, max_tokens)
    return drain(core)[rid]


def test_a_follow_up_turn_starts_from_the_snapshot_of_the_first_turns_last_block(toy, reference):
    """Turn 2 resends turn 1 and its answer: it computes only what follows the last block boundary turn 1 reached,
    and answers as the whole-sequence reference does."""
    core = make_core(toy, chunk=8)
    first = [(3 * j) % 61 + 1 for j in range(13)]
    answer = drain_one(core, "t1", first, 9)
    second = first + answer + [7, 9, 11]
    computed = core.scheduler.num_prefill_tokens_computed
    got = drain_one(core, "t2", second, 8)
    assert_greedy_matches(got, *greedy_reference(reference, second, 8))
    # turn 1 computed 13 + 8 tokens (its last answer token is not fed back): blocks up to token 20 are cached
    assert core.scheduler.num_prefill_tokens_computed - computed == len(second) - 20
    core.check_idle_invariants()


def test_the_same_prompt_again_hits_its_last_whole_block(toy, reference):
    """A prompt's chunk stops at its last block boundary, so the state there is kept: the same prompt again (a
    regenerated answer, another question after one system prompt) computes only the tokens past it."""
    core = make_core(toy, chunk=64)
    prompt = [(5 * j) % 61 + 1 for j in range(22)]
    want = greedy_reference(reference, prompt, 6)
    assert_greedy_matches(drain_one(core, "a", prompt, 6), *want)
    computed = core.scheduler.num_prefill_tokens_computed
    assert_greedy_matches(drain_one(core, "b", prompt, 6), *want)
    assert core.scheduler.num_prefill_tokens_computed - computed == 22 - 20
    other = prompt[:12] + [50, 51, 52, 53, 54]  # shares 3 cached blocks, but no snapshot lies within them
    computed = core.scheduler.num_prefill_tokens_computed
    assert_greedy_matches(drain_one(core, "c", other, 6), *greedy_reference(reference, other, 6))
    assert core.scheduler.num_prefill_tokens_computed - computed == len(other)  # no hit: computed whole
    core.check_idle_invariants()


def test_a_small_pool_takes_snapshots_over_and_evicts_blocks_without_losing_an_answer(toy, reference):
    core = make_core(toy, chunk=8, num_blocks=24, seqs=2)
    prompts = {f"p{i}": [(7 * i + 3 * j) % 61 + 1 for j in range(10 + 3 * i)] for i in range(5)}
    for rid, prompt in prompts.items():  # each twice: the second may hit what is left of the first
        for k in range(2):
            assert_greedy_matches(drain_one(core, f"{rid}-{k}", prompt, 10), *greedy_reference(reference, prompt, 10))
    assert core.kv.snapshots.taken_over + core.kv.prefix_stats.evicted_blocks > 0, "the pool was meant to be short"
    core.check_idle_invariants()


def test_without_prefix_caching_no_snapshot_is_kept(toy):
    core = make_core(toy, chunk=8, prefix_caching=False)
    assert core.cache_info.state_snapshots == 0 and core.kv.snapshots is None and core.kv.tree is None
    assert core.runner.kv_caches[2][0].shape[0] == core.cache_info.state_slots
