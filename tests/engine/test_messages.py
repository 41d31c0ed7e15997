"""The messages across the process boundary survive the real transport (a multiprocessing Pipe) unchanged: the
client's pickled, the core's as msgspec MessagePack; an error crosses with its type where it is tokenmill's or
Python's, and as text otherwise."""

import multiprocessing as mp
import time

import pytest

from tokenmill.disagg.transfer import KVTransferStats
from tokenmill.engine.kv_cache import PrefixCacheStats
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    ErrorInfo,
    FinishRequest,
    Shutdown,
    decode_output,
    encode_output,
)
from tokenmill.engine.step_cost import StepCost
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import ContextTooLong, ServerOverloaded
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_stats import SpecDecodeStats

CLIENT_MESSAGES = [
    AddRequest("r#1", [1, 2, 3], SamplingParams(n=2, temperature=0.5, seed=8, stop=["\n"], logprobs=2), 7,
               frozenset({2, 5}), 123.5, cache_salt="tenant"),
    AbortRequests(["a", "b#0"]),
    FinishRequest("r#0", "\n\n"),
    Shutdown(),
]
CORE_MESSAGES = [
    EngineReady(max_model_len=2048, vocab_size=49152, eos_token_ids=[2], num_blocks=100, block_size=16,
                startup_summary="KV cache: ...", pid=4321, kv_transfer_address="127.0.0.1:5000", kv_bytes=1 << 20),
    EngineFailed(ErrorInfo.of(FileNotFoundError("no model here"))),
    EngineOutputs([EngineCoreOutput("r#0", [17], [{17: -0.25, 3: -1.5}], "length", None, num_preemptions=2),
                   EngineCoreOutput("x", [], None, "error", None, "RuntimeError: boom"),
                   EngineCoreOutput("s", [5], None, "stop", 5, new_prompt_logprobs=[{4: -0.5}])],
                  {"r#1": (time.monotonic(), 32)}, {"bad": ErrorInfo.of(ContextTooLong("too long", param="prompt"))},
                  SchedulerStats(1, 2, 30, 0.5, 3, 40, PrefixCacheStats(queries=64, hits=32),
                                 SpecDecodeStats(2, 5, 3, [2, 1], [2, 2]), {"blocks": 1}, StepCost(0.01, 1e-4),
                                 prefill_tokens_by_level={0: 12, -1: 3}),
                  KVTransferStats(role="producer", sent_transfers=2)),
    EngineOutputs(),  # a heartbeat
]


def through_a_pipe(batch: list) -> list:
    recv, send = mp.Pipe(duplex=False)
    send.send(batch)
    assert recv.poll(5)
    return recv.recv()


def core_through_a_pipe(msg):
    recv, send = mp.Pipe(duplex=False)
    send.send_bytes(encode_output(msg))
    assert recv.poll(5)
    return decode_output(recv.recv_bytes())


def test_every_message_round_trips_equal():
    received = through_a_pipe(CLIENT_MESSAGES)
    assert received == CLIENT_MESSAGES
    assert [type(m) for m in received] == [type(m) for m in CLIENT_MESSAGES]
    add = received[0]
    assert isinstance(add.eos_token_ids, frozenset) and add.params.stop_list == ["\n"]
    assert add.params.seed == 8 and add.params.logprobs == 2
    for msg in CORE_MESSAGES:
        got = core_through_a_pipe(msg)
        assert got == msg and type(got) is type(msg)
    stats = core_through_a_pipe(CORE_MESSAGES[2]).stats
    assert stats.step_cost.seconds(10) == pytest.approx(0.011) and stats.prefix_cache.hit_rate == 0.5
    assert stats.prefill_tokens_by_level == {0: 12, -1: 3}  # int keys stay ints


def test_a_typed_rejection_keeps_its_type_and_fields():
    err = core_through_a_pipe(CORE_MESSAGES[2]).rejected["bad"].to_exception()
    assert isinstance(err, ContextTooLong) and err.param == "prompt" and str(err) == "too long"
    busy = ErrorInfo.of(ServerOverloaded("queue full", retry_after=7)).to_exception()
    assert isinstance(busy, ServerOverloaded) and busy.retry_after == 7
    missing = core_through_a_pipe(CORE_MESSAGES[1]).error.to_exception()
    assert isinstance(missing, FileNotFoundError) and str(missing) == "no model here"


class Unknown(Exception):
    pass


def test_an_error_of_another_type_crosses_as_text():
    info = ErrorInfo.of(Unknown("deep trouble"))
    assert info.to_exception() is None and info.text == "Unknown: deep trouble"
    assert ErrorInfo.of("the engine exited").text == "the engine exited"
    assert core_through_a_pipe(EngineFailed(info)).error.text == "Unknown: deep trouble"


class Odd(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.param, self.retry_after = 3, True  # fields of other types than tokenmill's errors give them


def test_an_error_whose_fields_are_off_the_schema_still_crosses():
    got = core_through_a_pipe(EngineOutputs(rejected={"r": ErrorInfo.of(Odd("strange"))})).rejected["r"]
    assert got == ErrorInfo("Odd", "strange") and got.text == "Odd: strange"
