"""Structured output over HTTP: how request bodies map to one constraint (protocol.py, no server), then against a
real `tokenmill serve` with SmolLM2 (tests/server/conftest.py): the `openai` client's `parse` with a pydantic
model, response_format json_object and json_schema (streamed too), vLLM's guided_* and structured_outputs on
/v1/completions, and 400s with OpenAI's error body naming the field for every refused constraint."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import start_server
from tokenmill.errors import InvalidRequest
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "Give the capital of France as JSON."}]
PROMPT = "The capital of France is"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "population_millions": {"type": "integer", "minimum": 0,
                                                                        "maximum": 100}},
               "required": ["city", "population_millions"], "additionalProperties": False}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


# ---- request bodies (no server) ------------------------------------------------------------------------------


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=CHAT, **fields)


def test_response_format_json_schema_maps_to_json() -> None:
    spec = _chat(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}
                 ).structured()
    assert spec.kind == "json" and json.loads(spec.json) == CITY_SCHEMA
    assert spec.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs"),
    ({"guided_json": CITY_SCHEMA}, "json", "guided_json"),
    ({"guided_json": json.dumps(CITY_SCHEMA)}, "json", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
])
def test_each_field_maps_to_its_constraint(fields: dict, kind: str, param: str) -> None:
    spec = CompletionRequest(prompt=PROMPT, **fields).structured()
    assert spec.kind == kind and spec.param == param


def test_text_or_nothing_is_no_constraint() -> None:
    assert _chat().structured() is None
    assert _chat(response_format={"type": "text"}).structured() is None
    assert _chat().to_params(49152).structured_outputs is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "frob"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_refused_bodies_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        _chat(**fields).to_params(49152)
    assert e.value.param == param


# ---- a real server -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "8")
    try:
        yield s
    finally:
        s.stop()


def complete(http: httpx.Client, server, **fields) -> httpx.Response:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **fields}
    return http.post("/v1/completions", json=body)


def assert_400(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value"
    assert error["param"] == param
    assert error["message"].startswith(param)
    for w in words:
        assert w in error["message"]


@pytest.mark.slow
def test_openai_parse_returns_the_pydantic_object(client, server) -> None:
    r = client.beta.chat.completions.parse(model=server.model, messages=CHAT, response_format=City, temperature=0,
                                           max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed
    assert list(json.loads(choice.message.content)) == list(City.model_fields)  # in the schema's order


@pytest.mark.slow
def test_response_format_json_object_gives_json(client, server) -> None:
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Describe a cat."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
def test_streamed_json_schema_joins_into_valid_json(client, server) -> None:
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Name a big city."}], stream=True, temperature=0,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True,
                                                                               "schema": CITY_SCHEMA}})
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    assert len([d for d in deltas if d]) > 1  # it did stream
    jsonschema.validate(json.loads("".join(deltas)), CITY_SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("fields, check", [
    ({"guided_choice": ["Paris", "London", "Berlin"]}, lambda t: t in ("Paris", "London", "Berlin")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r" [A-Z][a-z]{2,9}\."}, lambda t: re.fullmatch(r" [A-Z][a-z]{2,9}\.", t)),
    ({"structured_outputs": {"json": CITY_SCHEMA}, "max_tokens": 40},
     lambda t: jsonschema.validate(json.loads(t), CITY_SCHEMA) is None),
])
def test_completions_follow_the_constraint(http, server, fields: dict, check) -> None:
    r = complete(http, server, n=2, seed=1, **{"temperature": 0.7, **fields})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c in choices:
        assert c["finish_reason"] == "stop", c
        assert check(c["text"]), c["text"]


@pytest.mark.slow
def test_invalid_schema_is_a_400_naming_the_param(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    assert e.value.status_code == 400
    assert e.value.param == "response_format.json_schema.schema"
    assert e.value.code == "invalid_value"
    assert "frob" in e.value.message


@pytest.mark.slow
@pytest.mark.parametrize("fields, param, words", [
    ({"guided_regex": "(ab"}, "guided_regex", ["regex is not usable", "unclosed group"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", ["JSON schema is not usable", "frob"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     ["'schema'"]),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a", "b"]}, "guided_choice", ["only one", "guided_regex"]),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     ["only one", "response_format"]),
    ({"structured_outputs": {"jsn": {"type": "object"}}}, "structured_outputs", ["'jsn'"]),
    ({"response_format": {"type": "frob"}}, "response_format.type", ["'frob'"]),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", ["uniqueItems"]),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", ["nowhere"]),
])
def test_refused_constraints_are_400s_naming_the_param(http, server, fields: dict, param: str,
                                                       words: list[str]) -> None:
    assert_400(complete(http, server, **fields), param, *words)


@pytest.mark.slow
def test_bad_gbnf_grammar_is_a_400_not_a_500(http, server) -> None:
    """Bug (tokenmill/structured/backend.py `_checked`): an unreadable GBNF grammar raises a non-ValueError from
    llguidance's converter, which the server answers with 500 "internal error" instead of a 400 naming the field."""
    assert_400(complete(http, server, guided_grammar="root ::= undefined_rule"), "guided_grammar", "undefined_rule")
    assert_400(complete(http, server, guided_grammar="root ::= 'quoted'"), "guided_grammar")


@pytest.mark.slow
def test_the_server_still_serves_after_refusals(http, server) -> None:
    assert complete(http, server, guided_regex="(ab").status_code == 400
    r = complete(http, server, guided_regex="[0-9]{2}")
    assert r.status_code == 200 and re.fullmatch("[0-9]{2}", r.json()["choices"][0]["text"])
