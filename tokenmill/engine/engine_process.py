"""The engine-core process: build the EngineCore, warm it up, say ready, then loop: drain the API process's
messages, step while there is work, send what each step produced (and a heartbeat when idle)."""

from __future__ import annotations

import os
import signal
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    FinishRequest,
    Shutdown,
)
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

HEARTBEAT_S = 0.5



def _picklable(e: BaseException) -> BaseException | str:
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - anything unpicklable travels as text
        return f"{type(e).__name__}: {e}"


def run_engine_core(config: EngineConfig, inputs, outputs) -> None:
    """The engine process: build the core, warm it up, then loop: drain inputs, step while there is work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle; it stops us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from tokenmill.engine.core import EngineCore

        core = EngineCore(config)
        _warm_up(core)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which exits with it
        outputs.send(EngineFailed(_picklable(e)))
        return
    info = core.cache_info
    outputs.send(EngineReady(core.max_model_len, core.model_config.vocab_size, list(core.model_config.eos_token_ids),
                             info.num_blocks, info.block_size, info.describe(), os.getpid()))
    unstarted: dict[str, Request] = {}
    last_sent = 0.0
    while True:
        rejected: dict[str, BaseException] = {}
        timeout = 0 if core.has_unfinished else HEARTBEAT_S
        try:
            while inputs.poll(timeout):
                timeout = 0
                for msg in inputs.recv():
                    if isinstance(msg, AddRequest):
                        try:
                            core.add_request(msg.request)
                            unstarted[msg.request.request_id] = msg.request
                        except Exception as e:  # noqa: BLE001 - a refused request must not stop the engine
                            rejected[msg.request.request_id] = _picklable(e)
                    elif isinstance(msg, AbortRequests):
                        core.abort(msg.request_ids)
                        for rid in msg.request_ids:
                            unstarted.pop(rid, None)
                    elif isinstance(msg, FinishRequest):
                        core.finish(msg.request_id, msg.stop_reason)
                    elif isinstance(msg, Shutdown):
                        core.abort(list(core.scheduler.requests))
                        return
        except (EOFError, OSError):  # the API process is gone
            return
        outs = core.step() if core.has_unfinished else []
        started = {}
        if unstarted:
            started = {rid: (r.first_scheduled_time, r.num_cached_tokens or 0) for rid, r in unstarted.items()
                       if r.first_scheduled_time is not None}
            for rid in started:
                del unstarted[rid]
        now = time.monotonic()
        if outs or started or rejected or now - last_sent >= HEARTBEAT_S:
            try:
                outputs.send(EngineOutputs(outs, started, rejected, core.scheduler.stats(), now))
            except (EOFError, OSError):
                return
            last_sent = now


def _warm_up(core) -> None:
    """One tiny request through the core before we say ready: builds the kernels, so the first user's
    request (and the health check's heartbeat) is not stuck behind a compile."""
    req = Request("__warmup__", [0] * 8, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), 2)
    core.add_request(req)
    while core.has_unfinished:
        core.step()
    core.check_idle_invariants()
