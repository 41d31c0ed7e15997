"""Disaggregated serving for real: `tokenmill serve` producer and consumer processes behind `tokenmill router
--prefill --decode`, against one colocated server on the same weights (float32, greedy or seeded): the same answers,
the KV shipped and taken (metrics on every side), the consumer computing only what did not arrive; a producer or a
consumer that dies costs the client nothing but time, and leaves no block in use. Over HTTP, a client steers none of
it: a producer ships only to its kv_peers (the operator's list, extended by POST /admin/kv_peers), a consumer
request claims a transfer only with the producer's transfer_token, and loaded KV answers prefix lookups only
within its request's cache_salt."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from tests.router.test_router import H, start_router, stop
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow
PROMPT = "The history of the city of Paris begins with a small fishing village on an island in the Seine. " * 6
SECRET = "pd-serving-test-secret-0123456789"
ADMIN = {"Authorization": "Bearer pd-admin-key"}


def flags(model) -> list[str]:
    return ["--model", str(model), "--kv-cache-memory", "32MiB", "--threads", "1"]


def kv_config(connector: str, role: str, shm_dir) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_port": 0, "shm_dir": str(shm_dir),
                       "kv_secret": SECRET})


def producer_flags(model, connector: str, shm_dir) -> tuple[str, ...]:
    """A producer whose operator adds its consumers through the admin API once they are up (their ports are free
    ones)."""
    return (*flags(model), "--kv-transfer-config", kv_config(connector, "kv_producer", shm_dir),
            "--admin-api-key", ADMIN["Authorization"][7:])


def kv_address(consumer) -> str:
    """Where a consumer receives KV, as the router names it: its URL's host, its kv_port."""
    port = httpx.get(consumer.url + "/v1/kv_transfer").json()["kv_port"]
    return f"{urlparse(consumer.url).hostname}:{port}"


def allow(producer, *consumers) -> None:
    for consumer in consumers:
        r = httpx.post(producer.url + "/admin/kv_peers", json={"address": kv_address(consumer)}, headers=ADMIN)
        assert r.status_code == 200, r.text


def metric(url: str, name: str, **labels: str) -> float:
    """A series' value in a server's /metrics (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(part in (m.group(1) or "") for part in want.split(",") if part):
            return float(m.group(2))
    return 0.0


@pytest.fixture(scope="module", params=["tcp", "shm"])
def deployment(request, tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("pd")
    model = make_tiny_model(tmp, num_heads=4, num_kv_heads=2)
    shm = tmp / "shm"
    specs = [producer_flags(model, request.param, shm),
             (*flags(model), "--kv-transfer-config", kv_config(request.param, "kv_consumer", shm)),
             tuple(flags(model))]
    with ThreadPoolExecutor(3) as pool:
        producer, consumer, colocated = pool.map(lambda f: start_server(*f, api_key=None), specs)
    if request.param == "tcp":
        allow(producer, consumer)
    router, url = start_router([], "--prefill", producer.url, "--decode", consumer.url)
    yield {"producer": producer, "consumer": consumer, "colocated": colocated, "router": url, "model": model,
           "connector": request.param}
    stop(router)
    for s in (producer, consumer, colocated):
        s.stop()


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=120)


def test_answers_are_the_colocated_answers_and_the_kv_is_shipped_not_computed(deployment):
    d = deployment
    router, consumer, producer = d["router"], d["consumer"].url, d["producer"].url
    computed = metric(consumer, "tokenmill_prefill_tokens_computed_total")
    bodies = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
              ("/v1/chat/completions", {"messages": [{"role": "system", "content": PROMPT},
                                                     {"role": "user", "content": "Tell me more."}],
                                        "max_tokens": 12, "temperature": 0}),
              ("/v1/completions", {"prompt": PROMPT + "And", "max_tokens": 8, "n": 2, "temperature": 1.0,
                                   "seed": 5})]
    for path, body in bodies:
        got, ref = post(router, path, body, H), post(d["colocated"].url, path, body)
        assert got.status_code == 200, got.text
        assert got.headers["x-tokenmill-kv-transfer"] == "sent"
        assert got.json()["choices"] == ref.json()["choices"]
        assert got.json()["usage"]["prompt_tokens"] == ref.json()["usage"]["prompt_tokens"]
    # each request computed only its last prompt token on the consumer (the n = 2 one: one per sample); if not, what
    # the consumer's connector saw says why (a claim missed or refused, a transfer dropped)
    outcomes = {o: metric(consumer, "tokenmill_kv_transfers_total", outcome=o)
                for o in ("received", "missed", "refused_claim", "dropped")}
    assert metric(consumer, "tokenmill_prefill_tokens_computed_total") - computed == 4, outcomes
    sent = metric(producer, "tokenmill_kv_transfer_bytes_total", direction="sent")
    assert sent > 0 and sent == metric(consumer, "tokenmill_kv_transfer_bytes_total", direction="received")
    assert metric(consumer, "tokenmill_kv_transfer_loaded_tokens_total") > 0
    assert metric(router, "tokenmill_router_pd_requests_total", outcome="sent") == 3
    assert metric(router, "tokenmill_router_pd_first_decode_seconds_count") == 3
    for url in (producer, consumer):
        assert metric(url, "tokenmill_kv_cache_usage_ratio") == 0.0
        assert metric(url, "tokenmill_kv_transfer_buffered_bytes") == 0.0


def test_a_stream_passes_through_from_the_decode_instance(deployment):
    d = deployment
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    ref = post(d["colocated"].url, "/v1/completions", body).json()["choices"][0]["text"]
    with httpx.stream("POST", d["router"] + "/v1/completions", json={**body, "stream": True}, headers=H,
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-tokenmill-backend"] == d["consumer"].url
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == ref


def test_a_bad_request_gets_the_prefill_instances_400_and_no_decode_runs(deployment):
    d = deployment
    runs = metric(d["router"], "tokenmill_router_pd_first_decode_seconds_count")
    r = post(d["router"], "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": -1}, H)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert metric(d["router"], "tokenmill_router_pd_first_decode_seconds_count") == runs


def test_kv_transfer_params_are_refused_where_they_cannot_be_honoured(deployment):
    d = deployment
    take = {"do_remote_prefill": True, "transfer_id": "x1"}
    ship = {"do_remote_decode": True, "transfer_id": "x1", "remote_host": "127.0.0.1", "remote_port": 9}
    for url, params, message in ((d["colocated"].url, take, "without --kv-transfer-config"),
                                 (d["producer"].url, take, "not a consumer"),
                                 (d["consumer"].url, ship, "not a producer")):
        r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": params})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert message in r.json()["error"]["message"]


def ship(d: dict, prompt: str, transfer_id: str) -> dict:
    """The prefill half, as the router sends it: the producer's answer's kv_transfer_params."""
    params = {"do_remote_decode": True, "transfer_id": transfer_id}
    if d["connector"] == "tcp":
        host, port = kv_address(d["consumer"]).rsplit(":", 1)
        params.update(remote_host=host, remote_port=int(port))
    r = post(d["producer"].url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                     "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def claim(shipped: dict, transfer_id: str | None = None) -> dict:
    return {"do_remote_prefill": True, "transfer_id": transfer_id or shipped["transfer_id"],
            "transfer_token": shipped["transfer_token"]}


def test_a_producer_ships_only_to_its_kv_peers(deployment):
    """A client naming any other destination gets a 400 and the producer connects nowhere; the operator adds a
    consumer with POST /admin/kv_peers (admin key only); even then a listener without kv_secret gets no KV."""
    d = deployment
    if d["connector"] != "tcp":
        pytest.skip("kv_peers are tcp destinations (shm ships into its directory)")
    producer, consumer = d["producer"].url, d["consumer"]
    assert httpx.get(producer + "/admin/kv_peers", headers=ADMIN).json() == {"kv_peers": [kv_address(consumer)]}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    body = {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "transfer_id": "elsewhere", "remote_host": "127.0.0.1",
        "remote_port": listener.getsockname()[1]}}
    try:
        r = post(producer, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert "kv_peers" in r.json()["error"]["message"] and address in r.json()["error"]["message"]
        with pytest.raises(TimeoutError):
            listener.accept()  # no connection was even tried
        assert httpx.post(producer + "/admin/kv_peers", json={"address": address}).status_code == 401
        assert httpx.post(consumer.url + "/admin/kv_peers", json={"address": address},
                          headers=ADMIN).status_code == 404  # no --admin-api-key there: no admin API
        for bad in ({"address": "127.0.0.1"}, {"address": 14579}, {"address": "h:99999"}, {"host": "h:1"}):
            r = httpx.post(producer + "/admin/kv_peers", json=bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] in ("address", "host"), r.text
        r = httpx.post(producer + "/admin/kv_peers", json={"address": address}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["kv_peers"] == [kv_address(consumer), address]
        listener.settimeout(30)
        impostor = threading.Thread(target=lambda: listener.accept()[0].close())  # holds no kv_secret
        impostor.start()
        r = post(producer, "/v1/completions", body)
        impostor.join(30)
        assert r.status_code == 200 and r.json()["kv_transfer_params"]["status"] == "failed"
    finally:
        listener.close()


def test_a_consumer_claims_a_transfer_only_with_the_producers_token(deployment):
    d = deployment
    prompt = PROMPT + " Who may take this KV?"
    shipped, other = ship(d, prompt, "claim-1"), ship(d, prompt, "claim-2")
    assert shipped["status"] == "sent" and shipped["transfer_id"] == "claim-1"
    assert shipped["transfer_token"] != other["transfer_token"]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    no_token = {"do_remote_prefill": True, "transfer_id": "claim-1"}
    for params, message in ((no_token, "transfer_token is required"),
                            (claim(other, "claim-1"), "not the producer's token"),  # a token of one's own transfer
                            ({**no_token, "transfer_token": "0" * 64}, "not the producer's token")):
        r = post(d["consumer"].url, "/v1/completions", {**body, "kv_transfer_params": params})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert message in r.json()["error"]["message"]
    loaded = metric(d["consumer"].url, "tokenmill_kv_transfer_loaded_tokens_total")
    r = post(d["consumer"].url, "/v1/completions", {**body, "kv_transfer_params": claim(shipped)})
    assert r.status_code == 200
    assert r.json()["choices"] == post(d["colocated"].url, "/v1/completions", body).json()["choices"]
    assert metric(d["consumer"].url, "tokenmill_kv_transfer_loaded_tokens_total") > loaded


def test_loaded_kv_answers_prefix_lookups_only_within_its_cache_salt(deployment):
    """KV a producer request pushed must not become another tenant's cache hit: without a cache_salt it is shared
    with no one, with one only with requests of that salt."""
    d = deployment

    def cached_tokens(prompt: str, salt: str | None = None, transfer: dict | None = None) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt, "kv_transfer_params": transfer}
        r = post(d["consumer"].url, "/v1/completions", {k: v for k, v in body.items() if v is not None})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    unsalted = "A prompt whose KV arrives from a producer, with no cache salt. " * 8
    cached_tokens(unsalted, transfer=claim(ship(d, unsalted, "salt-0")))
    assert cached_tokens(unsalted) == 0
    salted = "A prompt whose KV arrives from a producer, for tenant a alone. " * 8
    cached_tokens(salted, "tenant-a", claim(ship(d, salted, "salt-a")))
    assert cached_tokens(salted, "tenant-b") == 0 and cached_tokens(salted) == 0
    assert cached_tokens(salted, "tenant-a") > 0


def test_a_dead_producer_or_consumer_costs_time_not_the_answer(tmp_path_factory):
    """Two consumers; one dies after the router learnt its receiver: the producer's transfer to it fails, the
    request goes to the other consumer, which computes the prompt. Then the producer dies: the request still gets
    its answer, computed whole by a consumer. Nothing hangs, no block stays in use."""
    from tests.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("pd-fail")
    model = make_tiny_model(tmp, num_heads=4, num_kv_heads=2)
    specs = [producer_flags(model, "tcp", tmp),
             (*flags(model), "--kv-transfer-config", kv_config("tcp", "kv_consumer", tmp)),
             (*flags(model), "--kv-transfer-config", kv_config("tcp", "kv_consumer", tmp)),
             tuple(flags(model))]
    with ThreadPoolExecutor(4) as pool:
        producer, first, second, colocated = pool.map(lambda f: start_server(*f, api_key=None), specs)
    allow(producer, first, second)
    # health checks far apart: the router learns of each death from the failed request itself
    router, url = start_router([], "--prefill", producer.url, "--decode", first.url, "--decode", second.url,
                               "--policy", "round_robin", "--health-interval", "600")
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        ref = post(colocated.url, "/v1/completions", body).json()["choices"][0]["text"]
        served = [post(url, "/v1/completions", body, H) for _ in range(2)]  # one per consumer
        assert {r.headers["x-tokenmill-backend"] for r in served} == {first.url, second.url}
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        for _ in range(2):  # whichever the turn is: the one that reaches the dead consumer is sent on
            r = post(url, "/v1/completions", body, H)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
            assert r.headers["x-tokenmill-backend"] == second.url
        assert metric(url, "tokenmill_router_pd_requests_total", outcome="failed") == 1
        assert metric(producer.url, "tokenmill_kv_transfers_total", outcome="send_failed") == 1
        producer.proc.send_signal(signal.SIGKILL)
        producer.proc.wait(10)
        computed = metric(second.url, "tokenmill_prefill_tokens_computed_total")
        r = post(url, "/v1/completions", body, H)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        assert r.headers["x-tokenmill-kv-transfer"] == "prefill_error"
        assert metric(second.url, "tokenmill_prefill_tokens_computed_total") - computed > 1
        assert metric(second.url, "tokenmill_kv_cache_usage_ratio") == 0.0
        assert metric(second.url, "tokenmill_num_requests_running") == 0.0
    finally:
        stop(router)
        for s in (producer, first, second, colocated):
            s.stop()
