"""The prefill/decode proxy's request path (the halves themselves: router/disagg.py): the decode instance is chosen
first (it must take KV), the prefill half runs on a prefill instance that ships the prompt's KV there, then the
decode half is forwarded to it and relayed to the client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi.responses import Response

from tokenmill.router.disagg import (
    KVReceiver,
    PDConfig,
    decode_body,
    kv_receiver,
    new_transfer_id,
    prefill_body,
)
from tokenmill.router.errors import error_response
from tokenmill.router.forward import (
    JSON_HEADERS,
    RETRY_STATUS,
    Forwarder,
    Job,
    off_loop,
    parse_object,
    routing_key,
    watched,
)
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import reads_prompt
from tokenmill.router.replicas import Replica, ReplicaPool


class PDProxy:
    def __init__(self, pd: PDConfig, pool: ReplicaPool, policy: Any, forwarder: Forwarder, metrics: RouterMetrics,
                 client: Callable[[], httpx.AsyncClient], max_attempts: int):
        self.pd, self.pool, self.policy, self.forwarder = pd, pool, policy, forwarder
        self.metrics, self.client, self.max_attempts = metrics, client, max_attempts

    async def handle(self, body: bytes, path: str) -> Response:
        data = await off_loop(lambda: parse_object(body), len(body))
        if data is None:
            return error_response(400, "the body must be a JSON object")
        key = await routing_key(body, reads_prompt(self.policy, self.pd.prefill_policy))
        decode, receiver = await self.decode_instance(key)
        if decode is None:
            self.metrics.unrouted.inc()
            return error_response(503, "no healthy decode instance with a KV receiver (--kv-transfer-config "
                                       "kv_consumer)", "server_error")
        transfer_id = new_transfer_id()
        started = time.monotonic()
        half = await off_loop(lambda: json.dumps(prefill_body(data, transfer_id, receiver)).encode(), len(body))
        answer = await self.prefill(half, path, key)
        if isinstance(answer, Response):
            return answer  # the request itself is bad (4xx): as the prefill instance said
        self.metrics.pd_prefill.observe(time.monotonic() - started)
        outcome = self.record(decode, answer)
        rest = await off_loop(lambda: json.dumps(decode_body(data, transfer_id, answer)).encode(), len(body))
        sent_at = time.monotonic()
        return self.forwarder.respond(Job(rest, path, key, decode, {"x-tokenmill-kv-transfer": outcome},
                                          lambda: self.metrics.pd_first_decode.observe(time.monotonic() - sent_at)))

    async def decode_instance(self, key: list[bytes]) -> tuple[Replica | None, KVReceiver | None]:
        """The policy's pick among the healthy decode instances, then the others by load: the first that says
        where it takes KV."""
        healthy = self.pool.healthy()
        chosen = self.policy.choose(healthy, key) if healthy else None
        for backend in sorted(healthy, key=lambda b: (b is not chosen, b.load)):
            try:
                receiver = await kv_receiver(self.client(), self.pd, backend)
            except httpx.HTTPError as e:
                self.pool.mark_failed(backend, f"/v1/kv_transfer: {type(e).__name__}")
                continue
            if receiver is not None:
                return backend, receiver
        return None, None

    def record(self, decode: Replica, answer: dict | None) -> str:
        """How the KV went ('sent', 'failed', 'prefill_error'), counted."""
        params = (answer or {}).get("kv_transfer_params")
        params = params if isinstance(params, dict) else {}
        outcome = "prefill_error" if answer is None else "sent" if params.get("status") == "sent" else "failed"
        self.metrics.pd_requests.labels(outcome).inc()
        if outcome == "failed":  # ask again next time: the decode instance may have restarted on another port
            self.pd.receivers.pop(decode.url, None)
        if outcome == "sent":
            tail, size = params.get("tail_seconds", 0.0), params.get("num_bytes", 0)
            if isinstance(tail, (int, float)) and isinstance(size, (int, float)) and size >= 0:
                self.metrics.pd_transfer.observe(tail)
                self.metrics.pd_bytes.inc(size)
        return outcome

    async def prefill(self, body: bytes, path: str, key: list[bytes]) -> dict | Response | None:
        """The prefill half on a prefill instance (the next one while one fails): its answer, a 4xx response to
        hand back, or None if none could run it."""
        tried: set[str] = set()
        for _ in range(self.max_attempts):
            candidates = self.pd.prefill.healthy(tried)
            if not candidates:
                return None
            backend = self.pd.prefill_policy.choose(candidates, key)
            tried.add(backend.url)
            with backend.busy():
                try:
                    resp = await watched(backend, self.client().post(backend.url + path, content=body,
                                                                     headers=JSON_HEADERS))
                except httpx.HTTPError as e:
                    self.failed(backend, f"{type(e).__name__}: {e}")
                    continue
            if resp.status_code == 200:
                answer = parse_object(resp.content)
                if answer is None:
                    self.failed(backend, "its answer is not a JSON object")
                    continue
                self.metrics.requests.labels(backend.url, "ok").inc()
                return answer
            if resp.status_code in RETRY_STATUS or resp.status_code >= 500:
                self.metrics.requests.labels(backend.url, "retried").inc()
                if resp.status_code != 429:
                    self.pd.prefill.mark_failed(backend, f"HTTP {resp.status_code}")
                continue
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
        return None

    def failed(self, backend: Replica, why: str) -> None:
        self.metrics.requests.labels(backend.url, "error").inc()
        self.pd.prefill.mark_failed(backend, why)
