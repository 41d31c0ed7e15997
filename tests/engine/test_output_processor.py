"""OutputProcessor without an engine: core outputs in, text, stop strings, n samples, logprobs and metrics out.

The decoder is one character per token id (its code point), so every expected text is exact."""

from __future__ import annotations

import pytest

from tests.engine.recorder import Recorder
from tokenmill.engine.messages import EngineCoreOutput, EngineOutputs, ErrorInfo, FinishRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.errors import ContextTooLong, RequestFailed, ServerBusy
from tokenmill.sampling_params import SamplingParams

EOS = 2


class CharDecoder:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i == EOS and skip_special_tokens else chr(i) for i in ids)



def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def out(rid: str, text: str = "", finish: str | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, ids(text), finish_reason=finish, **kw)


def step(*outputs: EngineCoreOutput, **kw) -> EngineOutputs:
    return EngineOutputs(list(outputs), **kw)


PROMPT = ids("Say:")


def add(proc: OutputProcessor, rid: str = "r", arrival: float = 100.0, salt: str | None = None, **params):
    params.setdefault("max_tokens", 20)
    return proc.add_request(rid, "Say:", PROMPT, SamplingParams(**params), params["max_tokens"], arrival, salt)


@pytest.mark.parametrize("include,final", [(False, "Hell"), (True, "Hello w")])
def test_a_stop_string_split_across_steps_is_never_streamed(include, final):
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["o w"], include_stop_str_in_output=include)
    streamed, stops = [], []
    for token in "Hello world":
        processed = proc.process(step(out("r", token)))
        stops += processed.stops
        streamed += [d.text for d in state.deltas()]
        if state.finished:
            break
    assert "".join(streamed) == final == state.output().outputs[0].text
    if not include:
        assert "o" not in "".join(streamed)  # the held-back tail that became the stop string never went out
    assert stops == [FinishRequest("r", "o w")]  # the core still runs it: told once to finish
    c = state.output().outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", "o w", ids("Hello w"))
    assert proc.requests == {}
    assert proc.process(step(out("r", "o"))).requests == []  # the core's step ahead of the stop: dropped
    assert state.output().outputs[0].token_ids == ids("Hello w")


def test_a_stop_token_id_is_output_but_its_text_is_not():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop_token_ids=[ord("!")])
    proc.process(step(out("r", "Hi")))
    processed = proc.process(step(out("r", "!", "stop", stop_reason=ord("!"))))
    assert processed.stops == [] and processed.requests == [state]
    c = state.output().outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("Hi", ids("Hi!"), "stop", ord("!"))


def test_n_samples_are_n_core_sequences_gathered_into_one_output():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, msgs = add(proc, n=3, seed=5, max_tokens=4, salt="tenant")
    assert [m.request_id for m in msgs] == ["r#0", "r#1", "r#2"]
    assert [m.params.seed for m in msgs] == [5, 6, 7]  # distinct, reproducible samples
    assert all(m.prompt_token_ids == PROMPT and m.max_tokens == 4 and m.eos_token_ids == {EOS}
               and m.cache_salt == "tenant" and m.arrival_time == 100.0 for m in msgs)
    proc.process(step(out("r#0", "a"), out("r#2", "x"), out("r#1", "pq", "length", num_preemptions=1)))
    assert not state.finished and "r" in proc.requests
    proc.process(step(out("r#2", "y", "stop", stop_reason=None), out("r#0", "b", num_preemptions=2)))
    processed = proc.process(step(out("r#0", "cd", "length", num_preemptions=2)))
    assert processed.requests == [state] and state.finished and proc.requests == {}
    result = state.output()
    assert result.finished and [c.index for c in result.outputs] == [0, 1, 2]
    assert [c.text for c in result.outputs] == ["abcd", "pq", "x"]  # the last of sample 2 ended it (stop)
    assert [c.finish_reason for c in result.outputs] == ["length", "length", "stop"]
    assert result.metrics.num_preemptions == 3 and result.metrics.finished_time is not None


def test_logprobs_follow_their_tokens_in_outputs_and_deltas():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, logprobs=1)
    a, b = ord("a"), ord("b")
    proc.process(step(EngineCoreOutput("r", [a], [{a: -0.5, b: -1.0}])))
    [first] = state.deltas()
    proc.process(step(EngineCoreOutput("r", [b], [{b: -0.25, a: -2.0}], "length")))
    [second] = state.deltas()
    assert (first.token_ids, first.logprobs) == ([a], [{a: -0.5, b: -1.0}])
    assert (second.token_ids, second.logprobs) == ([b], [{b: -0.25, a: -2.0}])
    c = state.output().outputs[0]
    assert c.cumulative_logprob == pytest.approx(-0.75) and len(c.logprobs) == 2
    plain, _ = add(proc, "plain")
    proc.process(step(EngineCoreOutput("plain", [a], None, "length")))
    assert plain.output().outputs[0].logprobs is None and plain.output().outputs[0].cumulative_logprob is None


def test_deltas_hand_out_each_piece_once():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc)
    proc.process(step(out("r", "ab")))
    assert [(d.text, d.finish_reason) for d in state.deltas()] == [("ab", None)]
    assert state.deltas() == []  # nothing new
    proc.process(step(out("r", "c", "length")))
    assert [(d.text, d.token_ids, d.finish_reason) for d in state.deltas()] == [("c", [ord("c")], "length")]
    assert state.deltas() == []


def test_abort_after_some_samples_ended_counts_each_as_it_ended():
    rec = Recorder()
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}), rec)
    add(proc, n=3)
    proc.process(step(out("r#0", "a", "length"), out("r#1", "b", "stop"), out("r#2", "c")))
    assert proc.abort_request("r") == ["r#2"]  # only the one still running goes to the core
    assert proc.abort_request("r") == [] and proc.requests == {}
    assert rec.calls["on_aborted"] == [(1,)]
    assert sorted(rec.calls["on_outcomes"][0][0]) == ["abort", "length", "stop"]


@pytest.mark.parametrize("why,kind", [(ErrorInfo("ValueError", "boom"), RequestFailed),
                                      (ErrorInfo.of(ContextTooLong("too long", param="prompt")), ContextTooLong)])
def test_a_rejection_by_the_core_keeps_its_kind(why, kind):
    """A built-in error is an internal failure, not 'context too long'; one of tokenmill's keeps its type."""
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, n=2)
    processed = proc.process(step(rejected={"r#1": why}))
    [(rejected, error)] = processed.rejected
    assert rejected is state and type(error) is kind and proc.requests == {}


def test_a_sample_the_engine_could_not_run_fails_its_request():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc)
    assert state.error is None
    proc.process(step(EngineCoreOutput("r", [], None, "error", None, "RuntimeError: kernel fault")))
    assert state.finished and isinstance(state.error, RequestFailed) and "kernel fault" in str(state.error)


def test_a_sample_the_busy_engine_could_not_run_in_time_is_a_503_with_retry_after():
    """A grammar not built in time on a busy server: ServerBusy (503, Retry-After), not an internal error."""
    from tokenmill.server.errors import error_response

    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc)
    proc.process(step(EngineCoreOutput("r", [], None, "error", None, "grammar not built in time", retry_after=10)))
    assert isinstance(state.error, ServerBusy) and state.error.retry_after == 10
    response = error_response(state.error)
    assert response.status_code == 503 and response.headers["retry-after"] == "10"
    assert b"grammar not built in time" in response.body and b"service_unavailable" in response.body


def test_per_request_metrics_and_their_hooks():
    rec = Recorder()
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}), rec)
    state, _ = add(proc, n=2, arrival=100.0)
    assert rec.calls["on_added"] == [(len(PROMPT),)]
    proc.process(step(started={"r#0": (101.0, 16), "r#1": (101.5, 0)}))
    assert state.metrics.first_scheduled_time == 101.0 and state.num_cached_tokens == 16  # from the first sample
    assert rec.calls["on_started"] == [(1.0,), (1.5,)]
    proc.process(step(out("r#0", "a"), out("r#1", "b"), stats=SchedulerStats(2, 0, 0, 0.1, 0)))
    assert state.metrics.first_token_time is not None
    assert len(rec.calls["on_first_token"]) == 2 and "on_inter_token" not in rec.calls
    assert rec.calls["on_stats"][-1][1] == 2  # tokens generated in that step
    proc.process(step(out("r#0", "c", "length"), out("r#1", "d", "length")))
    assert len(rec.calls["on_inter_token"]) == 2
    [(finished, e2e)] = rec.calls["on_finished"]
    assert finished is state and e2e == pytest.approx(state.metrics.finished_time - 100.0)
    assert "on_stats" in rec.calls and len(rec.calls["on_stats"]) == 1  # only steps that carry stats


def test_a_request_id_in_flight_cannot_be_reused():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    add(proc)
    with pytest.raises(ValueError, match="already in flight"):
        add(proc)


# ---- several tokens in one step (speculative decoding) -----------------------------------------------------


@pytest.mark.parametrize("include,text", [(False, "He"), (True, "Hell")])
def test_a_stop_string_completed_by_the_second_token_of_a_step_cuts_tokens_and_text_there(include, text):
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["ll"], include_stop_str_in_output=include)
    proc.process(step(out("r", "He")))
    processed = proc.process(step(out("r", "llo w")))  # "l" completes "ll" at the step's second token
    c = state.output().outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (ids("Hell"), text, "stop", "ll")
    assert processed.stops == [FinishRequest("r", "ll")]  # the core still runs it
    assert processed.num_generated == 5  # what the core sent, cut or not
    assert [(d.text, d.token_ids) for d in state.deltas()] == [(text, ids("Hell"))] and state.deltas() == []
    assert proc.requests == {}


def test_a_stop_string_within_one_multi_token_step_from_the_start():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["xy"])
    processed = proc.process(step(out("r", "axyzw")))
    c = state.output().outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (ids("axy"), "a", "stop", "xy")
    assert processed.stops == [FinishRequest("r", "xy")]
    [delta] = state.deltas()
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("a", ids("axy"), "stop")


def test_the_logprobs_of_tokens_past_a_stop_string_are_cut_too():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["bc"], logprobs=0)
    a, b, c_, d = (ord(ch) for ch in "abcd")
    proc.process(step(EngineCoreOutput("r", [a, b, c_, d], [{a: -0.5}, {b: -0.25}, {c_: -1.0}, {d: -2.0}])))
    c = state.output().outputs[0]
    assert (c.token_ids, c.text) == ([a, b, c_], "a")
    assert c.logprobs == [{a: -0.5}, {b: -0.25}, {c_: -1.0}]
    assert c.cumulative_logprob == pytest.approx(-1.75)


def test_a_stop_string_before_the_core_s_own_end_in_the_same_step_wins():
    """The core ended the sequence (length, or a stop token) with the step's last token, but a stop string completed
    earlier in the step: the output ends at the stop string, and the core is not told again."""
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["b"], max_tokens=4)
    processed = proc.process(step(out("r", "abcd", "length")))
    c = state.output().outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (ids("ab"), "a", "stop", "b")
    assert processed.stops == []

    state, _ = add(proc, "eos", stop=["q"])
    processed = proc.process(step(EngineCoreOutput("eos", ids("pqr") + [EOS], finish_reason="stop")))
    c = state.output().outputs[0]
    assert (c.token_ids, c.text, c.stop_reason) == (ids("pq"), "p", "q")
    assert processed.stops == []


def test_several_tokens_ending_with_a_stop_token_keep_it_in_the_ids_but_not_the_text():
    proc = OutputProcessor(CharDecoder(), frozenset({EOS}))
    state, _ = add(proc, stop=["zz"])
    proc.process(step(EngineCoreOutput("r", ids("ab") + [EOS], finish_reason="stop")))
    c = state.output().outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (ids("ab") + [EOS], "ab", "stop", None)
