"""The Jupyter notebooks (notebooks/*.ipynb, issue 5) on CPU: they exist, are valid nbformat, every
code cell parses as Python, and they use only ferroattn's public API — no ``_``-prefixed module or
attribute of ferroattn (imported, accessed, or named in a string), and every ferroattn name they
import or access exists in the installed package. Plus the notebook runner
(scripts/run_notebooks.py), its gpu_check.sh stage and its wheels in scripts/build_wheel.sh.

The notebooks are executed on the GPU machine (gpu_check.sh stage ``notebooks``) and committed with
their outputs; ``test_executed_outputs`` checks those outputs.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import types

import nbformat
import pytest

from _scripts import ROOT, load_script

NB_DIR = ROOT / "notebooks"
NAMES = ("01_attention_benchmark.ipynb", "02_gemm_roofline.ipynb", "03_sparse24.ipynb", "04_profile_hf_model.ipynb")
#: notebooks whose own kernels do not exist yet: a markdown cell must say so (none left since issue 4)
NOT_YET: dict[str, str] = {}
#: notebooks that measure our own kernels: the public entry point each must call
OWN_KERNELS = {"02_gemm_roofline.ipynb": "ferroattn.matmul", "03_sparse24.ipynb": "ferroattn.sparse24.matmul"}
PRIVATE_IN_STRING = re.compile(r"\bferroattn(\.[A-Za-z0-9_]+)*\._")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _read(name: str):
    return nbformat.read(str(NB_DIR / name), as_version=4)


def _code_cells(name: str) -> list:
    return [c for c in _read(name).cells if c.cell_type == "code"]


def _resolve(dotted: str):
    """The object named by a dotted ferroattn path (module, or attribute of one); raises
    AttributeError/ImportError naming what is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    path = parts[0]
    for p in parts[1:]:
        path = f"{path}.{p}"
        if hasattr(obj, p):
            obj = getattr(obj, p)
        elif isinstance(obj, types.ModuleType):
            obj = importlib.import_module(path)   # a submodule not imported by its package
        else:
            raise AttributeError(f"{path}: no such name")
    return obj


class _Checker(ast.NodeVisitor):
    """Collects problems: private ferroattn names, and (module path, name) pairs to resolve."""

    def __init__(self):
        self.problems: list[str] = []
        self.bound: dict[str, str] = {}      # local name -> dotted ferroattn path it is bound to
        self.used: set[str] = set()          # dotted ferroattn paths imported or accessed

    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] != "ferroattn":
                continue
            if any(_private(p) for p in a.name.split(".")):
                self.problems.append(f"line {node.lineno}: import {a.name}: private ferroattn module")
            self.used.add(a.name)
            if a.asname:
                self.bound[a.asname] = a.name
            else:
                self.bound[a.name.split(".")[0]] = "ferroattn"

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        if mod.split(".")[0] != "ferroattn" or node.level:
            return
        if any(_private(p) for p in mod.split(".")):
            self.problems.append(f"line {node.lineno}: from {mod} import ...: private ferroattn module")
        for a in node.names:
            if a.name == "*":
                self.problems.append(f"line {node.lineno}: from {mod} import *: name the public names")
                continue
            if _private(a.name):
                self.problems.append(f"line {node.lineno}: from {mod} import {a.name}: private ferroattn name")
            self.used.add(f"{mod}.{a.name}")
            self.bound[a.asname or a.name] = f"{mod}.{a.name}"

    def _chain(self, node):
        """(root name, [attrs]) of a Name.attr.attr chain, or None."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return node.id, attrs[::-1]
        return None

    def visit_Attribute(self, node):
        ch = self._chain(node)
        if ch and ch[0] in self.bound:
            root, attrs = ch
            for a in attrs:
                if _private(a):
                    self.problems.append(f"line {node.lineno}: {root}.{'.'.join(attrs)}: private ferroattn attribute")
                    break
            else:
                self.used.add(".".join([self.bound[root], *attrs]))
            return          # the whole chain is handled; do not revisit its prefixes
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            base, attr = node.args[0], node.args[1]
            ch = self._chain(base) if isinstance(base, (ast.Name, ast.Attribute)) else None
            if ch and ch[0] in self.bound and isinstance(attr, ast.Constant) and isinstance(attr.value, str) \
                    and _private(attr.value):
                self.problems.append(f"line {node.lineno}: {f.id}(..., {attr.value!r}): private ferroattn attribute")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and PRIVATE_IN_STRING.search(node.value):
            self.problems.append(f"line {node.lineno}: string names a private ferroattn module: {node.value[:80]!r}")


def _check_source(src: str) -> _Checker:
    c = _Checker()
    c.visit(ast.parse(src))
    return c


def _notebook_checker(name: str) -> _Checker:
    """One checker over all code cells in order (names bound in one cell are used in later ones)."""
    c = _Checker()
    for i, cell in enumerate(_code_cells(name)):
        before = len(c.problems)
        c.visit(ast.parse(cell.source))
        c.problems[before:] = [f"code cell {i}: {p}" for p in c.problems[before:]]
    return c


# ---- the notebooks ----------------------------------------------------------------------------

def test_all_notebooks_exist():
    present = sorted(p.name for p in NB_DIR.glob("*.ipynb"))
    assert present == sorted(NAMES), f"notebooks/: expected exactly {sorted(NAMES)}, found {present}"


@pytest.mark.parametrize("name", NAMES)
def test_valid_nbformat(name):
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert any(c.cell_type == "markdown" for c in nb.cells), "explain what is measured in markdown cells"
    assert len(_code_cells(name)) >= 3


@pytest.mark.parametrize("name", NAMES)
def test_code_cells_parse(name):
    for i, cell in enumerate(_code_cells(name)):
        try:
            ast.parse(cell.source)
        except SyntaxError as e:  # e.g. an IPython magic (%...) or shell escape (!...)
            pytest.fail(f"{name} code cell {i} is not plain Python: {e}")


@pytest.mark.parametrize("name", NAMES)
def test_first_cell_checks_gpu_and_versions(name):
    first = _code_cells(name)[0].source
    assert "torch.cuda.is_available()" in first and "raise" in first, "first code cell must check for a GPU"
    for what in ("torch.__version__", "ferroattn.__version__", "driver_version()", "get_device_name"):
        assert what in first, f"first code cell must print {what}"


@pytest.mark.parametrize("name", NAMES)
def test_public_api_only(name):
    c = _notebook_checker(name)
    assert not c.problems, f"{name} uses private ferroattn names:\n" + "\n".join(c.problems)
    assert c.used, f"{name} uses no ferroattn name at all"


@pytest.mark.parametrize("name", NAMES)
def test_ferroattn_names_exist(name):
    missing = []
    for dotted in sorted(_notebook_checker(name).used):
        try:
            _resolve(dotted)
        except (AttributeError, ImportError) as e:
            missing.append(f"{dotted} ({type(e).__name__}: {e})")
    assert not missing, f"{name} uses ferroattn names the installed package lacks:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", NAMES)
def test_missing_kernels_said_in_markdown(name):
    text = "\n".join(c.source for c in _read(name).cells if c.cell_type == "markdown")
    if name in NOT_YET:
        assert "do not exist yet" in text and NOT_YET[name] in text and "skipped" in text
    else:   # a notebook whose kernels exist must not say they do not
        assert "do not exist yet" not in text, f"{name}: markdown says kernels do not exist yet"


@pytest.mark.parametrize("name", sorted(OWN_KERNELS))
def test_own_kernels_measured(name):
    """The GEMM / 2:4 notebooks call our kernels through their public entry point (not only the
    torch peers)."""
    used = _notebook_checker(name).used
    assert OWN_KERNELS[name] in used, f"{name}: never calls {OWN_KERNELS[name]} (uses {sorted(used)})"


@pytest.mark.parametrize("name", NAMES)
def test_executed_outputs(name):
    cells = _code_cells(name)
    unexecuted = [i for i, c in enumerate(cells) if c.get("execution_count") is None]
    assert not unexecuted, f"{name}: code cells without an execution_count: {unexecuted}"
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(cells) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{name}: error outputs: {errors}"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{name}: not executed top to bottom in one kernel: {counts}"
    pngs = [o for c in cells for o in c.get("outputs", []) if "image/png" in (o.get("data") or {})]
    assert pngs, f"{name}: no plot (image/png output) recorded"


# ---- the checker itself (it must catch what it is for) ----------------------------------------

@pytest.mark.parametrize("src", [
    "from ferroattn import _native",
    "import ferroattn._native",
    "import ferroattn._native as n",
    "from ferroattn._env import x",
    "from ferroattn.profiler.sweep import _axis",
    "import ferroattn\nferroattn._native.profiler_stats()",
    "import ferroattn.profiler as p\np._private_thing",
    "from ferroattn import profiler\nprofiler.sweep._axis",
    "import ferroattn\ngetattr(ferroattn, '_native')",
    "import importlib\nimportlib.import_module('ferroattn._native')",
    "from ferroattn.profiler import *",
])
def test_checker_flags_private_names(src):
    assert _check_source(src).problems, src


@pytest.mark.parametrize("src", [
    "import ferroattn\nprint(ferroattn.__version__)",
    "from ferroattn.profiler import profile\nwith profile() as p:\n    p.records._x",   # not a ferroattn-bound chain
    "import torch\ntorch._C",
    "x = 'ferroattn.profiler'",
])
def test_checker_accepts_public_names(src):
    assert not _check_source(src).problems, src


def test_resolve_reports_missing_names():
    _resolve("ferroattn.profiler.measure_ceilings")
    _resolve("ferroattn.bench.attention.run")
    with pytest.raises((AttributeError, ImportError)):
        _resolve("ferroattn.profiler.no_such_function_here")
    with pytest.raises((AttributeError, ImportError)):
        _resolve("ferroattn.no_such_module")
    c = _check_source("from ferroattn.bench import attention\nattention.run\nattention.grid()")
    assert {"ferroattn.bench.attention", "ferroattn.bench.attention.run", "ferroattn.bench.attention.grid"} <= c.used


# ---- the runner, its stage and its wheels ------------------------------------------------------

def test_run_notebooks_finds_and_rejects(tmp_path):
    rn = load_script("run_notebooks")
    assert [p.name for p in rn.find_notebooks([])] == sorted(NAMES)
    with pytest.raises(FileNotFoundError):
        rn.find_notebooks([str(tmp_path / "missing.ipynb")])
    assert rn.main([str(tmp_path / "missing.ipynb")]) == 2
    assert rn.main(["--cell-timeout", "0"]) == 2
    assert rn.main(["--budget-s", "-1"]) == 2
    (tmp_path / "empty").mkdir()
    assert rn.main([str(tmp_path / "empty")]) == 2


def test_run_notebooks_executes_on_cpu(tmp_path):
    """A CPU-only notebook through the real kernel (needs nbclient + ipykernel; skipped without)."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint('cwd', os.getcwd())"),
                nbformat.v4.new_code_cell("sum(range(10))")]
    nbformat.write(nb, str(tmp_path / "ok.ipynb"))
    nb.cells.append(nbformat.v4.new_code_cell("1 / 0"))
    nb.cells.append(nbformat.v4.new_code_cell("print('never')"))
    nbformat.write(nb, str(tmp_path / "bad.ipynb"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_notebooks.py"), str(tmp_path / "ok.ipynb"),
                        str(tmp_path / "bad.ipynb"), "--out", str(out), "--cell-timeout", "120",
                        "--json", str(out / "r.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FAIL" in r.stdout and "ZeroDivisionError" in r.stdout
    ok = nbformat.read(str(out / "ok.ipynb"), as_version=4)
    assert [c.execution_count for c in ok.cells] == [1, 2]
    assert ok.cells[1].outputs[0]["data"]["text/plain"] == "45"
    bad = nbformat.read(str(out / "bad.ipynb"), as_version=4)
    assert bad.cells[2].outputs[-1]["output_type"] == "error" and bad.cells[3].execution_count is None


def test_run_notebooks_failing_in_place_keeps_the_committed_notebook(tmp_path):
    """A notebook that fails in place is left as it was; the failed run goes to <name>.failed.ipynb
    with the later cells' stale outputs cleared (needs nbclient + ipykernel; skipped without)."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    stale = nbformat.v4.new_code_cell("print('from an earlier run')", execution_count=2)
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="from an earlier run\n")]
    nb.cells = [nbformat.v4.new_code_cell("raise RuntimeError('needs a GPU')"), stale]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    before = path.read_text()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_notebooks.py"), str(path), "--cell-timeout", "120"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "nb.failed.ipynb" in r.stdout, r.stdout + r.stderr
    assert path.read_text() == before
    failed = nbformat.read(str(tmp_path / "nb.failed.ipynb"), as_version=4)
    assert failed.cells[0].outputs[-1]["output_type"] == "error"
    assert failed.cells[1].outputs == [] and failed.cells[1].execution_count is None


def test_gpu_check_has_notebooks_stage():
    env = dict(os.environ)
    env.pop("GPU_CHECK_STAGES", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--list-stages"], capture_output=True,
                       text=True, env=env, timeout=60)
    stages = r.stdout.split()
    assert r.returncode == 0 and "notebooks" in stages
    assert stages.index("notebooks") == stages.index("profile") + 1
    env["GPU_CHECK_STAGES"] = "notebooks"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--list-stages"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["install", "notebooks"]
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "scripts/run_notebooks.py ${NOTEBOOKS:-} --out \"$OUT/notebooks\"" in text and "[notebooks]=" in text


def test_build_wheel_brings_notebook_wheels():
    text = (ROOT / "scripts" / "build_wheel.sh").read_text()
    m = re.search(r'NOTEBOOK_WHEELS="([^"]*)"', text)
    assert m, "build_wheel.sh: NOTEBOOK_WHEELS not found"
    specs = m.group(1).split()
    names = {s.split("==")[0].replace("-", "_").lower() for s in specs}
    assert all("==" in s for s in specs), "pin every notebook wheel"
    assert len(names) == len(specs), "one version of each wheel"
    for need in ("nbclient", "nbformat", "jupyter_client", "jupyter_core", "ipykernel", "ipython", "traitlets",
                 "pyzmq", "tornado", "jsonschema", "fastjsonschema", "rpds_py", "referencing", "platformdirs"):
        assert need in names, f"build_wheel.sh: {need} missing from NOTEBOOK_WHEELS"
    assert "debugpy" not in names
    assert "$NOTEBOOK_WHEELS" in re.search(r"EXTRA_WHEELS=\$\{EXTRA_WHEELS:-\"([^\n]*)\"\}", text).group(1)
