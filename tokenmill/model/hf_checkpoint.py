"""A Hugging Face directory's files: its JSON files, and its safetensors shards as a Checkpoint, plain or AWQ
(matmul weights stored in AutoAWQ's layout)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.family_config import QWEN3_5, QWEN3_5_MOE
from tokenmill.formats.awq_format import BLOCK, Int4Groups
from tokenmill.formats.gguf_blocks import GGMLBlocks
from tokenmill.model.checkpoint import Checkpoint, expected_shapes, fused_parts
from tokenmill.model_config import ModelConfig

log = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any]:
    """A file holding one JSON object; an unreadable or malformed one raises ModelLoadError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _ignorable_hf_name(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares, or that belong to parts of a multimodal
    checkpoint its text model does not run (Qwen3.5's vision tower and multi-token-prediction head)."""
    return (name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)
            or (config.architecture in (QWEN3_5, QWEN3_5_MOE) and name.startswith(TEXT_ONLY_SKIPPED)))


# a multimodal checkpoint's text model's tensors are its language model's: "model.language_model.layers.0...."
TEXT_MODEL_PREFIX = "model.language_model."
TEXT_ONLY_SKIPPED = ("model.visual.", "mtp.")


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory. Each read opens its shard afresh: safetensors maps the file and hands out a tensor
    over the mapping, so the pages a tensor touched leave memory with it, not when the whole shard is done."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype):
        expected = expected_shapes(config)
        self._files: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # ours -> the file's, where they differ (a base model, a multimodal one)
        shapes: dict[str, tuple[int, ...]] = {}
        for file in _safetensors_files(path):
            with _reading(file) as f:
                for stored in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    shape = tuple(f.get_slice(stored).get_shape())
                    name = stored
                    if config.headless and not stored.startswith("model."):  # a base model: "layers.0...."
                        name = "model." + stored
                    elif stored.startswith(TEXT_MODEL_PREFIX):
                        name = "model." + stored[len(TEXT_MODEL_PREFIX):]
                    if name != stored:
                        self._stored[name] = stored
                    if self._claim(name, file, shape, expected):
                        continue
                    if name in expected or fused_parts(name, expected) is not None:  # Phi-3's fused q/k/v, gate/up
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
            return f.get_tensor(self._stored.get(name, name)).to(self.dtype)


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
    weight_map = read_json(index).get("weight_map")
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
