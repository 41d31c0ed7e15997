"""Reading an OutputStream out to the client: all of it for a JSON response (stopping if the client leaves), or
as server-sent events. However either ends, the stream's requests are aborted."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.output_processor import SampleDelta
from tokenmill.engine.output_stream import OutputStream
from tokenmill.errors import TokenmillError
from tokenmill.server.errors import APIError, classify

log = logging.getLogger("tokenmill")


@dataclass
class Choice:
    """One choice's output so far (a request's sample), gathered from its deltas."""

    text: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # each delta's token count (reasoning_tokens counts by delta)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: SampleDelta) -> None:
        self.text.append(d.text)
        self.sizes.append(len(d.token_ids))
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


async def collect(request: Request, stream: OutputStream, n: int) -> list[Choice] | None:
    """All choices of a non-streaming request, or None if the client went away first (the request is aborted)."""
    choices = [Choice() for _ in range(len(stream.requests) * n)]

    async def gather():
        async for update in stream:
            for d in update.samples:
                choices[update.prompt_index * n + d.index].add(d)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # raises the request's error, if any
            return choices
        return None
    finally:
        watch.cancel()
        work.cancel()
        stream.abort()


class SSEResponse(StreamingResponse):
    """A streaming response that aborts its requests however it ends: done, client gone, server stopping."""

    def __init__(self, content: AsyncIterator[bytes], stream: OutputStream):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


def sse(stream: OutputStream, chunks: AsyncIterator[dict]) -> SSEResponse:
    """Each chunk as an event; an error ends the stream as an error event; [DONE] last, always."""
    async def body():
        try:
            async for chunk in chunks:
                yield b"data: " + _dumps(chunk) + b"\n\n"
        except (TokenmillError, APIError) as e:
            yield b"data: " + _dumps(classify(e)[1]) + b"\n\n"
        except Exception as e:
            log.exception("unexpected error in a stream")
            yield b"data: " + _dumps(classify(e)[1]) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return SSEResponse(body(), stream)


def event_sse(stream: OutputStream, events: AsyncIterator[tuple[str, dict]],
              error_event: Callable[[dict], tuple[str, dict]]) -> SSEResponse:
    """Named events (`event: NAME` then its data), as Anthropic's and the Responses API's streams are; an error
    ends the stream as `error_event(OpenAI-style error body)`. No [DONE]: those streams end with their own event."""
    async def body():
        try:
            async for name, data in events:
                yield b"event: " + name.encode() + b"\ndata: " + _dumps(data) + b"\n\n"
        except Exception as e:  # noqa: BLE001 - whatever it is, the client gets an error event
            if not isinstance(e, (TokenmillError, APIError)):
                log.exception("unexpected error in a stream")
            name, data = error_event(classify(e)[1])
            yield b"event: " + name.encode() + b"\ndata: " + _dumps(data) + b"\n\n"

    return SSEResponse(body(), stream)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
