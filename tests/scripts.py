"""Load a script of ``lab/scripts/`` as a module, to call it in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """``lab/scripts/<name>.py`` imported as the module ``name``."""
    path = REPO / "lab" / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses of a script look their module up
    spec.loader.exec_module(module)
    return module
