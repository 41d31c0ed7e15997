"""benchmarks/window_kv.py's measurement on a tiny Gemma 3 (a 5-key window, 4-token blocks): both layouts finish
the same requests, and the hybrid one holds fewer KV bytes for them."""

from __future__ import annotations

import random

from benchmarks.tests.scripts import load_benchmark_script
from tests.model.test_kv_window_model import SPEC
from tests.models.tiny import make_tiny_model
from tokenmill import LLM


def test_the_hybrid_layout_holds_less_for_the_same_requests(tmp_path):
    window_kv = load_benchmark_script("window_kv.py")
    model = make_tiny_model(tmp_path, **SPEC)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(60)] for _ in range(3)]
    got = {}
    for name, off in window_kv.LAYOUTS.items():
        llm = LLM(str(model), dtype="float32", block_size=4, kv_cache_memory=1 << 20,
                  disable_hybrid_kv_cache_manager=off)
        got[name] = window_kv.run(llm, prompts, output_len=8)
    for result in got.values():
        assert result["most_running"] == 3 and result["preemptions"] == 0 and result["tokens_per_s"] > 0
    # 68 tokens of 6 layers (17 uniform blocks) against 17 full pages of 2 layers and at most 4 blocks of window pages
    assert got["uniform"]["most_held_mib"] == 3 * 17 * 6 * 4 * 256 / 2**20
    assert got["hybrid"]["most_held_mib"] <= 3 * (17 + 2 * 4) * 2 * 4 * 256 / 2**20
