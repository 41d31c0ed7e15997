"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}; "
                             f"supported: {', '.join(sorted(_REGISTRY))}") from None
