"""Quantized weights against dense bfloat16, side by side in one process (BENCHMARKS.md "Quantized serving").

    python benchmarks/quant.py                         # all parts
    python benchmarks/quant.py --parts matmul --rows 1,8,64,512
    python benchmarks/quant.py --parts decode --runs 5
    python benchmarks/quant.py --parts decode --formats bfloat16,gguf --checkpoints awq=DIR   # + an AWQ checkpoint

- bandwidth: what these cores read from memory (a reduction over 1 GiB, all threads): the floors below use it.
- matmul: a whole SmolLM2's matmuls (30 layers of qkv, o, gate/up with SiLU, down, each layer its own weights, so
  nothing stays in the caches between layers as in a real step) at M rows, per format, beside the format's byte
  floor (weight bytes / bandwidth).
- decode: one stream of greedy decode on SmolLM2 through the offline engine, tokens/s per format (median of runs),
  beside the floor of reading every weight once per token; "paired" is the median of each round's ratio to that
  round's bfloat16 (a round runs the formats back to back, so a spell of the machine moves both sides of it).
- batched: ShareGPT through the offline engine with 64 requests at a time (`--max-num-seqs 64`, 128 prompts,
  128 output tokens), output tokens/s per format: dequantization must not eat the compute-bound case. Engines
  are built once; the rounds then take the formats in turn, so a slow spell of the machine hits all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.model.backends.gguf_tiles import gguf_pack, kernel_layout
from tokenmill.model.cpu_kernels import _extension, cpu_isa
from tokenmill.quant.fp8 import quantize_fp8
from tokenmill.quant.int8 import quantize_int8

LAYERS = 30
HIDDEN, INTER, QKV = 576, 1536, 960
FORMATS = ("bfloat16", "int8", "fp8", "q4_1", "q8_0")  # the last two: GGUF blocks kept (--quantization gguf)
DECODE = {"bfloat16": "none", "int8": "int8", "fp8": "fp8", "int4": "int4", "gguf (Q4_1 + Q8_0 head)": "gguf",
          "bfloat16+kv-fp8 (FP8 KV cache)": "none:fp8", "gguf+kv-fp8 (FP8 KV cache)": "gguf:fp8"}  # quant[:kv dtype]


def bandwidth_gbs() -> float:
    """GB/s of a reduction streaming 1 GiB (best of 5): what a memory-bound decode step can read."""
    big = torch.ones(2**28, dtype=torch.float32)
    big.sum()
    best = min(_timed(big.sum) for _ in range(5))
    return big.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_matmuls(ops, fmt: str):
    """A callable running every layer's matmuls on x [M, HIDDEN], and the weight bytes it reads."""
    g = torch.Generator().manual_seed(0)
    layers, nbytes = [], 0
    for _ in range(LAYERS):
        ws = {name: torch.randn(n, k, generator=g) * 0.02 for name, (n, k) in
              {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
               "down": (HIDDEN, INTER)}.items()}
        if fmt == "bfloat16":
            packed = {n: (ops.bf16_pack_gate_up if n == "gate_up" else ops.bf16_pack)(w.bfloat16())
                      for n, w in ws.items()}
            layers.append((packed, None))
        elif fmt in ("q4_1", "q8_0"):
            layout = kernel_layout(ops.gguf_kernel())  # as CpuBackend.prepack lays them out
            packed = {n: gguf_pack(random_blocks(fmt, *w.shape, g), GGML[fmt], pairs=n == "gate_up", layout=layout)
                      for n, w in ws.items()}
            layers.append((packed, fmt))
        else:
            fp8 = fmt == "fp8"
            qs = {n: (quantize_fp8 if fp8 else quantize_int8)(w) for n, w in ws.items()}
            pack, pairs = (ops.fp8_pack, ops.fp8_pack_gate_up) if fp8 else (ops.int8_pack, ops.int8_pack_gate_up)
            packed = {n: (pairs if n == "gate_up" else pack)(q) for n, (q, _) in qs.items()}
            layers.append((packed, {n: s for n, (_, s) in qs.items()}))
        nbytes += sum(p.numel() * p.element_size() for p in packed.values())

    def run(x: torch.Tensor) -> None:
        for packed, scales in layers:
            if isinstance(scales, str):
                ops.gguf_linear(x, packed["qkv"], None)
                ops.gguf_linear(x, packed["o"], None)
                ops.gguf_linear(ops.gguf_linear_silu(x, packed["gate_up"]), packed["down"], None)
            elif scales is None:
                ops.bf16_linear(x, packed["qkv"], None)
                ops.bf16_linear(x, packed["o"], None)
                ops.bf16_linear(ops.bf16_linear_silu(x, packed["gate_up"]), packed["down"], None)
            else:
                fp8 = packed["o"].dtype == torch.float8_e4m3fn
                linear, silu = (ops.fp8_linear, ops.fp8_linear_silu) if fp8 else (ops.int8_linear, ops.int8_linear_silu)
                linear(x, packed["qkv"], scales["qkv"], None)
                linear(x, packed["o"], scales["o"], None)
                linear(silu(x, packed["gate_up"], scales["gate_up"]), packed["down"], scales["down"], None)

    return run, nbytes


GGML = {"q4_1": 3, "q8_0": 8}


def random_blocks(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[n, k/32 blocks] of random quants with float16 scales (and mins) of a trained model's size."""
    size, halves = {"q4_1": (20, 2), "q8_0": (34, 1)}[fmt]
    raw = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, halves, generator=g) * 0.01).half()
    raw[..., :2 * halves] = scales.view(torch.uint8).view(n, k // 32, 2 * halves)
    return raw.view(n, -1)


def matmul(rows: list[int], gbs: float) -> None:
    ops = _extension()
    if ops is None or not ops.bf16_kernel():
        print("matmul: the packed kernels run on AMX or AVX512-BF16 only; not on this CPU")
        return
    runs = {fmt: model_matmuls(ops, fmt) for fmt in FORMATS}
    print(f"matmul: {LAYERS} layers of SmolLM2 matmuls, ms (median of 7); floor = weight bytes / {gbs:.1f} GB/s")
    print("rows | " + " | ".join(f"{f} ms (floor)" for f in FORMATS))
    for m in rows:
        x = torch.randn(m, HIDDEN).bfloat16()
        ms = {}
        for fmt, (run, _) in runs.items():
            run(x)
            ms[fmt] = statistics.median(_timed(lambda r=run, x=x: r(x)) for _ in range(7)) * 1e3
        cells = " | ".join(f"{ms[f]:.2f} ({runs[f][1] / gbs / 1e6:.2f})" for f in FORMATS)
        print(f"{m} | {cells}")


def engines(max_num_seqs: int = 128, num_scheduler_steps: int = 1) -> dict:
    """An engine per --formats name (DECODE's, on the embedded GGUF) and per --checkpoints LABEL=PATH (served in
    its own format, e.g. an AWQ directory from `tokenmill quantize`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenmill import LLM

    common = {"dtype": "bfloat16", "max_num_seqs": max_num_seqs, "num_scheduler_steps": num_scheduler_steps}
    out = {fmt: LLM(quantization=q.partition(":")[0], kv_cache_dtype=q.partition(":")[2] or "auto", **common)
           for fmt, q in DECODE.items() if SELECTED is None or fmt.split(" ")[0] in SELECTED}
    for label, path in CHECKPOINTS.items():
        out[label] = LLM(path, **common)
    return out


SELECTED: set[str] | None = None  # --formats: DECODE names (the first word) to run; None = all
CHECKPOINTS: dict[str, str] = {}  # --checkpoints


def decode(runs: int, tokens: int, gbs: float, steps: list[int]) -> None:
    """`steps`: --num-scheduler-steps values; each format runs under each (one engine apiece), and its ratios are
    to the bfloat16 engine with the same steps."""
    from tokenmill import SamplingParams
    from tokenmill.engine.runner import weight_bytes

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llms = {(fmt, k): llm for k in steps for fmt, llm in engines(num_scheduler_steps=k).items()}
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in llms}
    for llm in llms.values():
        llm.generate(["Warm up"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for _ in range(runs):
        for key, llm in llms.items():
            t = time.perf_counter()
            llm.generate(["Once upon a time"], params, use_tqdm=False)
            rates[key].append(tokens / (time.perf_counter() - t))
    print(f"decode: one stream, {tokens} tokens, SmolLM2-135M, tokens/s (median of {runs} rounds)")
    print("format | scheduler steps | tok/s | vs bf16 | paired vs bf16 (median of the rounds' ratios) | weight MiB "
          "| floor tok/s (every matmul weight read once per token) | ms a token | of which reading the weights at "
          "the bandwidth | beyond the weights")
    for (fmt, k), llm in llms.items():
        model, base = llm.engine.core.runner.model, rates[("bfloat16", k)]
        rate = statistics.median(rates[(fmt, k)])
        paired = statistics.median(r / b for r, b in zip(rates[(fmt, k)], base))
        step, reading = 1e3 / rate, matmul_bytes(model) / (gbs * 1e9) * 1e3
        print(f"{fmt} | {k} | {rate:.1f} | {rate / statistics.median(base):.2f}x | {paired:.2f}x | "
              f"{weight_bytes(model) / 2**20:.0f} | {gbs * 1e9 / matmul_bytes(model):.1f} | {step:.2f} | "
              f"{reading:.2f} | {step - reading:.2f}")


def batched(runs: int) -> None:
    from tokenmill.bench.datasets import load_sharegpt
    from tokenmill.bench.offline import run_offline

    llms = engines(max_num_seqs=64)
    requests = load_sharegpt(next(iter(llms.values())).get_tokenizer(), 128, fixed_output_len=128)
    rates: dict[str, list[float]] = {fmt: [] for fmt in llms}
    for _ in range(runs):
        for fmt, llm in llms.items():
            rates[fmt].append(run_offline(llm, requests, progress=False)["output_throughput"])
    print(f"batched: ShareGPT, 128 requests, 64 at a time, 128 output tokens, output tok/s (median of {runs} rounds)")
    print("format | tok/s | vs bf16 | rounds")
    base = statistics.median(rates["bfloat16"])
    for fmt, r in rates.items():
        print(f"{fmt} | {statistics.median(r):.1f} | {statistics.median(r) / base:.2f}x | "
              f"{', '.join(f'{v:.0f}' for v in r)}")


def matmul_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode token reads: every matmul weight (the LM head included) in the form the kernel reads."""
    total = 0
    for m in model.linear_layers():
        for name in ("packed_weight", "qweight", "gguf_blocks", "weight"):
            t = getattr(m, name, None)
            if t is not None and not t.is_meta and not (name == "packed_weight" and t.is_mkldnn):
                total += t.numel() * t.element_size()
                break
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="bandwidth,matmul,decode,batched")
    p.add_argument("--rows", default="1,8,64,512")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--formats", default=None, help="decode/batched: which of " + ", ".join(DECODE) + " to run "
                   "(first word; default all; bfloat16 is the baseline and must be among them)")
    p.add_argument("--checkpoints", default="", help="decode/batched: LABEL=PATH,... checkpoints served in their "
                   "own format beside the formats (e.g. awq=DIR from `tokenmill quantize`)")
    p.add_argument("--num-scheduler-steps", default="1", help="decode: comma-separated multi-step decode settings, "
                   "each format run under each (e.g. 1,8)")
    args = p.parse_args(argv)
    global SELECTED
    SELECTED = None if args.formats is None else set(args.formats.split(",")) | {"bfloat16"}
    CHECKPOINTS.update(dict(item.split("=", 1) for item in args.checkpoints.split(",") if item))
    parts = args.parts.split(",")
    print(f"cpu isa: {cpu_isa()}, threads: {torch.get_num_threads()}")
    gbs = bandwidth_gbs()
    print(f"bandwidth: {gbs:.1f} GB/s")
    if "matmul" in parts:
        matmul([int(r) for r in args.rows.split(",")], gbs)
    if "decode" in parts:
        decode(args.runs, args.tokens, gbs, [int(k) for k in args.num_scheduler_steps.split(",")])
    if "batched" in parts:
        batched(args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
