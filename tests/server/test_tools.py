"""Tool calling (server/tools.py): tools and tool_choice checked, the calls in the prompt and parsed back out, the
streamed deltas; and through a real server with the official openai client, a two-turn exchange."""

from __future__ import annotations

import json

import openai
import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.server.tools import CallStream, ToolChoice, parse_calls, template_messages
from tokenmill.structured.backend import GrammarCache

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}


def call_text(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, separators=(',', ':'))}\n</tool_call>"


# ---- checking the request ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function"}], None, "tools.0"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools.0.function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_or_tool_choice_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequest) as e:
        ToolChoice.parse(tools, choice, True)
    assert e.value.param == param


def test_tool_choice_modes():
    assert ToolChoice.parse(None, None, True) is None and ToolChoice.parse([], None, True) is None
    auto = ToolChoice.parse([WEATHER, TIME], None, True)
    assert auto.mode == "auto" and auto.constraint() is None and len(auto.offered) == 2 and auto.parses
    none = ToolChoice.parse([WEATHER], "none", True)
    assert none.offered == () and not none.parses and none.constraint() is None
    named = ToolChoice.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert [t.name for t in named.offered] == ["get_time"] and named.constraint() is not None


def matcher_accepts(spec, text: str) -> bool:
    """Whether the constraint's grammar accepts `text` whole (byte level, no tokenizer needed)."""
    import llguidance.hf

    from tests.models.tiny import smollm2_tokenizer

    tok = llguidance.hf.from_tokenizer(smollm2_tokenizer(), n_vocab=49152)
    m = llguidance.LLMatcher(tok, GrammarCache().check(spec), log_level=0)
    return m.consume_tokens(smollm2_tokenizer().encode(text, add_special_tokens=False)) and m.is_accepting()


def test_required_constrains_the_output_to_calls_of_the_offered_functions():
    required = ToolChoice.parse([WEATHER, TIME], "required", True).constraint()
    one, two = call_text("get_weather", {"city": "Paris"}), call_text("get_time", {"zone": "UTC"})
    assert matcher_accepts(required, one) and matcher_accepts(required, one + "\n" + two)
    assert not matcher_accepts(required, call_text("get_weather", {"town": "Paris"}))  # arguments by schema
    assert not matcher_accepts(required, call_text("launch", {}))  # only offered functions
    assert not matcher_accepts(required, "Sure! " + one)  # nothing but calls
    single = ToolChoice.parse([WEATHER, TIME], "required", False).constraint()
    assert matcher_accepts(single, one) and not matcher_accepts(single, one + "\n" + two)  # no parallel calls
    named = ToolChoice.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert not matcher_accepts(named.constraint(), one) and matcher_accepts(named.constraint(), two)


# ---- the conversation in and the calls out ---------------------------------------------------------------------------
def test_template_messages_put_tools_in_the_system_message_and_calls_in_the_models_format():
    choice = ToolChoice.parse([WEATHER], None, True)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
    out = template_messages(history, choice, template_takes_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == call_text("get_weather", {"city": "Paris"}) and "tool_calls" not in out[2]
    assert out[3] == {"role": "tool", "content": '<tool_response>\n{"temp_c": 18}\n</tool_response>'}
    kept = template_messages(history, choice, template_takes_tools=True)  # the template renders them itself
    assert kept[0] == history[0] and kept[2]["tool_calls"] == history[2]["tool_calls"]
    assert len(template_messages(history[1:2], None, False)) == 1  # no tools: no system message added


def test_parse_calls_splits_content_and_calls():
    text = "Let me check.\n" + call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {"zone": "CET"})
    content, calls = parse_calls(text, ToolChoice.parse([WEATHER, TIME], None, True).tools)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    tools = ToolChoice.parse([WEATHER], None, True).tools
    assert parse_calls("no calls here", tools) == ("no calls here", [])
    bad = "<tool_call>\nnot json\n</tool_call>"
    assert parse_calls(bad, tools) == (bad, [])  # what the model wrote stays visible
    assert parse_calls(call_text("unknown_fn", {}), tools)[1] == []


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_call_stream_gives_content_then_each_call_when_its_block_closes(piece):
    text = "Checking <tool" + "ish> text. " + call_text("get_weather", {"city": "Rome"}) + " done"
    stream = CallStream(ToolChoice.parse([WEATHER], None, True).tools)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.feed(text[i:i + piece])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Checking <toolish> text.  done"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"} and stream.num_calls == 1
    unclosed = CallStream(ToolChoice.parse([WEATHER], None, True).tools)
    assert unclosed.feed("<tool_call>\n{") == [] and unclosed.finish() == [{"content": "<tool_call>\n{"}]


# ---- a real server ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tool_calls_round_trip_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "cloudy"})}]
    r2 = client.chat.completions.create(model=server.model, messages=msgs, tools=[WEATHER], tool_choice="none",
                                        temperature=0, max_tokens=24)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    # streamed: the call's header, then its arguments, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(
        model=server.model, messages=msgs[:1], tools=[WEATHER], stream=True, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id.startswith("call_")
    assert "city" in json.loads("".join(d[0].function.arguments or "" for d in deltas))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.slow
def test_bad_tools_get_400_naming_the_field(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test-key")
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, param in (({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools.0.function.name"),
                          ({"tools": [WEATHER], "tool_choice": "required",
                            "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param, e.value.body
