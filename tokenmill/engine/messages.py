"""The messages that cross the process boundary between the API process (engine/async_engine.py) and the
engine-core process (engine/engine_process.py). Plain dataclasses, pickled through a multiprocessing Pipe; no
torch, so the API process never loads the model stack.

    API -> engine: [AddRequest | AbortRequests | FinishRequest | Shutdown] (a batch per send)
    engine -> API: EngineReady | EngineFailed once at start-up, then EngineOutputs per step (and as a heartbeat)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.scheduler import SchedulerStats
from tokenmill.request import Request


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (only requests that changed)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": why this request could not be run



@dataclass
class AddRequest:
    request: Request


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishRequest:
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
    cache_description: str
    pid: int


@dataclass
class EngineFailed:
    error: BaseException | str


@dataclass
class EngineOutputs:
    outputs: list[EngineCoreOutput]
    # request id -> (first scheduled time (time.monotonic, same clock in both processes), prompt tokens cached)
    started: dict[str, tuple[float, int]]
    rejected: dict[str, BaseException]  # request id -> why the core refused it at add
    stats: SchedulerStats
    time: float = field(default_factory=time.monotonic)
