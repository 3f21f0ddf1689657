"""Aggregation of profiler records and the printed table, in the style of torch.profiler's
``prof.key_averages().table(sort_by=..., row_limit=...)``.

``key_averages(records, group_by)`` groups the calls of a :class:`~.events.Records`:

- "module": by qualified module name (rows: Name, Type, Calls, GPU total, GPU avg, % of total);
- "kernel": by (kernel name, config) (adds Grid, Block, Regs, Smem, Occ %, TFLOP/s, GB/s,
  % of roofline; a launch dimension that differs between calls shows as "varies");
- "op": by the op the kernels ran for (Calls = launches; TFLOP/s, GB/s, % of roofline over
  the summed FLOPs, bytes and time).

"% of total" is against ``Records.total_gpu_ms`` when set (the measured window), else the sum of
the outermost module records (module) or of all kernel records (kernel, op); the footer says which.
Rates: TFLOP/s = FLOPs / time / 1e12, GB/s = bytes / time / 1e9, shown as "--" when the group
counted no FLOPs (bytes) (e.g. other libraries' kernels imported from torch.profiler); "% of roofline" = achieved /
attainable at the group's intensity (:func:`~.roofline.utilisation`) against the compute ceiling
of the group's dtype (read from the kernel configs; :meth:`~.ceilings.Ceilings.for_dtype`), and
the footer names the ceilings used.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from ..errors import ArgumentError
from ._util import integer
from .ceilings import config_dtype
from .roofline import utilisation

GROUPS = ("module", "kernel", "op")

#: sort keys: name -> (attribute, descending)
_SORT_COMMON = {
    "gpu_time_total": ("gpu_time_total_ms", True),
    "device_time_total": ("gpu_time_total_ms", True),   # torch.profiler's names, accepted as aliases
    "cuda_time_total": ("gpu_time_total_ms", True),
    "gpu_time_avg": ("gpu_time_avg_ms", True),
    "calls": ("count", True),
    "count": ("count", True),
    "pct_total": ("pct_of_total", True),
    "name": ("key", False),
}
_SORT_RATES = {
    "tflops": ("tflops", True),
    "gbps": ("gbps", True),
    "pct_roofline": ("pct_of_roofline", True),
    "flops": ("flops", True),
    "bytes": ("nbytes", True),
}


def sort_keys(group_by: str) -> tuple:
    """The ``sort_by`` values :meth:`KeyAverages.table` accepts for ``group_by``."""
    return tuple(_SORT_COMMON) + (tuple(_SORT_RATES) if group_by != "module" else ())


@dataclass(frozen=True)
class Average:
    """One row of :func:`key_averages`.

    key: module name / kernel name / op name; kind: module class name (module), config (kernel),
    "" (op); count: calls (launches for kernel/op); gpu_time_total_ms, gpu_time_avg_ms: ms;
    pct_of_total: % of the total (see module docstring), None when the total is 0; flops, nbytes:
    summed (0 for modules); tflops, gbps, pct_of_roofline: over the summed work and time (None for
    modules, zero time, or no ceilings for pct_of_roofline); grid, block, registers, smem_bytes,
    occupancy: the kernel's (kernel group; "varies" when calls differ; None otherwise);
    kernels: distinct (name, config) pairs (op group).
    """

    key: str
    kind: str
    count: int
    gpu_time_total_ms: float
    pct_of_total: Optional[float]
    flops: float = 0.0
    nbytes: float = 0.0
    tflops: Optional[float] = None
    gbps: Optional[float] = None
    pct_of_roofline: Optional[float] = None
    grid: object = None
    block: object = None
    registers: object = None
    smem_bytes: object = None
    occupancy: object = None
    kernels: Optional[int] = None

    @property
    def gpu_time_avg_ms(self) -> float:
        return self.gpu_time_total_ms / self.count if self.count else 0.0


def _same(values):
    vals = list(values)
    return vals[0] if all(v == vals[0] for v in vals) else "varies"


def key_averages(records, group_by: str = "module") -> "KeyAverages":
    """Aggregate ``records`` (:class:`~.events.Records`) by ``group_by`` ("module", "kernel", "op");
    rows in order of first appearance. Raises ArgumentError for another ``group_by`` or when
    ``records`` is not a Records (modules, kernels, ceilings)."""
    if not all(hasattr(records, a) for a in ("modules", "kernels", "ceilings", "total_gpu_ms")):
        raise ArgumentError(f"records: expected ferroattn.profiler Records (profile().records), got "
                            f"{type(records).__name__}")
    if group_by not in GROUPS:
        raise ArgumentError(f"group_by: expected one of {GROUPS}, got {group_by!r}")
    ceil = records.ceilings
    if group_by == "module":
        recs = list(records.modules)
        if records.total_gpu_ms is not None:
            total, total_src = float(records.total_gpu_ms), "measured window"
        else:
            top = min((r.depth for r in recs), default=0)
            total = sum(r.gpu_ms for r in recs if r.depth == top)
            total_src = "sum of the outermost modules"
        groups: dict = {}
        for r in recs:
            groups.setdefault(r.name, []).append(r)
        rows = []
        for name, rs in groups.items():
            t = sum(r.gpu_ms for r in rs)
            rows.append(Average(name, _same(r.kind for r in rs), len(rs), t, 100.0 * t / total if total > 0 else None))
        return KeyAverages(rows, group_by, total, total_src, ceil)

    recs = list(records.kernels)
    if records.total_gpu_ms is not None:
        total, total_src = float(records.total_gpu_ms), "measured window"
    else:
        total, total_src = sum(r.gpu_ms for r in recs), "sum of the kernels"
    groups = {}
    for r in recs:
        groups.setdefault((r.name, r.config) if group_by == "kernel" else r.op, []).append(r)
    rows = []
    for key, rs in groups.items():
        t = sum(r.gpu_ms for r in rs)
        fl = sum(r.flops for r in rs)
        nb = sum(r.nbytes for r in rs)
        # no counted work (e.g. torch's kernels imported without FLOPs/bytes): rate unknown, not 0
        tf = fl / (t * 1e-3) / 1e12 if t > 0 and fl > 0 else None
        gb = nb / (t * 1e-3) / 1e9 if t > 0 and nb > 0 else None
        pr = None
        if ceil is not None and t > 0 and nb > 0:
            dts = {config_dtype(r.config) for r in rs}
            pr = utilisation(fl, nb, t, ceil.for_dtype(dts.pop() if len(dts) == 1 else None)).pct_of_roofline
        pct = 100.0 * t / total if total > 0 else None
        if group_by == "kernel":
            rows.append(Average(key[0], key[1], len(rs), t, pct, fl, nb, tf, gb, pr,
                                _same(r.grid for r in rs), _same(r.block for r in rs),
                                _same(r.registers for r in rs), _same(r.smem_bytes for r in rs),
                                _same(r.occupancy for r in rs)))
        else:
            rows.append(Average(key, "", len(rs), t, pct, fl, nb, tf, gb, pr,
                                kernels=len({(r.name, r.config) for r in rs})))
    return KeyAverages(rows, group_by, total, total_src, ceil)


def _fmt_time(ms: float) -> str:
    if ms >= 1000.0:
        return f"{ms / 1000.0:.3f}s"
    if ms >= 1.0:
        return f"{ms:.3f}ms"
    return f"{ms * 1000.0:.3f}us"


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "--"
    if isinstance(v, str):
        return v
    if isinstance(v, tuple):
        return "x".join(str(x) for x in v)
    return format(v, spec)


def _fmt_occ(v) -> str:
    """Occupancy fraction -> percent text."""
    return _fmt(v) if v is None or isinstance(v, str) else f"{100.0 * v:.1f}"


def _trunc(s: str, width: int) -> str:
    return s if len(s) <= width else s[: max(0, width - 3)] + "..."


class KeyAverages(list):
    """The rows of :func:`key_averages` (a list of :class:`Average`), with ``group_by``,
    ``total_gpu_ms`` (ms), ``total_source`` and ``ceilings``."""

    def __init__(self, rows, group_by: str, total_gpu_ms: float, total_source: str, ceilings):
        super().__init__(rows)
        self.group_by = group_by
        self.total_gpu_ms = total_gpu_ms
        self.total_source = total_source
        self.ceilings = ceilings

    def sorted(self, sort_by: Optional[str] = None) -> list:
        """Rows sorted by ``sort_by`` (one of :func:`sort_keys`; None: order of first appearance).
        Descending except "name"; missing values (None, "varies") last."""
        if sort_by is None:
            return list(self)
        keys = sort_keys(self.group_by)
        if sort_by not in keys:
            raise ArgumentError(f"sort_by: expected one of {keys} for group_by={self.group_by!r}, got {sort_by!r}")
        attr, desc = {**_SORT_COMMON, **_SORT_RATES}[sort_by]
        have = [r for r in self if isinstance(getattr(r, attr), (int, float, str))]
        missing = [r for r in self if not isinstance(getattr(r, attr), (int, float, str))]
        return sorted(have, key=lambda r: getattr(r, attr), reverse=desc) + missing

    def top(self, n: int = 10, sort_by: str = "gpu_time_total") -> list:
        """The ``n`` first rows by ``sort_by`` (e.g. the hot layers)."""
        n = integer("n", n, 0)
        return self.sorted(sort_by)[:n]

    def table(self, sort_by: Optional[str] = None, row_limit: Optional[int] = 100,
              max_name_column_width: int = 55) -> str:
        """The rows as a fixed-width text table (torch.profiler's layout: dashed rules, header,
        rows, totals). sort_by: see :meth:`sorted`; row_limit: at most this many rows (None or -1:
        all; else an int >= 1). Raises ArgumentError naming a bad ``sort_by``/``row_limit``."""
        if row_limit is not None:
            if isinstance(row_limit, bool) or not isinstance(row_limit, numbers.Integral) \
                    or not (row_limit >= 1 or row_limit == -1):
                raise ArgumentError(f"row_limit: expected an int >= 1, -1 or None (all rows), got {row_limit!r}")
            row_limit = int(row_limit)
        max_name_column_width = integer("max_name_column_width", max_name_column_width, 4)
        rows = self.sorted(sort_by)
        shown = rows if row_limit in (None, -1) else rows[:row_limit]
        g = self.group_by
        if g == "module":
            header = ["Name", "Type", "Calls", "GPU total", "GPU avg", "% of total"]
            body = [[r.key, r.kind, str(r.count), _fmt_time(r.gpu_time_total_ms), _fmt_time(r.gpu_time_avg_ms),
                     _fmt(r.pct_of_total)] for r in shown]
        elif g == "kernel":
            header = ["Name", "Config", "Calls", "GPU total", "GPU avg", "% of total", "Grid", "Block", "Regs",
                      "Smem", "Occ %", "TFLOP/s", "GB/s", "% of roofline"]
            body = [[r.key, r.kind, str(r.count), _fmt_time(r.gpu_time_total_ms), _fmt_time(r.gpu_time_avg_ms),
                     _fmt(r.pct_of_total), _fmt(r.grid), _fmt(r.block), _fmt(r.registers, "d"),
                     _fmt(r.smem_bytes, "d"), _fmt_occ(r.occupancy),
                     _fmt(r.tflops, ".1f"), _fmt(r.gbps, ".1f"), _fmt(r.pct_of_roofline, ".1f")] for r in shown]
        else:
            header = ["Name", "Calls", "Kernels", "GPU total", "GPU avg", "% of total", "TFLOP/s", "GB/s",
                      "% of roofline"]
            body = [[r.key, str(r.count), str(r.kernels), _fmt_time(r.gpu_time_total_ms),
                     _fmt_time(r.gpu_time_avg_ms), _fmt(r.pct_of_total), _fmt(r.tflops, ".1f"), _fmt(r.gbps, ".1f"),
                     _fmt(r.pct_of_roofline, ".1f")] for r in shown]
        trunc_cols = (0, 1) if g == "kernel" else (0,)
        body = [[_trunc(c, max_name_column_width) if i in trunc_cols else c for i, c in enumerate(row)]
                for row in body]
        widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(header)]

        def line(cells):
            # names left-aligned, numbers right-aligned (as torch.profiler)
            left = (0, 1) if g != "op" else (0,)
            return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        rule = "  ".join("-" * w for w in widths)
        out = [rule, line(header), rule] + [line(r) for r in body] + [rule]
        out.append(f"GPU time total: {_fmt_time(self.total_gpu_ms)} ({self.total_source})")
        if len(shown) < len(rows):
            out.append(f"Rows shown: {len(shown)} of {len(rows)} (row_limit={row_limit})")
        if g != "module":
            out.append(self.ceilings.label() if self.ceilings is not None else
                       "% of roofline: no ceilings given (ferroattn.profiler.measure_ceilings())")
        return "\n".join(out) + "\n"

    def __str__(self) -> str:
        return self.table()
