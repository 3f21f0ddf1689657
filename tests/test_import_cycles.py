"""scripts/import_cycles.py: the repository has no import circle (Rust modules at two levels,
Python modules), tuning imports nothing from ops, the profiler nothing from the benchmarks; and
the check finds each of those in a small synthetic tree."""
from __future__ import annotations

import textwrap

import pytest

from _scripts import ROOT, load_script

cycles = load_script("import_cycles")


@pytest.mark.parametrize("with_tests", [False, True])
def test_the_repository_has_no_import_circle(capsys, with_tests):
    problems = cycles.check(ROOT, with_tests=with_tests)
    assert problems == 0, capsys.readouterr().out


def _tree(tmp_path, files: dict):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    (tmp_path / "python" / "ferroattn").mkdir(parents=True, exist_ok=True)
    (tmp_path / "src").mkdir(exist_ok=True)
    return tmp_path


def test_use_trees_expand_to_their_leaves():
    leaves = cycles._expand_use("crate::ops::{attention::{self, Problem as P}, gemm::*}")
    assert leaves == [(("crate", "ops", "attention"), "attention"),
                      (("crate", "ops", "attention", "Problem"), "P"),
                      (("crate", "ops", "gemm"), None)]


def test_a_rust_circle_through_a_re_export_and_the_layer_rule(tmp_path, capsys):
    root = _tree(tmp_path, {
        "src/lib.rs": "pub mod ops;\npub mod tuning;\n",
        "src/ops/mod.rs": "pub mod attention;\n",
        "src/ops/attention.rs": """\
            mod variant;
            pub use variant::Kind;
            use crate::tuning::attention::pick; // a comment naming crate::nothing
            pub fn run() { let _ = pick(); }
            """,
        "src/ops/attention/variant.rs": "pub struct Kind;\n",
        "src/tuning/mod.rs": "pub mod attention;\n",
        "src/tuning/attention.rs": """\
            use crate::ops::attention::Kind;
            pub fn pick() -> Option<Kind> { let _s = "crate::ops::gemm"; None }
            #[cfg(test)]
            mod tests { use crate::ops::attention::run; }
            """,
    })
    assert cycles.check(root) == 3   # ops <-> tuning, ops::attention <-> tuning::attention, the rule
    out = capsys.readouterr().out
    assert "rust (top level): circle ops <-> tuning" in out
    assert "ops::attention <-> tuning::attention" in out
    assert "src/tuning/attention.rs:1" in out
    assert "ops::gemm" not in out and "nothing" not in out   # strings and comments are not paths
    edges = cycles.rust_graph(root / "src", with_tests=False)
    assert set(edges["tuning::attention"]["ops::attention"]) == {"src/tuning/attention.rs:1"}
    with_tests = cycles.rust_graph(root / "src", with_tests=True)
    assert "src/tuning/attention.rs:4" in with_tests["tuning::attention"]["ops::attention"]


def test_python_circles_lazy_imports_and_the_profiler_rule(tmp_path, capsys):
    root = _tree(tmp_path, {
        "python/ferroattn/__init__.py": "from . import a\n",
        "python/ferroattn/a.py": "from .b import _helper\n",
        "python/ferroattn/b.py": "def _helper():\n    from .a import thing\n",
        "python/ferroattn/_native.pyi": "def f() -> None: ...\n",
        "python/ferroattn/c.py": "def g():\n    from . import _native\n",
        "python/ferroattn/profiler/__init__.py": "from ..bench import timing\n",
        "python/ferroattn/bench/__init__.py": "",
        "python/ferroattn/bench/timing.py": "",
    })
    assert cycles.check(root) == 2   # a <-> b (closed inside a function), profiler -> bench
    out = capsys.readouterr().out
    assert "ferroattn.a <-> ferroattn.b" in out
    assert "python/ferroattn/b.py:2" in out
    assert "ferroattn.profiler imports ferroattn.bench" in out
    assert "ferroattn.c" not in out   # the extension module (a stub) is a module of its own
