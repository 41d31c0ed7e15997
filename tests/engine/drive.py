"""Driving an LLMEngine by hand in tests: token-id prompts in, every request's final output back."""

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    """Add each prompt under its id, step until all finish, check that no block or request state is left."""
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    engine.core.check_idle_invariants()
    return done
