"""Load a script from benchmarks/ as a module, for the tests of its logic beside it (they run no server or engine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository


def load_benchmark_script(filename: str) -> ModuleType:
    name = "bench_" + filename.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
