"""A mixture of experts behind `tokenmill serve`: the engine process starts (its start-up summary names the experts'
weight format), and concurrent greedy completions over HTTP are what the offline engine gives for each prompt."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.models.tiny import make_tiny_model
from tests.server.conftest import start_server
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 11], [12, 200, 31], list(range(40, 72))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe-server"), arch="olmoe", vocab_size=256, num_kv_heads=2,
                           num_experts=8, num_experts_per_tok=2, clip_qkv=3.0)


@pytest.mark.slow
def test_concurrent_completions_are_the_offline_engines(model):
    llm = LLM(str(model), dtype="float32", kv_cache_memory=16 << 20)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                        use_tqdm=False)]
    server = start_server("--model", str(model))
    try:
        assert "weights: float32" in server.stderr()

        def complete(prompt):
            return httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                              json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})

        with cf.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(complete, PROMPTS * 2))
        for i, r in enumerate(got):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[i % len(PROMPTS)]
    finally:
        assert server.stop() == 0
