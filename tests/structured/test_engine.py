"""Structured output through the offline engine on a tiny random model. Its choices are arbitrary, which stresses
the mask: whatever it prefers, every output must follow its constraint. JSON schemas here bound their output
(maxLength, minimum/maximum, enums, maxItems, additionalProperties false), so each request must end by itself
("stop") well before max_tokens, greedy or sampled, alone or in a batch, with or without speculative decoding."""

from __future__ import annotations

import json
import os
import re
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema
import pytest
import torch

from tests.models.tiny import EOS_ID, make_tiny_model
from tests.structured.grammars import slow_schema
from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.structured.backend import MatcherFactory
from tokenmill.structured.manager import StructuredOutputs

KV = 32 << 20
MAX_TOKENS = 160  # far above what any constraint below allows: reaching it means the grammar did not end
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["Hello", '{"a": 1, "b": [1, 2], "name": "abc"} {"a": 1, "b": [1, 2], "name": "abc"} {"a":']


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(properties: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = {
    "string_max_length": _obj({"name": {"type": "string", "maxLength": 6}}),
    "string_min_max_length": _obj({"code": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "integer_range": _obj({"n": _int(-5, 300), "m": _int(10, 12)}),
    "enum_and_boolean": _obj({"color": {"enum": ["red", "green", "light blue"]}, "ok": {"type": "boolean"},
                              "none": {"type": "null"}}),
    "const": _obj({"version": {"const": "v1"}, "k": _int(0, 3)}),
    "array_min_max_items": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 4},
    "array_of_enums": _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                     "maxItems": 3}}),
    "nested_objects": _obj({"user": _obj({"id": _int(0, 99), "tags": {"type": "array", "maxItems": 2,
                                                                       "items": {"type": "string", "maxLength": 3}},
                                          "address": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    "required_and_optional": _obj({"a": _int(0, 9), "b": {"type": "string", "maxLength": 4},
                                   "c": {"type": "boolean"}, "d": _int(1, 2)}, required=["a", "c"]),
    "ref": {"$defs": {"pt": _obj({"x": _int(0, 9), "y": _int(0, 9)})}, **_obj({"p": {"$ref": "#/$defs/pt"},
                                                                               "q": {"$ref": "#/$defs/pt"}})},
    "any_of": _obj({"v": {"anyOf": [_int(0, 9), {"type": "string", "maxLength": 3}, {"type": "null"}]}}),
    "top_level_string_pattern": {"type": "string", "pattern": "^[a-z]{2,4}$"},
}


# ---- fixtures and helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    """One compute thread for the engines here (tests/spec/test_speculation.py says why); restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("structured"), arch="llama", num_heads=4, num_kv_heads=2)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", KV)
    return LLM(str(path), dtype="float32", num_threads=1, **kw)


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return make_llm(tiny_dir)


def generate(llm: LLM, prompts, params):
    out = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.core.check_idle_invariants()  # every request's matcher released, every block free
    return out


def sampled_params(constraint: dict, **kw) -> list[SamplingParams]:
    """Greedy, then seeded sampling with n=3, each ending by itself before MAX_TOKENS."""
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint, **kw),
            SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=MAX_TOKENS, structured_outputs=constraint,
                           **kw)]


def run_all(llm: LLM, constraint: dict) -> list:
    """Every prompt greedy and with n=3 seeded samples: 8 completions."""
    params = sampled_params(constraint)
    outputs = generate(llm, [p for p in PROMPTS for _ in params], params * len(PROMPTS))
    assert [len(o.outputs) for o in outputs] == [1, 3] * len(PROMPTS)
    return completions(outputs)


def completions(outputs) -> list:
    return [c for o in outputs for c in o.outputs]


def assert_valid_json(schema: dict, done: list) -> list:
    """Each completion ended by itself and is a JSON value the schema accepts; the values."""
    values = []
    for c in done:
        assert c.finish_reason == "stop", f"did not end by itself: {c.text!r}"
        assert len(c.token_ids) < MAX_TOKENS
        value = json.loads(c.text)
        jsonschema.validate(value, schema)
        values.append(value)
    return values


# ---- JSON schemas --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    values = assert_valid_json(schema, run_all(llm, {"json": schema}))
    assert len(values) == 8


def test_json_schema_given_as_text_gives_the_same_output(llm: LLM) -> None:
    schema = SCHEMAS["nested_objects"]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": s})
              for s in (schema, json.dumps(schema, indent=2))]
    a, b = generate(llm, [PROMPTS[0]] * 2, params)
    assert a.outputs[0].text == b.outputs[0].text
    jsonschema.validate(json.loads(a.outputs[0].text), schema)


def test_properties_come_in_the_schema_order(llm: LLM) -> None:
    schema = _obj({"zeta": _int(0, 9), "alpha": {"type": "boolean"}, "mid": {"enum": ["x", "y"]}})
    outputs = generate(llm, PROMPTS, sampled_params({"json": schema})[0])
    for value in assert_valid_json(schema, completions(outputs)):
        assert list(value) == ["zeta", "alpha", "mid"]


def test_json_object_gives_a_json_object(llm: LLM) -> None:
    """Any object: the random model may keep writing it, so only the ones that end are parsed."""
    outputs = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=24, structured_outputs={
        "json_object": True}))
    for c in completions(outputs):
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 24


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=MAX_TOKENS,
                            structured_outputs={"json": SCHEMAS["ref"]})
    first = [c.token_ids for c in completions(generate(llm, PROMPTS[:1], params))]
    again = [c.token_ids for c in completions(generate(llm, PROMPTS[:1], params))]
    assert first == again


# ---- regex, choice, grammar --------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", [
    r"[a-z]{2,5}-[0-9]{3}",
    r"\d{4}-\d{2}-\d{2}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}\.",
    r"0x[0-9a-f]{1,8}",
])
def test_regex_outputs_fullmatch(llm: LLM, pattern: str) -> None:
    for c in run_all(llm, {"regex": pattern}):
        assert c.finish_reason == "stop" and len(c.token_ids) < MAX_TOKENS
        assert re.fullmatch(pattern, c.text), (pattern, c.text)


def test_choice_outputs_are_one_of_the_choices(llm: LLM) -> None:
    choices = ["red", "green", "blue", "blue green", "purple rain", "42"]
    done = run_all(llm, {"choice": choices})
    texts = [c.text for c in done]
    assert set(texts) <= set(choices), texts
    assert all(c.finish_reason == "stop" for c in done)


@pytest.mark.parametrize("grammar", [
    'root ::= num (op num)?\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?',  # GBNF
    'start: num (op num)?\nop: "+" | "-" | "*"\nnum: /[1-9][0-9]?/',  # Lark
])
def test_ebnf_grammar_outputs_follow_it(llm: LLM, grammar: str) -> None:
    for c in run_all(llm, {"grammar": grammar}):
        assert c.finish_reason == "stop"
        assert re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?)?", c.text), c.text


# ---- batches -------------------------------------------------------------------------------------------------


def test_mixed_batch_leaves_unconstrained_requests_as_they_are_alone(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [c.token_ids for c in completions(generate(llm, PROMPTS, free))]
    schema = SCHEMAS["nested_objects"]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": schema}), free,
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"regex": "[a-z]{3,9}"}),
              free, SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, structured_outputs={
                  "choice": ["a", "b"]})]
    mixed = generate(llm, prompts, params)
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), schema)
    assert re.fullmatch("[a-z]{3,9}", mixed[2].outputs[0].text)
    assert mixed[4].outputs[0].text in ("a", "b")
    # and the constrained request itself is the same alone as in the batch
    solo = generate(llm, PROMPTS[:1], params[0])
    assert solo[0].outputs[0].token_ids == mixed[0].outputs[0].token_ids


def test_mask_changes_the_output(llm: LLM) -> None:
    """The constraint is applied: the unconstrained greedy output is not valid for the regex."""
    free = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert not re.fullmatch(r"[0-9]{3}", free)
    constrained = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8,
                                                            structured_outputs={"regex": "[0-9]{3}"}))
    assert re.fullmatch(r"[0-9]{3}", constrained[0].outputs[0].text)


# ---- speculative decoding ------------------------------------------------------------------------------------


def test_speculative_decoding_keeps_outputs_valid_and_lossless(tiny_dir, llm: LLM,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts from prompt lookup (the JSON-like prompt offers many) are masked row by row; greedy constrained
    output is token for token what decoding without speculation gives."""
    spec = make_llm(tiny_dir, speculative_config=SPEC)
    spec.engine.core.speculator.cost = None  # speculate whatever the measured step cost says
    drafted = {"all_allowed": 0, "some_forbidden": 0}  # constrained requests' drafted steps, by the mask's rows
    real = StructuredOutputs.bitmask

    def bitmask(self, spans):
        masks = real(self, spans)
        if masks is not None:
            rows, row = set(masks[1]), 0
            for rid, drafts in spans:
                if rid in self and drafts:
                    masked = sum(r in rows for r in range(row, row + 1 + len(drafts)))
                    drafted["all_allowed" if masked == 1 + len(drafts) else "some_forbidden"] += 1
                row += 1 + len(drafts)
        return masks

    monkeypatch.setattr(StructuredOutputs, "bitmask", bitmask)
    names = ["nested_objects", "ref", "required_and_optional", "array_of_enums"]
    prompts = [p for _ in names for p in PROMPTS]
    for sampled in (False, True):
        params = [SamplingParams(temperature=1.0 if sampled else 0, seed=9 if sampled else None, n=2 if sampled else 1,
                                 max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS[name]})
                  for name in names for _ in PROMPTS]
        with_spec = generate(spec, prompts, params)
        for name, out in zip([n for n in names for _ in PROMPTS], with_spec):
            assert_valid_json(SCHEMAS[name], out.outputs)
        without = generate(llm, prompts, params)
        assert [c.token_ids for c in completions(with_spec)] == [c.token_ids for c in completions(without)]
    stats = spec.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0  # the constrained requests were speculated on
    assert stats.num_accepted_tokens > 0
    assert drafted["all_allowed"] > 0 and drafted["some_forbidden"] > 0, drafted  # both paths were taken
    pattern = r"\{\"a\": [0-9], \"b\": \[[0-9](, [0-9]){0,3}\]\}"  # what the prompt repeats: drafts are right
    regex = generate(spec, PROMPTS, sampled_params({"regex": pattern}))
    assert len(completions(regex)) == 4
    for c in completions(regex):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text


def test_preemption_keeps_the_grammar_in_step(tiny_dir, llm: LLM) -> None:
    """A preempted constrained request recomputes its KV; its matcher stays where its output is: the same
    output as without preemption."""
    per_token = llm.engine.core.cache_info.kv_bytes_per_token
    small = make_llm(tiny_dir, block_size=8, kv_cache_memory=16 * 8 * per_token, new_token_ratio=0)
    prompts = [PROMPTS[1]] * 3 + [PROMPTS[0] + " x" * i for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMAS["nested_objects"]})
    ref = generate(llm, prompts, params)
    outs = generate(small, prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [c.token_ids for c in completions(outs)] == [c.token_ids for c in completions(ref)]
    assert_valid_json(SCHEMAS["nested_objects"], completions(outs))


# ---- ends and failures -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraint", [{"choice": ["yes", "no"]}, {"regex": "[0-9]{3}"},
                                        {"json": SCHEMAS["integer_range"]}])
def test_ignore_eos_ends_when_the_grammar_ends(llm: LLM, constraint: dict) -> None:
    outputs = generate(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                    structured_outputs=constraint))
    for c in completions(outputs):
        assert c.finish_reason == "stop", c
        assert len(c.token_ids) < 64
        assert c.token_ids[-1] == EOS_ID  # the EOS the grammar left as the only choice; its text hidden
        assert "<|im_end|>" not in c.text
        assert c.text and not c.text.endswith("<|im_end|>")
    texts = [c.text for c in completions(outputs)]
    if "choice" in constraint:
        assert set(texts) <= {"yes", "no"}
    elif "regex" in constraint:
        assert all(re.fullmatch("[0-9]{3}", t) for t in texts)
    else:
        for t in texts:
            jsonschema.validate(json.loads(t), constraint["json"])


def test_stop_string_ends_a_constrained_request_and_releases_its_matcher(llm: LLM) -> None:
    schema = SCHEMAS["integer_range"]
    full = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     structured_outputs={"json": schema}))[0].outputs[0].text
    assert '"m"' in full
    out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=['"m"'],
                                                    structured_outputs={"json": schema}))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"m"'
    assert out.text == full[:full.index('"m"')]
    assert len(llm.engine.core.constrained.manager) == 0  # generate() also checked every block is free


def test_abort_while_waiting_for_the_matcher_leaves_no_state(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    gate = threading.Event()
    real = MatcherFactory.matcher

    def slow(self, grammar):
        gate.wait(10)
        return real(self, grammar)

    monkeypatch.setattr(MatcherFactory, "matcher", slow)
    pattern = "[b-y]{4}"  # built by no other test: a template built before would skip the (patched) build
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2, structured_outputs={"regex": pattern})
        engine.add_request("waiting", PROMPTS[0], params)
        assert engine.core.constrained.manager is not None and engine.core.constrained.manager.num_pending == 2
        engine.step()  # the matchers are not built: nothing is scheduled, nothing waits on the step
        assert engine.core.constrained.manager.num_pending == 2
        out = engine.abort_request("waiting")
        assert out is not None and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
        assert not engine.has_unfinished_requests()
        engine.core.check_idle_invariants()
    finally:
        gate.set()
    for _ in range(3):  # the builds finish after the abort: nothing comes back from them
        assert engine.step() == []
    engine.core.check_idle_invariants()
    assert engine.core.constrained.manager.num_pending == 0 and len(engine.core.constrained.manager) == 0
    out = generate(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    structured_outputs={"regex": pattern}))
    assert re.fullmatch(pattern, out[0].outputs[0].text)


def test_abort_of_a_running_constrained_request_releases_its_matcher(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("running", PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            structured_outputs={"regex": "[a-z]{40}"}))
    for _ in range(50):  # until its matcher is built and it has run a step or two
        engine.step()
        if engine.core.constrained.manager is not None and len(engine.core.constrained.manager) == 1:
            break
    assert len(engine.core.constrained.manager) == 1
    engine.step()
    engine.abort_request("running")
    engine.core.check_idle_invariants()


def test_a_grammar_that_fails_to_build_ends_its_request_with_an_error(llm: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self, grammar):
        raise ValueError("too many Earley items")

    monkeypatch.setattr(MatcherFactory, "matcher", broken)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=8, n=2, structured_outputs={"regex": "[0-9]+"})
    outputs = generate(llm, [PROMPTS[0], PROMPTS[0]], [free, bad])
    assert outputs[0].outputs[0].finish_reason == "length" and len(outputs[0].outputs[0].token_ids) == 8
    for c in outputs[1].outputs:
        assert c.finish_reason == "error"
        assert c.token_ids == []
        assert "too many Earley items" in (c.error or "")


def test_a_slow_grammar_does_not_hold_up_a_simple_one(llm: LLM) -> None:
    """A grammar that takes a builder for a second or more: a simple constrained request sent after it is built,
    runs and finishes meanwhile; the slow one then ends with its build's error, leaving nothing behind."""
    engine = llm.engine
    slow = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"json": slow_schema("engine", width=40)})
    simple = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"regex": "[0-9]{3}"})
    engine.add_request("slow", PROMPTS[0], slow)
    engine.add_request("simple", PROMPTS[0], simple)
    done = run_until(engine, "simple")
    assert re.fullmatch("[0-9]{3}", done["simple"].outputs[0].text)
    assert "slow" not in done and engine.core.constrained.manager.num_pending == 1  # still building
    c = run_until(engine, "slow")["slow"].outputs[0]
    assert c.finish_reason == "error" and c.token_ids == []
    assert (c.error or "").startswith("structured output: ")
    engine.core.check_idle_invariants()


def run_until(engine, request_id: str) -> dict:
    """Step until `request_id` finished; the requests that finished meanwhile, by id."""
    done = {}
    deadline = time.monotonic() + 60
    while request_id not in done:
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return done


def test_a_token_the_grammar_refuses_ends_the_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """`advance` says "error" (the matcher refused a sampled token: an engine bug): the request ends there, not at
    max_tokens, and its matcher is released; the other requests go on."""
    monkeypatch.setattr(StructuredOutputs, "advance", lambda self, rid, tokens: "error" if rid in self else None)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, structured_outputs={"regex": "[a-z]{30}"})
    outputs = generate(llm, [PROMPTS[0], PROMPTS[0]], [free, bad])
    assert len(outputs[0].outputs[0].token_ids) == 8
    c = outputs[1].outputs[0]
    assert len(c.token_ids) == 1
    assert c.finish_reason in ("stop", "error")


def test_invalid_constraint_is_refused_before_queueing(llm: LLM) -> None:
    with pytest.raises(InvalidRequest) as e:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs={"regex": "(ab"}), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequest) as e:
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}}),
                     use_tqdm=False)
    assert "uniqueItems" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_idle_invariants()
