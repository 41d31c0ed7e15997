"""LFM2 (model/lfm2.py), short-convolution layers beside attention, against transformers' Lfm2ForCausalLM on a
tiny random checkpoint: the config read as Lfm2Config reads it, and greedy output token for token (near-tie
aware) batched, in chunks and after preemption, on the CPU kernels and on the plain-PyTorch reference."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.drive import run
from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.reference import make_llm
from tests.models.tiny import make_tiny_model
from tokenmill.model.checkpoint import expected_shapes
from tokenmill.model.lfm2 import Lfm2ForCausalLM
from tokenmill.model.loader import load_model_config
from tokenmill.model_config import ModelConfig
from tokenmill.sampling_params import SamplingParams

LAYERS = ["conv", "full_attention", "conv", "conv", "full_attention"]
PROMPTS = {f"p{i}": [(11 * i + 5 * j) % 250 + 3 for j in range(3 + 7 * i)] for i in range(4)}
TOKENS = 12


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """A tiny LFM2 (conv kernel 3, the feed-forward width derived: 2/3 of 200 rounded up to 16s) and
    transformers' greedy answers to PROMPTS."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("lfm2"), arch="lfm2", num_layers=len(LAYERS),
                           hidden_size=64, intermediate_size=200, num_heads=4, num_kv_heads=2, vocab_size=256,
                           layer_types=LAYERS, conv_L_cache=3, block_multiple_of=16, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf, {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}


def test_the_config_is_read_as_lfm2config_reads_it(lfm2):
    path, hf, _ = lfm2
    cfg = load_model_config(path)
    assert cfg.conv_layers == [0, 2, 3] and cfg.conv_kernel == 3 and not cfg.conv_bias and cfg.qk_norm
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 144  # 133 rounded up
    assert cfg.rms_norm_eps == hf.config.norm_eps and cfg.tie_word_embeddings
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    caches = Lfm2ForCausalLM.layer_caches(cfg)
    assert [c.kind for c in caches] == ["state", "attention", "state", "state", "attention"]
    assert caches[0].state_shapes == ((2, 64),)  # the last kernel - 1 inputs of each channel


def test_the_tensors_expected_are_the_checkpoints_and_the_models(lfm2):
    """What opening a checkpoint checks (checkpoint.expected_shapes, plain Python) names every tensor
    transformers saved, and the model's parameters map onto exactly those."""
    from safetensors import safe_open

    path, _, _ = lfm2
    cfg = load_model_config(path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert expected_shapes(cfg) == saved
    with torch.device("meta"):
        targets = Lfm2ForCausalLM(cfg).weight_targets()
    assert set(targets) == set(saved)


def test_a_config_without_layer_types_takes_every_layer_off_full_attn_idxs(lfm2):
    path, _, _ = lfm2
    raw = json.loads((path / "config.json").read_text())
    del raw["layer_types"]
    raw.update(full_attn_idxs=[1, 4], block_auto_adjust_ff_dim=False, tie_embedding=False)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.conv_layers == [0, 2, 3] and cfg.intermediate_size == 200 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_greedy_output_matches_transformers_batched(lfm2, backend, monkeypatch):
    path, _, ref = lfm2
    llm = make_llm(path, backend, monkeypatch, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


def test_greedy_output_matches_transformers_in_chunks_and_after_preemption(lfm2, monkeypatch):
    """4-token chunks carry the convolution state from chunk to chunk; a pool too small for every request at
    once preempts some, which start again from a zero state."""
    path, _, ref = lfm2
    state, block = 3 * 4 * (2 * 64 * 4), 2 * 2 * 2 * 16 * 4 * 4  # 4 slots of 3 layers; 2 layers' 4 tokens
    llm = make_llm(path, "cpu", monkeypatch, dtype="float32", block_size=4, max_num_seqs=4, new_token_ratio=0,
                   max_num_batched_tokens=4, long_prefill_token_threshold=4,
                   kv_cache_memory=state + 10 * block)
    needed = sum(-(-(len(p) + TOKENS) // 4) for p in PROMPTS.values())
    assert llm.engine.core.cache_info.num_blocks < needed
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert llm.engine.core.scheduler.num_preemptions > 0, "the pool was meant to be short"
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


def test_bfloat16_output_does_not_depend_on_the_batch(lfm2, monkeypatch):
    path, _, _ = lfm2
    llm = make_llm(path, "cpu", monkeypatch, dtype="bfloat16", kv_cache_memory=4 << 20, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    together = run(llm.engine, PROMPTS, params)
    for rid, prompt in PROMPTS.items():
        assert run(llm.engine, {rid: prompt}, params)[rid].token_ids == together[rid].token_ids
