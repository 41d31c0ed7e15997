"""AsyncEngine: the EngineCore in its own process, the text side (tokens -> text, stop strings) in this one.

    API process                                          engine process (spawned)
    add_request -> sender thread == [Add, Abort, Finish] ==>  drain inputs, core.step(), repeat
    per-request asyncio queues <- reader thread <== EngineOutputs (outputs, started, stats; heartbeat) ==

The engine process steps while it has work and otherwise blocks on its input for at most a heartbeat interval,
so an idle engine still reports stats every HEARTBEAT_S. The reader thread folds outputs into each request's
incremental detokenizer (output_processor.apply_output, shared with the offline engine), tells the core to finish a
request whose stop string matched, and hands one batch of deltas per step to the event loop. Health is a fresh
heartbeat and a live process; when the process dies every request in flight fails with EngineDeadError and
`on_dead` is called (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_process import run_engine_core
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    FinishRequest,
    Shutdown,
)
from tokenmill.engine.output_processor import (
    RequestState,
    SampleState,
    apply_output,
    new_parent,
    resolve_max_tokens,
    validate_prompt,
)
from tokenmill.engine.scheduler import SchedulerStats
from tokenmill.errors import ContextTooLong, InvalidRequest, RequestFailed, ServerOverloaded, TokenmillError
from tokenmill.model.paths import resolve_model_path
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill")

HEALTH_STALE_S = 10.0  # a heartbeat older than this (the loop is stuck) makes /health 503


class EngineDeadError(TokenmillError):
    """The engine process is gone; nothing can be served."""


# ---- the API-process side ----------------------------------------------------------------------------------------


@dataclass
class SampleDelta:
    """What is new in one sample since the last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Update:
    """One step's news for one request (parent): its samples' deltas, or an error that ended it."""

    prompt_index: int
    samples: list[SampleDelta]
    finished: bool = False
    error: BaseException | None = None


@dataclass
class _Tracked:
    """A parent request as the API process tracks it."""

    parent: RequestState
    group: RequestGroup
    prompt_index: int
    sent_text: list[int]  # per sample: characters of visible text and tokens already delivered
    sent_tokens: list[int]
    sent_finish: list[bool]
    last_token_time: list[float | None]
    done: bool = False


class RequestGroup:
    """The requests of one HTTP call (one per prompt, each with n samples), read as one stream of Updates."""

    def __init__(self, engine: AsyncEngine, tracked: list[_Tracked] | None = None):
        self.engine = engine
        self.tracked: list[_Tracked] = tracked or []
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.remaining = 0
        self.closed = False

    @property
    def prompts(self) -> list[RequestState]:
        return [t.parent for t in self.tracked]

    async def __aiter__(self) -> AsyncIterator[Update]:
        try:
            while self.remaining:
                update = await self.queue.get()
                if update.error is not None:
                    raise update.error
                if update.finished:
                    self.remaining -= 1
                yield update
        finally:
            self.abort()

    def abort(self) -> None:
        """Idempotent: abort whatever of this group is still running (client gone, server stopping)."""
        if not self.closed:
            self.closed = True
            self.engine._abort_group(self)


@dataclass
class EngineInfo:
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    token_capacity: int
    cache_description: str
    pid: int


class AsyncEngine:
    """Owns the engine process; `add_requests` returns a RequestGroup to iterate for its updates."""

    def __init__(self, config: EngineConfig, *, max_waiting_requests: int = 256, max_waiting_tokens: int | None = None,
                 observer: Any = None):
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.observer = observer  # metrics hooks (server/metrics.py); None = no metrics
        self.on_dead: Callable[[str], None] | None = None
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.stats = SchedulerStats(0, 0, 0, 0.0, 0)
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._by_core_id: dict[str, tuple[_Tracked, SampleState]] = {}
        self._unstarted: dict[str, int] = {}  # core id -> its prompt tokens, until the core first schedules it
        self._unstarted_tokens = 0
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc = None
        self._last_heartbeat = 0.0
        self._stopping = False
        self._threads: list[threading.Thread] = []

    # ---- life cycle ------------------------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> EngineInfo:
        """Spawn the engine process and wait until its model is loaded and warmed up (blocking). The
        tokenizer loads here meanwhile. Raises what the engine raised (ConfigError, ModelLoadError, ...)."""
        model_path = resolve_model_path(self.config.model)  # a bad path fails here, before any process starts
        ctx = mp.get_context("spawn")
        in_recv, self._in_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, args=(self.config, in_recv, out_send),
                                 name="tokenmill-engine", daemon=True)
        self._proc.start()
        in_recv.close()  # ours closed, so EOF reaches each side when the other dies
        out_send.close()
        try:
            self.tokenizer = Tokenizer.load(model_path if self.config.tokenizer is None else self.config.tokenizer)
        except BaseException:
            self._proc.kill()
            raise
        deadline = time.monotonic() + timeout
        while True:
            if self._out_recv.poll(0.2):
                try:
                    msg = self._out_recv.recv()
                except (EOFError, OSError):
                    msg = EngineFailed(f"the engine process exited (code {self._proc.exitcode})")
                break
            if not self._proc.is_alive():
                msg = EngineFailed(f"the engine process exited during start-up (code {self._proc.exitcode})")
                break
            if time.monotonic() > deadline:
                self._proc.kill()
                msg = EngineFailed(f"the engine did not start within {timeout:.0f} s")
                break
        if isinstance(msg, EngineFailed):
            self._proc.join(5)
            if isinstance(msg.error, BaseException):
                raise msg.error
            raise EngineDeadError(msg.error)
        assert isinstance(msg, EngineReady), msg
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(msg.eos_token_ids)
        self.info = EngineInfo(msg.max_model_len, msg.vocab_size, eos, msg.num_blocks * msg.block_size,
                               msg.cache_description, msg.pid)
        if self.max_waiting_tokens is None:  # as many prompt tokens may wait as the KV cache holds
            self.max_waiting_tokens = self.info.token_capacity
        self._last_heartbeat = time.monotonic()
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reader and sender threads, delivering updates to `loop`."""
        self._loop = loop
        for target, name in ((self._read_loop, "tokenmill-engine-reader"), (self._send_loop, "tokenmill-engine-sender")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (it aborts whatever is left) and the threads."""
        self._stopping = True
        if self._proc is None:
            return
        if not self._threads:  # never attached (stopped during start-up): nothing to say goodbye to
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            return
        if self._proc.is_alive():
            self._send_q.put(Shutdown())
            self._send_q.put(None)
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        else:
            self._send_q.put(None)
        for t in self._threads:
            t.join(2)

    @property
    def healthy(self) -> bool:
        return (self.dead is None and self._proc is not None and self._proc.is_alive()
                and time.monotonic() - self._last_heartbeat < HEALTH_STALE_S)

    @property
    def num_waiting(self) -> tuple[int, int]:
        """(requests, tokens) not yet running: our own count of what the core has not scheduled yet, or the
        core's own count when it is larger (it also holds preempted requests)."""
        return (max(len(self._unstarted), self.stats.num_waiting),
                max(self._unstarted_tokens, self.stats.num_waiting_tokens))

    # ---- requests ----------------------------------------------------------------------------------------------
    def prepare(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate one prompt against the vocabulary, the context window and the KV pool; return its
        max_tokens. Raises InvalidRequest / ContextTooLong."""
        info = self.info
        validate_prompt(prompt_ids, info.vocab_size)
        max_tokens = resolve_max_tokens(params, len(prompt_ids), info.max_model_len, info.token_capacity)
        total = len(prompt_ids) + max_tokens
        if total > info.max_model_len:
            raise ContextTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                f"window of {info.max_model_len} tokens", param="max_tokens")
        if total > info.token_capacity:
            raise ContextTooLong(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV cache "
                f"capacity of {info.token_capacity} tokens; raise --kv-cache-memory", param="max_tokens")
        return max_tokens

    def overloaded(self, new_requests: int = 1, new_tokens: int = 1) -> ServerOverloaded | None:
        """Why a request of this size cannot join the waiting queue now, or None. Cheap: the server asks it
        before reading a body too, so a burst is shed at the door."""
        waiting, waiting_tokens = self.num_waiting
        if waiting + new_requests > self.max_waiting_requests:
            return ServerOverloaded(f"the waiting queue is full ({waiting} requests waiting, "
                                    f"--max-waiting-requests {self.max_waiting_requests}); retry later")
        if waiting_tokens and waiting_tokens + new_tokens > self.max_waiting_tokens:
            return ServerOverloaded(f"the waiting queue is full ({waiting_tokens} prompt tokens waiting, "
                                    f"--max-waiting-tokens {self.max_waiting_tokens}); retry later")
        return None

    def add_requests(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                     arrival_time: float | None = None, cache_salt: str | None = None) -> RequestGroup:
        """Queue one request per prompt (each with params.n samples); ids `request_id-i`. Validates everything
        first; raises InvalidRequest / ContextTooLong / ServerOverloaded / EngineDeadError with nothing queued."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        max_tokens = [self.prepare(ids, params) for _, ids in prompts]
        new_requests = len(prompts) * params.n
        new_tokens = sum(len(ids) for _, ids in prompts) * params.n
        if new_requests > self.max_waiting_requests:  # would never fit: retrying cannot help, so not a 429
            raise InvalidRequest(f"this request needs {new_requests} queue slots ({len(prompts)} prompts x n "
                                 f"{params.n}), more than the server's --max-waiting-requests "
                                 f"{self.max_waiting_requests}; send fewer prompts or a smaller n",
                                 param="n" if params.n > 1 else "prompt")
        if new_tokens > self.max_waiting_tokens:
            raise InvalidRequest(f"this request queues {new_tokens} prompt tokens (prompts x n), more than the "
                                 f"server's --max-waiting-tokens {self.max_waiting_tokens}; send fewer or shorter "
                                 f"prompts or a smaller n", param="prompt")
        overloaded = self.overloaded(new_requests, new_tokens)  # before building anything for it
        if overloaded is not None:
            raise overloaded
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(self)
        for i, ((text, ids), mt) in enumerate(zip(prompts, max_tokens)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            parent = new_parent(rid, text, ids, params, mt, self.tokenizer, self.info.eos_token_ids, arrival,
                                cache_salt)
            n = len(parent.samples)
            group.tracked.append(_Tracked(parent, group, i, [0] * n, [0] * n, [False] * n, [None] * n))
        with self._lock:
            overloaded = self.overloaded(new_requests, new_tokens)
            if overloaded is not None:
                raise overloaded
            for tracked in group.tracked:
                for s in tracked.parent.samples:
                    self._by_core_id[s.core_id] = (tracked, s)
                    self._unstarted[s.core_id] = len(tracked.parent.prompt_token_ids)
                    self._unstarted_tokens += len(tracked.parent.prompt_token_ids)
            group.remaining = len(group.tracked)
        for t in group.tracked:
            for req in t.parent.core_requests:
                self._send_q.put(AddRequest(req))
        if self.observer is not None:
            self.observer.on_added(sum(len(ids) for _, ids in prompts))
        return group

    def _abort_group(self, group: RequestGroup) -> None:
        ids, outcomes = [], []
        with self._lock:
            for t in group.tracked:
                if t.done:
                    continue
                t.done = True
                for s in t.parent.samples:
                    self._by_core_id.pop(s.core_id, None)
                    self._forget_unstarted(s.core_id)
                    if s.finish_reason is None:
                        s.finish_reason = "abort"
                        ids.append(s.core_id)
                    outcomes.append(s.finish_reason)  # samples that ended before the abort count as they ended
        if ids and self.dead is None:
            self._send_q.put(AbortRequests(ids))
            if self.observer is not None:
                self.observer.on_aborted(len(ids))
                self.observer.on_outcomes(outcomes)

    def fail_all(self, error: TokenmillError) -> int:
        """End every request in flight with `error` (the server is stopping): each client gets it as its answer
        or as a stream's last event, and the engine aborts them. Returns how many requests were failed."""
        with self._lock:
            pending = {id(t): t for t, _ in self._by_core_id.values() if not t.done}.values()
            deliveries = [(t.group, Update(t.prompt_index, [], True, error)) for t in pending]
        for group, _ in deliveries:
            group.abort()
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver_anyway, deliveries)
        return len(deliveries)

    def _forget_unstarted(self, core_id: str) -> None:
        n = self._unstarted.pop(core_id, None)
        if n is not None:
            self._unstarted_tokens -= n

    # ---- threads ---------------------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            msg = self._send_q.get()
            batch = [msg]
            while True:
                try:
                    batch.append(self._send_q.get_nowait())
                except queue.Empty:
                    break
            stop = any(m is None for m in batch)
            batch = [m for m in batch if m is not None]
            if batch:
                try:
                    self._in_send.send(batch)
                except (OSError, EOFError, ValueError):
                    return  # the engine is gone; the reader notices and reports
            if stop:
                return

    def _read_loop(self) -> None:
        reason = None
        while True:
            try:
                if not self._out_recv.poll(1.0):
                    if not self._proc.is_alive():
                        reason = f"the engine process exited (code {self._proc.exitcode})"
                        break
                    continue
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                self._proc.join(2)
                reason = f"the engine process exited (code {self._proc.exitcode})"
                break
            if isinstance(msg, EngineOutputs):
                try:
                    self._process(msg)
                except Exception:  # a bug here must not kill the reader silently
                    log.exception("error while processing engine outputs")
        if not self._stopping:
            self._die(reason)

    def _process(self, msg: EngineOutputs) -> None:
        self._last_heartbeat = time.monotonic()
        self.stats = msg.stats
        obs = self.observer
        deliveries: list[tuple[RequestGroup, Update]] = []
        finish_msgs = []
        now = time.monotonic()
        with self._lock:
            for rid, (t_sched, cached) in msg.started.items():
                self._forget_unstarted(rid)
                entry = self._by_core_id.get(rid)
                if entry is not None and entry[1].index == 0:
                    entry[0].parent.num_cached_tokens = cached
                if entry is not None and obs is not None:
                    obs.on_started(t_sched - entry[0].parent.metrics.arrival_time)
            for rid, err in msg.rejected.items():  # the API-side checks should make this unreachable
                entry = self._by_core_id.get(rid)
                if entry is not None and not entry[0].done:
                    tracked = entry[0]
                    tracked.done = True
                    for s in tracked.parent.samples:
                        self._by_core_id.pop(s.core_id, None)
                        self._forget_unstarted(s.core_id)
                    error = err if isinstance(err, TokenmillError) else RequestFailed(
                        f"the engine refused this request: {err}")
                    deliveries.append((tracked.group, Update(tracked.prompt_index, [], True, error)))
            touched: dict[int, _Tracked] = {}
            gen_tokens = 0
            for out in msg.outputs:
                entry = self._by_core_id.get(out.request_id)
                if entry is None:
                    continue
                tracked, sample = entry
                if sample.finish_reason is not None:
                    continue
                before = len(sample.token_ids)
                stop = apply_output(tracked.parent, sample, out)
                if stop is not None:
                    finish_msgs.append(FinishRequest(sample.core_id, stop))
                new = len(sample.token_ids) - before
                gen_tokens += new
                if obs is not None and new:
                    last = tracked.last_token_time[sample.index]
                    if last is None:
                        obs.on_first_token(now - tracked.parent.metrics.arrival_time)
                    else:
                        obs.on_inter_token(now - last)
                    tracked.last_token_time[sample.index] = now
                touched[id(tracked)] = tracked
            for tracked in touched.values():
                update = self._delta(tracked)
                if update.finished:
                    tracked.done = True
                    for s in tracked.parent.samples:
                        self._by_core_id.pop(s.core_id, None)
                        self._forget_unstarted(s.core_id)
                    if obs is not None:
                        obs.on_finished(tracked.parent, now - tracked.parent.metrics.arrival_time)
                deliveries.append((tracked.group, update))
        for m in finish_msgs:
            self._send_q.put(m)
        if obs is not None:
            obs.on_stats(msg.stats, gen_tokens)
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    @staticmethod
    def _delta(tracked: _Tracked) -> Update:
        deltas = []
        for s in tracked.parent.samples:
            i = s.index
            if tracked.sent_finish[i]:
                continue
            finished = s.finish_reason is not None
            text = s.detok.visible_text(finished)
            n_sent = tracked.sent_tokens[i]
            if len(text) == tracked.sent_text[i] and len(s.token_ids) == n_sent and not finished:
                continue
            deltas.append(SampleDelta(i, text[tracked.sent_text[i]:], s.token_ids[n_sent:],
                                      s.logprobs[n_sent:] if s.logprobs is not None else None,
                                      s.finish_reason, s.stop_reason))
            tracked.sent_text[i], tracked.sent_tokens[i], tracked.sent_finish[i] = len(text), len(s.token_ids), finished
        failed = next((s.error for s in tracked.parent.samples if s.error is not None), None)
        error = RequestFailed(f"the engine could not run this request: {failed}") if failed else None
        return Update(tracked.prompt_index, deltas, tracked.parent.finished, error)

    def _die(self, reason: str) -> None:
        self.dead = reason or "the engine process died"
        log.error("%s; failing every request in flight", self.dead)
        deliveries = []
        with self._lock:
            for tracked, _ in list(self._by_core_id.values()):
                if not tracked.done:
                    tracked.done = True
                    deliveries.append((tracked.group, Update(tracked.prompt_index, [], True,
                                                             EngineDeadError(self.dead))))
            self._by_core_id.clear()
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, deliveries)
        if self.observer is not None:
            self.observer.on_engine_dead(len(deliveries))
        if self.on_dead is not None:
            self.on_dead(self.dead)


def _deliver(deliveries: list[tuple[RequestGroup, Update]]) -> None:
    for group, update in deliveries:
        if not group.closed:
            group.queue.put_nowait(update)


def _deliver_anyway(deliveries: list[tuple[RequestGroup, Update]]) -> None:
    """For groups this side closed itself (fail_all): their readers still wait for a last update."""
    for group, update in deliveries:
        group.queue.put_nowait(update)
