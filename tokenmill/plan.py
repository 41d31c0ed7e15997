"""`tokenmill plan`: will this model fit on that GPU, how fast will it decode, and what will a token cost?

    tokenmill plan --model llama-3-70b --gpu h100 --tp 2 --context 8192 --batch 16
    tokenmill plan --model llama-3-8b --target-tpot-ms 20 --target-throughput 5000 --batch 64
    tokenmill plan --list
    tokenmill plan --gpu cpu --measure          # the real engine here, beside the roofline

The arithmetic lives in tokenmill.planner (models, hardware, roofline, recommend, measure); this module
is the command line: flags in, a table or one JSON object out. `python -m tokenmill.plan` works too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import TokenmillError
from tokenmill.planner.common import KV_DTYPES, WEIGHT_DTYPES
from tokenmill.planner.hardware import GPUS, HARDWARE_KEYS, get_hardware
from tokenmill.planner.measure import Measurement
from tokenmill.planner.model_files import load_model
from tokenmill.planner.models import PRESETS, ModelShape
from tokenmill.planner.recommend import Recommendation, recommend
from tokenmill.planner.roofline import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    RUNTIME_RESERVE_FRACTION,
    Deployment,
    Plan,
    plan,
)

DEFAULTS: dict[str, Any] = {
    "model": None, "gpu": "h100", "tp": 1, "pp": 1, "cp": 1, "dtype": None, "kv_dtype": "bf16", "context": 8192,
    "batch": 1, "price_per_hour": None, "target_tpot_ms": None, "target_throughput": None,
    "bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "compute_efficiency": COMPUTE_EFFICIENCY,
    "reserve_fraction": RUNTIME_RESERVE_FRACTION, "json": False, "list": False, "measure": False,
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` flags. Choices are checked by run_plan (not argparse) so every bad value gets one
    `error: --flag must be one of ...` message and exit status 2."""
    a = parser.add_argument
    a("--model", default=None, metavar="PATH|PRESET",
      help=f"a preset ({', '.join(PRESETS)}), a Hugging Face model directory or a .gguf file "
           "(default: the embedded SmolLM2-135M GGUF)")
    a("--gpu", default=DEFAULTS["gpu"], metavar="|".join(HARDWARE_KEYS),
      help="device kind; cpu is this machine (default: %(default)s)")
    a("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    a("--pp", type=int, default=1, help="pipeline-parallel stages (default: 1)")
    a("--cp", type=int, default=1, help="context-parallel ranks: the whole model on each, every sequence's KV split "
                                        "over them (default: 1)")
    a("--dtype", default=None, metavar="|".join(WEIGHT_DTYPES),
      help="weight dtype (default: bf16; a GGUF file's own tensor bytes)")
    a("--kv-dtype", default="bf16", metavar="|".join(KV_DTYPES), help="KV cache dtype (default: bf16)")
    a("--context", type=int, default=DEFAULTS["context"], metavar="L",
      help="tokens per sequence (default: %(default)s)")
    a("--batch", type=int, default=1, metavar="B",
      help="concurrent sequences per decode step; the largest considered by a recommendation (default: 1)")
    a("--price-per-hour", type=float, default=None, metavar="USD",
      help="price of one device-hour (default: a rough on-demand cloud price per device)")
    a("--target-tpot-ms", type=float, default=None, metavar="MS",
      help="recommend GPUs whose decode step is at most this")
    a("--target-throughput", type=float, default=None, metavar="TOK_PER_S",
      help="recommend GPUs (with replicas) reaching this many output tokens/s")
    a("--bandwidth-efficiency", type=float, default=BANDWIDTH_EFFICIENCY, metavar="FRACTION",
      help="achievable fraction of peak bandwidth (default: %(default)s = pure roofline)")
    a("--compute-efficiency", type=float, default=COMPUTE_EFFICIENCY, metavar="FRACTION",
      help="achievable fraction of peak FLOPs (default: %(default)s = pure roofline)")
    a("--reserve-fraction", type=float, default=RUNTIME_RESERVE_FRACTION, metavar="FRACTION",
      help="device memory kept for the runtime: activations, CUDA context (default: %(default)s)")
    a("--json", action="store_true", help="print one JSON object instead of tables")
    a("--list", action="store_true", help="list the model presets and the device table")
    a("--measure", action="store_true",
      help="run the real engine on this machine and print its decode step beside the roofline")


def _opt(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, DEFAULTS[name])


@dataclass
class PlanReport:
    """One deployment's plan, plus the recommendation and the measurement when asked for."""

    model: ModelShape
    plan: Plan
    recommendations: list[Recommendation] | None = None
    measured: Measurement | None = None

    def to_dict(self) -> dict[str, Any]:
        """The --json object: the plan's fields at top level, then `recommendations` and `measured`."""
        out = self.plan.to_dict()
        if self.recommendations is not None:
            out["recommendations"] = [r.to_dict() for r in self.recommendations]
        if self.measured is not None:
            out["measured"] = self.measured.to_dict()
        return out


def build_report(args: argparse.Namespace) -> PlanReport:
    """Everything `plan` prints. Raises PlanError on bad input."""
    model = load_model(_opt(args, "model"))
    price = _opt(args, "price_per_hour")
    hardware = get_hardware(_opt(args, "gpu"), usd_per_hour=price)
    dep = Deployment(
        hardware=hardware, tp=_opt(args, "tp"), pp=_opt(args, "pp"), cp=_opt(args, "cp"), dtype=_opt(args, "dtype"),
        kv_dtype=_opt(args, "kv_dtype"), context=_opt(args, "context"), batch=_opt(args, "batch"),
        bandwidth_efficiency=_opt(args, "bandwidth_efficiency"),
        compute_efficiency=_opt(args, "compute_efficiency"), reserve_fraction=_opt(args, "reserve_fraction"),
    )
    report = PlanReport(model, plan(model, dep))
    tpot, throughput = _opt(args, "target_tpot_ms"), _opt(args, "target_throughput")
    if tpot is not None or throughput is not None:
        overrides = {hardware.key: price} if price is not None and hardware.key in GPUS else None
        report.recommendations = recommend(model, dep, target_tpot_ms=tpot, target_throughput=throughput,
                                           price_overrides=overrides)
    if _opt(args, "measure"):
        from tokenmill.planner.measure import measure

        report.measured = measure(_opt(args, "model"), dep.batch, _opt(args, "dtype"), kv_dtype=_opt(args, "kv_dtype"))
    return report


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of `tokenmill plan`: 0 on success, 2 (with `error: ...` on stderr) on bad input."""
    try:
        if _opt(args, "list"):
            return _print_list(args)
        report = build_report(args)
    except (TokenmillError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _opt(args, "json"):
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_tables(report, args)
    return 0


def _print_list(args: argparse.Namespace) -> int:
    if _opt(args, "json"):
        presets = {name: {"params": m.params, **{k: getattr(m, k) for k in _SHAPE_FIELDS}}
                   for name, m in PRESETS.items()}
        gpus = {k: {f: getattr(h, f) for f in _GPU_FIELDS} for k, h in GPUS.items()}
        print(json.dumps({"presets": presets, "gpus": gpus}, indent=2))
        return 0
    from tokenmill.planner.report import make_console, render_list

    render_list(make_console())
    return 0


_SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "vocab_size", "tie_word_embeddings", "source")
_GPU_FIELDS = ("name", "memory_bytes", "bandwidth_bytes_per_s", "bf16_flops", "fp8_flops", "usd_per_hour",
               "source")


def _print_tables(report: PlanReport, args: argparse.Namespace) -> None:
    from tokenmill.planner.report import make_console, render_measurement, render_plan, render_recommendations

    console = make_console()
    render_plan(console, report.model, report.plan)
    if report.recommendations is not None:
        console.print()
        render_recommendations(console, report.recommendations, _opt(args, "target_tpot_ms"),
                               _opt(args, "target_throughput"))
    if report.measured is not None:
        console.print()
        render_measurement(console, report.measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill plan", description=__doc__.split("\n\n")[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
