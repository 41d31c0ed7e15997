"""The router places a request that names a model only on replicas whose /v1/models lists it (router/replicas.py,
router/forward.py), and lists the models of all its replicas. Scripted replicas (tests/router/fakes.py), a real
router app with its health loop."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.router.fakes import FakeReplica, Served
from tokenmill.router.app import build_router_app
from tokenmill.router.policies import make_policy
from tokenmill.router.replicas import ReplicaPool


@pytest.fixture(scope="module")
def replicas():
    made = [FakeReplica(models=["small"]), FakeReplica(models=["small", "big"]), FakeReplica()]
    yield made
    for r in made:
        r.stop()


@pytest.fixture(scope="module")
def router(replicas):
    pool = ReplicaPool([r.url for r in replicas], health_interval_s=0.1)
    served = Served(build_router_app(pool, make_policy("round_robin")), lifespan="on")
    deadline = time.monotonic() + 10
    while any(pool.backends[r.url].models is None for r in replicas[:2]):  # the first health checks read them
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield served.url, pool
    served.stop()


def placed(url: str, model: str | None, n: int = 6) -> list[str]:
    body = {"prompt": "hello", **({"model": model} if model else {})}
    out = []
    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out.append(r.headers["x-tokenmill-backend"])
    return out


def test_a_model_goes_only_to_replicas_that_list_it(router, replicas):
    url, pool = router
    small, both, unknown = (r.url for r in replicas)
    assert pool.backends[small].models == {"small"} and pool.backends[unknown].models is None
    assert set(placed(url, "big")) == {both, unknown}  # the one without a list may serve anything
    assert set(placed(url, "small")) == {small, both, unknown}
    assert set(placed(url, None)) == {small, both, unknown}  # no model: as before, any replica


def test_a_model_no_replica_lists_is_404_once_every_listing_is_known(router, replicas):
    url, pool = router
    pool.backends[replicas[2].url].models = frozenset({"other"})  # as if it listed its own
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "model": "huge"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "huge" in r.json()["error"]["message"]
    finally:
        pool.backends[replicas[2].url].models = None


def test_models_lists_every_replicas_models_once(router):
    url, _ = router
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 200
    assert sorted(card["id"] for card in r.json()["data"]) == ["big", "small"]
