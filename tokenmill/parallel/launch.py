"""Starting parallel ranks as processes: one rank (`start_rank`), every rank of one node (`run_node`, what
`tokenmill worker` runs on the hosts besides node 0), or none at all under torchrun, which starts every rank itself
(`torchrun_rank`: `torchrun --nproc-per-node N -m tokenmill.cli serve --tensor-parallel-size N`; rank 0 serves, the
others become workers)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from tokenmill.config import EngineConfig
from tokenmill.parallel.group import backend_for


def start_rank(rank: int, size: int, init_method: str, backend: str, timeout_s: float) -> subprocess.Popen:
    """One rank as a process (`python -m tokenmill.parallel.worker`, its arguments pickled on stdin): a plain
    subprocess, since the engine process, a daemon, may not have multiprocessing children."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.parallel.worker"], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((rank, size, init_method, backend, timeout_s)))
    proc.stdin.close()
    return proc


def run_node(config: EngineConfig, timeout_s: float = 30.0) -> int:
    """`tokenmill worker`: this node's ranks, until they end; non-zero if any failed."""
    size = config.parallel_size
    per_node = size // config.nnodes
    ranks = range(config.node_rank * per_node, (config.node_rank + 1) * per_node)
    init = f"tcp://{config.master_addr}:{config.master_port}"
    print(f"tokenmill worker node {config.node_rank}: ranks {ranks[0]}-{ranks[-1]} of {size}, meeting at "
          f"{config.master_addr}:{config.master_port}", flush=True)
    procs = [start_rank(r, size, init, backend_for(config.device), timeout_s) for r in ranks]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (torch.distributed.run) started it, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None

