"""benchmarks/engine_core.py's arithmetic, without running the engine: the decode-step bound on continuous vs
static batching that BENCHMARKS.md quotes."""

from __future__ import annotations

import pytest

from benchmarks.tests.scripts import load_benchmark_script


@pytest.fixture(scope="module")
def engine_core():
    return load_benchmark_script("engine_core.py")


def test_static_runs_each_batch_for_its_longest_member(engine_core):
    # static: max(5, 1) + max(1, 1) = 6; continuous: one slot runs 5, the other 1 + 1 + 1
    assert engine_core.decode_step_bound([5, 1, 1, 1], slots=2) == (6, 5)


def test_equal_lengths_leave_nothing_to_gain(engine_core):
    assert engine_core.decode_step_bound([3] * 8, slots=4) == (6, 6)


def test_continuous_never_needs_more_steps_than_static(engine_core):
    import random

    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(1, 256) for _ in range(rng.randint(1, 60))]
        slots = rng.randint(1, 16)
        static, continuous = engine_core.decode_step_bound(lens, slots)
        assert max(lens) <= continuous <= static <= sum(lens)
