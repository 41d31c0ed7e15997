"""Find a model, read its shape (ModelConfig) and its weights under Hugging Face parameter names.

Two on-disk forms are supported: a Hugging Face directory (config.json + *.safetensors; an AWQ checkpoint is one
too, its matmul weights stored in AutoAWQ's layout) and a llama.cpp GGUF file. Everything downstream sees one
state-dict layout, whichever form the model came in, as a Checkpoint: checked when opened, read one tensor at a
time as the model loads it. Each form is read in its own module (model/hf_checkpoint.py, model/gguf_checkpoint.py);
this one tells which form a path holds and hands it to that module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.formats.awq_format import awq_config
from tokenmill.formats.gguf import GGUFFile
from tokenmill.model.checkpoint import Checkpoint
from tokenmill.model.gguf_checkpoint import GGUFCheckpoint
from tokenmill.model.gguf_config import gguf_model_config
from tokenmill.model.hf_checkpoint import AWQCheckpoint, SafetensorsCheckpoint, read_json
from tokenmill.model.paths import SUPPORTED_FORMS, default_model_path, is_gguf, resolve_model_path  # noqa: F401
from tokenmill.model_config import ModelConfig


def load_model_config(path: Path) -> ModelConfig:
    """The model's shape, from config.json (HF directory) or from the GGUF metadata."""
    path = Path(path)
    if is_gguf(path):
        return gguf_model_config(GGUFFile.open(path))
    cfg = read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {e.args[0]!r}") from None
    gen = path / "generation_config.json"  # instruct models often list extra stop ids only here
    if gen.is_file():
        config.eos_token_ids = _merge_ids(config.eos_token_ids, read_json(gen).get("eos_token_id"))
    return config


def _merge_ids(ids: list[int], extra: int | list[int] | None) -> list[int]:
    extra_list = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([*ids, *extra_list]))


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
