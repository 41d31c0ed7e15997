"""Anthropic's Messages API and OpenAI's Responses API end to end, through the vendors' own SDKs (`anthropic`,
`openai`) against a real `tokenmill serve` with the default model: plain and streamed answers agree with each other
and with the chat completion of the same conversation, a tool round trip each, a two-turn previous_response_id
exchange, the response store (GET, DELETE, store: false, LRU), count_tokens, x-api-key, and each API's error shape;
/v1/embeddings through the `openai` SDK, and --runner pooling."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, start_server

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # Anthropic's SDK no longer takes sampling fields: they travel as extra_body
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                            "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-stored-responses", "3")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_text(client, server, messages, **kw) -> str:
    out = client.chat.completions.create(model=server.model, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content


def test_messages_plain_and_streamed_are_the_chat_answer(server, claude, client):
    plain = claude.messages.create(model=server.model, max_tokens=40, system="Be brief.", messages=ASK,
                                   extra_body=GREEDY)
    assert plain.type == "message" and plain.role == "assistant" and plain.stop_reason == "end_turn"
    text = plain.content[0].text
    assert text == chat_text(client, server, [{"role": "system", "content": "Be brief."}, *ASK], max_tokens=40)
    with claude.messages.stream(model=server.model, max_tokens=40, system="Be brief.", messages=ASK,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == plain.usage.output_tokens > 0
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model=server.model, system="Be brief.", messages=ASK).input_tokens


def test_messages_stop_sequences_and_max_tokens(server, claude):
    text = claude.messages.create(model=server.model, max_tokens=40, messages=ASK, extra_body=GREEDY).content[0].text
    word = text.split()[2]
    stopped = claude.messages.create(model=server.model, max_tokens=40, messages=ASK, stop_sequences=[word],
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and text.startswith(stopped.content[0].text)
    short = claude.messages.create(model=server.model, max_tokens=2, messages=ASK, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("streamed", [False, True])
def test_messages_tool_round_trip(server, claude, streamed):
    """tool_choice any: a tool_use block whose input follows the schema; its tool_result sent back, the model
    answers in text."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=server.model, max_tokens=80, tools=[WEATHER], extra_body=GREEDY)
    if streamed:
        with claude.messages.stream(messages=ask, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                    **kw) as stream:
            first = stream.get_final_message()
    else:
        first = claude.messages.create(messages=ask, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                       **kw)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and set(calls[0].input) == {"city"} and isinstance(calls[0].input["city"], str)
    follow = ask + [{"role": "assistant", "content": [c.model_dump(include={"type", "id", "name", "input"}) for c in calls]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": "Sunny, 24 C"}]}]
    answer = claude.messages.create(messages=follow, tool_choice={"type": "none"}, **kw)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_messages_errors_keys_and_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=server.model, max_tokens=5, messages=[], extra_body=GREEDY)
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "messages must not be empty"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=server.model, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-9", max_tokens=5, messages=ASK)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=server.model, max_tokens=5, messages=ASK)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    no_max = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                        json={"model": server.model, "messages": ASK})
    assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]


def test_responses_plain_streamed_and_two_turns(server, client):
    first = client.responses.create(model=server.model, input="Name three colours.", instructions="Be brief.",
                                    max_output_tokens=64, temperature=0)
    assert first.status == "completed" and first.output[0].type == "message"
    text = first.output_text
    assert text == chat_text(client, server, [{"role": "system", "content": "Be brief."}, *ASK], max_tokens=64)
    with client.responses.stream(model=server.model, input="Name three colours.", instructions="Be brief.",
                                 max_output_tokens=64, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == text
    second = client.responses.create(model=server.model, input="And two more?", previous_response_id=first.id,
                                     max_output_tokens=64, temperature=0)
    conversation = [*ASK, {"role": "assistant", "content": text}, {"role": "user", "content": "And two more?"}]
    assert second.output_text == chat_text(client, server, conversation, max_tokens=64)  # instructions not carried
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.total_tokens - 5
    short = client.responses.create(model=server.model, input="Name three colours.", max_output_tokens=2,
                                    temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("streamed", [False, True])
def test_responses_tool_round_trip(server, client, streamed):
    tool = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}
    kw = dict(model=server.model, tools=[tool], temperature=0, max_output_tokens=80)
    if streamed:
        with client.responses.stream(input="What is the weather in Paris?", tool_choice="required",
                                     parallel_tool_calls=False, **kw) as stream:
            arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
            first = stream.get_final_response()
    else:
        first = client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                        parallel_tool_calls=False, **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    if streamed:
        assert arguments == calls[0].arguments
    answer = client.responses.create(previous_response_id=first.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}], **kw)
    assert answer.output_text and answer.output[-1].type == "message"


def test_responses_json_schema_format(server, client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    out = client.responses.create(model=server.model, input="Pick a colour.", temperature=0, max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert json.loads(out.output_text)["colour"] in ("red", "green", "blue")


def test_response_store_get_delete_lru_and_store_false(server, client):
    kept = client.responses.create(model=server.model, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unstored = client.responses.create(model=server.model, input="Hi", max_output_tokens=4, temperature=0,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=server.model, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    ids = [client.responses.create(model=server.model, input="Hi", max_output_tokens=2).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError):  # --max-stored-responses 3: the oldest went first
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[3]).id == ids[3]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=server.model, input=[{"type": "input_image", "image_url": "x"}])
    assert err.value.body["param"] == "input.0.type"
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.responses.create(model=server.model, input="Hi", tools=[{"type": "web_search"}])


def test_suffix_needs_a_fill_in_the_middle_model(server):
    refused = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"prompt": "x", "suffix": "y", "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"
    assert "no FIM tokens" in refused.json()["error"]["message"] and server.model in refused.json()["error"]["message"]


def test_embeddings_through_the_openai_sdk(server, client, http):
    """Float and base64 (the SDK's default, decoded by it) give the same vectors; a text's vector is the same alone,
    batched with others and given as token ids; normalize: false gives the same direction unscaled."""
    texts = ["Hello world", "The capital of France is Paris.", "Owls hunt at night."]
    floats = client.embeddings.create(model=server.model, input=texts, encoding_format="float")
    decoded = client.embeddings.create(model=server.model, input=texts)  # base64 on the wire
    assert [d.embedding for d in floats.data] == [d.embedding for d in decoded.data]
    assert [d.index for d in floats.data] == [0, 1, 2] and len(floats.data[0].embedding) == 576
    alone = client.embeddings.create(model=server.model, input=texts[1], encoding_format="float").data[0].embedding
    assert alone == floats.data[1].embedding
    assert abs(sum(x * x for x in alone) - 1) < 1e-5  # normalized
    ids = http.post("/tokenize", json={"prompt": texts[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model=server.model, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == alone and by_ids.usage.prompt_tokens == len(ids)
    raw = http.post("/v1/embeddings", json={"input": texts[1], "normalize": False}).json()["data"][0]["embedding"]
    norm = sum(x * x for x in raw) ** 0.5
    assert norm > 1.5 and max(abs(a - b / norm) for a, b in zip(alone, raw)) < 1e-6
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model=server.model, input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=server.model, input=[])
    assert err.value.body["param"] == "input"


def test_runner_pooling_serves_embeddings_only():
    s = start_server("--runner", "pooling", "--pooling", "mean")
    try:
        with httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            out = http.post("/v1/embeddings", json={"input": "Hello"})
            assert out.status_code == 200 and len(out.json()["data"][0]["embedding"]) == 576
            refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
            assert http.post("/v1/chat/completions", json={"messages": ASK}).status_code == 400
    finally:
        s.stop()


def test_continuing_a_final_message_echo_and_anthropic_prefill(server, client, claude, http):
    """continue_final_message leaves the last (assistant) message open and the answer goes on with it; echo puts
    that message's text first, streamed or not; Anthropic's prefilled assistant turn is the same continuation."""
    prefix = "The three primary colours are"
    messages = [*ASK, {"role": "assistant", "content": prefix}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    goes_on = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=12,
                                             extra_body=extra).choices[0].message.content
    echoed = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=12,
                                            extra_body={**extra, "echo": True}).choices[0].message.content
    assert goes_on and not goes_on.startswith(prefix) and echoed == prefix + goes_on
    stream = client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=12,
                                            extra_body={**extra, "echo": True}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed
    prefilled = claude.messages.create(model=server.model, max_tokens=12, messages=messages, extra_body=GREEDY)
    assert prefilled.content[0].text == goes_on
    refused = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"
