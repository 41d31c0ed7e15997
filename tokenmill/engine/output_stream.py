"""What one API call reads: its requests' updates as one async iterator (OutputStream), and their delivery onto
the event loop, where a reader that stopped reading is cut off. AsyncEngine fills the streams from its reader
thread; the server drains them (server/streaming.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.output_processor import RequestState, SampleDelta
from tokenmill.errors import RequestFailed


class StreamEngine(Protocol):
    """What a stream needs of its engine (AsyncEngine): how far its reader may fall behind, and aborting what of it
    still runs."""

    stream_update_limit: int

    def _abort(self, stream: OutputStream) -> None: ...


@dataclass
class Update:
    """One step's news for one request of a stream: its samples' deltas, or the error that ended it."""

    prompt_index: int
    samples: list[SampleDelta]
    finished: bool = False
    error: BaseException | None = None


class OutputStream:
    """The updates of the requests of one API call (one per prompt, each with n samples), as one async iterator.
    However it ends (all finished, an error, the client gone), what still runs is aborted."""

    def __init__(self, engine: StreamEngine, requests: list[RequestState]):
        self.engine = engine
        self.requests = requests
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.limit = engine.stream_update_limit * len(requests)  # updates waiting past this: the reader is gone
        self.remaining = len(requests)
        self.closed = False

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, all prompts together."""
        return sum(r.num_cached_tokens for r in self.requests)

    async def __aiter__(self) -> AsyncIterator[Update]:
        try:
            while self.remaining:
                update = await self.queue.get()
                if update.error is not None:
                    raise update.error
                if update.finished:
                    self.remaining -= 1
                yield update
        finally:
            self.abort()

    def abort(self) -> None:
        """Idempotent: abort whatever of this stream is still running."""
        if not self.closed:
            self.closed = True
            self.engine._abort(self)


def deliver(deliveries: list[tuple[OutputStream, Update]], to_closed: bool) -> None:
    """On the event loop. A stream this side closed gets nothing more, unless `to_closed` (fail_all closes the
    streams it fails, whose readers still wait for that last update). A stream whose reader fell
    `OutputStream.limit` updates behind has stopped reading: it ends with an error and its requests are aborted,
    so a client that never reads cannot hold its KV blocks or this process's memory."""
    for stream, update in deliveries:
        if to_closed or not stream.closed:
            if not to_closed and stream.queue.qsize() >= stream.limit:
                stream.queue.put_nowait(Update(update.prompt_index, [], True, RequestFailed(
                    f"the client read none of this request's last {stream.limit} updates; it was aborted")))
                stream.abort()
                continue
            stream.queue.put_nowait(update)
