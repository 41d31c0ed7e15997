"""AWQ's searches (tokenmill/quant/awq.py): folding the scales keeps the dense model's function, on a model whose
activations have salient channels the scale search brings each matmul's INT4 output error below round-to-nearest,
and clipping lowers it further where outliers stretch a group."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.formats.awq_format import fake_quantize
from tokenmill.quant.awq import capture_inputs, dense_state, quantize_model, search_clip, search_scale

KV = 64 << 20


def salient_model(tmp_path):
    """A tiny model whose norms make a few input channels of every matmul 8x larger than the rest, as trained
    models' activations are."""
    path = make_tiny_model(tmp_path, vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4,
                           num_kv_heads=2)
    tensors = load_file(path / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[::16] *= 8.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (48,), generator=g).tolist() for _ in range(n)]


def test_search_never_does_worse_than_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, ::8] *= 10  # salient channels
    w = torch.randn(32, 64, generator=g) * 0.05
    s, rtn, awq = search_scale(w, x, group=32)
    assert s.shape == (64,) and (s > 0).all()
    assert awq < 0.8 * rtn  # the salient columns get finer steps
    assert rtn == ((x @ fake_quantize(w, 32).T - x @ w.T).pow(2).mean().item())


def test_clipping_narrows_groups_with_outliers_and_lowers_their_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 128, generator=g)
    w = torch.randn(16, 128, generator=g) * 0.05
    w[:, 5] = 0.6  # one rare large weight per feature, in the first group: it stretches that group's step
    x[:, 5] *= 0.01  # ... and meets tiny activations, so clipping it costs little
    shrink = search_clip(w, x, 64)
    assert shrink.shape == (16, 2) and ((shrink > 0.5) & (shrink <= 1)).all()
    assert (shrink[:, 0] < 1).all()
    err = lambda q: (x @ q.T - x @ w.T).pow(2).mean().item()
    assert err(fake_quantize(w, 64, shrink)) < err(fake_quantize(w, 64))


def test_awq_folds_scales_without_changing_the_dense_model_and_lowers_int4_error(tmp_path):
    path = salient_model(tmp_path)
    llm = LLM(str(path), dtype="float32", quantization="none", batch_invariant=False, enable_prefix_caching=False,
              kv_cache_memory=KV)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    calib, held_out = prompts(), prompts(4, seed=1)
    before = llm.generate([{"prompt_token_ids": p} for p in held_out], params, use_tqdm=False)
    captured = capture_inputs(llm, calib)
    assert set(captured.rows) == {f"{i}.{m}" for i in range(2) for m in ("qkv", "o", "gate_up", "down")}
    assert all(captured.mean_abs[k].shape == (v.shape[1],) for k, v in captured.rows.items())
    model = llm.engine.core.runner.model
    quantized, report = quantize_model(model, captured, group=32)
    assert all(awq <= rtn for rtn, awq in report.values())
    assert sum(awq for _, awq in report.values()) < 0.9 * sum(rtn for rtn, _ in report.values())
    assert len(quantized) == 2 * 7 and quantized["model.layers.1.self_attn.k_proj.weight"].q.shape == (64, 128)
    model.backend_cache.clear()  # the weights changed: no cached packed views
    llm.engine.core.runner.prepacked = llm.engine.core.runner.backend.prepack(model)
    after = llm.generate([{"prompt_token_ids": p} for p in held_out], params, use_tqdm=False)
    for a, b in zip(before, after):  # the folded scales cancel: the same function, to float32 rounding
        ta, tb = a.outputs[0], b.outputs[0]
        assert ta.token_ids == tb.token_ids
        for la, lb in zip(ta.logprobs, tb.logprobs):
            assert all(abs(la[t] - lb[t]) < 1e-3 for t in la if t in lb)
    # the folded weights load back as a checkpoint, and quantize to INT4 on load
    save_file(dense_state(model), path / "model.safetensors", metadata={"format": "pt"})
    awq = LLM(str(path), dtype="float32", quantization="int4", kv_cache_memory=KV)
    assert len(awq.generate([{"prompt_token_ids": held_out[0]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_rtn_needs_no_calibration_and_unknown_methods_fail(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path)), dtype="float32", quantization="none", batch_invariant=False,
              kv_cache_memory=KV)
    model = llm.engine.core.runner.model
    quantized, report = quantize_model(model, None, group=64, method="rtn")
    assert report == {} and len(quantized) == 2 * 7
    w = model.layers[0].mlp.down_proj.weight
    assert torch.equal(quantized["model.layers.0.mlp.down_proj.weight"].dequantize(), fake_quantize(w, 64))
    with pytest.raises(ValueError, match="unknown method"):
        quantize_model(model, None, group=64, method="gptq")
