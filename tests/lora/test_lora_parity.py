"""LoRA adapters served over the base model (model/lora.py, engine/lora_pool.py): each adapter's greedy output is
the PEFT-merged model's (transformers + peft, float32) token for token, and the base's is the base model's, all in
one batch; more adapters than slots wait their turn and still match; prompts chunked or cached change nothing; an
adapter's KV is never served to another adapter or the base from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.greedy import hf_greedy
from tests.models.tiny import make_tiny_adapter, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(10, 60)), [42, 7], list(range(200, 120, -3))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora"), vocab_size=256, num_kv_heads=2, num_layers=3)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {
        "qv": make_tiny_adapter(model_dir, root / "qv", r=4, alpha=8, seed=1),
        "all": make_tiny_adapter(model_dir, root / "all", r=8, alpha=4, targets=every, seed=2, use_rslora=True),
        "mlp": make_tiny_adapter(model_dir, root / "mlp", r=2, alpha=16, targets=("gate_proj", "down_proj"), seed=3,
                                 rank_pattern={"down_proj": 6}),
    }


def lora(name: str, path) -> LoRARequest:
    return LoRARequest(name, {"qv": 1, "all": 2, "mlp": 3}[name], str(path))


def greedy(model, prompt: list[int]) -> list[int]:
    return hf_greedy(model, prompt, GREEDY.max_tokens)[0]


@pytest.fixture(scope="module")
def references(model_dir, adapters):
    """{adapter name or None: greedy tokens per prompt} from transformers (the adapters merged by peft)."""
    from peft import PeftModel

    refs = {None: [greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), p)
                   for p in PROMPTS]}
    for name, path in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, path).merge_and_unload().eval()
        refs[name] = [greedy(merged, p) for p in PROMPTS]
    assert all(refs[name] != refs[None] for name in adapters)  # each adapter changes the output
    return refs


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=2,
               max_lora_rank=8)


def run(llm, jobs):
    """jobs: [(adapter name or None, prompt index)] -> their greedy tokens, all in one generate call."""
    prompts = [{"prompt_token_ids": PROMPTS[i]} for _, i in jobs]
    loras = [None if name is None else lora(name, llm.adapters[name]) for name, _ in jobs]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_adapters_and_base_in_one_batch_match_peft_merged(model_dir, llm, adapters, references, batch_invariant):
    """Batch-invariant: every step through the C++ layer stack, adapters added after each projection (row loop);
    not: a prompt's first chunk through the modules, its adapter runs of more than 16 rows as two matmuls."""
    if not batch_invariant:
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=2,
                  max_lora_rank=8, batch_invariant=False)
    llm.adapters = adapters
    # three adapters over two slots and the base: the third adapter's requests wait for a slot
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in (None, "qv", "all", "mlp")]
    for (name, i), got in zip(jobs, run(llm, jobs)):
        assert got == references[name][i], (name, i)
    llm.engine.core.check_idle_invariants()


def test_chunked_prompts_and_one_slot_give_the_same_tokens(model_dir, adapters, references):
    small = LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=1,
                max_lora_rank=8, max_num_batched_tokens=16)
    small.adapters = adapters
    jobs = [("all", 1), (None, 1), ("mlp", 3), ("qv", 1), ("all", 3)]
    for (name, i), got in zip(jobs, run(small, jobs)):
        assert got == references[name][i], (name, i)
    small.engine.core.check_idle_invariants()


def test_prefix_cache_is_kept_per_adapter(llm, adapters, references):
    llm.adapters = adapters
    prompt = {"prompt_token_ids": list(range(61, 111))}  # 50 tokens no other test sends: three blocks to cache
    tokens = {}

    def cached(name):
        out = llm.generate([prompt], GREEDY, use_tqdm=False,
                           lora_request=None if name is None else lora(name, adapters[name]))[0]
        assert tokens.setdefault(name, out.outputs[0].token_ids) == out.outputs[0].token_ids
        return out.num_cached_tokens

    first = {name: cached(name) for name in ("qv", None, "all")}
    assert first == {"qv": 0, None: 0, "all": 0}  # the same tokens, but another adapter's KV: not shared
    assert cached("qv") >= 48 and cached(None) >= 48  # the same adapter (or the base) again: its own blocks
    assert len({tuple(t) for t in tokens.values()}) == 3
    llm.engine.core.check_idle_invariants()


def test_an_adapter_needs_enable_lora(model_dir, adapters):
    from tokenmill.errors import InvalidRequest

    plain = LLM(str(model_dir), dtype="float32", kv_cache_memory=4 << 20)
    with pytest.raises(InvalidRequest, match="--enable-lora"):
        plain.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                       lora_request=lora("qv", adapters["qv"]))
    plain.engine.core.check_idle_invariants()


def test_unload_forgets_the_weights_once_unused(llm, adapters):
    llm.adapters = adapters
    run(llm, [("qv", 0)])
    pool = llm.engine.core.runner.lora
    assert "qv" in pool.weights
    llm.engine.core.lora.unload("qv")
    assert "qv" not in pool.weights and "qv" not in pool.names
    assert all(not slots.active[s] for _, slots in pool.slots for s in range(pool.num_slots)
               if pool.names[s] is None)
