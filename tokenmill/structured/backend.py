"""The grammar engine behind structured output: llguidance. A constraint becomes a grammar (Lark-like text), a matcher
walks it per request: each step it writes the request's row of the allowed-token bitmask and consumes the sampled
token. Masks are computed lazily, token by token, under llguidance's own per-step limits (lexer fuel, Earley
items), so no schema can stall a step however it is written.

Why llguidance and not xgrammar (measured on SmolLM2's tokenizer, BENCHMARKS.md "Structured output"): both build
typical schemas in 1-6 ms and cover the same keywords, but checking a constraint needs neither torch nor the
tokenizer with llguidance, so the API process (which never loads torch) answers a bad schema with 400 before
anything is queued; the engine builds a matcher from the grammar text in ~1 ms instead of receiving a serialized
40-130 kB token automaton per sample; and a keyword it cannot enforce (`uniqueItems`) is refused, not silently
ignored. xgrammar's masks are faster (1-3 us a row against 12-28 us), a cost of ~0.3 ms a step at 16 rows.

Building is not lazy: an extreme schema (an allOf of anyOfs, whose product llguidance expands) costs seconds of CPU
before llguidance's size limits stop it, and a build cannot be interrupted. So the server checks clients'
constraints in worker processes it kills at the time limit (structured/checker.py), and the engine builds matchers
on a small pool, a grammar built (or failed) once answered at once after (structured/manager.py).

This module imports torch only for the bitmask tensors (engine side); `grammar_text` and `check` do not.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from tokenmill.errors import InvalidRequest
from tokenmill.structured_params import StructuredOutputsParams

CACHE_ENTRIES = 256
Checked = tuple[str | None, str | None]  # (grammar text, None) or (None, why it is refused)
# JSON output without free whitespace: what a model writes is what the schema allows, and no token is spent on
# runs of spaces (a small model left free to pad often never closes the object)
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint as llguidance grammar text (cheap; does not check it)."""
    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(_as_lark(spec.grammar))


_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _as_lark(grammar: str) -> str:
    """EBNF in the GBNF style (rules `name ::= ...`, as vLLM's and llama.cpp's users write it) or Lark (`start: ...`;
    a `::=` inside a Lark string literal does not make it GBNF)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(grammar) if _GBNF_RULE.search(grammar) else grammar


class GrammarCache:
    """Constraint -> checked grammar text, or the reason it is refused; a bounded LRU shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Checked] = OrderedDict()

    def check(self, spec: StructuredOutputsParams) -> str:
        """The grammar text of a usable constraint; InvalidRequest naming the field otherwise. Checked here, with
        no time limit (a trusted caller's own constraint; the server checks clients' in structured/checker.py)."""
        hit = self.get(spec.key)
        if hit is None:
            hit = self.put(spec.key, _checked(spec))
        return answer(spec, hit)

    def get(self, key: tuple[str, str]) -> Checked | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple[str, str], hit: Checked) -> Checked:
        with self._lock:
            self._entries[key] = hit
            if len(self._entries) > CACHE_ENTRIES:
                self._entries.popitem(last=False)
        return hit


def answer(spec: StructuredOutputsParams, hit: Checked) -> str:
    """A check's outcome for the caller: the grammar text, or InvalidRequest naming the field."""
    grammar, error = hit
    if error is not None:
        raise InvalidRequest(f"{spec.param}: the {_what(spec)} is not usable: {error}", param=spec.param)
    return grammar


def _checked(spec: StructuredOutputsParams) -> Checked:
    """Compile and validate the constraint: up to a few seconds of CPU for an extreme one, within llguidance's
    limits."""
    try:
        grammar = grammar_text(spec)
    except Exception as e:  # noqa: BLE001 - the converters raise bare Exceptions for the client's grammar
        return None, _first_line(str(e) or type(e).__name__)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return (None, _first_line(error)) if error else (grammar, None)


def _first_line(text: str) -> str:
    """The engine's message on one line (a regex error's caret diagram folded in, a panic's backtrace left out), at
    most 500 characters."""
    lines = [line.strip() for line in text.split("<backtrace>")[0].strip().splitlines() if line.strip()]
    return " ".join(lines)[:500] if lines else "rejected"


def _what(spec: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[spec.kind]


class MatcherFactory:
    """Engine side: matchers for one tokenizer, one template per grammar (LRU) deep-copied per request. A grammar
    that fails to build is remembered too, so sending it again costs nothing."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # grammar -> template or error

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; ValueError if the grammar does not build (a limit hit)."""
        built = self.cached(grammar)
        if built is not None:
            return built
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            error = _first_line(template.get_error())
            self._remember(grammar, error)
            raise ValueError(error)
        self._remember(grammar, template)
        return template.deep_copy()

    def cached(self, grammar: str) -> llguidance.LLMatcher | None:
        """A fresh matcher if the grammar's template is built (microseconds: no need to queue for a builder),
        ValueError if it failed to, None if it was never built (or has left the LRU)."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
        if isinstance(template, str):
            raise ValueError(template)
        return None if template is None else template.deep_copy()

    def _remember(self, grammar: str, template: llguidance.LLMatcher | str) -> None:
        with self._lock:
            self._templates[grammar] = template
            if len(self._templates) > CACHE_ENTRIES:
                self._templates.popitem(last=False)
