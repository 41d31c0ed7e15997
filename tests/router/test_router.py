"""`tokenmill router` (tokenmill/router): the prefix index and the policies alone, then a real router process in front
of three real tokenmill replicas serving a tiny model on loopback: cache-aware placement, failover without losing a
request that had not begun, streams passed through chunk for chunk, the API key, replicas added and removed."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.router.disagg import decode_body
from tokenmill.router.forward import prompt_text
from tokenmill.router.policies import BALANCE_ABS, LeastLoad, PrefixAware, RoundRobin, make_policy
from tokenmill.router.prefix_index import BLOCK_CHARS, PrefixIndex
from tokenmill.router.replicas import Replica

KEY = "router-key"
ADMIN_KEY = "router-admin-key"
SYSTEM = "You are a meticulous assistant. " * 40  # ~1,300 characters shared by a group of prompts


# ---- alone ------------------------------------------------------------------------------------------------------
def test_prefix_index_matches_whole_blocks_per_replica():
    index = PrefixIndex()
    index.insert(SYSTEM + "question one", "a")
    index.insert("something else entirely " * 10, "b")
    matched = index.match(SYSTEM + "question two")
    assert matched["a"] == len(SYSTEM) // BLOCK_CHARS * BLOCK_CHARS and "b" not in matched
    assert index.match("short") == {}
    index.forget("a")
    assert index.match(SYSTEM) == {}


def test_prefix_index_is_bounded_least_recently_used_first():
    index = PrefixIndex(max_blocks=4)
    index.insert("x" * BLOCK_CHARS * 3, "a")
    index.insert("y" * BLOCK_CHARS * 3, "b")  # 6 blocks: x's first three... the oldest go
    assert len(index) == 4 and index.match("y" * BLOCK_CHARS * 3)["b"] == 3 * BLOCK_CHARS


def backends(*loads: int) -> list[Replica]:
    return [Replica(f"http://r{i}", in_flight=load) for i, load in enumerate(loads)]


def test_policies_choose_as_documented():
    rr, pool = RoundRobin(), backends(0, 0, 0)
    assert [rr.choose(pool, "").url for _ in range(4)] == ["http://r0", "http://r1", "http://r2", "http://r0"]
    assert LeastLoad().choose(backends(3, 1, 2), "").url == "http://r1"
    prefix = PrefixAware()
    first = prefix.choose(backends(0, 0, 0), SYSTEM + "a")
    assert all(prefix.choose(backends(0, 0, 0), SYSTEM + q).url == first.url for q in "bcde")  # sticks
    loaded = backends(0, 0, 0)
    next(b for b in loaded if b.url == first.url).in_flight = BALANCE_ABS + 5
    assert prefix.choose(loaded, SYSTEM + "f").url != first.url  # imbalanced: least load wins
    with pytest.raises(ValueError, match="--policy"):
        make_policy("random")


def test_prompt_text_reads_prompts_and_messages():
    assert prompt_text(b'{"prompt": "hello"}') == "hello"
    assert prompt_text(b'{"prompt": ["a", "b"]}') == "a"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert prompt_text(json.dumps({"messages": msgs}).encode()).startswith('[{"role": "system", "content": "S"}')
    assert prompt_text(b"not json") == "" and prompt_text(b"[1]") == ""


def test_the_decode_half_claims_the_transfer_with_the_producers_token():
    data = {"prompt": "p", "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "someone-elses"}}
    answer = {"kv_transfer_params": {"status": "sent", "transfer_token": "t0k"}}
    assert decode_body(data, "kv-1", answer)["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": "kv-1", "transfer_token": "t0k"}
    assert decode_body(data, "kv-1", None) == {"prompt": "p"}  # no prefill answer: nothing to claim


# ---- a real router -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("router"), num_heads=4, num_kv_heads=2)
    flags = ["--model", str(model), "--kv-cache-memory", "32MiB", "--threads", "1"]
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda _: start_server(*flags, api_key=None), range(3)))
    yield servers
    for s in servers:
        s.stop()


def start_router(urls: list[str], *extra: str) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "tokenmill.cli", "router", "--port", "0", "--api-key", KEY,
            "--health-interval", "0.5", *[a for u in urls for a in ("--backend", u)], *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 60
    line = ""
    while "tokenmill router at" not in line:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
    url = line.rsplit(" at ", 1)[1].strip()
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


H = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def complete(url: str, prompt: str, max_tokens: int = 4, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=H, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})


@pytest.mark.slow
def test_same_prefix_requests_land_on_one_replica_and_round_robin_spreads_them(replicas):
    urls = [s.url for s in replicas]
    for policy, spread in (("prefix", 1), ("round_robin", 3)):
        proc, url = start_router(urls, "--policy", policy)
        try:
            served = [complete(url, SYSTEM + f"Question {i}?").headers["x-tokenmill-backend"] for i in range(6)]
            assert len(set(served)) == spread, (policy, served)
        finally:
            stop(proc)


@pytest.mark.slow
def test_streams_pass_through_chunk_for_chunk_and_the_key_is_enforced(replicas):
    proc, url = start_router([replicas[0].url], "--policy", "least_load")
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=H).json()["data"][0]["id"] == replicas[0].model
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
        direct = httpx.post(replicas[0].url + "/v1/completions", json=body, timeout=60).text
        routed = httpx.post(url + "/v1/completions", json=body, headers=H, timeout=60).text

        def events(sse: str) -> list:
            return [json.loads(e[6:])["choices"] for e in sse.split("\n\n") if e.startswith("data: {")]

        assert events(routed) == events(direct) and routed.rstrip().endswith("data: [DONE]")
        # Anthropic's Messages API (its x-api-key) and embeddings pass through too
        ask = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
        via = httpx.post(url + "/v1/messages", json=ask, headers={"x-api-key": KEY}, timeout=60).json()
        assert via["content"] == httpx.post(replicas[0].url + "/v1/messages", json=ask, timeout=60).json()["content"]
        assert httpx.post(url + "/v1/messages", json=ask, headers={"x-api-key": "nope"}).status_code == 401
        text = {"input": "Hello", "encoding_format": "float"}
        assert httpx.post(url + "/v1/embeddings", json=text, headers=H, timeout=60).json()["data"] == \
            httpx.post(replicas[0].url + "/v1/embeddings", json=text, timeout=60).json()["data"]
        metrics = httpx.get(url + "/metrics").text
        assert f'tokenmill_router_requests_total{{backend="{replicas[0].url}",outcome="ok"}}' in metrics
    finally:
        stop(proc)


@pytest.mark.slow
def test_replicas_added_and_removed_at_run_time(replicas):
    proc, url = start_router([replicas[0].url], "--policy", "round_robin", "--admin-api-key", ADMIN_KEY)
    try:
        assert httpx.post(url + "/admin/backends", json={"url": replicas[1].url}).status_code == 401
        assert httpx.post(url + "/admin/backends", json={"url": replicas[1].url}, headers=ADMIN).status_code == 200
        assert httpx.post(url + "/admin/backends", json={"url": "ftp://x"}, headers=ADMIN).status_code == 400
        served = {complete(url, f"p{i}").headers["x-tokenmill-backend"] for i in range(4)}
        assert served == {replicas[0].url, replicas[1].url}
        assert httpx.request("DELETE", url + "/admin/backends", json={"url": replicas[0].url},
                             headers=ADMIN).status_code == 200
        assert {complete(url, f"q{i}").headers["x-tokenmill-backend"] for i in range(3)} == {replicas[1].url}
        listed = httpx.get(url + "/admin/backends", headers=ADMIN).json()["backends"]
        assert [b["url"] for b in listed] == [replicas[1].url]
    finally:
        stop(proc)


@pytest.mark.slow
def test_killing_a_replica_under_load_loses_no_request_that_had_not_begun(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("router-kill"), num_heads=4, num_kv_heads=2)
    flags = ["--model", str(model), "--kv-cache-memory", "32MiB", "--threads", "1"]
    servers = [start_server(*flags, api_key=None) for _ in range(2)]
    proc, url = start_router([s.url for s in servers], "--policy", "round_robin", "--admin-api-key", ADMIN_KEY)
    try:
        with ThreadPoolExecutor(12) as pool:  # whole (non-streamed) answers: nothing begins before the end
            futures = [pool.submit(complete, url, f"Request {i}: tell me a story", 400, ignore_eos=True)
                       for i in range(12)]
            time.sleep(0.3)
            servers[0].proc.kill()
            results = [f.result() for f in futures]
        assert [r.status_code for r in results] == [200] * 12
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in results)
        assert {r.headers["x-tokenmill-backend"] for r in results} == {servers[1].url}  # those on the dead one moved
        metrics = httpx.get(url + "/metrics").text
        assert f'tokenmill_router_requests_total{{backend="{servers[0].url}",outcome="error"}}' in metrics
        deadline = time.monotonic() + 10
        while httpx.get(url + "/admin/backends", headers=ADMIN).json()["backends"][0]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert complete(url, "after").status_code == 200  # the survivor takes everything
    finally:
        stop(proc)
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_a_stream_whose_replica_dies_midway_ends_with_an_error_event(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("router-stream"), num_heads=4, num_kv_heads=2)
    server = start_server("--model", str(model), "--kv-cache-memory", "32MiB", "--threads", "1", api_key=None)
    proc, url = start_router([server.url], "--policy", "round_robin")
    try:
        body = {"prompt": "Tell me a long story", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=H, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 5:
                        server.proc.kill()
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert len(events) < 2000
    finally:
        stop(proc)
        server.stop()


@pytest.mark.slow
def test_a_hung_replica_is_taken_out_and_its_waiting_request_goes_elsewhere(replicas):
    """A replica that accepts connections and never answers (a hung process): its health checks time out, the
    router takes it out, and the request waiting on it is sent to a live replica instead of hanging."""
    import socket
    import threading

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(hung.accept()) for _ in range(64)], daemon=True).start()
    dead_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    proc, url = start_router([dead_url, replicas[2].url], "--policy", "round_robin")
    try:
        # the router starts with both in rotation: round robin sends one of these to the hung replica first
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda i: complete(url, f"hung {i}"), range(2)))
        assert [r.status_code for r in results] == [200, 200]
        assert {r.headers["x-tokenmill-backend"] for r in results} == {replicas[2].url}
    finally:
        stop(proc)
        hung.close()
