"""What a model needs to know of how it is split over ranks (parallel/ builds the objects; the model reads them
through these protocols, so model/ imports nothing of parallel/)."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.model_config import ModelConfig


class RankCollectives(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None: ...


class TensorSplitLayout(Protocol):
    cfg: ModelConfig  # the whole model's
    size: int  # ranks
    vocab_start: int  # this rank's first vocabulary row


class TensorSplit(Protocol):
    """Tensor parallelism (parallel/group.py TensorParallel): this rank's shard of every layer."""

    group: RankCollectives
    layout: TensorSplitLayout


class StageSplit(Protocol):
    """Pipeline parallelism (parallel/layout.py PPStage): this stage's layers."""

    first: bool
    last: bool
