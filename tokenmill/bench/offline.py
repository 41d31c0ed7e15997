"""Offline throughput: the engine in-process through `tokenmill.LLM`, fed token ids (no HTTP, no re-tokenizing).

This is the ceiling the server is measured against: every request is submitted at once, greedy, with
`max_tokens` = its dataset output length and `ignore_eos`, so each makes exactly the tokens asked for.
Model loading and a short warm-up stay outside the timed region.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tokenmill.bench.datasets import BenchRequest


def run_offline(llm: Any, requests: Sequence[BenchRequest], progress: bool = True) -> dict[str, Any]:
    """Time `llm.generate` over `requests`; returns totals and throughputs (vLLM's result key names)."""
    from tokenmill.sampling_params import SamplingParams

    if not requests:
        raise ValueError("no requests to run")
    llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:8]}],
                 SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    total_in = sum(r.prompt_len for r in requests)
    total_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "completed": len(outputs),
        "duration": elapsed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(outputs) / elapsed,
        "output_throughput": total_out / elapsed,
        "total_token_throughput": (total_in + total_out) / elapsed,
        "input_lens": [r.prompt_len for r in requests],
        "output_lens": [len(o.outputs[0].token_ids) for o in outputs],
    }
