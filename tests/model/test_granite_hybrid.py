"""Granite-4.0-H (model/granite_hybrid.py), Mamba2 layers beside attention with Granite's multipliers, against
transformers' GraniteMoeHybridForCausalLM (no experts) on a tiny random checkpoint: the config, the tensors, the
scan kernel against its reference, and greedy output token for token (near-tie aware) batched, in chunks, after
preemption and from the prefix cache, on the CPU kernels and on the PyTorch reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.engine.drive import run
from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.gguf_serving import assert_gguf_serves
from tests.models.gguf_writer import write_granite_hybrid_gguf
from tests.models.hybrid_checks import (
    assert_bfloat16_output_does_not_depend_on_the_batch,
    assert_chunked_and_preempted_output_matches,
    assert_second_turn_hits,
)
from tests.models.reference import make_llm
from tests.models.tiny import make_tiny_model
from tokenmill.errors import ConfigError
from tokenmill.model.checkpoint import expected_shapes
from tokenmill.model.granite_hybrid import GraniteHybridForCausalLM
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model_config import ModelConfig
from tokenmill.sampling_params import SamplingParams

LAYERS = ["mamba", "attention", "mamba", "mamba"]
PROMPTS = {f"p{i}": [(11 * i + 5 * j) % 250 + 3 for j in range(3 + 23 * i)] for i in range(4)}
TOKENS = 12
# 8 heads of 16 in 2 groups of B and C (16 wide); the multipliers away from 1, so a missing one changes the output
SHAPE = {"num_layers": len(LAYERS), "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "num_kv_heads": 2,
         "vocab_size": 256, "layer_types": LAYERS, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
         "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_expand": 2, "embedding_multiplier": 0.5,
         "residual_multiplier": 0.9, "attention_multiplier": 0.1, "logits_scaling": 2.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("granite"), arch="granite_hybrid", **SHAPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf, {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}


def test_the_config_is_read_as_transformers_reads_it(granite):
    path, _, _ = granite
    cfg = load_model_config(path)
    assert cfg.mamba_layers == [0, 2, 3] and (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state) == (8, 16, 16)
    assert cfg.mamba_groups == 2 and cfg.conv_kernel == 4 and cfg.conv_bias and cfg.intermediate_size == 96
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == (
        0.5, 0.9, 0.1, 2.0)
    assert cfg.nope_layers == [0, 1, 2, 3]  # no position_embedding_type: no rotary
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    caches = GraniteHybridForCausalLM.layer_caches(cfg)
    assert [c.kind for c in caches] == ["state", "attention", "state", "state"]
    assert caches[0].state_shapes == ((3, 128 + 2 * 2 * 16), (8, 16, 16))
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match="num_local_experts"):
        ModelConfig.from_hf_dict({**raw, "num_local_experts": 4})


def test_the_tensors_expected_are_the_checkpoints_and_the_models(granite, tmp_path):
    from safetensors import safe_open

    from tokenmill.model.checkpoint import fused_parts

    path, _, _ = granite
    cfg = load_model_config(path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    expected = expected_shapes(cfg)
    covered = {}
    for name, shape in saved.items():  # the shared MLP's input_linear holds its gate and up rows
        parts = {name: (name, 0, shape[0])} if name in expected else fused_parts(name, expected)
        assert parts, name
        covered.update(parts)
    assert set(covered) == set(expected)
    assert all(saved[n] == expected[n] for n in saved if n in expected)
    with torch.device("meta"):
        targets = GraniteHybridForCausalLM(cfg).weight_targets()
    assert set(targets) == set(expected)
    from tokenmill.planner import load_model  # tokenmill plan: the same parameters and state as the engine's

    planned = load_model(str(path))
    assert planned.params == sum(math.prod(shape) for shape in saved.values())
    assert planned.state_bytes_per_sequence == sum(c.state_bytes for c in GraniteHybridForCausalLM.layer_caches(cfg))
    from_file = load_model(str(write_granite_hybrid_gguf(path, tmp_path / "g.gguf")))
    assert from_file.params == planned.params and from_file.state_layers == planned.state_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_scan_is_the_references(dtype):
    """csrc/recurrent.cpp's Mamba2 scan against the reference on strided rows of decodes and prompt spans: the same
    outputs and states, no other slot touched."""
    from tokenmill.model.backends import CpuBackend, TorchBackend
    from tokenmill.model.cpu_kernels import _extension

    backends = (TorchBackend(), CpuBackend(_extension()))
    gen = torch.Generator().manual_seed(2)
    t, heads, dim, groups, size = 40, 8, 16, 2, 16
    width = heads * dim + 2 * groups * size + heads
    rows = torch.randn(t, width + 3, generator=gen).to(dtype)[:, :width]
    x = rows[:, :heads * dim].view(t, heads, dim)
    b = rows[:, heads * dim:heads * dim + groups * size].view(t, groups, size)
    c = rows[:, heads * dim + groups * size:heads * dim + 2 * groups * size].view(t, groups, size)
    dt = rows[:, -heads:]
    a_log, d, dt_bias = (torch.randn(heads, generator=gen).to(dtype) for _ in range(3))
    spans = [(0, 1, 3), (1, 30, 0), (30, 31, 1), (31, 40, 4)]
    states = [torch.randn(6, heads, dim, size, generator=gen)] * 2
    states = [s.clone() for s in states]
    outs = [backend.mamba2_scan(x, dt, b, c, a_log, d, dt_bias, s, spans) for backend, s in zip(backends, states)]
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(states[1], states[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(states[1][2], states[0][2]) and torch.equal(states[1][5], states[0][5])


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_file_as_llama_cpp_writes_it_serves_the_same_model(granite, tmp_path, qtype):
    """From the converter's layout (q/k rows in rotary order, -exp(A_log), norm weights by group, the shared MLP
    split): the same config, and transformers' greedy tokens on the file's weights (Q8_0's dequantized); with
    Q8_0's blocks kept, every prompt token's logprob close to the dequantized model's."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    path, _, ref = granite
    file = write_granite_hybrid_gguf(path, tmp_path / "granite.gguf", qtype and getattr(GGMLQuantizationType, qtype))
    cfg, want = load_model_config(file), load_model_config(path)
    float32 = ("rms_norm_eps", "residual_multiplier", "attention_multiplier")  # the file's, in float32
    assert replace(cfg, max_position_embeddings=want.max_position_embeddings,
                   **{k: getattr(want, k) for k in float32}) == want
    if qtype is not None:  # the reference runs the weights the file holds
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        weights = load_weights(file, cfg)
        state = {n: weights[n] for n in weights if "shared_mlp" not in n}
        for i in range(cfg.num_layers):  # the shared MLP's gate and up rows back in one input_linear
            p = f"model.layers.{i}.shared_mlp."
            gate_up = [weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]]
            state[p + "input_linear.weight"] = torch.cat(gate_up)
            state[p + "output_linear.weight"] = weights[p + "output_linear.weight"]
        hf.load_state_dict(state, strict=True)
        ref = {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}
    assert_gguf_serves(file, path, PROMPTS, ref, TOKENS, qtype is not None)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_greedy_output_matches_transformers_batched(granite, backend, monkeypatch):
    path, _, ref = granite
    llm = make_llm(path, backend, monkeypatch, dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


def test_greedy_output_matches_transformers_in_chunks_and_after_preemption(granite, monkeypatch):
    path, _, ref = granite
    conv, ssm = 3 * (128 + 64) * 4, 8 * 16 * 16 * 4
    state, block = 3 * 4 * (conv + ssm), 2 * 2 * 16 * 4 * 4  # 4 slots of 3 layers; a block: K and V of 4 tokens
    assert_chunked_and_preempted_output_matches(path, monkeypatch, PROMPTS, ref, TOKENS, state + 30 * block, 8)


def greedy_without_cache(hf, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and logits from a whole forward pass per token. transformers' own generate on this model and
    this test's second turn (87 tokens) picks a token its uncached forward does not (85 where the forward's argmax is
    114, by 1.7), so the forward is the reference here."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits.append(hf(torch.tensor([ids])).logits[0, -1].float())
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], logits


def test_a_second_turn_starts_from_the_first_turns_cached_state(granite, monkeypatch):
    path, hf, ref = granite
    assert_second_turn_hits(path, monkeypatch, PROMPTS["p3"], ref["p3"][0], TOKENS,
                            lambda prompt, n: greedy_without_cache(hf, prompt, n))


def test_bfloat16_output_does_not_depend_on_the_batch(granite, monkeypatch):
    assert_bfloat16_output_does_not_depend_on_the_batch(granite[0], monkeypatch, PROMPTS, TOKENS)
