"""K-quants kept in their blocks (formats/kquants.py) against dequantized at load and against llama.cpp's own kernels,
on one GGUF file (default: Gemma 3 270M Q4_K_M), side by side in one run.

    python benchmarks/kquant.py                                  # every part, the run in BENCHMARKS.md
    python benchmarks/kquant.py --parts speed --runs 3
    python benchmarks/kquant.py --parts ppl --texts 200 --chunks 40

- memory: the bytes the weights take in tokenmill, kept (`--quantization gguf`) and dequantized (`none`), against
  the file's tensor bytes; each weight's format as served. The rotary tables (float32 cos/sin for every position)
  are buffers, not weights: given apart.
- speed: one stream, greedy: decode (128 tokens after an 8-token prompt: the time of max_tokens=129 less that of
  max_tokens=1) and prompt processing (a 512-token prompt, max_tokens=1), tokenmill kept and dequantized, and
  `llama-bench -p 0 -n 128` / `-p 512 -n 0` on the same file, all with `--threads` threads; rounds take each in
  turn, medians over `--runs` rounds.
- ppl: perplexity on held-out ShareGPT as benchmarks/ppl_vs_llama.py computes it, kept against dequantized.
- greedy: 64 greedy tokens for 4 prompts, kept against dequantized: how many tokens agree, and where they part,
  how far the kept model's token was below the dequantized model's best there (a near-tie is a gap of a few
  tenths of a nat).

`--avx2-stand-in` runs all of it as an AVX2-only CPU would, on an AVX-512 machine: tokenmill's kernels built with
-march=haswell (the AVX2 kept-block kernel, float32 compute), torch's and oneDNN's own dispatch capped at AVX2
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), and llama.cpp built with -mno-avx512f (`EXTRA_FLAGS=-mno-avx512f
TOOLS=llama-bench bash benchmarks/build_llama_server.sh /work/peers/llama.cpp-avx2/bin`). A stand-in: the same
cores, caches and memory as the AVX-512 runs, only the instructions of an AVX2 CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.long_prefill import cpu_line  # noqa: E402
from benchmarks.ppl_vs_llama import tokenmill_perplexity  # noqa: E402
from tokenmill.eval import heldout_texts  # noqa: E402
from tokenmill.model.paths import resolve_model_path  # noqa: E402

FORMATS = {"kept": "gguf", "dequantized": "none"}
AVX2_ENV_ALL = (("TOKENMILL_KERNEL_MARCH", "haswell"), ("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"))
AVX2_ENV = AVX2_ENV_ALL[0]


def weight_memory(model: str) -> dict:
    """Weight bytes served per format, as the start-up line counts them (the rotary tables included: they once held
    every position, 128 MiB beside Gemma 3 270M's 241 MiB file; `rotary_mib` says what they hold now), and the
    file's tensor bytes."""
    from gguf import GGUFReader

    from tokenmill import LLM
    from tokenmill.engine.runner import weight_bytes

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(resolve_model_path(model))).tensors)
    out = {"file_tensor_mib": file_bytes / 2**20}
    for name, q in FORMATS.items():
        llm = LLM(model, quantization=q, kv_cache_memory=64 << 20, max_num_seqs=2)  # one stream: 2 state slots
        m = llm.engine.core.runner.model
        rotary = [r for r in (m.rotary, getattr(m, "local_rotary", None)) if r is not None]
        rot = sum(b.untyped_storage().nbytes() for r in rotary for b in r.buffers())
        kinds: dict[str, int] = {}
        for layer in m.linear_layers():
            t = getattr(layer, "gguf_type", None)
            key = "dense" if t is None else str(t)
            kinds[key] = kinds.get(key, 0) + 1
        weights = weight_bytes(m) / 2**20
        out[name] = {"weights_mib": weights, "x_file": weights * 2**20 / file_bytes, "rotary_mib": rot / 2**20,
                     "x_file_less_rotary": (weights * 2**20 - rot) / file_bytes,
                     "matmuls_by_type": kinds}
        llm.shutdown()
    return out


def tokenmill_speed(llm, prompt: list[int], long_prompt: list[int]) -> tuple[float, float]:
    """(decode tok/s, prompt tok/s) of one stream."""
    from tokenmill import SamplingParams

    def timed(ids: list[int], n: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - start

    first = timed(prompt, 1)
    decode = 128 / (timed(prompt, 129) - first)
    prefill = len(long_prompt) / timed(long_prompt, 1)
    return decode, prefill


def llama_bench(binary: Path, model: Path, threads: int, prompt: int, gen: int) -> float:
    cmd = [str(binary), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", "1",
           "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(run.stdout)[0]["avg_ts"])


def speed(model: str, runs: int, threads: int, llama_bin: Path) -> dict:
    from tokenmill import LLM

    llms = {name: LLM(model, quantization=q, num_threads=threads, kv_cache_memory=64 << 20, max_num_seqs=2)
            for name, q in FORMATS.items()}
    path = resolve_model_path(model)
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {n: {"decode": [], "prefill": []} for n in [*llms, "llama.cpp"]}
    for r in range(runs):
        for name, llm in llms.items():
            vocab = llm.engine.core.model_config.vocab_size
            prompt = [rng.randrange(1000, vocab) for _ in range(8)]  # fresh each time: no prefix hit
            long_prompt = [rng.randrange(1000, vocab) for _ in range(512)]
            d, p = tokenmill_speed(llm, prompt, long_prompt)
            times[name]["decode"].append(d)
            times[name]["prefill"].append(p)
        times["llama.cpp"]["decode"].append(llama_bench(llama_bin / "llama-bench", path, threads, 0, 128))
        times["llama.cpp"]["prefill"].append(llama_bench(llama_bin / "llama-bench", path, threads, 512, 0))
        print(f"round {r + 1}: " + ", ".join(f"{n} decode {t['decode'][-1]:.1f} prefill {t['prefill'][-1]:.1f}"
                                             for n, t in times.items()), flush=True)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    return {"rounds": times, "median": med,
            "kept_over_llama": {k: med["kept"][k] / med["llama.cpp"][k] for k in ("decode", "prefill")}}


def perplexity(model: str, texts: int, ctx: int, chunks: int, threads: int) -> dict:
    text = "\n\n".join(heldout_texts(texts))
    out = {name: tokenmill_perplexity(model, text, ctx, chunks, threads, quantization=q) for name, q in FORMATS.items()}
    out["kept_over_dequantized"] = out["kept"]["perplexity"] / out["dequantized"]["perplexity"]
    return out


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Owls are birds that",
                  "Write a short poem about the sea."]


def greedy(model: str) -> dict:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    outs = {}
    for name, q in FORMATS.items():
        llm = LLM(model, quantization=q, kv_cache_memory=64 << 20, max_num_seqs=2)  # one stream: 2 state slots
        outs[name] = [o.outputs[0] for o in llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)]
        llm.shutdown()
    result = []
    for kept, dense in zip(outs["kept"], outs["dequantized"]):
        same = next((i for i, (a, b) in enumerate(zip(kept.token_ids, dense.token_ids)) if a != b), None)
        entry = {"agree": len(kept.token_ids) if same is None else same}
        if same is not None:
            chosen = dense.logprobs[same].get(kept.token_ids[same])
            entry["gap_nats"] = None if chosen is None else max(dense.logprobs[same].values()) - chosen
        result.append(entry)
    return {"prompts": result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--parts", default="memory,speed,ppl", help="any of memory, speed, ppl, greedy")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--llama-bin", default=None,
                    help="llama.cpp's binaries (default /work/peers/llama.cpp/bin; -avx2/bin with --avx2-stand-in)")
    ap.add_argument("--avx2-stand-in", action="store_true", help="run as an AVX2-only CPU would (see above)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/kquant.json (kquant_avx2.json)")
    args = ap.parse_args(argv)
    if args.avx2_stand_in and os.environ.get(AVX2_ENV[0]) != AVX2_ENV[1]:  # torch reads its caps at import: again
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **dict(AVX2_ENV_ALL)})
    args.llama_bin = args.llama_bin or f"/work/peers/llama.cpp{'-avx2' if args.avx2_stand_in else ''}/bin"
    args.out = args.out or f"benchmarks/results/kquant{'_avx2' if args.avx2_stand_in else ''}.json"
    parts = set(args.parts.split(","))
    result: dict = {"cpu": cpu_line(), "args": vars(args)}
    if args.avx2_stand_in:
        import torch

        from tokenmill.model import cpu_kernels

        ops = cpu_kernels._extension()
        result["stand_in"] = {"kernels": cpu_kernels.build_name(), "gguf_kernel": ops.gguf_kernel(),
                              "torch_capability": torch.backends.cpu.get_cpu_capability()}
        assert ops.gguf_kernel() == "avx2" and not ops.bf16_kernel(), result["stand_in"]
        print(result["stand_in"], flush=True)
    if "memory" in parts:
        result["memory"] = weight_memory(args.model)
        print(json.dumps(result["memory"], indent=1), flush=True)
    if "speed" in parts:
        result["speed"] = speed(args.model, args.runs, args.threads, Path(args.llama_bin))
        print(json.dumps(result["speed"]["median"], indent=1), result["speed"]["kept_over_llama"], flush=True)
    if "ppl" in parts:
        result["ppl"] = perplexity(args.model, args.texts, args.ctx, args.chunks, args.threads)
        print({k: (v["perplexity"] if isinstance(v, dict) else v) for k, v in result["ppl"].items()}, flush=True)
    if "greedy" in parts:
        result["greedy"] = greedy(args.model)
        print(result["greedy"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
