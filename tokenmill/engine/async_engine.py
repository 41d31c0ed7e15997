"""AsyncEngine: the server's client of the engine core, which runs in its own process (process_client.py).

    event loop: add_requests -> admission -> OutputProcessor.add_request -> [AddRequest...] -> engine process
    reader thread: EngineOutputs -> OutputProcessor.process -> one Update per changed request -> its OutputStream

Requests are admitted (engine/admission.py) and counted against the waiting-queue limits before anything is
queued. The reader thread folds outputs into the OutputProcessor (shared with the offline engine), tells the core
to finish sequences a stop string ended, and hands each step's deltas to the event loop in one call. Health is a
fresh heartbeat and a live process; when the process dies every request in flight fails with EngineDeadError and
`on_dead` is called (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.disagg.transfer import KVTransferParams
from tokenmill.engine.admission import ContextLimits, admit, check_generates, check_pooling
from tokenmill.engine.messages import AbortRequests, EngineOutputs, EngineReady, UnloadLoRA
from tokenmill.engine.output_processor import MetricsObserver, OutputProcessor, RequestState, SampleDelta
from tokenmill.engine.output_stream import OutputStream, Update, deliver
from tokenmill.engine.process_client import EngineDeadError, EngineProcessClient
from tokenmill.engine.slo_admission import SloAdmission
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import InvalidRequest, ServerBusy, ServerOverloaded, TokenmillError
from tokenmill.lora.request import LoRARequest
from tokenmill.model.paths import resolve_model_path
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.checker import GrammarChecker
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill")

HEALTH_STALE_S = 10.0  # a heartbeat older than this (the loop is stuck) makes /health 503
STREAM_UPDATE_LIMIT = 4096  # a request's updates its reader may leave unread (one a step) before it is aborted
# a structured output constraint not checked by then is refused (503: a busy server, or a grammar too costly), its
# check killed
GRAMMAR_CHECK_TIMEOUT_S = 10.0


@dataclass(kw_only=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    token_capacity: int
    startup_summary: str
    pid: int
    weight_format: str = ""
    weight_bytes: int = 0
    kv_bytes: int = 0  # the KV cache's pages and recurrent-state slots
    state_slots: int = 0  # a hybrid model's: one per running request
    state_bytes: int = 0  # one slot's, over every state layer
    state_snapshots: int = 0  # states kept at cached block boundaries (engine/state_snapshots.py)
    kv_transfer_address: str | None = None  # host:port a tcp KV consumer listens on (tokenmill/disagg/tcp.py)
    block_size: int = 16
    hidden_size: int = 0  # an embedding's dimensions
    generates: bool = True  # False: a base model without a language-model head, embeddings only
    # --enable-lora: (in, out) per adapted projection, the layers and the rank limit an adapter is checked against
    lora_projections: dict[str, tuple[int, int]] | None = None
    num_layers: int = 0
    max_lora_rank: int = 0


class AsyncEngine:
    """Owns the engine process; `add_requests` returns an OutputStream to iterate for its updates."""

    def __init__(self, config: EngineConfig, *, max_waiting_requests: int = 256, max_waiting_tokens: int | None = None,
                 observer: MetricsObserver | None = None, client: EngineProcessClient | None = None,
                 slo_admission: str = "off"):
        self.config = config
        self.slo = SloAdmission(config.scheduler, slo_admission)  # the TTFT forecast and --slo-admission
        self.client = client or EngineProcessClient(config)
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.stream_update_limit = STREAM_UPDATE_LIMIT
        self._observer = observer  # metrics hooks (server/metrics.py); None = no metrics
        self.on_dead: Callable[[str], None] | None = None
        self.info: EngineInfo | None = None
        self.limits: ContextLimits | None = None
        self.tokenizer: Tokenizer | None = None
        self.processor: OutputProcessor | None = None
        self.stats = SchedulerStats(0, 0, 0, 0.0, 0)
        self.dead: str | None = None
        self._lock = threading.Lock()  # the processor and the maps below: the event loop and the reader share them
        self._streams: dict[str, tuple[OutputStream, int]] = {}  # request id -> its stream and prompt index
        # core id -> (its prompt tokens, its priority, its arrival time), until the core first schedules it
        self._unstarted: dict[str, tuple[int, int, float]] = {}
        self._unstarted_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_heartbeat = 0.0
        self.grammars = GrammarChecker()  # structured output's constraints, checked once each in worker processes

    @property
    def observer(self) -> MetricsObserver | None:
        return self._observer

    @observer.setter
    def observer(self, observer: MetricsObserver | None) -> None:
        self._observer = observer
        if self.processor is not None:
            self.processor.observer = observer

    # ---- life cycle ------------------------------------------------------------------------------------------
    def start(self, timeout: float = 900.0) -> EngineInfo:
        """Spawn the engine process and wait until its model is loaded and warmed up (blocking); the tokenizer
        loads meanwhile. Raises what the engine raised (ConfigError, ModelLoadError, ...)."""
        model_path = resolve_model_path(self.config.model)  # a bad path fails here, before any process starts
        self.client.spawn()
        try:
            tokenizer = Tokenizer.load(model_path if self.config.tokenizer is None else self.config.tokenizer)
        except BaseException:
            self.client.shutdown()
            raise
        return self._ready(self.client.wait_ready(timeout), tokenizer)

    def _ready(self, msg: EngineReady, tokenizer: Tokenizer) -> EngineInfo:
        self.tokenizer = tokenizer
        eos = frozenset(tokenizer.eos_token_ids) | frozenset(msg.eos_token_ids)
        capacity = msg.token_capacity or msg.num_blocks * msg.block_size
        self.info = EngineInfo(
            max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, eos_token_ids=eos, token_capacity=capacity,
            startup_summary=msg.startup_summary, pid=msg.pid, weight_format=msg.weight_format,
            weight_bytes=msg.weight_bytes, kv_bytes=msg.kv_bytes, kv_transfer_address=msg.kv_transfer_address,
            state_slots=msg.state_slots, state_bytes=msg.state_bytes, state_snapshots=msg.state_snapshots,
            block_size=msg.block_size, hidden_size=msg.hidden_size, generates=msg.generates,
            lora_projections={k: tuple(v) for k, v in msg.lora_projections.items()}
            if msg.lora_projections is not None else None, num_layers=msg.num_layers,
            max_lora_rank=msg.max_lora_rank)
        self.limits = ContextLimits(msg.max_model_len, msg.vocab_size, self.info.token_capacity)
        self.processor = OutputProcessor(tokenizer, eos, self._observer)
        if self.max_waiting_tokens is None:  # as many prompt tokens may wait as the KV cache holds
            self.max_waiting_tokens = self.info.token_capacity
        self._last_heartbeat = time.monotonic()
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading the engine's outputs, delivering updates to `loop`."""
        self._loop = loop
        self.client.run(self._on_outputs, self._die)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (it aborts whatever is left) and the grammar checker's workers."""
        self.client.shutdown(timeout)
        self.grammars.close()

    @property
    def healthy(self) -> bool:
        return (self.dead is None and self.client.alive
                and time.monotonic() - self._last_heartbeat < HEALTH_STALE_S)

    # ---- admission -----------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> tuple[int, int]:
        """(requests, tokens) not yet running, each request counted by one side: this process counts what it sent
        that the core has not started yet (up to date at once, so a burst is counted as it arrives); the core counts
        those waiting again after a preemption (which this process saw start), as of its last step."""
        return (len(self._unstarted) + self.stats.num_requeued,
                self._unstarted_tokens + self.stats.num_requeued_tokens)

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

    def predicted_ttft(self, new_tokens: int, priority: int = 0, itl_ms: float | None = None) -> float | None:
        """Seconds until the first token of a request this size (engine/slo_admission.py); None until the engine
        has measured its steps."""
        return self.slo.predict(self.stats, self._unstarted.values(), new_tokens, priority, itl_ms)

    @property
    def ttft_bias(self) -> dict[int, float]:
        return self.slo.ttft_bias

    def _check_fits_queue(self, num_prompts: int, params: SamplingParams, new_tokens: int) -> None:
        """A request bigger than the whole waiting queue can never join it: retrying cannot help, so not a 429."""
        new_requests = num_prompts * params.n
        if new_requests > self.max_waiting_requests:
            raise InvalidRequest(f"this request needs {new_requests} queue slots ({num_prompts} prompts x n "
                                 f"{params.n}), more than the server's --max-waiting-requests "
                                 f"{self.max_waiting_requests}; send fewer prompts or a smaller n",
                                 param="n" if params.n > 1 else "prompt")
        if new_tokens > self.max_waiting_tokens:
            raise InvalidRequest(f"this request queues {new_tokens} prompt tokens (prompts x n), more than the "
                                 f"server's --max-waiting-tokens {self.max_waiting_tokens}; send fewer or shorter "
                                 f"prompts or a smaller n", param="prompt")

    # ---- requests ----------------------------------------------------------------------------------------------
    async def check_grammar(self, params: SamplingParams) -> str | None:
        """The grammar text of a request's structured output constraint, checked in a grammar worker process under
        a time limit (InvalidRequest naming the field for one that is wrong; ServerBusy, a 503 with Retry-After, for
        one not checked in time, which a busy CPU or a costly grammar causes alike: the worker is killed at the
        limit, so the check holds no thread and no CPU after it); None without one."""
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            return await asyncio.wrap_future(self.grammars.submit(spec, GRAMMAR_CHECK_TIMEOUT_S))
        except TimeoutError:
            raise ServerBusy(f"{spec.param}: the constraint did not compile within {GRAMMAR_CHECK_TIMEOUT_S:g} s "
                             "on this busy server; retry, or simplify it",
                             retry_after=max(1, round(GRAMMAR_CHECK_TIMEOUT_S))) from None

    def add_requests(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                     arrival_time: float | None = None, cache_salt: str | None = None,
                     grammar: str | None = None, kv_transfer: KVTransferParams | None = None,
                     lora_request: LoRARequest | None = None) -> OutputStream:
        """Queue one request per prompt (each with params.n samples); ids `request_id-i`. Checks everything
        first; raises InvalidRequest / ContextTooLong / ServerOverloaded / EngineDeadError with nothing queued."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        check_generates(self.info.generates, params)
        check_pooling(self.config.context_parallel_size, params)
        if kv_transfer is not None and len(prompts) > 1:
            raise InvalidRequest("kv_transfer_params takes one prompt per request", param="kv_transfer_params")
        max_tokens = [admit(ids, params.max_tokens, self.limits) for _, ids in prompts]
        new_tokens = sum(len(ids) for _, ids in prompts) * params.n
        self._check_fits_queue(len(prompts), params, new_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences = []
        with self._lock:
            overloaded = self.overloaded(len(prompts) * params.n, new_tokens)
            if overloaded is not None:
                raise overloaded
            predicted = self.predicted_ttft(new_tokens, params.priority, params.slo_itl_ms)
            params = self.slo.admit(params, predicted)
            states = []
            for i, ((text, ids), mt) in enumerate(zip(prompts, max_tokens)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                state, msgs = self.processor.add_request(rid, text, ids, params, mt, arrival, cache_salt, grammar,
                                                         kv_transfer, lora_request)
                state.predicted_ttft = predicted
                states.append(state)
                sequences += msgs
            stream = OutputStream(self, states)
            for i, state in enumerate(states):
                self._streams[state.request_id] = (stream, i)
            for msg in sequences:
                self._unstarted[msg.request_id] = (len(msg.prompt_token_ids), params.priority, arrival)
                self._unstarted_tokens += len(msg.prompt_token_ids)
        for msg in sequences:
            self.client.send(msg)
        return stream

    def unload_lora(self, name: str) -> None:
        """The engine forgets the adapter once no request runs through it (engine/lora_pool.py)."""
        self.client.send(UnloadLoRA(name))

    def fail_all(self, error: TokenmillError) -> int:
        """End every request in flight with `error` (the server is stopping): each client gets it as its answer
        or as a stream's last event, and the engine aborts them. Returns how many requests were failed."""
        with self._lock:
            deliveries = [(stream, Update(i, [], True, error)) for stream, i in self._streams.values()]
        for stream, _ in deliveries:
            stream.abort()
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(deliver, deliveries, True)
        return len(deliveries)

    def _abort(self, stream: OutputStream) -> None:
        ids = []
        with self._lock:
            for state in stream.requests:
                if self._streams.pop(state.request_id, None) is not None:
                    ids += self.processor.abort_request(state.request_id)
                    self._forget_unstarted(s.core_id for s in state.samples)
        if ids and self.dead is None:
            self.client.send(AbortRequests(ids))

    def _forget_unstarted(self, core_ids: Iterable[str]) -> None:
        """No longer waiting: scheduled, ended or aborted."""
        for core_id in core_ids:
            entry = self._unstarted.pop(core_id, None)
            if entry is not None:
                self._unstarted_tokens -= entry[0]

    # ---- the reader thread ---------------------------------------------------------------------------------------
    def _on_outputs(self, msg: EngineOutputs) -> None:
        self._last_heartbeat = time.monotonic()
        if msg.stats is not None:
            self.stats = msg.stats
        deliveries: list[tuple[OutputStream, Update]] = []
        with self._lock:
            self._forget_unstarted(msg.started)
            routed = self.processor.route(msg)
        self.processor.fold(routed)  # detokenizing: add_requests and aborts need not wait for it
        with self._lock:
            processed = self.processor.settle(routed)
            for state, error in processed.rejected:  # the admission check should make this unreachable
                deliveries += self._end(state, error)
            for state in processed.requests:
                self.slo.learn(state)
                if state.finished:
                    deliveries += self._end(state, state.error, state.deltas())
                else:
                    stream, i = self._streams[state.request_id]
                    deliveries.append((stream, Update(i, state.deltas(), False, state.error)))
        for stop in processed.stops:
            self.client.send(stop)
        if processed.aborts:
            self.client.send(AbortRequests(processed.aborts))
        if deliveries:
            self._loop.call_soon_threadsafe(deliver, deliveries, False)

    def _end(self, state: RequestState, error: BaseException | None,
             deltas: list[SampleDelta] | None = None) -> list[tuple[OutputStream, Update]]:
        """The last update of a request the processor no longer tracks (none if its stream was aborted meanwhile)."""
        entry = self._streams.pop(state.request_id, None)
        self._forget_unstarted(s.core_id for s in state.samples)
        return [] if entry is None else [(entry[0], Update(entry[1], deltas or [], True, error))]

    def _die(self, reason: str) -> None:
        self.dead = reason
        log.error("%s; failing every request in flight", reason)
        with self._lock:
            deliveries = [(stream, Update(i, [], True, EngineDeadError(reason))) for stream, i in self._streams.values()]
            self._streams.clear()
            for rid in list(self.processor.requests):
                self.processor.pop(rid)
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(deliver, deliveries, False)
        if self._observer is not None:
            self._observer.on_engine_dead(len(deliveries))
        if self.on_dead is not None:
            self.on_dead(reason)
