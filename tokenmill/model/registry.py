"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.granite_hybrid import GraniteHybridForCausalLM
from tokenmill.model.lfm2 import Lfm2ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.olmoe import OlmoeForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.qwen3 import Qwen3ForCausalLM
from tokenmill.model.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.model.smollm3 import SmolLM3ForCausalLM
from tokenmill.model_config import REGISTERED_ARCHITECTURES, ModelConfig

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}; "
                             f"supported: {', '.join(sorted(_REGISTRY))}") from None


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    """Serve checkpoints whose config.json names `architecture` with `cls`, a class built as this package's families
    are (LlamaForCausalLM's constructor, forward and `layer_caches`), its config read as a Llama's: a family kept
    outside the package, or a test's."""
    _REGISTRY[architecture] = cls
    REGISTERED_ARCHITECTURES[architecture] = lambda cfg: _weight_shapes(cls, cfg)


def _weight_shapes(cls: type[nn.Module], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a model of `cls` needs, by HF name (a fused projection's by part), from an instance
    on the meta device (no memory)."""
    with torch.device("meta"):
        model = cls(cfg)
    return {name: tuple(param.shape) if shard is None else (module.output_sizes[shard], *param.shape[1:])
            for name, (module, param, shard) in model.weight_targets().items()}
