"""tokenmill: an LLM serving engine. Offline use: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams

_LAZY = {"LLM": "tokenmill.llm", "SamplingParams": "tokenmill.sampling_params",
         "RequestOutput": "tokenmill.outputs", "CompletionOutput": "tokenmill.outputs"}


def __getattr__(name: str):
    # Lazy, so `tokenmill plan --help` does not pay for importing torch and transformers.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
