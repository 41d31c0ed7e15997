"""Forwarding: a request body goes to the replica the policy picks, on to another while one fails before its response
begins, and the response that begins is relayed byte for byte.

The work is done inside the response (`LiveResponse`): choosing, sending, retrying and relaying all run in one task
that a client going away cancels, so the replica's in-flight count (held by one `with backend.busy()` per attempt)
and the upstream request (closed in one `finally`) cannot outlive the request, however it ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from tokenmill.router.errors import Send, error_body, error_event, send_error, send_whole
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.prefix_index import block_names
from tokenmill.router.replicas import Replica, ReplicaPool

RETRY_STATUS = (429, 502, 503)
OFF_LOOP_BYTES = 64 << 10  # a body larger than this is parsed, hashed and encoded on a worker thread
JSON_HEADERS = {"content-type": "application/json"}
T = TypeVar("T")


class TakenOut(httpx.TransportError):
    """The replica a request waited on was taken out by its health checks (hung, not just slow to refuse)."""


def prompt_text(body: bytes) -> str:
    """The text a request's KV cache would be keyed by, for the prefix policy: the prompt, or the messages as
    JSON (a shared system prompt is then a shared prefix). '' when there is none to read."""
    data = parse_object(body)
    if data is None:
        return ""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return first if isinstance(first, str) else json.dumps(first if isinstance(first, list) else prompt)
    messages = data.get("messages")
    return json.dumps(messages, ensure_ascii=False) if isinstance(messages, list) else ""


def parse_object(body: bytes) -> dict | None:
    """The body as a JSON object, or None (not JSON, not an object, nested too deep to parse)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


async def off_loop(fn: Callable[[], T], size: int) -> T:
    """`fn()`, on a worker thread when its input is `size` > OFF_LOOP_BYTES: a large body parsed or hashed on the
    event loop would stall every other request's stream meanwhile."""
    return await asyncio.to_thread(fn) if size > OFF_LOOP_BYTES else fn()


def model_name(body: bytes) -> str | None:
    """The `model` a request names, or None."""
    data = parse_object(body)
    model = data.get("model") if data is not None else None
    return model if isinstance(model, str) else None


async def requested_model(body: bytes) -> str | None:
    """The model a request names: only replicas that list it take the request."""
    return await off_loop(lambda: model_name(body), len(body))


async def routing_key(body: bytes, wanted: bool) -> list[bytes]:
    """The prompt's block names the prefix policy places the request by; [] when no policy reads them."""
    if not wanted:
        return []
    return await off_loop(lambda: block_names(prompt_text(body)), len(body))


async def watched(backend: Replica | None, call: Awaitable[T]) -> T:
    """Await a request to a replica as one its take-out can cancel (a hung replica must not hold it): that cancel
    becomes TakenOut; a cancel of this task itself (its client gone) goes on as a cancel."""
    task = asyncio.ensure_future(call)
    if backend is not None:
        backend.pending.add(task)
    try:
        return await task
    except asyncio.CancelledError:
        _close_late(task)
        if asyncio.current_task().cancelling():
            raise
        raise TakenOut("the replica was taken out (failed health checks)") from None
    finally:
        if backend is not None:
            backend.pending.discard(task)


_closing: set[asyncio.Future] = set()


def _close_late(task: asyncio.Future) -> None:
    """A response that arrived just as its wait was cancelled is closed all the same: its connection goes back to
    the (bounded) pool."""
    if task.done() and not task.cancelled() and task.exception() is None:
        aclose = getattr(task.result(), "aclose", None)
        if aclose is not None:
            closing = asyncio.ensure_future(aclose())
            _closing.add(closing)
            closing.add_done_callback(_closing.discard)


async def until_disconnect(work: Awaitable[None], receive: Any) -> None:
    """Run `work` until it ends or the client goes away; then it is cancelled, which closes what it holds."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class LiveResponse(Response):
    """A response produced while it is served: `run(send)` sends it, in a task the client's leaving cancels."""

    def __init__(self, run: Callable[[Send], Awaitable[None]]):
        super().__init__()
        self.run = run

    async def __call__(self, scope: dict, receive: Any, send: Send) -> None:
        try:
            await until_disconnect(self.run(send), receive)
        except OSError:  # an ASGI 2.4 server says the client is gone by failing a send
            raise ClientDisconnect() from None


@dataclass
class Job:
    body: bytes
    path: str
    key: list[bytes]  # the prompt's block names, for the policy
    first: Replica | None = None  # tried first (the P/D proxy's decode instance)
    extra_headers: dict[str, str] = field(default_factory=dict)
    on_first_byte: Callable[[], None] | None = None
    model: str | None = None  # the model the request names: replicas that do not list it are passed over


@dataclass
class Refused:
    """A replica's answer that another replica may do better than (429, 502, 503): handed back if none does."""

    status: int
    content: bytes
    content_type: str | None
    final: bool = False  # no other replica would do better: the router itself is out of connections


class Forwarder:
    def __init__(self, pool: ReplicaPool, policy: Any, metrics: RouterMetrics,
                 client: Callable[[], httpx.AsyncClient], max_attempts: int):
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.client, self.max_attempts = client, max_attempts

    def respond(self, job: Job) -> LiveResponse:
        return LiveResponse(lambda send: self.run(job, send))

    async def run(self, job: Job, send: Send) -> None:
        """Each attempt holds its replica's in-flight count for exactly as long as it lasts."""
        tried: set[str] = set()
        last: Refused | None = None
        for _ in range(self.max_attempts):
            candidates = self.pool.healthy(tried, job.model)
            if not candidates:
                if not tried and self.pool.healthy():  # replicas are up, none lists this model
                    body = error_body(f"no replica serves the model {job.model!r}", "not_found_error", "model",
                                      "model_not_found")
                    return await send_whole(send, 404, json.dumps(body).encode(), "application/json")
                break
            first = job.first if job.first is not None and job.first.url not in tried else None
            backend = first or self.policy.choose(candidates, job.key)
            tried.add(backend.url)
            with backend.busy():
                outcome = await self.attempt(backend, job, send)
            if outcome is True:
                return
            last = outcome or last
            if last is not None and last.final:
                break
        if last is not None:
            return await send_whole(send, last.status, last.content, last.content_type)
        self.metrics.unrouted.inc()
        await send_error(send, 503, "no healthy replica could take the request; retry later")

    async def attempt(self, backend: Replica, job: Job, send: Send) -> bool | Refused | None:
        """True: relayed. Refused: the replica declined before beginning. None: it could not be reached."""
        client = self.client()
        request = client.build_request("POST", backend.url + job.path, content=job.body, headers=JSON_HEADERS)
        try:
            upstream = await watched(backend, client.send(request, stream=True))
        except httpx.PoolTimeout:
            busy = error_body("the router has no free connection toward the replicas; retry shortly", "server_error")
            return Refused(503, json.dumps(busy).encode(), "application/json", final=True)
        except httpx.HTTPError as e:
            self.failed(backend, f"{type(e).__name__}: {e}")
            return None
        try:
            if upstream.status_code not in RETRY_STATUS:
                self.metrics.requests.labels(backend.url, "ok").inc()
                await self.relay(upstream, backend, job, send)
                return True
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                self.failed(backend, f"{type(e).__name__}: {e}")
                return None
            self.metrics.requests.labels(backend.url, "retried").inc()
            if upstream.status_code != 429:
                self.pool.mark_failed(backend, f"HTTP {upstream.status_code}")
            return Refused(upstream.status_code, content, upstream.headers.get("content-type"))
        finally:
            await upstream.aclose()

    def failed(self, backend: Replica, why: str) -> None:
        self.metrics.requests.labels(backend.url, "error").inc()
        self.pool.mark_failed(backend, why)

    async def relay(self, upstream: httpx.Response, backend: Replica, job: Job, send: Send) -> None:
        """The replica's response as it comes; a stream whose replica fails midway ends with an error event and
        `[DONE]`, never a hang."""
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        passed = [(k, v) for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")]
        headers = [*passed, *job.extra_headers.items(), ("x-tokenmill-backend", backend.url)]
        await send({"type": "http.response.start", "status": upstream.status_code,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]})
        on_first_byte, tail = job.on_first_byte, b""
        backend.relaying.add(upstream)
        try:
            async for chunk in upstream.aiter_raw():
                if on_first_byte is not None:
                    on_first_byte()
                    on_first_byte = None
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpx.HTTPError, httpx.StreamError) as e:
            self.failed(backend, f"failed midway: {type(e).__name__}")
            if sse:
                tail = error_event(f"the replica serving this stream failed ({type(e).__name__}); retry the request")
        finally:
            backend.relaying.discard(upstream)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
