#!/usr/bin/env python3
"""What ferroattn.profiler costs a model's forward, and which part costs it (GPU machine only).

Llama-3.2-1B config (seeded random weights, bf16, attn "ferroattn"), prefill of batch x seqlen
random tokens, for each shape in --shapes: the median wall time of one forward (synchronised
before and after, so host-side cost counts) over --repeats forwards, in four modes, interleaved
round by round so drift hits every mode alike:

- ``off``:      no profiler;
- ``recorder``: only the Rust launch recorder on (``_native.profiler_enable(True)``);
- ``hooks``:    only the module hooks (``profiler.attach`` with CUDA events and NVTX; the
                 recorder off);
- ``profile``:  ``ferroattn.profiler.profile(model)``, one window over all the round's forwards
                 with ``prof.step()`` after each (the way a training/serving loop uses it);
- ``torch_hooks``: torch's own cost of a no-op forward pre hook + post hook (``always_call=True``)
                 on the same modules (the floor any hook-based attribution pays);
- ``hooks_no_nvtx``: the module hooks without NVTX ranges.

Also per-call host costs measured in a loop (µs): ``torch.cuda.Event(enable_timing=True).record()``
(new event, and re-recording one), ``torch.cuda.current_stream()``, an NVTX push + pop.

Prints a table and writes {device, driver, torch, commit, date, shapes: [{shape, off_ms, ...,
pct per mode}]} as JSON to --out (default $OUT/profiler_overhead.json when $OUT is set).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time


def wall_ms(fn) -> float:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(model, ids, repeats: int) -> dict:
    import torch

    from ferroattn import _native
    from ferroattn.profiler import attach, find_targets, profile

    def fwd():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    for _ in range(3):
        fwd()
    times: dict = {"off": [], "recorder": [], "hooks": [], "profile": [], "torch_hooks": [], "hooks_no_nvtx": []}
    targets = [m for _, m in find_targets(model)]
    rounds, per_round = 3, max(1, repeats // 3)
    for _ in range(rounds):
        times["off"] += [wall_ms(fwd) for _ in range(per_round)]
        _native.profiler_enable(True)
        times["recorder"] += [wall_ms(fwd) for _ in range(per_round)]
        _native.profiler_enable(False)
        _native.profiler_drain()
        with attach(model) as att:
            for _ in range(per_round):
                times["hooks"].append(wall_ms(fwd))
                att.resolve()
        with profile(model) as prof:
            for _ in range(per_round):
                times["profile"].append(wall_ms(fwd))
                prof.step()
        handles = [h for m in targets for h in (m.register_forward_pre_hook(lambda mod, args: None),
                                                  m.register_forward_hook(lambda mod, a, o: None, always_call=True))]
        times["torch_hooks"] += [wall_ms(fwd) for _ in range(per_round)]
        for h in handles:
            h.remove()
        with attach(model, nvtx=False) as att:
            for _ in range(per_round):
                times["hooks_no_nvtx"].append(wall_ms(fwd))
                att.resolve()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {f"{k}_ms": v for k, v in med.items()}
    out.update({f"{k}_pct": 100.0 * (v / med["off"] - 1.0) for k, v in med.items() if k != "off"})
    return out


def per_call_us(n: int = 20000) -> dict:
    """Host µs per call of the primitives a hooked module call uses (median of 5 loops of n)."""
    import torch

    def loop(fn) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        return statistics.median(runs)

    ev = torch.cuda.Event(enable_timing=True)

    def nvtx():
        torch.cuda.nvtx.range_push("x")
        torch.cuda.nvtx.range_pop()
    return {"event_new_and_record_us": loop(lambda: torch.cuda.Event(enable_timing=True).record()),
            "event_rerecord_us": loop(ev.record), "current_stream_us": loop(torch.cuda.current_stream),
            "nvtx_push_pop_us": loop(nvtx)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x256,1x2048,4x1024,4x2048", help="batch x seqlen list (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="forwards per mode (default %(default)s)")
    ap.add_argument("--out", default=None, help="JSON output path (default $OUT/profiler_overhead.json)")
    args = ap.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        assert all(len(s) == 2 and min(s) >= 1 for s in shapes)
    except (ValueError, AssertionError):
        print(f"profiler_overhead: --shapes: expected e.g. 1x256,4x2048, got {args.shapes!r}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("profiler_overhead: no CUDA GPU", file=sys.stderr)
        return 3
    from ferroattn.bench.report import driver_version
    from ferroattn.profiler import build_model

    model = build_model("llama-3.2-1b", attn="ferroattn", dtype="bfloat16", seed=0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    print(f"{'shape':>9} {'off ms':>9} {'recorder':>9} {'hooks':>9} {'profile':>9} {'torch':>9} {'no nvtx':>9}"
          "   (% over off; torch = no-op hooks)")
    for b, s in shapes:
        ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen).cuda()
        r = measure(model, ids, args.repeats)
        rows.append({"shape": [b, s], **r})
        print(f"{b:>4}x{s:<4} {r['off_ms']:9.3f} {r['recorder_pct']:+8.1f}% {r['hooks_pct']:+8.1f}% "
              f"{r['profile_pct']:+8.1f}% {r['torch_hooks_pct']:+8.1f}% {r['hooks_no_nvtx_pct']:+8.1f}%")
    micro = per_call_us()
    print("per call (host us):", {k: round(v, 2) for k, v in micro.items()})
    doc = {"kind": "profiler_overhead", "device": torch.cuda.get_device_name(0), "driver": driver_version(),
           "torch": torch.__version__, "commit": os.environ.get("FERROATTN_COMMIT"),
           "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "method": "median wall ms of one synchronised forward; modes interleaved in 3 rounds",
           "repeats_per_mode": args.repeats, "shapes": rows, "per_call_host_us": micro}
    out = args.out or (os.path.join(os.environ["OUT"], "profiler_overhead.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
