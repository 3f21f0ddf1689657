"""2:4 sparse GEMM benchmark (``python -m ferroattn bench sparse24``): ``y = x @ w.T`` with w (n, k)
2:4 sparse, ours against torch dense (``F.linear``: cuBLAS) on the same pruned weight and torch's
semi-structured sparsity (``torch.sparse.to_sparse_semi_structured``: cuSPARSELt when torch has it,
else CUTLASS; the class that ran is recorded), in one process.

Grid (issue 4): bf16 and fp16; square m = n = k in 1024 .. 16384; LLM shapes m (tokens) in
16 .. 16384 with (n, k) in (4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096).
``--quick``: bf16, square 4096 and 8192, m in 16, 256, 4096 with (4096, 4096) and (11008, 4096).

For every point: our 2:4 kernel (``backend="sparse"``, the device's best kernel) and each explicit
kernel backend (``mma_sp``, ``wgmma_sp``; a refusal is recorded with its reason), our dispatcher
(``backend="auto"``, :data:`ferroattn.sparse24.DISPATCH_TABLE`), dense and the semi-structured
peer. Each is called once (output checked against dense), then all that ran are timed together by
:func:`timing.paired_ms` in ``--rounds`` (default 5) interleaved rounds: per round every function
gets one window in a forward pass (dense, sparse, mma_sp, wgmma_sp, wgmma_sp_direct, auto, peer)
and one in the reverse pass, each window a :func:`timing.bench_gpu` median (CUDA events, L2
cleared before each call) on rotating copies of x and of the weights; ``--rep-ms`` (default 100)
per function and point is split over its 2·rounds windows. This cancels the clock drift of the
power-capped H200 over a point (a linear drift exactly). ``ms`` = median over rounds of a
function's round time (mean of its two windows; ``ms_rounds`` / ``ms_windows`` kept), TFLOP/s
counted dense (2·m·n·k) at that ``ms``; every speedup (ours over dense and over the peer, auto over
dense, peer over dense) is the paired ratio of :func:`timing.paired_ratio` (median over rounds
of the per-round ratio), with its per-round values and interval under ``paired``; the relative
Frobenius error of ours and of the peer against dense (a guard against fast-but-wrong). Shapes
the peer refuses are recorded with torch's message.

Two timing passes (``--timing both``, the default; ``gpu`` or ``call`` for one of them):

- *per call* (``ms``, ``tflops``, the speedup keys above, ``paired``): the paired rounds of
  :func:`timing.paired_ms` just described. Host-inclusive: ``F.linear`` on torch's cuSPARSELt
  tensor costs ~0.5-1.4 ms of host time per call on the H200 (2026-11-30), more than the ~0.1 ms
  L2-clearing kernel that otherwise hides host time from the event timing, so on small shapes the
  peer's per-call time is that host floor.
- *GPU time only* (``gpu_ms``, ``gpu_tflops``, ``gpu_ms_rounds`` per function; ratios
  ``gpu_speedup_vs_dense``, ``gpu_speedup_vs_peer``, ``gpu_auto_vs_dense``, ``gpu_peer_vs_dense``
  with ``paired_gpu``): :func:`timing.paired_gpu_ms`, the same functions in the same paired
  rounds, each window behind a ``torch.cuda._sleep`` that covers the host time of its calls, with
  a validity check that can fail (a function whose windows never hold has ``gpu_ms`` None and the
  reason in ``gpu_error``; it is never reported as GPU time). ``--gpu-rep-ms`` (default 30,
  ``--quick`` 10) ms of calls per function and point.

The issue-4 target verdicts of the summary use the GPU-time ratios whenever the GPU-time pass ran
(``summary["basis"] == "gpu"``; per-call ratios otherwise); both are printed, the table has a
block of each. With ``--timing both`` the per-call pass defaults to ``--rep-ms`` 70 (``--quick``
20) instead of 100 (30) so that the run takes about as long as the per-call pass alone did.

Writes the raw JSON (device, driver, torch, commit, date: :func:`report.run_metadata`) into
``--out`` (default ``bench/results``) after every weight shape (a killed run keeps what it
measured), including ``dispatch_table``: the measured speedups of the sparse kernel over dense
(by GPU time where measured, else per call) in the format of ``ferroattn.sparse24.DISPATCH_TABLE``
(also printed as a Python literal to paste; ``ferroattn.sparse24.load_dispatch_table(json_path)``
loads it at run time). Exit 0 when ours was measured at every point, 1 otherwise, 2 for bad
arguments, 3 without torch/CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from ..knobs import override
from . import report, timing
from .attention import FATAL_MARKERS

DTYPES = ("bf16", "fp16")
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
SQUARE = (1024, 2048, 4096, 8192, 16384)
LLM_M = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LLM_NK = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
QUICK = dict(dtypes=("bf16",), square=(4096, 8192), m=(16, 256, 4096), nk=((4096, 4096), (11008, 4096)))
SHAPE_SETS = ("all", "square", "llm")
KERNELS = ("mma_sp", "wgmma_sp", "wgmma_sp_direct")  # explicit kernels, timed besides "sparse" (the best)
#: the default ``--rep-ms`` per timing mode and ``--gpu-rep-ms``: (full grid, ``--quick``)
DEFAULT_REP_MS, DEFAULT_GPU_REP_MS = timing.DEFAULT_REP_MS, timing.DEFAULT_GPU_REP
#: kernel columns that are a backend run under other tuning knobs (``ferroattn.knobs.override``, set
#: only while that column is timed): the same-process A/B of wgmma_sp's epilogue forms (clocks
#: drift between runs)
KERNEL_VARIANTS = {"wgmma_sp_direct": ("wgmma_sp", {"wgmma_sp_epilogue": "direct"})}
PEERS = ("dense", "semi_structured")
#: the large shapes of the issue's 1.3x-dense target: 8192^3 and LLM shapes with m >= 4096
LARGE_M = 4096
DEVICE = "cuda"   # one place (a CPU dry run of the logic can point it elsewhere)


def _parse_list(text: str | None, name: str, allowed: Sequence[str]) -> list[str] | None:
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{name}: expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
    return items


def grid(quick: bool = False, dtypes: Sequence[str] | None = None, shapes: str = "all") -> list[dict]:
    """The grid points (no measurements) in run order, grouped by (dtype, n, k). Raises ValueError
    for unknown dtypes or shape sets."""
    if shapes not in SHAPE_SETS:
        raise ValueError(f"--shapes: expected one of {','.join(SHAPE_SETS)}, got {shapes!r}")
    dts = tuple(dtypes) if dtypes else (QUICK["dtypes"] if quick else DTYPES)
    bad = [d for d in dts if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtypes: expected a subset of {','.join(DTYPES)}, got {','.join(dts)}")
    square = QUICK["square"] if quick else SQUARE
    ms, nks = (QUICK["m"], QUICK["nk"]) if quick else (LLM_M, LLM_NK)
    pts = []
    for dt in dts:
        if shapes in ("all", "square"):
            for s in square:
                pts.append({"dtype": dt, "kind": "square", "m": s, "n": s, "k": s, "flops": 2.0 * s * s * s})
        if shapes in ("all", "llm"):
            for n, k in nks:
                for m in ms:
                    pts.append({"dtype": dt, "kind": "llm", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k})
    return pts


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def _is_fatal(msg: str | None) -> bool:
    return bool(msg) and any(m.lower() in msg.lower() for m in FATAL_MARKERS)


def rel_err(y: Any, ref: Any) -> float:
    """||y - ref||_F / ||ref||_F in fp32."""
    d = (y.float() - ref.float()).norm()
    return float(d / ref.float().norm().clamp_min(1e-30))


def make_weights(n: int, k: int, dtype: str, count: int, with_peer: bool) -> tuple[list[dict], str | None, str | None]:
    """``count`` random 2:4 weights (n, k): dicts with ``dense`` (pruned), ``ours``
    (Sparse24Tensor) and ``peer`` (torch semi-structured, when it accepts the shape). Returns
    (weights, peer error or None, peer class name or None)."""
    import torch
    from ferroattn import sparse24
    dt = getattr(torch, TORCH_DTYPE[dtype])
    ws, peer_err, peer_cls = [], None, None
    for _ in range(count):
        w = sparse24.prune(torch.randn(n, k, device=DEVICE, dtype=dt))
        entry = {"dense": w, "ours": sparse24.compress(w), "peer": None}
        if with_peer and peer_err is None:
            try:
                entry["peer"] = torch.sparse.to_sparse_semi_structured(w)
                peer_cls = type(entry["peer"]).__name__
            except Exception as e:
                peer_err = _err(e)
        ws.append(entry)
    return ws, peer_err, peer_cls


class _Rot:
    """Call i uses x set i % len(xs) and weight i % len(ws)."""

    def __init__(self, xs: list, ws: list):
        self.xs, self.ws, self.i = xs, ws, 0

    def next(self) -> tuple[Any, dict]:
        i = self.i
        self.i += 1
        return self.xs[i % len(self.xs)], self.ws[i % len(self.ws)]


#: the paired ratios of a point: key -> (numerator function, denominator function); the key is
#: also the point's top-level key holding the ratio's median (``speedup_vs_dense`` = dense / ours)
RATIOS = {"speedup_vs_dense": ("dense", "ours"), "speedup_vs_peer": ("peer", "ours"),
          "auto_vs_dense": ("dense", "auto"), "peer_vs_dense": ("dense", "peer")}


def measure_point(p: dict, xs: list, ws: list, peer_err: str | None, peer_cls: str | None, rep_ms: float,
                  warmup_ms: float, kernels: Sequence[str] = KERNELS, rounds: int = timing.DEFAULT_ROUNDS,
                  timing_mode: str = "call", gpu_rep_ms: float = timing.DEFAULT_GPU_REP_MS,
                  gpu_device: Any = None) -> dict:
    """Fill ``p`` with timings (per function ``{"ms", "call_ms", "tflops", "ms_rounds",
    "ms_windows"}`` of the per-call pass and, with the GPU-time pass, ``gpu_ms``, ``gpu_tflops``,
    ``gpu_ms_rounds``, ``gpu_ms_windows``, ``gpu_error``, ``gpu_stats``; None when not measured),
    errors, speedups (paired ratios, see the module docstring; ``paired[key]`` / ``paired_gpu[key]``
    hold :func:`timing.paired_ratio`'s dict for every key of :data:`RATIOS` and
    ``"<kernel>_vs_dense"``, the top-level ``key`` / ``gpu_<key>`` their medians) and errors vs
    dense. ``rep_ms`` / ``warmup_ms``: ms per function of the per-call pass, split over the
    2·``rounds`` windows; ``gpu_rep_ms``: ms of calls per function of the GPU-time pass.
    ``timing_mode``: "call" (default here: the per-call pass only), "gpu" or "both"
    (:data:`timing.TIMING_MODES`); ``gpu_device``: the device object of the GPU-time pass (default
    :func:`timing.cuda_device`; tests pass a simulated one). ``dense_again`` is kept as None (the
    pairing replaced the second dense timing). ArgumentError for ``rounds`` not a positive int or
    an unknown ``timing_mode``."""
    import torch
    import torch.nn.functional as F
    from ferroattn import sparse24

    timing.check_rounds(rounds, "rounds")
    timing.check_timing_mode(timing_mode, "timing_mode")
    p.update(ours=None, ours_error=None, kernels={}, kernel_errors={}, auto=None, auto_choice=None, dense=None,
             dense_again=None, peer=None, peer_error=peer_err, peer_class=peer_cls, speedup_vs_dense=None,
             speedup_vs_peer=None,
             auto_vs_dense=None, peer_vs_dense=None, rel_err=None, peer_rel_err=None, skipped=None, paired={},
             timing=timing_mode, gpu_timed=False, gpu_errors={}, paired_gpu={},
             **{f"gpu_{key}": None for key in RATIOS})
    x0, w0 = xs[0], ws[0]
    ref = F.linear(x0, w0["dense"])
    fns: dict[str, Callable[[], Any]] = {}
    contexts: dict[str, Callable[[], Any]] = {}

    def first_call(name, fn, check=True, knobs=None):
        """One call on (x0, w0) (with tuning ``knobs`` set); returns the error vs dense; queues ``fn``
        for timing."""
        with override(**(knobs or {})):
            y = fn(x0, w0)
            torch.cuda.synchronize()
        err = rel_err(y, ref) if check else None
        del y
        rot = _Rot(xs, ws)
        fns[name] = lambda: fn(*rot.next())
        if knobs:
            contexts[name] = lambda: override(**knobs)
        return err

    try:
        first_call("dense", lambda x, w: F.linear(x, w["dense"]), check=False)
    except Exception as e:
        p["dense_error"] = _err(e)
    try:
        p["rel_err"] = first_call("ours", lambda x, w: sparse24.matmul(x, w["ours"], backend="sparse"))
    except Exception as e:
        p["ours_error"] = _err(e)
    if not _is_fatal(p["ours_error"]):
        for kb in kernels:
            backend, knobs = KERNEL_VARIANTS.get(kb, (kb, {}))
            try:
                err = first_call(f"kernel:{kb}", lambda x, w, b=backend: sparse24.matmul(x, w["ours"], backend=b),
                                 knobs=knobs)
                if kb in KERNEL_VARIANTS:
                    p.setdefault("kernel_rel_err", {})[kb] = err
            except Exception as e:
                p["kernels"][kb], p["kernel_errors"][kb] = None, _err(e)
        try:
            p["auto_choice"] = sparse24.choose_backend(p["m"], p["n"], p["k"], x0.dtype, x0.device)
            first_call("auto", lambda x, w: sparse24.matmul(x, w["ours"]), check=False)
        except Exception as e:
            p["auto_error"] = _err(e)
        if w0.get("peer") is not None:
            try:
                p["peer_rel_err"] = first_call("peer", lambda x, w: F.linear(x, w["peer"]))
            except Exception as e:
                p["peer"], p["peer_error"] = None, _err(e)
    if _is_fatal(p["ours_error"]) or not fns:
        return p
    two = timing.time_both(fns, timing_mode, rounds, rep_ms, warmup_ms, gpu_rep_ms, contexts, gpu_device, _err)
    err_key = {"dense": "dense_error", "ours": "ours_error", "auto": "auto_error", "peer": "peer_error"}
    for name, e in two.errors.items():
        if name.startswith("kernel:"):
            p["kernel_errors"][name.removeprefix("kernel:")] = e
        else:
            p[err_key[name]] = e
    p["gpu_timed"] = two.gpu is not None
    if two.gpu is not None:
        p["gpu_cycles_per_ms"] = two.gpu.cycles_per_ms
    for name, r in two.results.items():
        r["tflops"] = report.tflops(p["flops"], r["ms"]) if r.get("ms") else None
        if "gpu_ms" in r:
            r["gpu_tflops"] = report.tflops(p["flops"], r["gpu_ms"]) if r["gpu_ms"] else None
        if r.get("gpu_error"):
            p["gpu_errors"][name.removeprefix("kernel:")] = r["gpu_error"]
        if name.startswith("kernel:"):
            p["kernels"][name.removeprefix("kernel:")] = r
        else:
            p[name] = r
    p["kernels"] = {kb: p["kernels"].get(kb) for kb in kernels}
    pairs = dict(RATIOS, **{f"{kb}_vs_dense": ("dense", f"kernel:{kb}") for kb in kernels})
    for key, (num, den) in pairs.items():
        call, gpu = two.ratios(num, den)
        if call is not None:
            p["paired"][key] = call
            if key in RATIOS:
                p[key] = call["ratio"]
        if gpu is not None:
            p["paired_gpu"][key] = gpu
            if key in RATIOS:
                p[f"gpu_{key}"] = gpu["ratio"]
    return p


def progress_line(p: dict) -> str:
    """One point's progress line: ours TFLOP/s and the ratios over dense and the peer, by GPU time
    (with the peer ratio's interval) and per call, "inv" where a GPU time did not hold."""
    parts = []
    errs = p.get("gpu_errors") or {}
    if p.get("gpu_timed"):
        ci = (p.get("paired_gpu") or {}).get("speedup_vs_peer", {}).get("ratio_ci")
        peer = "inv" if ("peer" in errs or "ours" in errs) else _f(p.get("gpu_speedup_vs_peer"), ".3f")
        parts.append(f"GPU time: ours {_f((p.get('ours') or {}).get('gpu_tflops'), '.1f')} TFLOP/s, x dense "
                     f"{'inv' if ('dense' in errs or 'ours' in errs) else _f(p.get('gpu_speedup_vs_dense'), '.3f')}, "
                     f"x peer {peer}" + (" [{:.3f}, {:.3f}]".format(*ci) if ci else ""))
    if p.get("timing", "call") != "gpu":
        ci = (p.get("paired") or {}).get("speedup_vs_peer", {}).get("ratio_ci")
        parts.append(f"per call: ours {_f((p.get('ours') or {}).get('tflops'), '.1f')} TFLOP/s, "
                     f"x dense {_f(p.get('speedup_vs_dense'), '.3f')}, x peer {_f(p.get('speedup_vs_peer'), '.3f')}"
                     + (" [{:.3f}, {:.3f}]".format(*ci) if ci else ""))
    return "; ".join(parts)


def dispatch_table(points: Sequence[dict], arch: str) -> dict:
    """``{arch: {dtype: {"n,k": [[rows, speedup of the sparse kernel over dense], ...]}}}`` from the
    measured points (the format of ``ferroattn.sparse24.set_dispatch_table``): the GPU-time speedup
    where the point has one (how the table in ferroattn/sparse24/dispatch.py is measured),
    else the per-call one (``--timing call``, or a GPU time that did not hold)."""
    out: dict = {}
    for p in points:
        s = p.get("gpu_speedup_vs_dense")
        if s is None:
            s = p.get("speedup_vs_dense")
        if s is None:
            continue
        by_shape = out.setdefault(arch, {}).setdefault(TORCH_DTYPE[p["dtype"]], {})
        by_shape.setdefault(f"{p['n']},{p['k']}", []).append([p["m"], round(float(s), 4)])
    for by_dtype in out.values():
        for by_shape in by_dtype.values():
            for pts in by_shape.values():
                pts.sort()
    return out


def dispatch_literal(table: dict) -> str:
    """The Python literal of DISPATCH_TABLE for ``table`` (to paste into ferroattn/sparse24/dispatch.py)."""
    lines = ["DISPATCH_TABLE = {"]
    for arch, by_dtype in table.items():
        lines.append(f"    {arch!r}: {{")
        for dt, by_shape in by_dtype.items():
            lines.append(f"        {dt!r}: {{")
            for nk, pts in by_shape.items():
                n, k = nk.split(",")
                lines.append(f"            ({n}, {k}): ({', '.join(f'({r}, {s})' for r, s in pts)},),")
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def summarize(points: Sequence[dict]) -> dict:
    """The issue-4 targets: ours >= 1.3x dense on 8192^3 and the LLM shapes with m >= 4096; >= 1.0x
    the semi-structured peer everywhere it runs; the dispatcher never below 0.95x dense.
    ``basis``: "gpu" when the GPU-time pass ran at some point (the targets then use the GPU-time
    ratios ``gpu_<key>``; a point without one -- its GPU time invalid -- counts as not measured,
    never replaced by its per-call ratio), else "call" (the per-call ratios ``<key>``).
    ``below[target]``: on the basis, how many points have a ratio below the goal (``n_below``) and
    how many of them have the whole paired interval (``ratio_ci``) below it (``n_ci_below``);
    ``rounds``: the sorted distinct numbers of paired rounds behind the ratios (empty when none).
    The ``speedup_*`` / ``auto_*`` / ``peer_*`` statistics are per call (host-inclusive);
    ``gpu`` holds the same statistics on GPU time (None without the GPU-time pass);
    ``gpu_invalid``: "<function> at <point>: <reason>" for every function whose GPU time did not
    hold (first 20; ``n_gpu_invalid`` counts all)."""
    basis = "gpu" if any(p.get("gpu_timed") for p in points) else "call"
    pre = "gpu_" if basis == "gpu" else ""
    paired_key = "paired_gpu" if basis == "gpu" else "paired"

    def vals(key, pred=lambda p: True):
        return [p[key] for p in points if p.get(key) is not None and pred(p)]

    def large(p):
        return (p["kind"] == "square" and p["m"] == 8192) or (p["kind"] == "llm" and p["m"] >= LARGE_M)

    def stats(xs):
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else None

    def below(key, goal, pred=lambda p: True):
        sel = [p for p in points if p.get(pre + key) is not None and pred(p) and p[pre + key] < goal]
        ci = [((p.get(paired_key) or {}).get(key) or {}).get("ratio_ci") for p in sel]
        return {"goal": goal, "n_below": len(sel), "n_ci_below": sum(1 for c in ci if c and c[1] < goal)}

    def ratio_stats(prefix):   # the ratio statistics of one timing ("gpu_" or "" = per call)
        return {"speedup_vs_dense_large": stats(vals(prefix + "speedup_vs_dense", large)),
                "speedup_vs_dense_all": stats(vals(prefix + "speedup_vs_dense")),
                "speedup_vs_peer_all": stats(vals(prefix + "speedup_vs_peer")),
                "speedup_vs_peer_large": stats(vals(prefix + "speedup_vs_peer", large)),
                "auto_vs_dense_all": stats(vals(prefix + "auto_vs_dense")),
                "peer_vs_dense_large": stats(vals(prefix + "peer_vs_dense", large)),
                "peer_vs_dense_all": stats(vals(prefix + "peer_vs_dense"))}

    invalid = [f"{name} at {p['dtype']} m={p['m']} n={p['n']} k={p['k']}: {why}"
               for p in points for name, why in (p.get("gpu_errors") or {}).items()]
    gpu = None if basis == "call" else ratio_stats("gpu_")
    return {
        "basis": basis,
        "rounds": sorted({len(r["ratio_rounds"]) for p in points for r in (p.get(paired_key) or {}).values()}),
        "below": {"vs_dense_large": below("speedup_vs_dense", 1.3, large),
                  "vs_peer_min": below("speedup_vs_peer", 1.0),
                  "auto_vs_dense_min": below("auto_vs_dense", 0.95)},
        "gpu": gpu,
        "n_gpu_invalid": len(invalid),
        "gpu_invalid": invalid[:20],
        "n_points": len(points),
        "n_measured": sum(1 for p in points if (p.get("ours") or {}).get("ms") is not None
                          or (p.get("ours") or {}).get("gpu_ms") is not None),
        "n_ours_failed": sum(1 for p in points if p.get("ours_error")),
        "n_skipped": sum(1 for p in points if p.get("skipped")),
        "peer_refused": sorted({f"{p['n']}x{p['k']} m={p['m']} {p['dtype']}" for p in points if p.get("peer_error")}),
        **ratio_stats(""),
        "max_rel_err": max(vals("rel_err"), default=None),
        "targets": {"vs_dense_large": 1.3, "vs_peer_min": 1.0, "auto_vs_dense_min": 0.95},
    }


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(points: Sequence[dict]) -> str:
    """One row per point. With GPU-time data at some point, a "GPU time only" block first (ours
    ms, TFLOP/s; dense and peer TFLOP/s; ours over dense, over the peer; auto over dense: the
    target ratios), then the "per call" block (host-inclusive) as before; "inv" marks a GPU time
    that did not hold (see ``gpu_errors``)."""
    with_gpu = any(p.get("gpu_timed") for p in points)
    gpu_head = (f"GPU-only: {'ours ms':>9} {'TFLOP/s':>8} {'dense':>7} {'peer':>7} {'x dense':>7} {'x peer':>7} "
                f"{'auto xd':>7} | per call: ") if with_gpu else ""
    head = (f"{'dtype':5} {'m':>6} {'n':>6} {'k':>6} | {gpu_head}{'ours ms':>9} {'TFLOP/s':>8} | {'dense':>8} "
            f"{'peer':>8} | {'x dense':>7} {'x peer':>7} {'auto':>5} {'x dense':>7} | rel_err")
    rows = [head, "-" * len(head)]

    for p in points:
        o = p.get("ours") or {}
        dense, peer = (p.get("dense") or {}).get("tflops"), (p.get("peer") or {}).get("tflops")
        gpu = ""
        if with_gpu:
            errs = p.get("gpu_errors") or {}

            def gv(name, key, fmt):
                if name in errs:
                    return "inv"
                return _f((p.get(name) or {}).get(key), fmt)

            def gr(key, names):
                if any(n in errs for n in names):
                    return "inv"
                return _f(p.get(f"gpu_{key}"), "7.3f")
            gpu = (f"{'':9} {gv('ours', 'gpu_ms', '9.4f'):>9} {gv('ours', 'gpu_tflops', '8.1f'):>8} "
                   f"{gv('dense', 'gpu_tflops', '7.1f'):>7} {gv('peer', 'gpu_tflops', '7.1f'):>7} "
                   f"{gr('speedup_vs_dense', ('ours', 'dense')):>7} {gr('speedup_vs_peer', ('ours', 'peer')):>7} "
                   f"{gr('auto_vs_dense', ('auto', 'dense')):>7} | {'':10}")
        rows.append(
            f"{p['dtype']:5} {p['m']:>6} {p['n']:>6} {p['k']:>6} | {gpu}{_f(o.get('ms'), '9.4f')} "
            f"{_f(o.get('tflops'), '8.1f')} | {_f(dense, '8.1f')} {_f(peer, '8.1f')} "
            f"| {_f(p.get('speedup_vs_dense'), '7.3f')} {_f(p.get('speedup_vs_peer'), '7.3f')} "
            f"{(p.get('auto_choice') or '-')[:5]:>5} {_f(p.get('auto_vs_dense'), '7.3f')} "
            f"| {_f(p.get('rel_err'), '.1e')}"
            + (f"  [{p['skipped'][:60]}]" if p.get("skipped") else "")
            + (f"  [ours: {p['ours_error'][:80]}]" if p.get("ours_error") else ""))
    return "\n".join(rows)


def format_summary(s: dict) -> str:
    def st(x):
        return "n/a" if not x else f"min {x['min']:.3f} median {x['median']:.3f} max {x['max']:.3f} (n={x['n']})"

    def bl(key):
        b = (s.get("below") or {}).get(key)
        return (f"; {b['n_below']} points below {b['goal']}, {b['n_ci_below']} of them with the whole interval "
                f"below" if b and b["n_below"] else "")
    lines = [f"points {s['n_points']}, measured {s['n_measured']}, ours failed {s['n_ours_failed']}, "
             f"skipped {s['n_skipped']}"]
    if s.get("rounds"):
        lines.append(f"speedups: per point the median of {'/'.join(map(str, s['rounds']))} paired rounds (dense, "
                     f"ours, kernels, auto and peer interleaved, forward and reverse pass per round)")
    g = s.get("gpu")
    if s.get("basis") == "gpu" and g is not None:
        lines += ["GPU time only (stream pre-filled by a sleep covering the host time; the target verdicts):",
                  f"  ours / dense, 8192^3 + LLM m>={LARGE_M} (target >= 1.3): {st(g['speedup_vs_dense_large'])}"
                  + bl("vs_dense_large"),
                  f"  ours / dense, all: {st(g['speedup_vs_dense_all'])}",
                  f"  ours / semi-structured peer, all (target >= 1.0): {st(g['speedup_vs_peer_all'])}"
                  + bl("vs_peer_min"),
                  f"  ours / semi-structured peer, large: {st(g['speedup_vs_peer_large'])}",
                  f"  auto / dense, all (target >= 0.95): {st(g['auto_vs_dense_all'])}" + bl("auto_vs_dense_min"),
                  f"  peer / dense, large: {st(g['peer_vs_dense_large'])}; all: {st(g['peer_vs_dense_all'])}"]
        if s.get("n_gpu_invalid"):
            lines.append(f"  GPU time did not hold (host-bound even behind the longest sleep; not reported) for "
                         f"{s['n_gpu_invalid']} function-points, e.g. {s['gpu_invalid'][:2]}")
        lines += ["per call (host-inclusive: CUDA events around each call after an L2 flush; not the verdicts):",
                  f"  ours / dense, 8192^3 + LLM m>={LARGE_M}: {st(s['speedup_vs_dense_large'])}",
                  f"  ours / dense, all: {st(s['speedup_vs_dense_all'])}",
                  f"  ours / semi-structured peer, all: {st(s['speedup_vs_peer_all'])} [on small shapes the peer's "
                  f"~0.5-1.4 ms host floor per F.linear]",
                  f"  ours / semi-structured peer, large: {st(s.get('speedup_vs_peer_large'))}",
                  f"  auto / dense, all: {st(s['auto_vs_dense_all'])}",
                  f"  peer / dense, large: {st(s['peer_vs_dense_large'])}",
                  f"max rel err vs dense: {_f(s['max_rel_err'], '.2e')}"]
        if s["peer_refused"]:
            lines.append(f"peer refused {len(s['peer_refused'])} points, e.g. {s['peer_refused'][:3]}")
        return "\n".join(lines)
    lines += [f"ours / dense, 8192^3 + LLM m>={LARGE_M} (target >= 1.3): {st(s['speedup_vs_dense_large'])}"
              + bl("vs_dense_large"),
              f"ours / dense, all: {st(s['speedup_vs_dense_all'])}",
              f"ours / semi-structured peer, all (target >= 1.0): {st(s['speedup_vs_peer_all'])}" + bl("vs_peer_min")
              + " [per-call times: on small shapes the peer's ~0.5-1.4 ms host floor per F.linear, not its GPU time]",
              f"ours / semi-structured peer, large: {st(s.get('speedup_vs_peer_large'))}",
              f"auto / dense, all (target >= 0.95): {st(s['auto_vs_dense_all'])}" + bl("auto_vs_dense_min"),
              f"peer / dense, large: {st(s['peer_vs_dense_large'])}",
              f"max rel err vs dense: {_f(s['max_rel_err'], '.2e')}"]
    if s["peer_refused"]:
        lines.append(f"peer refused {len(s['peer_refused'])} points, e.g. {s['peer_refused'][:3]}")
    return "\n".join(lines)


def run_grid(quick: bool = False, out_dir: str = "bench/results", dtypes: Sequence[str] | None = None,
             shapes: str = "all", rep_ms: float | None = None, time_budget_s: float | None = None,
             peers: Sequence[str] = PEERS, printer: Callable[[str], None] = print,
             rounds: int = timing.DEFAULT_ROUNDS, timing_mode: str = "both",
             gpu_rep_ms: float | None = None) -> tuple[dict, int]:
    """Run the benchmark; return (result dict, exit code). Needs a CUDA GPU. ``rep_ms``: per-call
    pass budget per function and point (ms; default :data:`DEFAULT_REP_MS` of ``timing_mode``),
    split over ``rounds`` paired rounds; ``gpu_rep_ms``: GPU-time pass, ms of calls per function
    and point (default 30, quick 10); ``timing_mode``: both (default), gpu or call
    (:func:`measure_point`). ArgumentError for ``rounds`` not a positive int or a bad
    ``timing_mode``."""
    timing.check_rounds(rounds, "rounds")
    timing.check_timing_mode(timing_mode, "timing_mode")
    import torch

    t0 = time.monotonic()
    rep = rep_ms if rep_ms is not None else DEFAULT_REP_MS[timing_mode][1 if quick else 0]
    gpu_rep = gpu_rep_ms if gpu_rep_ms is not None else DEFAULT_GPU_REP_MS[1 if quick else 0]
    warm = min(25.0, rep / 2)
    points = grid(quick, dtypes, shapes)
    meta = report.run_metadata()
    l2 = meta.get("l2_bytes") or 50 * 2**20
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    try:
        import torch.backends.cusparselt as cslt
        meta["cusparselt_version"] = cslt.version() if cslt.is_available() else None
    except Exception:
        meta["cusparselt_version"] = None
    printer(f"device {meta.get('device')} | driver {meta.get('driver')} | torch {meta.get('torch')} | cuSPARSELt "
            f"{meta.get('cusparselt_version')} | commit {meta.get('commit')} | {len(points)} points | "
            f"timing ({timing_mode}): " + " | ".join(timing.pass_names(timing_mode, rounds, gpu_rep)))
    cycles = None

    def result(partial: bool) -> dict:
        return {"meta": meta, "partial": partial,
                "config": {"quick": quick, "shapes": shapes, "rep_ms": rep, "warmup_ms": warm, "rounds": rounds,
                           "window_rep_ms": rep / (2 * rounds), "window_warmup_ms": warm / (2 * rounds),
                           "order": "per round: " + " ".join(timing.round_order(
                               ["dense", "ours", *KERNELS, "auto", *(["peer"] if "semi_structured" in peers else [])])),
                           "timing": timing.method_name(rounds), "timing_mode": timing_mode,
                           "gpu_rep_ms": gpu_rep if timing_mode != "call" else None,
                           "gpu_timing": timing.gpu_method_name(rounds, gpu_rep) if timing_mode != "call" else None,
                           "sleep_cycles_per_ms": cycles,
                           "peers": list(peers), "kernels": list(KERNELS),
                           "flops": "2*m*n*k (dense count)", "time_budget_s": time_budget_s,
                           "elapsed_s": time.monotonic() - t0},
                "points": points, "summary": summarize(points), "dispatch_table": dispatch_table(points, arch)}

    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["dtype"], p["n"], p["k"]), []).append(p)
    fatal = None
    for (dt, n, k), pts in groups.items():
        if fatal or (time_budget_s is not None and time.monotonic() - t0 > time_budget_s):
            for p in pts:
                p["skipped"] = fatal or f"time budget of {time_budget_s:.0f} s used up"
            continue
        try:
            ws, peer_err, peer_cls = make_weights(n, k, dt, timing.rotation_count(n * k * 2, l2, cap=3),
                                                  "semi_structured" in peers)
        except Exception as e:
            for p in pts:
                p["skipped"] = f"weights: {_err(e)}"
            fatal = fatal or (f"skipped after a fatal CUDA error: {_err(e)}" if _is_fatal(str(e)) else None)
            continue
        for p in pts:
            try:
                dtype = getattr(torch, TORCH_DTYPE[dt])
                xs = [torch.randn(p["m"], k, device=DEVICE, dtype=dtype)
                      for _ in range(timing.rotation_count(p["m"] * k * 2, l2, cap=4))]
            except Exception as e:
                p["skipped"] = f"inputs: {_err(e)}"
                continue
            measure_point(p, xs, ws, peer_err, peer_cls, rep, warm, rounds=rounds, timing_mode=timing_mode,
                          gpu_rep_ms=gpu_rep)
            cycles = p.get("gpu_cycles_per_ms") or cycles
            if _is_fatal(p.get("ours_error")):
                fatal = f"skipped after a fatal CUDA error in ours: {p['ours_error'][:200]}"
            printer(f"  {dt} m={p['m']} n={n} k={k}: " + progress_line(p))
            del xs
        del ws
        torch.cuda.empty_cache()
        report.write_json(result(partial=True), out_dir, kind="sparse24")
    final = result(partial=False)
    path = report.write_json(final, out_dir, kind="sparse24")
    printer(format_table(points))
    printer(f"raw JSON: {path}")
    printer(format_summary(final["summary"]))
    printer("dispatch table measured here (paste into python/ferroattn/sparse24/dispatch.py, or "
            "sparse24.load_dispatch_table(json_path)):\n" + dispatch_literal(final["dispatch_table"]))
    s = final["summary"]
    return final, (0 if s["n_ours_failed"] == 0 and s["n_measured"] > 0 else 1)


def _int_arg(opt: str) -> Callable[[str], int]:
    def conv(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{opt}: expected a positive integer, got {text!r}") from None
    return conv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench sparse24``."""
    parser.add_argument("--quick", action="store_true",
                        help="a reduced grid: bf16, square 4096 and 8192, m in 16, 256, 4096 with (n, k) "
                             "(4096, 4096) and (11008, 4096) (8 points)")
    parser.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")
    parser.add_argument("--dtypes", default=None, help="comma-separated subset of bf16,fp16")
    parser.add_argument("--shapes", default="all", help="all (default), square or llm")
    parser.add_argument("--rep-ms", type=float, default=None,
                        help="per-call pass: timing budget per function and point (ms), split over the rounds "
                             "(default 100, --quick 30 with --timing call; 70 / 20 with both or gpu)")
    parser.add_argument("--timing", choices=timing.TIMING_MODES, default="both",
                        help="both (default): GPU time only (the target verdicts) and per call (host-inclusive); "
                             "gpu or call: one of them")
    parser.add_argument("--gpu-rep-ms", type=float, default=None,
                        help="GPU-time pass: ms of calls per function and point, split over the rounds "
                             "(default 30, --quick 10)")
    parser.add_argument("--rounds", type=_int_arg("--rounds"), default=timing.DEFAULT_ROUNDS,
                        help="paired rounds per point: dense, ours, the kernels, auto and the peer timed "
                             "interleaved, a forward and a reverse pass per round; speedups = median over "
                             f"rounds of the per-round ratio (default {timing.DEFAULT_ROUNDS})")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop measuring new weight shapes after this many seconds (rest recorded as skipped)")
    parser.add_argument("--no-semi-structured", action="store_true",
                        help="skip torch's semi-structured (cuSPARSELt) peer; dense cuBLAS is always timed")


def check_args(args: argparse.Namespace, prog: str = "ferroattn bench sparse24") -> tuple[int | None, dict]:
    """Validate ``args`` before touching the GPU. Returns (exit code or None to go on, kwargs of
    :func:`run_grid`). Messages go to stderr."""
    try:
        dtypes = _parse_list(args.dtypes, "--dtypes", DTYPES)
        peers = ["dense"] if args.no_semi_structured else list(PEERS)
        grid(args.quick, dtypes, args.shapes)
        if args.rep_ms is not None and not 0 < args.rep_ms < float("inf"):
            raise ValueError(f"--rep-ms: expected a positive number, got {args.rep_ms}")
        if args.gpu_rep_ms is not None and not 0 < args.gpu_rep_ms < float("inf"):
            raise ValueError(f"--gpu-rep-ms: expected a positive number, got {args.gpu_rep_ms}")
        if args.time_budget_s is not None and not 0 < args.time_budget_s < float("inf"):
            raise ValueError(f"--time-budget-s: expected a positive number, got {args.time_budget_s}")
        timing.check_rounds(args.rounds, "--rounds")
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2, {}
    kwargs = dict(quick=args.quick, out_dir=args.out, dtypes=dtypes, shapes=args.shapes, rep_ms=args.rep_ms,
                  time_budget_s=args.time_budget_s, peers=peers, rounds=args.rounds, timing_mode=args.timing,
                  gpu_rep_ms=args.gpu_rep_ms)
    code = report.cannot_run(prog)
    if code is not None:
        return code, kwargs
    return None, kwargs


def run(args: argparse.Namespace) -> int:
    """Entry point of ``python -m ferroattn bench sparse24`` (args from :func:`add_arguments`)."""
    code, kwargs = check_args(args)
    if code is not None:
        return code
    _, code = run_grid(**kwargs)
    return code
