"""Pick, for every GPU in the table, the cheapest deployment meeting a latency and/or throughput target.

For each GPU and each TP degree in 1, 2, 4, 8 that the heads allow and that fits the model, the batch is
the largest one up to --batch (and up to the sequences whose KV fits) whose decode step meets
--target-tpot-ms (a step gets slower as the batch grows, so a bisection finds it). Enough replicas of
that deployment are added to reach --target-throughput (output tokens/s, all replicas together).
Replicas do not change the cost per token, so the GPUs are ranked by cost per million output tokens,
then by GPU count. The CPU is left out: it has no comparable price or scale-out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from tokenmill.planner.common import PlanError
from tokenmill.planner.hardware import GPUS, Hardware
from tokenmill.planner.models import ModelShape
from tokenmill.planner.roofline import (
    TP_CANDIDATES,
    Deployment,
    decode_step_seconds,
    memory_fit,
    usd_per_million,
    valid_tp_degrees,
    validate,
)


@dataclass
class Recommendation:
    """One GPU's cheapest deployment that meets the targets."""

    gpu: str
    gpu_name: str
    tp: int
    pp: int
    replicas: int
    n_gpus: int
    batch: int
    decode_step_ms: float
    tokens_per_s: float  # all replicas together
    usd_per_hour: float
    usd_per_million_tokens: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _largest_batch(model: ModelShape, dep: Deployment, max_batch: int, tpot_s: float | None) -> int:
    """Largest batch in [1, max_batch] whose decode step is within tpot_s (0 if even batch 1 misses)."""
    def ok(b: int) -> bool:
        return tpot_s is None or decode_step_seconds(model, dep, b)[0] <= tpot_s

    if not ok(1):
        return 0
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _best_for_gpu(model: ModelShape, base: Deployment, hw: Hardware, tpot_ms: float | None,
                  throughput: float | None) -> Recommendation | None:
    best: Recommendation | None = None
    for tp in TP_CANDIDATES:
        if tp not in valid_tp_degrees(model):
            continue
        dep = replace(base, hardware=hw, tp=tp)
        max_seqs = memory_fit(model, dep)[3]
        if max_seqs < 1:
            continue
        tpot_s = None if tpot_ms is None else tpot_ms / 1e3
        batch = _largest_batch(model, dep, min(base.batch, max_seqs), tpot_s)
        if batch == 0:
            continue
        step_s = decode_step_seconds(model, dep, batch)[0]
        tps = batch / step_s
        replicas = max(1, math.ceil(throughput / tps)) if throughput else 1
        price = (hw.usd_per_hour or 0.0) * dep.n_devices
        cost = usd_per_million(price, tps) or 0.0
        cand = Recommendation(hw.key, hw.name, tp, dep.pp, replicas, replicas * dep.n_devices, batch,
                              step_s * 1e3, tps * replicas, price * replicas, cost)
        if best is None or _rank(cand) < _rank(best):
            best = cand
    return best


def _rank(r: Recommendation) -> tuple[float, int]:
    return r.usd_per_million_tokens, r.n_gpus


def recommend(model: ModelShape, base: Deployment, *, target_tpot_ms: float | None = None,
              target_throughput: float | None = None,
              price_overrides: dict[str, float] | None = None) -> list[Recommendation]:
    """Every GPU's cheapest deployment meeting the targets, cheapest per million tokens first."""
    if target_tpot_ms is not None and target_tpot_ms <= 0:
        raise PlanError(f"--target-tpot-ms must be positive, got {target_tpot_ms}")
    if target_throughput is not None and target_throughput <= 0:
        raise PlanError(f"--target-throughput must be positive, got {target_throughput}")
    validate(model, replace(base, tp=1))
    out = []
    for key, hw in GPUS.items():
        if price_overrides and key in price_overrides:
            hw = replace(hw, usd_per_hour=price_overrides[key])
        rec = _best_for_gpu(model, base, hw, target_tpot_ms, target_throughput)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=_rank)
