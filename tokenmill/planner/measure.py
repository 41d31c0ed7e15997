"""--measure: this machine's real bandwidth and FLOP rate, and the engine's decode step beside the roofline.

Bandwidth is the best of a few `dst.copy_(src)` over a 256 MiB tensor (each copy reads and writes it, so
2 x 256 MiB move), large enough to leave every cache level. The FLOP rate is the best of a few fp32
matmuls. The engine's decode step is (time(max_tokens=1+K) - time(max_tokens=1)) / K for a batch of B
prompts: both runs pay the same prefill, so the difference is K decode steps, scheduler and sampling
included. The roofline prediction uses the measured rates, so the ratio shows the engine's overhead, not
a datasheet's optimism.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.planner.common import PlanError
from tokenmill.planner.hardware import cpu_hardware
from tokenmill.planner.model_files import default_gguf_path, load_model
from tokenmill.planner.models import PRESETS, ModelShape
from tokenmill.planner.roofline import Deployment, decode_step_seconds, kv_bytes_per_token

BANDWIDTH_TENSOR_BYTES = 256 << 20
MATMUL_SIZE = 1024
REPEATS = 5
MEASURE_PROMPT_TOKENS = 32
MEASURE_DECODE_STEPS = 8
ENGINE_REPEATS = 2  # best of this many runs of each length
# planner --dtype -> how the engine runs it: (its --dtype, its --quantization)
ENGINE_FORMATS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"),
                  "fp8": ("bfloat16", "fp8"), "int4": ("bfloat16", "int4")}


@dataclass
class Measurement:
    """Measured against predicted, for this machine."""

    model: str
    engine_dtype: str
    engine_quantization: str | None
    batch: int
    prompt_tokens: int
    decode_steps: int
    bandwidth_bytes_per_s: float
    matmul_flops: float
    measured_decode_step_ms: float
    predicted_decode_step_ms: float
    predicted_bound: str
    ratio: float  # measured / predicted
    engine_weight_bytes: int  # what the engine's weights hold (its start-up log and /metrics say the same)
    predicted_weight_bytes: int  # the planner's params x bytes per parameter
    engine_kv_bytes_per_token: int = 0  # the engine's KV cache (its start-up log says the same)
    predicted_kv_bytes_per_token: int = 0  # the planner's, at the same KV dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _best_seconds(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = BANDWIDTH_TENSOR_BYTES, repeats: int = REPEATS) -> float:
    """Bytes/s of a large tensor copy (read + write counted), best of `repeats`."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats)


def measure_matmul_flops(n: int = MATMUL_SIZE, repeats: int = REPEATS) -> float:
    """FLOP/s of an n x n fp32 matmul, best of `repeats`."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / _best_seconds(lambda: a @ b, repeats)


def time_engine_decode_step(model_path: str | None, batch: int, prompt_tokens: int, steps: int,
                            engine_dtype: str, repeats: int = ENGINE_REPEATS,
                            quantization: str | None = None, kv_cache_dtype: str = "auto") -> tuple[float, int, int]:
    """Seconds per decode step of the real engine at batch `batch`, the bytes its weights hold and its KV bytes
    per token (imported here: it needs torch)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.runner import weight_bytes

    llm = LLM(model=model_path, dtype=engine_dtype, quantization=quantization, max_num_seqs=max(batch, 1),
              max_num_batched_tokens=max(512, batch * prompt_tokens), kv_cache_dtype=kv_cache_dtype)
    # Distinct prompts, so no two sequences share a prefix.
    prompts = [{"prompt_token_ids": [100 + (7 * j + 13 * i) % 1000 for j in range(prompt_tokens)]}
               for i in range(batch)]

    def run(max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)

    run(2)  # warm-up: allocations, first-call overheads
    t_one = _best_seconds(lambda: run(1), repeats)
    t_many = _best_seconds(lambda: run(1 + steps), repeats)
    return (max(t_many - t_one, 0.0) / steps, weight_bytes(llm.engine.core.runner.model),
            llm.engine.core.cache_info.kv_bytes_per_token)


def measure(model_spec: str | None, batch: int, dtype: str | None = None,
            prompt_tokens: int = MEASURE_PROMPT_TOKENS, steps: int = MEASURE_DECODE_STEPS,
            repeats: int = ENGINE_REPEATS, kv_dtype: str | None = None) -> Measurement:
    """Measure this machine and the engine on `model_spec` (a model file; None = the embedded SmolLM2); `kv_dtype`
    fp8 runs the engine with --kv-cache-dtype fp8, anything else with the cache in the compute dtype."""
    path = _engine_model_path(model_spec)
    shape: ModelShape = load_model(path)
    weight_dtype = dtype if dtype in ENGINE_FORMATS else "fp32"
    engine_dtype, quantization = ENGINE_FORMATS[weight_dtype]
    bandwidth = measure_bandwidth()
    flops = measure_matmul_flops()
    try:
        measured_s, engine_bytes, engine_kv = time_engine_decode_step(
            path, batch, prompt_tokens, steps, engine_dtype, repeats, quantization,
            "fp8" if kv_dtype == "fp8" else "auto")
    except ImportError as e:
        raise PlanError(f"--measure needs the tokenmill engine, which failed to import: {e}") from None
    dep = Deployment(hardware=cpu_hardware(bandwidth=bandwidth, flops=flops), dtype=weight_dtype,
                     kv_dtype="fp8" if kv_dtype == "fp8" else "fp32" if engine_dtype == "float32" else "bf16",
                     context=prompt_tokens + steps // 2, batch=batch)
    predicted_s, bound = decode_step_seconds(shape, dep)
    return Measurement(
        model=shape.name, engine_dtype=engine_dtype, engine_quantization=quantization, batch=batch,
        prompt_tokens=prompt_tokens,
        decode_steps=steps, bandwidth_bytes_per_s=bandwidth, matmul_flops=flops,
        measured_decode_step_ms=measured_s * 1e3, predicted_decode_step_ms=predicted_s * 1e3,
        predicted_bound=bound, ratio=measured_s / predicted_s, engine_weight_bytes=engine_bytes,
        predicted_weight_bytes=shape.weight_bytes(weight_dtype), engine_kv_bytes_per_token=engine_kv,
        predicted_kv_bytes_per_token=kv_bytes_per_token(shape, dep.kv_dtype),
    )


def _engine_model_path(model_spec: str | None) -> str | None:
    """The engine loads files, not presets: smollm2-135m maps to the embedded GGUF."""
    if model_spec is None:
        return default_gguf_path()
    key = model_spec.strip().lower()
    if key == "smollm2-135m":
        return default_gguf_path()
    if key in PRESETS:
        raise PlanError(f"--measure runs the real engine, which needs model weights: --model {model_spec} "
                        "is a preset; pass a Hugging Face directory or .gguf file (or omit --model for the "
                        "embedded SmolLM2-135M)")
    return model_spec
