"""The engine-core loop (engine_process.serve) driven in a thread over real pipes, with a tiny model: the test is
the client. Outputs match the offline engine; abort, finish, refusal and shutdown leave no KV block held."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine_process import CALIBRATION_PROMPTS, HEARTBEAT_S, _warm_up, serve
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.messages import (AbortRequests, AddRequest, EngineOutputs, FinishRequest, Shutdown,
                                       decode_output)
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("loop"), vocab_size=256)


def config(model_dir, **scheduler) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_memory=8 << 20),
                        scheduler=SchedulerConfig(**scheduler))


def add(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> AddRequest:
    return AddRequest(rid, prompt, params, params.max_tokens, frozenset(), time.monotonic())


class Loop:
    """serve(core) on a thread; send() batches messages in, recv() reads what a step sent back."""

    def __init__(self, core: EngineCore):
        self.core = core
        in_recv, self.inputs = mp.Pipe(duplex=False)
        self.outputs, out_send = mp.Pipe(duplex=False)
        self.thread = threading.Thread(target=serve, args=(core, in_recv, out_send), daemon=True)
        self.thread.start()
        self.received: list[EngineOutputs] = []

    def send(self, *msgs) -> None:
        self.inputs.send(list(msgs))

    def recv_until(self, done, timeout: float = 60.0) -> EngineOutputs:
        """Read messages until `done(msg)`; returns that one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.outputs.poll(0.1):
                msg = decode_output(self.outputs.recv_bytes())
                self.received.append(msg)
                if done(msg):
                    return msg
        raise AssertionError("the loop did not send what was expected in time")

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.received for o in m.outputs if o.request_id == rid for t in o.new_token_ids]

    def finished(self, rid: str) -> str | None:
        return next((o.finish_reason for m in self.received for o in m.outputs
                     if o.request_id == rid and o.finish_reason), None)

    def idle(self) -> EngineOutputs:
        """Wait for a heartbeat that says nothing runs or waits and no KV block is held."""
        return self.recv_until(lambda m: m.stats.num_running == m.stats.num_waiting == 0 and m.stats.kv_usage == 0)

    def stop(self) -> None:
        """Shutdown, reading what the loop still sends meanwhile, as the API process's reader does: a loop that
        stepped on while this thread was descheduled can fill the output pipe and wait in send() until it is read.
        Once the loop returns, its end of the pipe is closed (the thread drops its arguments): poll() then says
        readable and recv() meets the end of file."""
        self.send(Shutdown())
        deadline = time.monotonic() + 10
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                while self.outputs.poll(0):
                    self.received.append(decode_output(self.outputs.recv_bytes()))
            except EOFError:  # the loop returned and its end of the pipe went with the thread's arguments
                pass
            self.thread.join(0.05)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy token ids from the offline engine, the same model in-process."""
    engine = LLMEngine(config(model_dir))

    def run(prompt: list[int]) -> list[int]:
        engine.add_request("ref", {"prompt_token_ids": prompt}, GREEDY)
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[0].outputs[0].token_ids

    return run


def test_requests_run_to_the_end_with_the_offline_engines_tokens(model_dir, reference):
    loop = Loop(EngineCore(config(model_dir)))
    prompts = {"a": [5, 6, 7, 8, 9], "b": list(range(20, 50))}
    loop.send(*(add(rid, p) for rid, p in prompts.items()))
    loop.recv_until(lambda m: loop.finished("a") and loop.finished("b"))
    for rid, prompt in prompts.items():
        assert loop.tokens(rid) == reference(prompt)
        assert loop.finished(rid) == "length"
    started = [rid for m in loop.received for rid in m.started]
    assert sorted(started) == ["a", "b"]  # each reported once, when first scheduled
    assert all(m.stats is not None for m in loop.received)
    loop.idle()
    loop.stop()
    loop.core.check_idle_invariants()


def test_abort_frees_the_kv_blocks_of_running_and_waiting_requests(model_dir):
    loop = Loop(EngineCore(config(model_dir, max_num_seqs=1)))  # one runs, the other waits
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    loop.send(add("run", list(range(10, 40)), long), add("wait", list(range(50, 60)), long))
    loop.recv_until(lambda m: len(loop.tokens("run")) >= 3)
    assert loop.received[-1].stats.kv_usage > 0 and loop.received[-1].stats.num_waiting == 1
    loop.send(AbortRequests(["run", "wait"]))
    loop.idle()  # from the loop's own thread: nothing runs, nothing waits, no block held
    loop.core.check_idle_invariants()  # the loop is idle, blocked on its input: safe to look
    assert len(loop.tokens("run")) < 500 and loop.tokens("wait") == []
    assert "wait" not in {rid for m in loop.received for rid in m.started}
    loop.stop()


def test_finish_ends_a_sequence_now_and_frees_its_blocks(model_dir):
    loop = Loop(EngineCore(config(model_dir)))
    loop.send(add("s", [1, 2, 3], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)))
    loop.recv_until(lambda m: len(loop.tokens("s")) >= 2)
    loop.send(FinishRequest("s", "\n"))
    loop.idle()
    loop.core.check_idle_invariants()
    assert len(loop.tokens("s")) < 500
    loop.stop()


class Unknown(Exception):
    pass


def test_a_refused_request_is_reported_and_the_others_go_on(model_dir, monkeypatch):
    core = EngineCore(config(model_dir))
    add_request = core.add_request

    def refusing(msg: AddRequest) -> None:
        if msg.request_id == "bad":
            raise Unknown("no room for you")
        add_request(msg)

    monkeypatch.setattr(core, "add_request", refusing)
    loop = Loop(core)
    loop.send(add("bad", [1, 2]), add("good", [3, 4]))
    loop.recv_until(lambda m: loop.finished("good"))
    rejected = {rid: why.text for m in loop.received for rid, why in m.rejected.items()}
    assert rejected == {"bad": "Unknown: no room for you"}  # crossed as text, the loop alive
    assert len(loop.tokens("good")) == GREEDY.max_tokens and loop.tokens("bad") == []
    loop.stop()


def test_an_idle_loop_sends_heartbeats(model_dir):
    loop = Loop(EngineCore(config(model_dir)))
    start = time.monotonic()
    beats = [loop.recv_until(lambda m: True, timeout=5) for _ in range(3)]
    assert all(b.outputs == [] and b.stats is not None for b in beats)
    assert time.monotonic() - start >= 1.5 * HEARTBEAT_S  # paced, not a busy stream
    loop.stop()


def test_shutdown_aborts_what_is_left_and_the_loop_ends_when_the_client_goes(model_dir):
    loop = Loop(EngineCore(config(model_dir)))
    loop.send(add("x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)))
    loop.recv_until(lambda m: loop.tokens("x"))
    loop.stop()
    loop.core.check_idle_invariants()

    gone = Loop(loop.core)
    gone.inputs.close()  # the client's end closes: the loop returns instead of spinning
    gone.thread.join(10)
    assert not gone.thread.is_alive()


def test_the_warm_up_leaves_a_step_cost_fit_and_no_block_held(model_dir):
    core = EngineCore(config(model_dir))
    assert core.step_cost.fitted is None
    _warm_up(core)
    fit = core.step_cost.fitted
    assert fit is not None  # the first burst's mixed steps are sized from the start
    assert fit.fixed < 1.0  # the first request's kernel build was forgotten, not fitted as a step's fixed cost
    assert not core.has_unfinished
    core.check_idle_invariants()


def test_the_warm_up_calibrates_within_the_cache(model_dir):
    core = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_memory=1 << 19)))
    assert core.cache_info.token_capacity < 2 * max(CALIBRATION_PROMPTS)  # the longest prompt would crowd the cache
    _warm_up(core)  # prompts over half the cache are skipped, not left waiting for room
    assert not core.has_unfinished
    core.check_idle_invariants()
