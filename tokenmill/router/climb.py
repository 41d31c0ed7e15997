"""The cascade's request path (the rules: router/cascade.py): each tier in turn until one is sure, or the last. A
whole answer is judged on its tokens' logprobs; a stream on its first tokens, held back meanwhile, then relayed with
the router's logprobs stripped and the tier and cost added to its usage chunk. A tier whose answer or event is not
the OpenAI shape counts as failed: before it is chosen the request climbs on; once its stream is relayed, the
stream ends with an error event and `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from tokenmill.router.cascade import (
    BadEvent,
    CascadeConfig,
    Tier,
    answer_logprobs,
    ask_logprobs,
    event,
    mean_logprob,
    parse_event,
    sse_events,
    strip_logprobs,
)
from tokenmill.router.errors import Send, error_event, error_response, send_error, send_whole
from tokenmill.router.forward import JSON_HEADERS, LiveResponse, off_loop, parse_object, watched
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.replicas import ReplicaPool

_READ_ERRORS = (TypeError, AttributeError, ValueError, KeyError)


@dataclass
class Judged:
    """A stream's first events, read to judge it, and where the rest of it is."""

    held: list[bytes]
    logprobs: list[float]
    buffer: bytes
    chunks: AsyncIterator[bytes]


@dataclass
class Ask:
    """One client request as the tiers are sent it: `bodies[last]` (the last tier gets the client's own)."""

    path: str
    chat: bool
    bodies: tuple[bytes, bytes]
    asked: bool  # the client asked for logprobs itself
    usage_asked: bool = False


class Climber:
    def __init__(self, config: CascadeConfig, pool: ReplicaPool, metrics: RouterMetrics,
                 client: Callable[[], httpx.AsyncClient]):
        self.config, self.pool, self.metrics, self.client = config, pool, metrics, client

    async def handle(self, body: bytes, path: str, chat: bool) -> Response:
        data = await off_loop(lambda: parse_object(body), len(body))
        if data is None:
            return error_response(400, "the body must be a JSON object")
        options = data.get("stream_options")
        if options is not None and not isinstance(options, dict):
            return error_response(400, "stream_options must be an object", param="stream_options")
        if data.get("stream"):
            data = {**data, "stream_options": {**(options or {}), "include_usage": True}}
        sent, asked = ask_logprobs(data, chat)
        bodies = await off_loop(lambda: (json.dumps(sent).encode(), json.dumps(data).encode()), len(body))
        ask = Ask(path, chat, bodies, asked, bool((options or {}).get("include_usage")))
        if data.get("stream"):
            return LiveResponse(lambda send: self.stream(ask, send))
        return await self.whole(ask)

    def busy(self, tier: Tier) -> Any:
        backend = self.pool.backends.get(tier.url)
        return backend.busy() if backend is not None else nullcontext()

    def account(self, tier: Tier, usage: dict, cost: float) -> None:
        self.metrics.answered.labels(tier.name).inc()
        self.metrics.spent.inc(max(cost, 0.0))
        self.metrics.if_largest.inc(max(self.config.tiers[-1].cost(usage), 0.0))

    async def whole(self, ask: Ask) -> Response:
        cost, tiers = 0.0, self.config.tiers
        for i, tier in enumerate(tiers):
            last = i == len(tiers) - 1
            try:
                with self.busy(tier):
                    resp = await watched(self.pool.backends.get(tier.url), self.client().post(
                        tier.url + ask.path, content=ask.bodies[last], headers=JSON_HEADERS))
            except httpx.HTTPError as e:
                if last:
                    return error_response(503, f"the last cascade tier ({tier.name}) failed: {type(e).__name__}",
                                          "server_error")
                self.metrics.escalated.labels(tier.name).inc()
                continue
            if resp.status_code != 200:
                if last or resp.status_code < 500:
                    return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
                self.metrics.escalated.labels(tier.name).inc()
                continue
            try:
                out, usage, spent, sure = read_answer(tier, resp.content, ask.chat)
            except BadEvent as e:
                if last:
                    return error_response(502, f"the last cascade tier ({tier.name}) answered malformed: {e}",
                                          "server_error")
                self.metrics.escalated.labels(tier.name).inc()
                continue
            cost += spent
            if not last and sure < self.config.escalate_below:
                self.metrics.escalated.labels(tier.name).inc()
                continue
            if not last and not ask.asked:
                strip_logprobs(out)
            out["tier"], out["usage"] = tier.name, {**usage, "cost_usd": cost}
            self.account(tier, usage, cost)
            return JSONResponse(out, headers={"x-tokenmill-tier": tier.name})
        return error_response(503, "no cascade tier answered", "server_error")

    async def stream(self, ask: Ask, send: Send) -> None:
        """A stream is judged on its first tokens, held back meanwhile; an unsure one is closed for the next tier."""
        cost, tiers = 0.0, self.config.tiers
        for i, tier in enumerate(tiers):
            last = i == len(tiers) - 1
            with self.busy(tier):
                client = self.client()
                request = client.build_request("POST", tier.url + ask.path, content=ask.bodies[last],
                                               headers=JSON_HEADERS)
                try:
                    upstream = await watched(self.pool.backends.get(tier.url), client.send(request, stream=True))
                except httpx.HTTPError as e:
                    if last:
                        return await send_error(send, 503, f"the last cascade tier ({tier.name}) failed: "
                                                           f"{type(e).__name__}")
                    continue
                try:
                    if upstream.status_code != 200:
                        if await self.refused(upstream, last, send):
                            return
                        continue
                    judged = await self.judge(upstream, ask.chat, 0 if last else self.config.first_tokens)
                    if judged is None:  # failed, or sent what is not an event, while judged: the next tier
                        continue
                    if not last and mean_logprob(judged.logprobs) < self.config.escalate_below:
                        self.metrics.escalated.labels(tier.name).inc()
                        cost += tier.price_out * len(judged.logprobs) / 1e6  # what it wrote before it was cut off
                        continue
                    return await self.relay(tier, judged, cost, ask, last, send)
                finally:
                    await upstream.aclose()
        await send_error(send, 503, "no cascade tier answered")

    @staticmethod
    async def refused(upstream: httpx.Response, last: bool, send: Send) -> bool:
        """A tier's non-200 answer: handed to the client (True) if it is the last tier's or a 4xx."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError as e:
            if last:
                await send_error(send, 502, f"the last cascade tier failed answering: {type(e).__name__}")
            return last
        if last or upstream.status_code < 500:
            await send_whole(send, upstream.status_code, content, upstream.headers.get("content-type"))
            return True
        return False

    @staticmethod
    async def judge(upstream: httpx.Response, chat: bool, first_tokens: int) -> Judged | None:
        """The stream's first `first_tokens` token logprobs, its events held; None if it fails meanwhile."""
        held, logprobs, buffer = [], [], b""
        chunks = upstream.aiter_raw()
        try:
            while len(logprobs) < first_tokens and b"[DONE]" not in held:
                events, buffer = sse_events(buffer + await anext(chunks))
                for e in events:
                    held.append(e)
                    if e != b"[DONE]":
                        logprobs += [v for lp in answer_logprobs(parse_event(e), chat) for v in lp]
        except StopAsyncIteration:
            pass
        except (httpx.HTTPError, httpx.StreamError, BadEvent):
            return None
        return Judged(held, logprobs, buffer, chunks)

    async def relay(self, tier: Tier, judged: Judged, cost: float, ask: Ask, last: bool, send: Send) -> None:
        """The chosen tier's stream: the held events, then the rest, each re-emitted; it always ends with `[DONE]`,
        after an error event if the tier failed, sent something unreadable, or stopped short."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-tokenmill-tier", tier.name.encode())]})
        tail = error_event(f"the {tier.name} tier's stream ended before [DONE]; retry the request")
        try:
            async with aclosing(events_of(judged)) as events:
                async for e in events:
                    if e == b"[DONE]":
                        tail = event("[DONE]")
                        break
                    out = self.rewrite(tier, e, cost, ask.asked or last, ask.usage_asked)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
        except (httpx.HTTPError, httpx.StreamError) as e:
            tail = error_event(f"the {tier.name} tier failed midway ({type(e).__name__}); retry the request")
        except BadEvent as e:
            tail = error_event(f"the {tier.name} tier sent a malformed event ({e}); retry the request")
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def rewrite(self, tier: Tier, e: bytes, cost: float, keep_logprobs: bool, usage_asked: bool) -> bytes:
        """One event as the client gets it: the router's logprobs stripped, the usage chunk given the tier and cost
        (and dropped if the client did not ask for usage)."""
        payload = parse_event(e)
        try:
            if not keep_logprobs:
                strip_logprobs(payload)
            usage = payload.get("usage")
            if usage and not payload.get("choices"):
                total = cost + tier.cost(usage)
                self.account(tier, usage, total)
                if not usage_asked:
                    return b""
                usage["cost_usd"], payload["tier"] = total, tier.name
            return event(payload)
        except _READ_ERRORS as err:
            raise BadEvent(f"unreadable chunk: {type(err).__name__}") from None


async def events_of(judged: Judged) -> AsyncIterator[bytes]:
    for e in judged.held:
        yield e
    buffer = judged.buffer
    async for raw in judged.chunks:
        events, buffer = sse_events(buffer + raw)
        for e in events:
            yield e


def read_answer(tier: Tier, content: bytes, chat: bool) -> tuple[dict, dict, float, float]:
    """A whole answer, its usage, what it cost and how sure it is (its least sure choice's mean logprob)."""
    out = parse_event(content)
    usage = out.get("usage") or {}
    try:
        spent = tier.cost(usage)
    except _READ_ERRORS as err:
        raise BadEvent(f"unreadable usage: {type(err).__name__}") from None
    sure = min((mean_logprob(lp) for lp in answer_logprobs(out, chat)), default=0.0)
    return out, usage, spent, sure
