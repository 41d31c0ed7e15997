"""Quality of every activation path of the default model's kept blocks, per CPU kind this machine can build kernels
for (docs/models/quality.md): benchmarks/quality.py once per kind, in its own process, against the same reference
(the GGUF file dequantized to float32, the exact weights; every kind computes it alike up to float32 rounding).

    python benchmarks/quality_per_cpu.py --num-samples 64            # every kind this CPU can stand in for
    python benchmarks/quality_per_cpu.py --kinds avx2 --num-samples 64

A kind other than this CPU's own is a stand-in: the kernels built for an older target (TOKENMILL_KERNEL_MARCH),
torch and oneDNN capped at its instruction sets. It takes the same code paths as the real CPU and computes the
same numbers (integer sums are exact and the float32 steps are the same instructions' results), but its speed is
not the real CPU's: quality only here.

Paths, each against the reference (`none@float32`):
- `auto@auto`: the model as served by default on that kind;
- `gguf@bfloat16`: kept blocks, bfloat16 activations (AMX: tiles widened to bfloat16; VNNI/AVX2: int8 blocks of x);
- `gguf@float32`: kept blocks, float32 activations (VNNI/AVX2: x split in two int8 blocks; AMX: dequantized per call);
- `none@bfloat16`: the dequantized weights in bfloat16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenmill.model.cpu_kernels import MARCH_ENV, _cpu_info

# kind -> (the flags a CPU needs to run it, the environment that builds and runs it, what it stands for)
KINDS = {
    "amx": (("amx_bf16", "amx_tile"), {}, "AMX (Sapphire Rapids and later Xeons)"),
    "avx512": (("avx512_vnni", "avx512_bf16"),
               {MARCH_ENV: "cooperlake", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
               "AVX-512 VNNI + BF16, no AMX (Zen 4)"),
    "avx2": (("avx2", "fma", "f16c"),
             {MARCH_ENV: "haswell", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
             "AVX2 only (Zen 3, Haswell to Alder Lake)"),
}
PATHS = ("auto@auto", "gguf@bfloat16", "gguf@float32", "none@bfloat16")
LABELS = {"auto@auto": "the default (dtype auto)", "gguf@bfloat16": "kept blocks, bfloat16 x",
          "gguf@float32": "kept blocks, float32 x", "none@bfloat16": "dequantized, bfloat16"}
OUT = ROOT / "docs" / "performance" / "data" / "quality-per-cpu.json"


def runnable(kind: str, flags: set[str]) -> bool:
    return all(f in flags for f in KINDS[kind][0])


def own_kind(flags: set[str]) -> str:
    """The kind this CPU is itself (the first of KINDS it has everything of)."""
    return next(kind for kind in KINDS if runnable(kind, flags))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS), help="of " + ", ".join(KINDS) + " (those this CPU runs)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--greedy-prompts", type=int, default=32)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)

    model, flag_text = _cpu_info()
    flags = set(flag_text.split())
    own = own_kind(flags)
    results = {}
    for kind in args.kinds.split(","):
        if not runnable(kind, flags):
            print(f"{kind}: this CPU cannot run it ({', '.join(KINDS[kind][0])} needed); skipped", file=sys.stderr)
            continue
        env = {**os.environ, **KINDS[kind][1], "HF_HUB_OFFLINE": "1"}
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--reference", "none@float32",
                   "--formats", ",".join(PATHS), "--num-samples", str(args.num_samples),
                   "--greedy-prompts", str(args.greedy_prompts), "--greedy-tokens", str(args.greedy_tokens),
                   "--json", out.name]
            print(f"{kind}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, check=True)
            results[kind] = json.loads(Path(out.name).read_text())
        results[kind]["stands_in"] = kind != own
        results[kind]["cpu_kind"] = KINDS[kind][2]
    data = {
        "topic": "Quality per CPU kind", "page": "quantization.md",
        "cpu": f"2-core {model} ({own}); other kinds are stand-ins built on it (quality only)",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/quality_per_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "results": results,
        "charts": [{
            "file": "quality-per-cpu.png",
            "title": f"SmolLM2-135M Q4_1: greedy {args.greedy_tokens}-token continuations identical to the "
                     "dequantized float32 model",
            "ylabel": f"of {args.greedy_prompts} prompts", "fmt": "{:.0f}",
            "categories": [KINDS[k][2].split(" (")[0] for k in results],
            "series": [{"label": LABELS[path], "values": [next(r["greedy_identical"] for r in results[k]["rows"]
                                                       if r["format"] == path) for k in results]}
                       for path in PATHS],
        }],
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    for kind, res in results.items():
        print(f"\n{KINDS[kind][2]}{' (stand-in)' if res['stands_in'] else ''}")
        for r in res["rows"]:
            print(f"  {r['format']:<14} {r['weights'][:60]:<60} ppl {r['perplexity']:.3f} {r['change']:+.2%} "
                  f"({r['change_ci95'][0]:+.2%} to {r['change_ci95'][1]:+.2%}) greedy {r['greedy_identical']}/"
                  f"{r['greedy_prompts']} prefix {r['mean_common_prefix']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
