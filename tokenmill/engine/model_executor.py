"""ModelExecutor: the engine core's one door to the model. It builds rank 0's runner and, with tensor, pipeline or
context parallelism, starts the other ranks (parallel/executor.py) and joins rank 0 to their groups; the core
hands it a step and gets the step's result, whatever number of ranks computes it.
"""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.model_spec import CacheInfo, ModelSpec
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.step_types import SchedulerOutput, StepResult
from tokenmill.parallel.context import ContextParallel
from tokenmill.parallel.executor import Executor
from tokenmill.parallel.group import PipelineParallel, TensorParallel
from tokenmill.parallel.layout import PPStage, TPLayout


class ModelExecutor:
    def __init__(self, config: EngineConfig, spec: ModelSpec, cache: CacheInfo):
        self.config, self.cache = config, cache
        mc, num_blocks = spec.config, cache.num_blocks
        self.ranks: Executor | None = None  # ranks 1..N-1: tensor-parallel ranks, pipeline stages, context shares
        tp = pp = cp = None
        if config.parallel_size > 1:
            self.ranks = Executor(config, num_blocks, config.parallel_size)
            group = self.ranks.group
            if config.tensor_parallel_size > 1:
                tp = TensorParallel(group, TPLayout(mc, config.tensor_parallel_size, 0, config.enable_expert_parallel))
            if config.pipeline_parallel_size > 1:
                pp = PipelineParallel(group, PPStage.of(mc, config.pipeline_parallel_size, 0),
                                      config.pipeline_micro_batches or config.pipeline_parallel_size)
            if config.context_parallel_size > 1:
                cp = ContextParallel(group, config.cache.block_size, num_blocks)
        try:
            self.runner: ModelRunner = spec.build_runner(  # rank 0's
                config, num_blocks, tp, pp, cp, num_snapshots=cache.state_snapshots)
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise
        self._model_config = mc

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One step on every rank; rank 0's runner announces it to the others (parallel/driver.py)."""
        return self.runner.execute(sched)

    def describe(self) -> str:
        """The compute path as the start-up log says it: backend, batch invariance, how the ranks split the model,
        the weights."""
        runner, cfg, mc = self.runner, self.config, self._model_config
        mode = "batch-invariant" if runner.batch_invariant else "not batch-invariant"
        threads = f"{torch.get_num_threads()} threads each"
        split = ""
        if cfg.tensor_parallel_size > 1:
            layout = TPLayout(mc, cfg.tensor_parallel_size, 0, cfg.enable_expert_parallel)
            split += f"\n{layout.describe()}; {threads}; weights and KV cache below are per rank"
        if cfg.pipeline_parallel_size > 1:
            split += (f"\n{PPStage.describe(mc, cfg.pipeline_parallel_size, runner.pp.micro_batches)}; {threads}; "
                      "weights and KV cache below are rank 0's")
        if cfg.context_parallel_size > 1:
            split += (f"\n{runner.cp.describe(self.cache.num_blocks)}; {threads}; "
                      "weights below are per rank, the KV cache is across the ranks")
        return f"backend: {runner.backend.describe()}; {mode}{split}\n{runner.weight_summary()}"

    def check(self) -> None:
        """Raise ParallelFailure if a rank has died."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """End the other ranks (rank 0's runner goes with the core)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
