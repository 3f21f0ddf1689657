#!/usr/bin/env python3
"""Import circles in the crate (src/**.rs) and the Python package (python/ferroattn).

Rust: every `crate::`, `super::` and `self::` path in code (use trees and inline paths; comments
and strings skipped) is resolved to the module it names, through `pub use` re-exports, and
becomes an edge between modules cut to two levels (`ops::attention`, `tuning::knobs`,
`profiler`). Test code (`#[cfg(test)]` items, `mod tests`, `tests.rs`) is left out unless
--with-tests. Reported: circles between top-level modules and between two-level modules, and
the layer rules: `tuning` imports nothing from `ops`, nothing outside `src/python` imports it.

Python: imports between ferroattn modules (`ast`; `if TYPE_CHECKING:` blocks skipped).
Reported: circles between modules and between two-level packages (`ferroattn.profiler`,
`ferroattn.bench`) through module-level imports, circles that an import inside a function
closes, and `ferroattn.profiler` importing `ferroattn.bench`.

`python scripts/import_cycles.py [--with-tests] [-v] [--root DIR]`; exit status 1 when
anything is reported. tests/test_import_cycles.py runs it on this repository.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ---- Rust ---------------------------------------------------------------------------------


def _strip_rust(text: str) -> str:
    """The text with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = re.match(r'r(#*)"', text[i:i + 10]) if c == "r" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) else None
        if m:
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if m:
                out.append("' '")
                i += len(m.group(0))
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _file_module(path: Path, src: Path) -> tuple[str, ...]:
    rel = path.relative_to(src).with_suffix("")
    parts = rel.parts
    if parts[-1] in ("lib", "mod"):
        parts = parts[:-1]
    return tuple(parts)


def _split_top(s: str) -> list[str]:
    """`a, b::{c, d}, e` split at the top-level commas."""
    items, depth, cur = [], 0, []
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _expand_use(tree: str, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str | None]]:
    """A use tree as (path, alias) leaves; alias None for a glob, the bound name otherwise."""
    tree = re.sub(r"\s+as\s+", " as ", tree.strip())
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree)
    if "{" in tree:
        head, _, rest = tree.partition("{")
        base = prefix + tuple(p for p in head.split("::") if p)
        out = []
        for item in _split_top(rest[: rest.rfind("}")]):
            out.extend(_expand_use(item, base))
        return out
    path_s, _, alias = tree.partition(" as ")
    parts = tuple(p for p in path_s.split("::") if p)
    if not parts:
        return []
    if parts[-1] == "*":
        return [(prefix + parts[:-1], None)]
    if parts[-1] == "self":
        parts = parts[:-1]
    full = prefix + parts
    return [(full, alias or (full[-1] if full else None))]


_CFG_TEST = re.compile(r"#\[cfg\(test\)\]")
_MOD = re.compile(r"(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*([;{])")
_USE = re.compile(r"(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);")
_PATH = re.compile(r"(crate|super|self)((?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")


class _RustFile:
    """One file's references to crate modules. Each use / path is kept with whether it is test
    code inside the file (an item under `#[cfg(test)]` or in `mod tests`); `test_mods` are the
    file modules it declares under `#[cfg(test)]` (`#[cfg(test)] mod batch_tests;`)."""

    def __init__(self, path: Path, module: tuple[str, ...], text: str):
        self.path, self.module = path, module
        # (scope, path, alias, pub, line, test)
        self.uses: list[tuple[tuple[str, ...], tuple[str, ...], str | None, bool, int, bool]] = []
        # (scope, path, line, test)
        self.paths: list[tuple[tuple[str, ...], tuple[str, ...], int, bool]] = []
        self.inline_mods: set[tuple[str, ...]] = set()
        self.test_mods: set[tuple[str, ...]] = set()
        self._scan(_strip_rust(text))

    def _scan(self, text: str) -> None:
        # scope stack: (module path, brace depth at which it closes, is test)
        stack: list[tuple[tuple[str, ...], int, bool]] = [(self.module, -1, False)]
        depth, pending_test, line = 0, False, 1
        i, n = 0, len(text)
        skip_until_depth = None  # the braces of a #[cfg(test)] item that is not a module
        while i < n:
            c = text[i]
            if c == "\n":
                line += 1
                i += 1
                continue
            scope, _, in_test = stack[-1]
            m = _CFG_TEST.match(text, i)
            if m:
                pending_test = True
                i = m.end()
                continue
            if i == 0 or not (text[i - 1].isalnum() or text[i - 1] in "_:"):
                m = _MOD.match(text, i)
                if m:
                    name, end = m.group(1), m.group(2)
                    test = in_test or pending_test or skip_until_depth is not None or name == "tests"
                    pending_test = False
                    line += text.count("\n", i, m.end())
                    i = m.end()
                    if end == "{":
                        depth += 1
                        stack.append((scope + (name,), depth, test))
                        self.inline_mods.add(scope + (name,))
                    elif test:
                        self.test_mods.add(scope + (name,))
                    continue
                m = _USE.match(text, i)
                if m:
                    test = in_test or pending_test or skip_until_depth is not None
                    for path, alias in _expand_use(m.group(2)):
                        self.uses.append((scope, path, alias, bool(m.group(1)), line, test))
                    pending_test = False
                    line += text.count("\n", i, m.end())
                    i = m.end()
                    continue
                m = _PATH.match(text, i)
                if m:
                    path = (m.group(1),) + tuple(p.strip() for p in m.group(2).split("::") if p.strip())
                    self.paths.append((scope, path, line, in_test or skip_until_depth is not None))
                    line += text.count("\n", i, m.end())
                    i = m.end()
                    continue
            if c == "{":
                depth += 1
                if pending_test and skip_until_depth is None:
                    skip_until_depth = depth
                pending_test = False
            elif c == "}":
                if skip_until_depth == depth:
                    skip_until_depth = None
                if stack[-1][1] == depth:
                    stack.pop()
                depth -= 1
            elif c == ";" and skip_until_depth is None:
                pending_test = False
            i += 1


def _absolute(scope: tuple[str, ...], path: tuple[str, ...]) -> tuple[str, ...] | None:
    if not path:
        return None
    head = path[0]
    if head == "crate":
        return path[1:]
    if head in ("super", "self"):
        cur = scope
        rest = list(path)
        while rest and rest[0] in ("super", "self"):
            if rest.pop(0) == "super":
                if not cur:
                    return None
                cur = cur[:-1]
        return cur + tuple(rest)
    return None  # an external crate or a local name


def rust_graph(src: Path, with_tests: bool) -> dict:
    """Edges between two-level modules: {a: {b: [file:line, ...]}}."""
    files = [_RustFile(p, _file_module(p, src), p.read_text()) for p in sorted(src.rglob("*.rs"))]
    test_mods = {m for f in files for m in f.test_mods}

    def test_file(f: _RustFile) -> bool:
        m = f.module
        return f.path.name == "tests.rs" or "tests" in m or "test_support" in m or any(
            m[:k] in test_mods for k in range(1, len(m) + 1))

    for f in files:
        if not with_tests:
            whole = test_file(f)
            f.uses = [u for u in f.uses if not (whole or u[5])]
            f.paths = [p for p in f.paths if not (whole or p[3])]
    modules = {f.module for f in files} | {m for f in files for m in f.inline_mods}
    # re-exports: (module, name) -> absolute target path
    reexports: dict[tuple[tuple[str, ...], str], tuple[str, ...]] = {}
    for f in files:
        for scope, path, alias, pub, *_ in f.uses:
            full = _absolute(scope, path)
            if pub and full and alias:
                reexports[(scope, alias)] = full

    def resolve(full: tuple[str, ...], hops: int = 0) -> tuple[str, ...]:
        """The module a path names: its longest module prefix, through re-exports."""
        for k in range(len(full), 0, -1):
            pre = full[:k]
            if pre in modules:
                if k < len(full) and (pre, full[k]) in reexports and hops < 16:
                    target = reexports[(pre, full[k])]
                    return resolve(target + full[k + 1:], hops + 1)
                return pre
        return ()

    def node(m: tuple[str, ...]) -> str:
        return "::".join(m[:2]) or "crate"

    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in files:
        refs = [(s, p, ln) for s, p, _, _, ln, _ in f.uses] + [r[:3] for r in f.paths]
        for scope, path, line in refs:
            full = _absolute(scope, path)
            if full is None:
                continue
            target = resolve(full)
            a, b = node(scope), node(target)
            if a != b and b != "crate":
                edges[a][b].append(f"{f.path.relative_to(src.parent)}:{line}")
    return edges


# ---- Python -------------------------------------------------------------------------------


def python_graph(pkg: Path) -> tuple[dict, dict]:
    """(module-level edges, lazy edges) between ferroattn modules: {a: {b: [where]}}."""
    base = pkg.parent
    mods: dict[str, Path] = {}
    for p in sorted(pkg.rglob("*.py")) + sorted(pkg.rglob("*.pyi")):  # a stub: an extension module
        parts = p.relative_to(base).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.setdefault(".".join(parts), p)
    eager: dict = defaultdict(lambda: defaultdict(list))
    lazy: dict = defaultdict(lambda: defaultdict(list))
    for name, p in mods.items():
        if p.suffix == ".pyi":
            continue
        is_pkg = p.name == "__init__.py"
        tree = ast.parse(p.read_text(), str(p))

        def visit(node: ast.AST, in_func: bool) -> None:
            for child in ast.iter_child_nodes(node):
                func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                guarded = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _py_targets(child, name, is_pkg, mods):
                        if target != name:
                            (lazy if in_func else eager)[name][target].append(f"{p.relative_to(base.parent)}:{child.lineno}")
                if not guarded:
                    visit(child, func)

        visit(tree, False)
    return eager, lazy


def _py_targets(node: ast.AST, name: str, is_pkg: bool, mods: dict) -> list[str]:
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in mods:
                out.append(a.name)
        return out
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        pkg = name.split(".") if is_pkg else name.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base not in mods:
        return out
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if sub in mods else base)
    return out


# ---- circles --------------------------------------------------------------------------------


def circles(edges: dict) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(set(edges) | {w for e in edges.values() for w in e}):
        if v not in index:
            strong(v)
    return sorted(out)


def cut(edges: dict, level: int, sep: str) -> dict:
    out: dict = defaultdict(lambda: defaultdict(list))
    for a, targets in edges.items():
        for b, where in targets.items():
            ca, cb = sep.join(a.split(sep)[:level]), sep.join(b.split(sep)[:level])
            if ca != cb:
                out[ca][cb].extend(where)
    return out


def _report(title: str, edges: dict, verbose: bool) -> int:
    """Prints each circle (its modules, the two-way pairs in it, the edges inside); the count."""
    found = circles(edges)
    for comp in found:
        print(f"{title}: circle {' <-> '.join(comp)}")
        members = set(comp)
        pairs = [f"{a} <-> {b}" for a in comp for b in comp if a < b and b in edges.get(a, {}) and a in edges.get(b, {})]
        if pairs:
            print(f"  two-way: {'; '.join(pairs)}")
        for a in comp:
            for b, where in sorted(edges.get(a, {}).items()):
                if b in members:
                    where = sorted(set(where), key=where.index)
                    shown = where if verbose else where[:3]
                    more = f" (+{len(where) - len(shown)} more)" if len(where) > len(shown) else ""
                    print(f"    {a} -> {b}: {', '.join(shown)}{more}")
    return len(found)


def check(root: Path, with_tests: bool = False, verbose: bool = False) -> int:
    """Prints every problem of the tree at ``root`` (src/ and python/ferroattn/); their count."""
    problems = 0
    redges = rust_graph(root / "src", with_tests)
    problems += _report("rust (top level)", cut(redges, 1, "::"), verbose)
    problems += _report("rust (two levels)", redges, verbose)
    for a, targets in sorted(redges.items()):
        for b, where in sorted(targets.items()):
            where = sorted(set(where), key=where.index)
            if a.startswith("tuning") and b.startswith("ops"):
                print(f"rust: {a} imports {b} (tuning is pure; it must not import ops): {', '.join(where[:3])}")
                problems += 1
            if b.startswith("python") and not a.startswith("python"):
                print(f"rust: {a} imports {b} (the binding layer is a leaf): {', '.join(where[:3])}")
                problems += 1

    eager, lazy = python_graph(root / "python" / "ferroattn")
    problems += _report("python (modules)", eager, verbose)
    problems += _report("python (two levels)", cut(eager, 2, "."), verbose)
    both: dict = defaultdict(lambda: defaultdict(list))
    for graph in (eager, lazy):
        for a, targets in graph.items():
            for b, where in targets.items():
                both[a][b].extend(where)
    if not circles(eager):   # a circle closed only by an import inside a function
        problems += _report("python (imports inside functions too)", both, verbose)
    for a, targets in sorted(both.items()):
        for b, where in sorted(targets.items()):
            if a.startswith("ferroattn.profiler") and b.startswith("ferroattn.bench"):
                print(f"python: {a} imports {b} (the profiler must not import the benchmarks): {', '.join(where[:3])}")
                problems += 1
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-tests", action="store_true", help="count imports made by Rust test code too")
    ap.add_argument("-v", "--verbose", action="store_true", help="every place of an edge in a circle")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repository)")
    args = ap.parse_args(argv)
    problems = check(args.root, args.with_tests, args.verbose)
    print("import circles: none" if problems == 0 else f"import circles: {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
