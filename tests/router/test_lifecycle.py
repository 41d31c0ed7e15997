"""How a routed request ends (router/forward.py, router/climb.py), on real routers in front of a scripted replica
(tests/router/fakes.py): the replica's in-flight count comes back to 0 however the client leaves, and the upstream
request is closed with it; a cascade stream that meets a malformed event or stops short ends with an error event and
`[DONE]`; bodies that cannot be read get a clear 400; large bodies are parsed off the event loop."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

import tokenmill.router.forward as forward
from tests.router.fakes import SLOW_S, FakeReplica, Served
from tests.router.test_router import H, start_router, stop
from tokenmill.router.app import build_router_app
from tokenmill.router.guard import GuardSettings
from tokenmill.router.policies import make_policy
from tokenmill.router.replicas import ReplicaPool

BAD = ("bad-event-first", "bad-event-after-2", "bad-json")


@pytest.fixture(scope="module")
def fake():
    replica = FakeReplica()
    yield replica
    replica.stop()


def in_flight(url: str, backend: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf'tokenmill_router_backend_in_flight{{backend="{re.escape(backend)}"}} (\S+)',
                           text).group(1))


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_in_flight_comes_back_when_the_client_leaves_before_or_during_the_stream(fake):
    proc, url = start_router([fake.url], "--policy", "least_load")
    closed = fake.closed_early
    try:
        body = {"prompt": "slow", "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # gone while the replica has not begun its answer
            httpx.post(url + "/v1/completions", json=body, headers=H, timeout=httpx.Timeout(60, read=0.3))
        wait_for(lambda: in_flight(url, fake.url) == 0.0, SLOW_S * 3)
        wait_for(lambda: fake.closed_early == closed + 1, SLOW_S * 3)  # the upstream request was closed with it
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "endless", "stream": True},
                          headers=H, timeout=30) as r:  # gone midway
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)][0].startswith("data: ")
            assert in_flight(url, fake.url) == 1.0
        wait_for(lambda: in_flight(url, fake.url) == 0.0)
        wait_for(lambda: fake.closed_early == closed + 2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "after", "stream": True}, headers=H, timeout=30)
        assert r.text.rstrip().endswith("data: [DONE]") and in_flight(url, fake.url) == 0.0
    finally:
        stop(proc)


def events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def cascade(fake):
    sure = FakeReplica(overrides={p: "ok" for p in BAD})  # the last tier answers them well
    proc, url = start_router([], "--cascade", f"a={fake.url}", "--cascade", f"b={sure.url}",
                             "--cascade-first-tokens", "2")
    yield url
    stop(proc)
    sure.stop()


def test_a_malformed_event_in_a_chosen_tier_stream_ends_it_with_an_error_then_done(cascade):
    # tier a is sure after two tokens, then sends a broken event (and more after it), or ends without [DONE]
    for prompt, relayed in (("bad-event-after-2", ["a", "b"]), ("no-done", ["a", "b", "c"])):
        r = httpx.post(cascade + "/v1/completions", json={"prompt": prompt, "stream": True}, headers=H, timeout=30)
        got = events(r)
        assert r.headers["x-tokenmill-tier"] == "a" and got[-1] == "[DONE]", (prompt, got)
        assert [json.loads(e)["choices"][0]["text"] for e in got[:-2]] == relayed
        error = json.loads(got[-2])["error"]
        assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}


def test_a_tier_that_answers_malformed_before_it_is_chosen_is_passed_over(cascade):
    r = httpx.post(cascade + "/v1/completions", json={"prompt": "bad-event-first", "stream": True}, headers=H,
                   timeout=30)
    got = events(r)
    assert r.headers["x-tokenmill-tier"] == "b" and got[-1] == "[DONE]"
    assert not any("error" in json.loads(e) for e in got[:-1])
    r = httpx.post(cascade + "/v1/completions", json={"prompt": "bad-json"}, headers=H, timeout=30)
    assert r.status_code == 200 and r.json()["tier"] == "b"


def test_bodies_that_cannot_be_read_get_a_clear_400(cascade, fake):
    deep = b"[" * 100_000 + b"]" * 100_000  # too deep for Python's parser: not a crash
    for body, what in ((b"not json", "JSON object"), (deep, "JSON object"), (b'{"prompt": "x", "stream": true, '
                                                                             b'"stream_options": 5}', "stream_options")):
        r = httpx.post(cascade + "/v1/completions", content=body, headers=H, timeout=30)
        assert r.status_code == 400 and what in r.json()["error"]["message"], r.text
    proc, url = start_router([fake.url], "--policy", "prefix")
    try:  # the prefix policy reads the prompt; the replica is the one to say what is wrong with the body
        r = httpx.post(url + "/v1/completions", content=deep, headers=H, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad JSON"
    finally:
        stop(proc)


def test_large_bodies_are_parsed_and_hashed_off_the_event_loop(monkeypatch, fake):
    threads: dict[str, threading.Thread] = {}
    real = forward.prompt_text

    def spy(body: bytes) -> str:
        text = real(body)
        threads[text[:5]] = threading.current_thread()
        return text

    monkeypatch.setattr(forward, "prompt_text", spy)
    router = Served(build_router_app(ReplicaPool([fake.url]), make_policy("prefix"), GuardSettings()),
                    lifespan="on")
    try:
        for prompt in ("small", "large" * 40_000):  # 200 KB
            r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200
        assert threads["small"] is router.thread and threads["large"] is not router.thread
    finally:
        router.stop()


def test_in_flight_comes_back_when_a_refusal_breaks_off(fake):
    """A 503 whose body breaks off while the router reads it (to hand it back if no replica does better)."""
    proc, url = start_router([fake.url], "--policy", "least_load")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "cut-503"}, headers=H, timeout=30)
        assert in_flight(url, fake.url) == 0.0
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        stop(proc)


def asgi_request(body: dict) -> tuple[dict, Any]:
    """An HTTP request as an ASGI server hands it to the router (spec 2.4: a client gone shows as send raising)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080),
             "headers": [(b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays; its leaving is said by send
        return {"type": "http.disconnect"}

    return scope, receive


def test_in_flight_comes_back_when_the_server_cancels_the_request_or_its_client_is_gone(fake):
    """The router's app as an ASGI server drives it: one that cancels a request whose replica has not answered
    yet (a connect cancelled), one whose client is gone by the time the response would start."""
    async def scenario() -> None:
        pool = ReplicaPool([fake.url])
        backend = pool.backends[fake.url]
        app = build_router_app(pool, make_policy("least_load"))
        async with app.router.lifespan_context(app):
            scope, receive = asgi_request({"prompt": "slow", "stream": True})
            request = asyncio.ensure_future(app(scope, receive, lambda message: asyncio.sleep(0)))
            while backend.in_flight == 0:
                await asyncio.sleep(0.01)
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            assert backend.in_flight == 0

            async def gone(message: dict) -> None:
                raise ConnectionResetError("the client is gone")

            scope, receive = asgi_request({"prompt": "ok", "stream": True})
            await asyncio.gather(app(scope, receive, gone), return_exceptions=True)
            assert backend.in_flight == 0 and backend.requests == 2

    asyncio.run(scenario())
