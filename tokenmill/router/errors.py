"""What a router client sees when something fails, in the OpenAI shape the replicas use themselves:
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
as a JSON response, a whole response sent on a raw ASGI channel, or a stream's last event before `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import JSONResponse

Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def error_event(message: str) -> bytes:
    """A stream's ending when it cannot go on: one error event, then `[DONE]`, so no client waits for more."""
    return f"data: {json.dumps(error_body(message, 'server_error'))}\n\ndata: [DONE]\n\n".encode()


async def send_whole(send: Send, status: int, body: bytes, content_type: str | None,
                     headers: Iterable[tuple[str, str]] = ()) -> None:
    """A complete response on a raw ASGI channel (for responses produced while their request is being served)."""
    raw = [(b"content-length", str(len(body)).encode())]
    if content_type:
        raw.append((b"content-type", content_type.encode("latin-1")))
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, status: int, message: str, kind: str = "server_error",
                     headers: Iterable[tuple[str, str]] = ()) -> None:
    await send_whole(send, status, json.dumps(error_body(message, kind)).encode(), "application/json", headers)
