"""Roofline model (S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009).

Units: FLOPs and bytes are counts; time in ms; rates in TFLOP/s (1e12 FLOP/s) and GB/s
(1e9 byte/s); arithmetic intensity in FLOP/byte.

- intensity ``I = flops / bytes``;
- attainable rate ``min(peak_tflops, I * bandwidth_gbps / 1000)`` TFLOP/s;
- ridge point ``I* = 1000 * peak_tflops / bandwidth_gbps`` FLOP/byte: below it a kernel is
  memory-bound, at or above it compute-bound;
- % of ceiling: achieved TFLOP/s / attainable TFLOP/s x 100 (the roofline that applies at the
  kernel's intensity), plus % of each ceiling on its own.

Every :class:`Utilisation` carries the :class:`~ferroattn.profiler.ceilings.Ceilings` it used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import ArgumentError
from ._util import figure_path, real
from .ceilings import Ceilings


def _pos(name: str, v, allow_zero: bool = False) -> float:
    return real(name, v, 0, strict=not allow_zero)


def _ceilings(c) -> Ceilings:
    if not isinstance(c, Ceilings):
        raise ArgumentError(f"ceilings: expected a ferroattn.profiler.Ceilings, got {type(c).__name__}")
    return c


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP/byte: ``flops / nbytes`` (flops >= 0, nbytes > 0)."""
    return _pos("flops", flops, allow_zero=True) / _pos("nbytes", nbytes)


def ridge_point(ceilings: Ceilings) -> float:
    """FLOP/byte where the memory roof meets the compute roof: ``1000 * peak_tflops / bandwidth_gbps``."""
    c = _ceilings(ceilings)
    return 1000.0 * c.peak_tflops / c.bandwidth_gbps


def attainable_tflops(intensity: float, ceilings: Ceilings) -> float:
    """TFLOP/s the roofline allows at ``intensity`` FLOP/byte: ``min(peak, intensity * bandwidth / 1000)``."""
    c = _ceilings(ceilings)
    return min(c.peak_tflops, _pos("intensity", intensity, allow_zero=True) * c.bandwidth_gbps / 1000.0)


@dataclass(frozen=True)
class Utilisation:
    """How close one measurement is to the roofline.

    intensity (FLOP/byte), achieved_tflops, achieved_gbps, attainable_tflops, pct_of_roofline
    (achieved / attainable x 100), pct_of_compute (achieved TFLOP/s / peak x 100), pct_of_bandwidth
    (achieved GB/s / bandwidth x 100), bound ("memory" below the ridge point, else "compute"),
    ceilings (the :class:`Ceilings` used; :meth:`Ceilings.label` names them).
    """

    intensity: float
    achieved_tflops: float
    achieved_gbps: float
    attainable_tflops: float
    pct_of_roofline: float
    pct_of_compute: float
    pct_of_bandwidth: float
    bound: str
    ceilings: Ceilings


def utilisation(flops: float, nbytes: float, ms: float, ceilings: Ceilings) -> Utilisation:
    """:class:`Utilisation` of a kernel that did ``flops`` FLOPs and moved ``nbytes`` bytes in ``ms``
    milliseconds (flops >= 0, nbytes > 0, ms > 0). Raises ArgumentError naming a bad argument."""
    c = _ceilings(ceilings)
    i = arithmetic_intensity(flops, nbytes)
    sec = _pos("ms", ms) * 1e-3
    tf = float(flops) / sec / 1e12
    gb = float(nbytes) / sec / 1e9
    att = attainable_tflops(i, c)
    return Utilisation(i, tf, gb, att, 100.0 * tf / att if att > 0 else 0.0, 100.0 * tf / c.peak_tflops,
                       100.0 * gb / c.bandwidth_gbps, "memory" if i < ridge_point(c) else "compute", c)


@dataclass(frozen=True)
class RooflinePoint:
    """One kernel on the roofline plot: name, intensity (FLOP/byte), achieved TFLOP/s."""

    name: str
    intensity: float
    tflops: float

    @classmethod
    def from_measurement(cls, name: str, flops: float, nbytes: float, ms: float) -> "RooflinePoint":
        i = arithmetic_intensity(flops, nbytes)
        return cls(str(name), i, float(flops) / (_pos("ms", ms) * 1e-3) / 1e12)


def plot_roofline(points: Sequence[RooflinePoint], ceilings: Ceilings, path: Optional[os.PathLike] = None,
                  title: Optional[str] = None):
    """Log-log roofline: both ceilings (memory slope up to the ridge point, compute roof after it),
    one labelled marker per point; labels are moved around their markers so that they do not
    overlap each other (:func:`_place_labels`), the legend sits outside the axes. Returns the matplotlib Figure; with ``path`` also saves it (the
    format from the suffix, e.g. PNG). Builds a bare ``matplotlib.figure.Figure`` (rendered by Agg,
    no pyplot, no display needed; shows inline in Jupyter when returned). Needs matplotlib
    (``pip install 'ferroattn[bench]'``). Raises ArgumentError naming ``ceilings``, ``points`` or
    ``path`` (a directory, or no suffix of a format matplotlib saves)."""
    c = _ceilings(ceilings)
    pts = list(points)
    for k, p in enumerate(pts):
        if not isinstance(p, RooflinePoint):
            raise ArgumentError(f"points: expected RooflinePoint items, got {type(p).__name__} at index {k}")
        _pos(f"points[{k}].intensity", p.intensity)
        _pos(f"points[{k}].tflops", p.tflops)
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        raise ImportError("plot_roofline needs matplotlib: pip install 'ferroattn[bench]'") from None
    if path is not None:
        path = figure_path("path", path)

    ridge = ridge_point(c)
    xs = [p.intensity for p in pts] + [ridge]
    lo = min(xs) / 4
    hi = max(xs) * 4
    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.plot([lo, ridge], [lo * c.bandwidth_gbps / 1000, c.peak_tflops], color="tab:blue",
            label=f"memory {c.bandwidth_gbps:.0f} GB/s ({c.memory_source})")
    ax.plot([ridge, hi], [c.peak_tflops, c.peak_tflops], color="tab:red",
            label=f"compute {c.peak_tflops:.1f} TFLOP/s ({c.compute_source})")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=0.8)
    anns = []
    for p in pts:
        ax.scatter([p.intensity], [p.tflops], zorder=3)
        anns.append(ax.annotate(p.name, (p.intensity, p.tflops), textcoords="offset points", xytext=(4, 4),
                                fontsize=7))
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"roofline — {c.device}")
    # the legend sits outside the axes, right of them: it never hides a point
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(True, which="both", linewidth=0.3)
    _place_labels(fig, anns)
    if path is not None:
        fig.savefig(path)
    return fig


#: Candidate label offsets from the marker, in points (x, y of the text's lower left corner; a
#: negative x is taken from the text's right edge).
_OFFSETS = ((4, 4), (4, -11), (-4, 4), (-4, -11), (4, 15), (4, -22), (-4, 15), (-4, -22), (4, 26), (4, -33),
            (-4, 26), (-4, -33), (4, 37), (4, -44), (-4, 37), (-4, -44))


def _place_labels(fig, anns: list) -> None:
    """Greedy label placement: lay the figure out once (Agg), then give each annotation, in order,
    the first candidate offset (:data:`_OFFSETS`) whose text box overlaps no label placed before;
    when none is free, the candidate with the least overlap. The layout is then frozen so a saved
    or displayed figure keeps these positions."""
    if len(anns) < 2:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    fig.set_layout_engine("none")   # keep the axes where the first layout put them
    placed = []

    def overlap(a, b) -> float:
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        return w * h if w > 0 and h > 0 else 0.0

    for ann in anns:
        best = None
        for dx, dy in _OFFSETS:
            ann.set_horizontalalignment("left" if dx >= 0 else "right")
            ann.xyann = (dx, dy)
            box = ann.get_window_extent(renderer)
            cost = sum(overlap(box, b) for b in placed)
            if best is None or cost < best[0]:
                best = (cost, dx, dy, box)
            if cost == 0:
                break
        cost, dx, dy, box = best
        ann.set_horizontalalignment("left" if dx >= 0 else "right")
        ann.xyann = (dx, dy)
        placed.append(box)
