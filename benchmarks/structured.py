"""Structured output, measured (BENCHMARKS.md "Structured output"):

    python benchmarks/structured.py --runs 3

- throughput: 16 requests at once through the offline engine, each asked for a JSON object of a given form, with
  the schema enforced on every request (greedy, at most 96 tokens) vs on none with each request held to the
  length its constrained twin wrote (`ignore_eos`, so both batches have the same shape step by step and the ratio
  is the constraint's cost alone): output tokens/s, and what the masks cost inside the steps (bitmask fill +
  apply per step, 16 rows);
- compile: per schema, checking the constraint cold and cached (the API process's work) and building a matcher
  cold and from the cached template (the engine's);
- validity: on the same "answer in this JSON form" prompts, how often the output parses and validates with and
  without the schema (a 135M model left alone often does not close the object, or invents keys).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema

from tokenmill.llm import LLM
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.backend import GrammarCache, MatcherFactory
from tokenmill.structured_params import StructuredOutputsParams

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "city": {"type": "string"}}, "required": ["name", "age", "city"]},
    "book": {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                              "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                              "genres": {"type": "array", "items": {"type": "string"},
                                                         "minItems": 1, "maxItems": 3}},
             "required": ["title", "author", "year", "genres"]},
    "weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "temperature_c": {"type": "number"},
                                                 "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}},
                "required": ["city", "temperature_c", "sky"]},
    "order": {"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                                  "qty": {"type": "integer", "minimum": 1}},
                                 "required": ["sku", "qty"]}},
              "type": "object", "properties": {"id": {"type": "integer"},
                                               "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                         "maxItems": 4}},
              "required": ["id", "items"]},
}
SUBJECTS = {"person": ["a pirate", "a chef in Rome", "a retired astronaut", "a young violinist"],
            "book": ["a mystery novel", "a cookbook", "a science fiction classic", "a children's book"],
            "weather": ["Oslo in winter", "Cairo in summer", "London in spring", "Tokyo in autumn"],
            "order": ["two keyboards and a mouse", "office chairs", "three books", "a laptop"]}


def prompts(llm: LLM) -> list[tuple[str, str]]:
    """(schema name, chat prompt text) pairs: 'answer in this JSON form'."""
    out = []
    for name, schema in SCHEMAS.items():
        for subject in SUBJECTS[name]:
            ask = (f"Describe {subject} as a JSON object following this JSON schema, and reply with the JSON "
                   f"only:\n{json.dumps(schema)}")
            out.append((name, llm.get_tokenizer().render_chat([{"role": "user", "content": ask}],
                                                              add_generation_prompt=True)))
    return out


def params(name: str | None, max_tokens: int = 96, ignore_eos: bool = False) -> SamplingParams:
    spec = {"json": SCHEMAS[name]} if name else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec, ignore_eos=ignore_eos)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def throughput(llm: LLM, work: list[tuple[str, str]], constrained: bool,
               lengths: list[int] | None = None) -> tuple[float, float, int, list[float], list[int]]:
    """tokens/s, seconds per output token, output tokens, the per-step mask times, and each output's length
    (`lengths`: unconstrained, hold each request to this many tokens)."""
    batch = (work * 2)[:16]
    core = llm.engine.core
    mask_times: list[float] = []
    if constrained:  # time the masks inside the steps: bitmask fill + apply
        so = core._structured()
        fill, apply = so.bitmask, so.apply

        def timed_fill(spans):
            t = time.perf_counter()
            out = fill(spans)
            mask_times.append(time.perf_counter() - t)
            return out

        def timed_apply(logits, bitmask, rows):
            t = time.perf_counter()
            apply(logits, bitmask, rows)
            mask_times[-1] += time.perf_counter() - t

        so.bitmask, so.apply = timed_fill, timed_apply
    start = time.perf_counter()
    sampling = ([params(n) for n, _ in batch] if constrained else
                [params(None, length, ignore_eos=True) for length in lengths])
    outs = llm.generate([p for _, p in batch], sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    if constrained:
        del so.bitmask, so.apply
    lens = [len(o.outputs[0].token_ids) for o in outs]
    return sum(lens) / seconds, seconds / max(sum(lens), 1) * 16, sum(lens), mask_times, lens


def compile_times() -> list[tuple[str, float, float, float, float]]:
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import Tokenizer

    factory = MatcherFactory(Tokenizer.load(default_model_path()).hf_tokenizer, 49152)
    rows = []
    for name, schema in SCHEMAS.items():
        cache, spec = GrammarCache(), StructuredOutputsParams(json=schema)
        t = time.perf_counter()
        grammar = cache.check(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        cache.check(spec)
        cached = time.perf_counter() - t
        t = time.perf_counter()
        factory.matcher(grammar)
        build = time.perf_counter() - t
        t = time.perf_counter()
        factory.matcher(grammar)
        copy = time.perf_counter() - t
        rows.append((name, cold, cached, build, copy))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    work = prompts(llm)
    llm.generate([work[0][1]], params(work[0][0], 8), use_tqdm=False)  # warm: kernels, tokenizer, llguidance
    free, bound, masks = [], [], []
    for run in range(args.runs):
        lengths = None
        for constrained in (True, False):
            tps, spt, tokens, mt, lengths = throughput(llm, work, constrained, lengths)
            (bound if constrained else free).append((tps, spt, tokens))
            masks += mt
            print(f"run {run + 1} {'schema' if constrained else 'free'}: {tps:.1f} tok/s, {tokens} tokens",
                  file=sys.stderr, flush=True)
    med = {k: (statistics.median(t for t, _, _ in v), statistics.median(s for _, s, _ in v),
               statistics.median(n for _, _, n in v)) for k, v in (("free", free), ("schema", bound))}
    print(f"\n## Structured output, 16 requests at once, offline, median of {args.runs} (CPU {cpu_isa()})")
    print("| requests | output tok/s | output tokens |\n|---|---|---|")
    for k, label in (("free", "no constraint, same lengths"), ("schema", "JSON schema on every request")):
        print(f"| {label} | {med[k][0]:.1f} | {med[k][2]:.0f} |")
    print(f"\nschema / free throughput: {med['schema'][0] / med['free'][0]:.2f}x; mask time per step (fill + apply, "
          f"16 rows): median {statistics.median(masks) * 1e3:.2f} ms, p99 "
          f"{sorted(masks)[int(0.99 * (len(masks) - 1))] * 1e3:.2f} ms over {len(masks)} steps")
    print("\n| schema | check cold (ms) | check cached (ms) | matcher cold (ms) | matcher from template (ms) |")
    print("|---|---|---|---|---|")
    for name, cold, cached, build, copy in compile_times():
        print(f"| {name} | {cold * 1e3:.2f} | {cached * 1e3:.3f} | {build * 1e3:.2f} | {copy * 1e3:.3f} |")
    rows = []
    for constrained in (False, True):
        outs = llm.generate([p for _, p in work], [params(n if constrained else None, 160) for n, _ in work],
                            use_tqdm=False)
        ok = sum(valid(o.outputs[0].text, SCHEMAS[n]) for (n, _), o in zip(work, outs))
        parses = sum(_parses(o.outputs[0].text) for o in outs)
        rows.append((constrained, parses, ok, len(work)))
    print("\n| output | parses as JSON | valid against the schema |\n|---|---|---|")
    for constrained, parses, ok, n in rows:
        print(f"| {'schema enforced' if constrained else 'prompt only'} | {parses}/{n} | {ok}/{n} |")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
