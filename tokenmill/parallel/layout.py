"""How a model splits across tensor-parallel ranks (Megatron style, as vLLM does it): each rank holds a contiguous
range of the query heads, of the KV heads (each KV head on several ranks when there are more ranks than KV
heads), of the MLP's intermediate columns and of the vocabulary; the norms are whole everywhere.

`TPLayout.shard_config` is the model a rank builds (the same classes, smaller), and `ShardedCheckpoint` hands each
rank its slice of every checkpoint tensor by name, so the loader writes only that slice: no rank ever holds the
whole model. Plain Python and torch slicing: no collectives here (parallel/group.py has those).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse a layout the model cannot take, naming the fix."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {size}")
    h, kvh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % size:
        sizes = [n for n in range(1, h + 1) if h % n == 0 and (kvh % n == 0 or n % kvh == 0) and inter % n == 0]
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the model's {h} attention heads; "
                          f"sizes that fit: {', '.join(map(str, sizes))}")
    if kvh % size and size % kvh:
        raise ConfigError(f"--tensor-parallel-size {size} neither divides the model's {kvh} KV heads nor is a "
                          "multiple of them (each rank needs whole KV heads)")
    if (not cfg.moe or cfg.dense_layers) and inter % size:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the MLP's {inter} intermediate columns")
    if cfg.moe and expert_parallel and cfg.num_experts % size:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the model's {cfg.num_experts} experts "
                          "(each rank holds as many under --enable-expert-parallel)")
    if cfg.moe and not expert_parallel and cfg.moe_intermediate_size % size:
        raise ConfigError(f"--tensor-parallel-size {size} does not divide the experts' {cfg.moe_intermediate_size} "
                          "columns; try --enable-expert-parallel (whole experts per rank)")


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank`'s share of `cfg` (the whole model's shape) over `size` ranks."""

    cfg: ModelConfig
    size: int
    rank: int
    # a mixture of experts' experts split whole among the ranks (vLLM's --enable-expert-parallel), rather than each
    # expert's columns: each rank runs its experts for the tokens routed to them, and the MLP's all-reduce sums them
    expert_parallel: bool = False

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kvh, n = self.cfg.num_kv_heads, self.size
        return self.rank * kvh // n if n <= kvh else self.rank // (n // kvh)

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.size

    @property
    def vocab(self) -> int:
        """Vocabulary rows per rank: the last rank's are padded with zero rows when the size does not divide it."""
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    @property
    def experts(self) -> range:
        """The experts this rank holds (all of them, their columns split, without expert parallelism)."""
        if not self.expert_parallel:
            return range(self.cfg.num_experts)
        n = self.cfg.num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def expert_columns(self) -> int:
        """Each held expert's intermediate columns on this rank."""
        return self.cfg.moe_intermediate_size // (1 if self.expert_parallel else self.size)

    def shard_config(self) -> ModelConfig:
        moe = {}
        if self.cfg.moe:
            moe = {"moe_intermediate_size": self.expert_columns,
                   "expert_range": (self.experts.start, len(self.experts)) if self.expert_parallel else None}
        return replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.intermediate, vocab_size=self.vocab, **moe)

    def describe(self) -> str:
        c = self.cfg
        return (f"tensor parallel: {self.size} ranks; each holds {self.heads} of {c.num_heads} query heads, "
                f"{self.kv_heads} of {c.num_kv_heads} KV heads"
                f"{' (replicated)' if self.size > c.num_kv_heads else ''}, {self.intermediate} of "
                f"{c.intermediate_size} MLP columns, {self.vocab} of {c.vocab_size} vocabulary rows"
                + (f"; experts {self.experts.start}-{self.experts.stop - 1} of {c.num_experts} whole"
                   if c.moe and self.expert_parallel else
                   f"; {self.expert_columns} of {c.moe_intermediate_size} columns of every expert" if c.moe else ""))


class ShardedCheckpoint(Mapping):
    """A checkpoint (any name -> tensor mapping, e.g. checkpoint.Checkpoint) as one rank sees it: each tensor its
    rank's slice, by the role its Hugging Face name gives it."""

    def __init__(self, weights: Mapping[str, torch.Tensor], layout: TPLayout):
        self.weights, self.layout = weights, layout
        # expert parallelism: the other ranks' experts are not this rank's to load
        self.names = [n for n in weights if _expert(n) is None or _expert(n)[0] in layout.experts]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.weights and (not isinstance(name, str) or _expert(name) is None
                                         or _expert(name)[0] in self.layout.experts)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.weights[name]
        lay, d = self.layout, self.layout.cfg.head_dim
        expert = _expert(name)
        if expert is not None:  # whole under expert parallelism, else its columns as a dense MLP's
            cols = lay.expert_columns
            if lay.expert_parallel:
                return t
            return t.narrow(1 if expert[1] in ("down_proj", "w2") else 0, lay.rank * cols, cols)
        leaf = name.rsplit(".", 2)
        proj = leaf[-2] if len(leaf) >= 2 else ""
        if proj in ("q_norm", "k_norm") and t.shape[0] != d:  # OLMoE's norms span the whole projection
            proj = proj[0] + "_proj"
        if proj == "q_proj":
            return t.narrow(0, lay.rank * lay.heads * d, lay.heads * d)
        if proj in ("k_proj", "v_proj"):
            return t.narrow(0, lay.kv_head_start * d, lay.kv_heads * d)
        if proj == "o_proj":
            return t.narrow(1, lay.rank * lay.heads * d, lay.heads * d)
        if proj in ("gate_proj", "up_proj"):
            return t.narrow(0, lay.rank * lay.intermediate, lay.intermediate)
        if proj == "down_proj":
            return t.narrow(1, lay.rank * lay.intermediate, lay.intermediate)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = t[lay.vocab_start:lay.vocab_start + lay.vocab]
            if len(rows) < lay.vocab:  # the last rank's padding: rows no token id reaches, logits sliced off
                rows = torch.cat([rows, rows.new_zeros(lay.vocab - len(rows), t.shape[1])])
            return rows
        return t


_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def _expert(name: str) -> tuple[int, str] | None:
    """(expert, projection) of an expert's tensor name; None for any other."""
    m = _EXPERT_NAME.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


def check_pipeline_parallel(cfg: ModelConfig, stages: int) -> None:
    if stages < 1:
        raise ConfigError(f"--pipeline-parallel-size must be >= 1, got {stages}")
    if stages > cfg.num_layers:
        raise ConfigError(f"--pipeline-parallel-size {stages} exceeds the model's {cfg.num_layers} layers (each stage "
                          "needs at least one); use at most that many stages")


@dataclass(frozen=True)
class PPStage:
    """Pipeline stage `index` of `count`: layers [start, end). The first stage (rank 0, the engine's process) also
    embeds the tokens and computes the logits from the last stage's output; every stage holds the final norm (a
    vector), which only the last applies. When the layers do not split evenly the later stages take one more."""

    index: int
    count: int
    start: int
    end: int

    @staticmethod
    def of(cfg: ModelConfig, count: int, index: int) -> PPStage:
        base, extra = divmod(cfg.num_layers, count)
        sizes = [base + (1 if i >= count - extra else 0) for i in range(count)]
        start = sum(sizes[:index])
        return PPStage(index, count, start, start + sizes[index])

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        return replace(cfg, num_layers=self.end - self.start,
                       nope_layers=[i - self.start for i in cfg.nope_layers if self.start <= i < self.end],
                       dense_layers=[i - self.start for i in cfg.dense_layers if self.start <= i < self.end],
                       sliding_layers=[i - self.start for i in cfg.sliding_layers if self.start <= i < self.end])

    @staticmethod
    def describe(cfg: ModelConfig, count: int, micro_batches: int) -> str:
        ranges = " | ".join(f"{s.start}-{s.end - 1}" for s in (PPStage.of(cfg, count, i) for i in range(count)))
        return (f"pipeline parallel: {count} stages, layers {ranges}; up to {micro_batches} micro-batches in "
                "flight per step")


class StageCheckpoint(Mapping):
    """A checkpoint as one pipeline stage sees it: its layers, renumbered from 0, the final norm, and on the first
    stage the embedding and the LM head."""

    def __init__(self, weights: Mapping[str, torch.Tensor], stage: PPStage):
        self.weights, self.stage = weights, stage
        self.names: dict[str, str] = {}  # the stage's name -> the checkpoint's
        for name in weights:
            mine = self._local(name)
            if mine is not None:
                self.names[mine] = name

    def _local(self, name: str) -> str | None:
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            i = int(index)
            return f"model.layers.{i - self.stage.start}.{rest}" if self.stage.start <= i < self.stage.end else None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return name if self.stage.first else None
        return name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.names[name]]
