"""Attention-forward benchmark: ferroattn against torch SDPA (flash, cuDNN, efficient backends).

Grid (FlashAttention-3 paper, forward): 16k tokens per batch (batch = 16384 / seqlen), hidden
2048 split as (head_dim, heads) = (64, 32), (128, 16), (256, 8); seqlen 512, 1k, 2k, 4k, 8k,
16k; causal and not; bf16 and fp16. ``--quick``: d 64/128/256 at seqlen 1k and 8k, bf16 only.

For every point: ours and each peer timed with :func:`timing.bench_gpu` (median) on rotating
copies of the inputs, TFLOP/s from :func:`report.fwd_flops` (visible pairs), ratio ours/peer,
% of the measured bf16 matmul ceiling, and ``max_abs_diff`` between our output and the first
peer that ran (a guard against fast-but-wrong). A peer that cannot run a point is recorded as null with the
reason. Also: the host-side cost of one small call (:mod:`.hostcost`).

Writes the raw JSON (:func:`report.write_json`) into ``--out`` (default ``bench/results``),
prints the table, then the summary lines. Exit 0 when every point was measured for ours,
1 when ours failed somewhere (the JSON is written anyway), 3 without a CUDA GPU.
``--candidate KNOBS`` (repeatable) also measures ours under other tuning knobs at every point,
paired with ours (:mod:`.candidate`: A/B runs). ``--backward`` runs :mod:`.attention_bwd` instead (same grid,
backward timings); ``--variants``
runs :mod:`.variants` instead (window, softcap, ALiBi, dropout, sinks against plain, FlexAttention
and SDPA; with ``--backward`` also the backward).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Sequence

from . import candidate, report, timing

DIMS = ((64, 32), (128, 16), (256, 8))          # (head_dim, heads): hidden 2048
#: head dims only ``--head-dims`` selects (not in the FlashAttention-3 grid): d 192 as in
#: DeepSeek-style MLA prefill (q/k 192), 8 heads
OPT_IN_DIMS = ((192, 8),)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
DTYPES = ("bf16", "fp16")
QUICK = dict(dims=DIMS, seqlens=(1024, 8192), dtypes=("bf16",))
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
DEFAULT_PEERS = ("flash", "cudnn", "efficient")
FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "illegal instruction",
                 "misaligned address", "device-side assert", "CUDA_ERROR_ILLEGAL", "CUDA_ERROR_LAUNCH_FAILED")


def grid(quick: bool = False, dtypes: Sequence[str] | None = None, head_dims: Sequence[int] | None = None,
         seqlens: Sequence[int] | None = None) -> list[dict]:
    """The grid points (without measurements), in run order."""
    dims = QUICK["dims"] if quick else DIMS
    sls = QUICK["seqlens"] if quick else SEQLENS
    dts = QUICK["dtypes"] if quick else DTYPES
    if dtypes:
        bad = [x for x in dtypes if x not in DTYPES]
        if bad:
            raise ValueError(f"--dtypes: expected a subset of {','.join(DTYPES)}, got {','.join(dtypes)}")
        dts = tuple(dtypes)
    if head_dims:
        every = tuple(sorted(DIMS + OPT_IN_DIMS))
        bad = [x for x in head_dims if x not in {d for d, _ in every}]
        if bad:
            raise ValueError(f"--head-dims: expected a subset of {','.join(str(d) for d, _ in every)}, got {bad}")
        dims = tuple((d, h) for d, h in every if d in head_dims)
    if seqlens:
        bad = [x for x in seqlens if TOKENS % x]
        if bad:
            raise ValueError(f"--seqlens: expected divisors of {TOKENS}, got {bad}")
        sls = tuple(seqlens)
    pts = []
    for dt in dts:
        for d, h in dims:
            for s in sls:
                for causal in (False, True):
                    b = TOKENS // s
                    pts.append({"dtype": dt, "causal": causal, "head_dim": d, "heads": h, "seqlen": s,
                                "batch": b, "flops": report.fwd_flops(b, h, s, s, d, causal)})
    return pts


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="attention grid", unit="pt", mininterval=2.0, file=sys.stderr)
    except ImportError:
        class _Plain:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                print(f"attention grid: {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _Plain()


def _is_fatal(msg: str | None) -> bool:
    return bool(msg) and any(m.lower() in msg.lower() for m in FATAL_MARKERS)


def make_inputs(b: int, s: int, h: int, d: int, dtype: str, l2_bytes: int) -> tuple[list, list]:
    """Rotating input sets: (q, k, v) as (b, s, h, d) for ours and as (b, h, s, d) for SDPA."""
    import torch
    dt = getattr(torch, TORCH_DTYPE[dtype])
    bytes_per_set = 3 * b * s * h * d * 2
    n = timing.rotation_count(bytes_per_set, l2_bytes)
    ours, sdpa = [], []
    for _ in range(n):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
        ours.append((q, k, v))
        sdpa.append(tuple(x.transpose(1, 2).contiguous() for x in (q, k, v)))
    return ours, sdpa


def measure_point(p: dict, ours_sets: list, sdpa_sets: list, peer_names: Sequence[str],
                  ceiling_tflops: float | None, rep_ms: float, warmup_ms: float,
                  candidates: dict[str, dict[str, str]] | None = None) -> dict:
    import torch
    import torch.nn.functional as F
    import ferroattn
    from . import peers as peers_mod
    from ..knobs import override

    causal = p["causal"]
    p.update(ours=None, ours_error=None, peers={}, peer_errors={}, ratio={}, max_abs_diff=None,
             diff_ref=None, skipped=None)
    out0 = None
    try:
        out0 = ferroattn.flash_attn_func(*ours_sets[0], causal=causal)
        torch.cuda.synchronize()
        rot = timing.Rotating(ours_sets)
        ms = timing.bench_gpu(lambda: ferroattn.flash_attn_func(*rot.next(), causal=causal), rep_ms, warmup_ms)
        tf = report.tflops(p["flops"], ms)
        p["ours"] = {"ms": ms, "tflops": tf,
                     "pct_ceiling": (100.0 * tf / ceiling_tflops) if (tf and ceiling_tflops) else None}
    except Exception as e:
        p["ours_error"] = f"{type(e).__name__}: {e}"
    for label, knobs in (candidates or {}).items():
        try:
            with override(**knobs):
                out_c = ferroattn.flash_attn_func(*ours_sets[0], causal=causal)
                torch.cuda.synchronize()
                rot = timing.Rotating(ours_sets)
                ms = timing.bench_gpu(lambda: ferroattn.flash_attn_func(*rot.next(), causal=causal), rep_ms, warmup_ms)
            diff = None if out0 is None else float((out_c.float() - out0.float()).abs().max())
            candidate.record(p, label, ms, diff)
            del out_c
        except Exception as e:
            candidate.record_error(p, label, e)
    for name in peer_names:
        ref, why = peers_mod.probe(name, peers_mod.sdpa_fn(*sdpa_sets[0], causal))
        if ref is None:
            p["peers"][name] = None
            p["peer_errors"][name] = why
            continue
        if out0 is not None and p["diff_ref"] is None:
            p["max_abs_diff"] = float((out0.float() - ref.transpose(1, 2).float()).abs().max())
            p["diff_ref"] = name
        del ref
        try:
            rot_t = timing.Rotating(sdpa_sets)
            with peers_mod.only(name):
                ms = timing.bench_gpu(lambda: F.scaled_dot_product_attention(*rot_t.next(), is_causal=causal),
                                      rep_ms, warmup_ms)
            p["peers"][name] = {"ms": ms, "tflops": report.tflops(p["flops"], ms)}
        except Exception as e:
            p["peers"][name] = None
            p["peer_errors"][name] = f"{type(e).__name__}: {e}"
        ours_tf = (p["ours"] or {}).get("tflops")
        peer = p["peers"][name]
        p["ratio"][name] = (ours_tf / peer["tflops"]) if (ours_tf and peer and peer["tflops"]) else None
    for name in peer_names:
        p["ratio"].setdefault(name, None)
    return p


def run(quick: bool = False, out_dir: str = "bench/results", dtypes: Sequence[str] | None = None,
        head_dims: Sequence[int] | None = None, seqlens: Sequence[int] | None = None,
        rep_ms: float | None = None, time_budget_s: float | None = None,
        peer_names: Sequence[str] = ("flash", "cudnn", "efficient"),
        printer: Callable[[str], None] = print,
        candidates: dict[str, dict[str, str]] | None = None) -> tuple[dict, int]:
    """Run the benchmark; return (result dict, exit code). Needs a CUDA GPU. ``candidates``:
    {label: tuning knobs}, ours measured again under each at every point (:mod:`.candidate`)."""
    import torch
    from . import ceilings, hostcost

    t_start = time.monotonic()
    rep = rep_ms if rep_ms is not None else (30.0 if quick else 100.0)
    warm = min(25.0, rep / 2)
    points = grid(quick, dtypes, head_dims, seqlens)
    meta = report.run_metadata()
    l2 = meta.get("l2_bytes") or 50 * 2**20
    printer(f"device {meta.get('device')} | driver {meta.get('driver')} | torch {meta.get('torch')} | "
            f"commit {meta.get('commit')} | {len(points)} points | timing: {timing.method_name()}")
    ceil = ceilings.measure()
    mm = ceil.get("matmul_bf16")
    ceiling_tflops = mm["tflops"] if mm else None
    printer("ceilings: bf16 matmul " + (f"{mm['tflops']:.0f} TFLOP/s" if mm else f"n/a ({ceil.get('matmul_bf16_error')})")
            + ", d2d copy " + (f"{ceil['copy_d2d']['gbps']:.0f} GB/s" if ceil.get("copy_d2d") else "n/a"))
    try:
        host = hostcost.measure()
    except Exception as e:
        host = {"error": f"{type(e).__name__}: {e}"}

    def result(partial: bool) -> dict:
        return {
            "meta": meta,
            "config": {"quick": quick, "tokens": TOKENS, "hidden": 2048, "rep_ms": rep, "warmup_ms": warm,
                       "timing": timing.method_name(), "peers": list(peer_names),
                       "flops": report.FLOPS_RULE,
                       "time_budget_s": time_budget_s, "elapsed_s": time.monotonic() - t_start},
            "partial": partial,
            "ceilings": ceil,
            "host_cost": host,
            "points": points,
            "summary": report.summarize(points, ref_peer=peer_names[0] if peer_names else "flash"),
            "candidates": candidate.summarize(points, candidates),
        }

    bar = _progress(len(points))
    fatal = None
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["dtype"], p["head_dim"], p["heads"], p["seqlen"], p["batch"]), []).append(p)
    for (dt, d, h, s, b), pts in groups.items():
        over = time_budget_s is not None and time.monotonic() - t_start > time_budget_s
        if fatal or over:
            for p in pts:
                p.update(skipped=fatal or f"time budget of {time_budget_s:.0f} s used up", ours=None,
                         peers={}, ratio={}, peer_errors={}, ours_error=None, max_abs_diff=None)
            bar.update(len(pts))
            continue
        try:
            ours_sets, sdpa_sets = make_inputs(b, s, h, d, dt, l2)
        except Exception as e:
            for p in pts:
                p.update(skipped=f"inputs: {type(e).__name__}: {e}", ours=None, peers={}, ratio={},
                         peer_errors={}, ours_error=None, max_abs_diff=None)
            bar.update(len(pts))
            continue
        for p in pts:
            measure_point(p, ours_sets, sdpa_sets, peer_names, ceiling_tflops, rep, warm, candidates)
            if _is_fatal(p.get("ours_error")):
                fatal = f"skipped after a fatal CUDA error in ours: {p['ours_error'][:200]}"
            r = p["ratio"].get(peer_names[0]) if peer_names else None
            bar.set_postfix_str(f"{dt} d={d} s={s} {'causal' if p['causal'] else 'full'}"
                                + (f" x{peer_names[0]}={r:.2f}" if r else ""))
            bar.update(1)
        del ours_sets, sdpa_sets
        torch.cuda.empty_cache()
        report.write_json(result(partial=True), out_dir)   # same file: survives a kill
    bar.close()

    final = result(partial=False)
    summary = final["summary"]
    path = report.write_json(final, out_dir)
    printer(report.format_table(points, peer_names))
    printer(f"raw JSON: {path}")
    printer(report.format_summary(summary, ceil, host))
    if candidates:
        printer(candidate.format_summary(final["candidates"]))
    code = 0 if summary["n_ours_failed"] == 0 and summary["n_measured"] > 0 else 1
    return final, code


SDPA_PEERS = ("flash", "cudnn", "efficient", "math")


def check_args(prog: str, args: argparse.Namespace, default_peers: Sequence[str],
               grid_fn: Callable[..., Any], known_peers: Sequence[str] = SDPA_PEERS
               ) -> tuple[int | None, list[str], list[str] | None]:
    """What ``bench attention`` (forward: this module's grid; ``--backward``: attention_bwd's;
    ``--variants``: :mod:`.variants`') checks before it runs: --peers names among ``known_peers``
    (default ``default_peers``), then --dtypes / --head-dims / --seqlens through ``grid_fn`` (before
    touching the GPU), then :func:`report.cannot_run` (the environment's tuning knobs, torch
    importable and a CUDA GPU). Messages go to stderr, prefixed
    ``prog``. Returns (exit code: 2 bad arguments, 3 cannot run, None to go on; peer names; dtypes
    or None for the default)."""
    peers_text = args.peers if args.peers is not None else ",".join(default_peers)
    peer_names = [x.strip() for x in peers_text.split(",") if x.strip()]
    bad = [x for x in peer_names if x not in known_peers]
    if bad or not peer_names:
        print(f"{prog}: --peers: expected names from {','.join(known_peers)}, got {bad or peers_text!r}",
              file=sys.stderr)
        return 2, peer_names, None
    dtypes = [x.strip() for x in args.dtypes.split(",")] if args.dtypes else None
    try:
        grid_fn(args.quick, dtypes, args.head_dims, args.seqlens)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2, peer_names, dtypes
    except ImportError as e:           # the FLOP count needs torch and the native extension
        print(f"{prog}: cannot run: {e}", file=sys.stderr)
        return 3, peer_names, dtypes
    code = report.cannot_run(prog)
    if code is not None:
        return code, peer_names, dtypes
    return None, peer_names, dtypes


def main_from_args(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", "attention") != "attention":
        print(f"ferroattn bench: unknown benchmark {args.bench_command!r}", file=sys.stderr)
        return 2
    if getattr(args, "deterministic", False):
        print("ferroattn bench attention: --deterministic: only with --backward (the forward is always "
              "deterministic)", file=sys.stderr)
        return 2
    code, knobs = candidate.from_args("ferroattn bench attention", args)
    if code is not None:
        return code
    code, peer_names, dtypes = check_args("ferroattn bench attention", args, DEFAULT_PEERS, grid)
    if code is not None:
        return code
    _, code = run(args.quick, args.out, dtypes, args.head_dims, args.seqlens, args.rep_ms,
                  args.time_budget_s, peer_names, candidates=knobs)
    return code
