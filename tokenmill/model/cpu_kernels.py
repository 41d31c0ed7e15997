"""Fast CPU kernels (C++, built on first use with torch's extension builder): paged attention, the skinny
linear layer, the fused elementwise ops of a decoder layer and the whole layer. model/backends/cpu.py is their
one caller; each has a plain-PyTorch equivalent in the TorchBackend, which runs when no compiler is available,
and is tested against it (tests/model/)."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("tokenmill")

# in csrc/ (benchmarks/kernel_ab.py builds them too)
SOURCE_NAMES = ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp", "linear.cpp", "decode_stack.cpp",
                "bf16_linear.cpp", "int8_linear.cpp", "gguf_linear.cpp", "gguf_vnni.cpp", "gguf_avx2.cpp",
                "f32_linear.cpp", "tile_attention.cpp", "lora.cpp", "moe.cpp", "recurrent.cpp")
# fast-math lets the compiler vectorize exp (glibc's libmvec); infinities stay meaningful (masked scores).
BUILD_FLAGS = ("-O3", "-fopenmp", "-march=native", "-ffast-math", "-fno-finite-math-only")
# $TOKENMILL_KERNEL_MARCH builds for an older target than this CPU instead (e.g. "haswell": AVX2 only), to run and
# measure, on an AVX-512 machine, the paths an older CPU takes; the build is named by the target too.
MARCH_ENV = "TOKENMILL_KERNEL_MARCH"


def build_flags() -> list[str]:
    march = os.environ.get(MARCH_ENV, "native")
    return [f"-march={march}" if f == "-march=native" else f for f in BUILD_FLAGS]
_SOURCES = [Path(__file__).parent / "csrc" / name for name in SOURCE_NAMES]
# part of the build's name too: a change rebuilds
_HEADERS = [Path(__file__).parent / "csrc" / name
            for name in ("kernels.h", "decode_stack.h", "dtypes.h", "simd.h", "tile_gemm.h", "work_split.h",
                         "gguf_quads.h")]


def _cpu_info() -> tuple[str, str]:
    """This CPU's model name and its sorted instruction-set flags, from /proc/cpuinfo where there is one."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == platform.machine():
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return model, flags


def cpu_tag() -> str:
    """A short key of this CPU's model and instruction sets. The kernels are built with -march=native, so a
    build made on one CPU can crash (SIGILL) on another: each CPU gets its own build, named by this key."""
    model, flags = _cpu_info()
    return hashlib.sha1(f"{model}|{flags}".encode()).hexdigest()[:12]


_ISA_OF_NOTE = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "asimd", "sve")


def cpu_isa() -> str:
    """The instruction sets the kernels' speed depends on, present here (for the start-up log), and the build's
    target where $TOKENMILL_KERNEL_MARCH names one."""
    flags = set(_cpu_info()[1].split())
    isa = " ".join(f for f in _ISA_OF_NOTE if f in flags)
    march = os.environ.get(MARCH_ENV, "native")
    return isa if march == "native" else f"{isa} (kernels built for -march={march})"


def build_name() -> str:
    """The extension's name: keyed by this CPU (cpu_tag) and by the sources, so neither another CPU's build
    nor another checkout's (an old tree benchmarked beside this one) is ever loaded, or rebuilt over, here."""
    sources = hashlib.sha1(b"".join(s.read_bytes() for s in (*_SOURCES, *_HEADERS))).hexdigest()[:8]
    march = os.environ.get(MARCH_ENV, "native")
    target = "" if march == "native" else "_" + "".join(c if c.isalnum() else "_" for c in march)
    return f"tokenmill_cpu_kernels_{cpu_tag()}{target}_{sources}"


@lru_cache(maxsize=1)
def _extension():
    """The compiled module, or None (then callers use the torch reference)."""
    if os.environ.get("TOKENMILL_NO_KERNELS"):
        return None
    built = _built(build_name())
    if built is not None:
        return built
    try:
        from torch.utils.cpp_extension import load

        return load(name=build_name(), sources=[str(s) for s in _SOURCES], extra_cflags=build_flags(),
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported platform: stay correct, only slower
        log.warning("fast CPU kernels unavailable (%s); using the PyTorch reference", e)
        return None


def build_directory() -> Path | None:
    """Where this CPU's build of these sources lives (its .so, and what is measured once per build beside it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(build_name(), verbose=False))
    except Exception as e:  # noqa: BLE001 - torch's helper moved or the cache is not writable
        log.debug("no kernel build directory (%s)", e)
        return None


def _built(name: str):
    """The module already built for this CPU and these sources (its name says both), imported straight away.
    torch's `load` would first take the build directory's lock file, and a process killed while holding it (a rank
    killed at start-up) leaves the lock behind: every later start would wait on it forever."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library

        directory = _get_build_directory(name, verbose=False)
        if not os.path.exists(os.path.join(directory, f"{name}.so")):
            return None
        return _import_module_from_library(name, directory, True)
    except Exception as e:  # noqa: BLE001 - torch's helpers moved, or a broken file: build as usual
        log.debug("no usable prebuilt kernels (%s)", e)
        return None


def paged_attention_kernel():
    ext = _extension()
    return None if ext is None else ext.paged_attention


if __name__ == "__main__":  # `make setup` builds here, so the first start never waits for a compiler
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ext = _extension()
    if ext is None:
        raise SystemExit("the CPU kernels did not build: tokenmill will run its PyTorch reference (slower)")
    print(f"built {build_name()} for isa: {cpu_isa() or 'baseline'}; bf16 matmuls: {ext.bf16_kernel() or 'oneDNN'}; "
          f"GGUF blocks: {ext.gguf_kernel() or 'dequantized'}")
