"""Tiny random-weight Llama-family models saved as Hugging Face directories, for fast exact tests.

Each directory holds config.json, model.safetensors, generation_config.json and SmolLM2's tokenizer
(with its chat template), so `LLM(model=dir)`, `load_weights(dir)` and `Tokenizer.load(dir)` all work,
and transformers can run the same model as a reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

SMOLLM2_VOCAB = 49152
BOS_ID, EOS_ID = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (a transformers fast tokenizer), built once from the bundled GGUF."""
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path()).hf_tokenizer


class BuiltOnFirstUse(dict):
    """key -> factory(key), built the first time a test asks for it and kept (a module fixture's models)."""

    def __init__(self, factory: Callable[[str], Any]):
        super().__init__()
        self.factory = factory

    def __missing__(self, key: str) -> Any:
        self[key] = value = self.factory(key)
        return value


def _hf_config(arch: str, **kw: Any) -> Any:
    from transformers import (Gemma3TextConfig, Lfm2Config, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    if arch == "qwen3":
        return Qwen3Config(use_sliding_window=False, **kw)  # per-head q/k RMSNorm, head_dim as given
    if arch == "phi3":
        return Phi3Config(sliding_window=None, **kw)  # fused qkv_proj / gate_up_proj in the checkpoint
    if arch == "smollm3":
        return SmolLM3Config(use_sliding_window=False, **kw)  # every 4th layer NoPE unless no_rope_layers says
    if arch == "gemma3":  # rotary per layer type: the global layers' (scaling included), the local ones' own base
        local = {"rope_type": "default", "rope_theta": kw.pop("rope_local_base_freq", 10000.0)}
        return Gemma3TextConfig(rope_parameters={"full_attention": kw.pop("rope_parameters"),
                                                 "sliding_attention": local}, **kw)
    if arch == "mixtral":  # experts as wide as intermediate_size
        return MixtralConfig(sliding_window=None, **kw)
    if arch == "qwen3_moe":  # experts moe_intermediate_size wide; mlp_only_layers dense
        return Qwen3MoeConfig(use_sliding_window=False, **kw)
    if arch == "olmoe":  # q/k norms over the whole projection; clip_qkv
        return OlmoeConfig(**kw)
    if arch == "lfm2":  # short-convolution layers but for those layer_types names full_attention; norm_eps
        kw["norm_eps"] = kw.pop("rms_norm_eps")
        return Lfm2Config(**kw)
    if arch == "qwen3_5":  # Gated DeltaNet layers but where layer_types says full_attention; rotary on a quarter
        from transformers import Qwen3_5TextConfig

        kw["rope_parameters"] = {"partial_rotary_factor": 0.25, **kw["rope_parameters"]}
        return Qwen3_5TextConfig(**kw)
    if arch == "qwen3_5_moe":  # qwen3_5's layers with experts and a shared expert in every one
        from transformers import Qwen3_5MoeTextConfig

        kw["rope_parameters"] = {"partial_rotary_factor": 0.25, **kw["rope_parameters"]}
        kw.pop("intermediate_size")
        return Qwen3_5MoeTextConfig(**kw)
    if arch == "granite_hybrid":  # Mamba2 layers but where layer_types says attention; no experts, no rotary
        from transformers import GraniteMoeHybridConfig

        kw.pop("rope_parameters")
        return GraniteMoeHybridConfig(num_local_experts=0, shared_intermediate_size=kw["intermediate_size"], **kw)
    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **kw)  # plain causal attention, like the engine
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **kw)  # q/k/v always carry a bias
    raise ValueError(f"unknown tiny arch {arch!r}; use llama, qwen2, mistral, qwen3, phi3, smollm3, gemma3, mixtral, "
                     "qwen3_moe, olmoe, lfm2, qwen3_5, qwen3_5_moe or granite_hybrid")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with spread, so tests can tell right from wrong.

    Logits get a std of ~3 (the 0.02 default init gives near-uniform ones); input projections are
    unit-gain; the residual-writing o_proj/down_proj are 4x louder, so layers outweigh the tied input
    embedding and greedy decoding does not just repeat the last token; norms and biases sit away from
    1 and 0, so a mis-mapped norm or bias changes the output.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            p.copy_(0.4 * noise)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # MoE: stacked experts
            p.copy_(4.0 * noise / math.sqrt(p.shape[-1]))
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))


def _next_free_dir(root: Path, arch: str) -> Path:
    n = 0
    while (root / f"tiny-{arch}-{n}").exists():
        n += 1
    return root / f"tiny-{arch}-{n}"


def make_tiny_model(
    tmp_path: Path,
    *,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 4,
    tie_word_embeddings: bool = True,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    head_dim: int | None = None,
    **family: Any,
) -> Path:
    """Build, save and return a new directory `tmp_path/tiny-{arch}-{n}` holding a random model.

    GQA when num_kv_heads < num_heads. vocab_size None uses SmolLM2's 49152 so text prompts work; a
    smaller vocab_size keeps the same tokenizer, so feed such a model token ids below vocab_size.
    rope_scaling is a HF dict such as {"rope_type": "llama3", "factor": 8.0, ...}. head_dim None is
    hidden_size // num_heads. `family` goes to the config class as it is (e.g. Phi-3's partial_rotary_factor and
    original_max_position_embeddings, SmolLM3's no_rope_layers, Gemma 3's sliding_window and layer_types;
    its rope_local_base_freq becomes the local layers' rotary).
    """
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    config = _hf_config(
        arch,
        vocab_size=vocab_size or SMOLLM2_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        **family,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if arch in ("gemma3", "qwen3_5", "qwen3_5_moe"):  # norms scaling by 1 + w: the others' spread around 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):  # that one: w
                    p.sub_(1.0)
    out = _next_free_dir(Path(tmp_path), arch)
    model.save_pretrained(out, safe_serialization=True)
    smollm2_tokenizer().save_pretrained(out)
    return out


def make_tiny_adapter(model_dir: Path, out: Path, *, r: int = 4, alpha: float = 8.0,
                      targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 1, use_rslora: bool = False,
                      **lora: Any) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir`, saved to `out` as PEFT saves one (adapter_config.json and
    adapter_model.safetensors), with random A and B loud enough to change greedy output. `lora` goes to
    LoraConfig as it is (rank_pattern, use_dora, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora, **lora)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 2 / math.sqrt(p.shape[-1]))
    model.save_pretrained(out, safe_serialization=True)
    return out
