"""Attention-backward benchmark: ferroattn against torch SDPA (flash and cuDNN backends).

``python -m ferroattn bench attention --backward [--quick] [--deterministic] [--out DIR] ...``

Grid: the forward benchmark's (:func:`ferroattn.bench.attention.grid`, FlashAttention-3 paper:
16k tokens per batch, hidden 2048 as (head_dim, heads) = (64, 32), (128, 16), (256, 8), seqlen
512 ... 16k, causal and not, bf16 and fp16). Every configuration is timed in two modes, with
the same method for every implementation:

- ``bwd`` (backward alone): the forward runs once per rotating input set OUTSIDE the timed
  region (its autograd graph is kept); the timed call is
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``;
- ``fwd_bwd`` (forward + backward): the timed call is ``out = attention(q, k, v)`` followed by
  ``torch.autograd.grad(out, (q, k, v), dout)``.

FLOPs (DESIGN §5): backward = 2.5 x forward, forward + backward = 3.5 x forward, forward counted
as the forward benchmark does (4·b·h·d per visible query-key pair): :func:`report.bwd_flops`,
:func:`report.fwd_bwd_flops`. Implementations: ours = ``ferroattn.flash_attn_func`` on
(b, s, h, d) leaves (``deterministic`` from ``--deterministic``), peers = SDPA restricted to one
backend on (b, h, s, d) leaves (each its natural contiguous layout; dout likewise). Timing:
:func:`timing.bench_gpu` (median, L2 cleared before each call) over rotating input sets. A guard
against fast-but-wrong: ``max_abs_diff`` = the largest |ours - peer| over dQ, dK and dV
(``grad_diff`` per gradient) against the first peer that ran. A peer that cannot run a point (in
either mode) is recorded as null with the reason.

Writes ``attention_bwd_<device>_<date>.json`` (:func:`report.write_json`, rewritten after every
configuration so a killed run keeps its points) into ``--out`` (default ``bench/results``):
``meta`` (device, driver, torch, commit, date), ``config``, ``ceilings``, ``points`` {mode: [grid
points]}, ``summary`` (:func:`report.summarize_backward`: per mode median/min ratio ours/SDPA-flash
over head dims 64 and 128 and over the whole grid, every peer, per-configuration ratios, the
issue's target). Prints one table per mode, the per-configuration ratios and the summary.
``--time-budget-s``: no new configuration starts after that many seconds (the rest is recorded
as skipped). Exit 0 when ours was measured at every point, 1 when ours failed somewhere or a
point was skipped for a fatal error, 3 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

from . import attention, candidate, report, timing

MODES = ("bwd", "fwd_bwd")
DEFAULT_PEERS = ("flash", "cudnn")
FLOPS = {"bwd": report.bwd_flops, "fwd_bwd": report.fwd_bwd_flops}


def grid(quick: bool = False, dtypes: Sequence[str] | None = None, head_dims: Sequence[int] | None = None,
         seqlens: Sequence[int] | None = None) -> dict[str, list[dict]]:
    """{mode: grid points}: the forward grid's configurations (same order, same filters and
    errors), each point's ``flops`` being that mode's FLOPs and ``fwd_flops`` the forward's."""
    base = attention.grid(quick, dtypes, head_dims, seqlens)
    out: dict[str, list[dict]] = {}
    for mode in MODES:
        pts = []
        for p in base:
            q = {k: v for k, v in p.items() if k != "flops"}
            q["mode"] = mode
            q["fwd_flops"] = p["flops"]
            q["flops"] = FLOPS[mode](p["batch"], p["heads"], p["seqlen"], p["seqlen"], p["head_dim"], p["causal"])
            pts.append(q)
        out[mode] = pts
    return out


def make_inputs(b: int, s: int, h: int, d: int, dtype: str, l2_bytes: int,
                device: str = "cuda") -> tuple[list[dict], list[dict]]:
    """Rotating input sets for ours ((b, s, h, d)) and for SDPA ((b, h, s, d), the same values):
    each a dict of leaf tensors q, k, v (requires_grad) and dout."""
    import torch
    dt = getattr(torch, attention.TORCH_DTYPE[dtype])
    bytes_per_set = 5 * b * s * h * d * 2          # q, k, v, dout, out
    n = timing.rotation_count(bytes_per_set, l2_bytes)
    ours, sdpa = [], []
    for _ in range(n):
        q, k, v, do = (torch.randn(b, s, h, d, device=device, dtype=dt) for _ in range(4))
        ours.append({"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(), "dout": do})
        t = [x.detach().transpose(1, 2).contiguous() for x in (q, k, v, do)]
        sdpa.append({"q": t[0].requires_grad_(), "k": t[1].requires_grad_(), "v": t[2].requires_grad_(), "dout": t[3]})
    return ours, sdpa


def _leaves(s: dict) -> tuple:
    return s["q"], s["k"], s["v"]


def time_impl(fwd: Callable, sets: list[dict], rep_ms: float, warmup_ms: float) -> dict:
    """Time one implementation in both modes. ``fwd(q, k, v)`` returns the attention output.
    Returns {"grads": (dq, dk, dv) of set 0, "bwd": ms | exception, "fwd_bwd": ms | exception};
    raises when the first forward + backward fails (then neither mode can be timed)."""
    res: dict[str, Any] = {}
    res["grads"], res["bwd"] = _time_bwd(fwd, sets, rep_ms, warmup_ms)   # its graphs are freed on return
    res["fwd_bwd"] = _time_fwd_bwd(fwd, sets, rep_ms, warmup_ms)
    return res


def _time_bwd(fwd: Callable, sets: list[dict], rep_ms: float, warmup_ms: float) -> tuple[tuple, Any]:
    """(grads of set 0, ms or exception) of the backward alone (module docstring)."""
    import torch
    outs = [fwd(*_leaves(s)) for s in sets]             # forward once per set, outside the timed region
    grads = torch.autograd.grad(outs[0], _leaves(sets[0]), sets[0]["dout"], retain_graph=True)
    torch.cuda.synchronize()
    rot = timing.Rotating(list(zip(outs, sets)))

    def bwd():
        o, s = rot.next()
        return torch.autograd.grad(o, _leaves(s), s["dout"], retain_graph=True)
    try:
        return grads, timing.bench_gpu(bwd, rep_ms, warmup_ms)
    except Exception as e:
        return grads, e


def _time_fwd_bwd(fwd: Callable, sets: list[dict], rep_ms: float, warmup_ms: float) -> Any:
    """ms or exception of forward + backward (module docstring)."""
    import torch
    rot = timing.Rotating(sets)

    def fwd_bwd():
        s = rot.next()
        return torch.autograd.grad(fwd(*_leaves(s)), _leaves(s), s["dout"])
    try:
        return timing.bench_gpu(fwd_bwd, rep_ms, warmup_ms)
    except Exception as e:
        return e


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _grad_diff(ours: Sequence, peer: Sequence) -> dict[str, float]:
    """max |ours - peer| per gradient; peer grads are (b, h, s, d), ours (b, s, h, d)."""
    return {name: float((a.float() - b.transpose(1, 2).float()).abs().max())
            for name, a, b in zip(("dq", "dk", "dv"), ours, peer)}


def measure_config(pts: dict[str, dict], ours_sets: list[dict], sdpa_sets: list[dict], peer_names: Sequence[str],
                   ceiling_tflops: float | None, rep_ms: float, warmup_ms: float,
                   deterministic: bool = False,
                   candidates: dict[str, dict[str, str]] | None = None) -> dict[str, dict]:
    """Measure one configuration in every mode. ``pts`` maps mode -> that mode's grid point (same
    configuration); each is filled in place (:mod:`.report` point format, plus ``grad_diff``, and
    with ``candidates`` their :mod:`.candidate` entries)."""
    import torch
    import torch.nn.functional as F
    import ferroattn
    from . import peers as peers_mod
    from ..knobs import override

    p0 = next(iter(pts.values()))
    causal = p0["causal"]
    for p in pts.values():
        p.update(ours=None, ours_error=None, peers={}, peer_errors={}, ratio={}, max_abs_diff=None,
                 diff_ref=None, grad_diff=None, skipped=None)

    def ours_fwd(q, k, v):
        return ferroattn.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

    ours_grads = None
    try:
        r = time_impl(ours_fwd, ours_sets, rep_ms, warmup_ms)
        ours_grads = r["grads"]
        for mode, p in pts.items():
            if isinstance(r[mode], BaseException):
                p["ours_error"] = _err(r[mode])
                continue
            tf = report.tflops(p["flops"], r[mode])
            p["ours"] = {"ms": r[mode], "tflops": tf,
                         "pct_ceiling": (100.0 * tf / ceiling_tflops) if (tf and ceiling_tflops) else None}
    except Exception as e:
        for p in pts.values():
            p["ours_error"] = _err(e)
    for label, knobs in (candidates or {}).items():
        try:
            with override(**knobs):
                rc = time_impl(ours_fwd, ours_sets, rep_ms, warmup_ms)
            diff = None if ours_grads is None else max(
                float((a.float() - b.float()).abs().max()) for a, b in zip(rc["grads"], ours_grads))
            del rc["grads"]
            for mode, p in pts.items():
                if isinstance(rc[mode], BaseException):
                    candidate.record_error(p, label, rc[mode])
                else:
                    candidate.record(p, label, rc[mode], diff)
        except Exception as e:
            for p in pts.values():
                candidate.record_error(p, label, e)

    def peer_fwd(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for name in peer_names:
        try:
            with peers_mod.only(name):
                r = time_impl(peer_fwd, sdpa_sets, rep_ms, warmup_ms)
        except Exception as e:
            _, why = peers_mod.probe(name, lambda: peer_fwd(*_leaves(sdpa_sets[0])))
            for p in pts.values():
                p["peers"][name] = None
                p["peer_errors"][name] = why or _err(e)
                p["ratio"][name] = None
            continue
        if ours_grads is not None and p0["diff_ref"] is None:
            gd = _grad_diff(ours_grads, r["grads"])
            for p in pts.values():
                p.update(grad_diff=gd, max_abs_diff=max(gd.values()), diff_ref=name)
        del r["grads"]
        for mode, p in pts.items():
            if isinstance(r[mode], BaseException):
                p["peers"][name] = None
                p["peer_errors"][name] = _err(r[mode])
            else:
                p["peers"][name] = {"ms": r[mode], "tflops": report.tflops(p["flops"], r[mode])}
            ours_tf = (p["ours"] or {}).get("tflops")
            peer = p["peers"][name]
            p["ratio"][name] = (ours_tf / peer["tflops"]) if (ours_tf and peer and peer["tflops"]) else None
    del ours_grads
    torch.cuda.synchronize()
    return pts


def _skip(pts: dict[str, dict], reason: str) -> None:
    for p in pts.values():
        p.update(skipped=reason, ours=None, peers={}, ratio={}, peer_errors={}, ours_error=None,
                 max_abs_diff=None, diff_ref=None, grad_diff=None)


def run(quick: bool = False, out_dir: str = "bench/results", dtypes: Sequence[str] | None = None,
        head_dims: Sequence[int] | None = None, seqlens: Sequence[int] | None = None,
        rep_ms: float | None = None, time_budget_s: float | None = None,
        peer_names: Sequence[str] = DEFAULT_PEERS, deterministic: bool = False,
        printer: Callable[[str], None] = print,
        candidates: dict[str, dict[str, str]] | None = None) -> tuple[dict, int]:
    """Run the backward benchmark; return (result dict, exit code). Needs a CUDA GPU.
    ``candidates``: {label: tuning knobs}, ours measured again under each (:mod:`.candidate`)."""
    import torch
    from . import ceilings

    t_start = time.monotonic()
    rep = rep_ms if rep_ms is not None else (30.0 if quick else 100.0)
    warm = min(25.0, rep / 2)
    by_mode = grid(quick, dtypes, head_dims, seqlens)
    n_cfg = len(by_mode[MODES[0]])
    meta = report.run_metadata()
    l2 = meta.get("l2_bytes") or 50 * 2**20
    ref_peer = peer_names[0] if peer_names else "flash"
    printer(f"device {meta.get('device')} | driver {meta.get('driver')} | torch {meta.get('torch')} | "
            f"commit {meta.get('commit')} | {n_cfg} configurations x {len(MODES)} modes | backward "
            f"{'deterministic' if deterministic else 'default (atomics)'} | timing: {timing.method_name()}")
    ceil = ceilings.measure()
    mm = ceil.get("matmul_bf16")
    ceiling_tflops = mm["tflops"] if mm else None
    printer("ceilings: bf16 matmul " + (f"{mm['tflops']:.0f} TFLOP/s" if mm else f"n/a ({ceil.get('matmul_bf16_error')})"))

    def result(partial: bool) -> dict:
        return {
            "meta": meta,
            "config": {"quick": quick, "tokens": attention.TOKENS, "hidden": 2048, "rep_ms": rep, "warmup_ms": warm,
                       "timing": timing.method_name(), "peers": list(peer_names), "modes": list(MODES),
                       "deterministic": deterministic,
                       "method": {"bwd": "forward once per input set outside the timed region; timed: "
                                         "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)",
                                  "fwd_bwd": "timed: out = attention(q, k, v); torch.autograd.grad(out, (q, k, v), dout)"},
                       "flops": report.FLOPS_RULE + "; backward 2.5x forward; forward+backward 3.5x forward",
                       "time_budget_s": time_budget_s, "elapsed_s": time.monotonic() - t_start},
            "partial": partial,
            "ceilings": ceil,
            "points": by_mode,
            "summary": report.summarize_backward(by_mode, ref_peer=ref_peer),
            "candidates": None if not candidates else
            {mode: candidate.summarize(by_mode[mode], candidates) for mode in MODES},
        }

    bar = attention._progress(n_cfg)
    fatal = None
    groups: dict[tuple, list[dict[str, dict]]] = {}
    for i in range(n_cfg):
        p = by_mode[MODES[0]][i]
        groups.setdefault((p["dtype"], p["head_dim"], p["heads"], p["seqlen"], p["batch"]), []).append(
            {m: by_mode[m][i] for m in MODES})
    for (dt, d, h, s, b), cfgs in groups.items():
        over = time_budget_s is not None and time.monotonic() - t_start > time_budget_s
        if fatal or over:
            for c in cfgs:
                _skip(c, fatal or f"time budget of {time_budget_s:.0f} s used up")
            bar.update(len(cfgs))
            continue
        try:
            ours_sets, sdpa_sets = make_inputs(b, s, h, d, dt, l2)
        except Exception as e:
            for c in cfgs:
                _skip(c, f"inputs: {_err(e)}")
            bar.update(len(cfgs))
            continue
        for c in cfgs:
            measure_config(c, ours_sets, sdpa_sets, peer_names, ceiling_tflops, rep, warm, deterministic,
                           candidates)
            errs = [p.get("ours_error") for p in c.values()]
            if any(attention._is_fatal(e) for e in errs):
                fatal = "skipped after a fatal CUDA error in ours: " + next(e for e in errs if attention._is_fatal(e))[:200]
            r = c["bwd"]["ratio"].get(ref_peer)
            bar.set_postfix_str(f"{dt} d={d} s={s} {'causal' if c['bwd']['causal'] else 'full'}"
                                + (f" bwd x{ref_peer}={r:.2f}" if r else ""))
            bar.update(1)
        del ours_sets, sdpa_sets
        torch.cuda.empty_cache()
        report.write_json(result(partial=True), out_dir, kind="attention_bwd")   # same file: survives a kill
    bar.close()

    final = result(partial=False)
    summary = final["summary"]
    path = report.write_json(final, out_dir, kind="attention_bwd")
    for mode in MODES:
        printer(f"== {report.MODE_TITLES[mode]} ==")
        printer(report.format_table(by_mode[mode], peer_names))
    printer("== ratios ours/peer per configuration ==")
    printer(report.format_per_config(summary, peer_names))
    printer(f"raw JSON: {path}")
    printer(report.format_summary_backward(summary, ceil))
    for mode in MODES if candidates else ():
        printer(candidate.format_summary(final["candidates"][mode], report.MODE_TITLES[mode]))
    failed = sum(s["n_ours_failed"] for s in summary["modes"].values())
    measured = sum(s["n_measured"] for s in summary["modes"].values())
    code = 0 if failed == 0 and measured > 0 and not fatal else 1
    return final, code


def main_from_args(args: argparse.Namespace) -> int:
    """``bench attention --backward``: validate the arguments (exit 2), check for a GPU (exit 3), run."""
    code, knobs = candidate.from_args("ferroattn bench attention --backward", args)
    if code is not None:
        return code
    code, peer_names, dtypes = attention.check_args("ferroattn bench attention --backward", args, DEFAULT_PEERS,
                                                     grid)
    if code is not None:
        return code
    _, code = run(args.quick, args.out, dtypes, args.head_dims, args.seqlens, args.rep_ms,
                  args.time_budget_s, peer_names, deterministic=bool(getattr(args, "deterministic", False)),
                  candidates=knobs)
    return code
