"""server/responses_api.py and server/response_store.py without a server: input items as chat messages, the
conversation a follow-up continues, text.format, answers as output items, chunks as the Responses event stream
(sequence numbers, item ids the final response repeats), and the bounded store."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    assistant_messages,
    output_of,
    response_events,
)


def request(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **kw})


def test_items_become_chat_messages_after_instructions_and_history():
    req = request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "cold"},
        {"type": "message", "role": "developer", "content": "ok"}],
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}})
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    chat = req.to_chat(history, req.input_messages())
    messages = chat.template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "tool", "developer"]
    assert messages[0]["content"] == "Be brief." and messages[1:3] == history
    assert [c["id"] for c in messages[4]["tool_calls"]] == ["c1", "c2"]
    assert messages[5] == {"role": "tool", "content": "cold", "tool_call_id": "c1"}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image"}]}, "input.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_refusals_name_the_field(body, param):
    req = request(**body)
    with pytest.raises(InvalidRequest) as err:
        req.to_chat([], req.input_messages())
    assert err.value.param == param


def chat_answer(message: dict, finish: str) -> dict:
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


def test_answers_become_items_and_the_next_turns_history():
    output, finish = output_of(chat_answer({"role": "assistant", "content": "Hi", "reasoning_content": "hm",
                                            "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                    "arguments": "{}"}}]},
                                           "tool_calls"))
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call"]
    assert output[1]["content"][0]["text"] == "Hi" and output[2]["call_id"] == "c"
    assert assistant_messages(output) == [{"role": "assistant", "content": "Hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert ResponseBuilder.status("length") == "incomplete" and ResponseBuilder.status("stop") == "completed"
    body = ResponseBuilder(request(input="x", max_output_tokens=5), "m").body("incomplete", output, None)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["object"] == "response"


def test_chunks_become_the_event_stream_with_stable_ids():
    def chunk(delta, finish=None):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hm"}),
              chunk({"content": "Le"}), chunk({"content": "t"}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}), chunk({}, "tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                        "prompt_tokens_details": {"cached_tokens": 0}}}]
    builder, output = ResponseBuilder(request(input="x"), "m"), []

    async def run():
        async def source():
            for c in chunks:
                yield c
        return [e async for e in response_events(source(), builder, output)]

    events = asyncio.run(run())
    names = [n for n, _ in events]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    data = [d for _, d in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    added = [d["item"]["id"] for d in data if d["type"] == "response.output_item.added"]
    done = [d["item"]["id"] for d in data if d["type"] == "response.output_item.done"]
    final = data[-1]["response"]
    assert added == done == [o["id"] for o in final["output"]] == [o["id"] for o in output]
    assert final["output"][1]["content"][0]["text"] == "Let" and final["output"][2]["arguments"] == "{}"
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 4


def test_store_is_bounded_least_recently_used_first():
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is None and len(store) == 2
    store.get("b")  # used: c goes next
    store.put("d", StoredResponse({"id": "d"}, []))
    assert store.get("c") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")
    off = ResponseStore(0)
    off.put("a", StoredResponse({}, []))
    assert off.get("a") is None
