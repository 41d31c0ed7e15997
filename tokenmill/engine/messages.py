"""The messages that cross the boundary between the client side (engine/output_processor.py, used by the server's
client in the API process and by the offline engine in-process) and the engine core (engine/core.py, run by
engine/engine_process.py). Plain dataclasses, pickled through a multiprocessing Pipe; no torch, so the API process
never loads the model stack.

    client -> core: [AddRequest | AbortRequests | FinishRequest | Shutdown] (a batch per send)
    core -> client: EngineReady | EngineFailed once at start-up, then EngineOutputs per step (and as a heartbeat)
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from tokenmill.disagg.transfer import KVTransferParams, KVTransferStats
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.sampling_params import SamplingParams


@dataclass
class AddRequest:
    """One sequence for the core to run (one of a request's n samples); the core makes its `Request` from it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved at admission (engine/admission.py)
    eos_token_ids: frozenset[int]
    arrival_time: float
    cache_salt: str | None = None
    grammar: str | None = None  # params.structured_outputs as checked grammar text (structured/backend.py)
    kv_transfer: KVTransferParams | None = None  # ship this prompt's KV, or take it (tokenmill/disagg/)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishRequest:
    """A stop string matched on the client side: the core ends the sequence and frees its blocks."""

    request_id: str
    stop_reason: str


@dataclass
class Shutdown:
    pass


@dataclass
class EngineReady:
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    startup_summary: str
    pid: int
    weight_format: str = ""  # e.g. "bfloat16", "int8 (bfloat16 compute)": the matmul weights as served
    weight_bytes: int = 0  # bytes the model's weights hold (engine/runner.py weight_bytes)
    token_capacity: int = 0  # tokens one request can hold at most (the pool, less a draft model's lookahead)
    kv_transfer_address: str | None = None  # host:port a tcp KV consumer listens on (tokenmill/disagg/tcp.py)


@dataclass
class EngineFailed:
    error: BaseException | str


def picklable_error(e: BaseException) -> BaseException | str:
    """An error as it can cross the boundary: itself (its type kept), or its text if it cannot be pickled."""
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - whatever pickling raises, the text still crosses
        return f"{type(e).__name__}: {e}"


@dataclass
class EngineCoreOutput:
    """What one step produced for one sequence (only sequences that changed)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": why this sequence could not be run
    num_preemptions: int = 0  # times the sequence was preempted (and recomputed) so far
    # params.prompt_logprobs: the next prompt tokens' logprobs ({token: logprob}, that token first), continuing
    # where the last output left off; a prefill chunk that samples nothing sends only these
    new_prompt_logprobs: list[dict[int, float]] | None = None
    kv_transfer: dict | None = None  # a producer's finished sequence: how its KV transfer ended (SendResult)


@dataclass
class EngineOutputs:
    """One engine step's news; an idle engine sends an empty one as its heartbeat."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # sequence id -> (first scheduled time (time.monotonic, one clock on the machine), prompt tokens found cached)
    started: dict[str, tuple[float, int]] = field(default_factory=dict)
    rejected: dict[str, BaseException | str] = field(default_factory=dict)  # sequence id -> why the core refused it
    stats: SchedulerStats | None = None  # set by the engine process; None in-process
    kv_transfer: KVTransferStats | None = None  # the KV connector's counters (engine process, when it has one)
