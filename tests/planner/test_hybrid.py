"""`tokenmill plan` on a hybrid (LFM2): parameters per layer kind, KV over the attention layers only, and
the fixed state of the short-convolution layers in each sequence's memory, on a tiny checkpoint and on
LFM2-350M's shape."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tokenmill.plan import add_plan_arguments, run_plan
from tokenmill.planner import GPUS, Deployment, load_model, plan
from tokenmill.planner.roofline import kv_bytes_per_token, kv_bytes_per_token_per_gpu

LAYERS = ["conv", "full_attention", "conv", "conv", "full_attention"]

# LFM2-350M's config.json (https://huggingface.co/LiquidAI/LFM2-350M/blob/main/config.json): its shape
LFM2_350M = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 1024, "num_hidden_layers": 16,
    "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    "num_attention_heads": 16, "num_key_value_heads": 8, "block_ff_dim": 6656, "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "conv_L_cache": 3, "conv_bias": False,
    "vocab_size": 65536, "tie_embedding": True, "max_position_embeddings": 128000, "norm_eps": 1e-5,
    "torch_dtype": "bfloat16"}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    rc = run_plan(parser.parse_args(argv))
    return rc, capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_lfm2(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lfm2"), arch="lfm2", num_layers=5, hidden_size=64,
                           intermediate_size=200, num_heads=4, num_kv_heads=2, vocab_size=256,
                           layer_types=LAYERS, conv_L_cache=3, block_multiple_of=16)


def test_tiny_lfm2_parameters_kv_and_state(tiny_lfm2):
    from safetensors import safe_open

    with safe_open(tiny_lfm2 / "model.safetensors", framework="pt") as f:
        saved = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    m = load_model(str(tiny_lfm2))
    assert m.params == saved  # tied embeddings: saved, and counted, once
    assert m.intermediate_size == 144 and m.qk_norm  # 2/3 of 200 rounded up to 16s, as Lfm2Config derives it
    assert m.attention_layer_count == 2 and [s.layers for s in m.state_layers] == [(0, 2, 3)]
    assert kv_bytes_per_token(m, "bf16") == 2 * 2 * 2 * 16 * 2  # K and V, 2 attention layers, 2 KV heads x 16
    assert m.state_bytes_per_sequence == 3 * 2 * 64 * 4  # 3 conv layers x (kernel 3 - 1) x hidden, float32


def test_tiny_lfm2_state_is_the_engines(tiny_lfm2):
    """The planner's state per sequence is what the engine's layer caches declare for the same config."""
    from tokenmill.model.lfm2 import Lfm2ForCausalLM
    from tokenmill.model.loader import load_model_config

    caches = Lfm2ForCausalLM.layer_caches(load_model_config(tiny_lfm2))
    assert load_model(str(tiny_lfm2)).state_bytes_per_sequence == sum(c.state_bytes for c in caches)


def test_tiny_lfm2_cli_text_and_json(tiny_lfm2, capsys):
    rc, out = _run(["--model", str(tiny_lfm2), "--gpu", "cpu", "--context", "512", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["params"] == load_model(str(tiny_lfm2)).params
    assert data["kv_bytes_per_token"] == 256 and data["state_bytes_per_sequence"] == 1536
    assert data["kv_bytes_per_sequence"] == 256 * 512 + 1536 == data["kv_bytes_per_sequence_per_gpu"]
    per_seq = data["kv_bytes_per_sequence"]
    assert data["max_concurrent_sequences"] == data["kv_budget_bytes_per_gpu"] // per_seq
    rc, out = _run(["--model", str(tiny_lfm2), "--gpu", "cpu", "--context", "512"], capsys)
    assert rc == 0 and "recurrent state per sequence" in out and "1,536 B" in out
    assert "3 short convolution, 2 attention" in out


def test_lfm2_350m_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LFM2_350M))
    m = load_model(str(tmp_path))
    print(f"LFM2-350M: {m.params:,} parameters")
    assert m.params == pytest.approx(354e6, rel=0.02)
    assert m.intermediate_size == 4608 and m.tie_word_embeddings
    assert kv_bytes_per_token(m, "bf16") == 2 * 6 * 8 * 64 * 2
    assert m.state_bytes_per_sequence == 10 * 2 * 1024 * 4
    # the same model named by full_attn_idxs instead of layer_types
    by_idxs = {k: v for k, v in LFM2_350M.items() if k != "layer_types"}
    by_idxs["full_attn_idxs"] = [2, 5, 8, 10, 12, 14]
    (tmp_path / "config.json").write_text(json.dumps(by_idxs))
    assert load_model(str(tmp_path)) == m


def test_state_splits_over_tp_and_pipeline_stages(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LFM2_350M))
    m = load_model(str(tmp_path))
    p = plan(m, Deployment(hardware=GPUS["h100"], tp=2, pp=3, context=8192))
    # stages [0, 6), [6, 11), [11, 16): 4, 3 and 3 conv layers, 2 attention layers each
    assert p.state_bytes_per_sequence_per_gpu == 4 * 2 * 1024 * 4 // 2
    assert kv_bytes_per_token_per_gpu(m, 2, 3, "bf16") == 2 * 2 * 4 * 64 * 2
    kv = p.kv_bytes_per_token_per_gpu * 8192
    assert p.kv_bytes_per_sequence_per_gpu == kv + p.state_bytes_per_sequence_per_gpu
    assert p.max_concurrent_sequences == p.kv_budget_bytes_per_gpu // p.kv_bytes_per_sequence_per_gpu


def test_state_counts_in_the_sequences_that_fit_and_the_decode_step(tmp_path):
    """At a short context the state is a tenth of a sequence's memory: fewer sequences fit than the KV alone
    would allow, and a decode step reads and writes each one's state."""
    (tmp_path / "config.json").write_text(json.dumps(LFM2_350M))
    m = load_model(str(tmp_path))
    dep = Deployment(hardware=GPUS["l40s"], context=64, batch=8)
    p = plan(m, dep)
    kv, state = p.kv_bytes_per_token * 64, m.state_bytes_per_sequence
    assert p.max_concurrent_sequences == p.kv_budget_bytes_per_gpu // (kv + state)
    assert p.max_concurrent_sequences < 0.95 * p.kv_budget_bytes_per_gpu // kv
    weights = p.weights_bytes  # a dense model's decode step reads every weight
    assert p.decode_bytes_per_gpu == pytest.approx(weights + 8 * kv + 2 * 8 * state)


def test_a_gguf_file_of_lfm2_names_its_convolution_layers_as_its_config_does(tiny_lfm2, tmp_path):
    """llama.cpp's LFM2 metadata (a KV head count per layer, 0 for a convolution layer): the same layers, KV per
    token and state as from config.json; the parameters from the file's tensors."""
    from tests.models.gguf_writer import write_lfm2_gguf

    from_dir = load_model(str(tiny_lfm2))
    from_gguf = load_model(str(write_lfm2_gguf(tiny_lfm2, tmp_path / "lfm2.gguf")))
    assert from_gguf.state_layers == from_dir.state_layers and from_gguf.qk_norm
    assert from_gguf.state_bytes_per_sequence == from_dir.state_bytes_per_sequence == 3 * 2 * 64 * 4
    assert kv_bytes_per_token(from_gguf, "bf16") == kv_bytes_per_token(from_dir, "bf16")
    assert from_gguf.params == from_dir.params


def test_tiny_qwen3_5_parameters_kv_and_state_are_the_checkpoints_and_the_engines(tmp_path):
    """Qwen3.5: Gated DeltaNet layers' parameters and state, the attention layers' doubled query projection
    (each head's output gate), and the multimodal form's config (text_config) read the same."""
    from safetensors import safe_open

    from tests.model.test_qwen3_5 import SHAPE
    from tests.models.tiny import make_tiny_model
    from tokenmill.model.loader import load_model_config
    from tokenmill.model.qwen3_5 import Qwen3_5ForCausalLM

    path = make_tiny_model(tmp_path, arch="qwen3_5", **SHAPE)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    m = load_model(str(path))
    assert m.params == saved and m.attention_layer_count == 1 and [s.layers for s in m.state_layers] == [(0, 1, 3)]
    caches = Qwen3_5ForCausalLM.layer_caches(load_model_config(path))
    assert m.state_bytes_per_sequence == sum(c.state_bytes for c in caches) == 3 * 4 * (3 * 96 + 4 * 16 * 8)
    assert kv_bytes_per_token(m, "bf16") == 2 * 2 * 32 * 2  # K and V of the one attention layer's 2 KV heads
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]  # a text_config names none
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {**config, "model_type": "qwen3_5_text"}, "vision_config": {}}
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(vl))
    assert load_model(str(tmp_path / "vl")).state_layers == m.state_layers
    from tests.models.gguf_writer import write_qwen3_5_gguf

    from_file = load_model(str(write_qwen3_5_gguf(path, tmp_path / "q.gguf")))
    assert from_file.state_layers == m.state_layers and from_file.params == saved and from_file.gated_attention
