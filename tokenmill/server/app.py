"""The OpenAI-compatible HTTP API over an AsyncEngine: create_app(engine, settings) assembles it.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (GET, DELETE
/v1/responses/{id}), Anthropic's POST /v1/messages and /v1/messages/count_tokens, GET /health, GET /metrics,
POST /tokenize, POST /detokenize (as vLLM has them), GET /version. Each API surface's routes live in their own
routes_*.py and share one Serving (serving.py: the engine, names, encoder, and the one way a generating request
starts); what a route needs lives beside it: the guard (guard.py), prompt encoding (prompts.py), response bodies
(responses.py), streaming (streaming.py), errors (errors.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.admin import add_admin_routes
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.guard import Guard
from tokenmill.server.lora_routes import add_lora_routes
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.routes_completions import add_completion_routes
from tokenmill.server.routes_embeddings import add_embedding_routes
from tokenmill.server.routes_messages import add_messages_routes
from tokenmill.server.routes_models import add_model_routes
from tokenmill.server.routes_responses import add_responses_routes
from tokenmill.server.routes_status import add_status_routes
from tokenmill.server.routes_tokens import add_token_routes
from tokenmill.server.serving import Serving
from tokenmill.server.settings import ServerSettings
from tokenmill.server.ui import add_ui_routes

__all__ = ["ServerSettings", "create_app"]


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics(settings.model_name)
    if engine.observer is None:
        engine.observer = metrics
    info = engine.info
    metrics.set_weights(info.weight_format, info.weight_bytes)
    metrics.set_cache(info.kv_bytes, info.state_slots, info.state_bytes, info.state_snapshots)
    metrics.block_size = info.block_size
    serving = Serving(engine, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    app.state.loras = serving.loras
    install_error_handlers(app, metrics.on_rejected)
    if settings.ui:
        add_ui_routes(app, engine, metrics, settings.model_name)
    add_admin_routes(app, engine)
    add_lora_routes(app, serving.loras)
    # registered in this order (the route table's order, as it always was)
    add_status_routes(app, serving)
    add_model_routes(app, serving)
    add_completion_routes(app, serving)
    add_messages_routes(app, serving)
    add_responses_routes(app, serving)
    add_embedding_routes(app, serving)
    add_token_routes(app, serving)
    # added last, so outermost: keys, body size and load shedding before anything parses a request (guard.py)
    app.add_middleware(Guard, settings=settings, on_reject=metrics.on_rejected, overloaded=engine.overloaded)
    return app
