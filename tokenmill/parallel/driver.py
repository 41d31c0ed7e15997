"""How rank 0's runner calls its model: in this process alone, or announcing each call to the other ranks first.

The runner holds one model and one backend, and makes two kinds of call: a forward pass over a step's inputs (one
batch, or a pipeline's micro-batches) and the LM head over some rows. `ModelCalls` runs them here; under tensor,
pipeline or context parallelism rank 0's calls are first broadcast (the step's token ids, positions and attention
metadata, or the rows whose logits are wanted), so every rank runs the same call on its part and meets the others
in the same collectives. Any exception inside a parallel call is fatal (ParallelFailure, from `RankGroup.together`):
the ranks are out of step, so the engine stops and says so. Ranks 1..N-1 run the same calls from
parallel/worker.py; starting them is parallel/executor.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.parallel.context import ContextParallel
from tokenmill.parallel.context import forward as context_forward

if TYPE_CHECKING:
    from tokenmill.parallel.group import PipelineParallel, RankGroup, TensorParallel

Batch = tuple[torch.Tensor, torch.Tensor, Any]  # token ids, positions, attention metadata


class ModelCalls:
    """One process holds the whole model: each call is the model's own."""

    def forward(self, model: torch.nn.Module, batches: list[Batch], kv_caches: list) -> torch.Tensor:
        """The final hidden states of every batch's tokens, in order, as one tensor."""
        hidden = [model(ids, pos, meta, kv_caches) for ids, pos, meta in batches]
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(hidden)


class TensorParallelCalls(ModelCalls):
    """Every rank holds a shard of every layer: each call is announced, then run on rank 0's shard."""

    def __init__(self, group: RankGroup):
        self.group = group

    def forward(self, model: torch.nn.Module, batches: list[Batch], kv_caches: list) -> torch.Tensor:
        hidden = []
        for ids, pos, meta in batches:
            with self.group.together("a tensor-parallel forward pass"):
                self.group.broadcast(("forward", (ids, pos, meta)))
                hidden.append(model(ids, pos, meta, kv_caches))
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.together("a tensor-parallel LM head call"):
            self.group.broadcast(("logits", hidden))
            return model.compute_logits(hidden)


class PipelineCalls(ModelCalls):
    """Rank 0 as pipeline stage 0: a step's micro-batches are announced to every stage, then each goes through this
    stage's layers and on to the next stage while this one starts the next micro-batch (so the stages work on
    different micro-batches at once); the last stage sends the final hidden states back here, where the LM head
    is."""

    def __init__(self, group: RankGroup, stages: int):
        self.group, self.stages = group, stages
        self.tp = group.tp_size  # ranks per stage (tensor parallel within)

    def forward(self, model: torch.nn.Module, batches: list[Batch], kv_caches: list) -> torch.Tensor:
        with self.group.together("a pipeline-parallel step"):
            self.group.broadcast(("pipeline", batches))
            hidden, dtype = model.config.hidden_size, model.norm.weight.dtype
            finals = [torch.empty(len(ids), hidden, dtype=dtype) for ids, _, _ in batches]
            last = (self.stages - 1) * self.tp  # the last stage's first rank sends the final hidden states back
            recvs = [self.group.recv(f, last, tag=i) for i, f in enumerate(finals)]
            sends, outputs = [], []
            for i, (ids, pos, meta) in enumerate(batches):
                outputs.append(model(ids, pos, meta, kv_caches))  # kept alive until sent
                sends.append(self.group.send(outputs[-1], self.tp, tag=i))  # the next stage's first rank
            for work in sends + recvs:
                work.wait()
            return torch.cat(finals) if len(finals) > 1 else finals[0]

    def logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head is on stage 0 (split over its ranks under tensor parallelism: they join in)."""
        with self.group.together("a parallel LM head call"):
            if self.tp > 1:
                self.group.broadcast(("logits", hidden))
            return model.compute_logits(hidden)


class ContextParallelCalls(ModelCalls):
    """Every rank holds the whole model and 1/C of each sequence: a forward pass is announced, run on this rank's
    share of the tokens, and the final hidden states of all rows gathered here; the LM head is rank 0's alone."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp

    def forward(self, model: torch.nn.Module, batches: list[Batch], kv_caches: list) -> torch.Tensor:
        hidden = []
        for ids, pos, meta in batches:
            replicate = meta.num_paged_tokens <= self.cp.replicate_max
            with self.cp.group.together("a context-parallel forward pass"):
                self.cp.group.broadcast(("context", (ids, pos, meta, replicate)))
                hidden.append(context_forward(model, self.cp, ids, pos, meta, kv_caches, replicate))
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)


def model_calls(tp: TensorParallel | None, pp: PipelineParallel | None, cp: ContextParallel | None) -> ModelCalls:
    """Rank 0's way of calling its model (the other ranks run rank 0's calls: they call their model directly)."""
    if pp is not None:
        return PipelineCalls(pp.group, pp.stage.count) if pp.group.is_driver else ModelCalls()
    if tp is not None:
        return TensorParallelCalls(tp.group) if tp.group.is_driver else ModelCalls()
    if cp is not None:
        return ContextParallelCalls(cp) if cp.group.is_driver else ModelCalls()
    return ModelCalls()
