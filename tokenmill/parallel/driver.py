"""Rank 0's side of tensor parallelism: start the worker ranks, and announce each model call to them.

`DriverModel` stands in for the model in rank 0's runner: a forward pass or an LM-head call is first broadcast
(its inputs: the step's token ids, positions and attention metadata, or the rows whose logits are wanted), so every
rank runs the same call on its shard and meets the others in the same collectives. Under tensor parallelism any
exception in a call is fatal (ParallelFailure): the ranks are out of step, so the engine stops and says so.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ParallelFailure
from tokenmill.parallel.group import TPGroup
from tokenmill.parallel.worker import backend_for, run_worker

log = logging.getLogger("tokenmill")


class DriverModel:
    def __init__(self, model: torch.nn.Module, group: TPGroup):
        self.model, self.group = model, group

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list) -> torch.Tensor:
        try:
            self.group.broadcast(("forward", (input_ids, positions, meta)))
            return self.model(input_ids, positions, meta, kv_caches)
        except Exception as e:
            raise ParallelFailure(f"a tensor-parallel forward pass failed ({type(e).__name__}: {e}); the ranks are "
                                  "out of step, so the engine stops") from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        try:
            self.group.broadcast(("logits", hidden))
            return self.model.compute_logits(hidden)
        except Exception as e:
            raise ParallelFailure(f"a tensor-parallel LM head call failed ({type(e).__name__}: {e})") from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class Workers:
    """Ranks 1..N-1 as processes on this host, and rank 0's group once they all joined it."""

    def __init__(self, config: EngineConfig, num_blocks: int, size: int, threads: int, timeout_s: float = 60.0):
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=run_worker, args=(r, size, init, config, num_blocks, threads, timeout_s),
                                  name=f"tokenmill-tp{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self.group = TPGroup(0, size, init, backend_for(config.device), timeout_s)
        except Exception as e:
            self.kill()
            raise ParallelFailure(f"the tensor-parallel ranks did not all start: {e}") from e

    def close(self) -> None:
        """Tell the workers to end, wait for them, leave the group."""
        try:
            self.group.broadcast(("stop", None))
        except Exception as e:  # noqa: BLE001 - a rank already gone: the joins below time out and kill
            log.debug("telling the tensor-parallel ranks to stop: %s", e)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()
        self.group.close()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
