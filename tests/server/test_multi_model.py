"""Several models in one real `tokenmill serve` (server/multi_app.py, server/model_pool.py): two tiny random models
(a Llama and a Qwen2, each its own engine process) under --max-loaded-models 1, so requests that alternate between
them evict one and load the other, with requests still arriving while that happens. The pool's logic edge by edge:
tests/server/test_model_pool.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.models.tiny import make_tiny_model
from tests.server.conftest import API_KEY, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    llama, qwen = make_tiny_model(root, arch="llama", seed=1), make_tiny_model(root, arch="qwen2", seed=2)
    s = start_server("--model", f"llama={llama}", "--model", f"qwen={qwen}", "--max-loaded-models", "1",
                     "--kv-cache-memory", "32MiB", "--threads", "1")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=180) as c:
        yield c


def statuses(http) -> dict[str, str]:
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return {card["id"]: card["status"] for card in r.json()["data"]}


def complete(http, model: str | None, prompt: str = "The capital of France is", stream: bool = False) -> str:
    """One greedy completion of 6 tokens (EOS ignored, so the text is never empty); its text."""
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": stream}
    if model is not None:
        body["model"] = model
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == (model or "llama")
        return r.json()["choices"][0]["text"]
    text, done = "", False
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert done
    return text


def engine_processes(server) -> int:
    """The server's children running an engine core (multiprocessing spawn)."""
    n = 0
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                n += b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                pass
    return n


def test_models_alternate_under_one_slot_with_their_states_listed(server, http):
    assert server.model == "llama, qwen"
    assert statuses(http) == {"llama": "loaded", "qwen": "unloaded"}  # the default loads before the ready line
    first = complete(http, None)  # no model: the default
    assert first
    qwen = complete(http, "qwen")
    assert qwen and statuses(http) == {"llama": "unloaded", "qwen": "loaded"}
    assert engine_processes(server) == 1
    assert "loading model qwen ..." in server.stderr() and "model qwen loaded in" in server.stderr()
    counted = re.search(r"model qwen loaded in [\d.]+ s \((\d+) MiB weights \+ KV cache\)", server.stderr())
    assert counted and int(counted.group(1)) >= 32  # the engine's KV bytes (--kv-cache-memory 32MiB) are counted
    assert complete(http, "llama") == first  # reloaded, it answers exactly as before (greedy)
    assert statuses(http) == {"llama": "loaded", "qwen": "unloaded"}
    assert complete(http, "qwen", stream=True) == qwen
    r = http.post("/v1/completions", json={"model": "mistral", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/models/qwen").json()["status"] == "loaded"


def test_concurrent_requests_while_models_are_evicted_and_loaded_all_succeed(server, http):
    jobs = [("llama" if i % 2 else "qwen", i % 3 == 0) for i in range(16)]
    expected = {m: complete(http, m) for m in ("llama", "qwen")}
    loads_before = loads(http)
    with cf.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda job: (job[0], complete(http, job[0], stream=job[1])), jobs))
    assert len(texts) == len(jobs)
    for model, text in texts:
        assert text == expected[model], model  # every request answered, by the model it named
    after = loads(http)
    assert sum(after.values()) > sum(loads_before.values())  # the slot really changed hands under load
    deadline = time.monotonic() + 30
    while engine_processes(server) != 1:  # an evicted engine may still be on its way out
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert list(statuses(http).values()).count("loaded") == 1
    assert http.get("/health").json()["status"] == "ok"


def pipes(server) -> int:
    """The server process's open pipe ends (an engine's are its two pipes' ends; stdout is one more)."""
    fd_dir = Path(f"/proc/{server.proc.pid}/fd")
    n = 0
    for fd in fd_dir.iterdir():
        try:
            n += fd.readlink().name.startswith("pipe:")
        except FileNotFoundError:
            pass
    return n


def test_unloaded_models_leave_nothing_behind_in_the_server(server, http):
    """Each unload frees the engine's objects in the server (its pipes, tokenizer, app): found kept alive by
    FastAPI's module-level caches of endpoint callables (server/pool_backend.py forget_unloaded_apps) and by the
    scope uvicorn keeps per connection (server/multi_app.py hands each model's app a copy)."""
    complete(http, "qwen")
    complete(http, "llama")
    time.sleep(1.0)
    before = pipes(server)
    for _ in range(2):
        complete(http, "qwen")
        complete(http, "llama")
    time.sleep(1.0)
    assert pipes(server) == before  # 4 more a load if an unloaded engine stayed referenced


def loads(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert "tokenmill_requests" in families  # the loaded model's own metrics, merged in
    return {s.labels["model_name"]: s.value for s in families["tokenmill_model_loads"].samples
            if s.labels["outcome"] == "ok" and s.name.endswith("_total")}


def test_a_killed_engine_unloads_its_model_and_the_server_carries_on(server, http):
    expected = complete(http, "llama")
    assert statuses(http)["llama"] == "loaded"
    os.kill(server.engine_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while statuses(http)["llama"] != "unloaded":
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.1)
    assert http.get("/health").status_code == 200
    assert "engine process exited" in http.get("/v1/models/llama").json()["error"]
    assert complete(http, "llama") == expected  # loaded again, the same model


def test_sigterm_unloads_every_model_and_exits_0(server, http):
    complete(http, "qwen")
    assert engine_processes(server) == 1
    assert server.stop() == 0
    assert "unloading model qwen (the server is stopping)" in server.stderr()
