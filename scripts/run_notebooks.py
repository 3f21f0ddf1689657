#!/usr/bin/env python3
"""Execute the Jupyter notebooks top to bottom with nbclient and keep the executed copies.

    python scripts/run_notebooks.py                          # every notebooks/*.ipynb, in place
    python scripts/run_notebooks.py --out out/notebooks      # executed copies go to out/notebooks/
    python scripts/run_notebooks.py notebooks/02_gemm_roofline.ipynb --cell-timeout 300

Each notebook runs in its own kernel (``--kernel``, default ``python3``), with the notebook's own
directory as working directory (``--cwd tmp``: a fresh temporary directory instead). Kernel: the
``python3`` kernelspec when one is installed; otherwise jupyter_client falls back to ipykernel's
built-in spec, ``[sys.executable, -m, ipykernel_launcher, -f, {connection_file}]``, so the kernel is
this same interpreter and inherits this process's environment (``PYTHONPATH`` included). That is
what makes a ``pip install --target DIR`` of nbclient + ipykernel work with ``PYTHONPATH=DIR``: no
``jupyter kernelspec install`` is needed.

Limits: ``--cell-timeout`` seconds per cell (default 600); ``--budget-s`` seconds for the whole
run (default: none): a cell's timeout is cut to what is left of it, and a notebook that would start
with less than 10 s left is not started (reported as SKIP, a failure).

Output: the executed notebook is written to ``--out DIR/<name>`` (default: over the input),
also when it failed: the copy then holds every output up to the failing cell, the error's
traceback in that cell (a timeout or a dead kernel is added as an ``error`` output), and the cells
after it unexecuted (their outputs cleared). A notebook that fails in place (no ``--out``) is not
overwritten: the failed run goes to ``<name>.failed.ipynb`` beside it. One line per notebook: PASS/FAIL/SKIP, wall time, what failed. ``--json
PATH`` also writes {notebooks: [{name, status, seconds, error, cell}], ok}.

Exit status: 0 when every notebook passed, 1 when one failed or was skipped, 2 for bad arguments
(no such notebook, nbclient not importable).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "notebooks"
MIN_START_S = 10.0


def find_notebooks(paths: list[str]) -> list[Path]:
    """The notebooks to run: the given files (or every *.ipynb of a given directory), else every
    notebooks/*.ipynb, sorted by name. Raises FileNotFoundError for a missing path."""
    if not paths:
        paths = [str(DEFAULT_DIR)]
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            out.extend(sorted(x for x in path.glob("*.ipynb") if not x.name.startswith(".")))
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"notebook: no such file or directory: {p}")
    return out


def _error_output(ename: str, evalue: str):
    import nbformat
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def run_one(path: Path, out_path: Path, kernel: str, cell_timeout: float, cwd_mode: str,
            deadline: float | None) -> dict:
    """Execute one notebook; write it (executed, or as far as it got) to ``out_path``.
    Returns {name, status: PASS|FAIL|SKIP, seconds, error, cell}."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    res = {"name": path.name, "status": "PASS", "seconds": 0.0, "error": None, "cell": None}
    if deadline is not None and deadline - time.monotonic() < MIN_START_S:
        res.update(status="SKIP", error="time budget used up before this notebook started")
        return res
    nb = nbformat.read(str(path), as_version=4)

    class Client(NotebookClient):
        """A NotebookClient whose per-cell timeout shrinks to what is left of the run's budget."""

        async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
            res["cell"] = cell_index
            if deadline is not None:
                left = deadline - time.monotonic()
                if left < 1:
                    raise CellTimeoutError(f"time budget used up before cell {cell_index}")
                self.timeout = max(1, int(min(cell_timeout, left)))
            return await super().async_execute_cell(cell, cell_index, execution_count=execution_count,
                                                     store_history=store_history)

    tmp = None
    if cwd_mode == "tmp":
        tmp = tempfile.TemporaryDirectory(prefix="nb-")
        cwd = tmp.name
    else:
        cwd = str(path.resolve().parent)
    client = Client(nb, timeout=int(cell_timeout), kernel_name=kernel, allow_errors=False,
                    record_timing=True, resources={"metadata": {"path": cwd}})
    t0 = time.monotonic()
    try:
        client.execute()
        res["cell"] = None
    except CellExecutionError as e:
        res.update(status="FAIL", error=f"{getattr(e, 'ename', 'error')}: {str(getattr(e, 'evalue', e))[:500]}")
    except (CellTimeoutError, TimeoutError) as e:
        res.update(status="FAIL", error=f"timeout: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}")
        if res["cell"] is not None and res["cell"] < len(nb.cells):
            nb.cells[res["cell"]].setdefault("outputs", []).append(
                _error_output("CellTimeoutError", f"run_notebooks: {e} (cell timeout {cell_timeout:.0f} s)"))
    except DeadKernelError as e:
        res.update(status="FAIL", error=f"kernel died: {e}")
        if res["cell"] is not None and res["cell"] < len(nb.cells):
            nb.cells[res["cell"]].setdefault("outputs", []).append(_error_output("DeadKernelError", str(e)))
    except Exception as e:  # kernel did not start, etc.
        res.update(status="FAIL", error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        res["seconds"] = time.monotonic() - t0
        if tmp is not None:
            tmp.cleanup()
    if res["status"] != "PASS":
        # cells after the failing one did not run here: clear their (older) outputs, so the copy
        # never mixes this run's error with another run's results
        first = (res["cell"] + 1) if res["cell"] is not None else 0
        for cell in nb.cells[first:]:
            if cell.cell_type == "code":
                cell.outputs = []
                cell.execution_count = None
        if out_path.resolve() == path.resolve():
            # in place: keep the committed (executed) notebook; the failed run goes beside it
            out_path = path.with_name(path.stem + ".failed.ipynb")
            res["output_note"] = f"failed run written to {out_path.name}; {path.name} left as it was"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(out_path))
    res["written"] = str(out_path)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebook files or directories (default: notebooks/)")
    ap.add_argument("--out", default=None, help="directory for the executed copies (default: in place)")
    ap.add_argument("--kernel", default="python3", help="kernel name (default python3)")
    ap.add_argument("--cell-timeout", type=float, default=600.0, help="seconds per cell (default 600)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default: none)")
    ap.add_argument("--cwd", choices=("notebook", "tmp"), default="notebook",
                    help="kernel working directory: the notebook's directory (default) or a temporary one")
    ap.add_argument("--json", default=None, help="also write the per-notebook results as JSON here")
    ap.add_argument("--progress", action="store_true",
                    help="keep tqdm progress bars in the outputs (default: TQDM_DISABLE=1 for the kernels, so "
                         "recorded outputs hold results, not hundreds of bar updates)")
    args = ap.parse_args(argv)
    if not args.progress:
        os.environ.setdefault("TQDM_DISABLE", "1")   # inherited by the kernels (tqdm reads TQDM_* defaults)
    if args.cell_timeout <= 0:
        print(f"run_notebooks: --cell-timeout: expected seconds > 0, got {args.cell_timeout}", file=sys.stderr)
        return 2
    if args.budget_s is not None and args.budget_s <= 0:
        print(f"run_notebooks: --budget-s: expected seconds > 0, got {args.budget_s}", file=sys.stderr)
        return 2
    try:
        nbs = find_notebooks(args.notebooks)
    except FileNotFoundError as e:
        print(f"run_notebooks: {e}", file=sys.stderr)
        return 2
    if not nbs:
        print("run_notebooks: no notebooks found", file=sys.stderr)
        return 2
    try:
        import nbclient
        import nbformat  # noqa: F401
    except ImportError as e:
        print(f"run_notebooks: cannot run: {e} (pip install nbclient ipykernel)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    print(f"run_notebooks: {len(nbs)} notebook(s), kernel {args.kernel}, nbclient {nbclient.__version__}, "
          f"python {sys.version.split()[0]}, cell timeout {args.cell_timeout:.0f} s"
          + (f", budget {args.budget_s:.0f} s" if args.budget_s else ""), flush=True)
    results = []
    for path in nbs:
        out_path = Path(args.out) / path.name if args.out else path
        print(f"--- {path.name} ...", flush=True)
        r = run_one(path, out_path, args.kernel, args.cell_timeout, args.cwd, deadline)
        r["output"] = r.pop("written", str(out_path))
        results.append(r)
        where = f" (cell {r['cell']})" if r["cell"] is not None and r["status"] == "FAIL" else ""
        print(f"{r['status']:4}  {r['seconds']:7.1f} s  {path.name}{where}"
              + (f"  {r['error']}" if r["error"] else "") + (f"  ({r['output_note']})" if r.get("output_note") else ""),
              flush=True)
    ok = all(r["status"] == "PASS" for r in results)
    total = sum(r["seconds"] for r in results)
    n_pass = sum(r["status"] == "PASS" for r in results)
    print(f"run_notebooks: {n_pass}/{len(results)} passed in {total:.1f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"notebooks": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
