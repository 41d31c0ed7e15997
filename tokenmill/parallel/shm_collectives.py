"""The model's collectives among ranks on one host through shared memory, instead of gloo's TCP loopback.

A decode step makes a collective per layer or two (tensor parallelism: the row-parallel all-reduces; context
parallelism: the partial attentions' all-gather), each of a few KiB, so its cost is latency: gloo's is ~0.3-1 ms
per call on these CPUs, which made parallel decode several times slower than one process (BENCHMARKS.md). Here each
rank copies its part into its own slot of a mapped /dev/shm file and bumps its sequence number; every rank spins
(then yields) until all sequence numbers reach the call's, and reads the slots. Two sets of slots alternate, so a
rank may write call s+1 while a slower one still reads call s: it can only be at s+1 once every rank posted s, i.e.
finished reading s-1, the last user of that set. Every rank sums or joins the slots in rank order, so all get the
same bits.

Only where it is safe and worth it: every rank on this host (the same boot id), a CPU whose stores other cores see
in order (x86), tensors on the CPU and at most SLOT_BYTES (larger ones are bandwidth-bound: gloo moves them). A
rank that dies is noticed while spinning (its /proc entry gone or a zombie), and a call that waits past the
group's timeout fails: never a silent hang.
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # per rank and call: a decode step's collectives are KiBs; a prefill's hidden states MiBs
LINE = 64  # each rank's sequence number and pid on their own cache line
SPINS_BEFORE_YIELD = 200
LIVENESS_EVERY_S = 0.05
SHM_DIR = Path("/dev/shm")
_FENCE = threading.Lock()


def host_id() -> str | None:
    """This host's identity for "are all ranks here?" (its boot id), or None where shared memory is not used (also
    when TOKENMILL_SHM_COLLECTIVES=0: gloo for everything, as benchmarks/parallel.py compares)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    if (os.environ.get("TOKENMILL_SHM_COLLECTIVES", "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64")
            or not SHM_DIR.is_dir() or not boot.exists()):
        return None
    return boot.read_text().strip()


def new_path() -> str:
    return str(SHM_DIR / f"tokenmill-collectives-{uuid.uuid4().hex}")


class ShmCollectives:
    """One rank's view of the shared slots; every rank of the group makes the same calls in the same order."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, create: bool):
        self.rank, self.size, self.timeout_s, self.seq = rank, size, timeout_s, 0
        header = 2 * size * LINE
        total = header + 2 * size * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, total)  # zero-filled: every sequence number starts at 0
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        stride = LINE // 8
        self._seqs = np.frombuffer(self._map, dtype=np.int64, count=size * stride)[::stride]
        self._pids = np.frombuffer(self._map, dtype=np.int64, count=size * stride, offset=size * LINE)[::stride]
        self._pids[rank] = os.getpid()
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                                       count=2 * size * SLOT_BYTES).view(2, size, SLOT_BYTES)

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place, in rank order."""
        parts = self._exchange(x)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (one shape), stacked [size, ...]."""
        return self._exchange(x).clone()

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """As all_gather on rank 0; the others take part and get None."""
        parts = self._exchange(x)
        return parts.clone() if self.rank == 0 else None

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Post x, wait for every rank's, and return the slots viewed as [size, *x.shape] (valid until the call after
        next: copy out)."""
        self.seq += 1
        slots = self._slots[self.seq % 2]
        n = x.numel() * x.element_size()
        slots[self.rank, :n].copy_(x.contiguous().view(-1).view(torch.uint8))
        # x86 keeps ordinary stores in order, but a large copy may use non-temporal ones, which it does not: a
        # locked instruction (taking an uncontended lock) orders them all before the sequence number is posted
        with _FENCE:
            pass
        self._seqs[self.rank] = self.seq
        self._wait(self.seq)
        return slots[:, :n].view(x.dtype).view(self.size, *x.shape)

    def _wait(self, seq: int) -> None:
        seqs = self._seqs
        if (seqs >= seq).all():
            return
        start = time.monotonic()
        check, spins = start + LIVENESS_EVERY_S, 0
        while not (seqs >= seq).all():
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()
            if spins % 64 == 0 and time.monotonic() >= check:
                now = time.monotonic()
                check = now + LIVENESS_EVERY_S
                for rank in np.flatnonzero(seqs < seq):
                    if not _alive(int(self._pids[rank])):
                        raise RuntimeError(f"parallel rank {rank} (pid {int(self._pids[rank])}) is gone")
                if now - start > self.timeout_s:
                    raise RuntimeError(f"a shared-memory collective waited {self.timeout_s:.0f} s for rank(s) "
                                       f"{np.flatnonzero(seqs < seq).tolist()}")

    def close(self) -> None:
        self._seqs = self._pids = self._slots = None
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    if pid <= 0:
        return True  # not registered yet
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return state not in ("Z", "X")
