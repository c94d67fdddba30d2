"""The docs' examples (docs/examples/NAME), imported from their files as ``PYTHONPATH`` makes dtrain import them."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def import_example(name: str, module: str) -> ModuleType:
    """``docs/examples/<name>/<module>.py`` as a module named ``module``."""
    spec = importlib.util.spec_from_file_location(module, EXAMPLES / name / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded
