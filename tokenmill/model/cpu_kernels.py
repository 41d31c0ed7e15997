"""The fast CPU attention kernel (C++, built on first use with torch's extension builder), with a plain
PyTorch fallback when no compiler is available. Tested against the reference in tests/model/test_attention.py."""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("tokenmill")

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@lru_cache(maxsize=1)
def paged_attention_kernel():
    """The compiled `paged_attention` op, or None (then callers use the torch reference)."""
    if os.environ.get("TOKENMILL_NO_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # fast-math lets the compiler vectorize exp (glibc's libmvec); infinities stay meaningful (masked scores).
        flags = ["-O3", "-fopenmp", "-march=native", "-ffast-math", "-fno-finite-math-only"]
        module = load(name="tokenmill_paged_attention", sources=[str(_SOURCE)], extra_cflags=flags,
                      extra_ldflags=["-fopenmp"], verbose=False)
        return module.paged_attention
    except Exception as e:  # no compiler, no ninja, unsupported platform: stay correct, only slower
        log.warning("fast CPU attention kernel unavailable (%s); using the PyTorch reference", e)
        return None
