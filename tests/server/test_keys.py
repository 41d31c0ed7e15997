"""Each area of a real server has its own key: clients (/v1/*), the operator (/admin/*, off without
--admin-api-key) and scrapers (/metrics, with --metrics-api-key); and a client's `priority` stays inside
--client-priority-range."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, start_server

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-secret"
METRICS_KEY = "metrics-secret"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed():
    s = start_server("--admin-api-key", ADMIN_KEY, "--metrics-api-key", METRICS_KEY,
                     "--client-priority-range=-2:5", "--scheduling-policy", "priority")
    try:
        yield s
    finally:
        s.stop()


def test_admin_endpoints_are_off_without_an_admin_key(server):
    for headers in ({}, bearer(API_KEY)):
        r = httpx.get(server.url + "/admin/kv_peers", headers=headers)
        assert r.status_code == 404, r.text
        assert "--admin-api-key" in r.json()["error"]["message"]


def test_metrics_stay_open_without_a_metrics_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_the_clients_key_never_opens_admin_endpoints(keyed):
    for headers in ({}, bearer(API_KEY), bearer(METRICS_KEY), bearer(ADMIN_KEY + "x")):
        r = httpx.get(keyed.url + "/admin/kv_peers", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        assert "admin API key" in r.json()["error"]["message"]
    # the admin key reaches the admin routes (this server has no KV connector: the route answers, not the guard)
    r = httpx.get(keyed.url + "/admin/kv_peers", headers=bearer(ADMIN_KEY))
    assert r.status_code != 401, r.text


def test_the_admin_key_is_not_a_client_key(keyed):
    r = httpx.get(keyed.url + "/v1/models", headers=bearer(ADMIN_KEY))
    assert r.status_code == 401
    assert httpx.get(keyed.url + "/v1/models", headers=bearer(API_KEY)).status_code == 200


def test_metrics_need_the_metrics_key_when_one_is_set(keyed):
    for headers in ({}, bearer(API_KEY), bearer(ADMIN_KEY)):
        r = httpx.get(keyed.url + "/metrics", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(keyed.url + "/metrics", headers=bearer(METRICS_KEY))
    assert r.status_code == 200 and "tokenmill_" in r.text


@pytest.mark.parametrize("priority,status", [(-2, 200), (5, 200), (-3, 400), (6, 400), (-1000000, 400)])
def test_priority_inside_the_operators_range(keyed, priority, status):
    body = {"model": keyed.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "priority": priority}
    r = httpx.post(keyed.url + "/v1/completions", json=body, headers=bearer(API_KEY), timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["param"] == "priority" and "--client-priority-range -2:5" in err["message"]
