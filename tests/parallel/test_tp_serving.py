"""`tokenmill serve --tensor-parallel-size 2` (and `--pipeline-parallel-size 2`, `--context-parallel-size 2`) for real: the answers of one
process; a rank that dies mid-stream
ends the stream with an error event and the server exits non-zero, and one that dies while the server idles turns
/health to 503 within seconds (never a server that says it is healthy and hangs the next request)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.test_server import sse_events

pytestmark = pytest.mark.slow


def worker_pids(srv) -> list[int]:
    """The tensor-parallel ranks 1..N-1: the engine process's worker children."""
    engine = srv.engine_pid()
    return [int(pid) for task in Path(f"/proc/{engine}/task").iterdir()
            for pid in (task / "children").read_text().split()
            if b"tokenmill.parallel.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tp-serve"), num_heads=4, num_kv_heads=2)


def flags(model) -> list[str]:
    """float32: ranks sum their partial products in another order than one process, exact only at this precision."""
    return ["--model", str(model), "--kv-cache-memory", "16MiB", "--threads", "1", "--dtype", "float32"]


def test_two_ranks_answer_as_one_process_and_a_dead_rank_ends_the_stream_and_the_server(model):
    with ThreadPoolExecutor(2) as pool:
        tp, one = pool.map(lambda extra: start_server(*flags(model), *extra, api_key=None),
                           (["--tensor-parallel-size", "2"], []))
    try:
        assert len(worker_pids(tp)) == 1
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        got = httpx.post(tp.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"] == httpx.post(one.url + "/v1/completions", json=body, timeout=60).json()["choices"]
        stream = {**body, "max_tokens": 2000, "stream": True}
        with httpx.Client(base_url=tp.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=stream) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(worker_pids(tp)[0], signal.SIGKILL)
            events = sse_events(list(lines))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
        assert tp.proc.wait(30) != 0
        assert "tensor-parallel" in tp.stderr()
    finally:
        tp.stop()
        one.stop()


def test_two_pipeline_stages_answer_as_one_process(model):
    with ThreadPoolExecutor(2) as pool:
        pp, one = pool.map(lambda extra: start_server(*flags(model), *extra, api_key=None),
                           (["--pipeline-parallel-size", "2", "--pipeline-micro-batches", "2"], []))
    try:
        assert len(worker_pids(pp)) == 1
        body = {"prompt": ["Once upon a time", "The sea"], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        got = httpx.post(pp.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"] == httpx.post(one.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    finally:
        pp.stop()
        one.stop()


def test_two_context_parallel_ranks_answer_as_one_process_streamed_or_not(model):
    with ThreadPoolExecutor(2) as pool:
        cp, one = pool.map(lambda extra: start_server(*flags(model), *extra, api_key=None),
                           (["--context-parallel-size", "2", "--no-batch-invariant"], ["--no-batch-invariant"]))
    try:
        assert len(worker_pids(cp)) == 1
        body = {"prompt": ["Once upon a time", "The sea " * 30], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        got = httpx.post(cp.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"] == httpx.post(one.url + "/v1/completions", json=body, timeout=60).json()["choices"]
        with httpx.Client(base_url=cp.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={**body, "prompt": body["prompt"][1], "stream": True}) as r:
            events = sse_events(list(r.iter_lines()))
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == got["choices"][1]["text"]
    finally:
        cp.stop()
        one.stop()


def test_a_rank_that_dies_while_idle_turns_health_to_503(model):
    tp = start_server(*flags(model), "--tensor-parallel-size", "2", api_key=None)
    try:
        assert httpx.get(tp.url + "/health").status_code == 200
        os.kill(worker_pids(tp)[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                status = httpx.get(tp.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None  # already gone
        assert status != 200
        assert tp.proc.wait(30) != 0
    finally:
        tp.stop()


def test_ranks_do_not_outlive_a_killed_engine(model):
    tp = start_server(*flags(model), "--tensor-parallel-size", "2", api_key=None)
    try:
        workers = worker_pids(tp)
        os.kill(tp.engine_pid(), signal.SIGKILL)
        assert tp.proc.wait(30) != 0
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{pid}").exists() and b"zombie" not in _state(pid) for pid in workers):
            assert time.monotonic() < deadline, "a tensor-parallel rank outlived its engine"
            time.sleep(0.1)
    finally:
        tp.stop()


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"
