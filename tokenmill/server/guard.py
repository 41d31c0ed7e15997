"""The ASGI guard in front of the app: keys, body size and load shedding before any parsing, and a JSON 500 for
whatever escapes the app. Rejections are answered here, without running the app.

Three keys, each compared in constant time: the clients' `--api-key` (/v1/*, /tokenize, /detokenize, /ui/stats; as
'Authorization: Bearer KEY' or, as Anthropic's clients send it, 'x-api-key: KEY'),
the operator's `--admin-api-key` (/admin/* and the LoRA adapter loading routes, which do not exist without it: a
client key never opens them) and an
optional `--metrics-api-key` (/metrics; open without it, as Prometheus scrapers expect)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from tokenmill.server.asgi import bearer_matches, drain_body
from tokenmill.server.errors import (
    APIError,
    BadRequest,
    InternalError,
    NotFound,
    RequestTooLarge,
    Unauthorized,
    classify_for,
)
from tokenmill.server.settings import ServerSettings

log = logging.getLogger("tokenmill")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/ui/stats")
ADMIN_PREFIX = "/admin/"
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # vLLM's paths; the admin key opens them
METRICS_PATH = "/metrics"
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")


class Guard:
    """ASGI middleware; `overloaded` says why a generate request cannot be queued now (or None)."""

    def __init__(self, app, settings: ServerSettings, on_reject: Callable[[int], None],
                 overloaded: Callable[[], Exception | None]):
        self.app, self.settings, self.on_reject, self.overloaded = app, settings, on_reject, overloaded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if not auth and b"x-api-key" in headers:
            auth = "Bearer " + headers[b"x-api-key"].decode("latin-1")
        refused = self._check_key(scope["path"], auth)
        if refused is not None:
            return await self._reject(refused, receive, send, path=scope["path"])
        limit = self.settings.max_request_bytes
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await self._reject(BadRequest("invalid Content-Length header"), receive, send, path=scope["path"])
        if length > limit:
            return await self._reject(_too_large(limit), receive, send, path=scope["path"])
        if scope["method"] == "POST" and scope["path"] in GENERATE_PATHS:
            full = self.overloaded()  # the queue has no room even for one request: shed it before parsing
            if full is not None:
                return await self._reject(full, receive, send, path=scope["path"])
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body"):
                        await drain_body(receive, limit)
                    raise _too_large(limit)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except APIError as exc:  # the guard's own refusal from inside the body (too large), left unhandled
            if not started:
                await self._reject(exc, receive, send, drain=False, path=scope["path"])
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await self._reject(InternalError(f"internal error: {type(exc).__name__}"), receive, send,
                                   drain=False, path=scope["path"])

    def _check_key(self, path: str, auth: str) -> Exception | None:
        """Why this path refuses this Authorization header, or None. Each area has its own key."""
        settings = self.settings
        if path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/") or path in LORA_ADMIN_PATHS:
            if not settings.admin_api_key:
                return NotFound(f"{path} is an admin endpoint, off on this server; start it with --admin-api-key")
            return _key_mismatch(auth, settings.admin_api_key, "admin API key")
        if path == METRICS_PATH:
            return _key_mismatch(auth, settings.metrics_api_key, "metrics API key") if settings.metrics_api_key \
                else None
        if settings.api_key and path.startswith(PROTECTED_PREFIXES):
            return _key_mismatch(auth, settings.api_key, "API key")
        return None

    async def _reject(self, exc: Exception, receive, send, drain: bool = True, path: str = "") -> None:
        """Answer without running the app, in the error shape of `path`'s API. The body is read and dropped first
        (up to a bound): a server that closes with a request body still arriving makes the client see a reset
        instead of the answer."""
        status, body = classify_for(path, exc)
        self.on_reject(status)
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if status in (429, 503):
            headers.append((b"retry-after", b"1"))
        if drain and not await drain_body(receive, self.settings.max_request_bytes):
            headers.append((b"connection", b"close"))
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def _key_mismatch(auth: str, key: str, what: str) -> Unauthorized | None:
    """None if `auth` is 'Bearer <key>'; compared in constant time, so a wrong key's timing tells nothing."""
    if bearer_matches(auth.encode("latin-1"), key):
        return None
    msg = f"missing {what}" if not auth else f"invalid {what}"
    return Unauthorized(f"{msg}: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body exceeds {limit} bytes (--max-request-bytes)")
