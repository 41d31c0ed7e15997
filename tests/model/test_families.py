"""Qwen3, Phi-3 / Phi-4-mini and SmolLM3, each from a Hugging Face directory and from a GGUF file written as
llama.cpp's convert_hf_to_gguf.py writes it: greedy tokens equal to transformers `generate` on the same weights,
on the plain-PyTorch reference backend and on the CPU kernel backend."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.greedy import assert_matches_reference, hf_greedy
from tests.models import reference
from tests.models.gguf_writer import llama_like_writer, write
from tests.models.tiny import SMOLLM2_VOCAB, BuiltOnFirstUse, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model import cpu_kernels
from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.backends.cpu_decode import LAYER_STACK
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.layout import PPStage

KV = 64 << 20
NEW_TOKENS = 24
# Long-rope: tokenmill fixes the factor set for the context it serves (layers.rope_frequencies), transformers by each
# sequence's length: they agree on sequences that fit the original context (32) when that is the context served
# (short factors), and on prompts longer than it when more is served (long factors).
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2, 2.9, 3.5, 4.1, 5.0],
            "long_factor": [1.5, 2.5, 3.5, 5.0, 7.0, 9.0, 12.0, 16.0]}
VARIANTS = {
    # head_dim 32, not hidden / heads = 16; q/k norms per head
    "qwen3": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=False),
    # Phi-4-mini: 3/4 of each head rotates (12 of 16 dims), long-rope, fused qkv_proj and gate_up_proj
    "phi4-mini": dict(arch="phi3", num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                      partial_rotary_factor=0.75, max_position_embeddings=256, original_max_position_embeddings=32,
                      rope_scaling={**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                                    "long_factor": LONGROPE["long_factor"][:6]}),
    # Phi-3-mini-128k: whole heads rotate (the whole-layer kernels run it), long-rope
    "phi3-mini": dict(arch="phi3", num_heads=4, num_kv_heads=4, tie_word_embeddings=False,
                      max_position_embeddings=256, original_max_position_embeddings=32, rope_scaling=LONGROPE),
    # the default NoPE layout: layer 3 of 4 has no rotary (llama.cpp's fixed rule for GGUF files too)
    "smollm3": dict(arch="smollm3", num_layers=4, num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    # NoPE layers as config.json lists them (HF directory only: a GGUF file cannot say so)
    "smollm3-listed-nope": dict(arch="smollm3", num_layers=3, num_heads=4, num_kv_heads=1,
                                tie_word_embeddings=False, no_rope_layers=[0, 1, 0]),
}
PROMPT_LENGTHS = (7, 16, 23, 32, 41)
# long-rope variants: (LLM arguments, prompt lengths) for the long factors, then the short ones
LONGROPE_CASES = [({}, (33, 41, 50)), ({"max_model_len": 32}, (5, 8))]
needs_kernels = pytest.mark.skipif(cpu_kernels._extension() is None, reason="the C++ kernels are not built here")
BACKENDS = ["reference", pytest.param("cpu", marks=needs_kernels)]


class Case:
    """Prompts to serve with these LLM arguments, and transformers' greedy tokens and logits for each."""

    def __init__(self, hf, llm_kwargs: dict, lengths: tuple[int, ...]):
        g = torch.Generator().manual_seed(sum(lengths))
        self.llm_kwargs = llm_kwargs
        self.prompts = [torch.randint(3, SMOLLM2_VOCAB, (n,), generator=g).tolist() for n in lengths]
        self.reference = [hf_greedy(hf, p, NEW_TOKENS) for p in self.prompts]


class Family:
    """A tiny random model of one variant saved as an HF directory, and the cases to check it on."""

    def __init__(self, root: Path, variant: str):
        from transformers import AutoModelForCausalLM

        self.variant, self.spec = variant, VARIANTS[variant]
        self.path = make_tiny_model(root, **self.spec)
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        cases = LONGROPE_CASES if "rope_scaling" in self.spec else [({}, PROMPT_LENGTHS)]
        self.cases = [Case(hf, kwargs, lengths) for kwargs, lengths in cases]
        self._gguf: Path | None = None

    @property
    def gguf(self) -> Path:
        if self._gguf is None:
            self._gguf = write_llama_cpp_gguf(self.path, self.path.parent / f"{self.path.name}.gguf",
                                              self.spec["arch"])
        return self._gguf


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    """Each variant built on first use, once per module."""
    root = tmp_path_factory.mktemp("families")
    return BuiltOnFirstUse(lambda variant: Family(root, variant))


def make_llm(model: Path, backend: str, monkeypatch, **kwargs) -> LLM:
    """LLM in float32 on the CPU kernel backend or on the plain-PyTorch reference."""
    return reference.make_llm(str(model), backend, monkeypatch, **{"dtype": "float32", "kv_cache_memory": KV, **kwargs})


def check_greedy(model: Path, backend: str, monkeypatch, family: Family, **kwargs) -> LLM:
    """Every case of the family served from `model`: greedy tokens as transformers'. Returns the last LLM."""
    for case in family.cases:
        llm = make_llm(model, backend, monkeypatch, **case.llm_kwargs, **kwargs)
        check_case(llm, case)
    return llm


def check_case(llm: LLM, case: Case) -> None:
    """The case's prompts served by `llm`: transformers' greedy tokens, and the engine idle with nothing held after."""
    outs = llm.generate([{"prompt_token_ids": p} for p in case.prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for out, (ref, logits) in zip(outs, case.reference):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    llm.engine.core.check_idle_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_directory_greedy_matches_transformers(families, variant, backend, monkeypatch):
    family = families[variant]
    model = check_greedy(family.path, backend, monkeypatch, family).engine.core.runner.model
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                    "smollm3": "SmolLM3ForCausalLM"}[family.spec["arch"]]
    if backend == "cpu":  # the whole-layer kernel computes the plain Llama layer: only where that is the model's
        plain = variant == "phi3-mini"
        assert model.whole_layer_kernels is plain
        assert (model.backend_cache.get(LAYER_STACK) is not None) is plain


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["qwen3", "phi4-mini", "smollm3"])
def test_kernel_runner_matches_reference_runner(families, variant, dtype):
    """A fresh prefill, then a step of decodes and a later chunk (tests/model/test_backends.py two_steps), on the
    CPU kernel backend and on the reference: the variations' own paths (q/k norms through the norm kernel,
    partial rotary and NoPE layers through the reference rotary) agree in bfloat16 too."""
    from tests.model.test_backends import two_steps
    from tokenmill.engine.runner import ModelRunner

    path = families[variant].path
    cfg = load_model_config(path)
    fast, ref = (ModelRunner(cfg, load_weights(path, cfg), dtype, "cpu", num_blocks=12, block_size=4,
                             use_kernel=kernels) for kernels in (True, False))
    assert isinstance(fast.backend, CpuBackend) and type(ref.backend) is TorchBackend
    for got, want in zip(two_steps(fast), two_steps(ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:  # different matmul kernels, each rounding to bfloat16
            assert (got - want).abs().max() < 0.03 * want.abs().max()


GGUF_VARIANTS = [v for v in VARIANTS if v != "smollm3-listed-nope"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_greedy_matches_transformers(families, variant, backend, monkeypatch):
    family = families[variant]
    check_greedy(family.gguf, backend, monkeypatch, family, tokenizer=str(family.path))


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_reads_as_the_hf_directory(families, variant):
    """The same config fields and, tensor for tensor, the same weights under the same names (Phi-3's fused
    tensors as their q/k/v and gate/up parts; llama.cpp's q/k row order undone for SmolLM3)."""
    family = families[variant]
    hf_cfg, gguf_cfg = load_model_config(family.path), load_model_config(family.gguf)
    for field in ("architecture", "head_dim", "qk_norm", "rotary_dim", "nope_layers", "num_kv_heads",
                  "tie_word_embeddings", "attention_bias", "max_position_embeddings"):
        assert getattr(gguf_cfg, field) == getattr(hf_cfg, field), field
    if hf_cfg.rope_scaling is not None:
        for key in ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"):
            assert gguf_cfg.rope_scaling[key] == pytest.approx(hf_cfg.rope_scaling[key], rel=1e-6), key
    hf, gguf = load_weights(family.path, hf_cfg), load_weights(family.gguf, gguf_cfg)
    assert sorted(hf) == sorted(gguf)
    for name in hf:
        assert torch.equal(hf[name], gguf[name]), name


def test_fused_gguf_tensors_keep_their_blocks_per_part(tmp_path):
    """A Q8_0 Phi-3 file: each q/k/v and gate/up part read as raw blocks (what the gguf weight format keeps) is the
    matching rows of the fused tensor, and decodes to what the dense read gives."""
    from gguf import GGMLQuantizationType as T

    path = make_tiny_model(tmp_path, arch="phi3", num_heads=4, num_kv_heads=2, num_layers=1, vocab_size=256)
    gguf = write_llama_cpp_gguf(path, tmp_path / "phi3-q8.gguf", "phi3", qtype=T.Q8_0)
    cfg = load_model_config(gguf)
    ckpt = load_weights(gguf, cfg)
    p = "model.layers.0."
    shapes = {"self_attn.q_proj": 64, "self_attn.k_proj": 32, "self_attn.v_proj": 32, "mlp.gate_proj": 128,
              "mlp.up_proj": 128}
    for part, rows in shapes.items():
        blocks = ckpt.blocks(f"{p}{part}.weight")
        assert blocks.shape == (rows, 64) and blocks.ggml_type == T.Q8_0
        assert torch.equal(blocks.dequantize(torch.float32), ckpt[f"{p}{part}.weight"])


# ---- configs ------------------------------------------------------------------------------------------------

PHI4_MINI = {  # config.json of microsoft/Phi-4-mini-instruct, its shape fields (factors shortened)
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
}


def test_phi4_mini_config():
    cfg = ModelConfig.from_hf_dict(PHI4_MINI)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.max_position_embeddings) == (128, 96, 131072)
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # Phi-3-mini-4k's 2047-token window: served only as far as the window never cuts
    mini = ModelConfig.from_hf_dict({**PHI4_MINI, "max_position_embeddings": 4096, "sliding_window": 2047,
                                     "partial_rotary_factor": 1.0, "rope_scaling": None})
    assert (mini.max_position_embeddings, mini.rotary_dim, mini.rope_scaling) == (2047, 128, None)
    with pytest.raises(ConfigError, match="longrope scaling needs"):
        ModelConfig.from_hf_dict({**PHI4_MINI, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}})


@pytest.mark.parametrize("variant", ["qwen3", "smollm3", "smollm3-listed-nope"])
def test_family_configs_round_trip(families, variant):
    cfg = load_model_config(families[variant].path)
    assert cfg.qk_norm == (variant == "qwen3")
    assert cfg.nope_layers == {"qwen3": [], "smollm3": [3], "smollm3-listed-nope": [0, 2]}[variant]
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_pipeline_stage_numbers_nope_layers_from_its_first_layer():
    cfg = ModelConfig("SmolLM3ForCausalLM", 256, 64, 128, 8, 4, 2, 16, nope_layers=[3, 7])
    assert PPStage.of(cfg, 2, 0).shard_config(cfg).nope_layers == [3]
    assert PPStage.of(cfg, 2, 1).shard_config(cfg).nope_layers == [3]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen3", num_layers=1, vocab_size=256)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'GemmaForCausalLM'; supported: .*Qwen3"):
        load_model_config(path)
    from gguf import GGUFWriter

    gguf = tmp_path / "gemma.gguf"
    w = GGUFWriter(str(gguf), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    write(w)
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gemma'; supported: .*phi3.*smollm3"):
        load_model_config(gguf)


# ---- GGUF files as llama.cpp writes them ------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute in convert_hf_to_gguf.py: each head's q/k rows interleaved for ggml's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_cpp_gguf(model_dir: Path, out: Path, arch: str, qtype=None) -> Path:
    """A GGUF file holding the HF directory's model as llama.cpp's convert_hf_to_gguf.py lays it out: the arch's
    metadata keys, tensor names from gguf-py's own name map, q/k rows permuted where the converter permutes them
    (SmolLM3, a LlamaModel; not Qwen3 or Phi-3), Phi-3's fused tensors kept fused (`attn_qkv`, and `ffn_up`
    holding gate and up) and its long-rope factors as two tensors. 2-D weights in `qtype` (None: F32)."""
    from gguf import MODEL_ARCH, get_tensor_name_map, quants

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    w = llama_like_writer(out, arch, cfg, f"tiny {arch}")
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if arch == "qwen3":  # TextModel: head_dim given explicitly
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "smollm3":  # LlamaModel: the rotary dims, head_dim
        w.add_rope_dimension_count(head_dim)
    extra = {}
    if arch == "phi3":  # Phi3MiniModel
        original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        w.add_rope_scaling_orig_ctx_len(original or cfg["max_position_embeddings"])
        if rope.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra = {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                     "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    names = get_tensor_name_map(getattr(MODEL_ARCH, arch.upper()), layers)
    for hf_name, tensor in weights.items():
        data = tensor.numpy().astype(np.float32)
        if arch == "smollm3" and ".q_proj." in hf_name:
            data = _llama_cpp_permute(data, heads)
        elif arch == "smollm3" and ".k_proj." in hf_name:
            data = _llama_cpp_permute(data, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if qtype is not None and data.ndim == 2:
            w.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    for name, data in extra.items():
        w.add_tensor(name, data)
    write(w)
    return out


@pytest.mark.parametrize("variant", ["qwen3", "phi4-mini", "smollm3"])
def test_chunked_prefill_prefix_hits_and_speculation_keep_the_greedy_output(families, variant, monkeypatch):
    """Prompts cut into 16-token chunks, drafts (the model drafting for itself) verified every step, and a second
    pass over the same prompts that finds their blocks cached: still transformers' tokens."""
    family = families[variant]
    case = family.cases[0]  # prompts of 16+ tokens: full blocks to cache
    spec = {"model": str(family.path), "num_speculative_tokens": 3}
    llm = make_llm(family.path, "cpu" if cpu_kernels._extension() is not None else "reference", monkeypatch,
                   max_num_batched_tokens=16, speculative_config=spec, **case.llm_kwargs)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in case.prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        for out, (ref, logits) in zip(outs, case.reference):
            assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    stats = llm.engine.core.scheduler.stats()
    assert stats.prefix_cache.hits > 0 and stats.spec_decode.num_draft_tokens > 0
    llm.engine.core.check_idle_invariants()
