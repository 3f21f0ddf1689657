"""Attention-variant benchmark: ferroattn with each variant against ferroattn plain, FlexAttention
(``torch.compile``) and SDPA where SDPA can express the variant.

``python -m ferroattn bench attention --variants [LIST] [--backward] [--seqlens 8192,32768] ...``

Grid: b 1, h 32, d 128, causal, bf16, seqlen 8k and 32k (``--quick``: 8k only), variants
(``--variants`` takes a comma-separated subset; ``plain`` always runs):

- ``plain``: causal attention, the baseline of the overhead ratios;
- ``window``: a causal local window ``window_size=(4096, 0)`` (a query sees itself and the 4096
  keys before it);
- ``softcap``: ``softcap=50``;
- ``alibi``: ``alibi_slopes``, (h,) fp32 geometric slopes ``2^(-8 (i + 1) / h)`` (ALiBi paper);
- ``dropout``: ``dropout_p=0.1``;
- ``sinks``: ``s_aux``, (h,) fp32 sink logits (random normal; with ``--backward`` a leaf that
  requires grad, so the backward also computes its gradient, as training does).

Modes: ``fwd``; with ``--backward`` also ``bwd`` (the backward alone, as :mod:`.attention_bwd`
times it: the forward runs once per input set outside the timed region, the timed call is
``torch.autograd.grad(out, leaves, dout, retain_graph=True)``). With ``--backward`` the leaves
require grad in both modes: the forward is timed as training runs it, and FlexAttention compiles
once per (variant, shape).

Implementations: ours = ``ferroattn.flash_attn_func`` on (b, s, h, d) with the variant's
arguments (``deterministic`` from ``--deterministic``); FlexAttention and SDPA on (b, h, s, d)
(the same values) as :mod:`.peers` builds them. A variant ours rejects (NotImplementedError, or a
TypeError for an argument this build does not take) is null with the reason
(``ours_unsupported``), which is not a failure; so is a peer that cannot express a variant or
fails on it (``peer_errors``).

Timing: ours -- all variants of one (seqlen, mode) -- in :func:`timing.paired_ms` rounds (A B ..
B A, :data:`ROUNDS` rounds), so ours-variant / ours-plain is a paired ratio
(:func:`timing.paired_ratio`: median over rounds, with its confidence interval); each peer once
with :func:`timing.bench_gpu` (median). Input sets rotate (:func:`timing.rotation_count`).
FlexAttention compiles in a first call outside the timed region (``first_call_s`` records every
first call).

FLOPs over the visible pairs (:func:`report.fwd_flops` / :func:`report.bwd_flops`, from
:func:`report.visible_pairs`): the window counts only the pairs inside it; softcap, ALiBi,
dropout and sinks do not change the count. Overhead of a variant (:func:`report.variant_overhead`):
cost per visible pair relative to plain at the same seqlen and mode, ``(ms / ms_plain) /
visible_fraction - 1`` (= TF/s plain / TF/s variant - 1); targets :data:`OVERHEAD_TARGET`,
softcap :data:`SOFTCAP_OVERHEAD_TARGET`. For the window it is also its time against its fraction
of the visible pairs.

Guard against fast-but-wrong: ``max_abs_diff[peer]`` = max |ours - peer| of the output (fwd) or
over the gradients (bwd; per gradient in ``grad_diff``) on the same inputs; none for dropout
(random masks differ).

Writes ``attn_variants_<device>_<date>.json`` (:func:`report.write_json`, rewritten after every
(seqlen, mode) so a killed run keeps its points) into ``--out`` (default ``bench/results``),
prints the table, the raw JSON path and the summary (:func:`report.summarize_variants`).
``--time-budget-s``: no new (seqlen, mode) starts after that many seconds. Exit 0 when ours ran
every variant it supports everywhere, 1 when ours failed somewhere (other than rejecting a
variant) or nothing was measured, 2 for bad arguments, 3 without a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

from . import attention, attention_bwd, report, timing
from . import peers as peers_mod

BATCH, HEADS, HEAD_DIM = 1, 32, 128
DTYPES = ("bf16",)
SEQLENS = (8192, 32768)
QUICK_SEQLENS = (8192,)
WINDOW = (4096, 0)
SOFTCAP = 50.0
DROPOUT_P = 0.1
#: overhead targets of a variant against plain (cost per visible pair)
OVERHEAD_TARGET = 0.10
SOFTCAP_OVERHEAD_TARGET = 0.25
#: paired rounds of ours' variants per (seqlen, mode)
ROUNDS = 2
DEFAULT_REP_MS = 50.0
MODES = ("fwd", "bwd")
FLOPS = {"fwd": report.fwd_flops, "bwd": report.bwd_flops}
PEER_NAMES = ("flex", "flash", "cudnn", "efficient", "math")
DEFAULT_PEERS = ("flex", "flash", "cudnn", "efficient")
KIND = "attn_variants"


@dataclass(frozen=True)
class Variant:
    """One attention variant (always causal): the flash_attn arguments that differ from plain."""
    name: str
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout_p: float = 0.0
    sinks: bool = False
    target: float | None = OVERHEAD_TARGET

    def args(self) -> dict[str, Any]:
        """The variant's arguments for the JSON (tensors described, not stored)."""
        out: dict[str, Any] = {}
        if self.window_size != (-1, -1):
            out["window_size"] = list(self.window_size)
        if self.softcap:
            out["softcap"] = self.softcap
        if self.alibi:
            out["alibi_slopes"] = "(h,) fp32, 2^(-8 (i + 1) / h)"
        if self.dropout_p:
            out["dropout_p"] = self.dropout_p
        if self.sinks:
            out["s_aux"] = "(h,) fp32, random normal"
        return out


def variant_table(window: tuple[int, int] = WINDOW) -> dict[str, Variant]:
    """The variants by name, in run order."""
    return {"plain": Variant("plain", target=None),
            "window": Variant("window", window_size=(int(window[0]), int(window[1]))),
            "softcap": Variant("softcap", softcap=SOFTCAP, target=SOFTCAP_OVERHEAD_TARGET),
            "alibi": Variant("alibi", alibi=True),
            "dropout": Variant("dropout", dropout_p=DROPOUT_P),
            "sinks": Variant("sinks", sinks=True)}


VARIANTS = tuple(variant_table())


def parse_variants(text: str | Sequence[str] | None) -> list[str]:
    """``--variants``: None / "all" -> every variant; else a comma-separated subset (plain is
    always added first: it is the overhead baseline). ValueError naming --variants otherwise."""
    if text is None or (isinstance(text, str) and text.strip() == "all"):
        return list(VARIANTS)
    items = [x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    bad = [x for x in items if x not in VARIANTS]
    if bad or not items:
        raise ValueError(f"--variants: expected names from {','.join(VARIANTS)} (or all), got "
                         f"{','.join(bad) if bad else repr(text)}")
    return [n for n in VARIANTS if n == "plain" or n in items]


def modes_for(backward: bool) -> tuple[str, ...]:
    return MODES if backward else MODES[:1]


def grid(variants: str | Sequence[str] | None = None, seqlens: Sequence[int] | None = None, backward: bool = False,
         quick: bool = False, dtypes: Sequence[str] | None = None, heads: int = HEADS, head_dim: int = HEAD_DIM,
         window: tuple[int, int] = WINDOW) -> list[dict]:
    """The grid points (without measurements) in run order: dtype, seqlen, mode, variant."""
    names = parse_variants(variants)
    table = variant_table(window)
    dts = tuple(dtypes) if dtypes else DTYPES
    bad = [x for x in dts if x not in attention.DTYPES]
    if bad:
        raise ValueError(f"--dtypes: expected a subset of {','.join(attention.DTYPES)}, got {','.join(dts)}")
    sls = tuple(seqlens) if seqlens else (QUICK_SEQLENS if quick else SEQLENS)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sls):
        raise ValueError(f"--seqlens: expected positive integers, got {list(sls)}")
    pts = []
    for dt in dts:
        for s in sls:
            plain_pairs = report.visible_pairs(s, s, True)
            for mode in modes_for(backward):
                for n in names:
                    v = table[n]
                    pairs = report.visible_pairs(s, s, True, v.window_size)
                    pts.append({"variant": n, "variant_args": v.args(), "mode": mode, "dtype": dt, "causal": True,
                                "batch": BATCH, "heads": heads, "head_dim": head_dim, "seqlen": s,
                                "window_size": list(v.window_size), "visible_pairs": pairs,
                                "visible_fraction": pairs / plain_pairs if plain_pairs else None,
                                "flops": FLOPS[mode](BATCH, heads, s, s, head_dim, True, v.window_size),
                                "target": v.target})
    return pts


# ---- inputs and implementations ------------------------------------------------------------

def make_inputs(b: int, s: int, h: int, d: int, dtype: str, l2_bytes: int, backward: bool,
                device: str = "cuda") -> tuple[list[dict], list[dict]]:
    """Rotating input sets (:func:`attention_bwd.make_inputs`: dicts of q, k, v, dout) for ours
    ((b, s, h, d)) and for the peers ((b, h, s, d), the same values); without ``backward`` the
    tensors do not require grad."""
    ours, bhsd = attention_bwd.make_inputs(b, s, h, d, dtype, l2_bytes, device)
    if not backward:
        ours, bhsd = ([{k: t.detach() for k, t in st.items()} for st in sets] for sets in (ours, bhsd))
    return ours, bhsd


def make_params(heads: int, device: Any, backward: bool) -> dict[str, Any]:
    """The variants' tensors: ``alibi_slopes`` (h,) fp32 ``2^(-8 (i + 1) / h)`` and ``s_aux``
    (h,) fp32 random normal (requires grad with ``backward``)."""
    import torch
    i = torch.arange(1, heads + 1, dtype=torch.float32, device=device)
    s_aux = torch.randn(heads, dtype=torch.float32, device=device)
    return {"alibi_slopes": torch.exp2(-8.0 * i / heads), "s_aux": s_aux.requires_grad_(backward)}


def ours_kwargs(v: Variant, params: dict[str, Any], deterministic: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``ferroattn.flash_attn_func`` for variant ``v`` (plain: causal only)."""
    kw: dict[str, Any] = {"causal": True}
    if v.window_size != (-1, -1):
        kw["window_size"] = v.window_size
    if v.softcap:
        kw["softcap"] = v.softcap
    if v.alibi:
        kw["alibi_slopes"] = params["alibi_slopes"]
    if v.dropout_p:
        kw["dropout_p"] = v.dropout_p
    if v.sinks:
        kw["s_aux"] = params["s_aux"]
    if deterministic:
        kw["deterministic"] = True
    return kw


def ours_fn(v: Variant, params: dict[str, Any], deterministic: bool = False) -> Callable:
    import ferroattn
    kw = ours_kwargs(v, params, deterministic)
    return lambda q, k, v_: ferroattn.flash_attn_func(q, k, v_, **kw)


#: (fn(q, k, v) on (b, h, s, d), None) or (None, why the peer cannot run the variant)
PeerCall = tuple[Callable | None, str | None]


def _tensor_args(v: Variant, params: dict[str, Any]) -> tuple[Any, Any]:
    return (params["alibi_slopes"] if v.alibi else None), (params["s_aux"] if v.sinks else None)


def peer_fns(table: dict[str, Variant], names: Sequence[str], peer_names: Sequence[str], s: int,
             params: dict[str, Any], dtype: Any, device: Any) -> dict[str, dict[str, PeerCall]]:
    """{peer: {variant: (fn(q, k, v) on (b, h, s, d), None) or (None, reason)}}. The SDPA call of a
    variant (and its mask) is built once and shared by the SDPA backends."""
    out: dict[str, dict[str, PeerCall]] = {p: {} for p in peer_names}
    sdpa: dict[str, PeerCall] = {}
    for n in names:
        v = table[n]
        slopes, s_aux = _tensor_args(v, params)
        for peer in peer_names:
            if peer == "flex":
                built, why = peers_mod.attempt(lambda: peers_mod.flex_variant(
                    v.window_size, v.softcap, slopes, v.dropout_p, s_aux, s, s, device))
            else:
                if n not in sdpa:
                    built, why = peers_mod.attempt(lambda: peers_mod.sdpa_variant(
                        v.window_size, v.softcap, slopes, v.dropout_p, s_aux, s, s, dtype, device))
                    sdpa[n] = built if built is not None else (None, f"building the SDPA call: {why}")
                built, why = sdpa[n], None
            out[peer][n] = built if built is not None else (None, why)
    return out


def _context(peer: str) -> Callable[[], ContextManager[Any]]:
    if peer == "flex" or peer == "ours":
        return contextlib.nullcontext
    return lambda: peers_mod.only(peer)


# ---- one measurement ---------------------------------------------------------------------

@dataclass
class Prepared:
    """An implementation ready to time: ``check`` (its output, or its gradients, on input set 0),
    ``timed`` (the zero-argument call to time) and ``first_call_s`` (wall time of the first call
    and the preparation, compilation included)."""
    check: Any
    timed: Callable[[], Any]
    first_call_s: float


def _leaves(s: dict) -> tuple:
    return s["q"], s["k"], s["v"]


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prepare(fwd: Callable, sets: list[dict], extra: tuple, mode: str,
            context: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Prepared:
    """``fwd(q, k, v)`` made ready to time in ``mode`` (module docstring) inside ``context()``;
    ``extra``: further leaves whose gradients the backward computes (the sinks)."""
    import torch
    t0 = time.perf_counter()
    with context():
        if mode == "fwd":
            check = fwd(*_leaves(sets[0])).detach()
            _sync()
            rot = timing.Rotating(sets)

            def timed():
                return fwd(*_leaves(rot.next()))
        else:
            outs = [fwd(*_leaves(s)) for s in sets]             # outside the timed region; graphs kept
            check = tuple(g.detach() for g in torch.autograd.grad(outs[0], _leaves(sets[0]) + extra,
                                                                   sets[0]["dout"], retain_graph=True))
            _sync()
            rot = timing.Rotating(list(zip(outs, sets)))

            def timed():
                o, s = rot.next()
                return torch.autograd.grad(o, _leaves(s) + extra, s["dout"], retain_graph=True)
    return Prepared(check, timed, time.perf_counter() - t0)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def unsupported_reason(e: BaseException) -> str | None:
    """The reason when ``e`` says ours does not implement a variant (NotImplementedError, or a
    TypeError for a keyword this build's flash_attn_func does not take); None for a failure."""
    if isinstance(e, NotImplementedError):
        return _err(e)
    if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
        return f"{_err(e)} (this build does not take the variant's argument)"
    return None


def _diff(ours: Any, peer: Any, mode: str) -> tuple[float, dict[str, float] | None]:
    """max |ours - peer| (peer tensors of rank 4 are (b, h, s, d), ours (b, s, h, d))."""
    def one(a, b):
        b = b.transpose(1, 2) if b.dim() == 4 else b
        return float((a.float() - b.float()).abs().max())
    if mode == "fwd":
        return one(ours, peer), None
    gd = {name: one(a, b) for name, a, b in zip(("dq", "dk", "dv", "ds_aux"), ours, peer)}
    return max(gd.values()), gd


def _extra(v: Variant, params: dict[str, Any], mode: str) -> tuple:
    s_aux = params.get("s_aux")
    return (s_aux,) if (mode == "bwd" and v.sinks and s_aux is not None and s_aux.requires_grad) else ()


def measure_group(pts: dict[str, dict], table: dict[str, Variant], ours_sets: list[dict], peer_sets: list[dict],
                  params: dict[str, Any], fns: dict[str, dict[str, PeerCall]],
                  peer_names: Sequence[str], mode: str, ceiling_tflops: float | None, rep_ms: float,
                  warmup_ms: float, rounds: int = ROUNDS, deterministic: bool = False) -> dict[str, dict]:
    """Measure every variant of one (seqlen, mode): ``pts`` maps variant name -> grid point (filled
    in place); ``fns`` is :func:`peer_fns`' table for this seqlen."""
    for p in pts.values():
        p.update(ours=None, ours_error=None, ours_unsupported=None, overhead=None, peers={}, peer_errors={},
                 ratio={}, max_abs_diff={}, grad_diff={}, first_call_s={}, skipped=None)
    prepared: dict[str, Prepared] = {}
    checks: dict[str, Any] = {}
    for name, p in pts.items():
        v = table[name]
        try:
            pr = prepare(ours_fn(v, params, deterministic), ours_sets, _extra(v, params, mode), mode)
        except Exception as e:  # noqa: BLE001  (recorded)
            why = unsupported_reason(e)
            p["ours_unsupported" if why else "ours_error"] = why or _err(e)
            continue
        prepared[name], checks[name] = pr, pr.check
        p["first_call_s"]["ours"] = pr.first_call_s
    if prepared:
        res = timing.paired_ms({n: pr.timed for n, pr in prepared.items()}, rounds, rep_ms / (2 * rounds),
                               warmup_ms / (2 * rounds))
        for n, e in res.errors.items():
            pts[n]["ours_error"] = _err(e)
        for n, per_round in res.ms.items():
            p = pts[n]
            ms = float(statistics.median(per_round))
            tf = report.tflops(p["flops"], ms)
            p["ours"] = {"ms": ms, "tflops": tf, "ms_rounds": per_round,
                         "pct_ceiling": (100.0 * tf / ceiling_tflops) if (tf and ceiling_tflops) else None}
        base = res.ms.get("plain")
        for n, per_round in res.ms.items():
            if n != "plain" and base is not None and pts[n]["visible_fraction"]:
                pts[n]["overhead"] = report.variant_overhead(timing.paired_ratio(per_round, base),
                                                             pts[n]["visible_fraction"], pts[n]["target"])
        del res
    del prepared
    for peer in peer_names:
        ctx = _context(peer)
        for name, p in pts.items():
            v = table[name]
            p["ratio"][peer] = None
            fn, why = fns[peer][name]
            pr = None
            if fn is not None:
                pr, why = peers_mod.attempt(lambda: prepare(fn, peer_sets, _extra(v, params, mode), mode, ctx))
            if pr is None:
                p["peers"][peer] = None
                p["peer_errors"][peer] = why
                continue
            p["first_call_s"][peer] = pr.first_call_s
            if name in checks and not v.dropout_p:
                p["max_abs_diff"][peer], gd = _diff(checks[name], pr.check, mode)
                if gd is not None:
                    p["grad_diff"][peer] = gd
            try:
                with ctx():
                    ms = timing.bench_gpu(pr.timed, rep_ms, warmup_ms)
            except Exception as e:  # noqa: BLE001
                p["peers"][peer] = None
                p["peer_errors"][peer] = _err(e)
                continue
            finally:
                pr = None                                       # frees its graphs before the next peer
            p["peers"][peer] = {"ms": ms, "tflops": report.tflops(p["flops"], ms)}
            ours_tf = (p["ours"] or {}).get("tflops")
            peer_tf = p["peers"][peer]["tflops"]
            p["ratio"][peer] = (ours_tf / peer_tf) if (ours_tf and peer_tf) else None
    del checks
    _sync()
    return pts


def _skip(pts: Sequence[dict], reason: str) -> None:
    for p in pts:
        p.update(skipped=reason, ours=None, ours_error=None, ours_unsupported=None, overhead=None, peers={},
                 peer_errors={}, ratio={}, max_abs_diff={}, grad_diff={}, first_call_s={})


# ---- the run -----------------------------------------------------------------------------

def run(variants: str | Sequence[str] | None = None, seqlens: Sequence[int] | None = None, backward: bool = False,
        quick: bool = False, out_dir: str = "bench/results", dtypes: Sequence[str] | None = None,
        rep_ms: float | None = None, time_budget_s: float | None = None,
        peer_names: Sequence[str] = DEFAULT_PEERS, deterministic: bool = False, rounds: int = ROUNDS,
        heads: int = HEADS, head_dim: int = HEAD_DIM, window: tuple[int, int] = WINDOW, device: str = "cuda",
        printer: Callable[[str], None] = print) -> tuple[dict, int]:
    """Run the variant benchmark; return (result dict, exit code). Needs a CUDA GPU (``device``,
    ``heads``, ``head_dim`` and ``window`` are for tests)."""
    import torch
    from . import ceilings

    t_start = time.monotonic()
    rep = rep_ms if rep_ms is not None else DEFAULT_REP_MS
    warm = min(25.0, rep / 2)
    table = variant_table(window)
    names = parse_variants(variants)
    modes = modes_for(backward)
    points = grid(names, seqlens, backward, quick, dtypes, heads, head_dim, window)
    meta = report.run_metadata()
    l2 = meta.get("l2_bytes") or 50 * 2**20
    printer(f"device {meta.get('device')} | driver {meta.get('driver')} | torch {meta.get('torch')} | "
            f"commit {meta.get('commit')} | variants {','.join(names)} | modes {','.join(modes)} | "
            f"{len(points)} points | peers {','.join(peer_names)}")
    ceil = ceilings.measure()
    mm = ceil.get("matmul_bf16")
    ceiling_tflops = mm["tflops"] if mm else None
    printer("ceilings: bf16 matmul " + (f"{mm['tflops']:.0f} TFLOP/s" if mm
                                        else f"n/a ({ceil.get('matmul_bf16_error')})"))

    def result(partial: bool) -> dict:
        return {
            "meta": meta,
            "config": {"batch": BATCH, "heads": heads, "head_dim": head_dim, "causal": True, "modes": list(modes),
                       "variants": {n: table[n].args() for n in names},
                       "targets": {n: table[n].target for n in names if table[n].target is not None},
                       "peers": list(peer_names), "deterministic": deterministic, "rep_ms": rep, "warmup_ms": warm,
                       "rounds": rounds,
                       "timing": {"ours": timing.method_name(rounds), "peers": timing.method_name()},
                       "method": {"fwd": "timed: out = attention(q, k, v)" + (" (leaves require grad)" if backward
                                                                               else ""),
                                  "bwd": "forward once per input set outside the timed region; timed: "
                                         "torch.autograd.grad(out, (q, k, v[, s_aux]), dout, retain_graph=True)"},
                       "flex_compile": {k: repr(v) for k, v in peers_mod.FLEX_COMPILE.items()},
                       "sdpa_mask_cap_bytes": peers_mod.SDPA_MASK_CAP_BYTES,
                       "flops": report.FLOPS_RULE + "; backward 2.5x forward",
                       "overhead": "(ms_variant / ms_plain) / visible_fraction - 1, paired rounds",
                       "max_abs_diff": "max |ours - peer| of the output (fwd) or over the gradients (bwd); "
                                       "none for dropout",
                       "time_budget_s": time_budget_s, "elapsed_s": time.monotonic() - t_start},
            "partial": partial,
            "ceilings": ceil,
            "points": points,
            "summary": report.summarize_variants(points, peer_names),
        }

    groups: dict[tuple, dict[str, dict[str, dict]]] = {}
    for p in points:
        groups.setdefault((p["dtype"], p["seqlen"]), {}).setdefault(p["mode"], {})[p["variant"]] = p
    bar = attention._progress(sum(len(g) for g in groups.values()))
    fatal = None
    with peers_mod.flex_settings():
        for (dt, s), by_mode in groups.items():
            over = time_budget_s is not None and time.monotonic() - t_start > time_budget_s
            if fatal or over:
                for pts in by_mode.values():
                    _skip(list(pts.values()), fatal or f"time budget of {time_budget_s:.0f} s used up")
                bar.update(len(by_mode))
                continue
            try:
                ours_sets, peer_sets = make_inputs(BATCH, s, heads, head_dim, dt, l2, backward, device)
                q0 = peer_sets[0]["q"]
                params = make_params(heads, q0.device, backward)
                fns = peer_fns(table, names, peer_names, s, params, q0.dtype, q0.device)
            except Exception as e:  # noqa: BLE001
                for pts in by_mode.values():
                    _skip(list(pts.values()), f"inputs: {_err(e)}")
                bar.update(len(by_mode))
                continue
            for mode, pts in by_mode.items():
                over = time_budget_s is not None and time.monotonic() - t_start > time_budget_s
                if fatal or over:
                    _skip(list(pts.values()), fatal or f"time budget of {time_budget_s:.0f} s used up")
                    bar.update(1)
                    continue
                measure_group(pts, table, ours_sets, peer_sets, params, fns, peer_names, mode, ceiling_tflops, rep,
                              warm, rounds, deterministic)
                errs = [p["ours_error"] for p in pts.values() if p.get("ours_error")]
                if any(attention._is_fatal(e) for e in errs):
                    fatal = "skipped after a fatal CUDA error in ours: " + next(e for e in errs
                                                                               if attention._is_fatal(e))[:200]
                bar.set_postfix_str(f"{dt} s={s} {mode}")
                bar.update(1)
                report.write_json(result(partial=True), out_dir, kind=KIND)   # same file: survives a kill
            del ours_sets, peer_sets, params, fns
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bar.close()

    final = result(partial=False)
    summary = final["summary"]
    path = report.write_json(final, out_dir, kind=KIND)
    printer(report.format_variants_table(points, peer_names))
    printer(f"raw JSON: {path}")
    printer(report.format_variants_summary(summary))
    code = 0 if summary["n_ours_failed"] == 0 and summary["n_measured"] > 0 and not fatal else 1
    return final, code


def main_from_args(args: argparse.Namespace) -> int:
    """``bench attention --variants [LIST]``: validate the arguments (exit 2), check for a GPU
    (exit 3), run."""
    prog = "ferroattn bench attention --variants"
    backward = bool(getattr(args, "backward", False))
    if getattr(args, "deterministic", False) and not backward:
        print(f"{prog}: --deterministic: only with --backward (the forward is always deterministic)",
              file=sys.stderr)
        return 2
    if args.head_dims:
        print(f"{prog}: --head-dims: the variant grid is fixed at d={HEAD_DIM}, h={HEADS}", file=sys.stderr)
        return 2
    if getattr(args, "candidate", None) is not None:
        print(f"{prog}: --candidate: only for the plain grid (forward or --backward)", file=sys.stderr)
        return 2
    try:
        names = parse_variants(args.variants)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2

    def grid_fn(quick, dtypes, head_dims, seqlens):
        return grid(names, seqlens, backward, quick, dtypes)
    code, peer_names, dtypes = attention.check_args(prog, args, DEFAULT_PEERS, grid_fn, PEER_NAMES)
    if code is not None:
        return code
    _, code = run(names, args.seqlens, backward, args.quick, args.out, dtypes, args.rep_ms, args.time_budget_s,
                  peer_names, deterministic=bool(getattr(args, "deterministic", False)))
    return code
