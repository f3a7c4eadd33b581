"""Load a command-line tool of ``tools/`` as a module, so tests call its ``main`` in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
"""tools/ of the checkout this package is installed from (editable install)."""


def load_tool(name: str) -> ModuleType:
    """The module of ``tools/<name>.py`` (loaded once, cached under ``tools.<name>``)."""
    key = f"tools.{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = TOOLS_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no tool {path}; tools/ holds {sorted(p.stem for p in TOOLS_DIR.glob('*.py'))}")
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
