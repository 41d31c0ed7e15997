"""LoRA on the real default model (SmolLM2 GGUF, bfloat16, kept Q4_1 blocks): with --enable-lora a base request's
greedy output is the plain engine's token for token, alone and batched beside adapter requests (whose steps leave
the whole-layer C++ path for the modules); an adapter changes its own requests' output and no one else's."""

from __future__ import annotations

import pytest

from benchmarks.lora import write_adapter
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest
from tokenmill.model.paths import default_model_path

PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root, model = tmp_path_factory.mktemp("smol-lora"), default_model_path()
    return [LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", model, 8, targets, seed=i, scale=0.2)))
            for i, targets in enumerate([("q_proj", "v_proj"), ("o_proj", "gate_proj", "up_proj", "down_proj")])]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_base_requests_unchanged_beside_adapters(adapters):
    with LLM() as plain:
        want = tokens(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(enable_lora=True, max_loras=2) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        mixed = tokens(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False,
                                    lora_request=[None, adapters[0], None, adapters[1]] * 2))
        alone = [tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=a)) for a in adapters]
        llm.engine.core.check_idle_invariants()
    assert [mixed[i] for i in (0, 2, 4, 6)] == [want[0], want[2]] * 2
    assert [mixed[i] for i in (1, 5)] == [alone[0][1]] * 2 and [mixed[i] for i in (3, 7)] == [alone[1][3]] * 2
    assert alone[0] != want and alone[1] != want
