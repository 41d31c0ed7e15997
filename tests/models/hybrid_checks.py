"""The engine checks every hybrid family's tests make on its tiny checkpoint: its recurrent state carried across
prompt chunks and restarted after preemption, a second chat turn starting from the first turn's cached state, and
greedy output that does not depend on the rest of the batch. Each takes the family's references as arguments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.engine.drive import run
from tests.greedy import assert_matches_reference
from tests.models.reference import make_llm
from tokenmill.sampling_params import SamplingParams

BLOCK = 4  # tokens a KV block holds in these checks


def assert_chunked_and_preempted_output_matches(path: Path, monkeypatch, prompts: dict[str, list[int]], ref: dict,
                                                tokens: int, memory: int, chunk: int) -> None:
    """`chunk`-token prompt chunks carry the state from chunk to chunk; `memory` (the state slots of 4 requests and
    a few blocks) holds too few blocks for every request at once, so some are preempted and start again from a zero
    state; every answer is still the reference's."""
    llm = make_llm(path, "cpu", monkeypatch, dtype="float32", block_size=BLOCK, max_num_seqs=4, new_token_ratio=0,
                   max_num_batched_tokens=chunk, long_prefill_token_threshold=chunk, enable_prefix_caching=False,
                   kv_cache_memory=memory)
    assert llm.engine.core.cache_info.num_blocks < sum(-(-(len(p) + tokens) // BLOCK) for p in prompts.values())
    done = run(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    assert llm.engine.core.scheduler.num_preemptions > 0, "the pool was meant to be short"
    for rid, (want, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, want, logits)


def assert_second_turn_hits(path: Path, monkeypatch, first: list[int], first_answer: list[int], tokens: int,
                            reference: Callable[[list[int], int], tuple], memory: int = 8 << 20) -> None:
    """The second turn resends the first and its answer: its prefix hit reaches the last block boundary the first
    turn computed (the state there from a snapshot), and it answers as `reference(prompt, tokens)` does."""
    llm = make_llm(path, "cpu", monkeypatch, dtype="float32", kv_cache_memory=memory, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    answer = run(llm.engine, {"t1": first}, params)["t1"].token_ids
    assert answer == first_answer
    second = first + answer + [17, 18, 19]
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    computed = len(first) + tokens - 1  # the first turn's last token was sampled, never fed back
    assert out.num_cached_tokens == computed // BLOCK * BLOCK
    assert_matches_reference(out.outputs[0].token_ids, *reference(second, tokens))
    llm.engine.core.check_idle_invariants()


def assert_bfloat16_output_does_not_depend_on_the_batch(path: Path, monkeypatch, prompts: dict[str, list[int]],
                                                        tokens: int) -> None:
    llm = make_llm(path, "cpu", monkeypatch, dtype="bfloat16", kv_cache_memory=8 << 20, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    together = run(llm.engine, prompts, params)
    for rid, prompt in prompts.items():
        assert run(llm.engine, {rid: prompt}, params)[rid].token_ids == together[rid].token_ids
