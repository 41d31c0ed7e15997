"""PEFT adapter directories read and checked (lora/adapter.py): what cannot be applied exactly is refused with a
message naming it, before any request runs through it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny import make_tiny_adapter, make_tiny_model
from tokenmill.errors import InvalidRequest
from tokenmill.lora.adapter import load_adapter_weights, read_adapter_config
from tokenmill.model_config import ModelConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("base"), vocab_size=256, num_layers=2)


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    return make_tiny_adapter(model_dir, tmp_path_factory.mktemp("a") / "qv", r=4, alpha=8)


@pytest.fixture(scope="module")
def model_config(model_dir):
    return ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))


def edited(adapter, tmp_path, config=None, tensors=None):
    out = tmp_path / "edited"
    shutil.copytree(adapter, out)
    if config is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(out / "adapter_model.safetensors"))), str(out / "adapter_model.safetensors"))
    return out


def test_weights_are_peft_scaled_with_b_transposed(adapter, model_config):
    cfg = read_adapter_config(adapter, 16)
    assert (cfg.rank, cfg.alpha) == (4, 8.0)
    weights = load_adapter_weights(cfg, model_config, 16)
    assert sorted({t for _, t in weights}) == ["q_proj", "v_proj"] and {l for l, _ in weights} == {0, 1}
    raw = load_file(str(adapter / "adapter_model.safetensors"))
    a, b = weights[(1, "v_proj")]
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    torch.testing.assert_close(a, raw[key.format("A")])
    torch.testing.assert_close(b, raw[key.format("B")].t() * 2.0)  # alpha / r


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias 'all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"r": 32}, "above --max-lora-rank 16"),
])
def test_unsupported_configs_are_refused_by_name(adapter, tmp_path, change, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        read_adapter_config(edited(adapter, tmp_path, config=change), 16)
    assert e.value.param == "lora_path"


def test_missing_files_are_named(adapter, tmp_path):
    with pytest.raises(InvalidRequest, match="no adapter_config.json"):
        read_adapter_config(tmp_path, 16)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidRequest, match="safe_serialization"):
        read_adapter_config(tmp_path, 16)


def test_an_adapter_for_another_model_is_refused(adapter, tmp_path, model_config):
    cfg = read_adapter_config(adapter, 16)
    with pytest.raises(InvalidRequest, match="another model"):
        load_adapter_weights(cfg, ModelConfig(**{**model_config.__dict__, "hidden_size": 32}), 16)
    with pytest.raises(InvalidRequest, match="base model has 1"):
        load_adapter_weights(cfg, ModelConfig(**{**model_config.__dict__, "num_layers": 1}), 16)


def test_tensors_outside_the_projections_are_refused(adapter, tmp_path, model_config):
    def with_embedding(t):
        return {**t, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 256)}

    def half_missing(t):
        return {k: v for k, v in t.items() if not k.endswith("layers.0.self_attn.q_proj.lora_B.weight")}

    for change, message in ((with_embedding, "embedding, LM head"), (half_missing, "without its other half")):
        path = edited(adapter, tmp_path / change.__name__, tensors=change)
        with pytest.raises(InvalidRequest, match=message):
            load_adapter_weights(read_adapter_config(path, 16), model_config, 16)
