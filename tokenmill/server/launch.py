"""`tokenmill serve`: start the engine process, then uvicorn; print one ready line; stop cleanly.

SIGTERM / Ctrl-C: uvicorn stops accepting, lets requests in flight finish for up to --shutdown-timeout seconds,
cancels (aborts) the rest, then the engine process is stopped and we exit 0. If the engine process dies, every
request in flight fails, the server says so on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import uvicorn

from tokenmill.engine_args import EngineArgs
from tokenmill.server.http_server import JSONErrorH11Protocol, Server
from tokenmill.server.model_app import start_model_app


def default_served_name(model: str | None) -> str:
    if model:
        return model
    from tokenmill.model.paths import default_model_path

    return Path(default_model_path()).stem


def check_server_flags(args: argparse.Namespace) -> None:
    from tokenmill.errors import ConfigError

    for flag in ("max_waiting_requests", "max_waiting_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")


def server_settings(args: argparse.Namespace, names: list[str], model_path: str):
    """The HTTP settings of one model's app (or, with several models, of the dispatcher in front of them)."""
    from tokenmill.server.app import ServerSettings
    from tokenmill.server.lora_routes import parse_lora_modules

    return ServerSettings(names, model_path=model_path,
                          api_key=args.api_key or None, admin_api_key=args.admin_api_key or None,
                          metrics_api_key=args.metrics_api_key or None,
                          client_priority_range=args.client_priority_range,
                          max_request_bytes=args.max_request_bytes,
                          max_stored_responses=args.max_stored_responses, pooling=args.pooling,
                          runner=args.runner,
                          ui=not args.no_ui, reasoning_parser=args.reasoning_parser,
                          default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                          lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)))


def serve(args: argparse.Namespace) -> int:
    check_server_flags(args)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    names = args.served_model_name or [default_served_name(args.model)]
    settings = server_settings(args, names, str(args.model or default_served_name(None)))

    state = {"exit_code": 0, "server": None}

    def on_signal(sig, frame):  # before uvicorn runs and after it returns (it re-raises what it caught)
        raise SystemExit(state["exit_code"])

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    served = None
    try:
        served = start_model_app(config, args, settings)
        engine = served.engine
        # uvicorn's own timeout is only the backstop: Server ends what is left at --shutdown-timeout with a 503
        uconfig = uvicorn.Config(served.app, host=args.host, port=args.port, log_level="warning", lifespan="on",
                                 access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 5,
                                 timeout_keep_alive=5, http=JSONErrorH11Protocol)
        server = Server(uconfig, names[0], engine, args.shutdown_timeout)
        state["server"] = server

        def on_dead(reason: str) -> None:
            print(f"error: {reason}; the server is stopping", file=sys.stderr, flush=True)
            state["exit_code"] = 1
            server.should_exit = True

        engine.on_dead = on_dead
        asyncio.run(server.serve())
        if not server.started and state["exit_code"] == 0:
            state["exit_code"] = 1  # uvicorn could not start (port in use, ...): it said why
    finally:
        if served is not None:
            served.engine.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
    return state["exit_code"]
