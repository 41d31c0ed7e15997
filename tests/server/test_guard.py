"""Unit tests for the ASGI guard (server/guard.py, server/asgi.py): keys, body size, load shedding and the JSON 500,
driven in process with raw ASGI messages around a tiny app."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from tokenmill.errors import ServerOverloaded
from tokenmill.server.asgi import bearer_matches, drain_body
from tokenmill.server.errors import APIError, classify
from tokenmill.server.guard import Guard
from tokenmill.server.settings import ServerSettings

API, ADMIN, METRICS = "client-key", "admin-key", "metrics-key"
LIMIT = 1024


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    app_calls: int
    body_seen: bytes = b""
    rejected: list[int] = field(default_factory=list)

    def json(self) -> dict:
        return json.loads(self.body)


def make_settings(**keys) -> ServerSettings:
    return ServerSettings(["m"], **{"max_request_bytes": LIMIT, **keys})


def call(settings: ServerSettings, path: str, method: str = "POST", key: str | None = None,
         chunks: tuple[bytes, ...] = (b"",), content_length: int | str | None = None, app=None,
         overloaded=lambda: None) -> Response:
    """Send one request through Guard(app) and collect the answer, the app's calls and on_reject's statuses."""
    rejected: list[int] = []
    state = {"calls": 0, "seen": b""}

    async def ok_app(scope, receive, send):
        """Reads the whole body, answers 200; an APIError from receive is answered the way the real app does."""
        state["calls"] += 1
        try:
            while True:
                message = await receive()
                state["seen"] += message.get("body", b"")
                if not message.get("more_body"):
                    break
        except APIError as exc:
            status, body = classify(exc)
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def counted(scope, receive, send):
        state["calls"] += 1
        await app(scope, receive, send)

    headers = []
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    guard = Guard(ok_app if app is None else counted, settings, rejected.append, overloaded)
    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    resp_headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return Response(start["status"], resp_headers, body, state["calls"], state["seen"], rejected)


def test_v1_needs_client_key():
    """/v1/* refuses a missing or wrong key with 401 + WWW-Authenticate, and runs the app with the right one."""
    settings = make_settings(api_key=API)
    missing = call(settings, "/v1/completions")
    assert missing.status == 401 and missing.app_calls == 0
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert "missing API key" in missing.json()["error"]["message"]
    wrong = call(settings, "/v1/completions", key="nope")
    assert wrong.status == 401 and "invalid API key" in wrong.json()["error"]["message"]
    assert call(settings, "/v1/completions", key=ADMIN).status == 401
    ok = call(settings, "/v1/completions", key=API)
    assert ok.status == 200 and ok.app_calls == 1


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/ui/stats", "/v1/models"])
def test_other_client_paths_need_client_key(path):
    """Every client area, not only generation, is behind the client key."""
    settings = make_settings(api_key=API)
    assert call(settings, path, method="GET").status == 401
    assert call(settings, path, method="GET", key=API).status == 200


def test_open_paths_and_no_key_server():
    """/health and the UI stay open; a server without --api-key leaves /v1 open."""
    assert call(make_settings(api_key=API), "/health", method="GET").status == 200
    assert call(make_settings(api_key=API), "/", method="GET").status == 200
    assert call(make_settings(), "/v1/completions").status == 200


@pytest.mark.parametrize("path", ["/admin/reset_prefix_cache", "/admin"])
def test_admin_is_404_without_admin_key(path):
    """Without --admin-api-key the admin area does not exist: 404 whatever key is sent."""
    settings = make_settings(api_key=API)
    for key in (None, API, ADMIN):
        resp = call(settings, path, key=key)
        assert resp.status == 404 and resp.app_calls == 0
        assert resp.json()["error"]["type"] == "not_found_error"


def test_admin_refuses_client_key():
    """With --admin-api-key, the client key (or none) gets 401; only the admin key runs the app."""
    settings = make_settings(api_key=API, admin_api_key=ADMIN)
    assert call(settings, "/admin/x", key=API).status == 401
    resp = call(settings, "/admin/x")
    assert resp.status == 401 and "admin API key" in resp.json()["error"]["message"]
    ok = call(settings, "/admin/x", key=ADMIN)
    assert ok.status == 200 and ok.app_calls == 1


def test_admin_key_does_not_open_v1():
    """Each area has its own key: the admin key is no client key."""
    settings = make_settings(api_key=API, admin_api_key=ADMIN)
    assert call(settings, "/v1/completions", key=ADMIN).status == 401


def test_metrics_open_without_metrics_key():
    """/metrics is open (as scrapers expect) unless --metrics-api-key is set, even when --api-key is."""
    assert call(make_settings(api_key=API), "/metrics", method="GET").status == 200


def test_metrics_key_when_set():
    """With --metrics-api-key, /metrics needs exactly that key; the client key does not open it."""
    settings = make_settings(api_key=API, metrics_api_key=METRICS)
    assert call(settings, "/metrics", method="GET").status == 401
    assert call(settings, "/metrics", method="GET", key=API).status == 401
    assert call(settings, "/metrics", method="GET", key=METRICS).status == 200


def test_content_length_over_limit_is_413_before_app():
    """A declared Content-Length past --max-request-bytes is a 413 without running the app."""
    resp = call(make_settings(), "/v1/completions", content_length=LIMIT + 1, chunks=(b"x" * (LIMIT + 1),))
    assert resp.status == 413 and resp.app_calls == 0
    assert resp.json()["error"]["code"] == "request_too_large"
    assert str(LIMIT) in resp.json()["error"]["message"]
    assert resp.rejected == [413]


def test_content_length_at_limit_passes():
    """A body of exactly the limit is accepted and reaches the app whole."""
    body = b"y" * LIMIT
    resp = call(make_settings(), "/v1/completions", content_length=LIMIT, chunks=(body,))
    assert resp.status == 200 and resp.body_seen == body


def test_invalid_content_length_is_400():
    """A Content-Length that is not a number is a 400, not a crash."""
    resp = call(make_settings(), "/v1/completions", content_length="lots")
    assert resp.status == 400 and resp.app_calls == 0
    assert resp.rejected == [400]


def test_chunked_body_growing_past_limit_is_413():
    """A body without Content-Length that grows past the limit is cut off with 413 as it arrives."""
    chunks = (b"a" * 600, b"b" * 600, b"c" * 10)
    resp = call(make_settings(), "/v1/completions", chunks=chunks)
    assert resp.status == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert len(resp.body_seen) <= LIMIT


def test_chunked_body_past_limit_is_413_even_when_the_app_does_not_catch_it():
    """The guard's refusal raised inside an app's receive keeps its 413 if the app lets it escape (not a 500)."""
    async def plain_app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    resp = call(make_settings(), "/v1/completions", chunks=(b"a" * 600, b"b" * 600, b"c"), app=plain_app)
    assert resp.status == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert resp.rejected == [413]


def test_chunked_body_within_limit_passes():
    """Chunks that add up to no more than the limit reach the app unchanged."""
    chunks = (b"a" * 500, b"b" * 524)
    resp = call(make_settings(), "/v1/completions", chunks=chunks)
    assert resp.status == 200 and resp.body_seen == b"".join(chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_overloaded_sheds_generate_with_429(path):
    """When `overloaded` names an error, generate POSTs get 429 + Retry-After without running the app."""
    full = lambda: ServerOverloaded("the waiting queue is full")  # noqa: E731
    resp = call(make_settings(), path, overloaded=full)
    assert resp.status == 429 and resp.app_calls == 0
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "server_overloaded"
    assert resp.rejected == [429]


def test_overloaded_spares_other_requests():
    """Shedding touches only generate POSTs: other paths and methods still run."""
    full = lambda: ServerOverloaded("full")  # noqa: E731
    assert call(make_settings(), "/v1/models", method="GET", overloaded=full).status == 200
    assert call(make_settings(), "/tokenize", overloaded=full).status == 200
    assert call(make_settings(), "/v1/completions", method="GET", overloaded=full).status == 200


def test_overloaded_not_consulted_before_key_check():
    """An unauthenticated request is refused for its key, not counted as shed load."""
    full = lambda: ServerOverloaded("full")  # noqa: E731
    resp = call(make_settings(api_key=API), "/v1/completions", overloaded=full)
    assert resp.status == 401 and resp.rejected == [401]


def test_on_reject_called_with_each_status():
    """on_reject hears every status the guard answers itself, and nothing for requests the app answers."""
    settings = make_settings(api_key=API, admin_api_key=ADMIN)
    assert call(settings, "/v1/completions").rejected == [401]
    assert call(make_settings(api_key=API), "/admin/x").rejected == [404]
    assert call(settings, "/v1/completions", key=API, content_length=LIMIT * 2).rejected == [413]
    assert call(settings, "/v1/completions", key=API).rejected == []


def test_app_exception_becomes_json_500():
    """An exception escaping the app is a JSON 500 naming only its type, and counted."""
    async def broken(scope, receive, send):
        raise RuntimeError("secret internals")

    resp = call(make_settings(), "/v1/completions", app=broken)
    assert resp.status == 500 and resp.app_calls == 1
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["code"] == "internal_error"
    assert "RuntimeError" in error["message"] and "secret" not in error["message"]
    assert resp.rejected == [500]


def test_exception_after_response_started_sends_nothing_more():
    """Once the app has started its answer, a late exception cannot send a second response start."""
    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("late")

    resp = call(make_settings(), "/v1/completions", app=half)
    assert resp.status == 200 and resp.rejected == []


def test_non_http_scopes_pass_through():
    """Lifespan and other non-HTTP scopes go straight to the app."""
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    guard = Guard(app, make_settings(api_key=API), lambda s: None, lambda: None)
    asyncio.run(guard({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_bearer_matches():
    """Only 'Bearer <key>' (scheme case-insensitive, padding stripped) matches; other schemes and keys do not."""
    assert bearer_matches(b"Bearer k1", "k1")
    assert bearer_matches(b"bearer  k1 ", "k1")
    assert not bearer_matches(b"Bearer k2", "k1")
    assert not bearer_matches(b"Basic k1", "k1")
    assert not bearer_matches(b"k1", "k1")
    assert not bearer_matches(b"", "k1")


def test_drain_body():
    """drain_body reads a body to its end (True), and reports a disconnect before it (False)."""
    def receiver(messages):
        async def receive():
            return messages.pop(0)
        return receive

    whole = [{"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.request", "body": b"b"}]
    assert asyncio.run(drain_body(receiver(whole), 10)) is True
    assert whole == []
    cut = [{"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.disconnect"}]
    assert asyncio.run(drain_body(receiver(cut), 10)) is False
