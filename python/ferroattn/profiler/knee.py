"""Knee detection on a batch x sequence-length latency grid.

Definition (ours; used by :func:`detect_knee`)
----------------------------------------------
Let ``L(b, s)`` be the measured latency (ms) and ``W(b, s)`` the work of a configuration
(default: tokens, ``W = b * s``; pass ``work=`` to use e.g. ``b * s * s`` for attention, whose
cost grows with ``s^2``). Along one axis, with the other fixed, take the points in increasing
order ``x_0 < x_1 < ... < x_{n-1}`` and

* the marginal cost into ``x_i`` (ms per unit of work), for ``i >= 1``::

      m_i = (L_i - L_{i-1}) / (W_i - W_{i-1})

* the growth of the marginal cost at ``x_i``, for ``1 <= i <= n-2``::

      g_i = max(m_{i+1}, f) / max(m_i, f)

  where the floor ``f = 1e-3 * max |m|`` over the whole grid keeps a flat (launch- or
  latency-bound) stretch, whose marginal cost is ~0 or noise, from dividing by zero; a growth of
  ~1000 therefore means "flat, then every extra unit of work costs time".

The knee of a line is the ``x_i`` with the largest ``g_i``: the last configuration before
each extra unit of work starts to cost more. The knee of the grid is the line knee with the
largest growth over both axes (ties: the smaller work, then the smaller batch). When that growth
is below ``min_growth`` (default 1.5) there is no knee (``Knee.found`` is False,
``Knee.config`` None): a linear grid (constant marginal cost, ``g = 1``) and a flat grid (all
``m = 0``) both give "no knee". A line needs at least 3 points to have a growth.

A power law (``L ~ W^p`` on a geometric grid) grows by the same factor at every step and so has
no single knee; the first point is then reported. Choose ``work`` so that the saturated regime is
linear in it (tokens for MLP-bound models, ``b*s*s`` for attention alone).

Why not Kneedle: Kneedle (V. Satopää, J. Albrecht, D. Irwin, B. Raghavan, "Finding a 'Kneedle'
in a Haystack: Detecting Knee Points in System Behavior", ICDCS Workshops 2011) normalises the
curve to the unit square and picks the point farthest from the chord. It is defined on one
curve, depends on the normalisation range, and is unstable on the 3-6 point geometric sweeps a
GPU benchmark affords; the marginal-cost ratio above is scale-free (unchanged by the units of
latency or work) and reads directly as "each extra token costs g times more after this point".
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from ..errors import ArgumentError
from ._util import real

#: Relative floor of the marginal cost (fraction of the grid's largest |marginal cost|).
REL_FLOOR = 1e-3

AXES = ("batch", "seqlen")


@dataclass(frozen=True)
class LineKnee:
    """Knee analysis of one line of the grid.

    axis: "batch" or "seqlen" (the axis that varies); fixed: the value of the other axis;
    values: the varying axis' values present on this line (ascending);
    latency_ms: latency at each value (ms); marginal: m_1..m_{n-1} (ms per unit of work);
    growth: g_1..g_{n-2} (dimensionless; the i-th entry belongs to values[i+1]);
    knee: the value with the largest growth, or None when the line has < 3 points or its largest
    growth is below ``min_growth``; knee_growth: that growth (None without a growth).
    """

    axis: str
    fixed: int
    values: tuple
    latency_ms: tuple
    marginal: tuple
    growth: tuple
    knee: Optional[int]
    knee_growth: Optional[float]


@dataclass(frozen=True)
class Knee:
    """Result of :func:`detect_knee`.

    config: (batch, seqlen) of the knee, or None when there is none; axis: the axis along which
    the largest growth happened ("batch"/"seqlen"), or None; growth: the marginal-cost growth at
    the knee (dimensionless, 1.0 = linear), None when no line had 3 points; min_growth: the
    threshold used; lines: per-axis :class:`LineKnee` lists (keys "batch" and "seqlen").
    """

    config: Optional[tuple]
    axis: Optional[str]
    growth: Optional[float]
    min_growth: float
    lines: dict = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return self.config is not None


def _check_axis_values(name: str, values, distinct: bool = True) -> list:
    """Positive ints (numpy integers too; not bools), distinct unless ``distinct`` is False."""
    try:
        vals = list(values)
    except TypeError:
        raise ArgumentError(f"{name}: expected a sequence of positive ints, got {values!r}") from None
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) <= 0:
            raise ArgumentError(f"{name}: expected positive ints, got {v!r} in {vals!r}")
    vals = [int(v) for v in vals]
    if distinct and len(set(vals)) != len(vals):
        raise ArgumentError(f"{name}: expected distinct values, got {vals!r}")
    if not vals:
        raise ArgumentError(f"{name}: expected at least one value, got none")
    return vals


def _latency(name: str, where: str, v) -> Optional[float]:
    """A latency value: None/NaN -> missing; negative, infinite or non-numeric -> error."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ArgumentError(f"{name}: expected latencies in ms (numbers), got {v!r} at {where}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name}: expected latencies in ms (numbers), got {v!r} at {where}") from None
    if math.isnan(f):
        return None
    if math.isinf(f) or f < 0:
        raise ArgumentError(f"{name}: expected finite latencies >= 0 ms, got {f} at {where}")
    return f


def _normalise(grid, batches, seqlens) -> dict:
    """{(b, s): latency_ms} from either accepted form (missing points left out)."""
    points: dict = {}
    if isinstance(grid, Mapping):
        if batches is not None or seqlens is not None:
            name = "batches" if batches is not None else "seqlens"
            raise ArgumentError(f"{name}: only with an array grid; a mapping grid carries its own "
                                f"keys (got batches={batches!r}, seqlens={seqlens!r})")
        for key, v in grid.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ArgumentError(f"grid: expected keys (batch, seqlen), got {key!r}")
            b, s = _check_axis_values("grid", key, distinct=False)   # (b, s) may be equal, e.g. (8, 8)
            lat = _latency("grid", f"(batch={b}, seqlen={s})", v)
            if lat is not None:
                points[(b, s)] = lat
    else:
        if batches is None or seqlens is None:
            name = "batches" if batches is None else "seqlens"
            raise ArgumentError(f"{name}: an array grid needs both axis values "
                                f"(got batches={batches!r}, seqlens={seqlens!r})")
        bs = _check_axis_values("batches", batches)
        ss = _check_axis_values("seqlens", seqlens)
        rows = grid.tolist() if hasattr(grid, "tolist") else grid
        try:
            rows = [list(r) for r in rows]
        except TypeError:
            raise ArgumentError(f"grid: expected a mapping or a 2-D array, got {type(grid).__name__}") from None
        shape = (len(rows), len(rows[0]) if rows else 0)
        if len(rows) != len(bs) or any(len(r) != len(ss) for r in rows):
            raise ArgumentError(f"grid: expected shape (len(batches), len(seqlens)) = ({len(bs)}, {len(ss)}), "
                                f"got {shape} (rows of lengths {[len(r) for r in rows]})")
        for i, b in enumerate(bs):
            for j, s in enumerate(ss):
                lat = _latency("grid", f"(batch={b}, seqlen={s})", rows[i][j])
                if lat is not None:
                    points[(b, s)] = lat
    if not points:
        raise ArgumentError("grid: expected at least one measured latency, got none")
    return points


def _lines(points: dict, work: Callable[[int, int], float]):
    """Yield (axis, fixed, [(x, latency, work)...]) for every line of the grid."""
    bs = sorted({b for b, _ in points})
    ss = sorted({s for _, s in points})
    for b in bs:
        yield "seqlen", b, [(s, points[(b, s)], work(b, s)) for s in ss if (b, s) in points]
    for s in ss:
        yield "batch", s, [(b, points[(b, s)], work(b, s)) for b in bs if (b, s) in points]


def detect_knee(grid, *, batches: Optional[Sequence[int]] = None, seqlens: Optional[Sequence[int]] = None,
                work: Optional[Callable[[int, int], float]] = None, min_growth: float = 1.5) -> Knee:
    """The configuration where the marginal cost grows fastest (definition: module docstring).

    grid: ``{(batch, seqlen): latency_ms}`` (values None/NaN = not measured, e.g. out of memory),
    or a 2-D array-like of latencies in ms of shape ``(len(batches), len(seqlens))`` together with
    ``batches`` and ``seqlens`` (positive ints); work: ``work(batch, seqlen) -> float > 0``, strictly
    increasing along each axis (default ``batch * seqlen``, tokens); min_growth: the smallest
    marginal-cost growth that counts as a knee (> 1).

    Returns a :class:`Knee`. Raises :class:`ferroattn.errors.ArgumentError` (a ``ValueError``)
    naming the argument on a malformed grid, negative/infinite latencies, bad axis values, a bad
    ``work`` or ``min_growth``.
    """
    min_growth = real("min_growth", min_growth, 1, strict=True)
    if work is None:
        work = lambda b, s: float(b * s)  # noqa: E731
    elif not callable(work):
        raise ArgumentError(f"work: expected a callable work(batch, seqlen) -> float, got {work!r}")
    points = _normalise(grid, batches, seqlens)

    raw = []  # (axis, fixed, xs, lats, works, marginals)
    for axis, fixed, line in _lines(points, work):
        xs = [x for x, _, _ in line]
        lats = [lat for _, lat, _ in line]
        ws = [real("work", w, 0, strict=True, where=f" at {axis}={x} ({fixed=})") for x, _, w in line]
        m = []
        for i in range(1, len(line)):
            dw = ws[i] - ws[i - 1]
            if not dw > 0:
                raise ArgumentError(f"work: expected strictly increasing along {axis}, got {ws[i - 1]} then "
                                    f"{ws[i]} at {axis}={xs[i - 1]}..{xs[i]}")
            m.append((lats[i] - lats[i - 1]) / dw)
        raw.append((axis, fixed, xs, lats, ws, m))

    scale = max((abs(v) for *_, m in raw for v in m), default=0.0)
    floor = REL_FLOOR * scale
    lines: dict = {a: [] for a in AXES}
    best = None  # (growth, -work, -batch, axis, config)
    for axis, fixed, xs, lats, ws, m in raw:
        if scale > 0:
            g = [max(m[i + 1], floor) / max(m[i], floor) for i in range(len(m) - 1)]
        else:
            g = [1.0] * max(0, len(m) - 1)
        knee = knee_g = None
        if g:
            i = max(range(len(g)), key=lambda k: (g[k], -k))  # first of equal maxima
            knee_g = g[i]
            if knee_g >= min_growth:
                knee = xs[i + 1]
            cfg = (fixed, xs[i + 1]) if axis == "seqlen" else (xs[i + 1], fixed)
            # growth rounded to 9 significant digits so float noise does not break ties
            cand = (float(f"{knee_g:.9g}"), -ws[i + 1], -cfg[0], axis, cfg)
            if best is None or cand[:3] > best[:3]:
                best = cand
        lines[axis].append(LineKnee(axis, fixed, tuple(xs), tuple(lats), tuple(m), tuple(g), knee, knee_g))

    if best is None:
        return Knee(None, None, None, float(min_growth), lines)
    if best[0] < min_growth:
        return Knee(None, None, best[0], float(min_growth), lines)
    return Knee(best[4], best[3], best[0], float(min_growth), lines)  # growth: rounded to 9 digits
