"""Rank 0's side of tensor and pipeline parallelism inside its runner: announce each model call to the other ranks.

`DriverModel` stands in for the model in rank 0's runner: a forward pass or an LM-head call is first broadcast
(its inputs: the step's token ids, positions and attention metadata, or the rows whose logits are wanted), so every
rank runs the same call on its shard and meets the others in the same collectives. Under tensor parallelism any
exception in a call is fatal (ParallelFailure): the ranks are out of step, so the engine stops and says so.
Starting the ranks is parallel/executor.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.parallel.group import RankGroup


class DriverModel:
    def __init__(self, model: torch.nn.Module, group: RankGroup):
        self.model, self.group = model, group

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list) -> torch.Tensor:
        with self.group.together("a tensor-parallel forward pass"):
            self.group.broadcast(("forward", (input_ids, positions, meta)))
            return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.together("a tensor-parallel LM head call"):
            self.group.broadcast(("logits", hidden))
            return self.model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class PipelineDriver:
    """Rank 0 as pipeline stage 0: a step's micro-batches are announced to every stage, then each goes through this
    stage's layers and on to the next stage while this one starts the next micro-batch (so the stages work on
    different micro-batches at once); the last stage sends the final hidden states back here, where the LM head
    is. Any failure is fatal, as under tensor parallelism."""

    def __init__(self, model: torch.nn.Module, group: RankGroup, stages: int):
        self.model, self.group, self.stages = model, group, stages
        self.tp = group.tp_size  # ranks per stage (tensor parallel within)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list) -> torch.Tensor:
        return self.forward_micro_batches([(input_ids, positions, meta)], kv_caches)

    def forward_micro_batches(self, batches: list[tuple[torch.Tensor, torch.Tensor, Any]],
                              kv_caches: list) -> torch.Tensor:
        """The final hidden states of every micro-batch's tokens, in order (one tensor)."""
        with self.group.together("a pipeline-parallel step"):
            self.group.broadcast(("pipeline", batches))
            hidden, dtype = self.model.config.hidden_size, self.model.norm.weight.dtype
            finals = [torch.empty(len(ids), hidden, dtype=dtype) for ids, _, _ in batches]
            last = (self.stages - 1) * self.tp  # the last stage's first rank sends the final hidden states back
            recvs = [self.group.recv(f, last, tag=i) for i, f in enumerate(finals)]
            sends, outputs = [], []
            for i, (input_ids, positions, meta) in enumerate(batches):
                outputs.append(self.model(input_ids, positions, meta, kv_caches))  # kept alive until sent
                sends.append(self.group.send(outputs[-1], self.tp, tag=i))  # the next stage's first rank
            for work in sends + recvs:
                work.wait()
            return torch.cat(finals) if len(finals) > 1 else finals[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head is on stage 0 (split over its ranks under tensor parallelism: they join in)."""
        with self.group.together("a parallel LM head call"):
            if self.tp > 1:
                self.group.broadcast(("logits", hidden))
            return self.model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
