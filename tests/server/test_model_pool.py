"""The model pool (server/model_pool.py) and the dispatcher in front of it (server/multi_app.py), over a fake backend
whose loads and unloads take real time in worker threads, as the engine's do: LRU eviction of idle models only,
one load per model however many wait, --max-loaded-models and --memory-limit never exceeded even for a moment (a
load waits until the unloads making its room have ended), --keep-alive, failed loads and dead engines. The real
engines: tests/server/test_multi_model.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.model_pool import Loaded, ModelEntry, ModelPool, ModelTooLarge, ModelUnavailable, PoolLimits
from tokenmill.server.multi_app import build_multi_app, model_of
from tokenmill.server.multi_launch import parse_model_arg, parse_model_args
from tokenmill.server.settings import ServerSettings


class FakeEngine:
    def __init__(self):
        self.dead = None
        self.failed = 0

    def fail_all(self, error) -> int:
        self.failed += 1
        return 0


def echo_app(name: str, gate: asyncio.Event | None = None):
    """An ASGI app answering {"model": name, "body": the body it got}; with `gate`, its body's end waits for it."""

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = json.dumps({"model": name, "body": body.decode(), "path": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data, "more_body": gate is not None})
        if gate is not None:
            await gate.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


class FakeBackend:
    """Loads take `load_s`, unloads `unload_s`, both blocking a worker thread. Tracks what is really live (from a
    load's start to its unload's end) so the tests can check the limits held at every moment."""

    def __init__(self, sizes: dict[str, int] | None = None, measured: dict[str, int] | None = None,
                 load_s: float = 0.05, unload_s: float = 0.05):
        self.sizes, self.measured = sizes or {}, measured or {}
        self.load_s, self.unload_s = load_s, unload_s
        self.fail: set[str] = set()
        self.events: list[str] = []
        self.live: dict[str, int] = {}
        self.peak_count = self.peak_bytes = 0
        self.on_dead = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.names: dict[int, str] = {}
        self._lock = threading.Lock()

    def estimate(self, entry: ModelEntry) -> int:
        return self.sizes.get(entry.name, 1)

    def load(self, entry: ModelEntry) -> Loaded:
        nbytes = self.measured.get(entry.name, self.estimate(entry))
        with self._lock:
            self.events.append(f"load {entry.name}")
            self.live[entry.name] = nbytes
            self.peak_count = max(self.peak_count, len(self.live))
            self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
        time.sleep(self.load_s)
        if entry.name in self.fail:
            with self._lock:
                del self.live[entry.name]
            raise RuntimeError(f"{entry.name} is broken")
        loaded = Loaded(echo_app(entry.name, self.gates.get(entry.name)), FakeEngine(), None, nbytes, 2048)
        self.names[id(loaded)] = entry.name
        return loaded

    def attach(self, loaded, loop, on_dead) -> None:
        self.on_dead[id(loaded)] = on_dead

    def unload(self, loaded: Loaded) -> None:
        time.sleep(self.unload_s)
        name = self.names[id(loaded)]
        with self._lock:
            self.events.append(f"unload {name}")
            del self.live[name]

    def loads(self, name: str) -> int:
        return self.events.count(f"load {name}")


async def call(app, method: str, path: str, body: bytes = b"", headers: list | None = None) -> tuple[int, bytes]:
    """One request through an ASGI app: (status, body)."""
    scope = {"type": "http", "method": method, "path": path, "headers": headers or [], "query_string": b""}
    sent = False
    out: dict = {"status": None, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["body"]


def make_pool(names: str, backend: FakeBackend, **limits) -> ModelPool:
    said: list[str] = []
    pool = ModelPool([ModelEntry(n, f"/models/{n}") for n in names], backend, PoolLimits(**limits), say=said.append)
    pool.said = said
    return pool


async def use(pool: ModelPool, name: str) -> None:
    pool.release(await pool.acquire(name))


def states(pool: ModelPool) -> dict[str, str]:
    return {n: e.state for n, e in pool.entries.items()}


async def settle(pool: ModelPool) -> None:
    """Until no load or unload is under way."""
    while any(e.task is not None and not e.task.done() for e in pool.entries.values()):
        await asyncio.sleep(0.01)


def test_the_least_recently_used_idle_model_is_evicted_and_the_limit_holds_throughout():
    async def main():
        backend = FakeBackend()
        pool = make_pool("abc", backend, max_loaded=2)
        pool.start()
        await use(pool, "a")
        await use(pool, "b")
        await use(pool, "a")  # a is now more recent than b
        await use(pool, "c")
        await settle(pool)
        assert states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert backend.events[-2:] == ["unload b", "load c"]  # c loaded only once b was really gone
        assert backend.peak_count == 2
        assert any("loading model c" in s for s in pool.said) and any("model c loaded in" in s for s in pool.said)
        await pool.close()
        assert set(states(pool).values()) == {"unloaded"} and backend.live == {}

    asyncio.run(main())


def test_busy_models_are_never_evicted_and_the_wait_for_one_is_bounded():
    async def main():
        backend = FakeBackend()
        pool = make_pool("ab", backend, max_loaded=1, wait_timeout=0.3)
        pool.start()
        held = await pool.acquire("a")
        started = time.monotonic()
        with pytest.raises(ModelUnavailable) as refused:
            await pool.acquire("b")
        assert 0.25 < time.monotonic() - started < 2.0
        assert refused.value.status == 503 and "'a'" in str(refused.value)
        assert states(pool) == {"a": "loaded", "b": "unloaded"} and backend.loads("b") == 0
        waiting = asyncio.ensure_future(pool.acquire("b"))
        await asyncio.sleep(0.1)
        assert not waiting.done() and states(pool)["a"] == "loaded"
        pool.release(held)  # a goes idle: b may take its slot now
        b = await asyncio.wait_for(waiting, 5)
        assert b.state == "loaded" and states(pool)["a"] == "unloaded" and backend.peak_count == 1
        pool.release(b)
        await pool.close()

    asyncio.run(main())


def test_concurrent_requests_for_an_unloaded_model_share_one_load():
    async def main():
        backend = FakeBackend(load_s=0.3)
        pool = make_pool("ab", backend)
        pool.start()
        got = await asyncio.gather(*(pool.acquire("b") for _ in range(6)))
        assert backend.loads("b") == 1 and all(e is pool.entries["b"] for e in got)
        assert pool.entries["b"].in_flight == 6
        for e in got:
            pool.release(e)
        assert pool.entries["b"].in_flight == 0
        await pool.close()

    asyncio.run(main())


def test_keep_alive_unloads_idle_models_only():
    async def main():
        backend = FakeBackend()
        pool = make_pool("ab", backend, keep_alive=0.2)
        pool.start()
        await use(pool, "a")
        held = await pool.acquire("b")
        await asyncio.sleep(0.8)
        await settle(pool)
        assert states(pool) == {"a": "unloaded", "b": "loaded"}  # b is busy: it stays however long
        assert pool.entries["a"].unloads == {"keep_alive": 1}
        pool.release(held)
        await asyncio.sleep(0.8)
        await settle(pool)
        assert states(pool)["b"] == "unloaded"
        await use(pool, "a")  # and it loads again on demand
        assert backend.loads("a") == 2
        await pool.close()

    asyncio.run(main())


def test_memory_limit_evicts_until_the_new_model_fits_and_refuses_one_that_never_can():
    async def main():
        backend = FakeBackend(sizes={"a": 60, "b": 50, "c": 30, "huge": 150})
        pool = make_pool(["a", "b", "c", "huge"], backend, memory_limit=100)
        pool.start()
        await use(pool, "a")
        await use(pool, "b")  # 60 + 50 > 100: a goes
        await settle(pool)
        assert states(pool)["a"] == "unloaded"
        await use(pool, "c")  # 50 + 30 fits: nothing goes
        await settle(pool)
        assert states(pool) == {"a": "unloaded", "b": "loaded", "c": "loaded", "huge": "unloaded"}
        with pytest.raises(ModelTooLarge) as refused:
            await pool.acquire("huge")
        assert refused.value.status == 400 and "--memory-limit" in str(refused.value)
        assert backend.loads("huge") == 0 and states(pool)["b"] == "loaded"  # nothing evicted for it
        assert backend.peak_bytes <= 100
        await pool.close()

    asyncio.run(main())


def test_a_load_measured_over_its_estimate_evicts_idle_models_and_one_over_the_limit_is_refused():
    async def main():
        backend = FakeBackend(sizes={"a": 60, "b": 30, "c": 10}, measured={"b": 80, "c": 130})
        pool = make_pool("abc", backend, memory_limit=100)
        pool.start()
        await use(pool, "a")
        await use(pool, "b")  # estimated 30 (fits beside a), measured 80: a goes once b is idle
        await settle(pool)
        assert states(pool)["a"] == "unloaded" and pool.entries["b"].bytes == 80
        with pytest.raises(ModelTooLarge):
            await pool.acquire("c")  # measured 130 > 100 after its load: unloaded, and the waiter told why
        await settle(pool)
        assert states(pool)["c"] == "unloaded"
        with pytest.raises(ModelTooLarge):
            await pool.acquire("c")  # now known: refused without loading it again
        assert backend.loads("c") == 1
        await pool.close()

    asyncio.run(main())


def test_a_failed_load_fails_its_waiters_and_the_next_request_tries_again():
    async def main():
        backend = FakeBackend(load_s=0.2)
        backend.fail.add("b")
        pool = make_pool("ab", backend)
        pool.start()
        results = await asyncio.gather(*(pool.acquire("b") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, ModelUnavailable) and "b is broken" in str(r) for r in results)
        assert backend.loads("b") == 1 and pool.entries["b"].error and states(pool)["b"] == "unloaded"
        backend.fail.clear()
        await use(pool, "b")
        assert states(pool)["b"] == "loaded" and pool.entries["b"].error is None
        await pool.close()

    asyncio.run(main())


def test_a_dead_engine_unloads_its_model_and_the_next_request_loads_it_again():
    async def main():
        backend = FakeBackend()
        pool = make_pool("ab", backend)
        pool.start()
        await use(pool, "a")
        loaded = pool.entries["a"].loaded
        loaded.engine.dead = "the engine process exited (code -9)"
        threading.Thread(target=backend.on_dead[id(loaded)], args=(loaded.engine.dead,)).start()  # reader thread
        await asyncio.sleep(0.05)
        await settle(pool)
        assert states(pool)["a"] == "unloaded" and "code -9" in pool.entries["a"].error
        await use(pool, "a")
        assert backend.loads("a") == 2 and states(pool)["a"] == "loaded"
        await pool.close()

    asyncio.run(main())


def test_model_args_and_body_model():
    a = parse_model_arg("small=/models/x.gguf")
    assert (a.name, a.path, a.named) == ("small", "/models/x.gguf", True)
    b = parse_model_arg("/models/x.gguf")
    assert (b.name, b.path, b.named) == ("/models/x.gguf", "/models/x.gguf", False)
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match="two models are named"):
        parse_model_args(["a=/x", "a=/y"])
    from tokenmill.cli import build_parser
    from tokenmill.server.multi_launch import split_models

    one = build_parser().parse_args(["serve", "--model", "/models/x.gguf"])
    assert len(split_models(one)) == 1 and one.model == "/models/x.gguf" and one.served_model_name is None
    named = build_parser().parse_args(["serve", "--model", "small=/models/x.gguf"])
    split_models(named)
    assert named.model == "/models/x.gguf" and named.served_model_name == ["small"]
    none = build_parser().parse_args(["serve"])
    assert split_models(none) == [] and none.model is None
    two = build_parser().parse_args(["serve", "--model", "a=/x", "--model", "/y", "--keep-alive", "never"])
    assert [m.name for m in split_models(two)] == ["a", "/y"] and two.keep_alive is None
    assert model_of(b'{"model": "m", "prompt": "x"}') == "m"
    assert model_of(b'{"prompt": "x"}') is None and model_of(b"not json") is None and model_of(b'{"model": 3}') is None


def outer(pool: ModelPool, api_key: str | None = None):
    return build_multi_app(pool, ServerSettings(list(pool.entries), api_key=api_key, ui=False))


def test_the_dispatcher_routes_by_model_replays_the_body_and_lists_states():
    async def main():
        backend = FakeBackend()
        pool = make_pool("ab", backend, max_loaded=1)
        app, _ = outer(pool, api_key="k")
        pool.start()
        auth = [(b"authorization", b"Bearer k")]
        status, body = await call(app, "POST", "/v1/completions", b'{"model": "a"}')
        assert status == 401  # the guard stands in front
        status, body = await call(app, "POST", "/v1/completions", b'{"model": "b", "prompt": "hi"}', auth)
        assert status == 200 and json.loads(body) == {"model": "b", "body": '{"model": "b", "prompt": "hi"}',
                                                      "path": "/v1/completions"}
        status, body = await call(app, "POST", "/v1/chat/completions", b'{"messages": []}', auth)
        assert status == 200 and json.loads(body)["model"] == "a"  # no model: the default, the first
        await settle(pool)
        status, body = await call(app, "GET", "/v1/models", headers=auth)
        cards = {c["id"]: c for c in json.loads(body)["data"]}
        assert cards["a"]["status"] == "loaded" and cards["b"]["status"] == "unloaded" and cards["a"]["default"]
        status, body = await call(app, "POST", "/v1/completions", b'{"model": "nope"}', auth)
        error = json.loads(body)["error"]
        assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        status, body = await call(app, "GET", "/v1/models/nope", headers=auth)
        assert status == 404
        status, body = await call(app, "POST", "/v1/messages", b'{"model": "nope"}', auth)
        assert status == 404 and json.loads(body)["type"] == "error"  # Anthropic's shape on its route
        status, body = await call(app, "GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        await call(app, "POST", "/v1/completions", b'{"model": "b"}', auth)
        await settle(pool)
        status, body = await call(app, "GET", "/ui/stats", headers=auth)  # the dashboard's polling
        assert status == 200 and json.loads(body)["status"] == "unloaded"
        await settle(pool)
        assert states(pool) == {"a": "unloaded", "b": "loaded"}  # it did not load the default model
        await pool.close()

    asyncio.run(main())


def test_a_streaming_response_keeps_its_model_busy_until_it_ends():
    async def main():
        backend = FakeBackend()
        gate = asyncio.Event()
        backend.gates["a"] = gate
        pool = make_pool("ab", backend, max_loaded=1)
        app, _ = outer(pool)
        pool.start()
        streaming = asyncio.ensure_future(call(app, "POST", "/v1/completions", b'{"model": "a"}'))
        await asyncio.sleep(0.2)
        assert pool.entries["a"].in_flight == 1
        other = asyncio.ensure_future(call(app, "POST", "/v1/completions", b'{"model": "b"}'))
        await asyncio.sleep(0.3)
        assert not other.done() and states(pool) == {"a": "loaded", "b": "unloaded"}  # a still streams
        gate.set()
        assert (await streaming)[0] == 200
        status, body = await asyncio.wait_for(other, 5)
        assert status == 200 and json.loads(body)["model"] == "b" and states(pool)["a"] == "unloaded"
        await pool.close()

    asyncio.run(main())


def test_metrics_of_every_loaded_model_merge_into_one_valid_exposition():
    async def main():
        backend = FakeBackend()
        pool = make_pool("ab", backend)
        app, metrics = outer(pool)
        pool.start()
        await use(pool, "a")
        await use(pool, "b")
        for name in "ab":  # each model's own ServerMetrics, as the real backend makes them
            m = ServerMetrics(name)
            m.on_added(7 if name == "a" else 11)
            pool.entries[name].loaded.registry = m.registry
        await call(app, "POST", "/v1/completions", b'{"model": "zzz"}')  # one 404 at the door
        status, text = await call(app, "GET", "/metrics")
        assert status == 200
        text = text.decode()
        types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))  # one HELP/TYPE per family, however many models
        families = {f.name: f for f in text_string_to_metric_families(text)}
        prompt = {s.labels["model_name"]: s.value for s in families["tokenmill_prompt_tokens"].samples
                  if s.name.endswith("_total")}
        assert prompt == {"a": 7.0, "b": 11.0}
        loaded = {s.labels["model_name"]: s.value for s in families["tokenmill_model_state"].samples
                  if s.labels["state"] == "loaded"}
        assert loaded == {"a": 1.0, "b": 1.0}
        rejected = [s for s in families["tokenmill_pool_requests_rejected"].samples if s.name.endswith("_total")]
        assert [(s.labels["status"], s.value) for s in rejected] == [("404", 1.0)]
        await pool.close()

    asyncio.run(main())
