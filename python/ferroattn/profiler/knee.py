"""Knee detection on a batch x sequence-length latency grid, robust to timing noise.

Meaning: the knee is the configuration where the marginal cost (ms per extra unit of work) grows
fastest: below it extra work is (nearly) free — the GPU is not full, or the forward is
host-bound — beyond it every extra unit costs time.

Definition (ours; used by :func:`detect_knee`)
----------------------------------------------
Let ``L(b, s)`` be the measured latency (ms) and ``W(b, s)`` the work of a configuration
(default: tokens, ``W = b * s``; pass ``work=`` to use e.g. ``b * s * s`` for attention, whose
cost grows with ``s^2``). Each line of the grid (one axis varies, the other is fixed; points in
increasing order ``x_0 < ... < x_{n-1}``, works ``w_0 < ... < w_{n-1}``) is analysed as follows.

1. Monotone smoothing: ``y`` = the isotonic (non-decreasing) least-squares fit of the latencies
   against work (pool-adjacent-violators; more work never takes less time, so a dip is noise).
2. Two-segment fit: for each candidate knee ``x_k`` (``1 <= k <= n-2``) the continuous
   piecewise-linear model ``y ~ a + c1 (w - w_0) + c2 max(0, w - w_k)`` is fitted by least squares;
   the pre-knee slope is ``c1`` and the post-knee slope ``c2' = c1 + c2`` (ms per unit of work;
   a floor + linear curve has ``c1 ~ 0``). The line's knee candidate is the ``k`` with the
   smallest residual (ties: the larger growth, then the smaller ``k``).
3. Noise: ``sigma`` = the pooled residual standard deviation of the raw latencies around the
   chosen fits of all lines (``sqrt(sum SSE / sum (n - 3))``), at least ``REL_NOISE_FLOOR`` (1e-3)
   times the median latency (a noiseless grid would otherwise make any bump significant).
4. Growth at ``x_k``: ``g_k = max(c2', s_n) / max(c1, s_n)`` with the noise slope
   ``s_n = sigma / (w_k - w_0)`` (a pre-knee slope below it cannot be told from a flat stretch,
   so a floor + linear curve gets a large, finite growth; 1.0 = no change of slope).
5. The line has a knee at ``x_k`` when ``g_k >= min_growth`` (default 1.5) and the post-knee rise
   ``c2' (w_{n-1} - w_k)`` exceeds ``Z_RISE`` (3) times ``sigma``: a knee only where the cost after
   it clearly grows beyond the noise.

The knee of the grid is the line knee with the largest growth over both axes (ties: the smaller
work, then the smaller batch). A line needs at least 3 points. A linear grid (``g = 1``), a flat
grid and a host-bound grid whose latencies only wander within the noise give no knee
(``Knee.found`` False, ``Knee.config`` None).

A power law (``L ~ W^p``, ``p > 1``, convex everywhere) has no single knee; the two-segment fit
then puts the break where it fits best (late on the line) and reports a growth > 1. Choose
``work`` so that the saturated regime is linear in it (tokens for MLP-bound models, ``b*s*s`` for
attention alone).

Why this rule: the ratio of adjacent finite differences (our first rule) reads noise as a knee on
host-bound sweeps (a 15-25 ms floor whose differences are all noise: the largest ratio landed on
a random point; H200 sweep of notebook 04, 2026-11-29); the monotone fit and the two-segment
least-squares fit use every point of a line, and the noise test refuses a knee the data cannot
support. Kneedle (V. Satopää, J. Albrecht, D. Irwin, B. Raghavan, "Finding a 'Kneedle' in a
Haystack: Detecting Knee Points in System Behavior", ICDCS Workshops 2011) picks the point
farthest from the chord of the normalised curve; it depends on the normalisation range and has no
notion of noise on the 3-6 point geometric sweeps a GPU benchmark affords. Isotonic regression:
pool-adjacent-violators (M. Ayer et al., Ann. Math. Statist. 26, 1955); the hinge (two-segment,
continuous) regression is the standard broken-stick / segmented regression model.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from ..errors import ArgumentError
from ._util import real

#: Smallest noise level, as a fraction of the grid's median latency.
REL_NOISE_FLOOR = 1e-3
#: A knee's post-knee rise must exceed this many noise standard deviations.
Z_RISE = 3.0

AXES = ("batch", "seqlen")


@dataclass(frozen=True)
class LineKnee:
    """Knee analysis of one line of the grid.

    axis: "batch" or "seqlen" (the axis that varies); fixed: the value of the other axis;
    values: the varying axis' values present on this line (ascending);
    latency_ms: latency at each value (ms, as measured); marginal: the raw finite differences
    ``(L_i - L_{i-1}) / (w_i - w_{i-1})``, i = 1..n-1 (ms per unit of work);
    growth: g_1..g_{n-2}, the growth of the two-segment fit with its break at values[1..n-2]
    (dimensionless; the i-th entry belongs to values[i+1]; module docstring, step 4);
    knee: the line's knee (steps 2 and 5), or None when the line has < 3 points or no break
    passes the tests; knee_growth: the growth of the chosen break (None with < 3 points);
    smoothed_ms: the monotone fit of latency_ms (step 1); slopes: (pre, post) slope of the chosen
    break (ms per unit of work), None with < 3 points.
    """

    axis: str
    fixed: int
    values: tuple
    latency_ms: tuple
    marginal: tuple
    growth: tuple
    knee: Optional[int]
    knee_growth: Optional[float]
    smoothed_ms: tuple = ()
    slopes: Optional[tuple] = None


@dataclass(frozen=True)
class Knee:
    """Result of :func:`detect_knee`.

    config: (batch, seqlen) of the knee, or None when there is none; axis: the axis along which
    the largest growth happened ("batch"/"seqlen"), or None; growth: the marginal-cost growth at
    the knee (dimensionless, 1.0 = linear), None when no line had 3 points; min_growth: the
    threshold used; lines: per-axis :class:`LineKnee` lists (keys "batch" and "seqlen");
    noise_ms: the noise level sigma used (ms; None when no line had 3 points). Without a knee,
    growth is the largest growth of any line's chosen break.
    """

    config: Optional[tuple]
    axis: Optional[str]
    growth: Optional[float]
    min_growth: float
    lines: dict = field(default_factory=dict)
    noise_ms: Optional[float] = None

    @property
    def found(self) -> bool:
        return self.config is not None


def fmt_growth(g: float) -> str:
    """A growth factor for titles and tables, never in exponent notation: 2 significant digits
    below 10 (``1.5x``, ``8.0x``), whole numbers above (``37x``, ``1234x``)."""
    return f"{g:.2g}x" if g < 10 else f"{g:.0f}x"


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
    if isinstance(v, bool) or not isinstance(v, numbers.Real):   # "7" or b"7" is no latency
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
        # rows are sequences of latencies (a str, bytes, dict or set row would be read by its
        # characters, bytes, keys or in no fixed order)
        unordered = (str, bytes, Mapping, set, frozenset)
        try:
            raw = [] if isinstance(rows, unordered) else list(rows)
            if isinstance(rows, unordered) or any(isinstance(r, unordered) for r in raw):
                raise ArgumentError(f"grid: expected a mapping or a 2-D array of latencies, got "
                                    f"{type(grid).__name__} of rows {[type(r).__name__ for r in raw][:4]}")
            rows = [list(r) for r in raw]
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


def isotonic(values: Sequence[float]) -> list:
    """The non-decreasing least-squares fit of ``values`` (pool-adjacent-violators, equal
    weights): blocks of adjacent values that decrease are replaced by their mean."""
    blocks: list = []   # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out: list = []
    for m, n in blocks:
        out.extend([m] * n)
    return out


def _two_segment(ws: Sequence[float], ys: Sequence[float], k: int) -> tuple:
    """Least-squares fit of ``y ~ a + c1 (w - w0) + c2 max(0, w - w_k)``: (a, c1, c2, fitted)."""
    import numpy as np  # noqa: PLC0415
    w = np.asarray(ws, dtype=float)
    y = np.asarray(ys, dtype=float)
    span = w[-1] - w[0]
    u = (w - w[0]) / span                       # work scaled to [0, 1] for conditioning
    h = np.maximum(0.0, u - u[k])
    A = np.stack([np.ones_like(u), u, h], axis=1)
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    a, c1, c2 = (float(c) for c in coef)
    return a, c1 / span, c2 / span, (A @ coef).tolist()


def _line_fit(ws: list, lats: list) -> tuple:
    """Step 1-2 for one line of n >= 3 points: (smoothed, [(k, c1, c2', sse_smooth, sse_raw)...])."""
    ys = isotonic(lats)
    fits = []
    for k in range(1, len(ws) - 1):
        _a, c1, c2, fitted = _two_segment(ws, ys, k)
        sse_s = sum((f - y) ** 2 for f, y in zip(fitted, ys))
        sse_r = sum((f - v) ** 2 for f, v in zip(fitted, lats))
        fits.append((k, c1, c1 + c2, sse_s, sse_r))
    return ys, fits


def _growth(ws: list, k: int, pre: float, post: float, sigma: float) -> float:
    s_n = sigma / (ws[k] - ws[0])
    return max(post, s_n) / max(pre, s_n)


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

    raw = []  # (axis, fixed, xs, lats, works, marginals, smoothed, fits)
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
        smooth, fits = _line_fit(ws, lats) if len(xs) >= 3 else (list(lats), [])
        raw.append((axis, fixed, xs, lats, ws, m, smooth, fits))

    # noise: pooled residuals of the raw latencies around each line's best-fitting break
    sse = dof = 0.0
    for *_, lats, _ws, _m, _smooth, fits in raw:
        if fits:
            best = min(fits, key=lambda f: f[3])
            sse += best[4]
            dof += len(lats) - 3
    lat_sorted = sorted(points.values())
    median = lat_sorted[len(lat_sorted) // 2]
    floor = REL_NOISE_FLOOR * median
    sigma = max(math.sqrt(sse / dof) if dof > 0 else 0.0, floor)
    if not sigma > 0:
        sigma = REL_NOISE_FLOOR * max(lat_sorted[-1], 1e-12)   # all-zero latencies

    lines: dict = {a: [] for a in AXES}
    best = None  # (growth, -work, -batch, axis, config)
    largest = None
    any_fit = False
    for axis, fixed, xs, lats, ws, m, smooth, fits in raw:
        g = tuple(float(_growth(ws, k, c1, c2p, sigma)) for k, c1, c2p, _s, _r in fits)
        knee = knee_g = slopes = None
        if fits:
            any_fit = True
            # smallest residual (9 significant digits, so float noise does not break ties), then larger growth
            j = min(range(len(fits)), key=lambda i: (float(f"{fits[i][3]:.9g}"), -g[i], i))
            k, c1, c2p = fits[j][0], float(fits[j][1]), float(fits[j][2])
            knee_g, slopes = g[j], (c1, c2p)
            rise = c2p * (ws[-1] - ws[k])
            largest = knee_g if largest is None else max(largest, knee_g)
            if knee_g >= min_growth and rise > Z_RISE * sigma:
                knee = xs[k]
                cfg = (fixed, xs[k]) if axis == "seqlen" else (xs[k], fixed)
                cand = (float(f"{knee_g:.9g}"), -ws[k], -cfg[0], axis, cfg)
                if best is None or cand[:3] > best[:3]:
                    best = cand
        lines[axis].append(LineKnee(axis, fixed, tuple(xs), tuple(lats), tuple(m), g, knee, knee_g,
                                    tuple(smooth), slopes))

    if not any_fit:
        return Knee(None, None, None, float(min_growth), lines, None)
    if best is None:
        return Knee(None, None, float(f"{largest:.9g}"), float(min_growth), lines, sigma)
    return Knee(best[4], best[3], best[0], float(min_growth), lines, sigma)  # growth: rounded to 9 digits
