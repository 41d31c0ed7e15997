"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.olmoe import OlmoeForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.qwen3 import Qwen3ForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.model.smollm3 import SmolLM3ForCausalLM

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
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}; "
                             f"supported: {', '.join(sorted(_REGISTRY))}") from None
