"""The llguidance backend (tokenmill/structured/backend.py): constraints checked once each (an LRU shared by
requests), every refusal an InvalidRequest naming the request field, GBNF and Lark grammars both read, no torch
on the checking side, and matchers for one tokenizer built once per grammar and copied per request."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache

import llguidance
import pytest

from tests.models.tiny import EOS_ID, SMOLLM2_VOCAB, smollm2_tokenizer
from tokenmill.errors import InvalidRequest
from tokenmill.structured import backend
from tokenmill.structured.backend import GrammarCache, MatcherFactory, grammar_text
from tokenmill.structured_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every constraint the cache actually compiles, by key."""
    calls: list[tuple[str, str]] = []
    real = backend._checked

    def checked(spec: StructuredOutputsParams):
        calls.append(spec.key)
        return real(spec)

    monkeypatch.setattr(backend, "_checked", checked)
    return calls


@lru_cache(maxsize=1)
def _factory() -> MatcherFactory:
    return MatcherFactory(smollm2_tokenizer(), SMOLLM2_VOCAB)


def _grammar_allows(grammar: str, text: str) -> bool:
    """Whether `grammar` accepts exactly `text` (by the matcher's own tokenization)."""
    tok = smollm2_tokenizer()
    m = _factory().matcher(grammar)
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


# ---- the cache -------------------------------------------------------------------------------------------------


def test_same_spec_is_checked_once(counted: list) -> None:
    cache = GrammarCache()
    first = cache.check(StructuredOutputsParams(json=SCHEMA, param="response_format.json_schema.schema"))
    # the same schema as JSON text, from another field: the same entry
    again = cache.check(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2), param="guided_json"))
    also = cache.check(StructuredOutputsParams.from_dict({"json": SCHEMA}))
    assert first == again == also
    assert len(counted) == 1
    cache.check(StructuredOutputsParams(regex="[0-9]+"))
    cache.check(StructuredOutputsParams(regex="[0-9]+", param="guided_regex"))
    assert len(counted) == 2


def test_refusals_are_cached_too_and_name_each_callers_field(counted: list) -> None:
    cache = GrammarCache()
    for param in ("guided_regex", "structured_outputs"):
        with pytest.raises(InvalidRequest) as e:
            cache.check(StructuredOutputsParams(regex="(ab", param=param))
        assert e.value.param == param
        assert str(e.value).startswith(f"{param}: the regex is not usable")
    assert len(counted) == 1


def test_caches_are_independent(counted: list) -> None:
    spec = StructuredOutputsParams(choice=["a", "b"])
    GrammarCache().check(spec)
    GrammarCache().check(spec)
    assert len(counted) == 2


def test_least_recently_used_entry_is_evicted(counted: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "CACHE_ENTRIES", 2)
    cache = GrammarCache()
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    cache.check(a)
    cache.check(b)
    cache.check(a)  # a is now the most recent: c evicts b
    cache.check(c)
    assert len(counted) == 3
    cache.check(a)
    assert len(counted) == 3
    cache.check(b)
    assert len(counted) == 4


def test_choices_that_join_alike_are_different_entries() -> None:
    """A choice holding the key's separator must not share a cache entry with the list it splits into.

    Bug (tokenmill/structured_params.py `key`): choices are joined with NUL, so ["a\\x00b"] and ["a", "b"] get one
    key, and whichever is checked first gives its grammar to the other."""
    cache = GrammarCache()
    cache.check(StructuredOutputsParams(choice=["a\x00b"]))
    grammar = cache.check(StructuredOutputsParams(choice=["a", "b"]))
    assert _grammar_allows(grammar, "a")
    assert _grammar_allows(grammar, "b")


# ---- refusals name the field ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, what, words", [
    ({"json": {"type": "frob"}}, "JSON schema", "frob"),
    ({"json": {"type": "object", "properties": {"x": {"type": "strin"}}}}, "JSON schema", "strin"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "JSON schema", "uniqueItems"),
    ({"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}, "JSON schema", "missing"),
    ({"regex": "(ab"}, "regex", "unclosed group"),
    ({"regex": "[a-"}, "regex", "regex"),
    ({"grammar": 'start: "a" ('}, "grammar", "Expected"),
    ({"grammar": "start: undefined_rule"}, "grammar", "undefined_rule"),
])
def test_unusable_constraints_name_the_param(fields: dict, what: str, words: str) -> None:
    spec = StructuredOutputsParams.from_dict(fields, param="the.field")
    with pytest.raises(InvalidRequest) as e:
        GrammarCache().check(spec)
    assert e.value.param == "the.field"
    message = str(e.value)
    assert message.startswith(f"the.field: the {what} is not usable: ")
    assert words in message
    assert "\n" not in message and len(message) < 700  # one line, bounded


@pytest.mark.parametrize("gbnf, words", [
    ("root ::= undefined_rule", "undefined_rule"),
    ("root ::= 'single quotes'", "Expected name"),
    ('root ::= ("a"', "Expected ')'"),
    ('root ::= "a" "b', "end of input"),
])
def test_bad_gbnf_grammars_are_invalid_requests(gbnf: str, words: str) -> None:
    """A GBNF grammar llguidance's converter cannot read is the client's error: InvalidRequest naming the field.

    Bug (tokenmill/structured/backend.py `_checked`): `gbnf_to_lark` raises GbnfToLarkError or a bare Exception,
    neither a ValueError, so it escapes `check` (the server answers 500 "internal error" instead of 400)."""
    spec = StructuredOutputsParams(grammar=gbnf, param="guided_grammar")
    with pytest.raises(InvalidRequest) as e:
        GrammarCache().check(spec)
    assert e.value.param == "guided_grammar"
    assert str(e.value).startswith("guided_grammar: the grammar is not usable: ")
    assert words in str(e.value)


# ---- what is accepted ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("grammar", [
    'root ::= "yes" | "no"',  # GBNF (llama.cpp, vLLM's xgrammar users)
    'start: "yes" | "no"',  # Lark
    'root ::= answer\nanswer ::= "yes" | "no"',
    'start: answer\nanswer: "yes" | "no"',
])
def test_gbnf_root_and_lark_start_are_both_accepted(grammar: str) -> None:
    text = GrammarCache().check(StructuredOutputsParams(grammar=grammar, param="guided_grammar"))
    assert _grammar_allows(text, "yes")
    assert _grammar_allows(text, "no")
    assert not _grammar_allows(text, "maybe")


def test_lark_grammar_with_gbnf_operator_in_a_literal_is_read_as_lark() -> None:
    """A Lark grammar is one without GBNF rules, whatever its string literals hold.

    Bug (tokenmill/structured/backend.py `_as_lark`): any grammar containing "::=" is converted as GBNF, so a Lark
    grammar matching "::=" text (a grammar for BNF, say) is refused (today: an exception, not even 400)."""
    grammar = 'start: NAME "::=" NAME\nNAME: /[a-z]+/'
    text = GrammarCache().check(StructuredOutputsParams(grammar=grammar, param="guided_grammar"))
    assert _grammar_allows(text, "ab::=cd")


@pytest.mark.parametrize("fields", [
    {"json": SCHEMA},
    {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}}},
    {"json_object": True},
    {"regex": "[0-9]{3}"},
    {"choice": ['say "hi"', "a|b", "x\\y"]},
])
def test_usable_constraints_give_valid_grammar_text(fields: dict) -> None:
    spec = StructuredOutputsParams.from_dict(fields)
    text = GrammarCache().check(spec)
    assert text == grammar_text(spec)
    assert not llguidance.LLMatcher.validate_grammar(text)


def test_choices_are_literal_strings() -> None:
    """Quotes, | and backslashes in a choice are text, not grammar."""
    choices = ['say "hi"', "a|b", "x\\y"]
    text = GrammarCache().check(StructuredOutputsParams(choice=choices))
    for c in choices:
        assert _grammar_allows(text, c)
    assert not _grammar_allows(text, "a")
    assert not _grammar_allows(text, "say hi")


def test_json_output_has_no_free_whitespace() -> None:
    text = GrammarCache().check(StructuredOutputsParams(json=SCHEMA))
    assert _grammar_allows(text, '{"n":5}')
    assert not _grammar_allows(text, '{ "n": 5 }')
    assert not _grammar_allows(text, '{"n":10}')  # maximum 9


def test_checking_does_not_import_torch() -> None:
    """The API process never loads torch: checking a schema must not either."""
    code = ("import sys; from tokenmill.structured.backend import GrammarCache; "
            "from tokenmill.structured_params import StructuredOutputsParams as S; "
            "GrammarCache().check(S(json={'type': 'object'})); GrammarCache().check(S(regex='a+')); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- matchers ------------------------------------------------------------------------------------------------


def test_matcher_factory_copies_one_template_per_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = smollm2_tokenizer()
    factory = MatcherFactory(tok, SMOLLM2_VOCAB)
    grammar = GrammarCache().check(StructuredOutputsParams(regex="[0-9]{2}"))
    other = GrammarCache().check(StructuredOutputsParams(regex="[a-z]"))
    built = []
    real = llguidance.LLMatcher

    def counting(*args, **kw):
        built.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    a, b = factory.matcher(grammar), factory.matcher(grammar)
    assert len(built) == 1
    digit = tok.encode("7", add_special_tokens=False)
    assert len(digit) == 1
    assert a.consume_token(digit[0]) and a.consume_token(digit[0])
    assert a.is_stopped() or a.is_accepting()
    assert not b.is_accepting()  # the copies do not share state
    assert b.consume_token(digit[0]) and not b.is_accepting()
    c = factory.matcher(grammar)
    assert not c.is_accepting()  # the template was not advanced either
    assert len(built) == 1
    factory.matcher(other)
    assert len(built) == 2


def test_matcher_ends_with_eos_only() -> None:
    tok = smollm2_tokenizer()
    grammar = GrammarCache().check(StructuredOutputsParams(choice=["yes"]))
    m = _factory().matcher(grammar)
    assert not m.consume_token(EOS_ID)  # EOS before the grammar has ended is refused
    m = _factory().matcher(grammar)
    for t in tok.encode("yes", add_special_tokens=False):
        assert m.consume_token(t)
    assert m.is_accepting()
    assert m.consume_token(EOS_ID)
    assert m.is_stopped()
