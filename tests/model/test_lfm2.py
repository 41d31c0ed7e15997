"""LFM2 (model/lfm2.py), short-convolution layers beside attention, against transformers' Lfm2ForCausalLM on a
tiny random checkpoint: the config read as Lfm2Config reads it, and greedy output token for token (near-tie
aware) batched, in chunks and after preemption, on the CPU kernels and on the plain-PyTorch reference."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.drive import run
from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.gguf_serving import assert_gguf_serves
from tests.models.gguf_writer import write_lfm2_gguf
from tests.models.hybrid_checks import (
    assert_bfloat16_output_does_not_depend_on_the_batch,
    assert_chunked_and_preempted_output_matches,
    assert_second_turn_hits,
)
from tests.models.reference import make_llm
from tests.models.tiny import make_tiny_model
from tokenmill.model.checkpoint import expected_shapes
from tokenmill.model.lfm2 import Lfm2ForCausalLM
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model_config import ModelConfig
from tokenmill.sampling_params import SamplingParams

LAYERS = ["conv", "full_attention", "conv", "conv", "full_attention"]
PROMPTS = {f"p{i}": [(11 * i + 5 * j) % 250 + 3 for j in range(3 + 7 * i)] for i in range(4)}
TOKENS = 12


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """A tiny LFM2 (conv kernel 3, the feed-forward width derived: 2/3 of 200 rounded up to 32s) and
    transformers' greedy answers to PROMPTS."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("lfm2"), arch="lfm2", num_layers=len(LAYERS),
                           hidden_size=64, intermediate_size=200, num_heads=4, num_kv_heads=2, vocab_size=256,
                           layer_types=LAYERS, conv_L_cache=3, block_multiple_of=32, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf, {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}


def test_the_config_is_read_as_lfm2config_reads_it(lfm2):
    path, hf, _ = lfm2
    cfg = load_model_config(path)
    assert cfg.conv_layers == [0, 2, 3] and cfg.conv_kernel == 3 and not cfg.conv_bias and cfg.qk_norm
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 160  # 133 rounded up
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


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_file_as_llama_cpp_writes_it_serves_the_same_model(lfm2, tmp_path, qtype):
    """From the converter's layout: the same config, and transformers' greedy tokens on the file's weights
    (Q8_0's dequantized); with Q8_0's blocks kept, every prompt token's logprob close to the dequantized
    model's."""
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    path, _, ref = lfm2
    file = write_lfm2_gguf(path, tmp_path / "lfm2.gguf", qtype and getattr(GGMLQuantizationType, qtype))
    cfg, want = load_model_config(file), load_model_config(path)
    assert (cfg.conv_layers, cfg.conv_kernel, cfg.intermediate_size, cfg.num_kv_heads, cfg.qk_norm) == (
        want.conv_layers, want.conv_kernel, want.intermediate_size, want.num_kv_heads, want.qk_norm)
    if qtype is not None:  # the reference runs the weights the file holds
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        weights = load_weights(file, cfg)
        hf.load_state_dict({name: weights[name] for name in weights}, strict=False)
        ref = {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}
    assert_gguf_serves(file, path, PROMPTS, ref, TOKENS, qtype is not None, memory=4 << 20)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_greedy_output_matches_transformers_batched(lfm2, backend, monkeypatch):
    path, _, ref = lfm2
    llm = make_llm(path, backend, monkeypatch, dtype="float32", kv_cache_memory=4 << 20, block_size=4)
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


def test_greedy_output_matches_transformers_in_chunks_and_after_preemption(lfm2, monkeypatch):
    path, _, ref = lfm2
    # 4 slots of 3 layers' state (no prefix cache: no snapshots); a block: 2 layers' K and V of 4 tokens
    state, block = 3 * 4 * (2 * 64 * 4), 2 * 2 * 2 * 16 * 4 * 4
    assert_chunked_and_preempted_output_matches(path, monkeypatch, PROMPTS, ref, TOKENS, state + 10 * block, 4)


def test_a_second_turn_starts_from_the_first_turns_cached_state(lfm2, monkeypatch):
    path, hf, ref = lfm2
    assert_second_turn_hits(path, monkeypatch, PROMPTS["p3"], ref["p3"][0], TOKENS,
                            lambda prompt, n: hf_greedy(hf, prompt, n), memory=4 << 20)


def test_bfloat16_output_does_not_depend_on_the_batch(lfm2, monkeypatch):
    assert_bfloat16_output_does_not_depend_on_the_batch(lfm2[0], monkeypatch, PROMPTS, TOKENS)


def test_the_engine_reports_its_state_slots_and_snapshots_to_the_metrics(lfm2):
    """The start-up message carries a hybrid's state slots, their bytes and the snapshots; /metrics shows them."""
    from prometheus_client import generate_latest

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine_args import EngineArgs
    from tokenmill.server.metrics import ServerMetrics

    path, _, _ = lfm2
    config = EngineArgs(model=str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=4,
                        max_num_seqs=4).create_engine_config()
    engine = AsyncEngine(config)
    try:
        info = engine.start()
    finally:
        engine.shutdown()
    assert (info.state_slots, info.state_bytes, info.state_snapshots) == (4, 3 * 2 * 64 * 4, 16)
    assert info.kv_bytes <= 4 << 20 and "recurrent state: 4 slots" in info.startup_summary
    metrics = ServerMetrics("lfm2")
    metrics.set_cache(info.kv_bytes, info.state_slots, info.state_bytes, info.state_snapshots)
    shown = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
             for line in generate_latest(metrics.registry).decode().splitlines() if not line.startswith("#")}
    assert shown["tokenmill_recurrent_state_slots"] == 4 and shown["tokenmill_recurrent_state_snapshots"] == 16
    assert shown["tokenmill_recurrent_state_bytes_per_request"] == 1536
    assert shown["tokenmill_kv_cache_bytes"] == info.kv_bytes
