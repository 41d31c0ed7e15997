"""Parallel ranks 1..N-1 (tensor-parallel shards or pipeline stages): each joins the group, takes rank 0's
configuration and block count, builds its part of the model and its KV cache, then runs whatever rank 0 announces:
a forward pass over the step's inputs, the LM head's slice for some rows, a pipeline step, or the end. Any failure
ends the process; rank 0's next collective then fails (or times out) and the engine with it, never a silent hang.

Started by rank 0 on its own node (parallel/executor.py Executor), and on every other node by `tokenmill worker`
(parallel/launch.py run_node)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.parallel.context import ContextParallel
from tokenmill.parallel.context import forward as context_forward
from tokenmill.parallel.group import RankGroup, backend_for

log = logging.getLogger("tokenmill")


def run_worker(rank: int, size: int, init_method: str, backend: str, timeout_s: float) -> bool:
    """A worker process's life: join the group, take the configuration, build this rank's part, run rank 0's
    commands until told to stop (True) or until something failed, rank 0 gone included (False)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process stops the engine; the engine stops us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    group = RankGroup(rank, size, init_method, backend, timeout_s)
    try:
        from tokenmill.engine.model_spec import ModelSpec, threads_per_rank
        from tokenmill.parallel.group import PipelineParallel, TensorParallel
        from tokenmill.parallel.layout import PPStage, TPLayout

        _, (config, num_blocks) = group.broadcast(None)  # ("setup", ...): the same on every rank
        group.split_tensor_parallel(config.tensor_parallel_size)
        torch.set_num_threads(threads_per_rank(config) or torch.get_num_threads())
        spec = ModelSpec.resolve(config)
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        tp = (TensorParallel(group, TPLayout(spec.config, tp_size, rank % tp_size, config.enable_expert_parallel))
              if tp_size > 1 else None)
        pp = (PipelineParallel(group, PPStage.of(spec.config, pp_size, rank // tp_size), 1) if pp_size > 1
              else None)
        cp = ContextParallel(group, config.cache.block_size, num_blocks) if config.context_parallel_size > 1 else None
        runner = spec.build_runner(config, num_blocks, tp, pp, cp)
        with torch.inference_mode():  # as rank 0's runner: no autograd bookkeeping
            serve(group, runner)
        return True
    except Exception as e:  # noqa: BLE001 - logged, then the process ends: rank 0 fails on its next collective
        log.error("parallel rank %d failed: %s: %s", rank, type(e).__name__, e)
        return False
    finally:
        group.close()


def serve(group: RankGroup, runner: Any) -> None:
    """Run rank 0's commands until it says stop."""
    while True:
        command: tuple[str, Any] = group.broadcast(None)
        if command[0] == "forward":
            input_ids, positions, meta = command[1]
            runner.model(input_ids, positions, meta, runner.kv_caches)
        elif command[0] == "logits":
            if runner.pp is None or runner.pp.stage.first:  # the LM head's ranks (stage 0 under pipelining)
                runner.model.compute_logits(command[1])
        elif command[0] == "pipeline":
            run_stage(group, runner, command[1])
        elif command[0] == "context":
            input_ids, positions, meta, replicate = command[1]
            context_forward(runner.model, runner.cp, input_ids, positions, meta, runner.kv_caches, replicate)
        else:
            return


def run_stage(group: RankGroup, runner: Any, batches: list) -> None:
    """This pipeline stage's part of a step: each micro-batch's hidden states from the stage before, through this
    stage's layers, on to the next stage (the last: the final norm, back to rank 0)."""
    stage, model, tp = runner.pp.stage, runner.model, group.tp_size
    # each rank of a stage (tensor parallel within) talks to the same-placed rank of the stages beside it; the last
    # stage's first rank sends the final hidden states to rank 0, its others send nothing
    me = group.rank
    after = None if stage.last and me % tp else 0 if stage.last else me + tp
    dtype, hidden = model.norm.weight.dtype, model.config.hidden_size
    sends, outputs = [], []
    for i, (input_ids, positions, meta) in enumerate(batches):
        x = None
        if not stage.first:
            x = torch.empty(len(input_ids), hidden, dtype=dtype)
            group.recv(x, me - tp, tag=i).wait()
        outputs.append(model(input_ids, positions, meta, runner.kv_caches, hidden_in=x))  # alive until sent
        if after is not None:
            sends.append(group.send(outputs[-1], after, tag=i))
    for work in sends:
        work.wait()


def run_torchrun_worker(config: EngineConfig, timeout_s: float = 30.0) -> int:
    """A rank other than 0 under torchrun: the worker's life, meeting the others where torchrun says (env://)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.parallel_size:
        print(f"error: torchrun started {world} processes, the flags ask for {config.parallel_size} ranks "
              "(--tensor-parallel-size x --pipeline-parallel-size); make them equal", file=sys.stderr)
        return 2
    return 0 if run_worker(rank, world, "env://", backend_for(config.device), timeout_s) else 1


if __name__ == "__main__":  # started by parallel/launch.py start_rank, its arguments pickled on stdin
    import pickle

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    sys.exit(0 if run_worker(*pickle.loads(sys.stdin.buffer.read())) else 1)  # `tokenmill worker` reports it
