"""Find a model, read its shape (ModelConfig) and its weights under Hugging Face parameter names.

Two on-disk forms are supported: a Hugging Face directory (config.json + *.safetensors; an AWQ checkpoint is one
too, its matmul weights stored in AutoAWQ's layout) and a llama.cpp GGUF file. Everything downstream sees one
state-dict layout, whichever form the model came in, as a Checkpoint: checked when opened, read one tensor at a
time as the model loads it.
"""

from __future__ import annotations

import json
import logging
import re
from abc import abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.model.paths import SUPPORTED_FORMS, default_model_path, is_gguf, resolve_model_path  # noqa: F401
from tokenmill.quant.awq_format import BLOCK, Int4Groups, awq_config
from tokenmill.quant.gguf import GGMLBlocks, GGUFFile, kept_gguf_type

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def load_model_config(path: Path) -> ModelConfig:
    """The model's shape, from config.json (HF directory) or from the GGUF metadata."""
    path = Path(path)
    if is_gguf(path):
        return gguf_model_config(GGUFFile.open(path))
    cfg = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {e.args[0]!r}") from None
    gen = path / "generation_config.json"  # instruct models often list extra stop ids only here
    if gen.is_file():
        config.eos_token_ids = _merge_ids(config.eos_token_ids, _read_json(gen).get("eos_token_id"))
    return config


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _merge_ids(ids: list[int], extra: int | list[int] | None) -> list[int]:
    extra_list = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([*ids, *extra_list]))


def gguf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    """(GGUF metadata prefix, HF architecture). llama.cpp files Mistral under `llama`; its name tells."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file {gguf.path} has unsupported architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs are filed as llama)")
    hf_arch = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(gguf.get("general.name", "")).lower():
        hf_arch = "MistralForCausalLM"
    return arch, hf_arch


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    """Map llama.cpp's `{arch}.*` metadata keys onto ModelConfig."""
    arch, hf_arch = gguf_architecture(gguf)

    def need(key: str) -> Any:
        value = gguf.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {gguf.path} lacks the metadata key {arch}.{key}")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    num_kv = gguf.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv, list):
        raise ModelLoadError(f"GGUF file {gguf.path} has per-layer KV head counts, which are not supported")
    head_dim = gguf.get(f"{arch}.attention.key_length") or gguf.get(f"{arch}.rope.dimension_count")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        embd = gguf.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd else need("vocab_size")
    eos = [gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=int(head_dim or hidden // num_heads),
        rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(gguf, arch),
        max_position_embeddings=int(gguf.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias=hf_arch == "Qwen2ForCausalLM" or "blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _gguf_rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    """No mapped scaling exists yet: refuse any, rather than run the model with the wrong positions."""
    kind = gguf.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ConfigError(f"GGUF file {gguf.path} uses rope scaling {kind!r}, which tokenmill does not "
                          "support for GGUF models (supported: none; llama3 scaling via a HF directory)")
    if "rope_freqs.weight" in gguf.tensors:
        raise ConfigError(f"GGUF file {gguf.path} carries rope_freqs (llama3-style rope scaling baked into "
                          "a tensor), which tokenmill does not support; use the model's HF directory")
    return None


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by HF name, with its [out_features, in_features] shape."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def allocate_parameters(model: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device real, uninitialised parameters on `device`, in their dtype, for
    load_hf_weights to fill in place. Module.to_empty would do, but its torch.empty_like of a meta tensor imports
    sympy (0.4 s and 30 MB the engine otherwise never needs). Parameters only: the models have no buffers yet.
    A parameter shared by two modules stays shared."""
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
            setattr(module, name, fresh[id(p)])


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The model's parameters under HF names, in `dtype`: names and shapes are checked against the config now,
    from the file headers; each tensor is read when it is asked for (see Checkpoint)."""
    path = Path(path)
    if is_gguf(path):
        return GGUFCheckpoint(path, config, dtype)
    awq = awq_config(path)
    if awq is not None:
        return AWQCheckpoint(path, config, dtype, awq["group_size"])
    return SafetensorsCheckpoint(path, config, dtype)


class Checkpoint(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by HF name, read from disk on each access and never kept.

    Why lazy: the model loads one tensor at a time straight into its parameter (LlamaForCausalLM.load_hf_weights),
    so at no point does a second copy of the whole model exist. Opening checks every name and shape, so a
    checkpoint that does not fit the config fails before any tensor is read."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]):
        self.path, self.dtype, self._shapes = path, dtype, shapes
        expected = expected_shapes(config)
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ModelLoadError(f"{path} lacks {len(missing)} weights the config needs, e.g. {missing[:4]}")
        wrong = [f"{n}: {s} != {expected[n]}" for n, s in shapes.items() if s != expected[n]]
        if wrong:
            raise ModelLoadError(f"{path} has weights whose shape disagrees with its config: {wrong[:4]}")

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor `name` (a known one), in self.dtype."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def _ignorable_hf_name(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory. Each read opens its shard afresh: safetensors maps the file and hands out a tensor
    over the mapping, so the pages a tensor touched leave memory with it, not when the whole shard is done."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype):
        expected = expected_shapes(config)
        self._files: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in _safetensors_files(path):
            with _reading(file) as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    shape = tuple(f.get_slice(name).get_shape())
                    if self._claim(name, file, shape, expected):
                        continue
                    if name in expected:
                        self._files[name] = file
                        shapes[name] = shape
                    elif not _ignorable_hf_name(name, config):
                        raise ModelLoadError(f"{file} holds tensor {name!r}, which a {config.architecture} "
                                             "model does not have")
        claimed = self._claimed_shapes(path)
        both = sorted(set(claimed) & set(shapes))
        if both:
            raise ModelLoadError(f"{path} holds {both[0]} both as it is and in another form")
        super().__init__(path, config, dtype, {**shapes, **claimed})

    def _claim(self, name: str, file: Path, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> bool:
        """Whether a subclass takes tensor `name` as part of its own form (e.g. AWQ's qweight); by default none."""
        return False

    def _claimed_shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        """The model weights the claimed tensors make, by HF name and shape."""
        return {}

    def _read(self, name: str) -> torch.Tensor:
        with _reading(self._files[name]) as f:
            return f.get_tensor(name).to(self.dtype)


@contextmanager
def _reading(file: Path) -> Iterator[Any]:
    """safe_open, with unreadable files reported as ModelLoadError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e


def _safetensors_files(path: Path) -> list[Path]:
    """The shards the index names, else every *.safetensors (some repos also ship e.g. a consolidated
    original-format file next to the HF shards; the index tells which set is the HF one)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no weight_map")
    files = [path / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names shards that are missing from {path}: {missing[:4]}")
    return files


AWQ_PARTS = ("qweight", "qzeros", "scales")


class AWQCheckpoint(SafetensorsCheckpoint):
    """The checkpoint's tensors by HF name; a quantized weight reads as its dequantized values (`self[name]`) or
    as Q4_Z blocks (`blocks(name)`, what the awq method keeps)."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype, group_size: int):
        self.group_size = group_size
        self._parts: dict[str, dict[str, tuple[Path, tuple[int, ...]]]] = {}
        self._quantized: dict[str, dict[str, Path]] = {}
        super().__init__(path, config, dtype)

    def _claim(self, name: str, file: Path, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> bool:
        base, _, suffix = name.rpartition(".")
        if suffix not in AWQ_PARTS or f"{base}.weight" not in expected:
            return False
        self._parts.setdefault(base, {})[suffix] = (file, shape)
        return True

    def _claimed_shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for base, found in self._parts.items():
            missing = [p for p in AWQ_PARTS if p not in found]
            if missing:
                raise ModelLoadError(f"{path} is an AWQ checkpoint, but {base} lacks {', '.join(missing)} "
                                     f"(it has {', '.join(sorted(found))}); quantize the model again")
            if len(found["qweight"][1]) != 2:
                raise ModelLoadError(f"{path}: {base}.qweight has shape {found['qweight'][1]}, not [in, out / 8]")
            k, n8 = found["qweight"][1]
            shapes[f"{base}.weight"] = (n8 * 8, k)
            self._quantized[f"{base}.weight"] = {p: found[p][0] for p in AWQ_PARTS}
        return shapes

    def groups(self, name: str) -> Int4Groups:
        base = name.removesuffix(".weight")
        tensors = {}
        for part, file in self._quantized[name].items():
            with _reading(file) as f:
                tensors[part] = f.get_tensor(f"{base}.{part}")
        return Int4Groups.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], self.group_size, base)

    def _read(self, name: str) -> torch.Tensor:
        return self.groups(name).dequantize(self.dtype) if name in self._quantized else super()._read(name)

    def blocks(self, name: str) -> torch.Tensor | GGMLBlocks:
        """A quantized weight as Q4_Z blocks (quant/gguf_linear.py keeps them); any other tensor, and groups the
        blocks cannot hold (under 32 inputs), as `self[name]`: dense, dequantized."""
        if name not in self._quantized:
            return self[name]
        if self.group_size % BLOCK:
            log.warning("AWQ groups of %d inputs are served dequantized (the kernel takes multiples of %d): %s",
                        self.group_size, BLOCK, name)
            return self[name]
        return self.groups(name).to_blocks()


# GGUF leaf name -> HF leaf name, within `blk.N.` / `model.layers.N.`
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name_for_gguf(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown names."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        leaf = _GGUF_LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{leaf}.{suffix}" if leaf else None
    leaf = _GGUF_GLOBAL_NAMES.get(base)
    return f"{leaf}.{suffix}" if leaf else None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order for llama models.

    convert_hf_to_gguf reorders each head's rows from HF's half-split rotary layout ([x0..x_{d/2}),
    [x_{d/2}..x_d)) into interleaved pairs (x0, x_{d/2}, x1, ...) for ggml's rope. Viewing each head as
    [d/2, 2] rows and swapping those two axes restores HF order (K uses the KV head count). Biases are
    permuted the same way, so this works on 1-D tensors too.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file: each read dequantizes one tensor (a chunk of rows at a time when `dtype` is not
    float32, quant/gguf.py) and undoes llama.cpp's rotary row order for llama q/k."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype):
        self._gguf = gguf = GGUFFile.open(path)
        arch, _ = gguf_architecture(gguf)
        self._names: dict[str, str] = {}  # HF name -> GGUF name
        self._rope_heads: dict[str, int] = {}  # HF name -> heads, for the rows llama.cpp permuted
        for name in gguf.tensors:
            hf_name = hf_name_for_gguf(name)
            if hf_name is None:
                raise ModelLoadError(f"GGUF file {path} holds tensor {name!r}, which tokenmill cannot map to a "
                                     f"{config.architecture} parameter")
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            self._names[hf_name] = name
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                self._rope_heads[hf_name] = config.num_heads if ".attn_q." in name else config.num_kv_heads
        super().__init__(path, config, dtype, {n: gguf.tensors[g].shape for n, g in self._names.items()})

    def _read(self, name: str) -> torch.Tensor:
        w = self._gguf.read_tensor(self._names[name], self.dtype)
        heads = self._rope_heads.get(name)
        return w if heads is None else unpermute_rope_rows(w, heads)

    def blocks(self, name: str) -> torch.Tensor | GGMLBlocks:
        """A 2-D tensor of a type kept at run time (quant/gguf_linear.py) as its raw blocks, rows in HF order;
        any other tensor dequantized, as `self[name]`."""
        info = self._gguf.tensors[self._names[name]]
        if len(info.shape) != 2 or not kept_gguf_type(info.ggml_type):
            return self[name]
        rows = self._gguf.read_raw(info.name).view(info.shape[0], -1)
        heads = self._rope_heads.get(name)
        return GGMLBlocks(info.ggml_type, rows if heads is None else unpermute_rope_rows(rows, heads), info.shape)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """For loading weights. Dequantizing and copying tensors into place are memory-bound elementwise ops, which
    gain little from intra-op threads, while every parallel region waits for its slowest thread: on a busy 2-core
    machine SmolLM2 took 25 s to dequantize with 2 threads and 1.7 s with 1, and 2.6-3.2 s to load into the model
    with 2 threads and 0.4-0.8 s with 1. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
