"""Peak memory and time to load the model: the peak RSS of building a ModelRunner, against the bytes its weights
finally take.

Loading should cost little more than the weights it leaves behind (issue 12: peak <= 1.3x the final weight bytes).
Each measurement runs in a fresh subprocess, so one load's freed memory cannot hide the next one's peak:
  - RSS before loading (torch and tokenmill imported, model config read) is the zero; peaks are VmHWM after
    resetting it (/proc/self/clear_refs), else ru_maxrss;
  - `load` is load_weights + the runner up to Backend.prepack (building the model and filling its weights), read by
    wrapping the backend's prepack; `runner` is the whole ModelRunner(...) (one KV block, so the cache is
    negligible), prepack included;
  - final bytes: the model's parameters, and separately the backend's packed copies (Backend.prepack).
Two paths per dtype: `engine` calls load_weights with its default float32 (how EngineCore loaded before
issue 12), `typed` passes the runner's dtype to load_weights as well (how EngineCore loads now).
Parameters a backend released after packing (left on the meta device) hold no memory and are not counted.

    python benchmarks/load_memory.py [--model PATH] [--dtypes float32 bfloat16] [--repeat 1] [--baseline-tree DIR]

--model defaults to the bundled SmolLM2 GGUF (Q4_1); an HF directory measures the safetensors path.

--baseline-tree DIR measures another checkout (e.g. `git worktree add /tmp/old COMMIT`) the same way, through
PYTHONPATH, and prints the two side by side.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MiB = 2**20
PATHS = ("engine", "typed")


def _status_kib(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _reset_peak() -> bool:
    """Set VmHWM back to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(model_path: str, dtype_name: str, path_kind: str) -> dict[str, float | str]:
    """One load in this process; called in a fresh subprocess."""
    import torch

    import tokenmill.engine.runner as runner_module
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.model.loader import load_model_config, load_weights, resolve_model_path

    dtype = getattr(torch, dtype_name)
    path = resolve_model_path(model_path or None)
    cfg = load_model_config(path)

    def peak_bytes() -> int:
        return (_status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    loaded: dict[str, float] = {}
    select_backend = runner_module.select_backend

    def select_and_watch(*args, **kwargs):  # the weights are in when the runner asks for packed copies
        backend = select_backend(*args, **kwargs)
        prepack = backend.prepack

        def watched(model):
            loaded.update(seconds=time.perf_counter() - t0, peak=peak_bytes() - before,
                          params=sum(p.numel() * p.element_size() for p in model.parameters()))
            return prepack(model)

        backend.prepack = watched
        return backend

    runner_module.select_backend = select_and_watch
    gc.collect()
    exact = _reset_peak()
    before = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    weights = load_weights(path, cfg) if path_kind == "engine" else load_weights(path, cfg, dtype)
    # as the engine builds it: batch_invariant is its default (a tree that predates the option has no such argument)
    kw = {"batch_invariant": True} if "batch_invariant" in inspect.signature(ModelRunner).parameters else {}
    runner = ModelRunner(cfg, weights, dtype, "cpu", num_blocks=1, block_size=16, **kw)
    del weights
    seconds = time.perf_counter() - t0
    peak = peak_bytes() - before
    held = _status_kib("VmRSS") * 1024 - before
    model = runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)  # meta: released
    packed = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in model.linear_layers()
                 if m.packed_weight is not None)
    return {"dtype": dtype_name, "path": path_kind, "load_s": loaded["seconds"], "load_peak": loaded["peak"],
            "load_params": loaded["params"],
            "seconds": seconds, "peak": peak, "held": held, "params": params, "packed": packed,
            "peak_source": "VmHWM" if exact else "ru_maxrss"}


def run_child(tree: str | None, model: str, dtype_name: str, path_kind: str) -> dict[str, float | str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, __file__, "--child", model, dtype_name, path_kind], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(runs: list[dict[str, float | str]]) -> dict[str, float | str]:
    """The run with the lowest peak (the least disturbed by other work), with the fastest times seen."""
    row = dict(min(runs, key=lambda r: r["peak"]))
    row["seconds"] = min(r["seconds"] for r in runs)
    row["load_s"] = min(r["load_s"] for r in runs)
    return row


def table(rows: list[tuple[str, dict[str, float | str]]]) -> str:
    lines = [("| tree | dtype | path | load s | load peak MiB | load peak / params loaded | runner s | "
              "runner peak MiB | runner peak / final weights | final: params MiB | final: packed MiB | held MiB |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tree, r in rows:
        params, packed = r["params"], r["packed"]  # what stays: plain parameters still held, packed copies
        loaded = r.get("load_params", params)
        lines.append(f"| {tree} | {r['dtype']} | {r['path']} | {r['load_s']:.2f} | {r['load_peak'] / MiB:.0f} | "
                     f"{r['load_peak'] / loaded:.2f}x | {r['seconds']:.2f} | {r['peak'] / MiB:.0f} | "
                     f"{r['peak'] / (params + packed):.2f}x | {params / MiB:.0f} | {packed / MiB:.0f} | "
                     f"{r['held'] / MiB:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a GGUF file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--repeat", type=int, default=1, help="fresh loads per row; the least disturbed is kept")
    ap.add_argument("--baseline-tree", default=None, help="another checkout, measured the same way")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "DTYPE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from long_prefill import cpu_line  # benchmarks/ is on sys.path as the script's folder

    trees = {"this tree": None, **({f"baseline {args.baseline_tree}": args.baseline_tree}
                                   if args.baseline_tree else {})}
    rows = []
    for dtype_name in args.dtypes:
        for path_kind in args.paths:
            runs: dict[str, list[dict[str, float | str]]] = {name: [] for name in trees}
            for _ in range(args.repeat):  # alternate the trees, so drifting load on the machine hits both
                for name, tree in trees.items():
                    runs[name].append(run_child(tree, args.model, dtype_name, path_kind))
            rows += [(name, best(r)) for name, r in runs.items()]
    print(f"CPU: {cpu_line()}; model: {args.model or 'the bundled SmolLM2-135M-Instruct Q4_1 GGUF'}")
    print(f"peak RSS from {rows[0][1]['peak_source']}, relative to the RSS before loading")
    print(table(rows))


if __name__ == "__main__":
    main()
