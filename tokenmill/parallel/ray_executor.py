"""Parallel ranks as Ray tasks (`--distributed-executor-backend ray`), for clusters that already run Ray: rank 0
joins the cluster (RAY_ADDRESS, or a local one it starts), and ranks 1..N-1 run as tasks wherever Ray places them,
each the same worker life as a process rank (parallel/worker.py run_worker). They still meet over torch.distributed
at rank 0's address; Ray only starts and watches them. `RayRank` answers as a subprocess.Popen does (poll, wait,
kill), so parallel/driver.py Workers treats both alike."""

from __future__ import annotations

import importlib
import os
from typing import Any

from tokenmill.errors import ConfigError


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


def _worker_life(rank: int, size: int, init_method: str, backend: str, timeout_s: float) -> bool:
    # the worker module named, as start_rank's `python -m tokenmill.parallel.worker` names it: it imports the
    # engine, which imports this module
    worker = importlib.import_module("tokenmill.parallel.worker")
    return worker.run_worker(rank, size, init_method, backend, timeout_s)


class RayRank:
    """One rank as a Ray task; `returncode` as a process's: 0 when it ended well, 1 otherwise."""

    def __init__(self, rank: int, size: int, init_method: str, backend: str, timeout_s: float, threads: int):
        ray = _ray()
        self.rank, self.returncode = rank, None
        task = ray.remote(num_cpus=threads, max_retries=0)(_worker_life)
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
