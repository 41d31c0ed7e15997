"""Parallel ranks as Ray tasks (`--distributed-executor-backend ray`), for clusters that already run Ray: rank 0
joins the cluster (RAY_ADDRESS, or a local one it starts), and ranks 1..N-1 run as tasks wherever Ray places them,
each the same worker life as a process rank (parallel/worker.py run_worker). They still meet over torch.distributed
at rank 0's address; Ray only starts and watches them. `RayRank` answers as a subprocess.Popen does (poll, wait,
kill), so parallel/executor.py Executor treats both alike."""

from __future__ import annotations

import os
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.parallel.worker import run_worker


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor-backend ray needs Ray: pip install ray (or use mp, the "
                          "default)") from None
    if not ray.is_initialized():
        # RAY_ADDRESS: an existing cluster; otherwise a local one, sized to this host, without its dashboard
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
                 ignore_reinit_error=True)
    return ray


def node_address() -> str:
    """Where the other ranks reach rank 0: this node's address as Ray knows it."""
    return _ray().util.get_node_ip_address()


class RayRank:
    """One rank as a Ray task; `returncode` as a process's: 0 when it ended well, 1 otherwise."""

    def __init__(self, rank: int, size: int, init_method: str, backend: str, timeout_s: float, threads: int):
        ray = _ray()
        self.rank, self.returncode = rank, None
        task = ray.remote(num_cpus=threads, max_retries=0)(run_worker)
        self.ref = task.options(name=f"tokenmill-rank-{rank}").remote(rank, size, init_method, backend, timeout_s)
        self.pid = f"ray task {self.ref.task_id().hex()[:12]}"

    def poll(self) -> int | None:
        if self.returncode is None:
            self.wait(timeout=0, raise_timeout=False)
        return self.returncode

    def wait(self, timeout: float | None = None, raise_timeout: bool = True) -> int | None:
        ray = _ray()
        done, _ = ray.wait([self.ref], timeout=timeout)
        if not done:
            if raise_timeout:
                import subprocess

                raise subprocess.TimeoutExpired(f"tokenmill rank {self.rank}", timeout)
            return None
        try:
            self.returncode = 0 if ray.get(self.ref) else 1
        except Exception:  # noqa: BLE001 - the task died (cancelled, its worker killed): a failed rank
            self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        _ray().cancel(self.ref, force=True)
