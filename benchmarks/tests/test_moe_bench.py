"""benchmarks/moe.py's models at a tiny scale: the random MoE and its dense twin load and serve, and the twin
multiplies what a token of the MoE multiplies (the planner's active parameters, the routers aside)."""

from __future__ import annotations

from benchmarks.tests.scripts import load_benchmark_script
from tokenmill import LLM, SamplingParams
from tokenmill.planner.model_files import load_model

TINY = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2}


def test_random_moe_and_its_dense_twin(tmp_path):
    moe_bench = load_benchmark_script("moe.py")
    cfg = {**moe_bench.OLMOE_1B_7B, **TINY}
    moe = moe_bench.write_random_model(tmp_path / "moe", cfg)
    dense = moe_bench.write_random_model(tmp_path / "dense", moe_bench.dense_twin(cfg))
    moe_shape, dense_shape = load_model(str(moe)), load_model(str(dense))
    routers = 2 * 8 * 64
    assert dense_shape.params == moe_shape.active_params - routers
    assert moe_shape.params - moe_shape.active_params == 2 * 6 * 3 * 64 * 32  # 6 idle experts a layer
    for path in (moe, dense):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=16 << 20)
        out = llm.generate([{"prompt_token_ids": list(range(100, 132))}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
