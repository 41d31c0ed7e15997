"""The real ModelBackend of the model pool (server/model_pool.py): each model is its own AsyncEngine (its own
engine process) and its own app from the unchanged `create_app`, so a model served among several answers exactly
as it would alone. The app's lifespan (attach the engine to the loop, shut it down) is driven here, at load and
unload, instead of by uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.server.model_app import start_model_app
from tokenmill.server.model_pool import Loaded, ModelEntry
from tokenmill.server.settings import ServerSettings


def weight_file_bytes(path: str | Path) -> int:
    """The bytes of a model's weight files: a GGUF file's size, or a directory's *.safetensors. A first estimate
    only: --quantization or a dequantized GGUF changes what they take once loaded (the engine's figure then
    replaces it)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def kv_budget(config) -> int:
    """The KV cache bytes a model's engine will size its pool to (--kv-cache-memory, else the engine's default,
    evaluated now as the engine will at its start)."""
    from tokenmill.config import default_kv_cache_memory

    return config.cache.kv_cache_memory or default_kv_cache_memory()


@dataclass
class EngineBackend:
    """Builds each model's engine and app from the serve flags (`args`) and the HTTP settings each app gets
    (`settings_of(name, path)`)."""

    args: argparse.Namespace
    settings_of: Callable[[str, str], ServerSettings]

    def estimate(self, entry: ModelEntry) -> int:
        from tokenmill.model.paths import resolve_model_path

        return weight_file_bytes(resolve_model_path(entry.path)) + kv_budget(entry.config)

    def load(self, entry: ModelEntry) -> Loaded:
        served = start_model_app(entry.config, self.args, self.settings_of(entry.name, entry.path),
                                 label=f"model {entry.name}: ")
        return Loaded(served.app, served.engine, served.metrics.registry,
                      served.info.weight_bytes + served.info.kv_bytes, served.info.max_model_len)

    def attach(self, loaded: Loaded, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        loaded.engine.on_dead = on_dead
        loaded.engine.attach(loop)

    def unload(self, loaded: Loaded) -> None:
        """Stop the engine process and let go of everything the model's app held (its engine, tokenizer, pipe ends):
        see forget_unloaded_apps."""
        loaded.engine.shutdown()
        loaded.app = loaded.engine = loaded.registry = None
        forget_unloaded_apps()


def forget_unloaded_apps() -> None:
    """FastAPI memoizes what kind of callable each route endpoint is in module-level LRU caches (4096 entries each,
    fastapi/dependencies/models.py) that hold the endpoints themselves; create_app's endpoints are closures over
    the engine, so without this every unloaded model's engine, tokenizer and pipe ends would stay alive until about
    150 more loads pushed them out (measured: ~8 MiB and 4 file descriptors per SmolLM2 load). The caches are only
    a speed-up (a live app's endpoints are classified again on their next use); then a full collection frees the
    reference cycles (callbacks, closures) the engine and its app form."""
    try:
        from fastapi.dependencies import models
    except ImportError:
        models = None
    for value in vars(models).values() if models is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    gc.collect()
