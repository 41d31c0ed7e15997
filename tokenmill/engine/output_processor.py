"""OutputProcessor: the client side of every request in flight, shared by the offline engine (llm_engine.py) and the
server's client (async_engine.py). It splits a request into its n core sequences, folds each step's EngineOutputs
into text (incremental detokenizer, stop strings), logprobs and per-request metrics, and hands results out whole
(RequestOutput, offline) or as deltas (SampleDelta, streaming). Plain Python: no torch, no model.

One request type per side of the boundary: the core has `Request`; this side has `RequestState` (with one
`SampleState` per sample). Not thread-safe: the async client calls its bookkeeping under its lock and detokenizes
(`fold`) outside it, so that adding and aborting requests never wait for a step's detokenization.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenmill.disagg.transfer import KVTransferParams, KVTransferStats
from tokenmill.engine.detokenizer import Decoder, IncrementalDetokenizer
from tokenmill.engine.messages import AddRequest, EngineCoreOutput, EngineOutputs, FinishRequest
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import RequestFailed, ServerBusy, TokenmillError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


class MetricsObserver(Protocol):
    """Per-request metrics hooks (server/metrics.py implements them); times in seconds."""

    def on_added(self, prompt_tokens: int) -> None: ...
    def on_started(self, queue_time: float) -> None: ...
    def on_first_token(self, ttft: float, request: RequestState) -> None: ...
    def on_inter_token(self, itl: float, request: RequestState) -> None: ...
    def on_finished(self, request: RequestState, e2e: float) -> None: ...
    def on_aborted(self, count: int) -> None: ...
    def on_outcomes(self, reasons: list[str]) -> None: ...
    def on_stats(self, stats: SchedulerStats, generated_tokens: int) -> None: ...
    def on_kv_transfer(self, stats: KVTransferStats) -> None: ...


@dataclass
class SampleDelta:
    """What is new in one sample since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class SampleState:
    """One of a request's n samples: one core sequence, `core_id`."""

    index: int
    core_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    retry_after: int | None = None  # the error was the engine being busy: a retry may succeed (ServerBusy)
    num_preemptions: int = 0
    last_token_time: float | None = None
    # what `delta` has handed out so far: characters of visible text, tokens, and whether the end
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> CompletionOutput:
        text = self.detok.visible_text(self.finished)
        return CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason, self.error)

    def delta(self) -> SampleDelta | None:
        """What is new since the last call, or None. Visible text only grows, so a delta is what is past it."""
        if self.sent_finish:
            return None
        text = self.detok.visible_text(self.finished)
        chars, tokens = self.sent_chars, self.sent_tokens
        if len(text) == chars and len(self.token_ids) == tokens and not self.finished:
            return None
        self.sent_chars, self.sent_tokens, self.sent_finish = len(text), len(self.token_ids), self.finished
        return SampleDelta(self.index, text[chars:], self.token_ids[tokens:],
                           self.logprobs[tokens:] if self.logprobs is not None else None,
                           self.finish_reason, self.stop_reason)


@dataclass(eq=False)
class RequestState:
    """A request as the client side tracks it: its prompt, its n samples and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when the first sample was first scheduled
    # params.prompt_logprobs: [None, {token: logprob}, ...] as far as computed; the n samples share the prompt, so
    # only the first sample's core sequence computes them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    predicted_ttft: float | None = None  # seconds, as the server's admission predicted it (async_engine.py)
    ttft_learned: bool = False  # its first token has corrected the prediction's bias (async_engine.py)
    kv_transfer: dict | None = None  # a producer's request: how its KV transfer ended (tokenmill/disagg/)
    embedding: list[float] | None = None  # an embedding request's result (params.pooling)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def error(self) -> RequestFailed | ServerBusy | None:
        """Why the engine could not run one of the samples, if it could not: ServerBusy where it was too busy then
        (a retry may succeed), else RequestFailed."""
        failed = next((s for s in self.samples if s.error is not None), None)
        if failed is None:
            return None
        if failed.retry_after is not None:
            return ServerBusy(f"the engine could not run this request now: {failed.error}", failed.retry_after)
        return RequestFailed(f"the engine could not run this request: {failed.error}")

    def output(self) -> RequestOutput:
        """The whole result so far, all n samples (offline use)."""
        self.metrics.num_preemptions = sum(s.num_preemptions for s in self.samples)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [s.output() for s in self.samples],
                             self.finished, self.metrics, self.num_cached_tokens,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             self.embedding)

    def deltas(self) -> list[SampleDelta]:
        """What is new in each sample since the last call (streaming)."""
        return [d for s in self.samples if (d := s.delta()) is not None]


@dataclass
class ProcessedOutputs:
    """What one EngineOutputs changed."""

    requests: list[RequestState] = field(default_factory=list)  # with news; the finished ones are forgotten
    stops: list[FinishRequest] = field(default_factory=list)  # for the core: stop strings ended these sequences
    rejected: list[tuple[RequestState, TokenmillError]] = field(default_factory=list)  # refused by the core; forgotten
    aborts: list[str] = field(default_factory=list)  # for the core: sequences of a refused request still running
    num_generated: int = 0  # new tokens, all requests together


@dataclass
class Routed:
    """One step's outputs matched to the samples they are for (`OutputProcessor.route`)."""

    step: EngineOutputs
    outputs: list[tuple[RequestState, SampleState, EngineCoreOutput]] = field(default_factory=list)
    result: ProcessedOutputs = field(default_factory=ProcessedOutputs)


class OutputProcessor:
    def __init__(self, tokenizer: Decoder, eos_token_ids: frozenset[int], observer: MetricsObserver | None = None):
        self.tokenizer, self.eos_token_ids, self.observer = tokenizer, eos_token_ids, observer
        self.requests: dict[str, RequestState] = {}
        self._samples: dict[str, tuple[RequestState, SampleState]] = {}  # core id -> its request and sample

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    max_tokens: int, arrival_time: float | None = None, cache_salt: str | None = None,
                    grammar: str | None = None, kv_transfer: KVTransferParams | None = None,
                    lora_request: LoRARequest | None = None) -> tuple[RequestState, list[AddRequest]]:
        """Track a request that passed admission; returns it and its n sequences for the core (ids `request_id`,
        or `request_id#i` for n > 1; seeded samples get seed + i). The n sequences share the prompt's KV blocks
        through the prefix cache. A producer's request ships its prompt's KV from the first sample only; every
        sample of a consumer's takes it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        now = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt, prompt_token_ids, params, [], RequestMetrics(arrival_time=now),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        msgs = []
        with_logprobs = params.logprobs is not None
        for i in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{i}"
            sample_params = params
            if params.n > 1 and params.seed is not None:
                sample_params = replace(sample_params, seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:  # computed once, by the first sample
                sample_params = replace(sample_params, prompt_logprobs=None)
            transfer = kv_transfer if kv_transfer is not None and (i == 0 or not kv_transfer.send) else None
            msgs.append(AddRequest(core_id, prompt_token_ids, sample_params, max_tokens, self.eos_token_ids, now,
                                   cache_salt, grammar, transfer, lora_request))
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_list,
                                           params.include_stop_str_in_output, params.skip_special_tokens)
            sample = SampleState(i, core_id, detok, logprobs=[] if with_logprobs else None,
                                 cumulative_logprob=0.0 if with_logprobs else None)
            state.samples.append(sample)
            self._samples[core_id] = (state, sample)
        self.requests[request_id] = state
        if self.observer is not None:
            self.observer.on_added(len(prompt_token_ids))
        return state, msgs

    def process(self, step: EngineOutputs) -> ProcessedOutputs:
        """Fold one step's outputs in. Outputs for sequences no longer tracked (aborted, or a core in another
        process running a step ahead of a stop string) are dropped."""
        routed = self.route(step)
        self.fold(routed)
        return self.settle(routed)

    # `process` in three parts, so that a client shared between threads can hold its lock for the bookkeeping
    # (`route`, `settle`) but not for detokenizing (`fold`), the part that grows with the step
    def route(self, step: EngineOutputs) -> Routed:
        """Bookkeeping: first schedules, the core's refusals, and which tracked sample each output is for."""
        routed = Routed(step)
        obs = self.observer
        for core_id, (scheduled_at, cached) in step.started.items():
            entry = self._samples.get(core_id)
            if entry is None:
                continue
            state, sample = entry
            if sample.index == 0:
                state.metrics.first_scheduled_time, state.num_cached_tokens = scheduled_at, cached
            if obs is not None:
                obs.on_started(scheduled_at - state.metrics.arrival_time)
        result = routed.result
        for core_id, why in step.rejected.items():
            entry = self._samples.get(core_id)
            if entry is not None:  # the request ends whole: its other samples must not run on with their blocks
                error = why.to_exception()
                if not isinstance(error, TokenmillError):
                    error = RequestFailed(f"the engine refused this request: {why.text}")
                result.rejected.append((entry[0], error))
                result.aborts += [s.core_id for s in entry[0].samples if s.core_id != core_id and not s.finished]
                self.pop(entry[0].request_id)
        for out in step.outputs:
            entry = self._samples.get(out.request_id)
            if entry is not None and not entry[1].finished:
                routed.outputs.append((*entry, out))
        return routed

    def fold(self, routed: Routed) -> None:
        """Detokenize and count: touches only the routed requests' own state (a request aborted meanwhile is
        folded for nothing, and `settle` drops it)."""
        now, obs, result = time.monotonic(), self.observer, routed.result
        touched: dict[str, RequestState] = {}
        for state, sample, out in routed.outputs:
            self._apply(state, sample, out, result.stops)
            touched[state.request_id] = state
            if out.new_token_ids:
                result.num_generated += len(out.new_token_ids)
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                if obs is not None and sample.last_token_time is None:
                    obs.on_first_token(now - state.metrics.arrival_time, state)
                elif obs is not None:
                    obs.on_inter_token(now - sample.last_token_time, state)
                sample.last_token_time = now
        result.requests = list(touched.values())

    def settle(self, routed: Routed) -> ProcessedOutputs:
        """Bookkeeping again: finished requests are forgotten (those still tracked), stats are observed."""
        now, obs, result, step = time.monotonic(), self.observer, routed.result, routed.step
        result.requests = [r for r in result.requests if self.requests.get(r.request_id) is r]
        for state in result.requests:
            if state.finished:
                state.metrics.finished_time = now
                self.pop(state.request_id)
                if obs is not None:
                    obs.on_finished(state, now - state.metrics.arrival_time)
        if obs is not None and step.stats is not None:
            obs.on_stats(step.stats, result.num_generated)
        if obs is not None and step.kv_transfer is not None:
            obs.on_kv_transfer(step.kv_transfer)
        return result

    def abort_request(self, request_id: str) -> list[str]:
        """End a request (client gone, server stopping); returns the core ids still running, for the core to
        abort. Samples that ended before count as they ended."""
        state = self.pop(request_id)
        if state is None:
            return []
        running = [s for s in state.samples if not s.finished]
        for s in running:
            s.finish_reason = "abort"
        if running and self.observer is not None:
            self.observer.on_aborted(len(running))
            self.observer.on_outcomes([s.finish_reason for s in state.samples])
        return [s.core_id for s in running]

    def pop(self, request_id: str) -> RequestState | None:
        """Stop tracking a request, whatever its samples' state."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for s in state.samples:
                del self._samples[s.core_id]
        return state

    @staticmethod
    def _apply(state: RequestState, sample: SampleState, out: EngineCoreOutput, stops: list[FinishRequest]) -> None:
        """Fold one core output into its sample. A stop string that ends the sample while the core still runs it
        goes to `stops`, for the core to finish it."""
        if out.new_prompt_logprobs and state.prompt_logprobs is not None and sample.index == 0:
            state.prompt_logprobs.extend(out.new_prompt_logprobs)
        new_ids = out.new_token_ids
        text_ids = new_ids
        if out.finish_reason == "stop" and not state.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the EOS / stop token ended it: its id is output, its text is not
        stop = sample.detok.append(text_ids)
        if stop is not None:  # tokens after the one completing a stop string (a verify pass brings several) go
            new_ids = new_ids[:sample.detok.num_used]
        sample.token_ids.extend(new_ids)
        sample.num_preemptions = out.num_preemptions
        if out.kv_transfer is not None:
            state.kv_transfer = out.kv_transfer
        if out.embedding is not None:
            state.embedding = out.embedding
        if sample.logprobs is not None and out.new_logprobs:
            for tok, lp in zip(new_ids, out.new_logprobs):
                sample.logprobs.append(lp)
                sample.cumulative_logprob += lp[tok]
        if stop is not None:  # a stop string wins, even over a length limit reached by the same token
            sample.finish_reason, sample.stop_reason = "stop", stop
            if out.finish_reason is None:
                stops.append(FinishRequest(sample.core_id, stop))
        elif out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason, sample.error = out.finish_reason, out.stop_reason, out.error
            sample.retry_after = out.retry_after
