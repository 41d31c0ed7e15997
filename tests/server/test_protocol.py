"""Unit tests for the request bodies (server/protocol.py) and reading them (server/json_body.py), in process."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import BadRequest, classify
from tokenmill.server.json_body import parse_json, validate
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 1000
JSON = "application/json"


def completion(**fields) -> CompletionRequest:
    return validate(CompletionRequest, {"prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_completion_defaults():
    """A bare completion body keeps OpenAI's defaults: 16 tokens, n=1, temperature 1, no stops, no seed."""
    params = completion().to_params(VOCAB)
    assert params.max_tokens == 16
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.stop is None
    assert params.seed is None
    assert params.logprobs is None


def test_completion_field_mapping():
    """Each sampling field of a completion body reaches SamplingParams under its own name."""
    params = completion(max_tokens=7, n=3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=42,
                        presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=1.1, min_tokens=2,
                        stop_token_ids=[3, 4], ignore_eos=True, logprobs=2).to_params(VOCAB)
    assert (params.max_tokens, params.n, params.seed) == (7, 3, 42)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.25, 0.5, 1.1)
    assert params.min_tokens == 2
    assert list(params.stop_token_ids) == [3, 4]
    assert params.ignore_eos is True
    assert params.logprobs == 2


def test_stop_string_and_list():
    """`stop` as one string becomes a one-item list; a list is kept as given."""
    assert list(completion(stop="\n").to_params(VOCAB).stop) == ["\n"]
    assert list(completion(stop=["a", "b"]).to_params(VOCAB).stop) == ["a", "b"]
    assert completion(stop=[]).to_params(VOCAB).stop is None


def test_tiny_temperature_is_greedy_and_huge_top_k_is_off():
    """A temperature below the float32-safe floor means greedy; top_k at or past the vocabulary means off."""
    params = completion(temperature=1e-9, top_k=VOCAB).to_params(VOCAB)
    assert params.temperature == 0.0
    assert params.top_k == 0


def test_chat_defaults():
    """A bare chat body has no max_tokens limit and no logprobs."""
    params = chat().to_params(VOCAB)
    assert params.max_tokens is None
    assert params.logprobs is None
    assert params.n == 1


def test_chat_max_completion_tokens_wins():
    """max_completion_tokens (OpenAI's newer name) takes precedence over max_tokens."""
    assert chat(max_tokens=5).to_params(VOCAB).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_params(VOCAB).max_tokens == 9


def test_chat_logprobs_and_top_logprobs():
    """logprobs: true alone asks for 0 alternatives; top_logprobs sets how many; top_logprobs needs logprobs."""
    assert chat(logprobs=True).to_params(VOCAB).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).to_params(VOCAB).logprobs == 3
    with pytest.raises(InvalidRequest) as err:
        chat(top_logprobs=3).to_params(VOCAB)
    assert err.value.param == "top_logprobs"


def test_chat_field_mapping():
    """Chat shares the sampling fields: n, seed and stop arrive as sent."""
    params = chat(n=2, seed=7, stop="END", temperature=0).to_params(VOCAB)
    assert (params.n, params.seed, params.temperature) == (2, 7, 0.0)
    assert list(params.stop) == ["END"]


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "n": 1.5}, "n"),
    (CompletionRequest, {"prompt": "x", "seed": "s"}, "seed"),
    (CompletionRequest, {"prompt": "x", "stop": 5}, "stop"),
    (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CompletionRequest, {"prompt": "x", "stream": "yes please"}, "stream"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids.0"),
    (CompletionRequest, {}, "prompt"),
    (CompletionRequest, {"prompt": {"text": "x"}}, "prompt"),
    (ChatCompletionRequest, {"messages": "hi"}, "messages"),
    (ChatCompletionRequest, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (ChatCompletionRequest, {"messages": [], "logprobs": "maybe"}, "logprobs"),
])
def test_validate_wrong_type_names_param(model, body, param):
    """A field of the wrong type is a BadRequest (HTTP 400, never 422) whose `param` names the field."""
    with pytest.raises(BadRequest) as err:
        validate(model, body)
    assert err.value.param == param
    status, payload = classify(err.value)
    assert status == 400
    assert payload["error"]["param"] == param


def test_validate_refuses_nan():
    """NaN is not a number a sampler can use: refused at validation, naming the field."""
    with pytest.raises(BadRequest) as err:
        validate(CompletionRequest, {"prompt": "x", "temperature": float("nan")})
    assert err.value.param == "temperature"


def test_validate_ignores_unknown_fields():
    """Vendor extras a client sends are ignored, not refused."""
    assert validate(CompletionRequest, {"prompt": "x", "vendor_extra": 1}).prompt == "x"


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {"1": 200.0}}, "logit_bias"),
    ({"logit_bias": {"one": 2.0}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 2.0}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 99}, "logprobs"),
    ({"temperature": 1000.0}, "temperature"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ["s"] * 65}, "stop"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_to_params_invalid_value_names_param(fields, param):
    """A well-typed but unusable value is an InvalidRequest (HTTP 400) naming the field."""
    with pytest.raises(InvalidRequest) as err:
        completion(**fields).to_params(VOCAB)
    assert err.value.param == param
    assert classify(err.value)[0] == 400


def test_prompts_shapes():
    """Every prompt shape becomes a list of prompts; an empty list is refused naming `prompt`."""
    assert completion(prompt="a").prompts() == ["a"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts() == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(InvalidRequest) as err:
        completion(prompt=[]).prompts()
    assert err.value.param == "prompt"


def test_chat_message_checks_name_the_message():
    """Unknown roles, and a missing content outside assistant turns, are refused naming the message's field."""
    with pytest.raises(InvalidRequest) as err:
        validate(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]}).template_messages()
    assert err.value.param == "messages.0.role"
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "user"}]}
    with pytest.raises(InvalidRequest) as err:
        validate(ChatCompletionRequest, body).template_messages()
    assert err.value.param == "messages.1.content"


def test_parse_json_accepts_json_types():
    """application/json (with parameters) and +json types are read."""
    assert parse_json(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}
    assert parse_json(b'{"a": 1}', "application/vnd.api+json") == {"a": 1}


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/x-www-form-urlencoded"])
def test_parse_json_refuses_other_content_types(content_type):
    """A body not declared as JSON is a 400 before it is parsed."""
    with pytest.raises(BadRequest, match="Content-Type"):
        parse_json(b'{"a": 1}', content_type)


@pytest.mark.parametrize("raw", [b"{", b"{'a': 1}", b"", b'{"a": 1} trailing', b"[" * 100_000])
def test_parse_json_refuses_malformed(raw):
    """Malformed or absurdly nested JSON is a 400, not a crash."""
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_json(raw, JSON)


def test_parse_json_refuses_non_object():
    """A JSON array or scalar is not a request body."""
    with pytest.raises(BadRequest, match="JSON object"):
        parse_json(b"[1, 2]", JSON)


def test_parse_json_refuses_invalid_utf8():
    """JSON must be UTF-8: other bytes are a 400 naming the offset."""
    with pytest.raises(BadRequest, match="UTF-8"):
        parse_json(b'{"a": "\xff"}', JSON)


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "ok \\udfff"}]}', "messages.0.content"),
    (b'{"prompt": ["fine", "\\uDBFF"]}', "prompt.1"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt"),
])
def test_parse_json_refuses_lone_surrogates(raw, param):
    """A lone UTF-16 surrogate (escaped or as bytes) is valid JSON but no text: a 400 naming the field."""
    with pytest.raises(BadRequest, match="surrogate") as err:
        parse_json(raw, JSON)
    assert err.value.param == param


def test_parse_json_keeps_surrogate_pairs():
    """A proper surrogate pair is an ordinary character, not refused."""
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}', JSON) == {"prompt": "\U0001f600"}
