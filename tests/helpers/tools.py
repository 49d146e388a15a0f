"""The scripts of tools/ as modules, for the tests that call them in process.

- ``load_tool(monkeypatch, name)``: tools/<name>.py imported as the module `name`, in sys.modules
  for this test only (a dataclass of the script looks its module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(monkeypatch, name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
