"""The router's guard (router/guard.py), on real router processes in front of a scripted replica (tests/router/
fakes.py): the admin endpoints open to the operator's key alone (and are off without one), /metrics behind its own
key, every key compared in constant time, bodies refused past --max-request-bytes on every route before they are
held, and client requests bounded by --max-connections."""

from __future__ import annotations

import hmac
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.fakes import FakeReplica, Served
from tests.router.test_router import ADMIN, ADMIN_KEY, H, start_router, stop
from tokenmill.router.app import backend_limits, build_router_app
from tokenmill.router.guard import GuardSettings
from tokenmill.router.policies import make_policy
from tokenmill.router.replicas import ReplicaPool

METRICS_KEY = "router-metrics-key"
M = {"Authorization": f"Bearer {METRICS_KEY}"}
LIMIT = 4096


@pytest.fixture(scope="module")
def fake():
    replica = FakeReplica()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def guarded(fake):
    proc, url = start_router([fake.url], "--policy", "round_robin", "--admin-api-key", ADMIN_KEY,
                             "--metrics-api-key", METRICS_KEY, "--max-request-bytes", "4KiB",
                             "--max-connections", "2")
    yield url
    stop(proc)


def error_of(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_admin_endpoints_open_to_the_admin_key_alone(guarded, fake):
    url = guarded
    for headers in ({}, H, {"Authorization": "Bearer wrong"}):  # the clients' key least of all
        r = httpx.get(url + "/admin/backends", headers=headers)
        assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
        assert httpx.post(url + "/admin/backends", json={"url": "http://127.0.0.1:9"}, headers=headers).status_code \
            == 401
    assert [b["url"] for b in httpx.get(url + "/admin/backends", headers=ADMIN).json()["backends"]] == [fake.url]
    assert httpx.post(url + "/admin/backends", json={"url": "http://127.0.0.1:9"}, headers=ADMIN).json() == \
        {"added": "http://127.0.0.1:9"}
    assert httpx.request("DELETE", url + "/admin/backends", json={"url": "http://127.0.0.1:9"},
                         headers=ADMIN).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=ADMIN).status_code == 401


def test_admin_endpoints_are_off_without_an_admin_key(fake):
    proc, url = start_router([fake.url], "--policy", "round_robin")
    try:
        for method in ("GET", "POST", "DELETE"):
            r = httpx.request(method, url + "/admin/backends", json={"url": "http://127.0.0.1:9"}, headers=H)
            assert r.status_code == 404 and "--admin-api-key" in error_of(r)["message"]
        assert httpx.get(url + "/health").json()["backends"] == 1  # nothing was added
    finally:
        stop(proc)


def test_the_admin_key_must_differ_from_the_clients_key():
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "router", "--backend", "http://127.0.0.1:9",
                        "--api-key", "same", "--admin-api-key", "same"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "--admin-api-key must differ from --api-key" in r.stderr


def test_metrics_need_their_key_when_one_is_given(guarded):
    for headers in ({}, H, ADMIN):
        r = httpx.get(guarded + "/metrics", headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = httpx.get(guarded + "/metrics", headers=M)
    assert r.status_code == 200 and "tokenmill_router_backend_in_flight" in r.text
    assert httpx.get(guarded + "/health").status_code == 200  # the load balancer's probe needs no key


def test_every_key_is_compared_in_constant_time(monkeypatch, fake):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    settings = GuardSettings(api_key="client", admin_api_key="admin", metrics_api_key="metrics")
    router = Served(build_router_app(ReplicaPool([fake.url]), make_policy("round_robin"), settings), lifespan="on")
    try:
        wrong = {"Authorization": "Bearer wrong"}
        for path, key in (("/v1/models", b"client"), ("/admin/backends", b"admin"), ("/metrics", b"metrics")):
            assert httpx.get(router.url + path, headers=wrong).status_code == 401
            assert (b"wrong", key) in calls, path
            right = {"Authorization": f"Bearer {key.decode()}"}
            assert httpx.get(router.url + path, headers=right).status_code != 401
            assert (key, key) in calls, path
    finally:
        router.stop()


def big_chunks(n: int):
    for _ in range(n):
        yield b"x" * 1024


def assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = error_of(r)
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]


def test_bodies_past_the_limit_are_refused_on_every_route(guarded, fake, tmp_path):
    big = {"prompt": "x" * (2 * LIMIT)}
    seen = len(fake.seen)
    for path, headers in (("/v1/completions", H), ("/v1/chat/completions", H), ("/admin/backends", ADMIN)):
        assert_too_large(httpx.post(guarded + path, json=big, headers=headers))  # said by its Content-Length
        assert_too_large(httpx.post(guarded + path, content=big_chunks(8), headers=headers))  # counted as it came
    assert len(fake.seen) == seen  # none of them reached the replica
    assert httpx.post(guarded + "/v1/completions", json={"prompt": "small"}, headers=H).status_code == 200
    tier_b = FakeReplica()
    cascade, cascade_url = start_router([], "--cascade", f"a={fake.url}", "--cascade", f"b={tier_b.url}",
                                        "--max-request-bytes", "4KiB")
    pd, pd_url = start_router([], "--prefill", fake.url, "--decode", tier_b.url, "--max-request-bytes", "4KiB")
    try:
        for url in (cascade_url, pd_url):
            assert_too_large(httpx.post(url + "/v1/completions", json=big, headers=H))
            assert_too_large(httpx.post(url + "/v1/completions", content=big_chunks(8), headers=H))
        assert len(fake.seen) == seen + 1 and tier_b.seen == []
    finally:
        stop(cascade)
        stop(pd)
        tier_b.stop()


def test_client_requests_past_max_connections_get_429_with_retry_after(guarded, fake):
    with ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(httpx.post, guarded + "/v1/completions", json={"prompt": "slow"}, headers=H, timeout=30)
                for _ in range(2)]
        deadline = time.monotonic() + 10
        while fake.seen.count("slow") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(guarded + "/v1/completions", json={"prompt": "one more"}, headers=H)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert error_of(r)["type"] == "server_overloaded" and "--max-connections" in error_of(r)["message"]
        assert httpx.get(guarded + "/health").status_code == 200  # probes are not client requests
        assert [f.result().status_code for f in slow] == [200, 200]
    assert httpx.post(guarded + "/v1/completions", json={"prompt": "after"}, headers=H).status_code == 200


def test_the_connections_toward_the_replicas_are_bounded():
    limits = backend_limits(32)
    assert limits.max_connections is not None and 32 <= limits.max_connections <= 64
    assert limits.max_keepalive_connections <= limits.max_connections


def test_bad_limits_are_refused_at_start():
    for args, message in ((["--max-connections", "0"], "--max-connections must be at least 1"),
                          (["--max-request-bytes", "0"], "--max-request-bytes must be at least 1")):
        r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "router", "--backend", "http://127.0.0.1:9",
                            *args], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 2 and message in r.stderr, r.stderr

