"""The executor owns the parallel ranks besides rank 0: it starts them (processes on this host, Ray tasks, or none
under torchrun), joins rank 0's group with them, hands every rank the configuration, watches them and ends them.

Kept apart from the runner's model wrappers (parallel/driver.py): launching ranks reaches the worker's code, which
builds a runner, so the runner must not reach back here.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.parallel.group import RankGroup, backend_for, check_no_process_group
from tokenmill.parallel.launch import start_rank, torchrun_rank
from tokenmill.parallel.ray_executor import RayRank, node_address

log = logging.getLogger("tokenmill")

STOP_TIMEOUT_S = 10.0  # for every worker to leave after the stop, before they are killed


class Executor:
    """The other ranks of node 0 as processes on this host (the other nodes' come from `tokenmill worker`), or all
    of them as Ray tasks (parallel/ray_executor.py), and rank 0's group once every rank joined; then every rank gets
    the configuration and the block count."""

    def __init__(self, config: EngineConfig, num_blocks: int, size: int, timeout_s: float = 30.0):
        check_no_process_group()
        under_torchrun = torchrun_rank() is not None  # torchrun started every rank, and says where they meet
        on_ray = config.distributed_executor_backend == "ray"  # Ray starts ranks 1..N-1, wherever it places them
        if under_torchrun and on_ray:
            raise ConfigError("under torchrun every rank is started already: drop --distributed-executor-backend ray")
        if under_torchrun:
            init = "env://"
        elif config.master_port is None:  # any free port for the rendezvous: on loopback unless Ray spreads ranks
            host = node_address() if on_ray else "127.0.0.1"
            with socket.socket() as s:
                s.bind(("0.0.0.0" if on_ray else host, 0))
                init = f"tcp://{host}:{s.getsockname()[1]}"
        else:
            init = f"tcp://{config.master_addr}:{config.master_port}"
        backend = backend_for(config.device)
        self.group: RankGroup | None = None
        if on_ray:
            threads = config.num_threads or max(1, (os.cpu_count() or 1) // size)
            self.procs = [RayRank(r, size, init, backend, timeout_s, threads) for r in range(1, size)]
        else:
            local = range(1, 1 if under_torchrun else size // config.nnodes)
            self.procs = [start_rank(r, size, init, backend, timeout_s) for r in local]
        try:
            self.group = RankGroup(0, size, init, backend, timeout_s)
            self.group.broadcast(("setup", (config, num_blocks)))
            self.group.split_tensor_parallel(config.tensor_parallel_size)
        except Exception as e:
            self.kill()
            raise ParallelFailure(f"the parallel ranks did not all start: {e}") from e

    def check(self) -> None:
        """Raise ParallelFailure if a worker process has ended (checked while idle too: a rank that died between
        requests must not wait for the next one to be found)."""
        for rank, p in self.dead():
            raise ParallelFailure(f"parallel rank {rank} ({p.pid}) exited with code {p.returncode}")

    def close(self) -> None:
        """Tell the workers to end, wait for them, leave the group. Ranks that cannot take the stop (one is gone,
        or a call of every rank was cut off mid-way) are killed at once instead of waited for."""
        dead = self.dead()
        for rank, p in dead:
            log.warning("parallel rank %d (%s) had exited with code %s", rank, p.pid, p.returncode)
        if self.group is not None and not self.group.in_call and not dead:
            self.stop()
        self.kill()

    def dead(self) -> list[tuple[int, Any]]:
        """The workers that have ended on their own (rank, process)."""
        return [(rank, p) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def stop(self) -> None:
        """Broadcast the stop and give each worker a moment to leave the group by itself (what keeps them quiet)."""
        try:
            self.group.broadcast(("stop", None))
        except Exception as e:  # noqa: BLE001 - a rank already gone: the joins below time out and kill
            log.debug("telling the parallel ranks to stop: %s", e)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed by the caller

    def kill(self) -> None:
        """End the workers at once and leave the group (after a failure, or when `close` could not)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        if getattr(self, "group", None) is not None:
            self.group.close()
            self.group = None
