"""Mixture-of-experts models (Mixtral, Qwen3-MoE, OLMoE) from Hugging Face directories and from GGUF files laid
out as llama.cpp's converter lays them out (experts stacked per layer): greedy tokens equal to transformers
`generate` on the same weights, on the reference and CPU kernel backends, in one process and split over two ranks
(expert parallel and tensor parallel); the grouped expert path's rows independent of the step."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.greedy import assert_same_greedy
from tests.model.test_families import BACKENDS, NEW_TOKENS, Case, check_case, make_llm, needs_kernels
from tests.models.gguf_writer import llama_like_writer, write
from tests.models.tiny import BuiltOnFirstUse, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.backends.base import Backend
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model.moe import SparseMoE
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.layout import ShardedCheckpoint, TPLayout, check_tensor_parallel

KV = 64 << 20
VARIANTS = {
    # experts named block_sparse_moe.experts.N.w1/w2/w3, top weights always renormalised (kept in float32)
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # per-head q/k norms, experts narrower than the dense layer 1 (mlp_only_layers), renormalised top weights
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, mlp_only_layers=[1], head_dim=32, num_layers=3),
    # q/k norms over the whole projection, q/k/v clamped, top weights not renormalised
    "olmoe": dict(arch="olmoe", num_experts=4, num_experts_per_tok=2, clip_qkv=2.0),
}
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
PROMPT_LENGTHS = (7, 16, 23, 32)


class MoEFamily:
    def __init__(self, root: Path, variant: str):
        from transformers import AutoModelForCausalLM

        spec = dict(VARIANTS[variant])
        layers = spec.pop("num_layers", 2)
        self.variant = variant
        self.path = make_tiny_model(root, num_heads=4, num_kv_heads=2, num_layers=layers, tie_word_embeddings=False,
                                    **spec)
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.case = Case(hf, {}, PROMPT_LENGTHS)
        self._gguf: dict[object, Path] = {}

    def gguf(self, qtype=None) -> Path:
        if qtype not in self._gguf:
            name = f"{self.path.name}-{'f32' if qtype is None else qtype.name}.gguf"
            self._gguf[qtype] = write_moe_gguf(self.path, self.path.parent / name, self.variant, qtype)
        return self._gguf[qtype]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, MoEFamily]:
    root = tmp_path_factory.mktemp("moe")
    return BuiltOnFirstUse(lambda variant: MoEFamily(root, variant))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_directory_greedy_matches_transformers(families, variant, backend, monkeypatch):
    family = families[variant]
    llm = make_llm(family.path, backend, monkeypatch)
    check_case(llm, family.case)
    model = llm.engine.core.runner.model
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert moe_layers == ([0, 2] if variant == "qwen3_moe" else [0, 1])
    assert len(model.layers[0].mlp.experts) == 4 and not model.whole_layer_kernels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_greedy_matches_transformers(families, variant, backend, monkeypatch):
    family = families[variant]
    check_case(make_llm(family.gguf(), backend, monkeypatch, tokenizer=str(family.path)), family.case)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_reads_as_the_hf_directory(families, variant):
    """The same config and, tensor for tensor, the same weights under the same names: each expert its slice of the
    stacked tensor (Mixtral's q/k rows in HF order again), the router and dense layers where they were."""
    family = families[variant]
    hf_cfg, gguf_cfg = load_model_config(family.path), load_model_config(family.gguf())
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_layers", "clip_qkv", "qk_norm", "head_dim"):
        assert getattr(gguf_cfg, field) == getattr(hf_cfg, field), field
    hf, gguf = load_weights(family.path, hf_cfg), load_weights(family.gguf(), gguf_cfg)
    assert sorted(hf) == sorted(gguf)
    for name in hf:
        assert torch.equal(hf[name], gguf[name]), name


def test_quantized_experts_keep_their_blocks(families, monkeypatch):
    """A Q8_0 file: each expert's blocks are its rows of the stacked tensor (decoding to what the dense read
    gives), the engine keeps them (the experts' layers hold blocks, not dense weights), and serving them gives the
    tokens of the same file dequantized at load."""
    from gguf import GGMLQuantizationType as T

    family = families["olmoe"]
    path = family.gguf(T.Q8_0)
    cfg = load_model_config(path)
    ckpt = load_weights(path, cfg)
    for name in ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.2.down_proj.weight"):
        blocks = ckpt.blocks(name)
        assert blocks.ggml_type == T.Q8_0 and blocks.shape == tuple(ckpt[name].shape)
        assert torch.equal(blocks.dequantize(torch.float32), ckpt[name])
    # the reference backend multiplies kept blocks by their exact dequantization: the same sums as the dense weights
    prompts = [{"prompt_token_ids": p} for p in family.case.prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    kept = make_llm(path, "reference", monkeypatch, tokenizer=str(family.path), quantization="gguf")
    expert = kept.engine.core.runner.model.layers[0].mlp.experts[0].down_proj
    assert getattr(expert, "gguf_type", None) == T.Q8_0
    dense = make_llm(path, "reference", monkeypatch, tokenizer=str(family.path), quantization="none")
    assert getattr(dense.engine.core.runner.model.layers[0].mlp.experts[0].down_proj, "gguf_type", None) is None
    for a, b in zip(kept.generate(prompts, params, use_tqdm=False), dense.generate(prompts, params, use_tqdm=False)):
        assert_same_greedy(a.outputs[0], b.outputs[0])


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep2", "tp2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_match_transformers(families, variant, expert_parallel):
    """Two ranks: with --enable-expert-parallel each holds two of the four experts whole (rank 0's model: experts
    0-1), else every expert's columns are split; either way transformers' tokens."""
    family = families[variant]
    llm = LLM(str(family.path), dtype="float32", kv_cache_memory=KV, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)
    try:
        moe = llm.engine.core.runner.model.layers[0].mlp
        assert (len(moe.experts), moe.first_expert) == ((2, 0) if expert_parallel else (4, 0))
        width = VARIANTS[variant].get("moe_intermediate_size", 128)
        assert moe.experts[0].down_proj.in_features == (width if expert_parallel else width // 2)
        check_case(llm, family.case)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_gguf_over_two_expert_parallel_ranks(families):
    """A GGUF file's experts (Mixtral's: its q/k rows permuted, its experts stacked) split over two ranks."""
    family = families["mixtral"]
    llm = LLM(str(family.gguf()), tokenizer=str(family.path), dtype="float32", kv_cache_memory=KV,
              tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert len(llm.engine.core.runner.model.layers[1].mlp.experts) == 2
        check_case(llm, family.case)
    finally:
        llm.shutdown()


@needs_kernels
def test_kept_gguf_experts_in_one_call(families):
    """Kept Q8_0 expert blocks on the CPU kernels: csrc/moe.cpp's one call gives the bits of the grouped path in
    Python over the same block kernels, alone or in a step of 40 tokens."""
    from gguf import GGMLQuantizationType as T

    family = families["qwen3_moe"]
    llm = LLM(str(family.gguf(T.Q8_0)), tokenizer=str(family.path), dtype="bfloat16", kv_cache_memory=KV,
              quantization="gguf")
    moe = llm.engine.core.runner.model.layers[0].mlp
    backend = moe.backend
    assert isinstance(backend, CpuBackend) and moe.experts[0].down_proj.gguf_type == T.Q8_0
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        ids, weights = moe.route(x)
        together = backend.moe_experts(x, ids, weights, moe.experts, 0)
        alone = torch.cat([backend.moe_experts(x[i:i + 1], ids[i:i + 1], weights[i:i + 1], moe.experts, 0)
                           for i in range(len(x))])
        grouped = Backend.moe_experts(backend, x, ids, weights, moe.experts, 0)
    assert torch.equal(together, grouped) and torch.equal(together, alone)


def test_expert_parallel_layout(families):
    """Rank 1's share under expert parallelism: experts 2-3 under their own numbers, nothing of rank 0's; without
    it, each expert's rows (gate, up) or columns (down) split; a layout that cannot split is refused by name."""
    cfg = load_model_config(families["mixtral"].path)
    ckpt = load_weights(families["mixtral"].path, cfg)
    ep = ShardedCheckpoint(ckpt, TPLayout(cfg, 2, 1, expert_parallel=True))
    experts = sorted({n.split(".experts.")[1].split(".")[0] for n in ep if ".experts." in n})
    assert experts == ["2", "3"] and "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in ep
    assert TPLayout(cfg, 2, 1, expert_parallel=True).shard_config().expert_range == (2, 2)
    tp = ShardedCheckpoint(ckpt, TPLayout(cfg, 2, 1))
    w1, w2 = (f"model.layers.0.block_sparse_moe.experts.3.{p}.weight" for p in ("w1", "w2"))
    assert torch.equal(tp[w1], ckpt[w1][64:]) and torch.equal(tp[w2], ckpt[w2][:, 64:])
    with pytest.raises(ConfigError, match="does not divide the model's 6 experts"):
        check_tensor_parallel(replace(cfg, num_experts=6), 4, expert_parallel=True)
    with pytest.raises(ConfigError, match="try --enable-expert-parallel"):
        check_tensor_parallel(replace(cfg, moe_intermediate_size=126), 4)


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, "int8")])
@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_kernels)])
def test_expert_rows_do_not_depend_on_the_step(families, backend, dtype, quantization):
    """On the CPU kernels a token's MoE output is the same bits alone and inside a step of 40 tokens routed every
    which way (batch-invariant matmuls, the router's 4 rows padded into tiles, each token's products summed in its
    own order); on either backend it equals the plain per-token sum of its experts' outputs."""
    from tokenmill.engine.runner import ModelRunner

    path = families["qwen3_moe"].path
    cfg = load_model_config(path)
    runner = ModelRunner(cfg, load_weights(path, cfg), dtype, "cpu", num_blocks=8, block_size=4,
                         use_kernel=backend == "cpu", batch_invariant=True, quantization=quantization)
    assert isinstance(runner.backend, CpuBackend if backend == "cpu" else TorchBackend)
    moe = runner.model.layers[0].mlp
    # packed where a kernel of ours takes the dtype: float32 panels on every CPU, bfloat16 tiles where AMX or
    # AVX512-BF16 runs them (an AVX2 CPU computes bfloat16 through torch)
    packs = backend == "cpu" and (dtype == torch.float32 or bool(runner.backend.bf16_kernel))
    assert (getattr(moe.experts[0].down_proj, "qweight", None) is not None
            or moe.experts[0].down_proj.packed_weight is not None) == (quantization is not None or packs)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        together = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
        ids, weights = moe.route(x)
        plain = torch.stack([sum(float(weights[t, j]) * moe.experts[int(ids[t, j])](x[t:t + 1])[0].float()
                                 for j in range(ids.shape[1])) for t in range(len(x))]).to(dtype)
    assert len(set(ids.flatten().tolist())) == 4  # every expert has tokens
    if backend == "cpu":  # csrc/moe.cpp, the experts over the threads alone, one by one in the step: the same bits
        assert torch.equal(together, alone)
        with torch.no_grad():  # and those of the grouped path in Python over the same kernels
            assert torch.equal(together, Backend.moe_experts(runner.backend, x, ids, weights, moe.experts, 0))
    torch.testing.assert_close(together, alone, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)
    torch.testing.assert_close(together, plain, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def test_moe_configs_round_trip(families):
    for variant in VARIANTS:
        cfg = load_model_config(families[variant].path)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    qwen = load_model_config(families["qwen3_moe"].path)
    assert (qwen.dense_layers, qwen.moe_intermediate_size, qwen.intermediate_size) == ([1], 64, 128)
    with pytest.raises(ConfigError, match="num_experts_per_tok 5"):
        ModelConfig.from_hf_dict({**qwen.to_hf_dict(), "num_experts_per_tok": 5})


# ---- GGUF files as llama.cpp's converter writes a mixture of experts ---------------------------------------------

_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate",
                "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_EXPERT_NAMES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def write_moe_gguf(model_dir: Path, out: Path, variant: str, qtype=None) -> Path:
    """The HF directory's model as llama.cpp's convert_hf_to_gguf.py writes it: Mixtral under `llama` with its
    expert counts (q/k rows permuted for ggml's rope), Qwen3-MoE's expert width, OLMoE's clamp; each layer's experts
    stacked into ffn_{gate,up,down}_exps [experts, rows, cols], the router as ffn_gate_inp (kept F32, as
    llama-quantize keeps it). Other 2-D and 3-D weights in `qtype` (None: F32)."""
    from gguf import quants

    from tests.model.test_families import _llama_cpp_permute

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    arch = GGUF_ARCH[variant]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = llama_like_writer(out, arch, cfg, f"tiny {variant}")
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in weights.items():
        data = tensor.numpy().astype(np.float32)
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[hf_name]] = data
            continue
        layer, rest = hf_name[len("model.layers."):].split(".", 1)
        module = rest.rsplit(".", 1)[0]
        if ".experts." in module:
            e, proj = module.split(".experts.")[1].split(".")
            experts.setdefault(f"blk.{layer}.ffn_{_EXPERT_NAMES[proj]}_exps.weight", {})[int(e)] = data
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            data = _llama_cpp_permute(data, heads if "q_proj" in module else kv_heads)
        tensors[f"blk.{layer}.{_LAYER_NAMES[module]}.weight"] = data
    tensors.update({name: np.stack([per[e] for e in sorted(per)]) for name, per in experts.items()})
    for name, data in tensors.items():
        if qtype is not None and data.ndim >= 2 and "ffn_gate_inp" not in name:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    write(w)
    return out


def test_lora_and_int4_checkpoints_are_refused_on_moe_models(families, tmp_path):
    from tokenmill.cli import build_parser
    from tokenmill.quantize import cmd_quantize

    with pytest.raises(ConfigError, match="--enable-lora does not serve mixture-of-experts"):
        LLM(str(families["olmoe"].path), dtype="float32", kv_cache_memory=KV, enable_lora=True)
    args = build_parser().parse_args(["quantize", "--model", str(families["olmoe"].path), "--out", str(tmp_path / "q")])
    with pytest.raises(ConfigError, match="is a mixture of experts: serve it with --quantization"):
        cmd_quantize(args)


def test_startup_summary_names_the_experts_format(families):
    """What `tokenmill serve` logs at start (it once looked for the first layer's down_proj, which an MoE lacks)."""
    llm = LLM(str(families["qwen3_moe"].path), dtype="bfloat16", kv_cache_memory=KV, quantization="int8")
    summary = llm.engine.core.startup_summary()
    assert "weights: int8 (bfloat16 compute)" in summary


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_planner_counts_the_engines_parameters(families, variant):
    """`tokenmill plan` reads the GGUF file's expert keys and tensors and the directory's config alike: total
    parameters as the engine holds them (its norms aside), active ones by the experts a token runs."""
    from tokenmill.planner.model_files import load_model

    family = families[variant]
    from_dir, from_gguf = load_model(str(family.path)), load_model(str(family.gguf()))
    assert (from_gguf.num_experts, from_gguf.experts_per_token, from_gguf.moe_layer_count) == (4, 2, from_dir.moe_layers
                                                                                              or 2)
    assert from_gguf.expert_intermediate_size == from_dir.expert_intermediate_size
    engine = sum(p.numel() for p in LLM(str(family.path), dtype="float32", kv_cache_memory=KV)
                 .engine.core.runner.model.parameters())
    assert from_dir.params == pytest.approx(engine, rel=1e-3) and from_gguf.params == pytest.approx(engine, rel=1e-3)
    idle = from_dir.moe_layer_count * 2 * from_dir.expert_params
    assert from_dir.params - from_dir.active_params == idle
