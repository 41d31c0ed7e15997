"""The device table: memory, bandwidth and dense tensor rates from vendor datasheets, plus this machine's CPU.

All rates are *dense* (no 2:4 sparsity): NVIDIA datasheets print the sparse figure with an asterisk, and
the dense one is half of it. Memory is the datasheet's capacity in decimal GB (1 GB = 1e9 bytes); HBM parts
expose a little more in practice, which the runtime reserve absorbs. Prices are rough on-demand cloud list
prices per device-hour (2025, GPU clouds rather than hyperscalers) and only a default: pass
--price-per-hour to use yours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from tokenmill.planner.common import COMPUTE_CLASS, PlanError

TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or the host CPU) as the roofline sees it."""

    key: str
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float  # dense BF16/FP16 tensor rate
    fp8_flops: float | None  # dense FP8 tensor rate; None where the device has no FP8 units
    fp32_flops: float  # dense TF32 (GPU) / FP32 (CPU) rate, for fp32 weights
    usd_per_hour: float | None
    source: str

    def peak_flops(self, dtype: str) -> float:
        """Peak dense rate for weights of `dtype` (fp8 falls back to the BF16 rate without FP8 units)."""
        kind = COMPUTE_CLASS.get(dtype, "bf16")
        if kind == "fp8":
            return self.fp8_flops or self.bf16_flops
        if kind == "fp32":
            return self.fp32_flops
        return self.bf16_flops


GPUS: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column:
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # 80 GB HBM3, 3.35 TB/s; BF16 1,979 TFLOPS* and FP8 3,958 TFLOPS* (*with sparsity) -> 989 / 1,979 dense;
    # TF32 989* -> 494.5 dense.
    "h100": Hardware("h100", "NVIDIA H100 SXM 80GB", 80 * 10**9, 3.35e12, 989 * TERA, 1979 * TERA,
                     494.5 * TERA, 2.99,
                     "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; same Hopper die and tensor rates as H100 SXM.
    # https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446
    "h200": Hardware("h200", "NVIDIA H200 SXM 141GB", 141 * 10**9, 4.8e12, 989 * TERA, 1979 * TERA,
                     494.5 * TERA, 3.79,
                     "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"),
    # NVIDIA A100 datasheet: A100 80GB SXM 2,039 GB/s; BF16 312 TFLOPS dense (624 sparse); TF32 156 dense;
    # Ampere has no FP8 tensor cores.
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    "a100-80g": Hardware("a100-80g", "NVIDIA A100 SXM 80GB", 80 * 10**9, 2.039e12, 312 * TERA, None,
                         156 * TERA, 1.79,
                         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # Same datasheet, A100 40GB SXM: 40 GB HBM2, 1,555 GB/s; same tensor rates.
    "a100-40g": Hardware("a100-40g", "NVIDIA A100 SXM 40GB", 40 * 10**9, 1.555e12, 312 * TERA, None,
                         156 * TERA, 1.29,
                         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; BF16 362.05 dense (733* sparse); FP8 733 dense
    # (1,466*); TF32 183 dense (366*).  https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
    "l40s": Hardware("l40s", "NVIDIA L40S 48GB", 48 * 10**9, 864e9, 362.05 * TERA, 733 * TERA,
                     183 * TERA, 0.99, "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    # AMD Instinct MI300X data sheet: 192 GB HBM3, 5.3 TB/s; peak dense BF16 1,307.4 TFLOPS, FP8 2,614.9,
    # TF32 653.7.
    # https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf
    "mi300x": Hardware("mi300x", "AMD Instinct MI300X 192GB", 192 * 10**9, 5.3e12, 1307.4 * TERA,
                       2614.9 * TERA, 653.7 * TERA, 2.49,
                       "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
                       "amd-instinct-mi300x-data-sheet.pdf"),
}

# This machine's CPU, when nothing is measured. 24 GB/s is what one or two DDR4/DDR5 channels sustain under
# a single process, deliberately conservative; --measure replaces it with a measured copy bandwidth.
CPU_DEFAULT_BANDWIDTH = 24e9
# Per core: 2.5 GHz x 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOPs = 80 GFLOP/s peak; 50 is what a well-tuned
# fp32 GEMM tends to reach. --measure replaces it with a measured matmul rate.
CPU_DEFAULT_FLOPS_PER_CORE = 50e9
# Rough on-demand price of one general-purpose cloud vCPU-hour, for a cost figure on `--gpu cpu`.
CPU_USD_PER_CORE_HOUR = 0.04
CPU_KEY = "cpu"

HARDWARE_KEYS = (*GPUS, CPU_KEY)


def host_memory_bytes() -> int:
    """Total RAM of this machine: /proc/meminfo MemTotal, else sysconf."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def cpu_hardware(bandwidth: float | None = None, flops: float | None = None) -> Hardware:
    """This machine as a device; `bandwidth`/`flops` are measured values when --measure supplies them."""
    cores = os.cpu_count() or 1
    rate = flops if flops is not None else cores * CPU_DEFAULT_FLOPS_PER_CORE
    bw = bandwidth if bandwidth is not None else CPU_DEFAULT_BANDWIDTH
    how = "measured" if bandwidth is not None else "assumed"
    return Hardware(
        key=CPU_KEY, name=f"this machine's CPU ({cores} cores, {how} bandwidth)",
        memory_bytes=host_memory_bytes(), bandwidth_bytes_per_s=bw,
        bf16_flops=rate, fp8_flops=None, fp32_flops=rate,
        usd_per_hour=cores * CPU_USD_PER_CORE_HOUR, source="/proc/meminfo; bandwidth " + how,
    )


def get_hardware(key: str, *, usd_per_hour: float | None = None) -> Hardware:
    """Look up --gpu (case-insensitive), applying a --price-per-hour override."""
    k = (key or "").strip().lower()
    if k == CPU_KEY:
        hw = cpu_hardware()
    elif k in GPUS:
        hw = GPUS[k]
    else:
        raise PlanError(f"--gpu must be one of {', '.join(HARDWARE_KEYS)}; got {key!r}")
    if usd_per_hour is not None:
        if usd_per_hour < 0:
            raise PlanError(f"--price-per-hour must be >= 0, got {usd_per_hour}")
        hw = replace(hw, usd_per_hour=usd_per_hour)
    return hw
