"""StructuredOutputsParams (tokenmill/structured_params.py): exactly one constraint, unknown fields and bad types
refused naming the field, a schema's cache key independent of how it was given, its properties' order kept."""

from __future__ import annotations

import json

import pytest

from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_params import KINDS, MAX_SPEC_CHARS, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string", "maxLength": 3}},
          "required": ["b", "a"], "additionalProperties": False}


# ---- exactly one ---------------------------------------------------------------------------------------------


def test_none_given_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="exactly one") as e:
        StructuredOutputsParams(param="guided_x")
    assert e.value.param == "guided_x"
    assert "got none" in str(e.value)


def test_json_object_false_counts_as_not_given() -> None:
    with pytest.raises(InvalidRequest, match="got none"):
        StructuredOutputsParams(json_object=False)


@pytest.mark.parametrize("fields", [
    {"json": SCHEMA, "regex": "a+"},
    {"regex": "a+", "choice": ["a"]},
    {"choice": ["a"], "grammar": 'root ::= "a"'},
    {"grammar": 'root ::= "a"', "json_object": True},
    {"json": SCHEMA, "json_object": True, "regex": "x"},
])
def test_two_given_are_refused_naming_both(fields: dict) -> None:
    with pytest.raises(InvalidRequest, match="exactly one") as e:
        StructuredOutputsParams.from_dict(fields, param="structured_outputs")
    assert e.value.param == "structured_outputs"
    for name in fields:
        assert name in str(e.value)


@pytest.mark.parametrize("fields, kind", [
    ({"json": SCHEMA}, "json"), ({"regex": "[0-9]+"}, "regex"), ({"choice": ["x", "y"]}, "choice"),
    ({"grammar": 'root ::= "a"'}, "grammar"), ({"json_object": True}, "json_object"),
])
def test_each_kind_alone_is_accepted(fields: dict, kind: str) -> None:
    spec = StructuredOutputsParams.from_dict(fields)
    assert spec.kind == kind
    assert spec.key[0] == kind
    assert spec.param == "structured_outputs"


# ---- unknown fields and bad types ----------------------------------------------------------------------------


def test_unknown_field_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest) as e:
        StructuredOutputsParams.from_dict({"json_shema": SCHEMA}, param="structured_outputs")
    assert e.value.param == "structured_outputs"
    assert "'json_shema'" in str(e.value)
    for kind in KINDS:  # and says what is expected
        assert kind in str(e.value)


def test_unknown_field_beside_a_valid_one_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="'whitespace'"):
        StructuredOutputsParams.from_dict({"regex": "a", "whitespace": " "})


def test_from_dict_needs_an_object() -> None:
    with pytest.raises(InvalidRequest, match="must be an object") as e:
        StructuredOutputsParams.from_dict(["regex", "a"], param="structured_outputs")  # type: ignore[arg-type]
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("fields, words", [
    ({"choice": "yes"}, "choice must be a non-empty list"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["yes", 1]}, "choice must be a non-empty list"),
    ({"choice": ["yes", ""]}, "choice must be a non-empty list"),
    ({"regex": 5}, "regex must be a non-empty string"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": ["root ::= x"]}, "grammar must be a non-empty string"),
    ({"grammar": ""}, "grammar must be a non-empty string"),
    ({"json": 5}, "must be an object, got int"),
    ({"json": [SCHEMA]}, "must be an object, got list"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": '"a string"'}, "must be an object, got str"),
    ({"json_object": "yes"}, "json_object must be true or false"),
    ({"json_object": 1}, "json_object must be true or false"),
])
def test_bad_types_are_refused_naming_the_param(fields: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as e:
        StructuredOutputsParams.from_dict(fields, param="guided_thing")
    assert e.value.param == "guided_thing"
    assert str(e.value).startswith("guided_thing")


def test_oversized_specs_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="longer than"):
        StructuredOutputsParams(regex="a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(InvalidRequest, match="longer than"):
        StructuredOutputsParams(json={"type": "string", "description": "x" * MAX_SPEC_CHARS})
    StructuredOutputsParams(regex="a" * MAX_SPEC_CHARS)  # the limit itself is fine


def test_sampling_params_takes_a_dict_and_refuses_other_types() -> None:
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.structured_outputs.choice == ("a", "b")
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(structured_outputs="a+")  # type: ignore[arg-type]
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequest, match="'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a+"})


# ---- the cache key -------------------------------------------------------------------------------------------


def test_schema_as_dict_or_json_text_gives_the_same_key() -> None:
    as_dict = StructuredOutputsParams(json=SCHEMA)
    spaced = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=4))
    compact = StructuredOutputsParams(json=json.dumps(SCHEMA, separators=(",", ":")))
    assert as_dict.key == spaced.key == compact.key
    assert as_dict.json == spaced.json  # stored as compact text either way
    assert isinstance(as_dict.json, str) and json.loads(as_dict.json) == SCHEMA
    assert as_dict == spaced and hash(as_dict) == hash(spaced)  # usable as a dict key itself


def test_key_order_of_properties_is_kept() -> None:
    """The output writes properties in the schema's order: two orders are two grammars, two keys."""
    spec = StructuredOutputsParams(json=SCHEMA)
    assert list(json.loads(spec.json)["properties"]) == ["b", "a"]
    assert spec.json.index('"b"') < spec.json.index('"a"')
    reordered = {**SCHEMA, "properties": {"a": SCHEMA["properties"]["a"], "b": SCHEMA["properties"]["b"]}}
    other = StructuredOutputsParams(json=json.dumps(reordered))
    assert list(json.loads(other.json)["properties"]) == ["a", "b"]
    assert other.key != spec.key


def test_keys_tell_kinds_and_values_apart() -> None:
    keys = {
        StructuredOutputsParams(regex="a").key,
        StructuredOutputsParams(grammar="a").key,
        StructuredOutputsParams(choice=["a"]).key,
        StructuredOutputsParams(choice=["a", "b"]).key,
        StructuredOutputsParams(choice=["ab"]).key,
        StructuredOutputsParams(json_object=True).key,
    }
    assert len(keys) == 6
    assert StructuredOutputsParams(choice=["x", "y"]).key == StructuredOutputsParams(choice=("x", "y")).key
    assert StructuredOutputsParams(choice=["x", "y"]).key != StructuredOutputsParams(choice=["y", "x"]).key


def test_choice_key_is_unambiguous() -> None:
    """Bug (tokenmill/structured_params.py `key`): choices are joined with NUL, so a choice holding NUL and the
    choices it splits into share a key, and so a compiled grammar in the cache."""
    assert StructuredOutputsParams(choice=["a\x00b"]).key != StructuredOutputsParams(choice=["a", "b"]).key


def test_param_does_not_change_the_key() -> None:
    """The same constraint from two request fields compiles once."""
    a = StructuredOutputsParams(regex="[0-9]+", param="guided_regex")
    b = StructuredOutputsParams(regex="[0-9]+", param="structured_outputs")
    assert a.key == b.key


def test_choice_list_becomes_a_tuple() -> None:
    spec = StructuredOutputsParams(choice=["yes", "no"])
    assert spec.choice == ("yes", "no")
    hash(spec)  # frozen and hashable, even though a list was given


def test_objects_that_name_their_properties_are_closed_unless_they_say_otherwise():
    from tokenmill.structured_params import close_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True},
                                               "fixed": {"const": {"properties": {}}}},
              "$defs": {"d": {"properties": {"b": {}}}}, "anyOf": [{"properties": {}}]}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in closed["properties"]  # the name map itself is left alone
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["fixed"] == {"const": {"properties": {}}}  # values are not schemas
    assert closed["$defs"]["d"]["additionalProperties"] is False and closed["anyOf"][0]["additionalProperties"] is False
    assert close_objects({"type": "object", "patternProperties": {"^x": {}}}) == {
        "type": "object", "patternProperties": {"^x": {}}}
