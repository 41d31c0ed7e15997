"""Two builds of the C++ kernels side by side in one process: on this noisy 2-core VM a kernel change is
measured by interleaving the two builds' calls (medians of rounds), not by runs minutes apart.

    python benchmarks/kernel_ab.py --old /tmp/wt_old --new . [--parts matmul,attention,engine] [--rounds 9]

`--old` and `--new` are checkouts (their tokenmill/model/csrc is built, with the flags the engine builds with, under
~/.cache/tokenmill-kernel-ab/). Parts:
- matmul: 30 DRAM-resident layers of SmolLM2's shapes kept as Q4_1 blocks (66 MB) and its Q8_0 LM head, at
  1, 8, 16 and 64 rows (the VNNI kernel; needs AVX512-VNNI);
- attention: paged attention, 9/3 heads x 64, blocks scattered over the pool: 64 decodes x ~400 keys over one
  layer's pool (L3-resident) and over 30 (DRAM-resident), and a prefill chunk of 512 tokens after 512 keys;
- engine: one engine (the embedded GGUF), one greedy stream, its kernel module swapped between the builds every
  50 steps.
The builds' outputs must be equal bit for bit (matmul, attention) unless --allow-differences.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenmill.model.cpu_kernels import BUILD_FLAGS


def source_names(tree: Path) -> list[str]:
    """The kernel sources `tree` builds: its own cpu_kernels.py's SOURCE_NAMES (an older checkout's list differs)."""
    module = ast.parse((tree / "tokenmill" / "model" / "cpu_kernels.py").read_text())
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SOURCE_NAMES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"{tree}: no SOURCE_NAMES in tokenmill/model/cpu_kernels.py")


def build(tree: Path) -> ModuleType:
    """The kernels of `tree`'s csrc, built once per source hash (a directory of its own: never the engine's)."""
    from torch.utils.cpp_extension import load

    csrc = tree / "tokenmill" / "model" / "csrc"
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(csrc.iterdir()) if p.is_file())).hexdigest()[:10]
    name = f"tokenmill_ab_{digest}"
    directory = Path.home() / ".cache" / "tokenmill-kernel-ab" / name
    built = directory / f"{name}.so"
    if built.exists():
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    directory.mkdir(parents=True, exist_ok=True)
    print(f"building {csrc} ({name}) ...", flush=True)
    return load(name=name, sources=[str(csrc / s) for s in source_names(tree)], extra_cflags=list(BUILD_FLAGS),
                extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)


def interleaved(fns: list, rounds: int) -> list[float]:
    """Median seconds of each fn over `rounds` rounds, the fns called in turn within each round."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def check_equal(a: torch.Tensor, b: torch.Tensor, what: str, allow: bool) -> None:
    if not torch.equal(a, b):
        message = f"{what}: the builds' outputs differ (max |diff| {(a.float() - b.float()).abs().max().item():.3g})"
        if not allow:
            raise SystemExit(message + "; pass --allow-differences if the change means to change them")
        print("note:", message)


def matmul_part(mods: list[ModuleType], rounds: int, allow: bool) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from tokenmill.model.backends.gguf_tiles import gguf_pack

    if mods[0].gguf_kernel() not in ("vnni", "avx2"):
        print("matmul: skipped (the kept-GGUF kernel here reads AMX tiles, not quads)")
        return
    g = torch.Generator().manual_seed(0)

    def packed(n: int, k: int, kind) -> torch.Tensor:
        raw = quants.quantize((torch.randn(n, k, generator=g) * 0.05).numpy(), kind)
        return gguf_pack(torch.from_numpy(raw).view(n, -1), kind, layout="quads")

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
    base = {s: packed(*s, T.Q4_1) for s in shapes}
    layers = [{s: w.clone() for s, w in base.items()} for _ in range(30)]
    head = packed(49152, 576, T.Q8_0)
    print("matmul: ms, medians; 30 Q4_1 layers (66 MB), the Q8_0 LM head (49152 x 576)")
    for rows in (1, 8, 16, 64):
        x = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in (576, 1536)}
        for s, w in base.items():
            check_equal(mods[0].gguf_linear(x[s[1]], w, None), mods[1].gguf_linear(x[s[1]], w, None),
                        f"matmul {s} x {rows} rows", allow)
        per_layers = interleaved([lambda m=m, x=x: [m.gguf_linear(x[s[1]], w, None) for layer in layers
                                                    for s, w in layer.items()] for m in mods], rounds)
        per_head = interleaved([lambda m=m, x=x: m.gguf_linear(x[576], head, None) for m in mods], rounds)
        print(f"  {rows:3d} rows: layers {per_layers[0] * 1e3:7.3f} -> {per_layers[1] * 1e3:7.3f}   "
              f"head {per_head[0] * 1e3:6.3f} -> {per_head[1] * 1e3:6.3f}")


def attention_part(mods: list[ModuleType], rounds: int, allow: bool) -> None:
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(0)

    def batch(seqs: int, context: int, chunk: int):
        """`seqs` requests of ~`context` keys, each with its last `chunk` tokens as queries (chunk 1: decodes),
        their blocks scattered over the pool as a serving engine's are after some churn."""
        blocks = (context + 15) // 16
        tables = torch.randperm(seqs * blocks, generator=g).view(seqs, blocks)
        ends = torch.randint(context - 40, context + 1, (seqs,), generator=g) if chunk == 1 else [context] * seqs
        lens = torch.cat([torch.arange(int(end) - chunk + 1, int(end) + 1) for end in ends])
        rows = torch.arange(seqs).repeat_interleave(chunk)
        q = torch.randn(len(rows), heads, dim, generator=g).to(torch.bfloat16)
        return q, tables, rows, lens, seqs * blocks

    print(f"attention: ms a layer, medians; {heads}/{kv_heads} heads x {dim}, blocks scattered over the pool")
    cases = [("decode 64 x ~400 keys", batch(64, 400, 1), 1, "L3-resident"),
             ("decode 64 x ~400 keys", batch(64, 400, 1), 30, "DRAM-resident"),
             ("prefill chunk of 512 after 512 keys", batch(1, 1024, 512), 8, "DRAM-resident")]
    for label, (q, tables, rows, lens, num_blocks), layers, where in cases:
        pools = [tuple(torch.randn(num_blocks, 16, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in "kv")
                 for _ in range(layers)]
        for k, v in pools[:1]:
            check_equal(mods[0].paged_attention(q, k, v, tables, rows, lens, 0.125),
                        mods[1].paged_attention(q, k, v, tables, rows, lens, 0.125), "attention", allow)
        reps = max(1, 30 // layers)
        times = interleaved([lambda m=m, reps=reps, pools=pools: [m.paged_attention(q, k, v, tables, rows, lens, 0.125)
                                                                  for _ in range(reps) for k, v in pools]
                             for m in mods], rounds)
        print(f"  {label}, {where}: {times[0] / reps / layers * 1e3:.3f} -> {times[1] / reps / layers * 1e3:.3f}")


def engine_part(mods: list[ModuleType], rounds: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenmill import LLM, SamplingParams

    llm = LLM()
    engine = llm.engine
    backend = engine.core.runner.model.backend
    if not hasattr(backend, "ops"):
        print("engine: skipped (no C++ backend here)")
        return
    engine.add_request("ab", {"prompt_token_ids": list(range(100, 150))},
                       SamplingParams(max_tokens=8000, ignore_eos=True, temperature=0))
    for _ in range(20):
        engine.step()
    rates: list[list[float]] = [[] for _ in mods]
    for _ in range(rounds):
        for i, m in enumerate(mods):
            backend.ops = m  # the packed weights are the same bytes for both builds
            engine.step()
            start = time.perf_counter()
            for _ in range(50):
                engine.step()
            rates[i].append(50 / (time.perf_counter() - start))
    engine.abort_request("ab")
    faster = sum(b > a for a, b in zip(*rates))
    print(f"engine: one greedy stream, tok/s, medians of {rounds} rounds of 50 steps: "
          f"{statistics.median(rates[0]):.1f} -> {statistics.median(rates[1]):.1f} (new faster in {faster})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="checkout whose kernels are the baseline")
    parser.add_argument("--new", type=Path, default=ROOT, help="checkout measured against it (default: this one)")
    parser.add_argument("--parts", default="matmul,attention,engine")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--allow-differences", action="store_true")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"matmul", "attention", "engine"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: matmul, attention, engine")
    for tree in (args.old, args.new):
        if not (tree / "tokenmill" / "model" / "csrc").is_dir():
            parser.error(f"{tree} is not a tokenmill checkout (no tokenmill/model/csrc)")
    mods = [build(args.old), build(args.new)]
    print(f"torch threads: {torch.get_num_threads()}")
    if "matmul" in parts:
        matmul_part(mods, args.rounds, args.allow_differences)
    if "attention" in parts:
        attention_part(mods, args.rounds, args.allow_differences)
    if "engine" in parts:
        engine_part(mods, args.rounds)


if __name__ == "__main__":
    main()
