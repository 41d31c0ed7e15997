"""The server's grammar checks (tokenmill/structured/checker.py, AsyncEngine.check_grammar): a check past its time
limit is refused as ServerBusy (503) and its worker process killed, so it holds no thread (the default pool, which tokenization
shares, stays free) and no CPU after the limit; checks waiting for a worker past their limit never run; outcomes
are cached; a worker that dies is refused like a bad constraint and replaced."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import sys
import time

import pytest

from tests.structured.grammars import slow_spec
from tokenmill.config import EngineConfig
from tokenmill.engine import async_engine
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidRequest, ServerBusy
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import checker as checker_module
from tokenmill.structured.checker import GrammarChecker
from tokenmill.structured_params import StructuredOutputsParams

LIMIT_S = 0.3
# one more slow check than the default thread pool has threads: were checks run there, none would be left
DEFAULT_POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)


def workers_alive() -> list[mp.process.BaseProcess]:
    return [p for p in mp.active_children() if p.name == "tokenmill-grammar-check"]


def threads_in_a_check() -> list[int]:
    """Threads of this process inside a grammar compile (tokenmill/structured/backend.py `_checked`)."""
    stuck = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name == "_checked" and frame.f_code.co_filename.endswith("backend.py"):
                stuck.append(ident)
                break
            frame = frame.f_back
    return stuck


@pytest.fixture
def checker():
    c = GrammarChecker()
    yield c
    c.close()


def test_check_grammar_past_its_limit_leaves_no_thread_or_cpu_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncEngine(EngineConfig())  # not started: checking needs no engine process
    plain = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    slow = [SamplingParams(structured_outputs=slow_spec(f"s{i}")) for i in range(DEFAULT_POOL_THREADS + 1)]

    async def scenario() -> None:
        assert await engine.check_grammar(plain)  # a worker started, under the usual limit
        monkeypatch.setattr(async_engine, "GRAMMAR_CHECK_TIMEOUT_S", LIMIT_S)
        results = await asyncio.gather(*(engine.check_grammar(p) for p in slow), return_exceptions=True)
        monkeypatch.undo()
        for r in results:
            assert isinstance(r, ServerBusy) and f"did not compile within {LIMIT_S:g} s" in str(r), r  # a 503
        started = time.monotonic()
        await asyncio.to_thread(lambda: None)
        assert time.monotonic() - started < 1.0, "the default thread pool is still busy with grammar checks"

    try:
        asyncio.run(scenario())
        assert threads_in_a_check() == []
        assert workers_alive() == []  # the workers that ran them were killed; a new one starts at the next check
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.3, "this process still computes after every check was refused"
        assert asyncio.run(engine.check_grammar(SamplingParams(structured_outputs={"regex": "[a-z]+"})))
    finally:
        engine.grammars.close()


def test_checks_waiting_past_their_limit_never_run(checker: GrammarChecker, monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    real = checker_module._Worker.run

    def run(self, spec, deadline):
        started.append(spec)
        return real(self, spec, deadline)

    monkeypatch.setattr(checker_module._Worker, "run", run)
    checker.submit(StructuredOutputsParams(regex="a+"), 30).result()  # one worker started
    specs = [slow_spec(f"w{i}") for i in range(6)]
    futures = [checker.submit(spec, LIMIT_S) for spec in specs]
    for f in futures:
        with pytest.raises(TimeoutError):
            f.result(timeout=30)
    assert 1 + 1 <= len(started) <= 1 + 2  # the warm-up, then at most one per worker thread: the rest expired
    assert workers_alive() == []


def test_a_check_within_its_limit_is_answered_and_cached(checker: GrammarChecker) -> None:
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    grammar = checker.submit(spec, 30).result()
    assert "json_schema" in grammar
    again = checker.submit(spec, 30)
    assert again.done() and again.result() == grammar  # from the cache: no worker, no thread
    bad = StructuredOutputsParams(regex="(ab")
    with pytest.raises(InvalidRequest, match="regex is not usable"):
        checker.submit(bad, 30).result()
    refused = checker.submit(bad, 30)
    assert refused.done()
    with pytest.raises(InvalidRequest, match="regex is not usable"):
        refused.result()


def test_at_most_the_pool_of_workers_runs_at_once(checker: GrammarChecker) -> None:
    futures = [checker.submit(StructuredOutputsParams(regex=f"[a-z]{{{i}}}"), 60) for i in range(1, 11)]
    peak = 0
    while not all(f.done() for f in futures):
        peak = max(peak, len(workers_alive()))
        time.sleep(0.01)
    assert all(f.result() for f in futures)
    assert 1 <= len(workers_alive()) <= checker_module.CHECK_WORKERS and peak <= checker_module.CHECK_WORKERS


class _KillsTheWorker(StructuredOutputsParams):
    """A constraint whose check ends the worker process (as a crash in the grammar engine would)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_worker_that_dies_refuses_its_constraint_and_is_replaced(checker: GrammarChecker) -> None:
    with pytest.raises(InvalidRequest, match="crashed the grammar checker") as e:
        checker.submit(_KillsTheWorker(regex="x+"), 30).result()
    assert e.value.param == "structured_outputs"
    assert checker.submit(StructuredOutputsParams(regex="y+"), 30).result()


def test_close_stops_the_workers() -> None:
    c = GrammarChecker()
    c.submit(StructuredOutputsParams(regex="z+"), 30).result()
    assert len(workers_alive()) == 1
    c.close()
    assert workers_alive() == []


def test_common_constraints_are_answered_at_once_without_a_worker(checker: GrammarChecker) -> None:
    """json_object is checked when the checker is made, in this process: its first request on a busy server waits
    for no worker process to start (a spawn that once took a loaded CPU past the limit)."""
    future = checker.submit(StructuredOutputsParams(json_object=True), 0.001)
    assert future.done() and future.result()
    assert workers_alive() == []
