"""An A/B candidate in ``bench attention`` (forward and ``--backward``): ours measured a second time
at every point, in the same process and right after ours, with some tuning knobs set
(``--candidate attn_sm90_fwd_kv_release=separate``; the knobs are in docs/DEVELOPING.md). Pairing
the two at each point keeps clock and L2 drift between runs out of the comparison.

Per point, ``p["candidate"]`` = {"ms", "tflops", "speedup": candidate TFLOP/s / ours TFLOP/s,
"max_abs_diff": the largest |candidate - ours| (forward output, or over dQ, dK, dV)}, or
``p["candidate_error"]``. :func:`summarize` gives the median / min / max speedup over the points.
"""
from __future__ import annotations

from typing import Any, Iterable


def parse(text: str) -> dict[str, str]:
    """``"name=value[,name=value...]"`` -> {name: value}. ValueError naming ``--candidate`` for an
    entry without ``=``, an empty name or a name given twice (unknown names and malformed values
    are the knobs' own errors, raised by :func:`check`)."""
    out: dict[str, str] = {}
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"--candidate: expected name=value[,name=value...], got {text!r}")
    for e in entries:
        name, sep, value = e.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--candidate: expected name=value, got {e!r}")
        if name in out:
            raise ValueError(f"--candidate: knob {name!r} given twice")
        out[name] = value.strip()
    return out


def check(knobs: dict[str, str]) -> None:
    """Set and restore the knobs once (no GPU work): an unknown knob or a malformed value raises
    ArgumentError (a ValueError) naming it before the benchmark starts."""
    from ..knobs import override
    with override(**knobs):
        pass


def entry(ours: dict | None, ms: float, flops: float, max_abs_diff: float | None) -> dict:
    """The candidate's figures at a point whose ours entry is ``ours`` (None when ours failed)."""
    from . import report
    tf = report.tflops(flops, ms)
    base = (ours or {}).get("tflops")
    return {"ms": ms, "tflops": tf, "speedup": (tf / base) if (tf and base) else None,
            "max_abs_diff": max_abs_diff}


def summarize(points: Iterable[dict], knobs: dict[str, str] | None) -> dict | None:
    """{"knobs", "median_speedup", "min_speedup", "max_speedup", "min_at", "n", "n_failed"} over
    the points with a candidate speedup; None without a candidate."""
    if not knobs:
        return None
    from . import report
    points = list(points)
    sel = [p for p in points if (p.get("candidate") or {}).get("speedup") is not None]
    sp = sorted(p["candidate"]["speedup"] for p in sel)
    worst = min(sel, key=lambda p: p["candidate"]["speedup"]) if sel else None
    return {
        "knobs": dict(knobs),
        "median_speedup": report._median(sp),
        "min_speedup": sp[0] if sp else None,
        "max_speedup": sp[-1] if sp else None,
        "min_at": None if worst is None else report.point_label(worst),
        "n": len(sp),
        "n_failed": sum(1 for p in points if p.get("candidate_error")),
    }


def format_summary(s: dict | None, title: str = "") -> str:
    """One line: the candidate's knobs and its speedup over ours."""
    if not s:
        return ""
    knobs = ",".join(f"{k}={v}" for k, v in s["knobs"].items())

    def f(x: Any) -> str:
        return "—" if x is None else f"{x:.3f}"
    return (f"candidate {knobs}{' (' + title + ')' if title else ''}: speedup over ours median "
            f"{f(s['median_speedup'])}, min {f(s['min_speedup'])} ({s['min_at']}), max {f(s['max_speedup'])}, "
            f"{s['n']} points, {s['n_failed']} failed")


def from_args(prog: str, args: Any) -> tuple[int | None, dict[str, str] | None]:
    """``--candidate`` of ``bench attention``: (None, knobs or None) to go on, or (2, None) after
    printing the error (a malformed list, an unknown knob, a bad value) to stderr, prefixed ``prog``;
    (3, None) when the native extension cannot be imported to check the knobs."""
    import sys
    text = getattr(args, "candidate", None)
    if text is None:
        return None, None
    try:
        knobs = parse(text)
        check(knobs)
    except ImportError as e:
        print(f"{prog}: cannot run: {e}", file=sys.stderr)
        return 3, None
    except ValueError as e:
        print(f"{prog}: --candidate: {e}" if not str(e).startswith("--candidate") else f"{prog}: {e}",
              file=sys.stderr)
        return 2, None
    return None, knobs
