"""Weights loaded straight into their final format: per-parameter weight loaders (fused q/k/v and gate/up shards in
their rows), a lazy Checkpoint read one tensor at a time, and a model built in its dtype with no float32 copy."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models.tiny import make_tiny_model
from tokenmill.engine.runner import ModelRunner
from tokenmill.errors import ModelLoadError
from tokenmill.formats import gguf_blocks
from tokenmill.formats.gguf import GGUFFile
from tokenmill.model.checkpoint import Checkpoint
from tokenmill.model.linear import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import (
    allocate_parameters,
    default_model_path,
    load_model_config,
    load_weights,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Qwen2 (q/k/v biases), GQA, untied: every kind of parameter and shard."""
    path = make_tiny_model(tmp_path_factory.mktemp("loader"), arch="qwen2", num_heads=4, num_kv_heads=2,
                           num_layers=2, vocab_size=256, tie_word_embeddings=False)
    return path, load_file(path / "model.safetensors")


def build(path: Path, dtype: torch.dtype) -> ModelRunner:
    """The reference runner: no backend packs (and so releases) the plain weights these tests read back."""
    cfg = load_model_config(path)
    return ModelRunner(cfg, load_weights(path, cfg), dtype, "cpu", num_blocks=2, block_size=4, use_kernel=False)


# ---- one fused layer ---------------------------------------------------------------------------------------


def test_fused_shards_land_in_their_rows_in_any_order():
    layer = Linear(8, [4, 2, 2], bias=True, dtype=torch.bfloat16)
    shards = [torch.randn(n, 8) for n in (4, 2, 2)]
    biases = [torch.randn(n) for n in (4, 2, 2)]
    for i in (2, 0, 1):  # a checkpoint need not list q, k, v in order
        layer.weight_loader(layer.weight, shards[i], i)
        layer.weight_loader(layer.bias, biases[i], i)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight, torch.cat(shards).to(torch.bfloat16))
    assert torch.equal(layer.bias, torch.cat(biases).to(torch.bfloat16))
    assert layer.shard_offsets == [0, 4, 6] and layer.out_features == 8


def test_wrong_shape_shard_is_refused_and_writes_nothing():
    layer = Linear(8, [4, 2, 2], bias=False)
    before = layer.weight.detach().clone()
    for shard, bad in [(1, torch.zeros(4, 8)), (0, torch.zeros(4, 7)), (None, torch.zeros(2, 8))]:
        with pytest.raises(ModelLoadError, match=r"shape disagrees with the model's: \(\d+, \d+\) != \(\d+, 8\)"):
            layer.weight_loader(layer.weight, bad, shard)
    assert torch.equal(layer.weight, before)


# ---- the whole model ---------------------------------------------------------------------------------------


def test_model_weights_are_the_checkpoint_fused_in_place(tiny):
    path, saved = tiny
    model = build(path, torch.float32).model
    for i in range(2):
        p, layer = f"model.layers.{i}.", model.layers[i]
        qkv = [saved[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
        assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([saved[p + f"self_attn.{n}_proj.bias"]
                                                                     for n in "qkv"]))
        assert torch.equal(layer.mlp.gate_up_proj.weight,
                           torch.cat([saved[p + "mlp.gate_proj.weight"], saved[p + "mlp.up_proj.weight"]]))
        assert torch.equal(layer.mlp.down_proj.weight, saved[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, saved[p + "input_layernorm.weight"])
    assert torch.equal(model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_runner_builds_the_model_in_its_dtype(tiny, dtype):
    """Built on the meta device in `dtype`, then given real memory: every parameter ends up loaded, in `dtype`,
    on the CPU, with no other copy (the model is never cast after loading)."""
    path, saved = tiny
    model = build(path, dtype).model
    params = dict(model.named_parameters())
    assert params and all(p.dtype == dtype and p.device.type == "cpu" and not p.requires_grad
                          for p in params.values())
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"][-32:],  # the v rows: 2 KV heads x 16 dims
                       saved["model.layers.1.self_attn.v_proj.weight"].to(dtype))
    assert torch.equal(params["norm.weight"], saved["model.norm.weight"].to(dtype))


def test_allocate_parameters_keeps_dtype_and_sharing():
    with torch.device("meta"):
        model = torch.nn.Sequential(Linear(4, [2, 2], dtype=torch.bfloat16), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # shared
    allocate_parameters(model, torch.device("cpu"))
    assert model[1].weight is model[0].weight
    assert [(p.device.type, p.dtype, p.requires_grad) for p in model.parameters()] == [
        ("cpu", torch.bfloat16, False), ("cpu", torch.bfloat16, False), ("cpu", torch.float32, False)]


def test_wrong_shape_in_the_model_names_the_tensor(tiny):
    path, saved = tiny
    cfg = load_model_config(path)
    model = LlamaForCausalLM(cfg)
    bad = dict(saved, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight'.*shape disagrees.*"
                                             r"\(16, 64\) != \(32, 64\)"):
        model.load_hf_weights(bad)


def test_missing_and_unknown_tensors_are_refused_before_any_write(tiny):
    path, saved = tiny
    model = LlamaForCausalLM(load_model_config(path))
    before = model.norm.weight.detach().clone()
    missing = {k: v for k, v in saved.items() if k != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"missing 1 tensors.*model\.layers\.0\.mlp\.up_proj\.weight"):
        model.load_hf_weights(missing)
    extra = dict(saved, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ModelLoadError, match=r"does not use.*q_norm"):
        model.load_hf_weights(extra)
    assert torch.equal(model.norm.weight, before)
    # what checkpoints carry and the model recomputes is not an error
    model.load_hf_weights(dict(saved, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))


class Tracked(Mapping[str, torch.Tensor]):
    """A mapping that hands out fresh tensors and counts how many are alive at once."""

    def __init__(self, source: Mapping[str, torch.Tensor]):
        self.source, self.alive, self.most_alive, self.reads = source, 0, 0, 0

    def _gone(self) -> None:
        self.alive -= 1

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.source[name].clone()
        self.reads += 1
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        weakref.finalize(t, self._gone)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


def test_load_holds_one_checkpoint_tensor_at_a_time(tiny):
    path, saved = tiny
    weights = Tracked(saved)
    threads = torch.get_num_threads()
    LlamaForCausalLM(load_model_config(path)).load_hf_weights(weights)
    assert weights.reads == len(saved) and weights.most_alive == 1
    assert torch.get_num_threads() == threads  # its single-thread section is undone


# ---- the lazy Checkpoint -------------------------------------------------------------------------------------


def test_checkpoint_reads_a_tensor_only_when_asked(monkeypatch):
    reads = []
    real = GGUFFile.read_tensor
    monkeypatch.setattr(GGUFFile, "read_tensor", lambda self, name, dtype=None: reads.append(name) or
                        real(self, name, dtype))
    path = default_model_path()
    ckpt = load_weights(path, load_model_config(path), torch.bfloat16)
    assert isinstance(ckpt, Checkpoint) and len(ckpt) == 272
    assert "model.norm.weight" in ckpt and "lm_head.weight" not in ckpt  # tied
    assert reads == []
    w = ckpt["model.layers.0.self_attn.k_proj.weight"]
    assert reads == ["blk.0.attn_k.weight"] and w.dtype == torch.bfloat16 and w.shape == (192, 576)
    with pytest.raises(KeyError):
        ckpt["lm_head.weight"]


class LargestFloat32(TorchDispatchMode):
    """The most elements any float32 tensor made by a torch op has."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.most = max(self.most, t.numel())
        return out


def test_bfloat16_gguf_load_makes_no_float32_tensor_past_a_chunk():
    """SmolLM2 (Q4_1) into a bfloat16 model: dequantizing goes a chunk of rows at a time, so no float32 copy of a
    tensor, let alone of the model, exists (the embedding alone would be 28M float32 elements)."""
    path = default_model_path()
    cfg = load_model_config(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, dtype=torch.bfloat16)
    allocate_parameters(model, torch.device("cpu"))
    with LargestFloat32() as seen:
        model.load_hf_weights(load_weights(path, cfg, torch.bfloat16))
    assert 0 < seen.most <= gguf_blocks.DEQUANTIZE_CHUNK
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
