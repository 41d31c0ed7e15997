"""What this server says about itself, for probes, scrapers and the router: GET /health (503 once the engine is
dead or silent), GET /metrics (Prometheus), GET /version, and GET /v1/kv_transfer (its part in disaggregated
prefill/decode)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import tokenmill
from tokenmill.server.errors import error_body
from tokenmill.server.serving import Serving


def add_status_routes(app: FastAPI, serving: Serving) -> None:
    engine, metrics = serving.engine, serving.metrics

    @app.get("/health")
    async def health():
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"the engine is not running: {engine.dead or 'no recent heartbeat'}",
                                       "service_unavailable", None, "engine_dead"), status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/v1/kv_transfer")
    async def kv_transfer():
        """This server's part in disaggregated prefill/decode, for the router: its role, its connector and where a
        tcp consumer receives KV (its host as the router reaches it, this port)."""
        cfg = engine.config.kv_transfer
        if cfg is None:
            return {"kv_role": None}
        address = serving.info.kv_transfer_address
        return {"kv_role": cfg.kv_role, "kv_connector": cfg.kv_connector, "kv_address": address,
                "kv_port": int(address.rsplit(":", 1)[1]) if address else None}
