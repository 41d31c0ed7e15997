"""Arrival times, SSE parsing, and turning a timed chunk stream into a request result (no real server)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from tokenmill.bench import loadgen
from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.loadgen import (
    LoadConfig,
    StreamRecorder,
    arrival_times,
    class_body,
    draw_classes,
    request_body,
    run_load,
    send_request,
)
from tokenmill.bench.metrics import RequestClass
from tokenmill.bench.sse import SSEParser

# ------------------------------------------------------------------------------------------- arrivals


def test_poisson_gaps_have_mean_one_over_rate():
    times = arrival_times(20_000, rate=4.0, seed=1, normalize=False)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert np.all(gaps > 0)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_mean_and_changes_the_spread(burstiness):
    times = arrival_times(20_000, rate=2.0, burstiness=burstiness, seed=2, normalize=False)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    # gamma(shape=b): CV^2 = 1/b, so b < 1 is burstier and b > 1 more even than Poisson
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.1)


def test_normalized_arrivals_end_at_n_over_rate_and_stay_sorted():
    times = arrival_times(50, rate=5.0, seed=3)
    assert times[-1] == pytest.approx(10.0)
    assert np.all(np.diff(times) >= 0) and times[0] > 0


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(7, math.inf).tolist() == [0.0] * 7


def test_infinite_burstiness_is_even_spacing():
    assert arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_arrivals_are_seeded():
    a, b, c = (arrival_times(100, 3.0, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (float("nan"), 1.0)])
def test_bad_rate_or_burstiness_is_refused(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness)


# -------------------------------------------------------------------------------------- request classes


def test_class_draw_follows_the_shares():
    assert np.bincount(draw_classes(1000, [0.75, 0.25], seed=1)).tolist() == [750, 250]
    assert np.bincount(draw_classes(8, [3, 1], seed=1)).tolist() == [6, 2]  # shares are normalised
    assert np.bincount(draw_classes(10, [1, 1, 1], seed=1)).tolist() == [4, 3, 3]  # remainders, in order
    assert np.bincount(draw_classes(7, [0.5, 0.3, 0.2], seed=1)).tolist() == [4, 2, 1]


def test_class_draw_is_seeded_and_shuffled():
    a, b, c = (draw_classes(200, [0.5, 0.5], seed=s) for s in (4, 4, 5))
    assert a == b and a != c
    assert a != sorted(a)  # mixed through the run, not one class after the other
    assert draw_classes(3, [1.0], seed=0) == [0, 0, 0]


@pytest.mark.parametrize("shares", [[], [1.0, 0.0], [-1.0], [float("nan")], [float("inf")]])
def test_class_draw_refuses_bad_shares(shares):
    with pytest.raises(ValueError, match="shares"):
        draw_classes(4, shares)


def test_class_body_sends_only_what_the_class_sets():
    full = RequestClass("i", share=0.75, priority=0, slo_ttft_ms=1000.0, slo_tpot_ms=150.0)
    assert class_body(full) == {"priority": 0, "slo_ttft_ms": 1000.0, "slo_itl_ms": 150.0}
    assert class_body(RequestClass("b", priority=1)) == {"priority": 1}
    assert class_body(RequestClass("plain")) == {}


def test_per_request_body_goes_over_the_global_one():
    req = BenchRequest("Say hi", [1, 2], 2, 7)
    cfg = LoadConfig(base_url="http://x", model="m", extra_body={"top_k": 1, "priority": 5})
    body = request_body(cfg, req, extra_body={"priority": 0, "slo_itl_ms": 150.0})
    assert body["priority"] == 0 and body["slo_itl_ms"] == 150.0 and body["top_k"] == 1
    assert request_body(cfg, req)["priority"] == 5


def _sse_handler(seen: list):
    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        events = [completion_chunk("a"), completion_chunk("b"), usage_chunk(4, 2)]
        payload = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=payload.encode(), headers={"content-type": "text/event-stream"})

    return handler


def test_run_load_sends_each_request_its_own_body(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(loadgen, "make_client", lambda cfg: httpx.AsyncClient(
        base_url="http://server", transport=httpx.MockTransport(_sse_handler(seen))))
    cfg = LoadConfig(base_url="http://server", model="m", progress=False, extra_body={"top_k": 1})
    requests = [BenchRequest(f"p{i}", [1], 1, 2) for i in range(4)]
    bodies = [{"priority": i % 2, "slo_ttft_ms": 100.0 * (i + 1)} for i in range(4)]
    results, _ = asyncio.run(run_load(cfg, requests, bodies))
    assert all(r.success for r in results)
    by_prompt = {b["prompt"]: b for b in seen}
    for i in range(4):
        assert by_prompt[f"p{i}"]["priority"] == i % 2 and by_prompt[f"p{i}"]["slo_ttft_ms"] == 100.0 * (i + 1)
        assert by_prompt[f"p{i}"]["top_k"] == 1

    seen.clear()  # without per-request bodies (benchmarks/*.py call it so): only the global fields
    results, _ = asyncio.run(run_load(cfg, requests[:2]))
    assert len(results) == 2 and all("priority" not in b for b in seen) and len(seen) == 2
    with pytest.raises(ValueError, match="3 extra bodies for 4 requests"):
        asyncio.run(run_load(cfg, requests, bodies[:3]))


# ------------------------------------------------------------------------------------------------ SSE


def test_sse_events_split_anywhere():
    stream = (b'data: {"a": 1}\n\n: ping\n\ndata: {"b":\n'
              b'data: 2}\r\n\r\nevent: x\ndata: [DONE]\n\n')
    whole = SSEParser().feed(stream)
    assert whole == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    for cut in range(1, len(stream)):
        parser = SSEParser()
        assert parser.feed(stream[:cut]) + parser.feed(stream[cut:]) + parser.close() == whole, cut


def test_sse_byte_at_a_time_with_multibyte_utf8_and_crlf():
    stream = 'data: {"text": "héllo ✓"}\r\n\r\ndata: [DONE]\r\n\r\n'.encode()
    parser = SSEParser()
    events = [e for i in range(len(stream)) for e in parser.feed(stream[i:i + 1])]
    assert events == ['{"text": "héllo ✓"}', "[DONE]"]


def test_sse_close_flushes_an_unterminated_event():
    parser = SSEParser()
    assert parser.feed(b"data: last") == []
    assert parser.close() == ["last"]


# ------------------------------------------------------------------------------------- chunk -> result


def completion_chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                  "finish_reason": finish}]})


def chat_chunk(delta: dict) -> str:
    return json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


def usage_chunk(prompt: int, completion: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


def test_recorder_times_content_chunks_only():
    rec = StreamRecorder("completions", prompt_len=5, sent_at=10.0)
    for payload, at in [(completion_chunk("Hello"), 10.5), (completion_chunk(" wor"), 10.75),
                        (completion_chunk("ld"), 11.0), (completion_chunk("", "length"), 11.5),
                        (usage_chunk(6, 3), 11.6), ("[DONE]", 11.7)]:
        rec.on_event(payload, at)
    r = rec.finish()
    assert r.success and rec.done
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.25, 0.25])
    assert r.latency == pytest.approx(1.0)  # the last content chunk, not the finish or usage chunk
    assert (r.output_tokens, r.prompt_len, r.generated_text) == (3, 6, "Hello world")


def test_recorder_chat_role_chunk_is_not_the_first_token():
    rec = StreamRecorder("chat", prompt_len=5, sent_at=0.0)
    rec.on_event(chat_chunk({"role": "assistant", "content": ""}), 0.01)
    rec.on_event(chat_chunk({"content": "Hi"}), 0.4)
    rec.on_event(chat_chunk({"content": "!"}), 0.5)
    rec.on_event(chat_chunk({}), 0.6)
    r = rec.finish()
    assert r.ttft == pytest.approx(0.4) and r.itl == pytest.approx([0.1]) and r.output_tokens is None


def test_recorder_error_event_and_empty_stream_fail():
    rec = StreamRecorder("completions", 5, 0.0)
    rec.on_event(completion_chunk("a"), 0.1)
    rec.on_event(json.dumps({"error": {"message": "engine died", "code": 503}}), 0.2)
    r = rec.finish()
    assert not r.success and "engine died" in r.error
    empty = StreamRecorder("completions", 5, 0.0)
    empty.on_event("[DONE]", 0.1)
    assert not empty.finish().success


def test_request_body_is_portable_and_greedy():
    req = BenchRequest("Say hi", [1, 2], 2, 7)
    cfg = LoadConfig(base_url="http://x", model="m", extra_body={"top_k": 1})
    body = request_body(cfg, req)
    assert body == {"model": "m", "prompt": "Say hi", "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 1}
    chat = request_body(LoadConfig(base_url="http://x", model="m", endpoint="chat", ignore_eos=False), req)
    assert chat["messages"] == [{"role": "user", "content": "Say hi"}] and "ignore_eos" not in chat


def _send(handler, endpoint: str = "completions"):
    cfg = LoadConfig(base_url="http://server", model="m", endpoint=endpoint)

    async def go():
        async with httpx.AsyncClient(base_url="http://server", transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, cfg, BenchRequest("hi", [1], 1, 3), t0=0.0)

    return asyncio.run(go())


def test_send_request_over_a_mock_stream():
    seen = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        events = [completion_chunk("a"), completion_chunk("b"), completion_chunk("c", "length"), usage_chunk(4, 3)]
        payload = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=payload.encode(), headers={"content-type": "text/event-stream"})

    r = _send(handler)
    assert seen["path"] == "/v1/completions" and seen["body"]["max_tokens"] == 3
    assert r.success and r.generated_text == "abc" and r.output_tokens == 3 and len(r.itl) == 2
    assert r.prompt_len == 4 and r.latency >= r.ttft >= 0


def test_send_request_http_error_is_a_failed_result():
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "queue full"}})

    r = _send(handler, endpoint="chat")
    assert not r.success and r.error.startswith("HTTP 429") and "queue full" in r.error
