"""The scripts under benchmarks/ are not a package: a test loads one by its file."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as module ``NAME``, registered in ``sys.modules`` (a script's dataclasses look their
    module up there), with ``benchmarks/`` on the path as it is for a script run from there (scripts import their
    neighbours)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
