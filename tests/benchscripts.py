"""The scripts under bench/, loaded as modules for the tests that run a short version of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(name: str) -> ModuleType:
    """bench/`name`.py. bench/ holds scripts, not a package: the file itself is loaded,
    registered before it runs so that its dataclasses can resolve their own module."""
    spec = importlib.util.spec_from_file_location(f"gpuwatch_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
