"""The messages that cross the boundary between the client side (engine/output_processor.py, used by the server's
client in the API process and by the offline engine in-process) and the engine core (engine/core.py, run by
engine/engine_process.py); no torch, so the API process never loads the model stack.

    client -> core: [AddRequest | AbortRequests | FinishRequest | Shutdown] (a batch per send, pickled)
    core -> client: EngineReady | EngineFailed once at start-up, then EngineOutputs per step (and as a heartbeat),
                    msgspec Structs encoded as MessagePack (`encode_output` / `decode_output`)

The core's messages go every step, so they are Structs of plain fields with a fixed schema: a 16-sequence step
encodes and decodes in ~6 us, against ~26 us pickled (~42 us for the dataclasses sent before; BENCHMARKS.md,
benchmarks/boundary_codec.py). The client's
go once per request and carry SamplingParams, whose validated fields (a dict or a params object, a string or a
list) no fixed schema states; they stay pickled.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

import msgspec

from tokenmill import errors
from tokenmill.disagg.transfer import KVTransferParams, KVTransferStats
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.lora.request import LoRARequest
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
    lora_request: LoRARequest | None = None  # the adapter it runs through (tokenmill/lora/)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishRequest:
    """A stop string matched on the client side: the core ends the sequence and frees its blocks."""

    request_id: str
    stop_reason: str


@dataclass
class UnloadLoRA:
    """Forget an adapter (POST /v1/unload_lora_adapter): its weights go once no request runs through it."""

    lora_name: str


@dataclass
class Shutdown:
    pass


class ErrorInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """An exception as it crosses the boundary: its type's name and message (and the fields tokenmill's errors
    carry); `to_exception` builds it again on the other side."""

    kind: str
    message: str
    param: str | None = None  # InvalidRequest's field
    retry_after: int | None = None  # ServerOverloaded's seconds

    @classmethod
    def of(cls, e: BaseException | str) -> ErrorInfo:
        if isinstance(e, str):
            return cls("", e)
        # only fields of the types the schema states: another exception's `param` may be anything, and a message
        # the client cannot decode would cost it the whole step's outputs
        param, retry = getattr(e, "param", None), getattr(e, "retry_after", None)
        return cls(type(e).__name__, str(e), param if isinstance(param, str) else None,
                   retry if isinstance(retry, int) and not isinstance(retry, bool) else None)

    def to_exception(self) -> Exception | None:
        """The same exception type with the same message, for tokenmill's errors and Python's built-in ones; None
        for another type (the caller says what failed in its own terms, with `text`)."""
        kind = getattr(errors, self.kind, None) or getattr(builtins, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            return None
        if issubclass(kind, errors.InvalidRequest):
            return kind(self.message, param=self.param)
        if issubclass(kind, (errors.ServerOverloaded, errors.ServerBusy)):
            return kind(self.message, retry_after=self.retry_after or 1)
        try:
            return kind(self.message)
        except Exception:  # noqa: BLE001 - a built-in whose constructor wants more: the text still crosses
            return None

    @property
    def text(self) -> str:
        return f"{self.kind}: {self.message}" if self.kind else self.message


class EngineReady(msgspec.Struct, tag=True, array_like=True, kw_only=True):
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
    kv_bytes: int = 0  # what the KV cache holds: its pages and any recurrent-state slots (engine/model_spec.py)
    # a hybrid model's state layers: slots (one per running request), one slot's bytes, prefix-cache snapshots
    state_slots: int = 0
    state_bytes: int = 0
    state_snapshots: int = 0
    kv_transfer_address: str | None = None  # host:port a tcp KV consumer listens on (tokenmill/disagg/tcp.py)
    hidden_size: int = 0  # the model's: an embedding's dimensions
    generates: bool = True  # False: a base model without a language-model head, embeddings only
    # --enable-lora: (in, out) of each projection an adapter may change, and the layers (the API process checks an
    # adapter against them: lora/adapter.py check_adapter); None: no adapters served
    lora_projections: dict[str, list[int]] | None = None
    num_layers: int = 0
    max_lora_rank: int = 0


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    error: ErrorInfo


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one sequence (only sequences that changed)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": why this sequence could not be run
    # finish_reason "error" because the engine was busy (a grammar not built in time): worth retrying after this
    # many seconds (the server answers 503 with Retry-After rather than 500)
    retry_after: int | None = None
    num_preemptions: int = 0  # times the sequence was preempted (and recomputed) so far
    # params.prompt_logprobs: the next prompt tokens' logprobs ({token: logprob}, that token first), continuing
    # where the last output left off; a prefill chunk that samples nothing sends only these
    new_prompt_logprobs: list[dict[int, float]] | None = None
    kv_transfer: dict | None = None  # a producer's finished sequence: how its KV transfer ended (SendResult)
    embedding: list[float] | None = None  # an embedding request's result (params.pooling), as it finishes


class EngineOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One engine step's news; an idle engine sends an empty one as its heartbeat."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # sequence id -> (first scheduled time (time.monotonic, one clock on the machine), prompt tokens found cached)
    started: dict[str, tuple[float, int]] = msgspec.field(default_factory=dict)
    rejected: dict[str, ErrorInfo] = msgspec.field(default_factory=dict)  # sequence id -> why the core refused it
    stats: SchedulerStats | None = None  # set by the engine process; None in-process
    kv_transfer: KVTransferStats | None = None  # the KV connector's counters (engine process, when it has one)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EngineReady | EngineFailed | EngineOutputs)


def encode_output(msg: EngineReady | EngineFailed | EngineOutputs) -> bytes:
    return _ENCODER.encode(msg)


def decode_output(data: bytes) -> EngineReady | EngineFailed | EngineOutputs:
    return _DECODER.decode(data)
