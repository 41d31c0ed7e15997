"""What to build the model runner from: the model resolved once from the config, and the KV cache it gets.

Rank 0 (engine/core.py) and every other parallel rank (parallel/worker.py) resolve the same `ModelSpec` and build
their runner from it; it lives apart from the engine core so that a worker rank needs none of the engine loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import EngineConfig, default_kv_cache_memory
from tokenmill.engine.kv_layout import KVLayout
from tokenmill.engine.runner import DTYPES, ModelRunner, kv_bytes_per_token
from tokenmill.errors import ConfigError
from tokenmill.family_config import GEMMA3
from tokenmill.model.backends import auto_dtype
from tokenmill.model.loader import load_model_config, load_weights, resolve_model_path
from tokenmill.model.paths import is_gguf
from tokenmill.model.registry import model_class
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.context import ContextParallel
from tokenmill.parallel.group import PipelineParallel, TensorParallel, rank_device
from tokenmill.parallel.layout import PPStage, TPLayout, check_pipeline_parallel, check_tensor_parallel
from tokenmill.quant.methods import checkpoint_quantization, resolve_quantization


@dataclass
class CacheInfo:
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    dtype: str
    prefix_caching: bool = False
    reserved_tokens: int = 0  # slots a draft model writes past a request's tokens (spec/draft_model.py lookahead)
    # how pages map onto layers (engine/kv_layout.py); with a hybrid one, `num_blocks` counts pages
    layout: KVLayout | None = None
    max_chunk: int = 0  # most tokens a request computes in one step (the scheduler's token budget)
    # a hybrid model's state layers (engine/state_slots.py): one slot per running request, paid from the budget first
    state_slots: int = 0
    state_bytes: int = 0  # of one slot, over every state layer
    # with prefix caching: copies of states at block boundaries that cached prefixes start from (state_snapshots.py)
    state_snapshots: int = 0
    prefix_off_because: str = "--no-prefix-caching"

    @property
    def token_capacity(self) -> int:
        """Tokens one request may reach: the pool, less the slots written ahead of it."""
        if self.layout is not None and self.layout.hybrid:
            return self.layout.token_capacity(self.num_blocks, self.max_chunk) - self.reserved_tokens
        return self.num_blocks * self.block_size - self.reserved_tokens

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (a block of every layer, or of a hybrid layout's `num_slots` layers)."""
        layout, whole = self.layout, self.kv_bytes_per_token * self.block_size
        return whole if layout is None or not layout.hybrid else whole * layout.num_slots // layout.num_paged_layers

    @property
    def total_bytes(self) -> int:
        """What the cache holds: its pages, and the recurrent-state slots beside them."""
        return self.num_blocks * self.page_bytes + (self.state_slots + self.state_snapshots) * self.state_bytes

    def describe(self) -> str:
        hybrid = self.layout is not None and self.layout.hybrid
        size = (f"{self.num_blocks} pages x {self.block_size} tokens, up to {self.token_capacity} tokens a request"
                if hybrid else f"{self.num_blocks} blocks x {self.block_size} tokens = {self.token_capacity} tokens")
        groups = state = ""
        if self.state_slots:
            groups = f" ({self.layout.describe_groups()})"
            state = (f"recurrent state: {self.state_slots} slots x {self.state_bytes / 2**20:.2f} MiB, "
                     f"{self.state_slots * self.state_bytes / 2**20:.0f} MiB, one per running request "
                     "(--max-num-seqs); ")
        prefix = "on" if self.prefix_caching else f"off ({self.prefix_off_because})"
        if self.state_snapshots:
            prefix += (f", {self.state_snapshots} state snapshots at block boundaries "
                       f"({self.state_snapshots * self.state_bytes / 2**20:.0f} MiB)")
        return (f"KV cache{groups}: {size}, {self.kv_bytes_per_token} bytes per token ({self.dtype}), "
                f"{self.num_blocks * self.page_bytes / 2**20:.0f} MiB; "
                + (f"{self.layout.describe()}; " if hybrid else "") + state
                + f"prefix caching {prefix}")


@dataclass
class ModelSpec:
    """What to build the model runner from, resolved once from the config (every tensor-parallel rank the same)."""

    path: Path
    config: ModelConfig
    dtype: torch.dtype
    quantization: str | None
    kv_dtype: torch.dtype

    @classmethod
    def resolve(cls, config: EngineConfig) -> ModelSpec:
        path = resolve_model_path(config.model)
        mc = load_model_config(path).serving(config.scheduler.max_model_len)
        stored = checkpoint_quantization(path)  # an AWQ checkpoint computes as --quantization awq would
        split = config.tensor_parallel_size * config.pipeline_parallel_size > 1  # GGUF blocks dequantized (below)
        dtype = DTYPES[auto_dtype(config.device, config.quantization or stored, gguf=is_gguf(path) and not split)
                       if config.dtype == "auto" else config.dtype]
        quantization = resolve_quantization(config.quantization, path, dtype, config.device,
                                            dtype_asked=config.dtype != "auto")
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(mc, config.tensor_parallel_size, config.enable_expert_parallel)
        if config.pipeline_parallel_size > 1:
            check_pipeline_parallel(mc, config.pipeline_parallel_size)
        if config.enable_lora and mc.moe:
            raise ConfigError(f"--enable-lora does not serve mixture-of-experts models yet ({mc.architecture}: "
                              "adapters of its experts have no slots); serve the model without it")
        if config.context_parallel_size > 1 and mc.architecture == GEMMA3:  # refused here, not at its first step
            raise ConfigError("--context-parallel-size does not serve Gemma 3 yet: its ring attention has neither a "
                              "sliding window nor a query_pre_attn_scalar scale; use --tensor-parallel-size or "
                              "--pipeline-parallel-size")
        # context parallelism keeps the whole model on every rank: any weight format
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1 and quantization in ("gguf", "awq", "int4"):
            if config.quantization is not None or stored is not None:
                raise ConfigError(f"--quantization {quantization} keeps blocks that the parallel ranks cannot split "
                                  "yet; use none, int8 or fp8 with --tensor-parallel-size / --pipeline-parallel-size")
            quantization = None  # a GGUF file's blocks, dequantized: each rank takes its slice
        spec = cls(path, mc, dtype, quantization, config.cache.cache_dtype(dtype))
        if spec.layout(config).state_layers:
            _check_state_layers(config)
        return spec

    def build_runner(self, config: EngineConfig, num_blocks: int, tp: TensorParallel | None = None,
                     pp: PipelineParallel | None = None, cp: ContextParallel | None = None,
                     num_snapshots: int = 0) -> ModelRunner:
        weights = load_weights(self.path, self.config, self.dtype)
        group = next((p.group for p in (tp, pp, cp) if p is not None), None)
        device = (rank_device(config.device, group.rank, config.parallel_size // config.nnodes) if group is not None
                  else config.device)
        return ModelRunner(self.config, weights, self.dtype, device, num_blocks, config.kv_block_size,
                           config.seed, batch_invariant=config.batch_invariant, quantization=self.quantization,
                           kv_dtype=self.kv_dtype, tp=tp, pp=pp, cp=cp, kv_layout=self.layout(config),
                           lora_slots=(config.scheduler.max_loras, config.max_lora_rank) if config.enable_lora
                           else None, num_state_slots=state_slots(config, self.layout(config)),
                           num_snapshots=num_snapshots)

    def layout(self, config: EngineConfig) -> KVLayout:
        """Hybrid (sliding-window layers give back the blocks that left their window) where the model has such
        layers and every reader of the KV cache reads it through the layers' own tables; uniform where something
        reads or writes a request's KV as whole layers of blocks: a pipeline stage's share of the layers, context
        parallelism's split blocks, a KV transfer (disaggregated prefill), a draft model's cache at the same block
        ids; or with --disable-hybrid-kv-cache-manager."""
        mc = self.config
        caches = model_class(mc).layer_caches(mc)
        if (config.cache.disable_hybrid_kv_cache_manager or config.pipeline_parallel_size > 1
                or config.context_parallel_size > 1 or config.kv_transfer is not None
                or (config.speculative is not None and config.speculative.method == "draft_model")):
            return KVLayout.uniform(mc.num_layers, config.kv_block_size, caches)
        return KVLayout.for_layers(caches, config.kv_block_size,
                                   config.scheduler.max_model_len or mc.max_position_embeddings)


def _check_state_layers(config: EngineConfig) -> None:
    """What layers with recurrent state cannot be served with yet, refused at start-up with the flag to drop."""
    refused = [flag for flag, on in (
        ("--tensor-parallel-size", config.tensor_parallel_size > 1),
        ("--pipeline-parallel-size", config.pipeline_parallel_size > 1),
        ("--context-parallel-size", config.context_parallel_size > 1),
        ("--kv-transfer-config", config.kv_transfer is not None),
        ("--speculative-config", config.speculative is not None),
        ("--enable-lora", config.enable_lora)) if on]
    if refused:
        raise ConfigError(f"this model's recurrent layers (a state per request) are not served with "
                          f"{', '.join(refused)} yet; serve it without")


def state_slots(config: EngineConfig, layout: KVLayout) -> int:
    """State slots a layout with state layers gets: one per request that may run at once."""
    return config.scheduler.max_num_seqs if layout.state_layers else 0


SNAPSHOTS_PER_SLOT = 4  # state snapshots kept per running request's slot, with prefix caching
SNAPSHOT_SHARE = 4  # at most 1 / this of the budget the slots leave


def state_snapshots(config: EngineConfig, layout: KVLayout, budget: int) -> int:
    """Snapshot rows a layout with state layers gets with prefix caching (engine/state_snapshots.py): four per
    slot, within a quarter of what the slots leave of the budget (the rest stays for pages)."""
    if not config.cache.enable_prefix_caching or not layout.state_layers:
        return 0
    slots = state_slots(config, layout)
    room = max(0, budget - slots * layout.state_bytes) // SNAPSHOT_SHARE // layout.state_bytes
    return min(SNAPSHOTS_PER_SLOT * slots, room)


def threads_per_rank(config: EngineConfig) -> int | None:
    """--threads, or with several parallel ranks on this host the cores shared out among them."""
    if config.num_threads is not None or config.parallel_size == 1:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // (config.parallel_size // config.nnodes))


def size_kv_cache(config: EngineConfig, spec: ModelSpec) -> CacheInfo:
    """How many KV blocks the budget (--kv-cache-memory, else a share of free memory) holds, per rank: a tensor-
    parallel rank keeps its heads' share, every pipeline stage as many blocks as the stage with the most layers,
    and a draft model's KV (at the same block ids, spec/draft_model.py) shares the budget. With context
    parallelism a block is block_size tokens on each rank (parallel/context.py); the bytes per token are whole."""
    mc, cc = spec.config, config.cache
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    per_rank = TPLayout(mc, tp_size, 0, config.enable_expert_parallel).shard_config() if tp_size > 1 else mc
    if pp_size > 1:
        per_rank = PPStage.of(mc, pp_size, pp_size - 1).shard_config(per_rank)
    per_token = kv_bytes_per_token(per_rank, spec.kv_dtype)
    draft_per_token = 0
    if config.speculative is not None and config.speculative.method == "draft_model":
        draft_per_token = kv_bytes_per_token(load_model_config(resolve_model_path(config.speculative.model)),
                                             spec.kv_dtype)
    layout = spec.layout(config)
    per_token = per_token * layout.num_paged_layers // layout.num_layers  # state layers keep no keys
    per_page_token = per_token * layout.num_slots // layout.num_paged_layers  # a hybrid page holds num_slots layers
    budget = cc.kv_cache_memory or default_kv_cache_memory()
    slots, snapshots = state_slots(config, layout), state_snapshots(config, layout, budget)
    pages_budget = budget - (slots + snapshots) * layout.state_bytes  # the state of every request that may run first
    num_blocks = cc.num_blocks or max(0, pages_budget) // ((per_page_token + draft_per_token) * cc.block_size)
    if num_blocks < 1:
        state = (f" after {slots} recurrent-state slots and {snapshots} snapshots of {layout.state_bytes} bytes "
                 "(lower --max-num-seqs)" if slots else "")
        raise ConfigError(f"--kv-cache-memory {budget} bytes holds no block of {cc.block_size} tokens "
                          f"({per_page_token * cc.block_size} bytes){state}; raise it")
    return CacheInfo(num_blocks, config.kv_block_size, per_token, str(spec.kv_dtype).removeprefix("torch."),
                     cc.enable_prefix_caching and (snapshots > 0 or not slots), layout=layout,
                     prefix_off_because="--no-prefix-caching" if not cc.enable_prefix_caching
                     else "no room for state snapshots: raise --kv-cache-memory",
                     reserved_tokens=config.speculative.lookahead if config.speculative is not None else 0,
                     max_chunk=config.scheduler.max_num_batched_tokens, state_slots=slots,
                     state_bytes=layout.state_bytes, state_snapshots=snapshots)
