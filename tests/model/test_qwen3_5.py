"""Qwen3.5 (model/qwen3_5.py), Gated DeltaNet layers beside gated attention, against transformers'
Qwen3_5ForCausalLM on a tiny random checkpoint: the config read as Qwen3_5TextConfig reads it, the delta rule's two
forms against each other, and greedy output token for token (near-tie aware) batched, in chunks, after preemption,
from the prefix cache, from a multimodal checkpoint's text part, on the CPU kernels and on the PyTorch reference."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from tests.engine.drive import run
from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.gguf_serving import assert_gguf_serves
from tests.models.gguf_writer import write_qwen3_5_gguf
from tests.models.hybrid_checks import (
    assert_bfloat16_output_does_not_depend_on_the_batch,
    assert_chunked_and_preempted_output_matches,
    assert_second_turn_hits,
)
from tests.models.reference import make_llm
from tests.models.tiny import make_tiny_model
from tokenmill.model.backends import recurrent
from tokenmill.model.checkpoint import expected_shapes
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model.qwen3_5 import Qwen3_5ForCausalLM
from tokenmill.model_config import ModelConfig
from tokenmill.sampling_params import SamplingParams

LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# p3 is longer than the chunked form's block, so a prompt crosses from one block of it to the next
PROMPTS = {f"p{i}": [(11 * i + 5 * j) % 250 + 3 for j in range(3 + 23 * i)] for i in range(4)}
TOKENS = 12
SHAPE = {"num_layers": len(LAYERS), "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 32, "vocab_size": 256, "layer_types": LAYERS, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
         "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """A tiny Qwen3.5 (two value heads per key head, rotary on 8 of 32 dims) and transformers' greedy answers."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5", **SHAPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf, {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}


def test_the_config_is_read_as_qwen3_5_text_config_reads_it(qwen3_5):
    path, _, _ = qwen3_5
    cfg = load_model_config(path)
    assert cfg.delta_layers == [0, 1, 3] and cfg.conv_kernel == 4 and cfg.rotary_dim == 8 and cfg.qk_norm
    assert (cfg.delta_key_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim) == (2, 4, 16, 8)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    caches = Qwen3_5ForCausalLM.layer_caches(cfg)
    assert [c.kind for c in caches] == ["state", "state", "attention", "state"]
    assert caches[0].state_shapes == ((3, 2 * 2 * 16 + 4 * 8), (4, 16, 8))  # conv inputs; a matrix per value head
    raw = json.loads((path / "config.json").read_text())
    del raw["layer_types"]
    assert ModelConfig.from_hf_dict({**raw, "full_attention_interval": 2}).delta_layers == [0, 2]


def test_the_tensors_expected_are_the_checkpoints_and_the_models(qwen3_5):
    from safetensors import safe_open

    path, _, _ = qwen3_5
    cfg = load_model_config(path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert expected_shapes(cfg) == saved
    with torch.device("meta"):
        targets = Qwen3_5ForCausalLM(cfg).weight_targets()
    assert set(targets) == set(saved)


def test_the_chunked_form_and_the_step_agree_with_transformers():
    """The prompt form (blocks of recurrent.CHUNK) and the one-token step, from a state a first span left, give
    transformers' chunked and recurrent gated delta rule's outputs and states."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = recurrent.CHUNK + 37, 2, 4, 16, 8
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    a, b = torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)
    a_log, dt_bias = 0.5 * torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    state = torch.zeros(3, hv, dk, dv)
    out = recurrent.gated_delta_rule(q[:-1], k[:-1], v[:-1], a[:-1], b[:-1], a_log, dt_bias, state, [(0, t - 1, 2)])
    want, want_state = torch_chunk_gated_delta_rule(q[None, :-1], k[None, :-1], v[None, :-1], g[None, :-1],
                                                    b[None, :-1].sigmoid(), output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[2], want_state[0], atol=1e-5, rtol=1e-5)
    step = recurrent.gated_delta_rule(q[-1:], k[-1:], v[-1:], a[-1:], b[-1:], a_log, dt_bias, state, [(0, 1, 2)])
    want, want_state = torch_recurrent_gated_delta_rule(q[None, -1:], k[None, -1:], v[None, -1:], g[None, -1:],
                                                        b[None, -1:].sigmoid(), initial_state=want_state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(step, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[2], want_state[0], atol=1e-5, rtol=1e-5)
    assert state[0].abs().sum() == 0  # no other slot touched


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_file_as_llama_cpp_writes_it_serves_the_same_model(qwen3_5, tmp_path, qtype):
    """From the converter's layout (value heads tiled, norms + 1, -exp(A_log)): the same config but for the heads'
    order, and transformers' greedy tokens on the file's weights (Q8_0's dequantized); with Q8_0's blocks kept,
    every prompt token's logprob close to the dequantized model's."""
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    path, _, ref = qwen3_5
    file = write_qwen3_5_gguf(path, tmp_path / "qwen3_5.gguf", qtype and getattr(GGMLQuantizationType, qtype))
    cfg, want = load_model_config(file), load_model_config(path)
    assert cfg.delta_tiled_heads and not want.delta_tiled_heads
    assert replace(cfg, delta_tiled_heads=False, rms_norm_eps=want.rms_norm_eps) == want  # the file's: float32
    if qtype is not None:  # the reference runs the weights the file holds, in the checkpoint's head order
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        weights = load_weights(file, cfg)
        grouped = untile(dict(weights.items()), want)
        hf.load_state_dict(grouped, strict=False)
        ref = {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}
    assert_gguf_serves(file, path, PROMPTS, ref, TOKENS, qtype is not None)


def untile(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A GGUF file's Gated DeltaNet tensors with their value heads back in the checkpoint's (grouped) order."""
    nk, nv, dv = cfg.delta_key_heads, cfg.delta_value_heads, cfg.delta_value_dim
    grouped = torch.tensor([(j % (nv // nk)) * nk + j // (nv // nk) for j in range(nv)])  # HF head j <- file head

    def heads(x: torch.Tensor, width: int, dim: int = 0, skip: int = 0) -> torch.Tensor:
        x = x.movedim(dim, 0)
        rest = x[skip:].reshape(nv, width, *x.shape[1:])[grouped].reshape(x[skip:].shape)
        return torch.cat([x[:skip], rest]).movedim(0, dim)

    out = {}
    for name, w in weights.items():
        skip = 2 * nk * cfg.delta_key_dim
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            w = heads(w, dv, skip=skip)
        elif name.endswith("in_proj_z.weight"):
            w = heads(w, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log")):
            w = heads(w, 1)
        elif name.endswith("linear_attn.out_proj.weight"):
            w = heads(w, dv, dim=1)
        out[name] = w
    return out


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_greedy_output_matches_transformers_batched(qwen3_5, backend, monkeypatch):
    path, _, ref = qwen3_5
    llm = make_llm(path, backend, monkeypatch, dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


def test_greedy_output_matches_transformers_in_chunks_and_after_preemption(qwen3_5, monkeypatch):
    path, _, ref = qwen3_5
    conv, matrices = 3 * (2 * 2 * 16 + 4 * 8) * 4, 4 * 16 * 8 * 4
    state, block = 3 * 4 * (conv + matrices), 2 * 2 * 32 * 4 * 4  # 4 slots of 3 layers; a block: K and V of 4
    assert_chunked_and_preempted_output_matches(path, monkeypatch, PROMPTS, ref, TOKENS, state + 30 * block, 8)


def test_a_second_turn_starts_from_the_first_turns_cached_state(qwen3_5, monkeypatch):
    path, hf, ref = qwen3_5
    assert_second_turn_hits(path, monkeypatch, PROMPTS["p3"], ref["p3"][0], TOKENS,
                            lambda prompt, n: hf_greedy(hf, prompt, n))


def test_bfloat16_output_does_not_depend_on_the_batch(qwen3_5, monkeypatch):
    assert_bfloat16_output_does_not_depend_on_the_batch(qwen3_5[0], monkeypatch, PROMPTS, TOKENS)


def test_a_multimodal_checkpoint_serves_its_text_model(qwen3_5, tmp_path, monkeypatch):
    """Qwen3_5ForConditionalGeneration as transformers saves it (text_config, the language model's tensors under
    model.language_model., a vision tower beside them), with a multi-token-prediction tensor as the released
    checkpoints carry: the text model answers as the text-only checkpoint does."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path, hf, ref = qwen3_5
    vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}
    config = Qwen3_5Config(text_config=hf.config.to_dict(), vision_config=vision, tie_word_embeddings=False)
    both = Qwen3_5ForConditionalGeneration(config)
    both.model.language_model.load_state_dict(hf.model.state_dict())
    both.lm_head.load_state_dict(hf.lm_head.state_dict())
    out = tmp_path / "vl"
    both.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in tensors)
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((path / name).read_bytes())
    cfg = load_model_config(out)
    assert cfg.architecture == "Qwen3_5ForCausalLM" and cfg == load_model_config(path)
    llm = make_llm(out, "cpu", monkeypatch, dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    done = run(llm.engine, PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)


@pytest.mark.parametrize("dv", [8, 128])  # 128: the kernel's fixed-width path (Qwen3.5's value heads)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernels_are_the_references(dtype, dv):
    """csrc/recurrent.cpp against the reference on a strided batch of decodes and prompt chunks (the kernel takes
    each token in turn, the reference a prompt's chunked form): the delta rule's outputs and states, the
    convolution's with SiLU, the gated norm; no slot but the batch's touched."""
    from tokenmill.model.backends import CpuBackend, TorchBackend
    from tokenmill.model.cpu_kernels import _extension

    backends = (TorchBackend(), CpuBackend(_extension()))
    gen = torch.Generator().manual_seed(1)
    t, hk, hv, dk = 80, 2, 4, 16
    width = 2 * hk * dk + hv * dv
    qkv = torch.randn(t, width + 5, generator=gen).to(dtype)[:, :width]  # rows strided, as the projection's slices
    q, k = qkv[:, :hk * dk].view(t, hk, dk), qkv[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(t, hv, dv)
    ba = torch.randn(t, 2 * hv, generator=gen).to(dtype)
    a_log, dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(dtype), torch.randn(hv, generator=gen).to(dtype)
    spans = [(0, 1, 3), (1, 71, 0), (71, 72, 1), (72, 80, 4)]  # the long prompt crosses a block of the chunked form
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    states = [torch.randn(6, hv, dk, dv, generator=gen)] * 2
    states = [s.clone() for s in states]
    outs = [backend.gated_delta_rule(q, k, v, ba[:, hv:], ba[:, :hv], a_log, dt_bias, state, spans, tiled)
            for backend, state, tiled in zip(backends, states, (False, False))]
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(states[1], states[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(states[1][2], states[0][2]) and torch.equal(states[1][5], states[0][5])
    tiled = [b.gated_delta_rule(q, k, v, ba[:, hv:], ba[:, :hv], a_log, dt_bias, s.clone(), spans, True)
             for b, s in zip(backends, states)]
    torch.testing.assert_close(tiled[1], tiled[0], **tol)
    assert not torch.allclose(tiled[0], outs[0])  # the heads' order matters
    weight = torch.randn(width, 4, generator=gen).to(dtype)
    conv_states = [torch.randn(6, 3, width, generator=gen)] * 2
    conv_states = [s.clone() for s in conv_states]
    convs = [b.short_conv(qkv, weight, None, s, spans, silu=True) for b, s in zip(backends, conv_states)]
    torch.testing.assert_close(convs[1], convs[0], **tol)
    torch.testing.assert_close(conv_states[1], conv_states[0])
    x, gate = torch.randn(t * hv, dv, generator=gen).to(dtype), torch.randn(t * hv, dv, generator=gen).to(dtype)
    norm = torch.randn(dv, generator=gen).to(dtype)
    torch.testing.assert_close(backends[1].gated_rms_norm(x, gate, norm, 1e-6),
                               backends[0].gated_rms_norm(x, gate, norm, 1e-6), **tol)


MOE_SHAPE = {**{k: v for k, v in SHAPE.items() if k != "intermediate_size"}, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE: 8 experts of 32, two a token, and a shared expert of 64 in every layer."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_5_moe"), arch="qwen3_5_moe", **MOE_SHAPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf, {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}


def test_the_moe_config_and_tensors_are_the_checkpoints(qwen3_5_moe):
    from safetensors import safe_open

    from tokenmill.model.qwen3_5 import Qwen3_5MoeForCausalLM

    path, _, _ = qwen3_5_moe
    cfg = load_model_config(path)
    experts = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_size)
    assert experts == (8, 2, 32, 64)
    assert cfg.norm_topk_prob and cfg.delta_layers == [0, 1, 3] and not cfg.dense_layers
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with safe_open(path / "model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert expected_shapes(cfg) == saved
    with torch.device("meta"):
        assert set(Qwen3_5MoeForCausalLM(cfg).weight_targets()) == set(saved)
    from tokenmill.planner import load_model  # tokenmill plan counts every tensor, the shared expert's too

    assert load_model(str(path)).params == sum(math.prod(s) for s in saved.values())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_moe_greedy_output_matches_transformers_batched_and_from_the_prefix_cache(qwen3_5_moe, backend, monkeypatch):
    path, hf, ref = qwen3_5_moe
    llm = make_llm(path, backend, monkeypatch, dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    done = run(llm.engine, PROMPTS, params)
    for rid, (tokens, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, tokens, logits)
    second = PROMPTS["p3"] + done["p3"].token_ids + [17, 18, 19]
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(PROMPTS["p3"]) + TOKENS - 1) // 4 * 4
    assert_matches_reference(out.outputs[0].token_ids, *hf_greedy(hf, second, TOKENS))
    llm.engine.core.check_idle_invariants()


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_moe_gguf_file_as_llama_cpp_writes_it_serves_the_same_model(qwen3_5_moe, tmp_path, qtype):
    """`qwen35moe`: the experts stacked per layer, the shared expert and its gate beside them; the same config but
    for the heads' order, and transformers' greedy tokens on the file's weights."""
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM

    path, _, ref = qwen3_5_moe
    file = write_qwen3_5_gguf(path, tmp_path / "moe.gguf", qtype and getattr(GGMLQuantizationType, qtype))
    cfg, want = load_model_config(file), load_model_config(path)
    assert replace(cfg, delta_tiled_heads=False, rms_norm_eps=want.rms_norm_eps) == want
    if qtype is not None:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.load_state_dict(stacked_experts(untile(dict(load_weights(file, cfg).items()), want), want), strict=True)
        ref = {rid: hf_greedy(hf, prompt, TOKENS) for rid, prompt in PROMPTS.items()}
    assert_gguf_serves(file, path, PROMPTS, ref, TOKENS, qtype is not None)


def stacked_experts(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert tensors (the checkpoint's names) as transformers' model holds them: each layer's experts stacked,
    gate and up rows side by side."""
    out = {n: w for n, w in weights.items() if ".mlp.experts." not in n}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([weights[f"{p}{e}.gate_proj.weight"],
                                                          weights[f"{p}{e}.up_proj.weight"]])
                                               for e in range(cfg.num_experts)])
        out[p + "down_proj"] = torch.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(cfg.num_experts)])
    return out


def test_tokenmill_plan_reads_the_moe_gguf_file_as_the_directory(qwen3_5_moe, tmp_path):
    from tokenmill.planner import load_model

    path, _, _ = qwen3_5_moe
    from_dir, from_file = load_model(str(path)), load_model(str(write_qwen3_5_gguf(path, tmp_path / "m.gguf")))
    assert from_file.state_layers == from_dir.state_layers and from_file.params == from_dir.params
    assert (from_file.num_experts, from_file.shared_expert_size) == (8, 64)
