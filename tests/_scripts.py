"""Shared by the tests of scripts/ and the benchmark (test_bench_report.py, test_bench_backward.py):
the repository root and loading a script of scripts/ as a module (scripts/ is not a package)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/<name>.py imported as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
