"""Weights in memory the kernel backs with 2 MiB pages (Linux transparent huge pages, MADV_HUGEPAGE).

A decode step streams every weight once from DRAM. On 4 KiB pages the hardware prefetchers stop at each page
boundary and every page costs a TLB entry; in one 2 MiB page they run on (measured: BENCHMARKS.md, "Kernels"). Only
the CPU backend's packed weights move here (torch allocates everything else as usual); where the OS has no
transparent huge pages they stay where torch put them. The KV cache stays on torch's pages: faulting gigabytes of
huge pages in at start-up cost seconds there and gained nothing measurable end to end.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from pathlib import Path

import torch

log = logging.getLogger("tokenmill")

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line, as torch's own allocations do
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can back memory with huge pages here: Linux, with THP not set to never."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and not t.is_mkldnn


def _arena(nbytes: list[int]) -> tuple[torch.Tensor, list[int]] | None:
    """One zeroed huge-page mapping with byte ranges of these sizes side by side (each on a cache line): a uint8
    tensor spanning exactly the bytes used (what weight accounting counts; it holds the mapping for as long as a
    view of it lives), and each range's offset in it. None where there is no such mapping to be had."""
    if not nbytes or not huge_pages_available():
        return None
    offsets, size = [], 0
    for n in nbytes:
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        size += n
    try:
        # one page more than needed, so the arena can start on a 2 MiB boundary (only whole aligned 2 MiB ranges
        # become huge pages)
        mapping = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE,
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:
        log.debug("no huge-page mapping of %d bytes: %s", size, e)
        return None
    start = (-torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()) % HUGE_PAGE
    return torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start), offsets


def _view(arena: torch.Tensor, offset: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return arena[offset:offset + nbytes].view(dtype).view(shape)


def move_to_huge_pages(holders: list[tuple[object, str]]) -> int:
    """Moves each `getattr(obj, name)` (a contiguous CPU tensor) into one huge-page mapping, side by side, and sets
    the attribute to its copy at once, so each original is freed as it goes (the peak is the mapping plus the
    originals not yet moved). Returns the bytes moved: 0 where there is no such mapping to be had (nothing moves)."""
    tensors = [getattr(obj, name) for obj, name in holders]
    if not all(_movable(t) for t in tensors):
        return 0
    arena = _arena([t.numel() * t.element_size() for t in tensors])
    del tensors
    if arena is None:
        return 0
    whole, offsets = arena
    freed = 0
    for (obj, name), offset in zip(holders, offsets):
        t = getattr(obj, name)
        copy = _view(whole, offset, t.shape, t.dtype)
        copy.copy_(t)
        setattr(obj, name, copy)
        freed += copy.numel() * copy.element_size()
        del t
        if freed >= TRIM_EVERY:  # hand the originals' pages back now, not at exit: see _trim
            _trim()
            freed = 0
    _trim()
    return whole.numel()


TRIM_EVERY = 256 << 20


def _trim() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim). Why: tensors of a few MiB (a mixture of
    experts' experts) come from the heap rather than their own mappings once glibc has raised its mmap threshold,
    and freeing them keeps the pages in the process; without this a 14 GB model moved here peaks at twice that."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
