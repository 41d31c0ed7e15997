"""An `LLM` on the plain-PyTorch reference backend (no C++ op at all) instead of the CPU kernels: what the kernels'
results are checked against on whole models."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.engine import runner as runner_module
from tokenmill.model.backends import CpuBackend, TorchBackend, select_backend


def make_llm(model: str, backend: str, monkeypatch: pytest.MonkeyPatch, **kwargs) -> LLM:
    """LLM on the CPU kernel backend ("cpu"), or on the reference ("reference": the runner's select_backend is
    told so while the engine starts)."""
    with monkeypatch.context() as m:
        if backend == "reference":
            m.setattr(runner_module, "select_backend",
                      lambda device, use_kernels=True, batch_invariant=False: select_backend(device, False,
                                                                                            batch_invariant))
        llm = LLM(str(model), **kwargs)
    want = TorchBackend if backend == "reference" else CpuBackend
    assert type(llm.engine.core.runner.backend) is want
    return llm
