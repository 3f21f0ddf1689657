"""Dense GEMM benchmark: ``ferroattn.matmul`` per backend against ``torch.matmul`` (cuBLAS).

Grid (issue 4): bf16 and fp16; square m = n = k in 1024, 2048, 4096, 8192, 16384; LLM shapes
m = tokens 16, 32, ..., 16384 with (n, k) in (4096, 4096), (11008, 4096), (4096, 11008),
(14336, 4096). ``--quick``: square 4096 and 8192, m = 16 and 4096, bf16 only.

Operands: ``a`` (m, k) row-major and ``b = w.T`` with ``w`` (n, k) row-major -- the
``nn.Linear`` layout; ``--layout nn`` uses a row-major (k, n) ``b`` instead. Both sides get the same
tensors. Two kinds of point per shape:

- ``matmul``: ``ferroattn.matmul(a, b, backend=X)`` vs ``torch.matmul(a, b)``;
- ``epilogue`` (per ``--activations``, default gelu): ``ferroattn.matmul(a, b, bias=bias,
  activation=act, backend=X)`` (one fused kernel) vs torch's unfused equivalent
  ``act(torch.addmm(bias, a, b))`` (what ``nn.Linear`` + the activation module run).

Backends X: "wmma", "sm90" and "auto" where the GPU supports them (``_native.gemm_backends``); an
explicit backend that cannot run a problem is recorded as null with the reason. For "auto" the
backend that ran is recorded. Timing: the peer and every backend of a point are timed together by
:func:`timing.paired_ms` in ``--rounds`` (default 5) interleaved rounds, each function once in a
forward and once in a reverse pass per round (peer, wmma, sm90, auto, auto, sm90, wmma, peer),
every window a :func:`timing.bench_gpu` median (CUDA events, L2 cleared before each call) on
rotating copies of the inputs (>= 3x L2 together); ``--rep-ms`` (default 100) per function and
point is split evenly over its 2·rounds windows. Per function ``ms`` = median over rounds of its
round time and TFLOP/s from 2·m·n·k at that ``ms``; per backend ``ratio`` = median over rounds of
(peer round time / ours round time) (:func:`timing.paired_ratio`: clock drift on the power-capped
H200 moves both sides of a round alike), with ``ratio_rounds``, ``ratio_min`` / ``ratio_max`` and
``ratio_ci`` (distribution-free interval of the median; coverage ``ratio_ci_level``, 0.9375 for 5
rounds), plus ``ms_rounds`` / ``ms_windows`` of every function. Also % of the measured matmul
ceiling of the dtype (:func:`ceilings.matmul_tflops`, cuBLAS 8192³), and
``rel_err`` = max|ours − peer| / max|peer| against the peer's output (a guard against
fast-but-wrong; > 2e-2 is flagged ``suspect``).

Two timing passes (``--timing both``, the default; ``gpu`` or ``call`` for one): the paired
*per-call* pass just described (host-inclusive: when a call's host time exceeds the L2 flush's GPU
time, the events see host time), and a paired *GPU-time-only* pass,
:func:`timing.paired_gpu_ms`: the same functions in the same rounds, each window behind a
``torch.cuda._sleep`` that covers the host time of its calls, with a validity check that can fail
(a function whose windows never hold has ``gpu_ms`` None and the reason in ``gpu_error``; never
reported as GPU time). Per function ``gpu_ms``, ``gpu_tflops``, ``gpu_ms_rounds``; per backend
``gpu_ratio`` (median over rounds of peer / ours by GPU time), ``gpu_paired`` (its
:func:`timing.paired_ratio` dict) and ``gpu_pct_ceiling``. The summary's target verdicts use the
GPU-time ratios whenever that pass ran (``summary["basis"] == "gpu"``; the per-call verdicts stay
in ``targets_call``); the table has per-call columns (``x<backend>``) and GPU-time columns
(``gpu x<backend>``, ``inv`` where a GPU time did not hold). ``--gpu-rep-ms`` (default 30,
``--quick`` 10): ms of calls per function and point; with the GPU-time pass the per-call pass
defaults to ``--rep-ms`` 70 (``--quick`` 20) so that a run takes about as long as before.

Also the host cost of one decode-sized call
(m = 16, 4096 x 4096, bf16). Raw JSON (``gemm_<device>_<date>.json``: device, driver, torch,
commit, date) to ``--out`` (default ``bench/results``), rewritten after each shape so a killed
run keeps what it measured; the table, then the summary against the issue's targets. Exit 0 when
"auto" was measured at every point, 1 when it failed somewhere, 2 for bad arguments, 3 without a
CUDA GPU.

CLI: ``python -m ferroattn bench gemm`` (:func:`add_arguments` / :func:`run`). Importing this
module does not import torch.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from . import report, timing

SQUARE = (1024, 2048, 4096, 8192, 16384)
LLM_NK = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
LLM_M = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("bf16", "fp16")
BACKENDS = ("wmma", "sm90", "auto")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
DEFAULT_ACTIVATIONS = ("gelu",)
LAYOUTS = ("linear", "nn")
SUITES = ("square", "llm")
QUICK = dict(square=(4096, 8192), llm_m=(16, 4096), dtypes=("bf16",))
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}

#: Issue 4 targets (ratios ours/peer) on the target shapes (square >= 4096, LLM m >= 4096).
TARGETS = {"sm90": 0.95, "wmma": 0.5}
#: The fused epilogue's target (matmul + bias + activation vs ``act(torch.addmm)``, auto backend): the
#: median over the target shapes at least :data:`EPILOGUE_MEDIAN_TARGET`, no target shape below
#: :data:`EPILOGUE_TARGET`. torch's separate activation pass costs only ~6 % of the GEMM there, so a
#: fused epilogue can gain little more than parity.
EPILOGUE_MEDIAN_TARGET = 1.0
EPILOGUE_TARGET = 0.95
TARGET_MIN_SIZE = 4096
SUSPECT_REL_ERR = 2e-2
FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "illegal instruction",
                 "misaligned address", "CUDA_ERROR_ILLEGAL", "CUDA_ERROR_LAUNCH_FAILED")


# ---- grid -------------------------------------------------------------------------------
def grid(quick: bool = False, dtypes: Sequence[str] | None = None, suites: Sequence[str] | None = None,
         sizes: Sequence[int] | None = None, ms: Sequence[int] | None = None,
         activations: Sequence[str] | None = None) -> list[dict]:
    """The grid points (without measurements), in run order: per dtype, per shape, the matmul
    point then one epilogue point per activation. ValueError (naming the option) for values
    outside the issue's grid."""
    dts = tuple(dtypes) if dtypes else (QUICK["dtypes"] if quick else DTYPES)
    _subset("--dtypes", dts, DTYPES)
    sts = tuple(suites) if suites else SUITES
    _subset("--suites", sts, SUITES)
    sq = tuple(sizes) if sizes else (QUICK["square"] if quick else SQUARE)
    _positive("--sizes", sq)
    llm_m = tuple(ms) if ms else (QUICK["llm_m"] if quick else LLM_M)
    _positive("--ms", llm_m)
    acts = tuple(activations) if activations is not None else DEFAULT_ACTIVATIONS
    _subset("--activations", acts, ACTIVATIONS, allow_empty=True)
    shapes: list[tuple[str, int, int, int]] = []
    if "square" in sts:
        shapes += [("square", s, s, s) for s in sq]
    if "llm" in sts:
        shapes += [("llm", m, n, k) for n, k in LLM_NK for m in llm_m]
    pts = []
    for dt in dts:
        for suite, m, n, k in shapes:
            for act in (None, *acts):
                pts.append({"dtype": dt, "suite": suite, "kind": "matmul" if act is None else "epilogue",
                            "activation": act, "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k})
    return pts


def _subset(opt: str, values: Sequence[str], allowed: Sequence[str], allow_empty: bool = False) -> None:
    bad = [v for v in values if v not in allowed]
    if bad or not (values or allow_empty):
        raise ValueError(f"{opt}: expected a {'' if allow_empty else 'non-empty '}subset of {','.join(allowed)}, "
                         f"got {','.join(values) or '(empty)'}")


def _positive(opt: str, values: Sequence[int]) -> None:
    if not values or any((not isinstance(v, int)) or v <= 0 for v in values):
        raise ValueError(f"{opt}: expected positive integers, got {list(values)}")


def is_target_shape(p: dict) -> bool:
    """The shapes the issue's targets are stated on: square 4096..16384 and LLM shapes with m >= 4096."""
    return p["m"] >= TARGET_MIN_SIZE and (p["suite"] == "llm" or p["n"] >= TARGET_MIN_SIZE)


# ---- measurement ------------------------------------------------------------------------
def make_inputs(m: int, n: int, k: int, dtype: str, layout: str, l2_bytes: int) -> list[tuple]:
    """Rotating input sets ``(a, b, bias)``: a (m, k) row-major, b (k, n) as ``w.T`` of a row-major
    (n, k) ``w`` ("linear") or row-major ("nn"), bias (n,); random normal data scaled by
    k^-1/2 so that outputs stay O(1) in fp16."""
    import torch
    dt = getattr(torch, TORCH_DTYPE[dtype])
    per_set = (m * k + k * n + n) * 2
    sets = []
    for _ in range(timing.rotation_count(per_set, l2_bytes)):
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5
        b = w.T if layout == "linear" else w.T.contiguous()
        sets.append((a, b, torch.randn(n, device="cuda", dtype=dt)))
    return sets


def _torch_fn(p: dict) -> Callable[[Any, Any, Any], Any]:
    import torch
    import torch.nn.functional as F
    if p["kind"] == "matmul":
        return lambda a, b, bias: torch.matmul(a, b)
    act = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
           "silu": F.silu}[p["activation"]]
    return lambda a, b, bias: act(torch.addmm(bias, a, b))


def _ours_fn(p: dict, backend: str) -> Callable[[Any, Any, Any], Any]:
    from ferroattn.gemm import matmul
    if p["kind"] == "matmul":
        return lambda a, b, bias: matmul(a, b, backend=backend)
    act = p["activation"]
    return lambda a, b, bias: matmul(a, b, bias=bias, activation=act, backend=backend)


#: the peer's name among the functions of :func:`timing.paired_ms` (not a backend name)
PEER = "torch"


def _rotated(fn: Callable, sets: list) -> Callable[[], Any]:
    rot = timing.Rotating(sets)
    return lambda: fn(*rot.next())


def _timed(two: "timing.TwoPass", name: str, flops: float) -> dict:
    """The record of one function: :attr:`timing.TwoPass.results` plus ``tflops`` (per call) and
    ``gpu_tflops`` (GPU time; only with the GPU-time pass)."""
    r = dict(two.results[name])
    r["tflops"] = report.tflops(flops, r["ms"]) if r.get("ms") else None
    if "gpu_ms" in r:
        r["gpu_tflops"] = report.tflops(flops, r["gpu_ms"]) if r["gpu_ms"] else None
    return r


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _ran_backend(p: dict, a, b, bias) -> str | None:
    """The backend "auto" picks for this point (one extra call through ops.gemm.gemm_into)."""
    import torch
    from ferroattn.ops.gemm import gemm_into, public_activation
    out = torch.empty(1, p["m"], p["n"], dtype=a.dtype, device=a.device)
    epi = p["kind"] == "epilogue"
    return gemm_into(a, b, out, None, bias if epi else None, None, 1.0, 0.0,
                     public_activation(p["activation"]) if epi else "none", "auto")


def measure_point(p: dict, sets: list, backends: Sequence[str], supported: Sequence[str],
                  ceiling_tflops: float | None, rep_ms: float, warmup_ms: float,
                  rounds: int = timing.DEFAULT_ROUNDS, timing_mode: str = "call",
                  gpu_rep_ms: float = timing.DEFAULT_GPU_REP_MS, gpu_device: Any = None) -> dict:
    """Fill ``p`` with the peer's and every backend's measurements (see the module docstring):
    each function is called once on ``sets[0]`` (output checked against the peer's), then all
    that ran are timed together by :func:`timing.paired_ms` in ``rounds`` rounds, ``rep_ms`` /
    ``warmup_ms`` (per function, ms) split over the 2·rounds windows. A backend whose first call
    raised a fatal CUDA error (:data:`FATAL_MARKERS`) stops the point before any timing.
    ``timing_mode``: "call" (default here: the per-call pass only), "gpu" or "both"
    (:data:`timing.TIMING_MODES`); with the GPU-time pass every record also has ``gpu_ms``,
    ``gpu_tflops``, ``gpu_ms_rounds``, ``gpu_ms_windows``, ``gpu_error`` (why no GPU time),
    ``gpu_stats`` and, per backend, ``gpu_ratio`` (peer / ours by GPU time, median over rounds),
    ``gpu_paired`` (:func:`timing.paired_ratio`'s dict) and ``gpu_pct_ceiling``; ``gpu_rep_ms``: ms
    of calls per function of that pass; ``gpu_device``: its device object (default
    :func:`timing.cuda_device`). ArgumentError for ``rounds`` not a positive int or an unknown
    ``timing_mode``."""
    import torch
    timing.check_rounds(rounds, "rounds")
    timing.check_timing_mode(timing_mode, "timing_mode")
    p.update(peer=None, peer_error=None, backends={}, backend_errors={}, ran=None, skipped=None)
    ref = None
    fns: dict[str, Callable[[], Any]] = {}
    rels: dict[str, float | None] = {}
    try:
        peer = _torch_fn(p)
        ref = peer(*sets[0]).float()
        fns[PEER] = _rotated(peer, sets)
    except Exception as e:
        p["peer_error"] = _err(e)
    for name in backends:
        if name != "auto" and name not in supported:
            p["backends"][name] = None
            p["backend_errors"][name] = f"not supported on this GPU (gemm_backends: {','.join(supported)})"
            continue
        try:
            fn = _ours_fn(p, name)
            out = fn(*sets[0])
            torch.cuda.synchronize()
            rel = None
            if ref is not None:
                err, scale = float((out.float() - ref).abs().max()), float(ref.abs().max())
                rel = err / scale if scale > 0 else err
            del out
            if name == "auto":
                p["ran"] = _ran_backend(p, *sets[0])
            fns[name], rels[name] = _rotated(fn, sets), rel
        except Exception as e:
            p["backends"][name] = None
            p["backend_errors"][name] = _err(e)
            if _is_fatal(p["backend_errors"][name]):
                break
    del ref
    if any(_is_fatal(v) for v in p["backend_errors"].values()):
        if PEER in fns:
            p["peer_error"] = "not timed: a fatal CUDA error in ours"
        return p
    if not fns:
        return p
    two = timing.time_both(fns, timing_mode, rounds, rep_ms, warmup_ms, gpu_rep_ms, None, gpu_device, _err)
    p["timing"], p["gpu_timed"] = timing_mode, two.gpu is not None
    if two.gpu is not None:
        p["gpu_cycles_per_ms"] = two.gpu.cycles_per_ms
    for name, e in two.errors.items():
        if name == PEER:
            p["peer_error"] = e
        else:
            p["backends"][name], p["backend_errors"][name] = None, e
    if PEER in two.results and PEER not in two.errors:
        p["peer"] = _timed(two, PEER, p["flops"])
    for name, rel in rels.items():
        if name not in two.results or name in two.errors:
            continue
        r = _timed(two, name, p["flops"])
        tf, gtf = r["tflops"], r.get("gpu_tflops")
        r.update({"ratio": None, "pct_ceiling": (100.0 * tf / ceiling_tflops) if (tf and ceiling_tflops) else None,
                  "rel_err": rel, "suspect": bool(rel is not None and rel > SUSPECT_REL_ERR)})
        call, gpu = two.ratios(PEER, name)
        if call is not None:
            r.update(call)
        if two.gpu is not None:
            r.update(gpu_ratio=gpu["ratio"] if gpu else None, gpu_paired=gpu,
                     gpu_pct_ceiling=(100.0 * gtf / ceiling_tflops) if (gtf and ceiling_tflops) else None)
        p["backends"][name] = r
    p["backends"] = {name: p["backends"][name] for name in backends if name in p["backends"]}
    return p


def host_cost(n_calls: int = 2000) -> dict:
    """Host-side cost of one decode-sized call (m = 16, n = k = 4096, bf16): ours ("auto") vs
    ``torch.matmul``, :func:`timing.host_us_per_call` (wall time of N back-to-back calls / N)."""
    import torch
    from ferroattn.gemm import matmul
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out: dict[str, Any] = {"shape": "m=16 n=4096 k=4096 bf16 (b = w.T)",
                           "method": "wall time of N back-to-back calls / N (one sync after the loop)"}
    for name, fn in (("ferroattn", lambda: matmul(a, w.T)), ("torch", lambda: torch.matmul(a, w.T))):
        try:
            host, gpu = timing.host_us_per_call(fn, n_calls), timing.gpu_us_per_call(fn)
            out[name] = {"host_us": host, "gpu_us": gpu, "host_bound": bool(host > 1.5 * gpu)}
        except Exception as e:
            out[name] = {"host_us": None, "gpu_us": None, "error": _err(e)}
    return out


# ---- summary and table --------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _ratios(points: Sequence[dict], kind: str, backend: str, target_only: bool,
            key: str = "ratio") -> list[tuple[float, dict]]:
    out = []
    for p in points:
        if p["kind"] != kind or (target_only and not is_target_shape(p)):
            continue
        r = ((p.get("backends") or {}).get(backend) or {}).get(key)
        if r is not None:
            out.append((r, p))
    return out


def point_label(p: dict) -> str:
    act = f" +bias+{p['activation']}" if p["kind"] == "epilogue" else ""
    return f"{p['dtype']} {p['suite']} m={p['m']} n={p['n']} k={p['k']}{act}"


def summarize(points: Sequence[dict], backends: Sequence[str] = BACKENDS) -> dict:
    """Per kind ("matmul", "epilogue") and backend: median / min ratio ours/peer over the target
    shapes (:func:`is_target_shape`) and over the whole grid, where the minimum is, best % of the
    ceiling; the target verdicts (matmul: :data:`TARGETS` per backend on the minimum over the
    target shapes; epilogue, "auto": the median over the target shapes >= :data:`EPILOGUE_MEDIAN_TARGET`
    and the minimum >= :data:`EPILOGUE_TARGET`), each with the number of target
    shapes whose paired ratio is below the goal (``n_below``) and of those whose whole interval
    ``ratio_ci`` is below it (``n_ci_below``: below beyond the round-to-round spread); counts;
    ``rounds``: the sorted distinct numbers of paired rounds behind the ratios (empty when none).

    ``kinds`` are per-call (host-inclusive) ratios, ``kinds_gpu`` the same on GPU time (None
    without the GPU-time pass). ``basis``: "gpu" when the GPU-time pass ran at some point -- the
    ``targets`` then use the GPU-time ratios (a point whose GPU time did not hold counts as not
    measured, never replaced by its per-call ratio) and ``targets_call`` keeps the per-call
    verdicts for reference -- else "call". ``gpu_invalid``: "<function> at <point>: <reason>" for
    every GPU time that did not hold (first 20; ``n_gpu_invalid`` counts all)."""
    basis = "gpu" if any(p.get("gpu_timed") for p in points) else "call"

    def kinds(key: str, pct_key: str) -> dict:
        res = {}
        for kind in ("matmul", "epilogue"):
            per = {}
            for name in backends:
                sel, whole = _ratios(points, kind, name, True, key), _ratios(points, kind, name, False, key)
                worst = min(sel, key=lambda x: x[0]) if sel else None
                pct = [((p.get("backends") or {}).get(name) or {}).get(pct_key) for p in points
                       if p["kind"] == kind]
                pct = [x for x in pct if x is not None]
                per[name] = {"target_median": _median([r for r, _ in sel]),
                             "target_min": worst[0] if worst else None,
                             "target_min_at": point_label(worst[1]) if worst else None, "n_target": len(sel),
                             "grid_median": _median([r for r, _ in whole]),
                             "grid_min": min(r for r, _ in whole) if whole else None, "n_grid": len(whole),
                             "best_pct_ceiling": max(pct) if pct else None}
            res[kind] = per
        return res

    def targets(kd: dict, key: str) -> dict:
        res = {}
        for name, goal in TARGETS.items():
            if name in backends:
                res[f"matmul_{name}"] = _verdict(goal, kd["matmul"][name], points, "matmul", name, key)
        if "auto" in backends:
            res["epilogue_auto"] = _verdict(EPILOGUE_TARGET, kd["epilogue"]["auto"], points, "epilogue", "auto", key,
                                            median_goal=EPILOGUE_MEDIAN_TARGET)
        return res

    out: dict[str, Any] = {"basis": basis, "kinds": kinds("ratio", "pct_ceiling"), "kinds_gpu": None}
    out["targets_call"] = targets(out["kinds"], "ratio")
    out["targets"] = out["targets_call"]
    if basis == "gpu":
        out["kinds_gpu"] = kinds("gpu_ratio", "gpu_pct_ceiling")
        out["targets"] = targets(out["kinds_gpu"], "gpu_ratio")
    invalid = [f"{name} at {point_label(p)}: {v['gpu_error']}" for p in points
               for name, v in [(PEER, p.get("peer")), *(p.get("backends") or {}).items()]
               if v and v.get("gpu_error")]
    out["n_gpu_invalid"], out["gpu_invalid"] = len(invalid), invalid[:20]
    rkey = "gpu_paired" if basis == "gpu" else None
    out["rounds"] = sorted({len((v[rkey] if rkey else v)["ratio_rounds"]) for p in points
                            for v in (p.get("backends") or {}).values()
                            if v and ((v.get(rkey) or {}) if rkey else v).get("ratio_rounds")})
    out["n_points"] = len(points)
    out["n_auto_measured"] = sum(1 for p in points if (p.get("backends") or {}).get("auto"))
    out["n_auto_failed"] = sum(1 for p in points if (p.get("backend_errors") or {}).get("auto"))
    out["n_skipped"] = sum(1 for p in points if p.get("skipped"))
    out["n_suspect"] = sum(1 for p in points for v in (p.get("backends") or {}).values() if v and v.get("suspect"))
    return out


def _ci_high(p: dict, backend: str, key: str = "ratio") -> float | None:
    """The upper end of the backend's ``ratio_ci`` at ``p`` (None without one); ``key`` "gpu_ratio":
    of its GPU-time ratio (``gpu_paired``)."""
    v = (p.get("backends") or {}).get(backend) or {}
    ci = (v.get("gpu_paired") or {}).get("ratio_ci") if key == "gpu_ratio" else v.get("ratio_ci")
    return ci[1] if ci else None


def _verdict(goal: float, t: dict, points: Sequence[dict], kind: str, backend: str, key: str = "ratio",
             median_goal: float | None = None) -> dict:
    """A target verdict: ``met`` when the minimum over the target shapes is >= ``goal`` and, with a
    ``median_goal``, their median is >= it too (None: nothing measured); ``median_met``: the median
    against ``median_goal`` (default ``goal``)."""
    mn, med = t["target_min"], t["target_median"]
    sel = _ratios(points, kind, backend, True, key)
    highs = [_ci_high(p, backend, key) for _, p in sel]
    med_goal = goal if median_goal is None else median_goal
    met = None if mn is None or med is None else bool(mn >= goal and med >= med_goal)
    return {"goal": goal, "median_goal": median_goal, "min": mn, "median": med, "min_at": t["target_min_at"],
            "met": met, "median_met": None if med is None else bool(med >= med_goal),
            "n_below": sum(1 for r, _ in sel if r < goal),
            "n_ci_below": sum(1 for h in highs if h is not None and h < goal)}


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _render(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_table(points: Sequence[dict], backends: Sequence[str]) -> str:
    """One row per point: peer TF/s, per backend TF/s and ratio (per call: host-inclusive), then,
    when some point has GPU-time data, "gpu torch TF/s" and "gpu x<backend>" (GPU time only; "inv"
    where a GPU time did not hold), "auto"'s % of ceiling, rel_err and the backend it ran."""
    with_gpu = any(p.get("gpu_timed") for p in points)
    gcols = (["gpu torch TF/s"] + [f"gpu x{b}" for b in backends]) if with_gpu else []
    cols = ["dtype", "suite", "m", "n", "k", "epilogue", "torch TF/s"] + [f"{b} TF/s" for b in backends] + \
        [f"x{b}" for b in backends] + gcols + ["%ceil", "rel_err", "ran"]
    rows = []
    for p in points:
        head = [p["dtype"], p["suite"], str(p["m"]), str(p["n"]), str(p["k"]),
                f"bias+{p['activation']}" if p["kind"] == "epilogue" else "-"]
        if p.get("skipped"):
            rows.append(head + ["skipped"] + [""] * (2 * len(backends) + len(gcols) + 3))
            continue
        peer = p.get("peer")
        row = head + [_f(peer["tflops"], ".1f") if peer else "ERR"]
        res = p.get("backends") or {}
        row += [_f(res[b]["tflops"], ".1f") if res.get(b) else "n/a" for b in backends]
        row += [_f(res[b]["ratio"], ".2f") if res.get(b) else "—" for b in backends]
        if with_gpu:
            peer_inv = bool(peer and peer.get("gpu_error"))
            row += ["inv" if peer_inv else (_f(peer.get("gpu_tflops"), ".1f") if peer else "ERR")]
            row += [("inv" if (peer_inv or res[b].get("gpu_error")) else _f(res[b].get("gpu_ratio"), ".2f"))
                    if res.get(b) else "—" for b in backends]
        auto = res.get("auto") or {}
        row += [_f(auto.get("pct_ceiling"), ".1f"), _f(auto.get("rel_err"), ".1e")
                + ("!" if auto.get("suspect") else ""), p.get("ran") or "—"]
        rows.append(row)
    return _render(cols, rows)


def format_summary(summary: dict, ceilings: dict | None = None, host: dict | None = None) -> str:
    lines = []
    if ceilings:
        lines.append("ceilings: " + ", ".join(
            f"{k.removeprefix('matmul_')} matmul {v['tflops']:.0f} TFLOP/s" if v else f"{k} n/a"
            for k, v in ceilings.items() if k.startswith("matmul_") and not k.endswith("_error")))
    rounds = summary.get("rounds")
    gpu_basis = summary.get("basis") == "gpu" and summary.get("kinds_gpu")
    if rounds:
        lines.append(f"ratios: per point the median of {'/'.join(map(str, rounds))} paired rounds (peer and "
                     f"backends interleaved, forward and reverse pass per round); ms: median over rounds")
    titles = {"matmul": "matmul vs torch.matmul (cuBLAS)", "epilogue": "matmul+bias+activation vs act(torch.addmm)"}
    blocks = [("", summary["kinds"])]
    if gpu_basis:
        blocks = [("GPU time only (stream pre-filled by a sleep covering the host time; the target verdicts) ",
                   summary["kinds_gpu"]),
                  ("per call (host-inclusive: CUDA events around each call after an L2 flush) ", summary["kinds"])]
    for label, kinds in blocks:
        for kind, per in kinds.items():
            if not any(t["n_grid"] for t in per.values()):   # nothing measured (e.g. no epilogue points)
                continue
            lines.append(f"{label}{titles[kind]}:")
            for name, t in per.items():
                lines.append(f"  {name:5s} target shapes (square >= {TARGET_MIN_SIZE}, LLM m >= {TARGET_MIN_SIZE}): "
                             f"median {_f(t['target_median'], '.3f')}, min {_f(t['target_min'], '.3f')}"
                             + (f" at {t['target_min_at']}" if t.get("target_min_at") else "")
                             + f" ({t['n_target']} points); whole grid median {_f(t['grid_median'], '.3f')}, "
                               f"min {_f(t['grid_min'], '.3f')} ({t['n_grid']} points); best "
                               f"{_f(t['best_pct_ceiling'], '.1f')}% of ceiling")
    if summary.get("n_gpu_invalid"):
        lines.append(f"GPU time did not hold (host-bound even behind the longest sleep; not reported) for "
                     f"{summary['n_gpu_invalid']} function-points, e.g. {summary['gpu_invalid'][:2]}")
    if gpu_basis:
        lines.append("target verdicts by GPU time only:")
    for key, v in summary["targets"].items():
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[v["met"]]
        below = (f"; {v['n_below']} target shapes below, {v['n_ci_below']} of them with the whole interval "
                 f"below" if v.get("n_below") else "")
        rule = (f"median >= {v['median_goal']}x over the target shapes, none below {v['goal']}x"
                if v.get("median_goal") is not None else f">= {v['goal']}x on every target shape")
        lines.append(f"target {key} {rule}: {verdict} (min {_f(v['min'], '.3f')}, "
                     f"median {_f(v['median'], '.3f')}{below})")
    if gpu_basis and summary.get("targets_call"):
        lines.append("per call (host-inclusive; reference, not the verdicts): " + "; ".join(
            f"{key} min {_f(v['min'], '.3f')} median {_f(v['median'], '.3f')}"
            for key, v in summary["targets_call"].items()))
    lines.append(f"points: {summary['n_points']}, auto measured {summary['n_auto_measured']}, auto failed "
                 f"{summary['n_auto_failed']}, skipped {summary['n_skipped']}, suspect rel_err {summary['n_suspect']}")
    if host:
        for name in ("ferroattn", "torch"):
            v = host.get(name)
            if isinstance(v, dict) and v.get("host_us") is not None:
                lines.append(f"host cost per call ({host['shape']}) {name}: {v['host_us']:.1f} us (GPU "
                             f"{v['gpu_us']:.1f} us{', host-bound' if v['host_bound'] else ', GPU-bound'})")
            elif isinstance(v, dict):
                lines.append(f"host cost per call {name}: n/a ({v.get('error')})")
    return "\n".join(lines)


# ---- run --------------------------------------------------------------------------------
def _is_fatal(msg: str | None) -> bool:
    return bool(msg) and any(m.lower() in msg.lower() for m in FATAL_MARKERS)


def run_bench(quick: bool = False, out_dir: str = "bench/results", dtypes: Sequence[str] | None = None,
              suites: Sequence[str] | None = None, sizes: Sequence[int] | None = None,
              ms: Sequence[int] | None = None, activations: Sequence[str] | None = None,
              backends: Sequence[str] = BACKENDS, layout: str = "linear", rep_ms: float | None = None,
              time_budget_s: float | None = None, with_host_cost: bool = True,
              printer: Callable[[str], None] = print, rounds: int = timing.DEFAULT_ROUNDS,
              timing_mode: str = "both", gpu_rep_ms: float | None = None) -> tuple[dict, int]:
    """Run the benchmark; return (result dict, exit code). Needs a CUDA GPU. ``rep_ms``: per-call
    pass budget per function and point (ms; default :data:`timing.DEFAULT_REP_MS` of
    ``timing_mode``: 100 / quick 30 alone, 70 / 20 with the GPU-time pass), split over ``rounds``
    paired rounds; ``gpu_rep_ms``: GPU-time pass, ms of calls per function and point (default 30,
    quick 10); ``timing_mode``: both (default), gpu or call (:func:`measure_point`). ArgumentError
    for ``rounds`` not a positive int or a bad ``timing_mode``."""
    timing.check_rounds(rounds, "rounds")
    timing.check_timing_mode(timing_mode, "timing_mode")
    import torch
    from ferroattn import _native
    from . import ceilings

    t0 = time.monotonic()
    rep = rep_ms if rep_ms is not None else timing.DEFAULT_REP_MS[timing_mode][1 if quick else 0]
    gpu_rep = gpu_rep_ms if gpu_rep_ms is not None else timing.DEFAULT_GPU_REP[1 if quick else 0]
    warm = min(25.0, rep / 2)
    points = grid(quick, dtypes, suites, sizes, ms, activations)
    meta = report.run_metadata()
    l2 = meta.get("l2_bytes") or 50 * 2**20
    try:
        supported = list(_native.gemm_backends(torch.cuda.current_device()))
    except Exception as e:
        supported = []
        printer(f"gemm_backends failed: {_err(e)}")
    printer(f"device {meta.get('device')} | driver {meta.get('driver')} | torch {meta.get('torch')} | commit "
            f"{meta.get('commit')} | {len(points)} points | backends {','.join(backends)} (GPU supports "
            f"{','.join(supported) or 'none'}) | layout {layout} | timing ({timing_mode}): "
            + " | ".join(timing.pass_names(timing_mode, rounds, gpu_rep)))
    ceil: dict[str, Any] = {}
    for dt in sorted({p["dtype"] for p in points}):
        key = f"matmul_{dt}"
        try:
            ceil[key] = ceilings.matmul_tflops(dtype=TORCH_DTYPE[dt])
        except Exception as e:
            ceil[key], ceil[f"{key}_error"] = None, _err(e)
    host = None
    if with_host_cost:
        try:
            host = host_cost()
        except Exception as e:
            host = {"error": _err(e)}

    def result(partial: bool) -> dict:
        return {"meta": meta,
                "config": {"quick": quick, "layout": layout, "backends": list(backends), "supported": supported,
                           "rep_ms": rep, "warmup_ms": warm, "rounds": rounds,
                           "window_rep_ms": rep / (2 * rounds), "window_warmup_ms": warm / (2 * rounds),
                           "order": "per round: " + " ".join(timing.round_order(
                               [PEER, *(b for b in backends if b == "auto" or b in supported)])),
                           "timing": timing.method_name(rounds), "timing_mode": timing_mode,
                           "gpu_rep_ms": gpu_rep if timing_mode != "call" else None,
                           "gpu_timing": timing.gpu_method_name(rounds, gpu_rep) if timing_mode != "call" else None,
                           "sleep_cycles_per_ms": next((p["gpu_cycles_per_ms"] for p in points
                                                        if p.get("gpu_cycles_per_ms")), None),
                           "peer": "torch.matmul (cuBLAS); epilogue: act(torch.addmm(bias, a, b))",
                           "flops": "2*m*n*k", "time_budget_s": time_budget_s, "elapsed_s": time.monotonic() - t0},
                "partial": partial, "ceilings": ceil, "host_cost": host, "points": points,
                "summary": summarize(points, backends)}

    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["dtype"], p["m"], p["n"], p["k"]), []).append(p)
    fatal = None
    done = 0
    for (dt, m, n, k), pts in groups.items():
        over = time_budget_s is not None and time.monotonic() - t0 > time_budget_s
        if fatal or over:
            for p in pts:
                p.update(skipped=fatal or f"time budget of {time_budget_s:.0f} s used up", peer=None, backends={},
                         backend_errors={}, ran=None)
            continue
        try:
            sets = make_inputs(m, n, k, dt, layout, l2)
        except Exception as e:
            for p in pts:
                p.update(skipped=f"inputs: {_err(e)}", peer=None, backends={}, backend_errors={}, ran=None)
            continue
        ceiling = (ceil.get(f"matmul_{dt}") or {}).get("tflops")
        for p in pts:
            measure_point(p, sets, backends, supported, ceiling, rep, warm, rounds, timing_mode, gpu_rep)
            errs = [v for v in p["backend_errors"].values() if _is_fatal(v)]
            if errs:
                fatal = f"skipped after a fatal CUDA error in ours: {errs[0][:200]}"
            done += 1
            auto = p["backends"].get("auto") or {}
            gp = auto.get("gpu_paired") or {}
            print(f"gemm bench {done}/{len(points)}: {point_label(p)}"
                  + (f" auto GPU time x{gp['ratio']:.2f} [{gp['ratio_min']:.2f}, {gp['ratio_max']:.2f}]"
                     if gp.get("ratio") else (" auto GPU time: " + auto["gpu_error"] if auto.get("gpu_error") else ""))
                  + (f" per call x{auto['ratio']:.2f} [{auto['ratio_min']:.2f}, {auto['ratio_max']:.2f}]"
                     if auto.get("ratio") else ""), file=sys.stderr, flush=True)
        del sets
        torch.cuda.empty_cache()
        report.write_json(result(partial=True), out_dir, kind="gemm")
    final = result(partial=False)
    path = report.write_json(final, out_dir, kind="gemm")
    printer(format_table(points, backends))
    printer(f"raw JSON: {path}")
    printer(format_summary(final["summary"], ceil, host))
    s = final["summary"]
    code = 0 if s["n_auto_failed"] == 0 and s["n_auto_measured"] > 0 else 1
    if "auto" not in backends:
        code = 0 if any(p.get("backends") for p in points) else 1
    return final, code


# ---- command line -------------------------------------------------------------------------
def _int_list(opt: str):
    def conv(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{opt}: expected comma-separated positive integers, got {text!r}") from None
        if not vals or any(v <= 0 for v in vals):
            raise argparse.ArgumentTypeError(f"{opt}: expected comma-separated positive integers, got {text!r}")
        return vals
    return conv


def _name_list(opt: str, allowed: Sequence[str], allow_empty: bool = False):
    def conv(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        if (not vals and not allow_empty) or any(v not in allowed for v in vals):
            raise argparse.ArgumentTypeError(f"{opt}: expected a comma-separated subset of {','.join(allowed)}, "
                                             f"got {text!r}")
        return vals
    return conv


def _positive_float(opt: str):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = -1.0
        if not (0 < v < float("inf")):
            raise argparse.ArgumentTypeError(f"{opt}: expected a positive number, got {text!r}")
        return v
    return conv


def _positive_int(opt: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{opt}: expected a positive integer, got {text!r}")
        return v
    return conv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m ferroattn bench gemm``."""
    parser.add_argument("--quick", action="store_true", help="a reduced grid (square 4096/8192, m 16/4096, bf16)")
    parser.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")
    parser.add_argument("--dtypes", type=_name_list("--dtypes", DTYPES), default=None,
                        help="comma-separated subset of bf16,fp16")
    parser.add_argument("--suites", type=_name_list("--suites", SUITES), default=None,
                        help="comma-separated subset of square,llm (default both)")
    parser.add_argument("--sizes", type=_int_list("--sizes"), default=None,
                        help="square sizes (default 1024,2048,4096,8192,16384)")
    parser.add_argument("--ms", type=_int_list("--ms"), default=None,
                        help="LLM token counts m (default 16,32,...,16384)")
    parser.add_argument("--backends", type=_name_list("--backends", BACKENDS), default=list(BACKENDS),
                        help="comma-separated subset of wmma,sm90,auto (default all)")
    parser.add_argument("--activations", type=_name_list("--activations", ACTIVATIONS, allow_empty=True),
                        default=list(DEFAULT_ACTIVATIONS),
                        help="epilogue points: comma-separated subset of relu,gelu,gelu_tanh,silu "
                             "(default gelu; an empty string for none)")
    parser.add_argument("--layout", choices=LAYOUTS, default="linear",
                        help="b operand: linear = w.T of a row-major (n, k) weight (default), nn = row-major (k, n)")
    parser.add_argument("--rep-ms", type=_positive_float("--rep-ms"), default=None,
                        help="per-call pass: timing budget per function and point in ms, split over the rounds "
                             "(default 100, --quick 30 with --timing call; 70 / 20 with both or gpu)")
    parser.add_argument("--timing", choices=timing.TIMING_MODES, default="both",
                        help="both (default): GPU time only (the target verdicts) and per call (host-inclusive); "
                             "gpu or call: one of them")
    parser.add_argument("--gpu-rep-ms", type=_positive_float("--gpu-rep-ms"), default=None,
                        help="GPU-time pass: ms of calls per function and point, split over the rounds "
                             "(default 30, --quick 10)")
    parser.add_argument("--rounds", type=_positive_int("--rounds"), default=timing.DEFAULT_ROUNDS,
                        help="paired rounds per point: the peer and every backend timed interleaved, a forward "
                             f"and a reverse pass per round; ratio = median over rounds (default "
                             f"{timing.DEFAULT_ROUNDS})")
    parser.add_argument("--time-budget-s", type=_positive_float("--time-budget-s"), default=None,
                        help="stop measuring new shapes after this many seconds (the rest recorded as skipped)")
    parser.add_argument("--no-host-cost", action="store_true", help="skip the host cost of a decode-sized call")


def run(args: argparse.Namespace) -> int:
    """``python -m ferroattn bench gemm``: exit code (0 ok, 1 ours failed, 2 bad arguments, 3 no GPU)."""
    prog = "ferroattn bench gemm"
    try:
        grid(args.quick, args.dtypes, args.suites, args.sizes, args.ms, args.activations)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    code = report.cannot_run(prog)
    if code is not None:
        return code
    _, code = run_bench(args.quick, args.out, args.dtypes, args.suites, args.sizes, args.ms, args.activations,
                        args.backends, args.layout, args.rep_ms, args.time_budget_s, not args.no_host_cost,
                        rounds=args.rounds, timing_mode=args.timing, gpu_rep_ms=args.gpu_rep_ms)
    return code
