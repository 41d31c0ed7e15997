"""A scriptable OpenAI replica, served for real (uvicorn on 127.0.0.1, in a thread of the test process), for the
router's failure paths that a real model cannot be made to take on cue: an answer that starts late, a stream that
never ends, malformed events, a stream cut short, a refusal broken off. The prompt names what the replica does (`overrides` can map a
prompt to another behaviour, so two replicas answer one prompt differently); any other prompt gets a normal, sure
answer (every token's logprob 0). The replica counts what it saw and the requests whose client left early."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn

SLOW_S = 1.5  # "slow": the answer's headers come this late


class Served:
    """An ASGI app on a real socket, in a thread: `url`, and `stop()`."""

    def __init__(self, app: Any, lifespan: str = "off"):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan=lifespan, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def chunk(text: str) -> dict:
    return {"id": "fake", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": {"token_logprobs": [0.0]}, "finish_reason": None}]}


USAGE = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
ANSWER = {"id": "fake", "object": "text_completion", "usage": USAGE,
          "choices": [{"index": 0, "text": "abc", "logprobs": {"token_logprobs": [0.0, 0.0, 0.0]},
                       "finish_reason": "length"}]}


def sse(payload: Any) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class FakeReplica:
    def __init__(self, overrides: dict[str, str] | None = None, models: list[str] | None = None):
        self.overrides = overrides or {}
        self.models = models  # what GET /v1/models lists (None: it has no such route, as a non-OpenAI server)
        self.seen: list[str] = []
        self.closed_early = 0  # requests whose client (the router) left before the answer was complete
        self.served = Served(self)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["path"] == "/health":
            return await whole(send, 200, b'{"status": "ok"}')
        if scope["path"] == "/v1/models" and self.models is not None:
            cards = [{"id": m, "object": "model", "owned_by": self.url} for m in self.models]
            return await whole(send, 200, json.dumps({"object": "list", "data": cards}).encode())
        if scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await whole(send, 404, b'{"detail": "Not Found"}')
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return await whole(send, 400, b'{"error": {"message": "bad JSON", "type": "invalid_request_error"}}')
        prompt = str(data.get("prompt", "chat"))
        self.seen.append(prompt)
        await self.behave(self.overrides.get(prompt, prompt), bool(data.get("stream")), receive, send)

    async def behave(self, mode: str, stream: bool, receive: Any, send: Any) -> None:
        if mode == "slow" and await left(receive, SLOW_S):
            self.closed_early += 1
            return
        if mode == "bad-json":
            return await whole(send, 200, b"this is not JSON")
        if mode == "cut-503":  # a refusal whose body breaks off: fewer bytes than its Content-Length says
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"100")]})
            await send({"type": "http.response.body", "body": b'{"error": ', "more_body": True})
            raise ConnectionAbortedError("cut off on purpose")
        if not stream:
            return await whole(send, 200, json.dumps(ANSWER).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        events = {"bad-event-first": [b"data: {broken\n\n", sse(chunk("a"))],
                  "bad-event-after-2": [sse(chunk("a")), sse(chunk("b")), b"data: {broken\n\n", sse(chunk("c"))],
                  "no-done": [sse(chunk("a")), sse(chunk("b")), sse(chunk("c"))]}.get(mode)
        if mode == "endless":
            while not await left(receive, 0.05):
                await send({"type": "http.response.body", "body": sse(chunk("x")), "more_body": True})
            self.closed_early += 1
            return
        if events is None:
            events = [sse(chunk(t)) for t in "abc"] + [sse({"id": "fake", "choices": [], "usage": USAGE}),
                                                     sse("[DONE]")]
        for e in events:
            await send({"type": "http.response.body", "body": e, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def whole(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def left(receive: Any, timeout: float) -> bool:
    """Whether the client went away within `timeout` seconds."""
    async def disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnect(), timeout)
        return True
    except asyncio.TimeoutError:
        return False
