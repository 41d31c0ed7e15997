"""The messages across the process boundary survive the real transport (a multiprocessing Pipe) unchanged, and an
error that cannot be pickled still crosses, as text."""

import multiprocessing as mp
import time

import pytest

from tokenmill.engine.kv_cache import PrefixCacheStats
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    FinishRequest,
    Shutdown,
    picklable_error,
)
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import ContextTooLong
from tokenmill.sampling_params import SamplingParams

MESSAGES = [
    AddRequest("r#1", [1, 2, 3], SamplingParams(n=2, temperature=0.5, seed=8, stop=["\n"], logprobs=2), 7,
               frozenset({2, 5}), 123.5, cache_salt="tenant"),
    AbortRequests(["a", "b#0"]),
    FinishRequest("r#0", "\n\n"),
    Shutdown(),
    EngineReady(2048, 49152, [2], 100, 16, "KV cache: ...", 4321),
    EngineOutputs([EngineCoreOutput("r#0", [17], [{17: -0.25, 3: -1.5}], "length", None, num_preemptions=2),
                   EngineCoreOutput("x", [], None, "error", None, "RuntimeError: boom")],
                  {"r#1": (time.monotonic(), 32)}, {},
                  SchedulerStats(1, 2, 30, 0.5, 3, 40, PrefixCacheStats(queries=64, hits=32))),
]


def through_a_pipe(batch: list) -> list:
    recv, send = mp.Pipe(duplex=False)
    send.send(batch)
    assert recv.poll(5)
    return recv.recv()


def test_every_message_round_trips_equal():
    received = through_a_pipe(MESSAGES)
    assert received == MESSAGES
    assert [type(m) for m in received] == [type(m) for m in MESSAGES]
    add = received[0]
    assert isinstance(add.eos_token_ids, frozenset) and add.params.stop_list == ["\n"]
    assert add.params.seed == 8 and add.params.logprobs == 2


def test_a_typed_rejection_keeps_its_type_and_param():
    [out] = through_a_pipe([EngineOutputs(rejected={"r": picklable_error(ContextTooLong("too long", param="prompt"))})])
    err = out.rejected["r"]
    assert isinstance(err, ContextTooLong) and err.param == "prompt" and str(err) == "too long"


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


def test_an_unpicklable_error_crosses_as_text():
    error = picklable_error(Unpicklable("deep trouble"))
    assert error == "Unpicklable: deep trouble"
    [msg] = through_a_pipe([EngineFailed(error)])
    assert msg.error == "Unpicklable: deep trouble"
    with pytest.raises(TypeError):
        through_a_pipe([EngineFailed(Unpicklable("x"))])  # what picklable_error is for
