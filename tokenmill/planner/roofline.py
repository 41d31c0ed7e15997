"""Memory fit and roofline timing of one deployment: a model on `tp x pp` (or `cp`) devices of one kind.

The model, stated once:

* Memory per device = weights / (tp x pp) + a runtime reserve + KV cache. The reserve
  (RUNTIME_RESERVE_FRACTION of device memory: CUDA context, activations, allocator fragmentation, CUDA
  graphs) matches vLLM's default gpu_memory_utilization of 0.9. Everything left holds KV blocks.
* KV bytes per token = 2 (K and V) x attention layers x KV heads x head_dim x bytes. Grouped-query attention
  stores the KV heads, not the query heads. Tensor parallelism splits the KV heads across ranks; when
  tp > KV heads each KV head is replicated on tp / KV heads ranks (as vLLM does), so a rank still holds
  one head per layer.
* A hybrid's state layers (LFM2's short convolutions) keep no KV but a fixed state per running sequence,
  whatever its length (planner/layers.py; float32, as the engine keeps it). A sequence's memory is its KV
  over the context plus that state: the KV-per-sequence figure and the sequences that fit count both.
  Tensor parallelism splits the state's channels; each context-parallel rank holds it whole. A decode
  step reads and writes each sequence's state.
* A decode step at batch B reads the weights once and each sequence's KV cache once, and does
  2 x params x B matmul FLOPs plus 4 x attention layers x heads x head_dim x context x B attention
  FLOPs. The step takes max(bytes / bandwidth, FLOPs / peak): the larger wins (roofline). Tensor
  parallelism divides both the bytes and the FLOPs by tp. The all-reduce traffic of TP (2 per layer,
  B x hidden values each) is not modelled: on NVLink/Infinity Fabric it costs a few percent at small
  batch; on PCIe (L40S) it is larger.
* Pipeline parallelism splits the layers (and their KV) over pp stages, so it divides memory, but a
  token still passes through every stage in turn: the decode step latency stays the whole model's at the
  given tp, and with one batch in flight the deployment's throughput is the same as without pp (a
  conservative choice: interleaving pp micro-batches could approach pp x, if the memory for pp x B
  sequences is there). Tokens/s per device therefore drops with pp; use pp only to fit.
* Context parallelism (cp ranks, not combined with tp or pp) keeps the whole model on every device and splits
  each sequence's tokens and KV over them: KV per token per device and attention FLOPs divide by cp, and prefill's
  matmuls too (each rank computes its share of the prompt); a decode step's matmuls and weight reads do not (every
  rank computes a decode token, parallel/context.py). It is for contexts one device cannot hold.
* Prefill of L tokens (one prompt): 2 x params x L + 2 x attention layers x heads x head_dim x L^2
  (causal attention) FLOPs against reading the weights once and writing L tokens of KV.
* Efficiency: BANDWIDTH_EFFICIENCY and COMPUTE_EFFICIENCY scale the datasheet peaks. Both default to
  1.0, the pure roofline; measured engines reach roughly 0.7-0.85 of peak bandwidth and 0.5-0.7 of peak
  FLOPs, so real steps are slower. --bandwidth-efficiency / --compute-efficiency change them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenmill.planner.common import PlanError, fmt_bytes, kv_bytes_per_element, weight_bytes_per_param
from tokenmill.planner.hardware import Hardware
from tokenmill.planner.layers import pipeline_stages
from tokenmill.planner.models import ModelShape

RUNTIME_RESERVE_FRACTION = 0.10
BANDWIDTH_EFFICIENCY = 1.0
COMPUTE_EFFICIENCY = 1.0
TP_CANDIDATES = (1, 2, 4, 8)  # one node's worth of devices
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Deployment:
    """What to plan: a device kind, the parallelism, the dtypes and the workload (context, batch)."""

    hardware: Hardware
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dtype: str | None = None  # None: the model's own (bf16, or a GGUF's actual tensor bytes)
    kv_dtype: str = "bf16"
    context: int = 8192
    batch: int = 1
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    compute_efficiency: float = COMPUTE_EFFICIENCY
    reserve_fraction: float = RUNTIME_RESERVE_FRACTION

    @property
    def n_devices(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def weight_shards(self) -> int:
        """Devices the weights are split over (context-parallel ranks each hold them whole)."""
        return self.tp * self.pp


@dataclass
class Plan:
    """Every figure `tokenmill plan` prints; `to_dict` is the --json object."""

    model: str
    gpu: str
    gpu_name: str
    tp: int
    pp: int
    cp: int
    n_gpus: int
    dtype: str
    kv_dtype: str
    context: int
    batch: int
    params: int
    weights_bytes: int
    weights_bytes_per_gpu: int
    memory_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_sequence: int  # KV over the context, plus the state of a hybrid's state layers
    kv_bytes_per_sequence_per_gpu: int
    weights_fit: bool
    fits: bool
    max_concurrent_sequences: int
    min_tp_to_fit: int | None
    decode_step_ms: float
    decode_bound: str
    decode_bytes_per_gpu: float
    decode_flops_per_gpu: float
    prefill_ms: float
    prefill_bound: str
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    usd_per_hour_per_gpu: float | None
    usd_per_million_tokens: float | None
    bandwidth_bytes_per_s: float
    peak_flops: float
    # a hybrid's state layers: the fixed state one running sequence keeps, whatever its length (0: none)
    state_bytes_per_sequence: int = 0
    state_bytes_per_sequence_per_gpu: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- validation ----------------------------------------------------------------------------------

def valid_tp_degrees(model: ModelShape) -> list[int]:
    """TP degrees the model's heads allow: divisors of the query heads that shard or replicate KV heads."""
    return [d for d in range(1, model.num_heads + 1)
            if model.num_heads % d == 0 and (model.num_kv_heads % d == 0 or d % model.num_kv_heads == 0)]


def validate(model: ModelShape, dep: Deployment) -> None:
    """Reject impossible deployments with a message naming the flag."""
    sizes = (("--tp", dep.tp), ("--pp", dep.pp), ("--cp", dep.cp), ("--context", dep.context), ("--batch", dep.batch))
    for flag, value in sizes:
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{flag} must be a positive integer, got {value}")
    if dep.cp > 1 and dep.tp * dep.pp > 1:
        raise PlanError("--cp does not combine with --tp / --pp (nor does the engine's --context-parallel-size yet)")
    if dep.tp not in valid_tp_degrees(model):
        raise PlanError(
            f"--tp {dep.tp} does not divide the {model.num_heads} attention heads "
            f"({model.num_kv_heads} KV heads) of {model.name}; valid TP degrees: "
            f"{', '.join(map(str, valid_tp_degrees(model)))}")
    if dep.pp > model.num_layers:
        raise PlanError(f"--pp {dep.pp} exceeds the {model.num_layers} layers of {model.name}")
    if dep.dtype is not None:
        weight_bytes_per_param(dep.dtype)
    kv_bytes_per_element(dep.kv_dtype)
    for flag, frac in (("--bandwidth-efficiency", dep.bandwidth_efficiency),
                       ("--compute-efficiency", dep.compute_efficiency)):
        if not 0 < frac <= 1:
            raise PlanError(f"{flag} must be in (0, 1], got {frac}")
    if not 0 <= dep.reserve_fraction < 1:
        raise PlanError(f"--reserve-fraction must be in [0, 1), got {dep.reserve_fraction}")


# -- memory --------------------------------------------------------------------------------------

def kv_bytes_per_token(model: ModelShape, kv_dtype: str) -> int:
    """2 x attention layers x KV heads x head_dim x bytes (the whole model, one token)."""
    return model.kv_elements_per_token() * kv_bytes_per_element(kv_dtype)


def kv_heads_per_rank(model: ModelShape, tp: int) -> int:
    """KV heads one TP rank stores: sharded while tp <= KV heads, then one replicated head."""
    return max(model.num_kv_heads // tp, 1)


def kv_bytes_per_token_per_gpu(model: ModelShape, tp: int, pp: int, kv_dtype: str, cp: int = 1) -> int:
    """One token's KV on the most loaded device (pp stages split layers; the first stages get the extra), on
    average over a sequence's tokens under context parallelism (each rank keeps 1/cp of them)."""
    layers = max(model.attention_layers_in(stage) for stage in pipeline_stages(model.num_layers, pp))
    return math.ceil(2 * layers * kv_heads_per_rank(model, tp) * model.head_dim * kv_bytes_per_element(kv_dtype) / cp)


def state_bytes_per_sequence_per_gpu(model: ModelShape, tp: int, pp: int) -> int:
    """One sequence's state on the device whose pipeline stage holds the most (0 without state layers):
    tp splits its channels; context-parallel ranks each hold it whole."""
    if not model.state_layers:
        return 0
    most = max(model.state_bytes_in(stage) for stage in pipeline_stages(model.num_layers, pp))
    return math.ceil(most / tp)


def sequence_bytes_per_gpu(model: ModelShape, dep: Deployment) -> int:
    """One sequence of `context` tokens on a device: its KV, and a hybrid's state (each at its most loaded
    pipeline stage)."""
    return (kv_bytes_per_token_per_gpu(model, dep.tp, dep.pp, dep.kv_dtype, dep.cp) * dep.context
            + state_bytes_per_sequence_per_gpu(model, dep.tp, dep.pp))


def memory_fit(model: ModelShape, dep: Deployment) -> tuple[int, int, int, int]:
    """(weights per device, reserve, bytes left for KV and state, sequences of `context` tokens that fit)."""
    weights_per_gpu = math.ceil(model.weight_bytes(dep.dtype) / dep.weight_shards)
    reserve = int(dep.hardware.memory_bytes * dep.reserve_fraction)
    budget = dep.hardware.memory_bytes - reserve - weights_per_gpu
    per_seq = max(sequence_bytes_per_gpu(model, dep), 1)
    return weights_per_gpu, reserve, budget, max(budget // per_seq, 0)


def min_tp_to_fit(model: ModelShape, dep: Deployment) -> int | None:
    """Smallest TP in 1, 2, 4, 8 (allowed by the heads) that holds the weights and one sequence."""
    for tp in TP_CANDIDATES:
        if tp in valid_tp_degrees(model) and memory_fit(model, replace(dep, tp=tp))[3] >= 1:
            return tp
    return None


# -- time ----------------------------------------------------------------------------------------

def _rates(model: ModelShape, dep: Deployment) -> tuple[float, float]:
    bw = dep.hardware.bandwidth_bytes_per_s * dep.bandwidth_efficiency
    weight_dtype = dep.dtype or model.default_dtype
    peak = dep.hardware.peak_flops(weight_dtype) * dep.compute_efficiency
    return bw, peak


def _decode_weight_bytes(model: ModelShape, dep: Deployment, tokens: int) -> float:
    """Weight bytes a step of `tokens` tokens reads (a mixture of experts: the experts they are routed to)."""
    return model.weight_bytes(dep.dtype) * model.decode_params_read(tokens) / model.params


def decode_cost(model: ModelShape, dep: Deployment, batch: int | None = None) -> tuple[float, float]:
    """(bytes, FLOPs) per device of one decode step, summed over the pipeline stages."""
    b = dep.batch if batch is None else batch
    kv_rank = kv_bytes_per_token_per_gpu(model, dep.tp, 1, dep.kv_dtype, dep.cp)
    state_rank = state_bytes_per_sequence_per_gpu(model, dep.tp, 1)  # read, updated and written back
    nbytes = _decode_weight_bytes(model, dep, b) / dep.tp + b * dep.context * kv_rank + 2 * b * state_rank
    attn = 4 * model.attention_layer_count * model.num_heads * model.head_dim * dep.context * b / dep.cp
    flops = (2 * model.decode_active_params * b + attn) / dep.tp
    return nbytes, flops


def decode_step_seconds(model: ModelShape, dep: Deployment, batch: int | None = None) -> tuple[float, str]:
    """(seconds, "memory" | "compute") of one decode step at batch B."""
    nbytes, flops = decode_cost(model, dep, batch)
    bw, peak = _rates(model, dep)
    t_mem, t_compute = nbytes / bw, flops / peak
    return (t_mem, "memory") if t_mem >= t_compute else (t_compute, "compute")


def prefill_seconds(model: ModelShape, dep: Deployment) -> tuple[float, str]:
    """(seconds, bound) of prefilling one prompt of `context` tokens."""
    n = dep.context
    attn = 2 * model.attention_layer_count * model.num_heads * model.head_dim * n * n
    body = model.body_params - (model.decode_params - model.decode_active_params)  # a token's k experts only
    flops = (2 * body * n + 2 * model.lm_head_params + attn) / dep.tp / dep.cp
    kv_write = n * kv_bytes_per_token_per_gpu(model, dep.tp, 1, dep.kv_dtype, dep.cp)
    state_write = state_bytes_per_sequence_per_gpu(model, dep.tp, 1)
    nbytes = _decode_weight_bytes(model, dep, n) / dep.tp + kv_write + state_write
    bw, peak = _rates(model, dep)
    t_mem, t_compute = nbytes / bw, flops / peak
    return (t_mem, "memory") if t_mem >= t_compute else (t_compute, "compute")


def usd_per_million(usd_per_hour_total: float | None, tokens_per_s: float) -> float | None:
    """Cost of a million output tokens at a steady `tokens_per_s`."""
    if usd_per_hour_total is None or tokens_per_s <= 0:
        return None
    return usd_per_hour_total / SECONDS_PER_HOUR / tokens_per_s * 1e6


# -- the plan ------------------------------------------------------------------------------------

def plan(model: ModelShape, dep: Deployment) -> Plan:
    """All figures for one deployment (raises PlanError for impossible inputs)."""
    validate(model, dep)
    hw = dep.hardware
    weights_per_gpu, reserve, budget, max_seqs = memory_fit(model, dep)
    kv_tok = kv_bytes_per_token(model, dep.kv_dtype)
    kv_tok_gpu = kv_bytes_per_token_per_gpu(model, dep.tp, dep.pp, dep.kv_dtype, dep.cp)
    state = model.state_bytes_per_sequence
    state_gpu = state_bytes_per_sequence_per_gpu(model, dep.tp, dep.pp)
    step_s, bound = decode_step_seconds(model, dep)
    prefill_s, prefill_bound = prefill_seconds(model, dep)
    nbytes, flops = decode_cost(model, dep)
    bw, peak = _rates(model, dep)
    tps = dep.batch / step_s
    price = hw.usd_per_hour
    result = Plan(
        model=model.name, gpu=hw.key, gpu_name=hw.name, tp=dep.tp, pp=dep.pp, cp=dep.cp, n_gpus=dep.n_devices,
        dtype=model.dtype_label(dep.dtype), kv_dtype=dep.kv_dtype, context=dep.context, batch=dep.batch,
        params=model.params, weights_bytes=model.weight_bytes(dep.dtype),
        weights_bytes_per_gpu=weights_per_gpu,
        memory_bytes_per_gpu=hw.memory_bytes, reserve_bytes_per_gpu=reserve,
        kv_budget_bytes_per_gpu=max(budget, 0),
        kv_bytes_per_token=kv_tok, kv_bytes_per_token_per_gpu=kv_tok_gpu,
        kv_bytes_per_sequence=kv_tok * dep.context + state,
        kv_bytes_per_sequence_per_gpu=kv_tok_gpu * dep.context + state_gpu,
        weights_fit=budget >= 0, fits=max_seqs >= 1, max_concurrent_sequences=int(max_seqs),
        min_tp_to_fit=min_tp_to_fit(model, dep),
        decode_step_ms=step_s * 1e3, decode_bound=bound,
        decode_bytes_per_gpu=nbytes, decode_flops_per_gpu=flops,
        prefill_ms=prefill_s * 1e3, prefill_bound=prefill_bound,
        tokens_per_s=tps, tokens_per_s_per_gpu=tps / dep.n_devices,
        usd_per_hour_per_gpu=price,
        usd_per_million_tokens=usd_per_million(None if price is None else price * dep.n_devices, tps),
        bandwidth_bytes_per_s=bw, peak_flops=peak,
        state_bytes_per_sequence=state, state_bytes_per_sequence_per_gpu=state_gpu,
    )
    result.warnings = _warnings(model, dep, result)
    return result


def _warnings(model: ModelShape, dep: Deployment, p: Plan) -> list[str]:
    out = []
    if not p.weights_fit:
        out.append(f"the weights ({fmt_bytes(p.weights_bytes_per_gpu)} per device) do not fit in "
                   f"{fmt_bytes(p.memory_bytes_per_gpu)} less the {dep.reserve_fraction:.0%} runtime reserve")
    elif not p.fits:
        out.append(f"the weights fit, but not one sequence of {dep.context} tokens "
                   f"({fmt_bytes(p.kv_bytes_per_sequence_per_gpu)} of KV per device)")
    if not p.fits:
        if p.min_tp_to_fit:
            out.append(f"does not fit at tp={dep.tp}; smallest TP that fits: {p.min_tp_to_fit}")
        else:
            out.append(f"no TP degree up to {TP_CANDIDATES[-1]} fits: add pipeline stages (--pp) "
                       "or quantise (--dtype)")
    elif dep.batch > p.max_concurrent_sequences:
        out.append(f"--batch {dep.batch} exceeds the {p.max_concurrent_sequences} sequences of {dep.context} "
                   "tokens whose KV fits; the figures assume it anyway")
    if model.max_context and dep.context > model.max_context:
        out.append(f"--context {dep.context} exceeds the model's {model.max_context}-token context window")
    if dep.tp > model.num_kv_heads:
        out.append(f"tp {dep.tp} > {model.num_kv_heads} KV heads: each KV head is replicated on "
                   f"{dep.tp // model.num_kv_heads} devices")
    if dep.dtype == "fp8" and dep.hardware.fp8_flops is None:
        out.append(f"{dep.hardware.name} has no FP8 tensor cores: fp8 saves memory but computes "
                   "at the BF16 rate")
    return out
