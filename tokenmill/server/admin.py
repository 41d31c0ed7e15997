"""The operator's endpoints under /admin/: the guard (guard.py) opens them only with --admin-api-key and answers 404
without one, so a client key never reaches them.

GET /admin/kv_peers: the consumers this producer may ship KV to. POST /admin/kv_peers {"address": "host:port"}: one
more, for a running producer (the router's call when it learns of a decode instance). The list lives in this API
process, where each request's destination is checked (disagg/transfer.py); it lasts until the server stops (put
lasting peers in --kv-transfer-config kv_peers).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidRequest
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.server.json_body import parse_json

log = logging.getLogger("tokenmill")


def add_admin_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.get("/admin/kv_peers")
    async def list_kv_peers() -> dict:
        cfg = engine.config.kv_transfer
        return {"kv_peers": list(cfg.kv_peers) if cfg is not None else []}

    @app.post("/admin/kv_peers")
    async def add_kv_peer(request: Request) -> dict:
        body = parse_json(await request.body(), request.headers.get("content-type"))
        cfg = tcp_producer(engine)
        address = peer_address(body)
        if address not in cfg.kv_peers:
            cfg.kv_peers.append(address)
            log.info("KV peer %s added: this producer may now ship KV there", address)
        return {"kv_peers": list(cfg.kv_peers)}


def tcp_producer(engine: AsyncEngine) -> KVTransferConfig:
    """The config whose kv_peers a POST extends; 400 on a server that ships no KV over tcp (the list means nothing
    there)."""
    cfg = engine.config.kv_transfer
    if cfg is None or not cfg.produces or cfg.kv_connector != "tcp":
        what = "no --kv-transfer-config" if cfg is None else f"kv_role {cfg.kv_role}, kv_connector {cfg.kv_connector}"
        raise InvalidRequest(f"this server ships no KV over tcp ({what}), so it has no kv_peers", param="address")
    return cfg


def peer_address(body: dict) -> str:
    """The body's one field, as kv_peers holds it; 400 naming the field otherwise."""
    unknown = sorted(set(body) - {"address"})
    if unknown:
        raise InvalidRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; the body is {{\"address\": "
                             "\"host:port\"}", param=unknown[0])
    try:
        return KVTransferConfig.peer(body.get("address"))
    except ValueError as e:
        raise InvalidRequest(f"address: {e}", param="address") from None
