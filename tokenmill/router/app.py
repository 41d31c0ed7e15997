"""`tokenmill router`: the OpenAI API in front of many replicas (tokenmill, vLLM, llama.cpp's server: anything that
speaks it). Each request goes to the replica the policy picks (router/policies.py); bodies and streams pass through
byte for byte.

- A replica that cannot be reached, or answers 502/503 (gone, shutting down) or 429 (its queue is full), before
  the response has begun, is skipped and the request goes to the next one (up to --max-attempts replicas); a
  replica that fails a request is taken out until its health check passes again.
- A stream whose replica fails midway ends with an error event and `[DONE]`, never a hang; a client that goes away
  closes the upstream request, so the replica aborts it and frees its blocks.
- `--api-key` guards /v1/* and /admin/* (Bearer); `--backend-api-key` is what the router sends to the replicas.
- /health: 200 while a replica is healthy. /metrics: requests by replica and outcome, retries, replicas' health,
  load and in-flight counts. /admin/backends: GET lists, POST {"url"} adds, DELETE {"url"} removes, at run time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tokenmill.router.backends import Backend, BackendPool
from tokenmill.router.cascade import (
    Tier,
    ask_logprobs,
    event,
    mean_logprob,
    sse_events,
    strip_logprobs,
    token_logprobs,
)
from tokenmill.router.disagg import PDConfig, decode_body, kv_receiver, new_transfer_id, prefill_body

log = logging.getLogger("tokenmill.router")
RETRY_STATUS = (429, 502, 503)
MAX_BODY_BYTES = 16 << 20  # a larger body is refused here (413) rather than held in memory and sent on
_PD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def prompt_text(body: bytes) -> str:
    """The text a request's KV cache would be keyed by, for the prefix policy: the prompt, or the messages as
    JSON (a shared system prompt is then a shared prefix). '' when there is none to read."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        return first if isinstance(first, str) else json.dumps(first if isinstance(first, list) else prompt)
    messages = data.get("messages")
    return json.dumps(messages, ensure_ascii=False) if isinstance(messages, list) else ""


class _PoolCollector:
    """The replicas' state, read at scrape time (`prefix`: a second pool's, e.g. the prefill instances)."""

    def __init__(self, pool: BackendPool, prefix: str = ""):
        self.pool = pool
        self.name = "tokenmill_router_" + (prefix + "_" if prefix else "") + "backend_"

    def collect(self):
        healthy = GaugeMetricFamily(self.name + "healthy", "1 while the replica is in rotation", labels=["backend"])
        in_flight = GaugeMetricFamily(self.name + "in_flight", "Requests the router has in flight there",
                                      labels=["backend"])
        load = GaugeMetricFamily(self.name + "load", "In flight plus the replica's own waiting queue",
                                 labels=["backend"])
        for b in self.pool.backends.values():
            healthy.add_metric([b.url], 1.0 if b.healthy else 0.0)
            in_flight.add_metric([b.url], b.in_flight)
            load.add_metric([b.url], b.load)
        yield from (healthy, in_flight, load)


@dataclass
class CascadeConfig:
    tiers: list[Tier]
    escalate_below: float = -1.0  # mean token logprob under which a tier's answer climbs to the next tier
    first_tokens: int = 8  # a stream is judged on this many tokens


def build_router_app(pool: BackendPool, policy: Any, api_key: str | None = None, backend_api_key: str | None = None,
                     max_attempts: int = 3, cascade: CascadeConfig | None = None, pd: PDConfig | None = None
                     ) -> FastAPI:
    """The router's app over `pool`; with `pd`, `pool` is the decode instances and `pd.prefill` the prefill ones."""
    registry = CollectorRegistry()
    requests_total = Counter("tokenmill_router_requests", "Requests forwarded, by replica and outcome (ok: the "
                             "response began; error: unreachable or failed midway; retried: skipped for another)",
                             ["backend", "outcome"], registry=registry)
    unrouted = Counter("tokenmill_router_unrouted", "Requests no replica could take (503)", registry=registry)
    answered = Counter("tokenmill_router_cascade_answers", "Requests answered, by cascade tier", ["tier"],
                       registry=registry)
    escalated = Counter("tokenmill_router_cascade_escalations", "Answers judged unsure, by the tier that gave them",
                        ["tier"], registry=registry)
    spent = Counter("tokenmill_router_cost_usd", "What the answered requests cost, every tier they touched",
                    registry=registry)
    if_largest = Counter("tokenmill_router_cost_if_last_tier_usd", "What they would have cost sent to the last "
                         "tier alone (its prices, the answering tier's token counts)", registry=registry)
    registry.register(_PoolCollector(pool))
    if pd is not None:
        registry.register(_PoolCollector(pd.prefill, "prefill"))
    pd_requests = Counter("tokenmill_router_pd_requests", "Prefill/decode requests by how their KV went: sent (the "
                          "decode instance took it), failed (it computed the prompt itself), prefill_error (no "
                          "prefill instance answered: the decode instance computed everything)", ["outcome"],
                          registry=registry)
    pd_prefill = Histogram("tokenmill_router_pd_prefill_seconds", "The prefill half: request to answer (the prompt "
                           "computed and its KV shipped)", buckets=_PD_BUCKETS, registry=registry)
    pd_transfer = Histogram("tokenmill_router_pd_transfer_tail_seconds", "Of the prefill half, the KV transfer after "
                            "the prompt's last step (the rest overlaps the prefill)", buckets=_PD_BUCKETS,
                            registry=registry)
    pd_first_decode = Histogram("tokenmill_router_pd_first_decode_seconds", "The decode half: request to the first "
                                "byte of its answer", buckets=_PD_BUCKETS, registry=registry)
    pd_bytes = Counter("tokenmill_router_pd_kv_bytes", "KV bytes prefill instances shipped", registry=registry)
    state: dict[str, httpx.AsyncClient] = {}
    index = getattr(policy, "index", None)
    if index is not None:
        pool.on_removed = index.forget

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state["client"] = httpx.AsyncClient(headers=headers, limits=limits,
                                            timeout=httpx.Timeout(None, connect=5.0))
        pool.start()
        if pd is not None:
            pd.prefill.start()
        try:
            yield
        finally:
            await pool.stop()
            if pd is not None:
                await pd.prefill.stop()
            await state["client"].aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)

    def authorized(request: Request) -> bool:
        return not api_key or request.headers.get("authorization", "") == f"Bearer {api_key}"

    async def relay(upstream: httpx.Response, backend: Backend, on_first_byte=None) -> AsyncIterator[bytes]:
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        backend.relaying.add(upstream)
        try:
            async for chunk in upstream.aiter_raw():
                if on_first_byte is not None:
                    on_first_byte()
                    on_first_byte = None
                yield chunk
        except (httpx.HTTPError, httpx.StreamClosed) as e:
            requests_total.labels(backend.url, "error").inc()
            pool.mark_failed(backend, f"failed midway: {type(e).__name__}")
            if sse:
                error = {"error": {"message": f"the replica serving this stream failed ({type(e).__name__}); "
                                              "retry the request", "type": "server_error", "param": None,
                                   "code": None}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            backend.in_flight -= 1
            backend.relaying.discard(upstream)
            await upstream.aclose()

    async def forward(request: Request, path: str) -> Response:
        if not authorized(request):
            return _error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
        if pd is not None:
            return await forward_pd(body, path)
        return await dispatch(body, path, prompt_text(body))

    async def dispatch(body: bytes, path: str, text: str, first: Backend | None = None,
                       extra_headers: dict[str, str] | None = None, on_first_byte=None) -> Response:
        """Send to the replica the policy picks (`first`, if given, on the first attempt), on to another while one
        fails before its response begins; relay the response that begins."""
        headers = {"content-type": "application/json"}
        tried: set[str] = set()
        last: Response | None = None
        for _ in range(max_attempts):
            candidates = pool.healthy(tried)
            if not candidates:
                break
            backend = first if first is not None and first.url not in tried else policy.choose(candidates, text)
            tried.add(backend.url)
            backend.in_flight += 1
            backend.requests += 1
            client = state["client"]
            sending = asyncio.ensure_future(client.send(client.build_request(
                "POST", backend.url + path, content=body, headers=headers), stream=True))
            backend.pending.add(sending)
            try:
                upstream = await sending
            except (httpx.HTTPError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # this handler itself is cancelled (the client left), not the replica taken out
                backend.in_flight -= 1
                requests_total.labels(backend.url, "error").inc()
                pool.mark_failed(backend, f"{type(e).__name__}: {e}")
                continue
            finally:
                backend.pending.discard(sending)
            if upstream.status_code in RETRY_STATUS:  # not begun: another replica may take it
                content = await upstream.aread()
                await upstream.aclose()
                backend.in_flight -= 1
                requests_total.labels(backend.url, "retried").inc()
                if upstream.status_code != 429:
                    pool.mark_failed(backend, f"HTTP {upstream.status_code}")
                last = Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
                continue
            requests_total.labels(backend.url, "ok").inc()
            passed = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")}
            return StreamingResponse(relay(upstream, backend, on_first_byte), status_code=upstream.status_code,
                                     headers={**passed, **(extra_headers or {}), "x-tokenmill-backend": backend.url})
        if last is not None:
            return last
        unrouted.inc()
        return _error(503, "no healthy replica could take the request; retry later", "server_error")

    async def forward_pd(body: bytes, path: str) -> Response:
        """Prefill half on a prefill instance (shipping the KV to the decode instance chosen first), then the decode
        half there, relayed to the client."""
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return _error(400, "the body must be a JSON object")
        text = prompt_text(body)
        client = state["client"]
        decode, receiver, healthy = None, None, pool.healthy()
        chosen = policy.choose(healthy, text) if healthy else None
        for backend in sorted(healthy, key=lambda b: (b is not chosen, b.load)):  # the policy's, then least load
            try:
                receiver = await kv_receiver(client, pd, backend)
            except httpx.HTTPError as e:
                pool.mark_failed(backend, f"/v1/kv_transfer: {type(e).__name__}")
                continue
            if receiver is not None:
                decode = backend
                break
        if decode is None:
            unrouted.inc()
            return _error(503, "no healthy decode instance with a KV receiver (--kv-transfer-config kv_consumer)",
                          "server_error")
        transfer_id = new_transfer_id()
        started = time.monotonic()
        answer = await prefill(prefill_body(data, transfer_id, receiver), path, text)
        if isinstance(answer, Response):
            return answer  # the request itself is bad (4xx): as the prefill instance said
        pd_prefill.observe(time.monotonic() - started)
        params = (answer or {}).get("kv_transfer_params") or {}
        outcome = "prefill_error" if answer is None else "sent" if params.get("status") == "sent" else "failed"
        pd_requests.labels(outcome).inc()
        if outcome == "failed":  # ask again next time: the decode instance may have restarted on another port
            pd.receivers.pop(decode.url, None)
        if outcome == "sent":
            pd_transfer.observe(params.get("tail_seconds", 0.0))
            pd_bytes.inc(params.get("num_bytes", 0))
        sent_at = time.monotonic()
        return await dispatch(json.dumps(decode_body(data, transfer_id)).encode(), path, text, decode,
                              {"x-tokenmill-kv-transfer": outcome},
                              lambda: pd_first_decode.observe(time.monotonic() - sent_at))

    async def prefill(body: dict, path: str, text: str) -> dict | Response | None:
        """The prefill half on a prefill instance (the next one while one fails): its answer, a 4xx response to
        hand back, or None if none could run it."""
        client, tried = state["client"], set()
        for _ in range(max_attempts):
            candidates = pd.prefill.healthy(tried)
            if not candidates:
                return None
            backend = pd.prefill_policy.choose(candidates, text)
            tried.add(backend.url)
            backend.in_flight += 1
            backend.requests += 1
            call = asyncio.ensure_future(client.post(backend.url + path, json=body))
            backend.pending.add(call)
            try:
                resp = await call
            except (httpx.HTTPError, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise
                requests_total.labels(backend.url, "error").inc()
                pd.prefill.mark_failed(backend, f"{type(e).__name__}: {e}")
                continue
            finally:
                backend.in_flight -= 1
                backend.pending.discard(call)
            if resp.status_code == 200:
                requests_total.labels(backend.url, "ok").inc()
                return resp.json()
            if resp.status_code in RETRY_STATUS or resp.status_code >= 500:
                requests_total.labels(backend.url, "retried").inc()
                if resp.status_code != 429:
                    pd.prefill.mark_failed(backend, f"HTTP {resp.status_code}")
                continue
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
        return None

    def account(tier: Tier, usage: dict, cost: float) -> None:
        answered.labels(tier.name).inc()
        spent.inc(cost)
        if_largest.inc(cascade.tiers[-1].cost(usage))

    async def watched(tier: Tier, call):
        """Await a request to a tier as one its replica's take-out can cancel (a hung tier must not hold it)."""
        backend = pool.backends.get(tier.url)
        task = asyncio.ensure_future(call)
        if backend is not None:
            backend.pending.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the client left
            raise httpx.ReadError("the tier was taken out (failed health checks)") from None
        finally:
            if backend is not None:
                backend.pending.discard(task)

    async def climb(request: Request, path: str, chat: bool) -> Response:
        """The cascade: each tier in turn until one is sure (or the last)."""
        if not authorized(request):
            return _error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        try:
            data = json.loads(await request.body())
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return _error(400, "the body must be a JSON object")
        if data.get("stream"):
            return await climb_stream(data, path, chat)
        client, cost = state["client"], 0.0
        sent, asked = ask_logprobs(data, chat)
        for i, tier in enumerate(cascade.tiers):
            last = i == len(cascade.tiers) - 1
            try:
                resp = await watched(tier, client.post(tier.url + path, json=data if last else sent))
            except httpx.HTTPError as e:
                if last:
                    return _error(503, f"the last cascade tier ({tier.name}) failed: {type(e).__name__}",
                                  "server_error")
                escalated.labels(tier.name).inc()
                continue
            if resp.status_code != 200:
                if last or resp.status_code < 500:
                    return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
                escalated.labels(tier.name).inc()
                continue
            out = resp.json()
            usage = out.get("usage") or {}
            cost += tier.cost(usage)
            choices = out.get("choices") or []
            sure = min((mean_logprob(token_logprobs(c, chat)) for c in choices), default=0.0)
            if not last and sure < cascade.escalate_below:
                escalated.labels(tier.name).inc()
                continue
            if not last and not asked:
                strip_logprobs(out)
            out["tier"] = tier.name
            out["usage"] = {**usage, "cost_usd": cost}
            account(tier, usage, cost)
            return JSONResponse(out, headers={"x-tokenmill-tier": tier.name})
        return _error(503, "no cascade tier answered", "server_error")

    async def climb_stream(data: dict, path: str, chat: bool) -> Response:
        """A stream is judged on its first tokens, held back meanwhile; an unsure one is closed for the next tier."""
        client = state["client"]
        usage_asked = bool((data.get("stream_options") or {}).get("include_usage"))
        base = {**data, "stream_options": {**(data.get("stream_options") or {}), "include_usage": True}}
        sent, asked = ask_logprobs(base, chat)
        cost = 0.0
        for i, tier in enumerate(cascade.tiers):
            last = i == len(cascade.tiers) - 1
            try:
                upstream = await watched(tier, client.send(client.build_request(
                    "POST", tier.url + path, json=base if last else sent), stream=True))
            except httpx.HTTPError as e:
                if last:
                    return _error(503, f"the last cascade tier ({tier.name}) failed: {type(e).__name__}",
                                  "server_error")
                continue
            if upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                if last or upstream.status_code < 500:
                    return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
                continue
            held, logprobs, buffer, done = [], [], b"", False
            chunks = upstream.aiter_raw()
            while not last and not done and len(logprobs) < cascade.first_tokens:
                try:
                    raw = await chunks.__anext__()
                except (StopAsyncIteration, httpx.HTTPError):
                    done = True
                    break
                events, buffer = sse_events(buffer + raw)
                for e in events:
                    held.append(e)
                    if e != b"[DONE]":
                        for c in json.loads(e).get("choices") or []:
                            logprobs += token_logprobs(c, chat)
            if not last and mean_logprob(logprobs) < cascade.escalate_below:
                await upstream.aclose()
                escalated.labels(tier.name).inc()
                cost += tier.price_out * len(logprobs) / 1e6  # what it wrote before it was cut off
                continue
            return StreamingResponse(relay_tier(tier, upstream, chunks, held, buffer, cost, asked or last,
                                                usage_asked),
                                     media_type="text/event-stream", headers={"x-tokenmill-tier": tier.name})
        return _error(503, "no cascade tier answered", "server_error")

    async def relay_tier(tier: Tier, upstream: httpx.Response, chunks, held: list[bytes], buffer: bytes, cost: float,
                         keep_logprobs: bool, usage_asked: bool) -> AsyncIterator[bytes]:
        """The chosen tier's stream: the held events, then the rest, each re-emitted with the router's logprobs
        stripped, the usage chunk given the tier and cost (and dropped if the client did not ask for usage)."""
        def out(e: bytes) -> bytes:
            if e == b"[DONE]":
                return event("[DONE]")
            payload = json.loads(e)
            if not keep_logprobs:
                strip_logprobs(payload)
            if payload.get("usage") and not payload.get("choices"):
                total = cost + tier.cost(payload["usage"])
                account(tier, payload["usage"], total)
                if not usage_asked:
                    return b""
                payload["usage"]["cost_usd"], payload["tier"] = total, tier.name
            return event(payload)

        try:
            for e in held:
                yield out(e)
            async for raw in chunks:
                events, buffer = sse_events(buffer + raw)
                for e in events:
                    yield out(e)
        except httpx.HTTPError as e:
            error = {"error": {"message": f"the {tier.name} tier failed midway ({type(e).__name__}); retry",
                               "type": "server_error", "param": None, "code": None}}
            yield event(error) + event("[DONE]")
        finally:
            await upstream.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request):
        if cascade is not None:
            return await climb(request, "/v1/completions", chat=False)
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if cascade is not None:
            return await climb(request, "/v1/chat/completions", chat=True)
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        for backend in pool.healthy():
            try:
                resp = await state["client"].get(backend.url + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return JSONResponse(resp.json())
        return _error(503, "no healthy replica answered", "server_error")

    @app.get("/health")
    async def health():
        n = len(pool.healthy())
        body = {"healthy_backends": n, "backends": len(pool.backends)}
        if pd is not None:  # both halves are needed
            body["healthy_prefill_backends"] = p = len(pd.prefill.healthy())
            n = min(n, p)
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/admin/backends")
    async def list_backends(request: Request):
        if not authorized(request):
            return _error(401, "invalid or missing API key", "authentication_error")
        return {"backends": [{"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "load": b.load,
                              "requests": b.requests, "errors": b.errors} for b in pool.backends.values()]}

    async def backend_url(request: Request) -> str | JSONResponse:
        if not authorized(request):
            return _error(401, "invalid or missing API key", "authentication_error")
        try:
            url = (await request.json())["url"]
            return pool.normalize(url)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return _error(400, f"the body must be {{\"url\": \"http://host:port\"}}: {e}", param="url")

    @app.post("/admin/backends")
    async def add_backend(request: Request):
        url = await backend_url(request)
        if isinstance(url, JSONResponse):
            return url
        pool.add(url)
        return {"added": url}

    @app.delete("/admin/backends")
    async def remove_backend(request: Request):
        url = await backend_url(request)
        if isinstance(url, JSONResponse):
            return url
        if not pool.remove(url):
            return _error(404, f"no backend {url}", param="url")
        return {"removed": url}

    return app


class RouterServer(uvicorn.Server):
    """Prints one ready line, with the port it really bound."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for srv in self.servers:
                for sock in srv.sockets:
                    port = sock.getsockname()[1]
            print(f"tokenmill router at http://{self.config.host}:{port}", flush=True)


def run_router(backends: list[str], policy: str, host: str, port: int, api_key: str | None,
               backend_api_key: str | None, health_interval_s: float, max_attempts: int,
               cascade: CascadeConfig | None = None, prefill: list[str] | None = None) -> int:
    """`backends` are the replicas (with `prefill`: the decode instances), or the cascade's tiers."""
    from tokenmill.router.policies import make_policy

    pool = BackendPool(backends or [t.url for t in cascade.tiers], backend_api_key, health_interval_s)
    pd = PDConfig(BackendPool(prefill, backend_api_key, health_interval_s), make_policy(policy)) if prefill else None
    app = build_router_app(pool, make_policy(policy), api_key, backend_api_key, max_attempts, cascade, pd)
    server = RouterServer(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    server.run()
    return 0
