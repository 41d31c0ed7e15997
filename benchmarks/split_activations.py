"""What the kept-block kernels cost per activation path: the AVX2 kernel (csrc/gguf_avx2.cpp) on SmolLM2's matmul
shapes with float32 and bfloat16 rows, and the default model's one-stream and 32-stream decode with its blocks kept in
two compute dtypes. x is rounded in two int8 parts (csrc/gguf_quads.h quantize_rows); run the script from a tree
before that (63142db, where bfloat16 rows were rounded once) beside this one for the split's cost.

    python benchmarks/split_activations.py --part matmul
    python benchmarks/split_activations.py --part engine --dtypes bfloat16,float32

Set TOKENMILL_KERNEL_MARCH (and ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) to measure another CPU kind's kernels on a
newer CPU: a stand-in's speed is not the real CPU's, say so beside its numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SHAPES = ((3072, 576), (576, 1536), (49152, 576))  # gate/up, down, the Q8_0 head: (N, K)


def best_ms(fn, seconds: float = 0.1, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def matmul() -> None:
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from tokenmill.model.backends.gguf_tiles import gguf_pack
    from tokenmill.model.cpu_kernels import _extension

    ops = _extension()
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        qtype = T.Q8_0 if n == 49152 else T.Q4_1
        raw = torch.from_numpy(quants.quantize((torch.randn(n, k, generator=g) * 0.05).numpy(), qtype)).view(n, -1)
        packed = gguf_pack(raw, int(qtype), layout="quads")
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            f32 = best_ms(lambda x=x, w=packed: ops.gguf_avx2_linear(x, w, None))
            bf16 = best_ms(lambda x=xb, w=packed: ops.gguf_avx2_linear(x, w, None))
            print(f"N={n} K={k} M={m}: float32 rows {f32:.3f} ms, bfloat16 rows {bf16:.3f} ms")


def engine(dtypes: list[str]) -> None:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompts = [f"Question {i}: tell me about the number {i * 7}." for i in range(32)]
    for dtype in dtypes:
        llm = LLM(dtype=dtype, quantization="gguf", kv_cache_memory=256 << 20)
        llm.generate(["Once upon a time"], params, use_tqdm=False)
        one = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(["Once upon a time"], params, use_tqdm=False)
            one.append(128 / (time.perf_counter() - start))
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        batch = 32 * 128 / (time.perf_counter() - start)
        print(f"{dtype}: one stream {statistics.median(one):.1f} tok/s (median of 3), 32 streams {batch:.1f} tok/s")
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("matmul", "engine"), default="matmul")
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args(argv)
    if args.part == "matmul":
        matmul()
    else:
        engine(args.dtypes.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
