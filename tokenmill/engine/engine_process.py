"""The engine-core process: build the EngineCore, warm it up, say ready, then `serve`: drain the client's
messages, step while there is work, send what each step produced (and a heartbeat when idle). `serve` takes any
core and any pair of pipe-like ends (poll/recv, send_bytes), so tests drive it in a thread with a tiny model."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    ErrorInfo,
    FinishRequest,
    Shutdown,
    UnloadLoRA,
    encode_output,
)
from tokenmill.lora.adapter import projection_shapes
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:  # the core (torch, the model) is imported inside the engine process only
    from tokenmill.engine.core import EngineCore

HEARTBEAT_S = 0.5


def run_engine_core(config: EngineConfig, inputs: Any, outputs: Any) -> None:
    """The engine process's target: build the core, warm it up, say ready (or why not), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle; it stops us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from tokenmill.engine.core import EngineCore
        from tokenmill.engine.runner import weight_bytes

        core = EngineCore(config)
        _warm_up(core)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which exits with it
        outputs.send_bytes(encode_output(EngineFailed(ErrorInfo.of(e))))
        return
    info = core.cache_info
    mc = core.model_config
    ready = EngineReady(
        max_model_len=core.max_model_len, vocab_size=mc.vocab_size, eos_token_ids=list(mc.eos_token_ids),
        num_blocks=info.num_blocks, block_size=info.block_size, startup_summary=core.startup_summary(),
        pid=os.getpid(), weight_format=core.runner.weight_format(), weight_bytes=weight_bytes(core.runner.model),
        token_capacity=info.token_capacity, kv_bytes=info.total_bytes, state_slots=info.state_slots,
        state_bytes=info.state_bytes, state_snapshots=info.state_snapshots,
        kv_transfer_address=core.connector.address() if core.connector is not None else None,
        hidden_size=mc.hidden_size, generates=not mc.headless,
        lora_projections={k: list(v) for k, v in projection_shapes(mc).items()} if core.runner.lora is not None
        else None, num_layers=mc.num_layers, max_lora_rank=core.config.max_lora_rank)
    outputs.send_bytes(encode_output(ready))
    try:
        serve(core, inputs, outputs)
    finally:
        core.close()


def serve(core: EngineCore, inputs: Any, outputs: Any) -> None:
    """The loop, until Shutdown or the client's end of the pipe closes: drain the inputs (waiting up to a heartbeat
    when idle), step while there is work, send each step's EngineOutputs (and one per heartbeat when idle)."""
    last_sent = 0.0
    while True:
        rejected: dict[str, ErrorInfo] = {}
        timeout = 0 if core.has_unfinished else HEARTBEAT_S
        try:
            while inputs.poll(timeout):
                timeout = 0
                for msg in inputs.recv():
                    if isinstance(msg, AddRequest):
                        try:
                            core.add_request(msg)
                        except Exception as e:  # noqa: BLE001 - a refused request must not stop the engine
                            rejected[msg.request_id] = ErrorInfo.of(e)
                    elif isinstance(msg, AbortRequests):
                        core.abort(msg.request_ids)
                    elif isinstance(msg, FinishRequest):
                        core.finish(msg.request_id, msg.stop_reason)
                    elif isinstance(msg, UnloadLoRA):
                        core.lora.unload(msg.lora_name)
                    elif isinstance(msg, Shutdown):
                        core.abort_all()
                        return
        except (EOFError, OSError):  # the client is gone
            return
        core.check_health()  # a dead tensor-parallel rank ends the loop (the API process then reports it)
        step = core.step() if core.has_unfinished else EngineOutputs()
        now = time.monotonic()
        if step.outputs or step.started or rejected or now - last_sent >= HEARTBEAT_S:
            step.rejected, step.stats = rejected, core.scheduler.stats()
            if core.connector is not None:
                step.kv_transfer = core.connector.stats()
            try:
                outputs.send_bytes(encode_output(step))
            except (EOFError, OSError):
                return
            last_sent = now


# Prompt lengths the warm-up runs after its first request, each with two decode steps after its prefill, so the
# step-cost fit (engine/step_cost.py) knows what a step of N tokens takes before the first user's burst: without
# it, --max-decode-slowdown and ITL targets cannot size a mixed step, and a served 16-stream run's first ~1.2 s
# ran 512-token steps of ~210 ms beside the first decodes: 54 of the 81 gaps above its ITL p99 (3.6x TPOT p50).
CALIBRATION_PROMPTS = (8, 32, 128, 512)
CALIBRATION_BUDGET_S = 2.0  # a large model on a slow device stops calibrating here (its fit then comes from use)


def _warm_up(core: EngineCore) -> None:
    """Requests through the core before we say ready: the first builds the kernels, so the first user's request
    (and the health check's heartbeat) is not stuck behind a compile; the next measure steps of a few sizes for
    the step-cost fit (what the first request's compile took is forgotten)."""
    _run_to_end(core, "__warmup__", [0] * 8)
    core.step_cost.forget()
    limit = min(core.config.scheduler.max_num_batched_tokens, core.max_model_len - 3,
                core.cache_info.token_capacity // 2)
    start = time.perf_counter()
    for i, n in enumerate(n for n in CALIBRATION_PROMPTS if n <= limit):
        if time.perf_counter() - start > CALIBRATION_BUDGET_S:
            break
        # a first token of its own: no prompt shares a cached block with another, so each step is its full size
        _run_to_end(core, f"__calibrate_{n}__", [(i + 1 + j) % core.model_config.vocab_size for j in range(n)])
    core.check_idle_invariants()


def _run_to_end(core: EngineCore, request_id: str, prompt: list[int]) -> None:
    core.add_request(AddRequest(request_id, prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                3, frozenset(), time.monotonic()))
    while core.has_unfinished:
        core.step()
