"""The ranks of one engine (tensor-parallel shards or pipeline stages): which rank this process is, and the
collectives and point-to-point sends the model calls.

Ranks are processes over torch.distributed (gloo on CPU, NCCL on CUDA). Rank 0 is the engine core's process: it
schedules, builds each step's inputs and samples; ranks 1..N-1 (parallel/worker.py) hold their shard of every layer
and run the same forward passes. Two process groups: `control` carries rank 0's commands (workers wait on it while
the engine idles, with no deadline: a rank 0 that dies closes its connections, which ends their wait), `compute`
the model's collectives, with a deadline (`timeout_s`), so a rank that hangs mid-step fails the engine within it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.parallel.layout import PPStage, TPLayout
from tokenmill.parallel.shm_collectives import ShmCollectives, host_id, new_path

STARTUP_TIMEOUT_S = 600.0  # every rank loads its shard before the first command
IDLE_TIMEOUT = datetime.timedelta(days=30)
PIPE_TIMEOUT = datetime.timedelta(seconds=600)  # a micro-batch's trip through every stage (a long prefill)


def backend_for(device: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int, ranks_per_node: int) -> str:
    """The device of one rank: on CUDA each rank of a node its own GPU (`cuda` -> `cuda:<local rank>`); a CPU is
    shared. Refuses a node with fewer GPUs than ranks (the world size this host cannot start)."""
    if device != "cuda":
        return device
    found = torch.cuda.device_count()
    if found < ranks_per_node:
        raise ConfigError(f"{ranks_per_node} parallel ranks per node need as many GPUs, this node has {found}; "
                          "lower --tensor-parallel-size / --pipeline-parallel-size or add --nnodes")
    return f"cuda:{rank % ranks_per_node}"


@contextmanager
def fatal(what: str) -> Iterator[None]:
    """Any exception in a call the ranks make together leaves them out of step: the engine must stop."""
    try:
        yield
    except Exception as e:
        raise ParallelFailure(f"{what} failed ({type(e).__name__}: {e}); the ranks are out of step, so the engine "
                              "stops") from e


def check_no_process_group() -> None:
    """Refuse to start ranks while this process is in a torch.distributed group already: its default group is
    one per process, so a second parallel engine needs the first shut down."""
    if dist.is_initialized():
        raise ConfigError("this process already runs a parallel engine (torch.distributed is initialized): shut "
                          "the other one down first (llm.shutdown(), or create it with `with LLM(...) as llm:`)")


class RankGroup:
    def __init__(self, rank: int, size: int, init_method: str, backend: str, timeout_s: float):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.local: ShmCollectives | None = None
        self.in_call = False  # a call of every rank began and did not end (see `together`)
        try:
            self._make_groups(backend)
        except BaseException:
            self.close()  # torch's process groups are per process: none may outlive a failed start
            raise

    def _make_groups(self, backend: str) -> None:
        # commands are pickled Python objects: over gloo whatever the compute backend (NCCL moves tensors only)
        self.control = dist.new_group(timeout=IDLE_TIMEOUT, backend="gloo")
        self.pipe = dist.new_group(timeout=PIPE_TIMEOUT)
        self.tp_size = self.size
        self.compute = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))
        self.local = self._shared_memory() if backend == "gloo" else None  # the compute collectives on one host

    def _shared_memory(self) -> ShmCollectives | None:
        """Shared-memory collectives when every rank is on this host (parallel/shm_collectives.py), else None."""
        hosts = [None] * self.size
        dist.all_gather_object(hosts, host_id(), group=self.control)
        if hosts[0] is None or len(set(hosts)) > 1:
            return None
        box = [new_path() if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        path, local = box[0], None
        if self.is_driver:
            local = ShmCollectives(path, self.rank, self.size, self.timeout_s, create=True)
        dist.barrier(group=self.control)  # created before the others open it
        if not self.is_driver:
            local = ShmCollectives(path, self.rank, self.size, self.timeout_s, create=False)
        dist.barrier(group=self.control)  # every rank has it open (and its pid written): the name can go
        if self.is_driver:
            os.unlink(path)
        return local

    def split_tensor_parallel(self, tp_size: int) -> None:
        """Tensor parallelism inside pipeline stages: ranks s*tp_size .. (s+1)*tp_size-1 make stage s, and the model's
        collectives stay within this rank's stage. Every rank calls it, in the same order (new_group's rule)."""
        if tp_size == self.size:
            return
        if tp_size == 1:  # a pure pipeline: no collectives inside a stage
            self.tp_size = 1
            return
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)),
                                 timeout=datetime.timedelta(seconds=self.timeout_s))
                  for s in range(self.size // tp_size)]
        self.tp_size, self.compute = tp_size, groups[self.rank // tp_size]
        if self.local is not None:  # its slots span the whole world, not one stage: gloo within stages
            self.local.close()
            self.local = None

    def send(self, x: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending `x` to rank `dst` (a pipeline stage's output); returns the work to wait on."""
        return dist.isend(x.contiguous(), dst, group=self.pipe, tag=tag)

    def recv(self, x: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into `x` from rank `src`; returns the work to wait on."""
        return dist.irecv(x, src, group=self.pipe, tag=tag)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the row-parallel layers' partial products)."""
        if self.local is not None and self.local.fits(x):
            return self.local.all_reduce(x)
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` joined along the last dimension (the vocab-parallel LM head's logits);
        the others get None."""
        x = x.contiguous()
        if self.local is not None and self.local.fits(x):
            parts = self.local.gather(x)
            return torch.cat(list(parts.unbind(0)), dim=-1) if parts is not None else None
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked [size, ...] on every rank."""
        if self.local is not None and self.local.fits(x):
            return self.local.all_gather(x)
        out = x.new_empty((self.size, *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.compute)
        return out

    def all_gather_rows(self, x: torch.Tensor, rows: list[torch.Tensor], total: int) -> torch.Tensor:
        """The [total, ...] tensor of which each rank holds the rows `rows[rank]` (in `x`), on every rank."""
        return _placed(self.all_gather(_padded(x, rows)), rows, total)

    def gather_rows_to_driver(self, x: torch.Tensor, rows: list[torch.Tensor], total: int) -> torch.Tensor | None:
        """As all_gather_rows, on rank 0 only; the others get None."""
        padded = _padded(x, rows)
        if self.local is not None and self.local.fits(padded):
            parts = self.local.gather(padded)
        else:
            parts = padded.new_empty((self.size, *padded.shape)) if self.is_driver else None
            dist.gather(padded, list(parts.unbind(0)) if parts is not None else None, dst=0, group=self.compute)
        return _placed(parts, rows, total) if parts is not None else None

    def shift(self, x: torch.Tensor, into: torch.Tensor, tag: int) -> list[Any]:
        """Start sending `x` to the next rank of the ring and receiving the previous rank's into `into` (either
        may be empty: nothing moves); returns the works to wait on."""
        works = []
        if x.numel():
            works.append(dist.isend(x.contiguous(), (self.rank + 1) % self.size, group=self.compute, tag=tag))
        if into.numel():
            works.append(dist.irecv(into, (self.rank - 1) % self.size, group=self.compute, tag=tag))
        return works

    @contextmanager
    def together(self, what: str) -> Iterator[None]:
        """A call every rank makes (fatal, as `fatal`). One that did not end, failed or interrupted (Ctrl-C),
        stays marked in `in_call`: the other ranks are somewhere inside it, so closing kills them rather than
        sending them a stop they cannot hear."""
        self.in_call = True
        with fatal(what):
            yield
        self.in_call = False

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (what the workers run next)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        """Leave every group: the process can then start another (torch allows one default group at a time)."""
        if self.local is not None:
            self.local.close()
            self.local = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _padded(x: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """x's rows padded to the most any rank holds (collectives move equal shapes)."""
    padded = x.new_zeros((max(len(r) for r in rows), *x.shape[1:]))
    padded[:len(x)] = x
    return padded


def _placed(parts: torch.Tensor, rows: list[torch.Tensor], total: int) -> torch.Tensor:
    """Each rank's padded rows [size, most, ...] put back at their places in a [total, ...] tensor."""
    whole = parts.new_empty((total, *parts.shape[2:]))
    for rank, r in enumerate(rows):
        whole[r] = parts[rank, :len(r)]
    return whole


@dataclass
class TensorParallel:
    """What a rank's model needs: its group (collectives) and its layout (which shard it holds)."""

    group: RankGroup
    layout: TPLayout


@dataclass
class PipelineParallel:
    """What a pipeline stage's runner needs: its group (sends), its stage (which layers), how many micro-batches a
    step is cut into (rank 0)."""

    group: RankGroup
    stage: PPStage
    micro_batches: int
