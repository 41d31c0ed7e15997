"""AsyncEngine's API-process bookkeeping, without an engine process: aborts and the metrics they report."""

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, RequestGroup, _Tracked
from tokenmill.engine.messages import AbortRequests
from tokenmill.engine.output_processor import new_parent
from tokenmill.model.paths import default_model_path
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


class Recorder:
    def __init__(self):
        self.aborted, self.outcomes = 0, []

    def on_aborted(self, count: int) -> None:
        self.aborted += count

    def on_outcomes(self, reasons: list[str]) -> None:
        self.outcomes.extend(reasons)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.load(default_model_path())


def tracked_group(engine: AsyncEngine, tokenizer, n: int) -> tuple[RequestGroup, _Tracked]:
    parent = new_parent("r", "x", [1, 2, 3], SamplingParams(n=n, max_tokens=4), 4, tokenizer, frozenset())
    group = RequestGroup(engine)
    tracked = _Tracked(parent, group, 0, [0] * n, [0] * n, [False] * n, [None] * n)
    group.tracked.append(tracked)
    group.remaining = 1
    for s in parent.samples:
        engine._by_core_id[s.core_id] = (tracked, s)
    return group, tracked


def test_abort_after_some_samples_finished_counts_every_sample(tokenizer):
    """An n=3 request whose client leaves after two samples ended: those two count as they ended, one as abort."""
    rec = Recorder()
    engine = AsyncEngine(EngineConfig(), observer=rec)
    group, tracked = tracked_group(engine, tokenizer, 3)
    tracked.parent.samples[0].finish_reason = "length"
    tracked.parent.samples[1].finish_reason = "stop"
    group.abort()
    group.abort()  # idempotent
    assert rec.aborted == 1 and sorted(rec.outcomes) == ["abort", "length", "stop"]
    msg = engine._send_q.get_nowait()
    assert isinstance(msg, AbortRequests) and msg.request_ids == [tracked.parent.samples[2].core_id]
    assert engine._by_core_id == {}


def test_fail_all_ends_every_group_with_the_error(tokenizer):
    import asyncio

    from tokenmill.errors import ServerShuttingDown

    async def main():
        engine = AsyncEngine(EngineConfig(), observer=Recorder())
        engine._loop = asyncio.get_running_loop()
        group, _ = tracked_group(engine, tokenizer, 2)
        assert engine.fail_all(ServerShuttingDown("stopping")) == 1
        with pytest.raises(ServerShuttingDown):
            async for _ in group:
                pass
        assert engine._by_core_id == {} and isinstance(engine._send_q.get_nowait(), AbortRequests)

    asyncio.run(main())


@pytest.mark.parametrize("rejection,expected", [("ValueError: boom", "RequestFailed"),
                                                 (None, "ContextTooLong")])
def test_an_engine_rejection_keeps_its_kind(tokenizer, rejection, expected):
    """A refusal that crossed the process boundary as text is an internal failure, not 'context too long';
    a typed one keeps its type."""
    import asyncio

    from tokenmill.engine.messages import EngineOutputs
    from tokenmill.engine.scheduler import SchedulerStats
    from tokenmill.errors import ContextTooLong

    async def main():
        engine = AsyncEngine(EngineConfig(), observer=None)
        engine._loop = asyncio.get_running_loop()
        group, tracked = tracked_group(engine, tokenizer, 1)
        err = rejection if rejection is not None else ContextTooLong("too long", param="prompt")
        engine._process(EngineOutputs([], {}, {tracked.parent.samples[0].core_id: err}, SchedulerStats(0, 0, 0, 0.0, 0)))
        with pytest.raises(Exception) as e:
            async for _ in group:
                pass
        assert type(e.value).__name__ == expected

    asyncio.run(main())


def test_the_api_process_never_loads_the_model_stack():
    """The server's process (app, launch, client, tokenizer) imports neither torch nor the engine core: it stays
    small and starts fast; the model lives in the engine process."""
    import subprocess
    import sys

    code = ("import sys; import tokenmill.server.app, tokenmill.server.launch; "
            "from tokenmill.tokenizer import Tokenizer; from tokenmill.model.paths import default_model_path; "
            "Tokenizer.load(default_model_path()); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tokenmill.model.llama', "
            "'tokenmill.engine.core', 'tokenmill.engine.runner'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
