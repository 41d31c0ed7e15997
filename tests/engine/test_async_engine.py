"""AsyncEngine, the server's client, without an engine process: a fake process client records what is sent and
lets the test play the engine's EngineOutputs. Streams, admission, queue limits, aborts, shutdown and death."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from tests.engine.recorder import Recorder
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineOutputs,
    EngineReady,
    ErrorInfo,
    FinishRequest,
)
from tokenmill.engine.output_stream import OutputStream
from tokenmill.engine.step_cost import StepCost
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import (
    ContextTooLong,
    InvalidRequest,
    RequestFailed,
    ServerOverloaded,
    ServerShuttingDown,
)
from tokenmill.sampling_params import SamplingParams

MAX_MODEL_LEN, CAPACITY = 64, 128  # 8 blocks of 16 tokens


class FakeClient:
    """Stands in for EngineProcessClient: ready at once, records sends; the test calls `play` as the engine."""

    alive = True

    def __init__(self):
        self.sent: list = []

    def spawn(self) -> None:
        pass

    def wait_ready(self, timeout: float) -> EngineReady:
        return EngineReady(max_model_len=MAX_MODEL_LEN, vocab_size=49152, eos_token_ids=[2],
                           num_blocks=CAPACITY // 16, block_size=16, startup_summary="KV cache: fake", pid=1234)

    def run(self, on_outputs, on_exit) -> None:
        self.play, self.exit = on_outputs, on_exit

    def send(self, msg) -> None:
        self.sent.append(msg)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.alive = False

    def of_type(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]



def stats(waiting: int = 0, waiting_tokens: int = 0) -> SchedulerStats:
    return SchedulerStats(0, waiting, waiting_tokens, 0.0, 0)


def outputs(*outs: EngineCoreOutput, **kw) -> EngineOutputs:
    return EngineOutputs(list(outs), stats=kw.pop("stats", stats()), **kw)


async def started_engine(observer=None, **kw) -> tuple[AsyncEngine, FakeClient]:
    client = FakeClient()
    engine = AsyncEngine(EngineConfig(), observer=observer, client=client, **kw)
    engine.start()  # the real tokenizer of the default model; the fake engine is ready at once
    engine.attach(asyncio.get_running_loop())
    return engine, client


def tok(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def drain(stream: OutputStream) -> list:
    return [u async for u in stream]


def test_a_stream_gets_each_steps_deltas_and_its_usage():
    async def main():
        engine, client = await started_engine()
        assert engine.info.token_capacity == CAPACITY and engine.healthy
        stream = engine.add_requests("c", [("Hi", [1, 2, 3])], SamplingParams(max_tokens=4, stop=["!"]))
        [add] = client.of_type(AddRequest)
        assert (add.request_id, add.prompt_token_ids, add.max_tokens) == ("c", [1, 2, 3], 4)
        hello, bang = tok(engine, "Hello"), tok(engine, "!")
        client.play(outputs(started={"c": (time.monotonic(), 16)}))
        client.play(outputs(EngineCoreOutput("c", hello)))
        client.play(outputs(EngineCoreOutput("c", bang)))
        updates = await drain(stream)
        assert "".join(d.text for u in updates for d in u.samples) == "Hello"
        assert updates[-1].finished and updates[-1].samples[-1].finish_reason == "stop"
        assert client.of_type(FinishRequest) == [FinishRequest("c", "!")]  # the core still ran it: told to stop
        assert stream.num_cached_tokens == 16
        assert engine.num_waiting == (0, 0)

    asyncio.run(main())


def test_many_prompts_and_n_samples_share_one_stream():
    async def main():
        engine, client = await started_engine()
        stream = engine.add_requests("m", [(None, [5, 6]), (None, [7, 8, 9])], SamplingParams(n=2, max_tokens=1))
        ids = [m.request_id for m in client.of_type(AddRequest)]
        assert ids == ["m-0#0", "m-0#1", "m-1#0", "m-1#1"]
        client.play(outputs(*(EngineCoreOutput(rid, [100 + i], None, "length") for i, rid in enumerate(ids))))
        updates = await drain(stream)
        got = {(u.prompt_index, d.index): d.token_ids for u in updates for d in u.samples}
        assert got == {(0, 0): [100], (0, 1): [101], (1, 0): [102], (1, 1): [103]}
        assert client.of_type(AbortRequests) == []  # all ended on their own: nothing to abort

    asyncio.run(main())


def test_admission_refuses_with_nothing_queued():
    async def main():
        engine, client = await started_engine()
        with pytest.raises(ContextTooLong, match=f"context window of {MAX_MODEL_LEN}"):
            engine.add_requests("x", [(None, [1] * 10)], SamplingParams(max_tokens=60))
        with pytest.raises(ContextTooLong, match=f"the context window is {MAX_MODEL_LEN}"):
            engine.add_requests("x", [(None, [1] * 10), (None, [1] * MAX_MODEL_LEN)], SamplingParams(max_tokens=1))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.add_requests("x", [(None, [10**6])], SamplingParams(max_tokens=1))
        assert client.sent == [] and engine.processor.requests == {}
        stream = engine.add_requests("y", [(None, [1] * 10)], SamplingParams(max_tokens=None))
        assert client.sent[0].max_tokens == MAX_MODEL_LEN - 10  # None: what the context window leaves
        stream.abort()

    asyncio.run(main())


def test_the_waiting_queue_limits_refuse_and_free_up():
    async def main():
        engine, client = await started_engine(max_waiting_requests=3, max_waiting_tokens=40)
        with pytest.raises(InvalidRequest, match="--max-waiting-requests 3"):  # could never fit: not a 429
            engine.add_requests("big", [(None, [1])], SamplingParams(n=4, max_tokens=1))
        a = engine.add_requests("a", [(None, [1] * 10)], SamplingParams(n=2, max_tokens=1))
        assert engine.num_waiting == (2, 20)
        with pytest.raises(ServerOverloaded, match="20 prompt tokens waiting"):
            engine.add_requests("b", [(None, [1] * 25)], SamplingParams(max_tokens=1))
        with pytest.raises(ServerOverloaded, match="2 requests waiting"):
            engine.add_requests("b", [(None, [1])], SamplingParams(n=2, max_tokens=1))
        client.play(outputs(started={"a#0": (time.monotonic(), 0)}))
        await asyncio.sleep(0)
        assert engine.num_waiting == (1, 10)  # scheduled: no longer waiting
        client.play(outputs(stats=SchedulerStats(1, 2, 20, 0.0, 1, num_requeued=1, num_requeued_tokens=10)))
        await asyncio.sleep(0)
        assert engine.num_waiting == (2, 20)  # a#0 preempted: waiting again, which only the core can count
        client.play(outputs())
        await asyncio.sleep(0)
        a.abort()
        assert engine.num_waiting == (0, 0) and engine.overloaded() is None
        assert client.of_type(AbortRequests) == [AbortRequests(["a#0", "a#1"])]

    asyncio.run(main())


def test_abort_after_some_samples_ended_counts_every_sample():
    """An n=3 request whose client leaves after two samples ended: those two count as they ended, one as abort."""
    async def main():
        rec = Recorder()
        engine, client = await started_engine(observer=rec)
        stream = engine.add_requests("r", [(None, [1, 2, 3])], SamplingParams(n=3, max_tokens=4))
        client.play(outputs(EngineCoreOutput("r#0", [7], None, "length"), EngineCoreOutput("r#1", [8], None, "stop")))
        stream.abort()
        stream.abort()  # idempotent
        assert rec.calls["on_aborted"] == [(1,)]
        assert sorted(rec.calls["on_outcomes"][0][0]) == ["abort", "length", "stop"]
        assert client.of_type(AbortRequests) == [AbortRequests(["r#2"])]
        assert engine.processor.requests == {} and engine._streams == {}

    asyncio.run(main())


def test_fail_all_ends_every_stream_with_the_error():
    async def main():
        engine, client = await started_engine(observer=Recorder())
        streams = [engine.add_requests(rid, [(None, [1, 2])], SamplingParams(n=2, max_tokens=4)) for rid in "ab"]
        assert engine.fail_all(ServerShuttingDown("stopping")) == 2
        for stream in streams:
            with pytest.raises(ServerShuttingDown):
                await drain(stream)
        assert sorted(i for m in client.of_type(AbortRequests) for i in m.request_ids) == ["a#0", "a#1", "b#0", "b#1"]
        assert engine.processor.requests == {}

    asyncio.run(main())


@pytest.mark.parametrize("rejection,expected", [(ErrorInfo("ValueError", "boom"), RequestFailed),
                                                 (ErrorInfo.of(ContextTooLong("too long", param="prompt")),
                                                  ContextTooLong)])
def test_an_engine_rejection_keeps_its_kind(rejection, expected):
    """A refusal that crossed the process boundary as text is an internal failure, not 'context too long';
    a typed one keeps its type."""
    async def main():
        engine, client = await started_engine()
        stream = engine.add_requests("r", [(None, [1, 2])], SamplingParams(max_tokens=4))
        client.play(outputs(rejected={"r": rejection}))
        with pytest.raises(expected):
            await drain(stream)
        assert engine.num_waiting == (0, 0) and engine._streams == {}

    asyncio.run(main())


def test_when_the_engine_dies_every_request_fails_and_the_server_is_told():
    async def main():
        rec = Recorder()
        engine, client = await started_engine(observer=rec)
        told = []
        engine.on_dead = told.append
        stream = engine.add_requests("r", [(None, [1, 2])], SamplingParams(max_tokens=4))
        client.exit("the engine process exited (code -9)")
        with pytest.raises(EngineDeadError, match="code -9"):
            await drain(stream)
        assert told == ["the engine process exited (code -9)"] and not engine.healthy
        assert rec.calls["on_engine_dead"] == [(1,)]
        with pytest.raises(EngineDeadError):
            engine.add_requests("late", [(None, [1])], SamplingParams(max_tokens=1))

    asyncio.run(main())


def test_the_api_process_never_loads_the_model_stack():
    """The server's process (app, launch, client, tokenizer) imports neither torch nor the engine core: it stays
    small and starts fast; the model lives in the engine process."""
    code = ("import sys; import tokenmill.server.app, tokenmill.server.launch; "
            "from tokenmill.tokenizer import Tokenizer; from tokenmill.model.paths import default_model_path; "
            "Tokenizer.load(default_model_path()); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tokenmill.model.llama')) "
            "or m in ('tokenmill.engine.core', 'tokenmill.engine.runner')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def fitted_stats(running: int = 0) -> SchedulerStats:
    return SchedulerStats(running, 0, 0, 0.0, 0, step_cost=StepCost(0.010, 0.001))  # 10 ms + 1 ms per token


@pytest.mark.parametrize("mode", ["reject", "degrade", "off"])
def test_slo_admission_acts_on_the_predicted_ttft(mode):
    async def main():
        from tokenmill.config import SchedulerConfig

        client = FakeClient()
        engine = AsyncEngine(EngineConfig(scheduler=SchedulerConfig(policy="priority")), client=client,
                             slo_admission=mode, max_waiting_tokens=10**6)
        engine.start()
        engine.attach(asyncio.get_running_loop())
        client.play(outputs(stats=fitted_stats()))
        await asyncio.sleep(0)
        engine.add_requests("queued", [(None, [1] * 30)], SamplingParams(max_tokens=1))
        # 30 tokens ahead + 20 own in one 512-token step: 10 + 50 ms
        assert engine.predicted_ttft(20) == pytest.approx(0.060)
        engine.add_requests("fits", [(None, [1] * 20)], SamplingParams(max_tokens=1, slo_ttft_ms=200))
        late = SamplingParams(max_tokens=1, slo_ttft_ms=50)  # predicted 10 + 70 ms
        if mode == "reject":
            with pytest.raises(ServerOverloaded, match="slo_ttft_ms") as e:
                engine.add_requests("late", [(None, [1] * 20)], late)
            assert e.value.retry_after == 1
            assert [m.request_id for m in client.of_type(AddRequest)] == ["queued", "fits"]
        else:
            engine.add_requests("late", [(None, [1] * 20)], late)
            sent = {m.request_id: m.params.priority for m in client.of_type(AddRequest)}
            assert sent == {"queued": 0, "fits": 0, "late": 1 if mode == "degrade" else 0}
        # policy priority: the tokens of worse-ranked requests waiting do not count
        for i in range(8):
            engine.add_requests(f"low-{i}", [(None, [1] * 60)], SamplingParams(max_tokens=1, priority=5))
        assert engine.predicted_ttft(40, priority=0) < 0.5 < engine.predicted_ttft(40, priority=5)

    asyncio.run(main())


def test_the_ttft_prediction_uses_the_steps_an_itl_target_allows():
    async def main():
        client = FakeClient()
        engine = AsyncEngine(EngineConfig(), client=client)
        engine.start()
        engine.attach(asyncio.get_running_loop())
        client.play(outputs(stats=fitted_stats()))
        await asyncio.sleep(0)
        # 50 ms x 0.8 = 40 ms: 30 tokens a step after the 10 ms fixed cost; 60 tokens -> 2 steps of 40 ms
        assert engine.predicted_ttft(60, itl_ms=50) == pytest.approx(0.080)
        assert engine.predicted_ttft(60) == pytest.approx(0.070)  # no target: one 512-token step

    asyncio.run(main())


def test_the_ttft_prediction_counts_aged_waiting_requests_and_prefills_under_way():
    async def main():
        from tokenmill.config import SchedulerConfig

        client = FakeClient()
        engine = AsyncEngine(EngineConfig(scheduler=SchedulerConfig(policy="priority", priority_aging_s=10.0)),
                             client=client, max_waiting_tokens=10**6)
        engine.start()
        engine.attach(asyncio.get_running_loop())
        stats = fitted_stats()
        stats.prefill_tokens_by_level = {0: 100, 1: 5000}  # a level-0 prompt's last 100 tokens under way
        client.play(outputs(stats=stats))
        await asyncio.sleep(0)
        # 100 under way + 20 own in one step; the level-1 prefill is not ahead of a level-0 request
        assert engine.predicted_ttft(20, priority=0) == pytest.approx(0.010 + 0.120)
        engine.add_requests("old-batch", [(None, [1] * 40)], SamplingParams(max_tokens=1, priority=1),
                            arrival_time=time.monotonic() - 15.0)  # aged one level: level 0 now
        assert engine.predicted_ttft(20, priority=0) == pytest.approx(0.010 + 0.160)

    asyncio.run(main())


def test_the_ttft_prediction_learns_its_bias_from_first_tokens():
    async def main():
        client = FakeClient()
        engine = AsyncEngine(EngineConfig(), client=client, max_waiting_tokens=10**6)
        engine.start()
        engine.attach(asyncio.get_running_loop())
        client.play(outputs(stats=fitted_stats()))
        await asyncio.sleep(0)
        base = engine.predicted_ttft(20)
        assert base == pytest.approx(0.030) and engine.ttft_bias == {}  # 10 ms + 20 ms, nothing learnt yet
        engine.add_requests("r", [(None, [1] * 20)], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.3)  # the engine answers ten times later than predicted
        core_id = client.of_type(AddRequest)[0].request_id
        client.play(outputs(EngineCoreOutput(core_id, [5]), stats=fitted_stats(),
                            started={core_id: (time.monotonic(), 0)}))
        client.play(outputs(EngineCoreOutput(core_id, [6]), stats=fitted_stats()))  # learnt once per request
        error = 0.3 - 0.030
        assert 0.1 * error <= engine.ttft_bias[0] < 0.1 * (error + 0.2)
        assert engine.predicted_ttft(20) == pytest.approx(base + engine.ttft_bias[0])
        assert engine.predicted_ttft(20, priority=1) == pytest.approx(base)  # learnt per priority
        engine.add_requests("slow", [(None, [1] * 20)], SamplingParams(max_tokens=2, priority=1))
        await asyncio.sleep(1.0)  # a passed-over low-priority request: its error counts at most 0.5 s
        core_id = client.of_type(AddRequest)[1].request_id
        client.play(outputs(EngineCoreOutput(core_id, [5]), stats=fitted_stats(),
                            started={core_id: (time.monotonic(), 0)}))
        assert engine.ttft_bias[1] == pytest.approx(0.1 * 0.5)

    asyncio.run(main())


def test_a_refused_sample_ends_its_siblings_in_the_core():
    """The core refuses one of an n=3 request's samples: the request fails whole, and the two others are aborted
    there (not left running with their blocks)."""
    async def main():
        engine, client = await started_engine()
        stream = engine.add_requests("r", [(None, [1, 2])], SamplingParams(n=3, max_tokens=4))
        client.play(outputs(EngineCoreOutput("r#0", [7]), rejected={"r#1": ErrorInfo("ValueError", "boom")}))
        with pytest.raises(RequestFailed):
            await drain(stream)
        assert client.of_type(AbortRequests) == [AbortRequests(["r#0", "r#2"])]
        assert engine.processor.requests == {} and engine._streams == {} and engine.num_waiting == (0, 0)

    asyncio.run(main())


def test_a_reader_that_stops_reading_is_aborted():
    """Updates pile up for a stream nobody reads only up to its bound; then the request is aborted in the core
    (its blocks freed) and the stream ends with an error, whatever the reader does later."""
    async def main():
        engine, client = await started_engine()
        engine.stream_update_limit = 5
        stream = engine.add_requests("r", [(None, [1, 2])], SamplingParams(max_tokens=40))
        for token in range(20):
            client.play(outputs(EngineCoreOutput("r", [100 + token])))
        await asyncio.sleep(0)
        assert stream.queue.qsize() <= 6 and stream.closed
        assert client.of_type(AbortRequests) == [AbortRequests(["r"])]
        assert engine.processor.requests == {} and engine._streams == {}
        with pytest.raises(RequestFailed, match="read none of this request's last 5 updates"):
            await drain(stream)

    asyncio.run(main())


def test_detokenizing_a_step_does_not_hold_the_lock_that_add_and_abort_take():
    """The reader thread detokenizes outside the client's lock: while a decode is stuck, the event loop's side
    (add_requests, abort) can still take it."""
    async def main():
        engine, client = await started_engine()
        stream = engine.add_requests("r", [(None, [1, 2])], SamplingParams(max_tokens=4))
        tokenizer = engine.processor.tokenizer
        in_decode, release = threading.Event(), threading.Event()

        class StuckDecoder:
            def __getattr__(self, name):
                return getattr(tokenizer, name)

            def decode(self, *a, **kw):
                in_decode.set()
                release.wait(10)
                return tokenizer.decode(*a, **kw)

        for sample in engine.processor.requests["r"].samples:
            sample.detok.tokenizer = StuckDecoder()
        reader = threading.Thread(target=client.play, args=(outputs(EngineCoreOutput("r", [7])),))
        reader.start()
        try:
            assert in_decode.wait(10)
            took = engine._lock.acquire(timeout=2)
            if took:
                engine._lock.release()
            assert took, "the reader held the lock while detokenizing"
        finally:
            release.set()
            reader.join(10)
        stream.abort()

    asyncio.run(main())
