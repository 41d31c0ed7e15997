"""Rotary tables that grow with the positions served (model/layers.py RotaryEmbedding): a row is the same bits
whatever the tables' length, and an engine whose requests run past the first tables (the Python steps and the C++
whole-model decode built on them) gives the tokens of an engine whose tables held every position from the start."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.model import layers
from tokenmill.model.backends.cpu_decode import DECODE_MODEL
from tokenmill.model.layers import RotaryEmbedding

SCALINGS = [None, {"rope_type": "linear", "factor": 8.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
             "original_max_position_embeddings": 64, "attention_factor": 1.2}]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_grown_tables_hold_the_rows_of_whole_tables(monkeypatch, scaling):
    whole = RotaryEmbedding(16, 1000, 10000.0, scaling)
    monkeypatch.setattr(layers, "TABLE_POSITIONS", 32)
    grown = RotaryEmbedding(16, 1000, 10000.0, scaling)
    assert grown.cos.shape == (32, 16) and whole.cos.shape == (1000, 16)
    positions = torch.tensor([0, 5, 31, 32, 100, 999])
    for dtype in (torch.float32, torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(grown.tables(positions, dtype), whole.tables(positions, dtype)))
    assert grown.cos.shape[0] == 1000  # doubled past 999, capped at max_positions
    assert not grown.cover(1000) and grown.cover(10) is False


def test_requests_past_the_first_tables_give_the_tokens_of_whole_tables(tmp_path, monkeypatch):
    path = str(make_tiny_model(tmp_path, vocab_size=256, num_kv_heads=2))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 40, 90, 7 * i + 1]} for i in range(3)]
    want = [o.outputs[0].token_ids for o in LLM(path, kv_cache_memory=8 << 20).generate(prompts, params,
                                                                                          use_tqdm=False)]
    monkeypatch.setattr(layers, "TABLE_POSITIONS", 16)  # decode steps cross 16 and 32: the tables grow twice
    for steps in (1, 8):  # step by step, and in whole-model runs of 8 (the C++ decode model, where it is built)
        llm = LLM(path, kv_cache_memory=8 << 20, num_scheduler_steps=steps)
        assert llm.engine.core.runner.model.rotary.cos.shape[0] == 16
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        model = llm.engine.core.runner.model
        assert model.rotary.cos.shape[0] >= 44
        built = model.backend_cache.get(DECODE_MODEL)
        if steps > 1 and llm.engine.core.runner.backend.name == "cpu":  # the runs went through a rebuilt model
            assert built is not None and built[0] is not None
            assert built[1] is model.rotary.rounded(model.norm.weight.dtype)[0]
