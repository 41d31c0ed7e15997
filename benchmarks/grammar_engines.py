"""xgrammar vs llguidance on SmolLM2's tokenizer: compile time, per-row mask time, schema coverage (BENCHMARKS.md,
"Structured output"; how the grammar engine was chosen). Needs xgrammar, which tokenmill does not depend on:

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi && python benchmarks/grammar_engines.py
"""
import json
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer

hf = Tokenizer.load(default_model_path()).hf_tokenizer
V = 49152
SCHEMAS = {
 "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
 "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
     "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
     "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["id", "tags"]}, "score": {"type": "number"}}, "required": ["user"]},
 "ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}},
         "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
}
SAMPLE = {"flat": '{"name": "Bob", "age": 42}', "nested": '{"user": {"id": 7, "tags": ["a", "ccc"], "email": "x@y.com"}, "score": 1.5}',
          "ref": '{"a": {"x": 1, "y": 2}, "b": {"x": 3.5, "y": -1}}'}
def ids(s): return hf.encode(s, add_special_tokens=False)

import xgrammar as xgr

t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V); t_info = time.perf_counter() - t
comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
print(f"xgrammar tokenizer info {t_info*1e3:.0f} ms")
for name, schema in SCHEMAS.items():
    t = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(schema)); tc = time.perf_counter() - t
    ser = cg.serialize_json(); t = time.perf_counter(); cg2 = xgr.CompiledGrammar.deserialize_json(ser, info); td = time.perf_counter() - t
    m = xgr.GrammarMatcher(cg2); bm = xgr.allocate_token_bitmask(1, V); times = []
    for tok in ids(SAMPLE[name]):
        t = time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter() - t)
        assert m.accept_token(tok), (name, tok)
    logits = torch.randn(16, V); bm16 = xgr.allocate_token_bitmask(16, V)
    t = time.perf_counter(); xgr.apply_token_bitmask_inplace(logits, bm16); ta = time.perf_counter() - t
    print(f"xgrammar {name}: compile {tc*1e3:.1f} ms, serialized {len(ser)/1e3:.0f} kB, deserialize {td*1e3:.1f} ms, "
          f"mask median {statistics.median(times)*1e6:.0f} us max {max(times)*1e6:.0f} us, apply 16 rows {ta*1e3:.2f} ms")
import llguidance
import llguidance.hf
import llguidance.torch

t = time.perf_counter(); lt = llguidance.hf.from_tokenizer(hf, n_vocab=V); t_info = time.perf_counter() - t
print(f"llguidance tokenizer {t_info*1e3:.0f} ms")
for name, schema in SCHEMAS.items():
    t = time.perf_counter(); g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    m = llguidance.LLMatcher(lt, g); tc = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    bm = llguidance.torch.allocate_token_bitmask(1, V); times = []
    for tok in ids(SAMPLE[name]):
        t = time.perf_counter(); llguidance.torch.fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter() - t)
        assert m.consume_token(tok), (name, tok, m.get_error())
    print(f"llguidance {name}: matcher {tc*1e3:.1f} ms, mask median {statistics.median(times)*1e6:.0f} us max {max(times)*1e6:.0f} us")

HARD = {
 "oneOf": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "string"}]},
 "anyOf_null": {"type": "object", "properties": {"x": {"anyOf": [{"type": "number"}, {"type": "null"}]}}},
 "minLength": {"type": "string", "minLength": 3, "maxLength": 5},
 "format_date": {"type": "string", "format": "date"},
 "exclusive": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
 "recursive": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}}, "$ref": "#/$defs/node"},
 "additional": {"type": "object", "additionalProperties": {"type": "integer"}},
 "const": {"const": "fixed"},
 "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
 "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
 "bad_type": {"type": "frobnicate"},
}
for name, s in HARD.items():
    r = []
    try:
        t = time.perf_counter(); comp.compile_json_schema(json.dumps(s), strict_mode=True); r.append(f"xgr ok {1e3*(time.perf_counter()-t):.0f}ms")
    except Exception as e:  # noqa: BLE001 - a refusal is what we measure
        r.append("xgr ERR " + str(e).splitlines()[0][:80])
    try:
        t = time.perf_counter(); g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)); m = llguidance.LLMatcher(lt, g)
        r.append(("llg ERR " + m.get_error()[:80]) if m.is_error() else f"llg ok {1e3*(time.perf_counter()-t):.0f}ms")
    except Exception as e:  # noqa: BLE001 - a refusal is what we measure
        r.append("llg EXC " + str(e).splitlines()[0][:80])
    print(name, " | ".join(r))
