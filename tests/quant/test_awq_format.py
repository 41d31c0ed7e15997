"""AWQ's on-disk and run-time forms (tokenmill/formats/awq_format.py, model/hf_checkpoint.py AWQCheckpoint): AutoAWQ's GEMM
packing, round-to-nearest groups, Q4_Z blocks that decode to exactly (q - z) * s, and a written checkpoint that
loads back with clear errors for the broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny import make_tiny_model
from tests.quant.common import assert_kept_tracks_dense
from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.formats.awq_format import (
    AWQ_ORDER,
    Int4Groups,
    pack_features,
    quantize_groups,
    unpack_features,
)
from tokenmill.formats.gguf_blocks import Q4_Z, dequantize
from tokenmill.model.cpu_kernels import _extension

ops = _extension()
KEPT = ops.gguf_kernel() if ops is not None else ""  # amx, vnni, or "" (the reference)
KV = 64 << 20


def test_packing_follows_autoawq_order():
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8)  # feature c has code c
    packed = pack_features(codes)
    # nibble i holds feature AWQ_ORDER[i]: 0, 2, 4, 6, 1, 3, 5, 7 from the low bits up
    assert packed.item() == sum(f << (4 * i) for i, f in enumerate(AWQ_ORDER)) == 0x75316420
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 16, (5, 32), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_features(pack_features(many)), many)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_groups_round_within_half_a_step_and_blocks_decode_exactly(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(48, 256, generator=g) * 0.1
    w[3, 7] = 2.0  # an outlier stretches its group only
    q = quantize_groups(w, group)
    step = q.scale.float().repeat_interleave(group, dim=1)
    assert ((w - q.dequantize()).abs() <= step / 2 + 1e-6).all()
    back = Int4Groups.from_awq(**q.to_awq(), group=group)
    assert all(torch.equal(a, b) for a, b in ((back.q, q.q), (back.scale, q.scale), (back.zero, q.zero)))
    blocks = q.to_blocks()
    assert blocks.ggml_type == Q4_Z and blocks.data.shape == (48, 256 // 32 * 19)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(blocks.data, Q4_Z, (48, 256), dtype), q.dequantize(dtype))


def test_group_size_must_divide_and_blocks_need_multiples_of_32():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_groups(torch.randn(8, 96), 64)
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        quantize_groups(torch.randn(8, 96), 16).to_blocks()
    q = quantize_groups(torch.randn(16, 64), 32).to_awq()
    with pytest.raises(ModelLoadError, match="do not make"):
        Int4Groups.from_awq(q["qweight"], q["qzeros"][:1], q["scales"], 32, "layer.x")


def rtn_checkpoint(tmp_path, **kw):
    src = make_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, **kw)
    out = tmp_path / "rtn"
    assert main(["quantize", "--method", "rtn", "--model", str(src), "--out", str(out), "--no-progress"]) == 0
    return src, out


def test_written_checkpoint_is_autoawq_layout_and_reloads_to_the_same_outputs(tmp_path):
    src, out = rtn_checkpoint(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] | {"tokenmill": None} == {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None, "tokenmill": None}
    tensors = load_file(out / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.qweight"].dtype == torch.int32 and tensors[f"{q}.qweight"].shape == (64, 64 // 8)
    assert tensors[f"{q}.qzeros"].shape == (1, 8) and tensors[f"{q}.scales"].dtype == torch.float16
    assert f"{q}.weight" not in tensors and "model.embed_tokens.weight" in tensors
    # the dequantized checkpoint is the source with each matmul weight rounded to nearest and the rest in
    # bfloat16, as written: the same outputs as that model
    source = load_file(src / "model.safetensors")
    for name, w in source.items():
        base = name.removesuffix(".weight")
        quantized = f"{base}.qweight" in tensors
        source[name] = quantize_groups(w.float(), 64).dequantize() if quantized else w.bfloat16().float()
    save_file(source, src / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    by_hand = LLM(str(src), dtype="float32", kv_cache_memory=KV).generate(batch, params, use_tqdm=False)
    loaded = LLM(str(out), dtype="float32", quantization="none", kv_cache_memory=KV)
    for a, b in zip(by_hand, loaded.generate(batch, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.skipif(not KEPT, reason="no kept-block kernel here (AMX or AVX512-VNNI); the dequantizing reference")
def test_kept_awq_groups_track_the_dequantized_checkpoint(tmp_path):
    """Bit for bit on AMX tiles; to x's rounding in two int8 parts on VNNI and AVX2."""
    _, out = rtn_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    batch = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 17, 40)]
    kept = LLM(str(out), kv_cache_memory=KV)  # an AWQ checkpoint serves as awq by default, in the CPU's dtype
    dtype = "bfloat16" if ops.bf16_kernel() else "float32"  # model/backends/__init__.py auto_dtype
    assert kept.engine.core.quantization == "awq" and f"awq ({dtype}" in kept.engine.core.runner.weight_summary()
    layer = kept.engine.core.runner.model.layers[0]
    assert layer.mlp.gate_up_proj.packed_weight.shape[-1] == ops.gguf_tile_bytes(Q4_Z)
    dense = LLM(str(out), dtype=dtype, quantization="none", kv_cache_memory=KV)
    assert_kept_tracks_dense(dense.generate(batch, params, use_tqdm=False),
                             kept.generate(batch, params, use_tqdm=False), exact=KEPT == "amx")
    kept.engine.core.check_idle_invariants()


def test_reference_backend_serves_awq_groups(tmp_path):
    _, out = rtn_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = [{"prompt_token_ids": list(range(9, 30))}]
    ref = LLM(str(out), dtype="float32", quantization="none", kv_cache_memory=KV).generate(batch, params,
                                                                                        use_tqdm=False)
    awq = LLM(str(out), dtype="float32", quantization="awq", kv_cache_memory=KV)  # blocks kept, no tiles in float32
    assert awq.engine.core.runner.model.layers[0].self_attn.qkv_proj.gguf_type == Q4_Z
    assert awq.generate(batch, params, use_tqdm=False)[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_bad_inputs_name_the_fix(tmp_path, capsys):
    src, out = rtn_checkpoint(tmp_path)
    assert main(["quantize", "--method", "rtn", "--model", str(src), "--out", str(tmp_path / "g"),
                 "--group-size", "48"]) == 2
    assert "--group-size 48 must be a multiple of 32" in capsys.readouterr().err
    assert main(["quantize", "--method", "rtn", "--model", str(src), "--out", str(out)]) == 2  # not empty
    assert "choose a new one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", "--method", "gptq", "--out", str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="tokenmill quantize --method awq"):
        LLM(str(src), quantization="awq", kv_cache_memory=KV)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj.weight both as it is and in another form"):
        LLM(str(out), kv_cache_memory=KV)
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj lacks qzeros"):
        LLM(str(out), kv_cache_memory=KV)
