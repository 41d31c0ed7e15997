"""This tree against another checkout, side by side on one machine, each measurement in a fresh process and the
two trees alternated run by run (issue 12's "done when"):

- single-stream decode: per-step median ms, 128-token prompt, 256 greedy tokens;
- batched throughput: 64 ShareGPT requests at once (prompts <= 1024 tokens, outputs capped at 128, ignore_eos),
  output tokens/s of the whole batch;
- API-process RSS: what `tokenmill serve`'s front process holds after importing the app and loading the tokenizer.

    git worktree add /tmp/base f1b194e
    python benchmarks/seams_ab.py --baseline-tree /tmp/base --runs 3

Peak RSS at load is benchmarks/load_memory.py's. Medians over runs; the CPU is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

DECODE = """
import statistics, sys, time
from tokenmill import LLM, SamplingParams
llm = LLM(dtype="auto", kv_cache_memory=64 << 20)
engine, prompt = llm.engine, {"prompt_token_ids": list(range(1000, 1128))}
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
engine.add_request("single", prompt, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
engine.step()
times = []
while engine.has_unfinished_requests():
    t0 = time.perf_counter(); engine.step(); times.append((time.perf_counter() - t0) * 1000)
print(statistics.median(times))
"""

BATCH = """
import json, sys, time
from tokenmill import LLM, SamplingParams
reqs = json.load(open(sys.argv[2]))
llm = LLM(dtype="auto", kv_cache_memory=1 << 30, max_num_seqs=64)
llm.generate([{"prompt_token_ids": reqs[0][0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
t0 = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(sum(n for _, n in reqs) / (time.perf_counter() - t0))
"""

API_RSS = """
import re, sys
from tokenmill.server import app
from tokenmill.tokenizer import Tokenizer
from tokenmill.model.paths import default_model_path
Tokenizer.load(default_model_path())
print(int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024)
"""


VERIFY = """
import pathlib, sys
import tokenmill
assert pathlib.Path(tokenmill.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve()), tokenmill.__file__
"""


def run(tree: Path, code: str, *args: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    # cwd=tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    out = subprocess.run([sys.executable, "-c", VERIFY + code, str(tree), *args], cwd=tree, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--parts", default="decode,batch,api")
    args = p.parse_args()

    from tokenmill.bench.datasets import load_sharegpt
    from tokenmill.model.cpu_kernels import _cpu_info, cpu_isa
    from tokenmill.model.paths import default_model_path
    from tokenmill.tokenizer import Tokenizer

    reqs = load_sharegpt(Tokenizer.load(default_model_path()), 64, seed=0, max_prompt_len=1024, max_output_len=128)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as workload:
        json.dump([[r.prompt_token_ids, r.output_len] for r in reqs], workload)

    parts = {"decode": ("single-stream decode, ms/step", DECODE, ()),
             "batch": ("64 concurrent ShareGPT, output tok/s", BATCH, (workload.name,)),
             "api": ("API-process RSS, MiB", API_RSS, ())}
    trees = {"before": args.baseline_tree.resolve(), "after": HERE}
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.parts.split(","):
        label, code, extra = parts[name]
        for i in range(args.runs):
            for which, tree in trees.items():
                value = run(tree, code, *extra)
                results.setdefault(label, {}).setdefault(which, []).append(value)
                print(f"{label} run {i + 1} {which}: {value:.2f}", flush=True)
    print(f"\nCPU: {_cpu_info()[0]} (isa: {cpu_isa()}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("| measure | before | after | after / before |\n|---|---|---|---|")
    for label, by in results.items():
        b, a = statistics.median(by["before"]), statistics.median(by["after"])
        print(f"| {label} | {b:.1f} | {a:.1f} | {a / b:.2f}x |")
    os.unlink(workload.name)


if __name__ == "__main__":
    main()
