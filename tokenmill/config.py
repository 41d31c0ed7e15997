"""The engine's configuration dataclasses, validated once at the edge (flags, LLM kwargs); inner code trusts them.
The model's own shape is tokenmill/model_config.py's ModelConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.errors import ConfigError
from tokenmill.json_flag import json_flag
from tokenmill.kv_transfer_config import KVTransferConfig

if TYPE_CHECKING:
    import torch

def default_kv_cache_memory() -> int:
    """A quarter of available RAM, capped at 2 GiB: room for the weights, activations and the OS."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail // 4, 2 << 30))


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = default_kv_cache_memory()
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: auto = the model's dtype; fp8 = e4m3, half of bfloat16's bytes
    num_blocks: int | None = None  # set by the engine once the pool is sized
    enable_prefix_caching: bool = True  # share KV blocks of common prefixes (engine/prefix_cache.py)
    # True: sliding-window layers keep every block, as full-attention ones do (engine/kv_layout.py's uniform layout)
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError(f"--block-size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                              f"{self.kv_cache_dtype!r}")

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model computing in `model_dtype`."""
        import torch  # not at import: the API process reads this module without the model stack

        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


# continuous: first come first served; priority: lower `priority` first, preempting worse ones, aging bounds waits;
# static: fixed batches (kept for measurement)
SCHEDULING_POLICIES = ("continuous", "priority", "static")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    policy: str = "continuous"  # or "static" (fixed batches, kept for measurement)
    max_model_len: int | None = None  # set from the model config when None
    # prefills with more tokens left than this share the step (engine/scheduler.py); None = a quarter of
    # max_num_batched_tokens, at least one block; >= max_num_batched_tokens: no sharing (a long prompt takes it all)
    long_prefill_token_threshold: int | None = None
    # while requests decode, a step carries at most this many prompt tokens besides them (None: no cap), so the
    # decodes' steps stay short (inter-token latency) at the cost of prompts taking more steps
    max_prefill_tokens_while_decoding: int | None = None
    # while requests decode, a step that carries prompt chunks beside them takes at most this many times what the
    # decodes alone take (by the measured step cost; at least 50 ms), times 1 + the prompts waiting or under way per
    # decode (policy.step_budget): an inter-token latency p99 within a few TPOTs without a target to set, and no
    # wave of prompts starved. None or 0: off
    max_decode_slowdown: float | None = 3.0
    # latency targets for requests that give none (SamplingParams.slo_*): with an ITL target, a step carries no
    # more prompt tokens than the measured step cost allows within it (engine/scheduler.py)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    priority_aging_s: float = 30.0  # policy priority: a waiting request gains one priority level per this long
    # KV headroom for decode growth (SGLang's new-token ratio): a request is admitted only if the pool keeps room for
    # this share of the output tokens the running requests may still write; the share decays to a tenth of itself
    # while nothing is preempted and goes back up when blocks run out. 0: admit whatever fits now.
    new_token_ratio: float = 0.7
    # multi-step decode: a batch of a few plain decodes (nothing waiting, no ITL target) runs up to this many steps
    # in a row without the engine's per-step Python between them (engine/multi_step.py run_length); 1: off
    num_scheduler_steps: int = 1
    # LoRA: distinct adapters the running requests may use at once (the model's adapter slots)
    max_loras: int = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= 256:
            raise ConfigError(f"--max-loras must be an integer in [1, 256], got {self.max_loras!r}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ConfigError(
                f"--long-prefill-token-threshold must be >= 1, got {self.long_prefill_token_threshold}")
        if self.max_decode_slowdown and self.max_decode_slowdown < 1:
            raise ConfigError(f"--max-decode-slowdown must be >= 1 (or 0: off), got {self.max_decode_slowdown}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ConfigError("--max-prefill-tokens-while-decoding must be >= 1, got "
                              f"{self.max_prefill_tokens_while_decoding}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.policy!r}")
        for name, flag in (("slo_ttft_ms", "--slo-ttft-ms"), ("slo_itl_ms", "--slo-itl-ms"),
                           ("priority_aging_s", "--priority-aging-s")):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{flag} must be a positive number, got {value}")
        if self.num_scheduler_steps < 1:
            raise ConfigError(f"--num-scheduler-steps must be >= 1, got {self.num_scheduler_steps}")
        if not 0 <= self.new_token_ratio <= 1:
            raise ConfigError(f"--new-token-ratio must be in [0, 1], got {self.new_token_ratio}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """--speculative-config, the JSON of vLLM's flag: `{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}` (prompt lookup) or `{"model": PATH, "num_speculative_tokens": 4}`
    (a draft model sharing the target's vocabulary). A request speculates where its acceptance pays for the extra
    compute at the current batch (spec/speculator.py); none does while more than `disable_by_batch_size` run."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # the draft model (method draft_model): an HF directory or a .gguf file
    quantization: str | None = None  # the draft's weights, as --quantization (e.g. awq for an INT4 self-draft)
    disable_by_batch_size: int | None = None  # a hard cap; None: the measured step cost decides (engine/step_cost.py)

    @property
    def lookahead(self) -> int:
        """KV slots past a request's tokens that its proposer writes: a draft model's own KV, up to k positions
        ahead (spec/draft_model.py); prompt lookup writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "quantization",
            "disable_by_batch_size")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (LLM(speculative_config=...)) or None; one clear ConfigError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        kw = json_flag(value, "--speculative-config", cls.KEYS, '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        if "method" not in kw:
            kw["method"] = "draft_model" if kw.get("model") else "ngram"
        return cls(**kw)

    def __post_init__(self) -> None:
        if self.method in ("draft", "draft_model") or (self.method not in SPECULATIVE_METHODS and self.model):
            self.method = "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config: unknown method {self.method!r}; known: ngram, draft_model "
                              "(give \"model\": PATH for a draft model)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                  f"{lo!r} and {hi!r}")
        elif not self.model:
            raise ConfigError('--speculative-config: method draft_model needs "model": a path to the draft')
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError(f"--speculative-config: quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ConfigError("--speculative-config: disable_by_batch_size must be an integer >= 1")


# tokenmill/quant/methods.py builds each (listed here: the config imports no model stack)
# the KV cache's element type: the model's (auto), or FP8 e4m3 (fp8 and fp8_e4m3, vLLM's names), values as they are
# (scale 1, as vLLM without calibrated scales), clamped to +-448
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATION_CHOICES = ("int8", "fp8", "int4", "awq", "gguf", "none")


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the embedded SmolLM2 GGUF
    dtype: str = "auto"  # float32 | bfloat16 | auto
    device: str = "cpu"
    batch_invariant: bool = True  # prompt tokens read their context through the paged kernel (runner.py)
    quantization: str | None = None  # QUANTIZATION_CHOICES; None: the default (tokenmill/quant/methods.py)
    seed: int = 0
    tokenizer: str | None = None
    num_threads: int | None = None  # compute threads (torch intra-op); None = torch's default (the cores)
    tensor_parallel_size: int = 1  # ranks (processes over torch.distributed) each holding a shard of every layer
    enable_expert_parallel: bool = False  # a mixture of experts' experts split whole over those ranks
    pipeline_parallel_size: int = 1  # ranks each holding a contiguous range of the layers
    pipeline_micro_batches: int | None = None  # a step's micro-batches in flight (None: one per stage)
    context_parallel_size: int = 1  # ranks each holding the whole model and 1/C of every sequence's tokens and KV
    distributed_executor_backend: str = "mp"  # ranks 1..N-1 as processes (mp) or Ray tasks (ray)
    # several hosts (torch.distributed's rendezvous): ranks split evenly over the nodes; node 0 runs the server and
    # ranks 0..k-1, node i (`tokenmill worker`) ranks i*k..(i+1)*k-1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: any free port (one node only)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # --speculative-config (JSON text, a dict or a SpeculativeConfig; None: no speculation)
    speculative: SpeculativeConfig | None = None
    # --kv-transfer-config (JSON text, a dict or a KVTransferConfig; None: no disaggregation)
    kv_transfer: KVTransferConfig | None = None
    enable_lora: bool = False  # adapter slots in the model (model/lora.py); requests name adapters (LoRARequest)
    max_lora_rank: int = 16  # the slots' rank: an adapter of a higher rank is refused

    @property
    def parallel_size(self) -> int:
        """Ranks in all: tensor-parallel shards x pipeline stages, or context-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def kv_block_size(self) -> int:
        """The scheduler's block: block_size tokens on each context-parallel rank (parallel/context.py)."""
        return self.cache.block_size * self.context_parallel_size

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.parse(self.speculative)
        self.kv_transfer = KVTransferConfig.parse(self.kv_transfer)
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.num_threads}")
        if not isinstance(self.tensor_parallel_size, int) or not 1 <= self.tensor_parallel_size <= 64:
            raise ConfigError("--tensor-parallel-size must be an integer in [1, 64], got "
                              f"{self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or not 1 <= self.pipeline_parallel_size <= 64:
            raise ConfigError("--pipeline-parallel-size must be an integer in [1, 64], got "
                              f"{self.pipeline_parallel_size!r}")
        if not isinstance(self.context_parallel_size, int) or not 1 <= self.context_parallel_size <= 64:
            raise ConfigError("--context-parallel-size must be an integer in [1, 64], got "
                              f"{self.context_parallel_size!r}")
        if self.context_parallel_size > 1 and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError("--context-parallel-size does not combine with --tensor-parallel-size / "
                              "--pipeline-parallel-size yet; use one kind of parallelism")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ConfigError("--distributed-executor-backend must be mp or ray, got "
                              f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ConfigError("--distributed-executor-backend ray places the ranks on the Ray cluster's nodes itself; "
                              "drop --nnodes (or use mp with `tokenmill worker` on each node)")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ConfigError(f"--pipeline-micro-batches must be >= 1, got {self.pipeline_micro_batches}")
        if not isinstance(self.nnodes, int) or self.nnodes < 1 or self.parallel_size % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} must divide the ranks ({self.parallel_size}: tensor x "
                              "pipeline x context parallel size): every node runs as many")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError(f"--nnodes {self.nnodes} needs --master-port: a port on --master-addr (node 0's "
                              "address) that every node reaches")
        if self.parallel_size > 1 and (self.speculative is not None or self.kv_transfer is not None):
            raise ConfigError("--tensor-parallel-size / --pipeline-parallel-size / --context-parallel-size > 1 do not "
                              "combine with --speculative-config or --kv-transfer-config yet; drop one of them")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"--max-lora-rank must be an integer in [1, 512], got {self.max_lora_rank!r}")
        if self.enable_lora and self.parallel_size > 1:
            raise ConfigError("--enable-lora does not combine with tensor / pipeline / context parallelism yet; "
                              "serve adapters on one rank")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; "
                              f"got {self.quantization!r}")
