"""server/anthropic.py without a server: Anthropic requests as chat requests (system, tool_use and tool_result
blocks, tool_choice), chat answers as Messages, chat chunks as Anthropic's event sequence."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.server.anthropic import MessagesRequest, message_body, message_events

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_blocks_become_chat_messages():
    req = request(system=[{"type": "text", "text": "Be brief."}], tools=[TOOL],
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                  stop_sequences=["END"], messages=[
                      {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "hmm", "signature": ""},
                          {"type": "text", "text": "Let me look."},
                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]},
                          {"type": "text", "text": "Thanks"}]}])
    chat = req.to_chat()
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "cold", "tool_call_id": "t1"},
        {"role": "user", "content": "Thanks"}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.stop == ["END"] and chat.max_tokens == 8
    assert [request(tools=[TOOL], tool_choice={"type": t}, messages=[{"role": "user", "content": "x"}]).to_chat()
            .tool_choice for t in ("auto", "any", "none")] == ["auto", "required", "none"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": {"type": "tool"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as err:
        request(**body).to_chat()
    assert err.value.param == param


def test_max_tokens_is_required_to_generate_but_not_to_count():
    req = MessagesRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidRequest, match="max_tokens"):
        req.to_chat()
    assert req.to_chat(for_generation=False).template_messages() == [{"role": "user", "content": "x"}]


def chat_answer(message: dict, finish: str, stop_reason=None) -> dict:
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                       "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 4}}}


def test_answers_become_messages():
    body = message_body(chat_answer({"role": "assistant", "content": "Hi", "reasoning_content": "think",
                                     "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                                    "tool_calls"), "msg_1")
    assert body["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                               {"type": "text", "text": "Hi"},
                               {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]
    assert body["stop_reason"] == "tool_use" and body["id"] == "msg_1"
    assert body["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                             "cache_creation_input_tokens": 0}
    stopped = message_body(chat_answer({"role": "assistant", "content": "a"}, "stop", "END"), "m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert message_body(chat_answer({"role": "assistant", "content": "a"}, "length"), "m")["stop_reason"] == \
        "max_tokens"
    assert message_body(chat_answer({"role": "assistant", "content": "a"}, "stop", 2), "m")["stop_reason"] == \
        "end_turn"  # EOS (a token id) is the end of a turn


def test_chunks_become_the_event_sequence():
    def chunk(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hm"}),
              chunk({"content": "Let"}), chunk({"content": " me"}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
              chunk({}, "tool_calls"), {"choices": [], "usage": {"completion_tokens": 7}}]

    async def run():
        async def source():
            for c in chunks:
                yield c
        return [e async for e in message_events(source(), "msg_1", "m", 12)]

    events = asyncio.run(run())
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [d for _, d in events]
    assert all(d["type"] == n for n, d in events)
    assert data[0]["message"]["usage"]["input_tokens"] == 12
    assert [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"] == \
        ["thinking", "text", "tool_use"]
    assert [d["index"] for d in data if "index" in d] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert data[9]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert data[11]["delta"]["stop_reason"] == "tool_use" and data[11]["usage"] == {"output_tokens": 7}
    assert json.dumps(data)  # all plain JSON
