"""The ASGI guard in front of the router's routes: who may call what, how large a body may be, and how many client
requests run at once, all decided before a route runs. The body is read here, counted as it arrives, and refused
(413) the moment it passes --max-request-bytes: no route ever holds more than that.

- /v1/*: the clients' --api-key; each request holds one of --max-connections slots until its last byte is sent
  (past them: 429 with Retry-After).
- /admin/*: the operator's --admin-api-key only; without one the admin endpoints are off (404). The clients' key
  never opens them: a client that could add a backend would receive other clients' prompts and the backend key.
- /metrics: --metrics-api-key when given, else open. /health: always open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.router.errors import error_body
from tokenmill.server.asgi import bearer_matches, drain_body, replay

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # as `tokenmill serve --max-request-bytes`
DEFAULT_MAX_CONNECTIONS = 1024
ADMIN_OFF = ("the admin endpoints are off: start the router with --admin-api-key KEY (or $TOKENMILL_ADMIN_API_KEY) "
             "and send 'Authorization: Bearer KEY'")


@dataclass(frozen=True)
class GuardSettings:
    api_key: str | None = None
    admin_api_key: str | None = None
    metrics_api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be at least 1, got {self.max_request_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.admin_api_key and self.admin_api_key == self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key: the clients' key must not open /admin/*")


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    kind: str
    code: str | None = None
    close: bool = False  # the body could not be read to its end: the connection cannot be reused


class RouterGuard:
    """ASGI middleware over the router's app (see the module docstring)."""

    def __init__(self, app: Any, settings: GuardSettings):
        self.app, self.settings = app, settings
        self.active = 0  # client requests being served

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is not None:
            return await reject(refusal, receive, send, self.settings.max_request_bytes)
        slot = 1 if scope["path"].startswith("/v1/") else 0
        if slot and self.active >= self.settings.max_connections:
            busy = Refusal(429, f"the router is serving --max-connections {self.settings.max_connections} requests; "
                                "retry shortly", "server_overloaded", "server_overloaded")
            return await reject(busy, receive, send, self.settings.max_request_bytes)
        self.active += slot
        try:
            body = await read_body(receive, self.settings.max_request_bytes)
            if isinstance(body, Refusal):
                return await reject(body, receive, send, self.settings.max_request_bytes, drain=False)
            if body is not None:  # None: the client left while sending it
                await self.app(scope, replay(body, receive), send)
        finally:
            self.active -= slot

    def check(self, scope: dict) -> Refusal | None:
        """The key the path needs, and the declared body size: refused before a byte of the body is read."""
        path, s = scope["path"], self.settings
        headers = dict(scope.get("headers") or [])
        if path == "/admin" or path.startswith("/admin/"):
            if not s.admin_api_key:
                return Refusal(404, ADMIN_OFF, "not_found_error", "admin_disabled")
            key = s.admin_api_key
        elif path == "/metrics":
            key = s.metrics_api_key
        else:
            key = s.api_key if path.startswith("/v1/") else None
        auth = headers.get(b"authorization", b"")
        if not auth and b"x-api-key" in headers:  # Anthropic's clients send their key so
            auth = b"Bearer " + headers[b"x-api-key"]
        if key and not bearer_matches(auth, key):
            why = "invalid" if auth else "missing"
            return Refusal(401, f"{why} API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           "authentication_error", "invalid_api_key")
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return Refusal(400, "invalid Content-Length header", "invalid_request_error")
        if length > s.max_request_bytes:
            return too_large(s.max_request_bytes)
        return None


def too_large(limit: int, close: bool = False) -> Refusal:
    return Refusal(413, f"the request body exceeds {limit} bytes (--max-request-bytes)", "invalid_request_error",
                   "request_too_large", close)


async def read_body(receive: Any, limit: int) -> bytes | Refusal | None:
    """The whole body, counted as it arrives: a Refusal once it passes `limit` (the rest read and dropped, up to a
    bound), None if the client went away."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            complete = not message.get("more_body") or await drain_body(receive, limit)
            return too_large(limit, close=not complete)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def reject(refusal: Refusal, receive: Any, send: Any, limit: int, drain: bool = True) -> None:
    """Answer without running the app. The body is read and dropped first (up to a bound): a server that closes
    with a request body still arriving makes the client see a reset instead of the answer."""
    data = json.dumps(error_body(refusal.message, refusal.kind, None, refusal.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if refusal.status in (429, 503):
        headers.append((b"retry-after", b"1"))
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if refusal.close or (drain and not await drain_body(receive, limit)):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})
