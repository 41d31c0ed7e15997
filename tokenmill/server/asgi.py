"""What the server's guard (server/guard.py) and the router's (router/guard.py) share: a constant-time key check and
the bounded drain of a refused request's body. Plain ASGI, no framework."""

from __future__ import annotations

import hmac
from typing import Any


def bearer_matches(authorization: bytes, key: str) -> bool:
    """Whether an Authorization header carries `key`, compared in constant time: how much of a guess was right must
    not show in how long the answer takes."""
    given = authorization[7:].strip() if authorization[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(given, key.encode())


async def drain_body(receive: Any, limit: int) -> bool:
    """Read and drop the rest of a request body, up to max(4 x limit, 64 MiB); True if it all came. A server that
    answers and closes while a body is still arriving makes the client see a reset instead of the answer."""
    budget = max(4 * limit, 64 << 20)
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return False
        budget -= len(message.get("body", b""))
        if not message.get("more_body"):
            return True
    return False


def replay(body: bytes, receive: Any) -> Any:
    """A receive for the app behind a layer that read the body first (the guard, the multi-model dispatcher): the
    body in one message, then the client's own messages (its disconnect)."""
    given = False

    async def receive_replayed() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_replayed
