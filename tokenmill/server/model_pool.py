"""ModelPool: which of the models one `tokenmill serve --model A=... --model B=...` serves are loaded, and when they
load and unload. Plain asyncio on the server's event loop; loading and unloading block, so they run in threads.

Each configured model is one `ModelEntry` whose state moves unloaded -> loading -> loaded -> unloading -> unloaded.
A request `acquire`s its model (loading it first if needed, one load per model however many requests wait for
it) and `release`s it when its response has ended; `in_flight` counts the requests between the two, so only idle
models are ever evicted, least recently used first. Room is counted two ways, both checked before a load:
`--max-loaded-models` (models not unloaded) and `--memory-limit` (their weights + KV cache bytes: a model's
estimate before its first load, what its engine reported after). A model that alone exceeds the memory limit is
refused at once (ModelTooLarge); a request that finds every slot taken by busy models waits for one to go idle, at
most `wait_timeout` seconds (then ModelUnavailable, 503). A load starts only once the models being unloaded have
really stopped, so their memory is back before the next model takes its own. `--keep-alive` unloads a model idle
that long. An engine that dies makes its model unloaded (the next request loads it again), never the server stop.

The pool knows nothing of engines or HTTP: a `ModelBackend` loads, attaches and unloads (server/pool_backend.py for
the real one; tests pass a fake).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.server.errors import APIError

log = logging.getLogger("tokenmill")

STATES = ("unloaded", "loading", "loaded", "unloading")
DEFAULT_WAIT_TIMEOUT_S = 300.0


class ModelUnavailable(APIError):
    """The model cannot serve now (every slot busy past the wait, or its load failed): retrying later may work."""

    status, type, code = 503, "service_unavailable", "model_unavailable"


class ModelTooLarge(APIError):
    """The model cannot fit --memory-limit even with every other model unloaded: retrying cannot help."""

    status, type, code = 400, "invalid_request_error", "model_too_large"


@dataclass
class PoolLimits:
    max_loaded: int | None = None  # --max-loaded-models; None: all of them
    memory_limit: int | None = None  # --memory-limit, bytes of weights + KV cache; None: no limit
    keep_alive: float | None = None  # --keep-alive, seconds idle before unloading; None: never
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S  # --model-wait-timeout: a wait for a busy slot, then 503

    def __post_init__(self) -> None:
        from tokenmill.errors import ConfigError

        if self.max_loaded is not None and self.max_loaded < 1:
            raise ConfigError(f"--max-loaded-models must be >= 1, got {self.max_loaded}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise ConfigError(f"--memory-limit must be a positive number of bytes, got {self.memory_limit}")
        if self.keep_alive is not None and not self.keep_alive >= 0:
            raise ConfigError(f"--keep-alive must be >= 0 seconds, got {self.keep_alive}")
        if not self.wait_timeout > 0:
            raise ConfigError(f"--model-wait-timeout must be > 0 seconds, got {self.wait_timeout}")


@dataclass
class Loaded:
    """What one load made: the model's ASGI app, its engine (healthy, dead, fail_all), its metrics registry (or
    None) and the bytes its weights and KV cache take, as its engine reported them."""

    app: Any
    engine: Any
    registry: Any
    bytes: int
    max_model_len: int | None = None


class ModelBackend(Protocol):
    def estimate(self, entry: ModelEntry) -> int:
        """Bytes the model's weights and KV cache will take, before it has ever loaded."""

    def load(self, entry: ModelEntry) -> Loaded:
        """Start the model's engine and build its app (blocking: runs in a worker thread)."""

    def attach(self, loaded: Loaded, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        """Start delivering its outputs to `loop` (on the loop); `on_dead(reason)` from any thread if it dies."""

    def unload(self, loaded: Loaded) -> None:
        """Stop its engine (blocking: runs in a worker thread)."""


@dataclass
class ModelEntry:
    name: str
    path: str
    config: Any = None  # the model's EngineConfig
    state: str = "unloaded"
    loaded: Loaded | None = None
    last_used: float = 0.0
    in_flight: int = 0
    bytes: int = 0  # counted against --memory-limit while not unloaded: the estimate while loading, then measured
    measured: int | None = None  # the bytes of its last load, the estimate of the next one
    error: str | None = None  # why its last load failed or its engine died
    failure: APIError | None = None  # what the requests waiting on a failed load get
    failures: int = 0  # failed loads so far: a waiter that sees this change gets `failure`
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # reason -> count
    load_seconds: float | None = None  # the last load's, request to ready
    task: asyncio.Task | None = None  # its load or unload under way

    def card(self) -> dict:
        """What /v1/models says of it beyond the OpenAI fields."""
        out: dict[str, Any] = {"status": self.state, "in_flight": self.in_flight}
        if self.error is not None:
            out["error"] = self.error
        return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ModelPool:
    def __init__(self, entries: list[ModelEntry], backend: ModelBackend, limits: PoolLimits | None = None, *,
                 say: Callable[[str], None] = _stderr, clock: Callable[[], float] = time.monotonic):
        if not entries:
            raise ValueError("a model pool needs at least one model")
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise ValueError("model names must be unique")
        self.backend, self.limits, self.say, self.clock = backend, limits or PoolLimits(), say, clock
        self._changed_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keep_alive_task: asyncio.Task | None = None
        self._closed = False

    @property
    def default(self) -> ModelEntry:
        """The first model: the one a request that names none gets."""
        return next(iter(self.entries.values()))

    def get(self, name: str) -> ModelEntry | None:
        return self.entries.get(name)

    # ---- life cycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """On the running loop: start the keep-alive sweep (if --keep-alive)."""
        self._loop = asyncio.get_running_loop()
        self._changed_event = asyncio.Event()
        if self.limits.keep_alive is not None:
            self._keep_alive_task = self._loop.create_task(self._keep_alive())

    async def close(self) -> None:
        """Unload everything (loads under way finish first: a thread blocked in a load cannot be cancelled)."""
        self._closed = True
        if self._keep_alive_task is not None:
            self._keep_alive_task.cancel()
            await asyncio.gather(self._keep_alive_task, return_exceptions=True)
        while True:
            busy = [e.task for e in self.entries.values() if e.task is not None and not e.task.done()]
            if busy:
                await asyncio.gather(*busy, return_exceptions=True)
            loaded = [e for e in self.entries.values() if e.state == "loaded"]
            if not loaded and not busy:
                return
            for e in loaded:
                self._start_unload(e, "shutdown", "the server is stopping")

    def fail_all(self, error: Exception) -> int:
        """End every request in flight on every loaded model with `error` (shutdown past its timeout)."""
        return sum(e.loaded.engine.fail_all(error) for e in self.entries.values() if e.loaded is not None)

    # ---- requests ------------------------------------------------------------------------------------------
    async def acquire(self, name: str, touch: bool = True) -> ModelEntry:
        """The model `name`, loaded, with this request counted in its `in_flight` until `release`. Waits while it
        loads (or while another model unloads to make room), and at most `wait_timeout` seconds for a busy slot.
        `touch` False: the request does not count as use for LRU and --keep-alive (the dashboard's polling)."""
        entry = self.entries[name]
        seen_failures = entry.failures
        deadline: float | None = None
        while True:
            if self._closed:
                raise ModelUnavailable("the server is stopping", param="model")
            if entry.state == "loaded":
                if self._alive(entry):
                    entry.in_flight += 1
                    if touch:
                        entry.last_used = self.clock()
                    return entry
                self._engine_died(entry, entry.loaded, entry.loaded.engine.dead or "its engine stopped answering")
            elif entry.state == "unloaded":
                if entry.failures != seen_failures:
                    raise entry.failure
                victims = self._room_for(entry)
                if victims is not None:
                    self._start_load(entry, victims)
                elif deadline is None:
                    deadline = self.clock() + self.limits.wait_timeout
            timeout = None
            if entry.state == "unloaded" and deadline is not None:  # waiting for a busy model to go idle
                timeout = deadline - self.clock()
                if timeout <= 0:
                    raise ModelUnavailable(self._busy_message(entry), param="model")
            await self._wait_change(timeout)

    def release(self, entry: ModelEntry, touch: bool = True) -> None:
        """A request's response has ended (however): the model may now be idle."""
        entry.in_flight -= 1
        if touch:
            entry.last_used = self.clock()
        if entry.in_flight == 0:
            self._enforce_memory()
            self._changed()

    # ---- room --------------------------------------------------------------------------------------------------
    def estimate(self, entry: ModelEntry) -> int:
        return entry.measured if entry.measured is not None else self.backend.estimate(entry)

    def _room_for(self, entry: ModelEntry) -> list[ModelEntry] | None:
        """The idle models to unload so `entry` fits (least recently used first; [] if it fits now), or None if it
        cannot fit until a busy model goes idle. Models already unloading count as gone (the load waits for them)."""
        limit, most = self.limits.memory_limit, self.limits.max_loaded
        need = self.estimate(entry)
        if limit is not None and need > limit:
            raise ModelTooLarge(f"the model {entry.name!r} needs about {_mib(need)} (weights + KV cache) and the "
                                f"server's --memory-limit is {_mib(limit)}: it can never be loaded here; raise "
                                "--memory-limit or lower --kv-cache-memory", param="model")
        others = [e for e in self.entries.values() if e is not entry and e.state in ("loading", "loaded")]
        count, used = len(others), sum(e.bytes for e in others)

        def fits() -> bool:
            return (most is None or count + 1 <= most) and (limit is None or used + need <= limit)

        victims: list[ModelEntry] = []
        idle = sorted((e for e in others if e.state == "loaded" and e.in_flight == 0), key=lambda e: e.last_used)
        for candidate in [None, *idle]:
            if candidate is not None:
                victims.append(candidate)
                count, used = count - 1, used - candidate.bytes
            if fits():
                return victims
        return None

    def _busy_message(self, entry: ModelEntry) -> str:
        loaded = [e.name for e in self.entries.values() if e.state != "unloaded" and e is not entry]
        return (f"the model {entry.name!r} is not loaded and no loaded model ({', '.join(map(repr, loaded))}) went "
                f"idle within {self.limits.wait_timeout:g} s to make room (--max-loaded-models / --memory-limit); "
                "retry later")

    def _enforce_memory(self) -> None:
        """After a load measured more than its estimate: unload idle models, least recently used first, until the
        loaded ones fit --memory-limit again (busy ones are unloaded when they go idle: this runs at each release)."""
        limit = self.limits.memory_limit
        if limit is None:
            return
        held = [e for e in self.entries.values() if e.state in ("loading", "loaded")]
        used = sum(e.bytes for e in held)
        for e in sorted((e for e in held if e.state == "loaded" and e.in_flight == 0), key=lambda e: e.last_used):
            if used <= limit:
                return
            self._start_unload(e, "memory", f"over --memory-limit {_mib(limit)}")
            used -= e.bytes

    # ---- load and unload -------------------------------------------------------------------------------------
    def _start_load(self, entry: ModelEntry, victims: list[ModelEntry]) -> None:
        for victim in victims:
            self._start_unload(victim, "evicted", f"least recently used, to make room for {entry.name!r}")
        freeing = [e.task for e in self.entries.values() if e.state == "unloading" and e.task is not None]
        entry.state, entry.bytes = "loading", self.estimate(entry)
        entry.task = asyncio.get_running_loop().create_task(self._load(entry, freeing))
        self._changed()

    async def _load(self, entry: ModelEntry, freeing: list[asyncio.Task]) -> None:
        if freeing:  # their memory must be back before this model takes its own
            await asyncio.gather(*freeing, return_exceptions=True)
        started = self.clock()
        self.say(f"loading model {entry.name} ...")
        try:
            loaded = await asyncio.to_thread(self.backend.load, entry)
        except Exception as e:
            entry.state, entry.bytes, entry.error = "unloaded", 0, f"{type(e).__name__}: {e}"
            entry.failure = ModelUnavailable(f"the model {entry.name!r} could not be loaded: {e}", param="model")
            entry.failures += 1
            self.say(f"model {entry.name} failed to load: {e}")
            log.debug("load of %s failed", entry.name, exc_info=True)
            self._changed()
            return
        loop = asyncio.get_running_loop()
        self.backend.attach(loaded, loop, lambda reason: loop.call_soon_threadsafe(self._engine_died, entry,
                                                                                   loaded, reason))
        entry.loaded, entry.state, entry.error = loaded, "loaded", None
        entry.measured = entry.bytes = loaded.bytes
        entry.loads += 1
        entry.load_seconds = self.clock() - started
        entry.last_used = self.clock()
        self.say(f"model {entry.name} loaded in {entry.load_seconds:.1f} s ({_mib(loaded.bytes)} weights + KV cache)")
        limit = self.limits.memory_limit
        if limit is not None and loaded.bytes > limit:  # the estimate was short: it can never stay
            entry.failure = ModelTooLarge(f"the model {entry.name!r} takes {_mib(loaded.bytes)} (weights + KV "
                                          f"cache) once loaded, more than --memory-limit {_mib(limit)}",
                                          param="model")
            entry.failures += 1
            entry.error = str(entry.failure)
            self._start_unload(entry, "too_large", "larger than --memory-limit")
            return
        self._enforce_memory()
        self._changed()

    def _start_unload(self, entry: ModelEntry, kind: str, reason: str) -> None:
        """`kind` (evicted, keep_alive, memory, too_large, engine_dead, shutdown) is what /metrics counts."""
        loaded, entry.state, entry.loaded = entry.loaded, "unloading", None
        entry.unloads[kind] = entry.unloads.get(kind, 0) + 1
        entry.task = asyncio.get_running_loop().create_task(self._unload(entry, loaded, reason))
        self._changed()

    async def _unload(self, entry: ModelEntry, loaded: Loaded, reason: str) -> None:
        started = self.clock()
        self.say(f"unloading model {entry.name} ({reason}) ...")
        try:
            await asyncio.to_thread(self.backend.unload, loaded)
        except Exception as e:  # its process is gone or going either way: the slot is free
            log.warning("unloading model %s: %s", entry.name, e)
        entry.state, entry.bytes = "unloaded", 0
        self.say(f"model {entry.name} unloaded in {self.clock() - started:.1f} s")
        self._changed()

    def _alive(self, entry: ModelEntry) -> bool:
        engine = entry.loaded.engine
        return getattr(engine, "dead", None) is None

    def _engine_died(self, entry: ModelEntry, loaded: Loaded, reason: str) -> None:
        """On the loop: the model's engine process died. Its requests in flight have failed (503); the model is
        unloaded, so the next request loads it again."""
        if entry.loaded is not loaded or entry.state != "loaded":
            return
        entry.error = f"its engine died: {reason}"
        self._start_unload(entry, "engine_dead", "its engine died")

    async def _keep_alive(self) -> None:
        keep = self.limits.keep_alive
        tick = min(max(keep / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(tick)
            now = self.clock()
            for e in list(self.entries.values()):
                if e.state == "loaded" and e.in_flight == 0 and now - e.last_used >= keep:
                    self._start_unload(e, "keep_alive", f"idle for {keep:g} s, --keep-alive")

    # ---- waiting ---------------------------------------------------------------------------------------------
    def _changed(self) -> None:
        """Wake every waiter: each looks again at what it waits for (one event per change, so none is missed:
        a waiter takes the current event before it awaits, with no await between its check and its wait)."""
        if self._changed_event is not None:
            self._changed_event.set()
        self._changed_event = asyncio.Event()

    async def _wait_change(self, timeout: float | None) -> None:
        if self._changed_event is None:
            self._changed_event = asyncio.Event()
        event = self._changed_event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
