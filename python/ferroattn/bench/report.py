"""FLOP formulas, run metadata, summary statistics, the printed table and the raw JSON of a
benchmark run (forward grid, backward grid, variant grid). Pure Python (no torch needed except in
:func:`run_metadata`), so it is tested on CPU with synthetic numbers.

A grid point (one dict per shape) holds::

    {"dtype": "bf16", "causal": bool, "head_dim": d, "heads": h, "seqlen": s, "batch": b,
     "flops": float,                          # FLOPs of what is timed (fwd_flops; the backward
                                              # benchmark: bwd_flops or fwd_bwd_flops), counted
                                              # over the visible (query, key) pairs
     "ours": {"ms", "tflops", "pct_ceiling"} | None, "ours_error": str | None,
     "peers": {name: {"ms", "tflops"} | None}, "peer_errors": {name: reason},
     "ratio": {name: ours_tflops / peer_tflops | None},
     "max_abs_diff": float | None, "diff_ref": peer name | None,
     "skipped": reason | None}
"""
from __future__ import annotations

import datetime as _dt
import json
import numbers
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from .._measure import driver_version  # noqa: F401  (shared with the profiler; public here too)


def _check_mask_args(causal, window_size) -> None:
    """``causal`` a bool, ``window_size`` a pair of ints (ArgumentError naming them otherwise: a
    string such as ``"no"`` is never read as True)."""
    from ..errors import ArgumentError  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise ArgumentError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")


def _check_sizes(**sizes) -> None:
    """Every size an int >= 0 (ArgumentError naming it otherwise: no float is truncated)."""
    from ..errors import ArgumentError  # noqa: PLC0415
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ArgumentError(f"{name}: expected an int >= 0, got {type(v).__name__} {v!r}")


def visible_pairs(s_q: int, s_k: int, causal: bool = False, window_size: Sequence[int] = (-1, -1)) -> int:
    """The (query, key) pairs of one (batch, head) that a flash_attn call's causal / window mask
    leaves visible: the window normalised as flash_attn does (``AttnVariant.from_flash_attn``: a
    side >= s_k or negative is unbounded, the unset side of a one-sided window is s_k), then
    :func:`ferroattn.ops.variant.visible_pairs` (the one count; the launch recorder's FLOPs use the
    same on the normalised variant the kernels get). Needs torch and the native extension
    (imported on first use). Raises ArgumentError (sizes that are not ints >= 0, a causal that is
    not a bool, a window that is not a pair of ints)."""
    _check_sizes(s_q=s_q, s_k=s_k)
    _check_mask_args(causal, window_size)
    from ferroattn.ops.variant import AttnVariant  # noqa: PLC0415
    from ferroattn.ops.variant import visible_pairs as _visible_pairs  # noqa: PLC0415
    v = AttnVariant.from_flash_attn(bool(causal), tuple(int(w) for w in window_size), 0.0, None, None, int(s_q),
                                    int(s_k))
    return int(_visible_pairs(int(s_q), int(s_k), v.causal, (v.window_left, v.window_right)))


def fwd_flops(b: int, h: int, s_q: int, s_k: int, d: int, causal: bool,
              window_size: Sequence[int] = (-1, -1)) -> float:
    """Attention forward FLOPs: two matmuls (q kᵀ and p v) of 2·d FLOPs per visible (query, key)
    pair and head, i.e. 4·b·h·d·:func:`visible_pairs` -- 4·b·h·s_q·s_k·d without a mask; causal
    with s_q == s_k counts s·(s + 1)/2 pairs (the diagonal included: 1/s above the "half" of the
    FlashAttention papers); a local window counts only the pairs inside it. Softcap, ALiBi and
    sinks do not change the count. Raises ArgumentError (as :func:`visible_pairs`)."""
    _check_sizes(b=b, h=h, s_q=s_q, s_k=s_k, d=d)
    _check_mask_args(causal, window_size)
    return _flops("ATTN_FWD_PRODUCTS", b, h, s_q, s_k, d, causal, window_size)


def _flops(products: str, b, h, s_q, s_k, d, causal, window_size) -> float:
    """FLOPs of the named product count (``_native.ATTN_FWD_PRODUCTS`` / ``ATTN_BWD_PRODUCTS``)
    over the visible pairs, by ``_native.attn_flops`` (the one formula)."""
    from ferroattn import _native
    pairs = int(b) * int(h) * visible_pairs(s_q, s_k, causal, window_size)
    return float(_native.attn_flops(getattr(_native, products), pairs, int(d)))


#: How the benchmarks count FLOPs (for the raw JSON's config).
FLOPS_RULE = ("forward 4*b*h*d*visible_pairs(s_q, s_k, causal, window_size) "
              "(ferroattn.ops.attention.visible_pairs; causal with s_q == s_k: s*(s+1)/2 pairs)")


def bwd_flops(b: int, h: int, s_q: int, s_k: int, d: int, causal: bool,
              window_size: Sequence[int] = (-1, -1)) -> float:
    """Attention backward FLOPs (dQ, dK, dV): its 5 products over the same visible pairs, i.e.
    2.5 x :func:`fwd_flops` (FlashAttention convention; ``_native.ATTN_BWD_PRODUCTS``)."""
    fwd_flops(b, h, s_q, s_k, d, causal, window_size)   # the argument checks
    return _flops("ATTN_BWD_PRODUCTS", b, h, s_q, s_k, d, causal, window_size)


def fwd_bwd_flops(b: int, h: int, s_q: int, s_k: int, d: int, causal: bool,
                  window_size: Sequence[int] = (-1, -1)) -> float:
    """Forward + backward FLOPs: 3.5 x :func:`fwd_flops`."""
    return fwd_flops(b, h, s_q, s_k, d, causal, window_size) + bwd_flops(b, h, s_q, s_k, d, causal, window_size)


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s from FLOPs and milliseconds (None when ms is None or not positive)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def git_commit(repo: str | os.PathLike | None = None) -> str:
    """$FERROATTN_COMMIT when set (scripts/gpu_check.sh sets it from dist/COMMIT: the commit the
    wheel was built from, which is what ran), else ``git rev-parse HEAD`` (with ``-dirty`` when the
    tree has changes) of the working directory, else "unknown". Outside gpu_check on the device,
    set FERROATTN_COMMIT: the device's copy of the tree can carry a stale git state."""
    env = os.environ.get("FERROATTN_COMMIT")
    if env:
        return env
    if shutil.which("git"):
        try:
            cwd = str(repo) if repo else None
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                                  text=True, timeout=10)
            if head.returncode == 0:
                dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True,
                                       text=True, timeout=10).stdout.strip()
                return head.stdout.strip() + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_metadata() -> dict[str, Any]:
    """Device, driver, software versions, commit and date of this run (needs torch + CUDA)."""
    import torch
    meta: dict[str, Any] = {"date": now_utc(), "commit": git_commit(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "driver": driver_version()}
    try:
        import ferroattn
        meta["ferroattn"] = ferroattn.__version__
    except Exception:
        meta["ferroattn"] = None
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(device=p.name, sm=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    memory_bytes=p.total_memory, l2_bytes=getattr(p, "L2_cache_size", None))
    return meta


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def summarize(points: Iterable[dict], ref_peer: str = "flash", head_dims: Sequence[int] = (64, 128)) -> dict:
    """Summary of a grid: median and minimum ratio ours/``ref_peer`` (TFLOP/s) over the points
    with head_dim in ``head_dims`` (where the minimum is), the median ratio to every peer over all
    points, the best % of the matmul ceiling, and counts of measured/failed/skipped points."""
    points = list(points)
    sel = [p for p in points if p["head_dim"] in head_dims and p.get("ratio", {}).get(ref_peer) is not None]
    ratios = [p["ratio"][ref_peer] for p in sel]
    worst = min(sel, key=lambda p: p["ratio"][ref_peer]) if sel else None
    peers = sorted({k for p in points for k in p.get("peers", {})})
    per_peer = {}
    for name in peers:
        rs = [p["ratio"][name] for p in points if p.get("ratio", {}).get(name) is not None]
        per_peer[name] = {"median_ratio": _median(rs), "min_ratio": min(rs) if rs else None, "n": len(rs)}
    pct = [p["ours"]["pct_ceiling"] for p in points if p.get("ours") and p["ours"].get("pct_ceiling") is not None]
    return {
        "ref_peer": ref_peer,
        "head_dims": list(head_dims),
        "median_ratio": _median(ratios),
        "min_ratio": min(ratios) if ratios else None,
        "min_ratio_at": None if worst is None else point_label(worst),
        "n_ratio_points": len(ratios),
        "per_peer": per_peer,
        "best_pct_ceiling": max(pct) if pct else None,
        "n_points": len(points),
        "n_measured": sum(1 for p in points if p.get("ours")),
        "n_ours_failed": sum(1 for p in points if p.get("ours_error")),
        "n_skipped": sum(1 for p in points if p.get("skipped")),
    }


def point_label(p: dict) -> str:
    return (f"{p['dtype']} {'causal' if p['causal'] else 'full'} d={p['head_dim']} h={p['heads']} "
            f"s={p['seqlen']} b={p['batch']}")


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def format_table(points: Sequence[dict], peers: Sequence[str]) -> str:
    """One row per grid point: TFLOP/s of ours and each peer, ratio ours/peer, % of ceiling."""
    cols = ["dtype", "mask", "d", "h", "seqlen", "b", "ours TF/s"] + [f"{p} TF/s" for p in peers] + \
        [f"x{p}" for p in peers] + ["%ceil", "max|diff|"]
    rows = []
    for p in points:
        if p.get("skipped"):
            rows.append([p["dtype"], "causal" if p["causal"] else "full", str(p["head_dim"]), str(p["heads"]),
                         str(p["seqlen"]), str(p["batch"]), "skipped"] + [""] * (2 * len(peers) + 2))
            continue
        ours = p.get("ours") or {}
        row = [p["dtype"], "causal" if p["causal"] else "full", str(p["head_dim"]), str(p["heads"]),
               str(p["seqlen"]), str(p["batch"]), _f(ours.get("tflops"), ".1f") if ours else "ERR"]
        for name in peers:
            pr = p.get("peers", {}).get(name)
            row.append(_f(pr["tflops"], ".1f") if pr else "n/a")
        for name in peers:
            row.append(_f(p.get("ratio", {}).get(name), ".2f"))
        row.append(_f(ours.get("pct_ceiling"), ".1f"))
        row.append(_f(p.get("max_abs_diff"), ".1e"))
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_summary(summary: dict, ceilings: dict | None = None, host: dict | None = None) -> str:
    ref = summary["ref_peer"]
    ds = " & ".join(str(d) for d in summary["head_dims"])
    lines = []
    if ceilings:
        mm, cp = ceilings.get("matmul_bf16"), ceilings.get("copy_d2d")
        lines.append("ceilings: bf16 matmul " + (f"{mm['tflops']:.0f} TFLOP/s" if mm else "n/a") +
                     ", d2d copy " + (f"{cp['gbps']:.0f} GB/s" if cp else "n/a"))
    lines.append(f"median ratio ours/SDPA-{ref} over d {ds}: {_f(summary['median_ratio'], '.3f')} "
                 f"({summary['n_ratio_points']} points)")
    lines.append(f"minimum ratio ours/SDPA-{ref} over d {ds}: {_f(summary['min_ratio'], '.3f')}"
                 + (f" at {summary['min_ratio_at']}" if summary.get("min_ratio_at") else ""))
    for name, v in summary["per_peer"].items():
        lines.append(f"  vs SDPA-{name}: median {_f(v['median_ratio'], '.3f')}, min {_f(v['min_ratio'], '.3f')} "
                     f"over {v['n']} points")
    if summary.get("best_pct_ceiling") is not None:
        lines.append(f"best: {summary['best_pct_ceiling']:.1f}% of the measured bf16 matmul ceiling")
    lines.append(f"points: {summary['n_points']}, measured {summary['n_measured']}, ours failed "
                 f"{summary['n_ours_failed']}, skipped {summary['n_skipped']}")
    if host:
        for name, v in host.items():
            if isinstance(v, dict) and v.get("host_us") is not None:
                lines.append(f"host cost per call ({host.get('shape', '')}) {name}: {v['host_us']:.1f} us "
                             f"(GPU {v['gpu_us']:.1f} us{', host-bound' if v.get('host_bound') else ', GPU-bound'})")
            elif isinstance(v, dict):
                lines.append(f"host cost per call {name}: n/a ({v.get('error')})")
    return "\n".join(lines)


# ---- backward benchmark ------------------------------------------------------------------

#: Issue 3 targets for the attention backward: the median ratio ours/SDPA-flash over head dims
#: 64 and 128 at least 1.0, and no measured grid point below 0.85.
BWD_TARGET_MEDIAN = 1.0
BWD_TARGET_MIN = 0.85
MODE_TITLES = {"bwd": "backward alone (dQ, dK, dV; FLOPs = 2.5 x forward)",
               "fwd_bwd": "forward + backward (FLOPs = 3.5 x forward)"}


def summarize_backward(points_by_mode: dict[str, list[dict]], ref_peer: str = "flash",
                       head_dims: Sequence[int] = (64, 128)) -> dict:
    """Summary of a backward-benchmark run. ``points_by_mode`` maps a mode ("bwd", "fwd_bwd") to
    grid points of the :func:`summarize` format whose ``flops`` are that mode's FLOPs.

    Per mode: everything :func:`summarize` gives (median/min ratio ours/``ref_peer`` over
    ``head_dims``, medians per peer over the whole grid, counts), plus ``grid_*`` (median/min over
    every head dim) and ``per_peer_sel`` (median/min/where per peer over ``head_dims``).
    ``per_config``: one row per configuration with every ratio of every mode. ``target``: the
    issue's targets checked on the "bwd" mode (median over ``head_dims`` >= BWD_TARGET_MEDIAN,
    whole-grid minimum >= BWD_TARGET_MIN; ``met`` is None when nothing was measured, and
    ``complete`` says whether every point was measured)."""
    out: dict[str, Any] = {"ref_peer": ref_peer, "head_dims": list(head_dims), "modes": {}, "per_config": []}
    rows: dict[str, dict] = {}
    for mode, pts in points_by_mode.items():
        pts = list(pts)
        s = summarize(pts, ref_peer, head_dims)
        whole = summarize(pts, ref_peer, sorted({p["head_dim"] for p in pts}))
        s.update(grid_median_ratio=whole["median_ratio"], grid_min_ratio=whole["min_ratio"],
                 grid_min_ratio_at=whole["min_ratio_at"])
        sel = {}
        for name in s["per_peer"]:
            t = summarize(pts, name, head_dims)
            sel[name] = {"median_ratio": t["median_ratio"], "min_ratio": t["min_ratio"],
                         "min_ratio_at": t["min_ratio_at"], "n": t["n_ratio_points"]}
        s["per_peer_sel"] = sel
        out["modes"][mode] = s
        for p in pts:
            row = rows.setdefault(point_label(p), {"label": point_label(p)})
            row[mode] = dict(p.get("ratio") or {})
            row[f"{mode}_tflops"] = (p.get("ours") or {}).get("tflops")
    out["per_config"] = list(rows.values())
    b = out["modes"].get("bwd")
    if b is not None:
        med, mn = b["median_ratio"], b["grid_min_ratio"]
        median_ok = None if med is None else bool(med >= BWD_TARGET_MEDIAN)
        min_ok = None if mn is None else bool(mn >= BWD_TARGET_MIN)
        out["target"] = {"median_target": BWD_TARGET_MEDIAN, "min_target": BWD_TARGET_MIN,
                         "median_ok": median_ok, "min_ok": min_ok,
                         "met": None if (median_ok is None or min_ok is None) else (median_ok and min_ok),
                         "complete": b["n_points"] > 0 and b["n_measured"] == b["n_points"]}
    return out


def format_summary_backward(summary: dict, ceilings: dict | None = None) -> str:
    """The summary lines of a backward-benchmark run (from :func:`summarize_backward`)."""
    ref = summary["ref_peer"]
    ds = " & ".join(str(d) for d in summary["head_dims"])
    lines = []
    if ceilings:
        mm = ceilings.get("matmul_bf16")
        lines.append("ceilings: bf16 matmul " + (f"{mm['tflops']:.0f} TFLOP/s" if mm else "n/a"))
    for mode, s in summary["modes"].items():
        lines.append(f"{MODE_TITLES.get(mode, mode)}:")
        lines.append(f"  median ratio ours/SDPA-{ref} over d {ds}: {_f(s['median_ratio'], '.3f')} "
                     f"({s['n_ratio_points']} points); minimum {_f(s['min_ratio'], '.3f')}"
                     + (f" at {s['min_ratio_at']}" if s.get("min_ratio_at") else ""))
        lines.append(f"  whole grid: median {_f(s.get('grid_median_ratio'), '.3f')}, minimum "
                     f"{_f(s.get('grid_min_ratio'), '.3f')}"
                     + (f" at {s['grid_min_ratio_at']}" if s.get("grid_min_ratio_at") else ""))
        for name, v in s["per_peer"].items():
            sel = (s.get("per_peer_sel") or {}).get(name, {})
            lines.append(f"  vs SDPA-{name}: d {ds} median {_f(sel.get('median_ratio'), '.3f')}, min "
                         f"{_f(sel.get('min_ratio'), '.3f')}; whole grid median {_f(v['median_ratio'], '.3f')}, "
                         f"min {_f(v['min_ratio'], '.3f')} over {v['n']} points")
        if s.get("best_pct_ceiling") is not None:
            lines.append(f"  best: {s['best_pct_ceiling']:.1f}% of the measured bf16 matmul ceiling")
        lines.append(f"  points: {s['n_points']}, measured {s['n_measured']}, ours failed {s['n_ours_failed']}, "
                     f"skipped {s['n_skipped']}")
    t = summary.get("target")
    if t:
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        lines.append(f"target (backward >= {t['median_target']}x SDPA-{ref} as the median over d {ds}, no point "
                     f"< {t['min_target']}x): {verdict}" + ("" if t["complete"] else " (grid incomplete)"))
    return "\n".join(lines)


def format_per_config(summary: dict, peers: Sequence[str]) -> str:
    """One row per configuration: ours/peer ratios of every mode side by side."""
    modes = list(summary["modes"])
    cols = ["config"] + [f"{m} x{p}" for m in modes for p in peers]
    rows = [[r["label"]] + [_f((r.get(m) or {}).get(p), ".2f") for m in modes for p in peers]
            for r in summary["per_config"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


# ---- variant benchmark -------------------------------------------------------------------

def variant_overhead(ratio: dict, visible_fraction: float, target: float | None) -> dict:
    """A variant's overhead against plain (same kernel, seqlen and mode) from the paired time
    ratio ``ratio`` (:func:`timing.paired_ratio` of ms_variant over ms_plain): the cost per
    visible pair ``cost_ratio = time_ratio / visible_fraction`` (``visible_fraction`` = the
    variant's visible pairs over plain's; 1 unless the variant masks pairs), ``overhead =
    cost_ratio - 1`` (= TF/s plain / TF/s variant - 1) with the interval of the paired ratio, and
    ``ok`` = overhead <= ``target`` (None without a target)."""
    f = float(visible_fraction)
    if not f > 0:
        raise ValueError(f"visible_fraction: expected > 0, got {visible_fraction!r}")
    lo, hi = ratio["ratio_ci"]
    cost = ratio["ratio"] / f
    return {"time_ratio": ratio["ratio"], "time_ratio_ci": [lo, hi], "time_ratio_rounds": ratio["ratio_rounds"],
            "visible_fraction": f, "cost_ratio": cost, "overhead": cost - 1.0,
            "overhead_ci": [lo / f - 1.0, hi / f - 1.0], "target": target,
            "ok": None if target is None else bool(cost - 1.0 <= target)}


def variant_label(p: dict) -> str:
    dtype = p.get("dtype", "bf16")
    return f"{p['variant']} {p['mode']} s={p['seqlen']}" + ("" if dtype == "bf16" else f" {dtype}")


def _first_line(text: str | None, n: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= n else line[: n - 3] + "..."


def summarize_variants(points: Iterable[dict], peers: Sequence[str] = ()) -> dict:
    """Summary of a variant-benchmark run (points of :func:`ferroattn.bench.variants.grid`, measured):

    - ``overhead``: one row per variant point with an overhead (label, overhead, interval,
      target, ok); ``target``: n checked / ok, the labels over target, ``met`` (None when nothing
      was checked) and ``complete`` (every non-plain point has an overhead);
    - ``not_measured``: every non-plain point without an overhead and why (ours rejects the
      variant, failed, was skipped, or plain was not measured);
    - ``window``: per window point its visible fraction, time ratio and cost ratio against plain;
    - ``per_peer``: median / minimum ratio ours/peer (TF/s) over the points where both ran, and
      per mode; ``max_abs_diff``: the largest guard value per peer;
    - counts: points, measured (ours), unsupported by ours, ours failed, skipped."""
    pts = list(points)
    overhead, not_measured, window = [], [], []
    for p in pts:
        o = p.get("overhead")
        if o is not None:
            overhead.append({"label": variant_label(p), "variant": p["variant"], "mode": p["mode"],
                             "seqlen": p["seqlen"], "overhead": o["overhead"], "overhead_ci": o["overhead_ci"],
                             "target": o["target"], "ok": o["ok"]})
            if p["variant"] == "window" or p.get("visible_fraction", 1.0) != 1.0:
                window.append({"label": variant_label(p), "visible_fraction": o["visible_fraction"],
                               "time_ratio": o["time_ratio"], "cost_ratio": o["cost_ratio"]})
        elif p["variant"] != "plain":
            why = (p.get("skipped") or p.get("ours_unsupported") or p.get("ours_error")
                   or ("plain not measured" if p.get("ours") else "not measured"))
            not_measured.append({"label": variant_label(p), "reason": why})
    checked = [r for r in overhead if r["ok"] is not None]
    failed = [r["label"] for r in checked if not r["ok"]]
    names = list(peers) or sorted({k for p in pts for k in p.get("peers", {})})
    per_peer, diffs = {}, {}
    for name in names:
        rs = [(p["mode"], p["ratio"][name]) for p in pts if (p.get("ratio") or {}).get(name) is not None]
        by_mode = {}
        for mode in sorted({m for m, _ in rs}):
            vals = [r for m, r in rs if m == mode]
            by_mode[mode] = {"median_ratio": _median(vals), "min_ratio": min(vals), "n": len(vals)}
        vals = [r for _, r in rs]
        per_peer[name] = {"median_ratio": _median(vals), "min_ratio": min(vals) if vals else None, "n": len(vals),
                          "modes": by_mode}
        ds = [p["max_abs_diff"][name] for p in pts
              if isinstance((p.get("max_abs_diff") or {}).get(name), (int, float))]
        diffs[name] = max(ds) if ds else None
    return {
        "overhead": overhead,
        "target": {"n_checked": len(checked), "n_ok": len(checked) - len(failed), "failed": failed,
                   "met": None if not checked else not failed, "complete": not not_measured},
        "not_measured": not_measured,
        "window": window,
        "per_peer": per_peer,
        "max_abs_diff": diffs,
        "n_points": len(pts),
        "n_measured": sum(1 for p in pts if p.get("ours")),
        "n_unsupported": sum(1 for p in pts if p.get("ours_unsupported")),
        "n_ours_failed": sum(1 for p in pts if p.get("ours_error")),
        "n_skipped": sum(1 for p in pts if p.get("skipped")),
    }


def format_variants_table(points: Sequence[dict], peers: Sequence[str]) -> str:
    """One row per variant point: visible %, TF/s of ours and each peer, ratio ours/peer,
    overhead against plain (with its target) and the largest max|diff| over the peers. Ours:
    "n/i" = the variant is not implemented (null with the reason in the JSON)."""
    cols = ["mode", "variant", "seqlen", "vis%", "ours TF/s"] + [f"{p} TF/s" for p in peers] + \
        [f"x{p}" for p in peers] + ["overhead", "target", "max|diff|"]
    rows = []
    for p in points:
        head = [p["mode"], p["variant"], str(p["seqlen"]), _f(100.0 * p["visible_fraction"], ".1f")
                if p.get("visible_fraction") is not None else "—"]
        if p.get("skipped"):
            rows.append(head + ["skipped"] + [""] * (2 * len(peers) + 3))
            continue
        ours = p.get("ours") or {}
        row = head + [_f(ours.get("tflops"), ".1f") if ours else ("n/i" if p.get("ours_unsupported") else "ERR")]
        for name in peers:
            pr = (p.get("peers") or {}).get(name)
            row.append(_f(pr["tflops"], ".1f") if pr else "n/a")
        for name in peers:
            row.append(_f((p.get("ratio") or {}).get(name), ".2f"))
        o = p.get("overhead")
        row.append("" if p["variant"] == "plain" else ("—" if o is None else f"{100.0 * o['overhead']:+.1f}%"))
        tgt = p.get("target")
        row.append("" if tgt is None else f"<={100.0 * tgt:.0f}%" + ("" if o is None or o["ok"] else " OVER"))
        ds = [x for x in (p.get("max_abs_diff") or {}).values() if isinstance(x, (int, float))]
        row.append(_f(max(ds) if ds else None, ".1e"))
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_variants_summary(summary: dict) -> str:
    """The summary lines of a variant-benchmark run (from :func:`summarize_variants`); the last
    line is the verdict on the overhead targets."""
    lines = []
    for w in summary["window"]:
        lines.append(f"{w['label']}: {100.0 * w['visible_fraction']:.1f}% of plain's visible pairs in "
                     f"{100.0 * w['time_ratio']:.1f}% of its time (cost per visible pair {w['cost_ratio']:.2f}x)")
    for name, v in summary["per_peer"].items():
        modes = "; ".join(f"{m} median {_f(r['median_ratio'], '.3f')}, min {_f(r['min_ratio'], '.3f')}"
                          for m, r in v["modes"].items())
        lines.append(f"ours/{name}: {modes or 'no common points'} ({v['n']} points); largest max|diff| "
                     f"{_f(summary['max_abs_diff'].get(name), '.1e')}")
    for r in summary["overhead"]:
        if r["target"] is not None:
            lo, hi = r["overhead_ci"]
            lines.append(f"overhead {r['label']}: {100.0 * r['overhead']:+.1f}% (paired interval "
                         f"{100.0 * lo:+.1f}% .. {100.0 * hi:+.1f}%), target <= {100.0 * r['target']:.0f}%: "
                         f"{'ok' if r['ok'] else 'OVER'}")
    for r in summary["not_measured"]:
        lines.append(f"not measured: {r['label']}: {_first_line(r['reason'])}")
    lines.append(f"points: {summary['n_points']}, measured {summary['n_measured']}, not implemented by ours "
                 f"{summary['n_unsupported']}, ours failed {summary['n_ours_failed']}, skipped {summary['n_skipped']}")
    t = summary["target"]
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
    lines.append(f"variant overhead targets (vs ours plain, per visible pair): {verdict}, {t['n_ok']}/{t['n_checked']} "
                 f"within target" + ("" if t["complete"] else f", not measured: {len(summary['not_measured'])}")
                 + (f"; over: {', '.join(t['failed'])}" if t["failed"] else ""))
    return "\n".join(lines)


def clean_json(x: Any) -> Any:
    """Replace non-finite floats (NaN, inf: e.g. the diff of a broken output) by their string
    form, recursively, so the JSON stays standard."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return x


def result_filename(meta: dict, kind: str = "attention") -> str:
    dev = re.sub(r"[^A-Za-z0-9]+", "-", str(meta.get("device") or "nodevice")).strip("-").lower()
    when = re.sub(r"[^0-9T]", "", str(meta.get("date") or now_utc()))
    return f"{kind}_{dev}_{when}.json"


def cannot_run(prog: str) -> int | None:
    """The benchmarks' last check before they measure: 2 (after printing the error, prefixed with
    ``prog``, to stderr) when a ``FERROATTN_*`` tuning-knob variable is malformed (it names the
    variable; every kernel call would raise it), 3 (after printing the "cannot run" line) when
    torch cannot be imported or sees no CUDA GPU, else None."""
    try:
        from ..knobs import current
        current()
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except ImportError:
        pass                           # the native extension's absence is reported where it is needed
    try:
        import torch
    except ImportError as e:
        print(f"{prog}: cannot run: torch is not importable ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print(f"{prog}: cannot run: no CUDA GPU found (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    return None


def out_dir_error(out_dir: str | os.PathLike) -> str | None:
    """None when ``out_dir`` is (made) a writable directory, else the ``--out`` error message: a
    benchmark checks its output directory before it measures, never only at its end."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        return f"--out: expected a writable directory, got {str(out_dir)!r} ({e})"
    return None


def write_json(result: dict, out_dir: str | os.PathLike, kind: str = "attention") -> Path:
    """Write ``result`` to ``out_dir/<kind>_<device>_<date>.json`` (atomically) and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / result_filename(result.get("meta", {}), kind)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(clean_json(result), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path
