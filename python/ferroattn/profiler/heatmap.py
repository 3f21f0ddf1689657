"""Batch x sequence-length sweep heatmap (issue 5): latency and/or throughput per configuration,
every cell annotated, unmeasured cells shown as "n/a", the knee (:func:`~.knee.detect_knee`) outlined.

Units: latency in ms; throughput in tokens/s, ``batch * seqlen / (latency_ms / 1000)``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Optional, Sequence, Union

from ..errors import ArgumentError
from ._util import figure_path
from .knee import Knee, _check_axis_values, _normalise, detect_knee, fmt_growth

METRICS = ("latency_ms", "tokens_per_s")
_LABELS = {"latency_ms": "latency (ms)", "tokens_per_s": "throughput (tokens/s)"}
MISSING = "n/a"
KNEE_GID = "knee"  # gid of the knee outline patch (find it in ax.patches)


def _metrics(metric) -> tuple:
    ms = [metric] if isinstance(metric, str) else None
    if ms is None:
        try:
            ms = list(metric)
        except TypeError:
            ms = [metric]
    if not ms or len(set(ms)) != len(ms) or any(not isinstance(m, str) or m not in METRICS for m in ms):
        raise ArgumentError(f"metric: expected one of {METRICS!r} or a sequence of distinct ones, got {metric!r}")
    return tuple(ms)


def _axes(grid, batches, seqlens) -> tuple:
    """(batches, seqlens), sorted ascending, including configurations with no measurement."""
    if isinstance(grid, Mapping):
        return sorted({int(b) for b, _ in grid}), sorted({int(s) for _, s in grid})
    return sorted(_check_axis_values("batches", batches)), sorted(_check_axis_values("seqlens", seqlens))


def _fmt_si(v: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def _fmt(metric: str, v: Optional[float]) -> str:
    """Cell text: latency with 3 significant digits, whole ms from 1000 ms on (never "1.23e+03");
    throughput with k/M/G suffixes."""
    if v is None:
        return MISSING
    if metric == "latency_ms":
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return _fmt_si(v)


def sweep_values(points: dict, batches: Sequence[int], seqlens: Sequence[int], metric: str) -> list:
    """Rows (one per batch) of per-seqlen values of ``metric`` (None = not measured; a 0 ms latency
    has no defined throughput and is None for "tokens_per_s")."""
    rows = []
    for b in batches:
        row = []
        for s in seqlens:
            lat = points.get((b, s))
            if lat is None or metric == "latency_ms":
                row.append(lat)
            else:
                row.append(b * s / (lat * 1e-3) if lat > 0 else None)
        rows.append(row)
    return rows


def plot_sweep_heatmap(grid, *, metric: Union[str, Sequence[str]] = "latency_ms", knee=None,
                       title: Optional[str] = None, path: Optional[os.PathLike] = None,
                       batches: Optional[Sequence[int]] = None, seqlens: Optional[Sequence[int]] = None):
    """Heatmap of a batch x sequence-length sweep, one panel per metric.

    grid: as :func:`~.knee.detect_knee` accepts it — ``{(batch, seqlen): latency_ms}`` (None/NaN =
    not measured, e.g. out of memory) or a 2-D array-like of ms of shape ``(len(batches),
    len(seqlens))`` with ``batches`` and ``seqlens``. metric: "latency_ms" (ms), "tokens_per_s"
    (``batch * seqlen / latency`` in tokens/s) or a sequence of both (one panel each, in order).
    knee: a :class:`~.knee.Knee` (its ``config`` is outlined), None (computed with
    ``detect_knee(grid)``, default work = tokens) or False (no outline). Rows are batch sizes
    (ascending from the top), columns sequence lengths (ascending to the right); each cell is
    annotated with its value (3 significant digits, whole ms from 1000 ms on; throughput with
    k/M/G suffixes), unmeasured cells are grey and annotated "n/a"; the colour scale is
    logarithmic when all values are > 0. The knee is named in the title and in a figure legend
    below the panels (constrained layout: it never covers an axis label).

    Returns the matplotlib Figure (a bare ``matplotlib.figure.Figure`` rendered by Agg, no pyplot;
    shows inline in Jupyter); with ``path`` also saves it (format from the suffix, e.g. PNG). The
    knee outline is the patch with gid ``"knee"``. Raises :class:`ferroattn.errors.ArgumentError`
    naming ``metric``, ``knee``, ``grid``, ``batches``, ``seqlens`` or ``path`` (a directory, or no
    suffix of a format matplotlib saves: ``.png``, ``.svg``, ``.pdf``, ...) on bad input; ImportError
    without matplotlib (``pip install 'ferroattn[bench]'``).
    """
    metrics = _metrics(metric)
    points = _normalise(grid, batches, seqlens)
    bs, ss = _axes(grid, batches, seqlens)
    if knee is None:
        knee = detect_knee(points)
    elif knee is not False and not isinstance(knee, Knee):
        raise ArgumentError(f"knee: expected a ferroattn.profiler.Knee, None or False, got {type(knee).__name__}")
    knee_cfg = knee.config if isinstance(knee, Knee) else None
    if knee_cfg is not None and (knee_cfg[0] not in bs or knee_cfg[1] not in ss):
        raise ArgumentError(f"knee: its config (batch, seqlen) = {knee_cfg!r} is not a cell of the grid "
                            f"(batches {bs}, seqlens {ss})")
    if title is not None and not isinstance(title, str):
        raise ArgumentError(f"title: expected a str or None, got {type(title).__name__}")
    try:
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ImportError("plot_sweep_heatmap needs matplotlib: pip install 'ferroattn[bench]'") from None
    if path is not None:
        path = figure_path("path", path)

    n = len(metrics)
    fig = Figure(figsize=(max(4.0, 1.0 + 0.9 * len(ss)) * n, max(3.0, 1.4 + 0.55 * len(bs))), dpi=110,
                 layout="constrained")
    axs = fig.subplots(1, n, squeeze=False)[0]
    for ax, m in zip(axs, metrics):
        rows = sweep_values(points, bs, ss, m)
        data = [[math.nan if v is None else v for v in r] for r in rows]
        vals = [v for r in rows for v in r if v is not None]
        if vals and min(vals) > 0 and max(vals) > min(vals):
            norm = LogNorm(vmin=min(vals), vmax=max(vals))
        else:
            lo = min(vals, default=0.0)
            hi = max(vals, default=1.0)
            norm = Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1.0)
        cmap = "viridis" if m == "latency_ms" else "magma"
        ax.set_facecolor("lightgrey")  # NaN cells are not drawn: the background shows through
        im = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        cm = im.get_cmap()
        for i in range(len(bs)):
            for j in range(len(ss)):
                v = rows[i][j]
                if v is None:
                    color = "black"
                else:
                    r, g, b_, _ = cm(float(norm(v)))
                    color = "black" if 0.299 * r + 0.587 * g + 0.114 * b_ > 0.5 else "white"
                ax.text(j, i, _fmt(m, v), ha="center", va="center", fontsize=8, color=color)
        if knee_cfg is not None:
            i, j = bs.index(knee_cfg[0]), ss.index(knee_cfg[1])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5,
                                   gid=KNEE_GID, label=f"knee (batch={knee_cfg[0]}, seqlen={knee_cfg[1]})"))
        ax.set_xticks(range(len(ss)), [str(s) for s in ss])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("batch")
        ax.set_title(_LABELS[m], fontsize=9)
        fig.colorbar(im, ax=ax, label=_LABELS[m])
    if knee_cfg is not None:   # one legend for the figure, below everything (never over an axis label)
        handles = [p for p in axs[0].patches if p.get_gid() == KNEE_GID]
        fig.legend(handles=handles, loc="outside lower left", fontsize=7, frameon=False)
    if title is not None:
        fig.suptitle(title)
    elif knee_cfg is not None:
        growth = "" if knee.growth is None else f", marginal-cost growth {fmt_growth(knee.growth)}"
        fig.suptitle(f"batch x seqlen sweep — knee at batch={knee_cfg[0]}, seqlen={knee_cfg[1]} "
                     f"(along {knee.axis}{growth})")
    else:
        fig.suptitle("batch x seqlen sweep — no knee")
    if path is not None:
        fig.savefig(path)
    return fig
