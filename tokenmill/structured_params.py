"""What a request asks its output to follow (vLLM's `structured_outputs`), checked once at the edge. Plain Python:
the API process, the offline engine and the engine core all read it; only the backend (structured/backend.py)
knows the grammar engine.

Exactly one of: `json` (a JSON schema: a dict or its JSON text), `regex`, `choice` (a list of strings, the output
is one of them), `grammar` (EBNF as xgrammar reads it, GBNF-like: `root ::= ...`) or `json_object` (any JSON
object, the OpenAI `{"type": "json_object"}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequest

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar this large is a mistake or an attack: refused before compiling


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise InvalidRequest(f"{self.param}: give exactly one of {', '.join(KINDS)} (got {what})",
                                 param=self.param)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json, self.param))
        if self.regex is not None:
            self._check_text(self.regex, "regex")
        if self.grammar is not None:
            self._check_text(self.grammar, "grammar")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise InvalidRequest(f"{self.param}.choice must be a non-empty list of non-empty strings",
                                     param=self.param)
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(f"{self.param}.json_object must be true or false", param=self.param)

    @classmethod
    def from_dict(cls, fields: dict, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's object; unknown fields are refused (a typo would otherwise constrain nothing)."""
        if not isinstance(fields, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise InvalidRequest(f"{param}: unknown field {unknown[0]!r}; expected one of {', '.join(KINDS)}",
                                 param=param)
        return cls(**fields, param=param)

    def _check_text(self, value: Any, name: str) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{self.param}.{name} must be a non-empty string", param=self.param)
        if len(value) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"{self.param}.{name} is longer than {MAX_SPEC_CHARS} characters", param=self.param)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: the compile cache's key."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, json.dumps(list(value)) if kind == "choice" else str(value)


# what clients send most, whose grammar is known to build: checked (API process) and built (engine) before any
# request waits for it, so a busy CPU never fails one
COMMON_CONSTRAINTS = (StructuredOutputsParams(json_object=True),)

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYS = ("const", "enum", "default", "examples")  # values, not schemas


def close_objects(schema: Any) -> Any:
    """The schema with every object that names its properties but says nothing of others closed
    (`additionalProperties: false`), as vLLM's default (xgrammar's strict mode) reads schemas: a small model left
    free to add keys often never stops adding them (pydantic's schemas leave objects open)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas: a property may be named anything
            out[key] = {name: close_objects(s) for name, s in value.items()}
        else:
            out[key] = value if key in _DATA_KEYS else close_objects(value)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema as compact JSON text (one cache entry however the client spaced it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
    text = json.dumps(close_objects(schema), separators=(",", ":"))  # key order kept: properties are written in it
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"{param}: the JSON schema is longer than {MAX_SPEC_CHARS} characters", param=param)
    return text
