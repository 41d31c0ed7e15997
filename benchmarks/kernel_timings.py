"""Kernel microbenchmarks behind BENCHMARKS.md "Kernels": each fast path against what it replaces, same process.
(Not `kernels.py`: the scripts here run with benchmarks/ first on sys.path, where a module of that name shadows
the `kernels` package transformers imports, and every script that loads transformers failed.)

    python benchmarks/kernel_timings.py                      # all parts
    python benchmarks/kernel_timings.py --parts matmul       # matmul | bf16 | attention | silu | sampler

- matmul: one of each SmolLM2 matmul (qkv, o, gate_up, down; plus the 49,152-row LM head up to 128 rows) at M
  rows, `F.linear` (BLAS, repacks the weight every call) vs oneDNN on a weight prepacked once vs the skinny GEMV.
- bf16: the same matmuls in bfloat16, our packed kernel (csrc/bf16_linear.cpp: AMX tiles, or AVX512-BF16 dot
  products; one kernel for every row count, so batch-invariant) vs oneDNN on a prepacked weight, per shape.
- attention: the paged-attention kernel for B decode tokens over `--context` keys each and for prefill chunks,
  blocks scattered over the pool: float32, bfloat16 on the vector kernel, bfloat16 on AMX tiles.
- silu: the fused SiLU-and-multiply kernel against torch's two ops.
- sampler: the engine's sampler on 64 x 49,152 logits (temperature 1, top-p, greedy) against per-row
  torch.multinomial.
Times are the best of 5 repetitions (ms).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.model.cpu_kernels import _extension  # noqa: E402
from tokenmill.model.linear import prepack_weight  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def best_ms(fn, iters: int = 10, reps: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters)
    return best * 1e3


def matmul(rows: list[int]) -> None:
    ops = _extension()
    weights = {k: torch.randn(n, k_) for k, (k_, n) in SHAPES.items()}
    packed = {k: prepack_weight(w) for k, w in weights.items()}
    if any(p is None for p in packed.values()):
        print("no oneDNN packing on this CPU/torch build; skipping matmul")
        return
    print("rows | F.linear ms | oneDNN prepacked ms | skinny GEMV ms (<= 8 rows)")
    for m in rows:
        names = [k for k in SHAPES if k != "lm_head" or m <= 128]
        xs = {k: torch.randn(m, SHAPES[k][0]) for k in names}
        plain = sum(best_ms(lambda k=k: F.linear(xs[k], weights[k])) for k in names)
        onednn = sum(best_ms(lambda k=k: torch.ops.mkldnn._linear_pointwise(xs[k], packed[k], None, "none", [], ""))
                     for k in names)
        skinny = (sum(best_ms(lambda k=k: ops.skinny_linear(xs[k], weights[k], None)) for k in names)
                  if ops is not None and m <= 8 else float("nan"))
        print(f"{m} | {plain:.2f} | {onednn:.2f} | {skinny:.2f}", flush=True)


def attention(batch: int, context: int) -> None:
    """Decode (`batch` tokens over `context` keys each, then over context / 4 to 7 context / 4) and prefill (4 chunks of 128 tokens at 128, 1 of 512 at 0)
    in float32 and bfloat16; bfloat16 on the vector kernel and, where the CPU has AMX, on tiles."""
    ops = _extension()
    if ops is None:
        print("no C++ kernels; skipping attention")
        return
    uneven = [max(1, context // 4 + (3 * context // 2) * i // max(batch - 1, 1)) for i in range(batch)]
    cases = [(f"decode {batch} x {context} keys", [(context, 1)] * batch),
             (f"decode {batch} x {min(uneven)}-{max(uneven)} keys", [(ctx, 1) for ctx in uneven]),
             ("prefill 4 x 128 tokens at 128", [(256, 128)] * 4), ("prefill 512 tokens at 0", [(512, 512)])]
    dots = ops.tile_attention_applies(16, 64, 9, 3)
    kind = "AMX tiles" if ops.amx_attention_applies(16, 64, 9, 3) else "AVX512-BF16 dot products"
    print("paged attention, GQA 9/3, head_dim 64, 16-token blocks scattered over the pool, ms per layer")
    print(f"case | float32 | bfloat16 vectors | bfloat16 {kind}")
    for name, contexts in cases:
        blocks = [(ctx + 15) // 16 for ctx, _ in contexts]
        pool = sum(blocks) + 8
        k32 = torch.randn(pool, 16, 3, 64)
        v32 = torch.randn_like(k32)
        perm = torch.randperm(pool - 8).tolist()
        tables = torch.zeros(len(contexts), max(blocks), dtype=torch.long)
        rows, lens, at = [], [], 0
        for r, ((ctx, chunk), n) in enumerate(zip(contexts, blocks)):
            tables[r, :n] = torch.tensor(perm[at:at + n])
            at += n
            rows += [r] * chunk
            lens += list(range(ctx - chunk + 1, ctx + 1))
        rows_t, lens_t = torch.tensor(rows), torch.tensor(lens)
        q32 = torch.randn(len(rows), 9, 64)
        cells = []
        for dtype, fn in ((torch.float32, ops.paged_attention), (torch.bfloat16, ops.paged_attention_vectors),
                          (torch.bfloat16, ops.paged_attention if dots else None)):
            if fn is None:
                cells.append("n/a (no AMX or AVX512-BF16)")
                continue
            q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
            cells.append(f"{best_ms(lambda: fn(q, k, v, tables, rows_t, lens_t, 0.125), iters=10):.3f}")
        print(f"{name} | " + " | ".join(cells), flush=True)


def sampler(rows: int, vocab: int) -> None:
    """The engine's sampler at temperature 1 (what vLLM's benchmark client asks for: it sends no temperature)
    and with top-p, against the per-row torch.multinomial it replaced (one exponential per vocabulary entry)."""
    from tokenmill.engine.sampler import Sampler, SamplingRow
    from tokenmill.sampling_params import SamplingParams

    logits = torch.randn(rows, vocab) * 3
    for kw in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.0}):
        params = SamplingParams(max_tokens=8, **kw)
        gens = [torch.Generator().manual_seed(i) if kw["temperature"] else None for i in range(rows)]
        sample_rows = [SamplingRow(params, [1], [2], g) for g in gens]
        ours = best_ms(lambda: Sampler()(logits, sample_rows), iters=3)
        line = f"sampler, {rows} rows x {vocab}, {kw}: {ours:.2f} ms"
        ops = _extension()
        if ops is not None and kw["temperature"]:
            from tokenmill.model.backends.cpu import CpuBackend

            fused = Sampler(CpuBackend(ops))
            line += f", with the CPU backend's fused weights {best_ms(lambda: fused(logits, sample_rows), iters=3):.2f} ms"
        if kw["temperature"] == 1.0:
            def multinomial():
                probs = logits.softmax(dim=1)
                return [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(gens)]
            line += f" (per-row torch.multinomial: {best_ms(multinomial, iters=3):.2f} ms)"
        print(line, flush=True)


def silu(rows: list[int]) -> None:
    ops = _extension()
    if ops is None:
        print("no C++ kernels; skipping silu")
        return
    for m in rows:
        gate_up = torch.randn(m, 2 * 1536)
        gate, up = gate_up.split(1536, dim=-1)
        fused = best_ms(lambda: ops.silu_mul(gate_up), iters=50)
        torch_ms = best_ms(lambda: F.silu(gate) * up, iters=50)
        print(f"silu_mul, {m} rows x 1536: kernel {fused:.3f} ms, torch {torch_ms:.3f} ms")


def bf16(rows: list[int]) -> None:
    ops = _extension()
    if ops is None or not ops.bf16_kernel():
        print("no bfloat16 matmul kernel on this CPU (needs AMX or AVX512-BF16); skipping bf16")
        return
    weights = {k: (torch.randn(n, k_) * 0.05).to(torch.bfloat16) for k, (k_, n) in SHAPES.items()}
    ours = {k: ops.bf16_pack(w) for k, w in weights.items()}
    onednn = {k: prepack_weight(w) for k, w in weights.items()}
    print(f"bf16, ours ({ops.bf16_kernel()}) / oneDNN prepacked, ms per matmul")
    print("rows | " + " | ".join(SHAPES))
    for m in rows:
        cells = []
        for k, (k_, _) in SHAPES.items():
            x = torch.randn(m, k_).to(torch.bfloat16)
            a = best_ms(lambda k=k, x=x: ops.bf16_linear(x, ours[k], None))
            b = (best_ms(lambda k=k, x=x: torch.ops.mkldnn._linear_pointwise(x, onednn[k], None, "none", [], ""))
                 if onednn[k] is not None else float("nan"))
            cells.append(f"{a:.3f} / {b:.3f}")
        print(f"{m} | " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="matmul,bf16,attention,silu,sampler")
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256,512")
    p.add_argument("--batch", type=int, default=49)
    p.add_argument("--context", type=int, default=370)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    with torch.inference_mode():
        if "matmul" in parts:
            matmul(rows)
        if "bf16" in parts:
            bf16(rows)
        if "attention" in parts:
            attention(args.batch, args.context)
        if "silu" in parts:
            silu([r for r in rows if r in (1, 64, 512)] or rows[:1])
        if "sampler" in parts:
            sampler(64, 49152)
    return 0


if __name__ == "__main__":
    sys.exit(main())
