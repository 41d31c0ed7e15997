"""Constraints that are slow to compile with llguidance: an allOf of two anyOfs of objects, which llguidance
expands into their product (60 x 60 objects of 10 patterned properties each). Checking one takes about 2 s of CPU,
building its matcher about 3 s (and then fails: the product is past llguidance's symbol limit), against a few
milliseconds for a usual schema; a `tag` makes each a new constraint, so no cache answers it."""

from __future__ import annotations

from tokenmill.structured.backend import grammar_text
from tokenmill.structured_params import StructuredOutputsParams


def slow_schema(tag: str, width: int = 60) -> dict:
    def alternative(i: int) -> dict:
        return {"type": "object",
                "properties": {f"k{q}_{tag}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + q + 30}}}$"}
                               for q in range(10)}}

    return {"allOf": [{"anyOf": [alternative(i) for i in range(width)]} for _ in range(2)]}


def slow_spec(tag: str, width: int = 60) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=slow_schema(tag, width))


def slow_grammar(tag: str, width: int = 60) -> str:
    """The grammar text the engine receives (not checked: cheap to make)."""
    return grammar_text(slow_spec(tag, width))
