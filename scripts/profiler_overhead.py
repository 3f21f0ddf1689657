#!/usr/bin/env python3
"""What ferroattn.profiler costs a model's forward, and which part costs it (GPU machine only).

Llama-3.2-1B config (seeded random weights, bf16, attn "ferroattn"), prefill of batch x seqlen
random tokens, for each shape in --shapes. Modes (what is on during the timed forwards):

- ``off``:           nothing;
- ``recorder``:      only the Rust launch recorder (``_native.profiler_enable(True)``);
- ``hooks``:         only the module hooks as ``profile`` uses them (``profiler.attach``: forward
                     wrappers, native marks; NVTX ranges only when an NVTX tool is attached, i.e.
                     none here unless run under Nsight);
- ``hooks_no_nvtx``: the same with NVTX ranges off explicitly;
- ``hooks_torch``:   the module hooks in torch-hook mode (``attach(mode="torch")``, native marks);
- ``torch_noop``:    torch's own cost of a no-op forward pre hook + post hook (``always_call``)
                     on the same modules (the floor of any torch-hook-based attribution);
- ``profile``:       ``ferroattn.profiler.profile(model)`` (hooks + recorder), ``prof.step()`` after
                     each forward (outside the timed region), as a training/serving loop uses it;
- ``torch_profiler``: ``torch.profiler.profile()`` (its defaults: CPU + CUDA activities) around the
                     same forwards, ``step()`` after each: torch.profiler's own cost, the reference
                     of the cost budget.

The budget (:mod:`ferroattn.profiler.cost`): ``profile`` costs no more than ``torch_profiler`` on
the same forward (paired rounds of this run), and at most 5 % on GPU-bound forwards (4 x 1024 and
larger). With both modes measured, each shape gets a ``cost_rule`` verdict (JSON) and a printed
line with both costs.

Method (robust to the drift and noise of host-bound forwards): rounds; in each round every mode
runs (set up, one untimed forward, ``--per-round`` timed forwards, torn down) in an order rotated
by one each round (round robin), so drift and order effects hit every mode alike. A mode's cost
in a round is its mean time over the round's ``off`` mean (a paired ratio); the overhead is the
median of the paired ratios minus 1 (in %), with a 95 % bootstrap interval of that median
(2000 resamples of the rounds, seeded) and the inter-quartile range of the ratios. Two times per
forward: ``wall`` (synchronised before and after: everything the caller waits for) and ``host``
(from the call to its return, before the final synchronisation: the host time to issue the
forward; it includes waits inside the forward, e.g. transformers' own host syncs).
Rounds: as many as fit the time budget (``--budget-s``, whole script; at least --min-rounds).

Also per-call host costs measured in loops (µs): ``torch.cuda.Event(enable_timing=True).record()``
(new event, and re-recording one), ``torch.cuda.current_stream()``,
``torch._C._cuda_getCurrentRawStream``, a native mark (``_native.profiler_mark``, released in
bulk afterwards), an NVTX push + pop.

Prints a table and writes the JSON (layout: ``doc`` in :func:`main`) to --out (default
$OUT/profiler_overhead.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import statistics
import sys
import time

T0 = time.perf_counter()
MODES = ("off", "recorder", "hooks", "hooks_no_nvtx", "hooks_torch", "torch_noop", "profile", "torch_profiler")
#: Diagnostic modes (``--modes``): where a hooked call's host time goes. hooks_no_marks: the default
#: hooks with the timestamps replaced by a constant (no driver call); hooks_bare: also no NVTX, no
#: shapes, no record_function probe (the wrapper and its bookkeeping alone); hooks_marks_only: the
#: bare hooks plus the native timestamps.
DIAGNOSTIC_MODES = ("hooks_no_marks", "hooks_bare", "hooks_marks_only", "hooks_noop_native", "hooks_nvtx",
                    "hooks_old", "hooks_pyw", "hooks_marks_only_pyw", "profile_pyw", "profile_lazy",
                    "hooks_nomark_native")
#: hooks_nomark_native: the native per-call path (marks_only options) whose marks come from a stand-in
#: ``_native`` whose ``profiler_mark`` returns 0 (no driver call): (hooks_marks_only -
#: hooks_nomark_native) / marks per forward = a mark's in-situ host cost (JSON, per shape:
#: ``in_situ_per_mark_us``).
#: A/B of the native per-call path in one run: *_pyw: the Python per-call wrapper (``native_wrap=False``;
#: its marks are ``_native.profiler_mark``, capture check at every mark: the older per-call path)
#: instead of the native one (``_native.ProfilerForward``: one native call per hooked
#: call, marks straight from Rust, the legacy-stream capture check once per root call);
#: profile_lazy: profile() resolving finished calls at every 4th step (``harvest_forwards = 4``)
#: instead of at every step (the default). In the 2026-11-30 05:44 run (profiler_overhead_*_T0544)
#: the default then was every 4th step: its "profile_eager" is today's profile, its "profile" is
#: today's profile_lazy, its "profile_old" is today's profile_pyw.
#: hooks_noop_native: the bare hooks whose two "marks" per call are a raw-stream lookup plus a
#: trivial native call (``_native.profiler_enabled()``, no driver call): with hooks_bare and
#: hooks_marks_only it splits a mark's in-situ cost into the Python->Rust call and the rest (the
#: driver's cuEventRecord and the pool bookkeeping).
#: hooks_nvtx: the default hooks with NVTX ranges forced on (``attach(nvtx=True)``; by default they
#: are pushed only when an NVTX tool is attached); hooks_old: the hooks module given by
#: --old-hooks (a copy of an earlier python/ferroattn/profiler/hooks.py), default options: an A/B
#: of the Python per-call path in the same run.
OLD_HOOKS = None
#: GPU gaps between consecutive depth-1 siblings (µs; one list per forward, boundaries in call
#: order), from the ``hooks`` mode's records: what sharing one mark between a call's end and the
#: next sibling's start would hide.
GAPS: list = []


def _sibling_gaps(recs) -> list:
    """start(next) - end(previous) in µs for consecutive depth-1 records of one forward."""
    d1 = sorted((r for r in recs if r.depth == 1), key=lambda r: r.start_us)
    return [b.start_us - (a.start_us + 1e3 * a.gpu_ms) for a, b in zip(d1, d1[1:])]


def _quantile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise(ratios, seed=0, resamples=2000) -> dict:
    """Overhead in % from paired per-round ratios: median, 95 % bootstrap interval of the
    median, inter-quartile range."""
    pct = [100.0 * (r - 1.0) for r in ratios]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(pct, k=len(pct))) for _ in range(resamples))
    return {"pct": statistics.median(pct), "ci95": [_quantile(meds, 0.025), _quantile(meds, 0.975)],
            "iqr": [_quantile(pct, 0.25), _quantile(pct, 0.75)], "rounds": len(pct)}


class Modes:
    """Set-up / tear-down of each mode around a block of forwards (``after`` runs after each
    timed forward, outside the timed region)."""

    def __init__(self, model):
        import torch

        from ferroattn import _native
        from ferroattn.profiler import find_targets
        self.model, self.native, self.torch = model, _native, torch
        self.targets = [m for _, m in find_targets(model)]

    @contextlib.contextmanager
    def on(self, mode):
        from ferroattn.profiler import attach, profile
        after = (lambda: None)
        if mode == "off":
            yield after
        elif mode == "recorder":
            self.native.profiler_enable(True)
            try:
                yield after
            finally:
                self.native.profiler_enable(False)
                self.native.profiler_drain()
        elif mode in ("hooks_no_marks", "hooks_bare", "hooks_marks_only", "hooks_noop_native", "hooks_marks_only_pyw"):
            kw = {} if mode == "hooks_no_marks" else {"nvtx": False, "record_shapes": False, "record_function": False}
            if mode != "hooks_marks_only":   # these replace att._mark: the Python wrapper calls it
                kw["native_wrap"] = False
            with attach(self.model, **kw) as att:
                if mode == "hooks_noop_native":
                    raw, noop, dev = self.torch._C._cuda_getCurrentRawStream, self.native.profiler_enabled, att.device

                    def fake_mark():
                        raw(dev)
                        return 0 if noop() is False else 0
                    att._mark = fake_mark
                elif mode not in ("hooks_marks_only", "hooks_marks_only_pyw"):
                    att._mark = lambda: 0    # no timestamp: nothing to resolve afterwards
                yield (lambda: att.discard())
        elif mode == "hooks_nomark_native":
            with attach(self.model, nvtx=False, record_shapes=False, record_function=False, native_wrap=True,
                        native=_NoMarkNative()) as att:
                yield (lambda: att.discard())
        elif mode == "hooks_old":
            with OLD_HOOKS.attach(self.model) as att:
                yield att.resolve
        elif mode == "hooks":
            with attach(self.model) as att:
                yield (lambda: GAPS.append(_sibling_gaps(att.resolve())))
        elif mode == "hooks_pyw":
            with attach(self.model, native_wrap=False) as att:
                yield att.resolve
        elif mode in ("hooks_no_nvtx", "hooks_torch", "hooks_nvtx"):
            kw = {"nvtx": False} if mode == "hooks_no_nvtx" else {"mode": "torch"} if mode == "hooks_torch" \
                else {"nvtx": True}
            with attach(self.model, **kw) as att:
                yield att.resolve
        elif mode == "torch_noop":
            handles = [h for m in self.targets
                       for h in (m.register_forward_pre_hook(lambda mod, args: None),
                                 m.register_forward_hook(lambda mod, a, o: None, always_call=True))]
            try:
                yield after
            finally:
                for h in handles:
                    h.remove()
        elif mode == "torch_profiler":
            with self.torch.profiler.profile() as tp:
                yield tp.step
        elif mode in ("profile", "profile_pyw", "profile_lazy"):
            kw = {"native_wrap": False} if mode == "profile_pyw" else {}
            with profile(self.model, **kw) as prof:
                if mode == "profile_lazy":
                    prof.harvest_forwards = 4
                yield prof.step
        else:
            raise ValueError(mode)


class _NoMarkNative:
    """The ``_native`` mark functions with no driver call: ``profiler_mark`` returns 0 (no mark),
    so a native per-call path built over it runs everything but the mark (hooks_nomark_native)."""

    @staticmethod
    def profiler_mark(stream, device):
        return 0

    @staticmethod
    def profiler_marks_query(marks):
        return [True] * len(marks)

    @staticmethod
    def profiler_marks_resolve(marks, reference_event=None):
        return [None] * len(marks)

    @staticmethod
    def profiler_marks_release(marks):
        return 0


def _rounded(d):
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return round(d, 3) if isinstance(d, float) else d


def _short(d) -> str:
    """A printable summary (floats rounded)."""
    return str(_rounded(d))


def in_situ_per_mark(row: dict, marks_per_forward: int) -> dict:
    """Host µs per mark in situ from a shape's modes: (hooks_marks_only - hooks_nomark_native)
    ms / marks per forward, host and wall; {} unless both modes ran."""
    m = row["modes"]
    mode, base = m.get("hooks_marks_only"), m.get("hooks_nomark_native")
    if mode is None or base is None:
        return {}
    return {f"event_{t}_us": 1e3 * (mode[f"{t}_ms"] - base[f"{t}_ms"]) / marks_per_forward for t in ("host", "wall")}


#: Python garbage collections (per generation) that started inside timed forwards, per mode
#: (gc.callbacks); a profiler that keeps objects alive can make the interpreter collect more often.
_GC = {"on": False, "counts": [0, 0, 0]}
GC_TIMED: dict = {}


def _gc_callback(phase, info):
    if phase == "start" and _GC["on"]:
        _GC["counts"][info["generation"]] += 1


def timed(torch, fwd):
    """(wall ms, host ms) of one forward."""
    torch.cuda.synchronize()
    _GC["on"] = True
    t0 = time.perf_counter()
    fwd()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    _GC["on"] = False
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3


def one_round(modes: Modes, fwd, order, per_round: int) -> dict:
    """{mode: (mean wall ms, mean host ms)} of one round."""
    torch = modes.torch
    out = {}
    for mode in order:
        with modes.on(mode) as after:
            fwd()                      # untimed: first call after set-up
            after()
            walls, hosts = [], []
            before = list(_GC["counts"])
            for _ in range(per_round):
                w, h = timed(torch, fwd)
                walls.append(w)
                hosts.append(h)
                after()
            acc = GC_TIMED.setdefault(mode, {"forwards": 0, "gen0": 0, "gen1": 0, "gen2": 0})
            acc["forwards"] += per_round
            for g in range(3):
                acc[f"gen{g}"] += _GC["counts"][g] - before[g]
        out[mode] = (statistics.fmean(walls), statistics.fmean(hosts))
    return out


def measure(modes: Modes, fwd, rounds: int, per_round: int, deadline: float, gpu_bound: bool = False) -> dict:
    """Round-robin rounds until ``rounds`` or the deadline (at least 3); summary per mode, and the
    cost budget's verdict (``cost_rule``: :func:`ferroattn.profiler.cost.cost_verdict` on the wall
    times of off / profile / torch_profiler) when both profilers were measured."""
    rows = []
    for r in range(rounds):
        if r >= 3 and time.perf_counter() > deadline:
            break
        k = r % len(MODES)
        rows.append(one_round(modes, fwd, MODES[k:] + MODES[:k], per_round))
    out = {"rounds": len(rows), "per_round": per_round,
           "off_ms": statistics.median(x["off"][0] for x in rows),
           "off_host_ms": statistics.median(x["off"][1] for x in rows), "modes": {}}
    for mode in MODES[1:]:
        wall = summarise([x[mode][0] / x["off"][0] for x in rows])
        host = summarise([x[mode][1] / x["off"][1] for x in rows])
        out["modes"][mode] = {"wall_ms": statistics.median(x[mode][0] for x in rows), "wall": wall,
                              "host_ms": statistics.median(x[mode][1] for x in rows), "host": host}
        out[f"{mode}_pct"] = wall["pct"]          # flat keys, as the first version of this script wrote
    if "profile" in MODES and "torch_profiler" in MODES:
        from ferroattn.profiler.cost import cost_verdict
        out["cost_rule"] = cost_verdict([x["off"][0] for x in rows], [x["profile"][0] for x in rows],
                                        [x["torch_profiler"][0] for x in rows], gpu_bound)
    return out


def per_call_us(n: int = 10000) -> dict:
    """Host µs per call of the primitives a hooked module call uses (median of 5 loops of n)."""
    import torch

    from ferroattn import _native

    def loop(fn, after=None) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
            if after is not None:
                after()
        torch.cuda.synchronize()
        return statistics.median(runs)

    ev = torch.cuda.Event(enable_timing=True)
    dev = torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream
    marks: list = []

    def nvtx():
        torch.cuda.nvtx.range_push("x")
        torch.cuda.nvtx.range_pop()

    def release():
        _native.profiler_marks_release(marks)
        marks.clear()
    out = {"event_new_and_record_us": loop(lambda: torch.cuda.Event(enable_timing=True).record()),
           "event_rerecord_us": loop(ev.record), "current_stream_us": loop(torch.cuda.current_stream),
           "raw_stream_us": loop(lambda: raw(dev)), "nvtx_push_pop_us": loop(nvtx)}
    if hasattr(_native, "profiler_mark"):
        out["native_mark_us"] = loop(lambda: marks.append(_native.profiler_mark(raw(dev), dev)), release)
        # in situ-like: a mark after a small kernel launch (GPU busy or just idle), and after ~20 µs
        # of host work (GPU idle): the mark's cost = the pair's time minus the time without it
        x = torch.zeros(256, device="cuda")
        m = max(1, n // 5)

        def spin():
            t = time.perf_counter() + 20e-6
            while time.perf_counter() < t:
                pass

        def pair_loop(work, with_mark):
            def body():
                work()
                if with_mark:
                    marks.append(_native.profiler_mark(raw(dev), dev))
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(m):
                    body()
                runs.append((time.perf_counter() - t0) / m * 1e6)
                torch.cuda.synchronize()
                release()
            return statistics.median(runs)
        for label, work in (("after_kernel", lambda: x.add_(1)), ("after_host_20us", spin)):
            base, with_mark = pair_loop(work, False), pair_loop(work, True)
            out[f"native_mark_{label}_us"] = with_mark - base
            out[f"{label}_alone_us"] = base
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):   # a non-legacy stream: the capture check runs
            out["native_mark_side_stream_us"] = loop(
                lambda: marks.append(_native.profiler_mark(raw(dev), dev)), release)
        # one hooked call of a module with no GPU work (torch.nn.Identity as the root), per wrapper:
        # Module.__call__ + the per-call path + its two marks; "plain": Module.__call__ alone
        from ferroattn.profiler import attach
        ident, xs = torch.nn.Identity(), torch.zeros(1, device="cuda")
        k = max(1, n // 5)

        def call_loop():
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(k):
                    ident(xs)
                runs.append((time.perf_counter() - t0) / k * 1e6)
                torch.cuda.synchronize()
                if att is not None:
                    att.discard()
            return statistics.median(runs)
        att = None
        out["identity_plain_us"] = call_loop()
        for label, kw in (("native", {}), ("pyw", {"native_wrap": False})):
            with attach(ident, **kw) as att:
                out[f"identity_hooked_{label}_us"] = call_loop()
                out[f"identity_hooked_{label}_is_native"] = att._native_forward is not None
            att = None
    return out


def main(argv=None) -> int:
    global MODES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x256,1x2048,4x1024,4x2048", help="batch x seqlen list (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=40, help="most rounds per shape (default %(default)s)")
    ap.add_argument("--min-rounds", type=int, default=8, help="fewest rounds per shape (default %(default)s)")
    ap.add_argument("--per-round", type=int, default=2, help="timed forwards per mode per round (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=75.0,
                    help="wall-clock budget of the whole script in s; rounds are cut to fit (default %(default)s)")
    ap.add_argument("--out", default=None, help="JSON output path (default $OUT/profiler_overhead.json)")
    ap.add_argument("--old-hooks", default=None, help="path of an earlier hooks.py for the hooks_old mode")
    ap.add_argument("--modes", default=None,
                    help="modes compared with off, from " + ",".join(MODES[1:] + DIAGNOSTIC_MODES) + " (default "
                         + ",".join(MODES[1:]) + ")")
    args = ap.parse_args(argv)
    if args.modes is None:
        args.modes = ",".join(MODES[1:])
    chosen = tuple(m for m in args.modes.split(",") if m)
    if not chosen or not set(chosen) <= set(MODES[1:] + DIAGNOSTIC_MODES):
        print(f"profiler_overhead: bad --modes {args.modes!r}: expected a comma-separated subset of "
              f"{','.join(MODES[1:] + DIAGNOSTIC_MODES)}", file=sys.stderr)
        return 2
    MODES = ("off",) + chosen
    if "hooks_old" in chosen:
        if not args.old_hooks:
            print("profiler_overhead: --modes hooks_old needs --old-hooks PATH", file=sys.stderr)
            return 2
        import importlib.util
        global OLD_HOOKS
        spec = importlib.util.spec_from_file_location("ferroattn.profiler._hooks_old", args.old_hooks)
        OLD_HOOKS = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(OLD_HOOKS)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 2 and min(s) >= 1 for s in shapes)
        assert args.rounds >= 3 and args.min_rounds >= 3 and args.per_round >= 1 and args.budget_s > 0
    except (ValueError, AssertionError):
        print(f"profiler_overhead: bad arguments: --shapes {args.shapes!r} (e.g. 1x256,4x2048), --rounds >= 3, "
              f"--min-rounds >= 3, --per-round >= 1, --budget-s > 0", file=sys.stderr)
        return 2
    import gc
    gc.callbacks.append(_gc_callback)
    import torch
    if not torch.cuda.is_available():
        print("profiler_overhead: no CUDA GPU", file=sys.stderr)
        return 3
    from ferroattn.bench.report import driver_version
    from ferroattn.profiler import build_model
    from ferroattn.profiler.cost import format_verdict, is_gpu_bound

    model = build_model("llama-3.2-1b", attn="ferroattn", dtype="bfloat16", seed=0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    modes = Modes(model)
    micro = per_call_us()
    print("per call (host us):", {k: round(v, 2) for k, v in micro.items()}, flush=True)
    inputs = []
    for b, s in shapes:
        ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen).cuda()

        def fwd(ids=ids):
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False)
        for _ in range(3):
            fwd()
        inputs.append(fwd)
    # time per round per shape, from one calibration round each (counts toward nothing)
    t_round = []
    for fwd in inputs:
        t = time.perf_counter()
        one_round(modes, fwd, MODES, args.per_round)
        t_round.append(time.perf_counter() - t)
    left = args.budget_s - (time.perf_counter() - T0) - 2.0
    rounds = max(min(args.min_rounds, args.rounds), min(args.rounds, int(left / max(sum(t_round), 1e-3))))
    print(f"rounds per shape: {rounds} (round times {', '.join(f'{t:.2f}' for t in t_round)} s; "
          f"{left:.0f} s left)", flush=True)
    rows = []
    hdr = "".join(f"{m:>15}" for m in MODES[1:])
    print(f"{'shape':>9} {'off ms':>8}{hdr}   (wall % over off: median of paired rounds [95% CI])")
    share = [max(0.0, left) * t / sum(t_round) for t in t_round]   # each shape's slice of the budget, s
    for (b, s), fwd, slice_s in zip(shapes, inputs, share):
        GAPS.clear()
        GC_TIMED.clear()
        r = measure(modes, fwd, rounds, args.per_round, time.perf_counter() + slice_s, is_gpu_bound(b, s))
        r["gc_in_timed_forwards"] = {m: dict(v) for m, v in GC_TIMED.items()}
        per_forward = [g for g in GAPS if len(g) == len(GAPS[0])] if GAPS else []
        r["sibling_gaps_us"] = ({"forwards": len(per_forward),
                                 "median_per_boundary": [statistics.median(c) for c in zip(*per_forward)],
                                 "max_per_boundary": [max(c) for c in zip(*per_forward)]}
                                if per_forward else None)
        rows.append({"shape": [b, s], **r})
        cells = "".join(f"{r['modes'][m]['wall']['pct']:+6.1f} [{r['modes'][m]['wall']['ci95'][0]:+.0f},"
                        f"{r['modes'][m]['wall']['ci95'][1]:+.0f}]".rjust(15) for m in MODES[1:])
        print(f"{b:>4}x{s:<4} {r['off_ms']:8.2f}{cells}  ({r['rounds']} rounds)", flush=True)
        hcells = "".join(f"{r['modes'][m]['host']['pct']:+6.1f}".rjust(15) for m in MODES[1:])
        print(f"{'host':>9} {r['off_host_ms']:8.2f}{hcells}", flush=True)
    for row in rows:
        if "cost_rule" in row:
            print(format_verdict(row["cost_rule"], f"cost budget {row['shape'][0]}x{row['shape'][1]}"), flush=True)
    n_mod = len(modes.targets)
    for row in rows:
        if "hooks_nomark_native" in row["modes"]:
            row["in_situ_per_mark_us"] = in_situ_per_mark(row, 2 * n_mod)
            print(f"in situ per mark ({row['shape'][0]}x{row['shape'][1]}):", _short(row["in_situ_per_mark_us"]),
                  flush=True)
    for row in rows:   # host µs per hooked module call implied by each hooks mode (the default: 2 marks each)
        for mode in (m for m in MODES if m.startswith("hooks")):
            key = "hooks_us_per_module_call" if mode == "hooks" else f"{mode}_us_per_module_call"
            row[key] = 1e3 * (row["modes"][mode]["host_ms"] - row["off_host_ms"]) / n_mod
    doc = {"kind": "profiler_overhead", "device": torch.cuda.get_device_name(0), "driver": driver_version(),
           "torch": torch.__version__, "commit": os.environ.get("FERROATTN_COMMIT"),
           "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "method": "round robin over modes (order rotated each round); per round and mode the mean of "
                     f"{args.per_round} timed forwards after one untimed; overhead = median over rounds of the "
                     "paired ratio mode/off - 1, 95% bootstrap CI of that median, IQR; wall = synchronised "
                     "before and after, host = until the forward call returns",
           "cost_rule": "ferroattn.profiler.cost: profile costs no more than torch_profiler (fails only when the "
                        "95% interval of the median paired difference (profile - torch_profiler) / off lies above 0), "
                        "and <= 5% (median paired ratio) on GPU-bound forwards (batch x seqlen >= 4096)",
           "hooked_modules": n_mod, "modes": list(MODES), "shapes": rows, "per_call_host_us": micro,
           "elapsed_s": time.perf_counter() - T0}
    out = args.out or (os.path.join(os.environ["OUT"], "profiler_overhead.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {out}")
    print(f"profiler_overhead: {doc['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
