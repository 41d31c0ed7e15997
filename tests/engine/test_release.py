"""One release path: a sequence that ends in any stage (waiting for its grammar, refused at add, failed, aborted)
leaves nothing behind in the core: no block, and no KV-transfer, structured-output or speculation state
(check_idle_invariants)."""

from __future__ import annotations

import time

import pytest

from tests.disagg.test_core_transfer import add, make_core
from tests.models.tiny import make_tiny_model
from tokenmill.disagg.transfer import KVTransferParams
from tokenmill.errors import ConfigError
from tokenmill.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("release"), vocab_size=256)


@pytest.fixture
def producer(model, tmp_path):
    core = make_core(model, tmp_path, "kv_producer", "shm")
    yield core
    core.close()


def constrained(rid: str, constraint: dict, transfer: KVTransferParams | None = None):
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=constraint)
    return add(rid, list(range(3, 20)), params, transfer)


def settle(core, limit_s: float = 30.0) -> list:
    outputs, deadline = [], time.monotonic() + limit_s
    while core.has_unfinished and time.monotonic() < deadline:
        outputs += core.step().outputs
    return outputs


def test_aborted_while_its_grammar_builds_releases_its_kv_transfer(producer):
    producer.add_request(constrained("c", {"json": SCHEMA}, KVTransferParams("t1", True)))
    assert producer.kv_transfer._shipments  # shipping began with the request
    producer.abort(["c"])
    settle(producer)
    producer.check_idle_invariants()


def test_a_grammar_that_fails_releases_its_kv_transfer(producer):
    producer.add_request(constrained("bad", {"regex": "(unclosed"}, KVTransferParams("t2", True)))
    outputs = settle(producer)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error")]
    producer.check_idle_invariants()


def test_a_sequence_refused_at_add_leaves_no_state(model, tmp_path):
    """A consumer-only transfer on a producer is refused with ConfigError: nothing of it stays."""
    core = make_core(model, tmp_path, "kv_producer", "shm")
    try:
        with pytest.raises(ConfigError):
            core.add_request(add("x", list(range(3, 12)), transfer=KVTransferParams("t3", False)))
        assert core.request_ids() == []
        core.check_idle_invariants()
    finally:
        core.close()


def test_abort_all_ends_every_stage(producer):
    """Waiting for a grammar, waiting to run and running: abort_all ends them all."""
    producer.add_request(constrained("g", {"json": SCHEMA}))
    producer.add_request(add("w", list(range(3, 30)), SamplingParams(max_tokens=50, temperature=0)))
    producer.step()
    producer.add_request(add("w2", list(range(5, 30)), SamplingParams(max_tokens=50, temperature=0)))
    assert set(producer.request_ids()) >= {"w", "w2"}
    producer.abort_all()
    assert producer.request_ids() == [] and not producer.has_unfinished
    producer.check_idle_invariants()


def test_the_idle_check_finds_a_leak(producer):
    """The suite's after-test check has teeth: a block held by no request is found (then given back)."""
    leaked = producer.kv.pool.allocate(1)
    with pytest.raises(AssertionError, match="leaked"):
        producer.check_idle_invariants()
    assert producer.scheduler.stats().leaked_blocks == 0  # counted only once a request came and went
    producer.add_request(add("r", list(range(3, 8)), SamplingParams(max_tokens=2, temperature=0)))
    settle(producer)
    assert producer.scheduler.stats().leaked_blocks == 1
    producer.kv.pool.release(leaked)
