"""What the router says about its replicas, for clients, probes and scrapers: GET /v1/models (every model some
healthy replica lists), GET /health (200 while a replica, and with prefill/decode a prefill one too, is healthy) and
GET /metrics (router/metrics.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from tokenmill.router.disagg import PDConfig
from tokenmill.router.errors import error_response
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.replicas import ReplicaPool


def add_status_routes(app: FastAPI, pool: ReplicaPool, pd: PDConfig | None, metrics: RouterMetrics,
                      client: Callable[[], httpx.AsyncClient]) -> None:
    """`client()`: the client toward the replicas, which exists only while the app runs (its lifespan opens it)."""

    async def models_of(backend) -> list | None:
        try:
            resp = await client().get(backend.url + "/v1/models", timeout=10.0)
            data = resp.json()["data"] if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return data if isinstance(data, list) else None

    @app.get("/v1/models", response_model=None)
    async def models() -> Response:
        """Every model some healthy replica lists (replicas may serve different models), each once, as the first
        replica that lists it describes it."""
        answers = [a for a in await asyncio.gather(*(models_of(b) for b in pool.healthy())) if a is not None]
        if not answers:
            return error_response(503, "no healthy replica answered", "server_error")
        cards: dict[str, dict] = {}
        for data in answers:
            for card in data:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], card)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        n = len(pool.healthy())
        body = {"healthy_backends": n, "backends": len(pool.backends)}
        if pd is not None:  # both halves are needed
            body["healthy_prefill_backends"] = p = len(pd.prefill.healthy())
            n = min(n, p)
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")
