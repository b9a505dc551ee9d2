"""Loading a script of the repository (experiments/*/collect.py, run.py) as a module, for the tests that call its
functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str):
    """The module of ROOT/`rel` (a path such as "experiments/gate/collect.py"), executed afresh."""
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_").removesuffix(".py"), ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
