"""One model served: its engine (its own process, started here), its metrics and its app, built the same way for
`tokenmill serve` (server/launch.py) and for each model of the model pool (server/pool_backend.py)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.server.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.messages import EngineInfo
    from tokenmill.server.metrics import ServerMetrics


@dataclass(kw_only=True)
class ModelApp:
    engine: AsyncEngine
    info: EngineInfo
    metrics: ServerMetrics
    app: FastAPI


def start_model_app(config: EngineConfig, args: argparse.Namespace, settings: ServerSettings,
                    label: str = "") -> ModelApp:
    """Start the engine of `config` with the serve flags' admission limits (`args`), print its start-up summary
    (after `label`), and build its app; an engine whose app cannot be built is stopped again."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import create_app
    from tokenmill.server.metrics import ServerMetrics

    metrics = ServerMetrics(settings.model_name, config.scheduler.slo_ttft_ms, config.scheduler.slo_itl_ms)
    engine = AsyncEngine(config, max_waiting_requests=args.max_waiting_requests,
                         max_waiting_tokens=args.max_waiting_tokens, observer=metrics,
                         slo_admission=args.slo_admission)
    try:
        info = engine.start()
        print(f"{label}{info.startup_summary}", file=sys.stderr, flush=True)
        app = create_app(engine, settings, metrics)
    except BaseException:
        engine.shutdown()
        raise
    return ModelApp(engine=engine, info=info, metrics=metrics, app=app)
