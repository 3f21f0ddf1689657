"""A/B candidates in ``bench attention`` (forward and ``--backward``): ours measured again at every
point, in the same process and right after ours, with some tuning knobs set (``--candidate
attn_sm90_fwd_kv_release=separate``, repeatable; the knobs are in docs/DEVELOPING.md). Pairing the
runs at each point keeps clock and L2 drift between runs out of the comparison.

A candidate is labelled by its ``--candidate`` text. Per point, ``p["candidates"][label]`` =
{"ms", "tflops", "speedup": candidate TFLOP/s / ours TFLOP/s, "max_abs_diff": the largest
|candidate - ours| (forward output, or over dQ, dK, dV)}, or ``p["candidate_errors"][label]``.
:func:`summarize` gives, per label, the median / min / max speedup over the points.
"""
from __future__ import annotations

from typing import Any, Iterable


def parse(text: str) -> dict[str, str]:
    """``"name=value[,name=value...]"`` -> {name: value}. A value may hold commas itself (the
    tile knobs: ``gemm_wmma_tile=128,128,32,2,4,4``): a comma-separated piece without ``=`` belongs
    to the value before it. ValueError naming ``--candidate`` when the text does not start with
    ``name=``, for an empty name or a name given twice (unknown names and malformed values are the
    knobs' own errors, raised by :func:`canonical`)."""
    out: dict[str, str] = {}
    pieces = [e.strip() for e in text.split(",") if e.strip()]
    if not pieces:
        raise ValueError(f"--candidate: expected name=value[,name=value...], got {text!r}")
    name = None
    for e in pieces:
        key, sep, value = e.partition("=")
        if not sep:
            if name is None:
                raise ValueError(f"--candidate: expected name=value, got {e!r}")
            out[name] += "," + e
            continue
        name = key.strip()
        if not name:
            raise ValueError(f"--candidate: expected name=value, got {e!r}")
        if name in out:
            raise ValueError(f"--candidate: knob {name!r} given twice")
        out[name] = value.strip()
    return out


def canonical(knobs: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the knobs as the library reads them back: {name: canonical text}, in name order; the
    current values of the same knobs). Sets and restores them once (no GPU work): an unknown knob
    or a malformed value raises ArgumentError (a ValueError) naming it before the benchmark starts."""
    from ..knobs import current, override
    before = current()
    with override(**knobs):
        after = current()
    names = sorted(knobs)
    return {n: after[n] for n in names}, {n: before[n] for n in names}


def record(p: dict, label: str, ms: float, max_abs_diff: float | None) -> None:
    """Store candidate ``label``'s figures at point ``p`` (whose ours entry may be None)."""
    from . import report
    tf = report.tflops(p["flops"], ms)
    base = (p.get("ours") or {}).get("tflops")
    p.setdefault("candidates", {})[label] = {"ms": ms, "tflops": tf, "speedup": (tf / base) if (tf and base) else None,
                                             "max_abs_diff": max_abs_diff}


def record_error(p: dict, label: str, e: BaseException) -> None:
    """Store why candidate ``label`` could not be measured at point ``p``."""
    p.setdefault("candidate_errors", {})[label] = f"{type(e).__name__}: {e}"


def summarize(points: Iterable[dict], candidates: dict[str, dict[str, str]] | None) -> dict | None:
    """Per label: {"knobs", "median_speedup", "min_speedup", "max_speedup", "min_at", "n",
    "n_failed"} over the points with that candidate's speedup; None without candidates."""
    if not candidates:
        return None
    from . import report
    points = list(points)
    out = {}
    for label, knobs in candidates.items():
        sel = [p for p in points if ((p.get("candidates") or {}).get(label) or {}).get("speedup") is not None]
        sp = sorted(p["candidates"][label]["speedup"] for p in sel)
        worst = min(sel, key=lambda p: p["candidates"][label]["speedup"]) if sel else None
        out[label] = {
            "knobs": dict(knobs),
            "median_speedup": report._median(sp),
            "min_speedup": sp[0] if sp else None,
            "max_speedup": sp[-1] if sp else None,
            "min_at": None if worst is None else report.point_label(worst),
            "n": len(sp),
            "n_failed": sum(1 for p in points if label in (p.get("candidate_errors") or {})),
        }
    return out


def format_summary(summaries: dict | None, title: str = "") -> str:
    """One line per candidate: its label and its speedup over ours."""
    def f(x: Any) -> str:
        return "—" if x is None else f"{x:.3f}"
    return "\n".join(
        f"candidate {label}{' (' + title + ')' if title else ''}: speedup over ours median "
        f"{f(s['median_speedup'])}, min {f(s['min_speedup'])} ({s['min_at']}), max {f(s['max_speedup'])}, "
        f"{s['n']} points, {s['n_failed']} failed"
        for label, s in (summaries or {}).items())


def from_args(prog: str, args: Any) -> tuple[int | None, dict[str, dict[str, str]] | None]:
    """The ``--candidate`` options of ``bench attention`` (a list: the option repeats): (None,
    {label: knobs} or None) to go on, or (2, None) after printing the error to stderr, prefixed
    ``prog``: a malformed list, an unknown knob, a bad value, a candidate given twice (the same
    knobs after canonicalisation: ``=1`` and ``=on``, another order), a candidate that sets every
    knob to the value it has already (it would measure ours against ours), or a malformed
    ``FERROATTN_*`` variable in the environment (named as such); (3, None) when the native
    extension cannot be imported to check the knobs. A label is the canonical
    ``name=value[,name=value...]`` in name order."""
    import sys
    texts = getattr(args, "candidate", None)
    if not texts:
        return None, None
    from ..knobs import current
    try:
        current()
    except ImportError as e:
        print(f"{prog}: cannot run: {e}", file=sys.stderr)
        return 3, None
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2, None
    out: dict[str, dict[str, str]] = {}
    try:
        for text in texts:
            knobs, before = canonical(parse(text))
            if knobs == before:
                raise ValueError(f"--candidate: {text!r} sets every knob to its current value "
                                 f"({', '.join(f'{k}={v}' for k, v in knobs.items())}): it would measure ours again")
            # a knob left at its current value changes nothing: not part of what is measured
            changed = {k: v for k, v in knobs.items() if v != before[k]}
            label = ",".join(f"{k}={v}" for k, v in changed.items())
            if label in out:
                raise ValueError(f"--candidate: {text!r} given twice (as {label})")
            out[label] = changed
    except ValueError as e:
        print(f"{prog}: --candidate: {e}" if not str(e).startswith("--candidate") else f"{prog}: {e}",
              file=sys.stderr)
        return 2, None
    return None, out
