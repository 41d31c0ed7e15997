"""Shared pieces of the planner: its error type, the dtype tables and human formatting of sizes."""

from __future__ import annotations

from tokenmill.errors import ConfigError


class PlanError(ConfigError):
    """A `tokenmill plan` flag is invalid; the message names the flag and what it accepts.

    A ValueError (through ConfigError), so library callers can catch it as such; the CLI prints it
    as `error: ...` and exits with status 2.
    """


# Bytes stored per weight parameter.
#   bf16/fp16: 2 bytes. fp32: 4 bytes (what the engine runs on CPU; used by --measure).
#   fp8: 1 byte; one scale per tensor or per output channel, negligible next to the weights.
#   int8: 1 byte; per-output-channel fp16 scales, negligible.
#   int4: 0.5 byte + one fp16 scale per group of INT4_GROUP_SIZE weights (GPTQ/AWQ style, symmetric,
#         no zero point): 4 + 16/128 = 4.125 bits = 0.515625 bytes.
# Assumption: every parameter (embeddings and LM head included) is stored at the chosen dtype; real
# deployments often keep the embeddings in 16 bits, which matters only for small-vocabulary-heavy models.
INT4_GROUP_SIZE = 128
WEIGHT_BYTES_PER_PARAM: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp32": 4.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2.0 / INT4_GROUP_SIZE,
}

# Bytes per cached K or V element.
KV_BYTES_PER_ELEMENT: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

# Which tensor-core rate a weight dtype computes at. fp8 is W8A8 (FP8 GEMMs, the FP8 column where the
# device has one); int8 and int4 are weight-only (W8A16 / W4A16: dequantised to bf16 in the GEMM), so they
# save bytes, not FLOPs; fp32 uses the TF32/FP32 column.
COMPUTE_CLASS: dict[str, str] = {
    "bf16": "bf16", "fp16": "bf16", "int8": "bf16", "int4": "bf16", "fp8": "fp8", "fp32": "fp32",
}

# The dtypes the issue names first; the extra ones (fp16, fp32) are accepted too.
WEIGHT_DTYPES = tuple(WEIGHT_BYTES_PER_PARAM)
KV_DTYPES = tuple(KV_BYTES_PER_ELEMENT)


def weight_bytes_per_param(dtype: str) -> float:
    """Bytes per parameter for --dtype, or a PlanError naming the allowed values."""
    try:
        return WEIGHT_BYTES_PER_PARAM[dtype]
    except KeyError:
        raise PlanError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}; got {dtype!r}") from None


def kv_bytes_per_element(kv_dtype: str) -> int:
    """Bytes per K/V element for --kv-dtype, or a PlanError naming the allowed values."""
    try:
        return KV_BYTES_PER_ELEMENT[kv_dtype]
    except KeyError:
        raise PlanError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}") from None


def fmt_bytes(n: float) -> str:
    """Decimal units (GB = 1e9 bytes), as datasheets print memory sizes."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """Parameter counts: 70.55B, 134.5M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_rate(n: float) -> str:
    """Bandwidth in bytes/s."""
    return f"{fmt_bytes(n)}/s"
