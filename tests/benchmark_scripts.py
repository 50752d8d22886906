"""Load a script of ``benchmarks/`` as a module, so that tests can call its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported as the module ``benchmark_<name>``."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
