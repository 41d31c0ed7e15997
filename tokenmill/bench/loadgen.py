"""The load generator: seeded arrival times, and streaming OpenAI requests timed chunk by chunk.

Arrivals follow vLLM's benchmark: gaps drawn from a gamma distribution with shape = burstiness and scale =
1/(rate·burstiness) (burstiness 1 is a Poisson process; < 1 burstier, > 1 more even), then scaled so the last
request arrives at exactly N/rate, which keeps throughput stable across seeds. An infinite rate sends
everything at once. `--max-concurrency` caps requests in flight; a request's clock starts when it is
actually sent, after any wait for a slot, as in vLLM.

Requests are plain text (portable across servers), `stream: true` with `stream_options.include_usage`,
`max_tokens` = the dataset's output length, greedy, and `ignore_eos` (vLLM and tokenmill honour it; other
servers ignore unknown fields). In a mixed load (`--request-class`) each request is given a class by a seeded
shuffle and carries that class's `priority`, `slo_ttft_ms` and `slo_itl_ms` in its body.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import RequestClass, RequestResult
from tokenmill.bench.sse import DONE, SSEParser

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                  normalize: bool = True) -> np.ndarray:
    """Send time of each of `n` requests, in seconds from the start (all 0 for an infinite rate)."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"rate must be positive, got {rate}")
    if burstiness <= 0 or math.isnan(burstiness):
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if n <= 0 or math.isinf(rate):
        return np.zeros(max(n, 0))
    if math.isinf(burstiness):  # the gamma's limit: perfectly even spacing
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if normalize and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


CLASS_STREAM = 1  # the class draw's own random stream, so it does not echo the arrival gaps of the same seed


def draw_classes(n: int, shares: Sequence[float], seed: int = 0) -> list[int]:
    """The class index of each of `n` requests: counts follow the shares as closely as whole requests allow
    (largest remainders), in a seeded random order, so small runs get the mix asked for and reruns the same one."""
    if not shares or any(not (s > 0 and math.isfinite(s)) for s in shares):
        raise ValueError(f"shares must be positive and finite, got {list(shares)}")
    total = float(sum(shares))
    quotas = [n * s / total for s in shares]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    labels = np.repeat(np.arange(len(shares)), counts)
    return np.random.default_rng((seed, CLASS_STREAM)).permutation(labels).tolist()


def class_body(c: RequestClass) -> dict[str, Any]:
    """What a request of class `c` tells the server: only the fields the class sets (vLLM refuses a nonzero
    `priority` unless it schedules by priority, so nothing is sent for a class that gives none)."""
    fields = {"priority": c.priority, "slo_ttft_ms": c.slo_ttft_ms, "slo_itl_ms": c.slo_tpot_ms}
    return {k: v for k, v in fields.items() if v is not None}


@dataclass
class LoadConfig:
    """Where and how to send the workload."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 6 * 3600.0
    progress: bool = True


def request_body(cfg: LoadConfig, req: BenchRequest, max_tokens: int | None = None,
                 extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request; `extra_body` (this request's own fields) goes over cfg.extra_body."""
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens or req.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    body.update(extra_body or {})
    return body


def chunk_text(data: dict[str, Any], endpoint: str) -> str:
    """The text a streamed chunk carries for choice 0 ('' for role-only, finish-only and usage chunks)."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


class StreamRecorder:
    """Turns timed SSE payloads of one request into a RequestResult (kept apart from I/O for testing)."""

    def __init__(self, endpoint: str, prompt_len: int, sent_at: float) -> None:
        self.endpoint, self.sent_at = endpoint, sent_at
        self.result = RequestResult(success=False, prompt_len=prompt_len)
        self._last: float | None = None
        self._text: list[str] = []
        self.done = False

    def on_event(self, payload: str, at: float) -> None:
        if payload.strip() == DONE:
            self.done = True
            return
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            self.result.error = f"malformed event: {payload[:200]!r}"
            self.done = True
            return
        if not isinstance(data, dict):
            return
        if data.get("error") and not data.get("choices"):
            error = data["error"]
            self.result.error = str(error.get("message", error) if isinstance(error, dict) else error)
            self.done = True
            return
        text = chunk_text(data, self.endpoint)
        if text:
            if self._last is None:
                self.result.ttft = at - self.sent_at
            else:
                self.result.itl.append(at - self._last)
            self._last = at
            self._text.append(text)
        usage = data.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                self.result.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens"):
                self.result.prompt_len = int(usage["prompt_tokens"])

    def finish(self) -> RequestResult:
        r = self.result
        r.generated_text = "".join(self._text)
        if self._last is not None and not r.error:
            r.success = True
            r.latency = self._last - self.sent_at
        elif not r.error:
            r.error = "the stream ended without any content chunk"
        return r


async def send_request(client: httpx.AsyncClient, cfg: LoadConfig, req: BenchRequest, t0: float,
                       max_tokens: int | None = None, extra_body: dict[str, Any] | None = None) -> RequestResult:
    """Stream one request and time its chunks; never raises (failures come back as unsuccessful results)."""
    sent_at = time.perf_counter()
    rec = StreamRecorder(cfg.endpoint, req.prompt_len, sent_at)
    rec.result.start_time = sent_at - t0
    parser = SSEParser()
    request_json = request_body(cfg, req, max_tokens, extra_body)
    try:
        async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=request_json) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return rec.finish()
            async for chunk in resp.aiter_bytes():
                at = time.perf_counter()
                for payload in parser.feed(chunk):
                    rec.on_event(payload, at)
                if rec.done:
                    break
            at = time.perf_counter()
            for payload in parser.close():
                rec.on_event(payload, at)
    except (httpx.HTTPError, OSError) as e:
        rec.result.error = f"{type(e).__name__}: {e}"
    return rec.finish()


def make_client(cfg: LoadConfig) -> httpx.AsyncClient:
    """One connection pool for the run; unlimited connections, so a request never waits on the pool
    (that wait would be counted as TTFT); `max_concurrency` is enforced by a semaphore instead."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(cfg.timeout_s, connect=30.0))


async def run_load(cfg: LoadConfig, requests: Sequence[BenchRequest],
                   extra_bodies: Sequence[dict[str, Any]] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results (in request order) and the duration
    from the start of sending to the last response. `extra_bodies[i]`, if given, goes into request i's body."""
    if extra_bodies is not None and len(extra_bodies) != len(requests):
        raise ValueError(f"{len(extra_bodies)} extra bodies for {len(requests)} requests")
    bodies = extra_bodies if extra_bodies is not None else [None] * len(requests)
    times = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not cfg.progress, leave=False)

    async with make_client(cfg) as client:
        async def one(req: BenchRequest, at: float, extra: dict[str, Any] | None) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                result = await send_request(client, cfg, req, t0, extra_body=extra)
            else:
                async with slots:
                    result = await send_request(client, cfg, req, t0, extra_body=extra)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, float(t), b) for r, t, b in zip(requests, times, bodies)))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


class ServerUnreachable(Exception):
    """The server cannot be asked for its models (down, wrong URL, wrong key)."""


def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The id of the first model the server lists at /v1/models: checks the URL and the key on the way."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot connect ({type(e).__name__}: {e})") from None
    if resp.status_code in (401, 403):
        raise ServerUnreachable(f"the server refused the API key (HTTP {resp.status_code}); pass --api-key")
    if resp.status_code != 200:
        raise ServerUnreachable(f"GET /v1/models answered HTTP {resp.status_code}; pass --model")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnreachable("GET /v1/models listed no model; pass --model") from None
