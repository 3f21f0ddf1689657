#!/usr/bin/env python3
"""First-call cost with a warm kernel cache, in a fresh process (run after `precompile`).

For a few attention shapes: wall time of the first ``flash_attn_func`` call (kernel looked up in
the disk cache, loaded as a module, launched) and of the second call (in-memory hit), and the
process's ``_native.jit_stats()`` counters before and after. ``compiles`` should stay 0 when
``precompile`` ran for this GPU's arch with the same ``FERROATTN_CACHE_DIR``.

``--json PATH`` also writes the figures. Exit 0 when all calls ran, 1 otherwise, 3 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = [  # (b, s, h, d, causal, dtype)
    (1, 128, 16, 64, False, "bfloat16"),
    (1, 1024, 16, 128, True, "float16"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import ferroattn
    from ferroattn import _native
    t_import = time.perf_counter() - t0
    if not torch.cuda.is_available():
        print("first_call: cannot run: no CUDA GPU found", file=sys.stderr)
        return 3
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    attn = ferroattn.flash_attn_func  # the lazy import of the torch layer stays out of the timing
    res = {"import_s": t_import, "jit_stats_before": _native.jit_stats(), "calls": []}
    ok = True
    for b, s, h, d, causal, dt in SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=getattr(torch, dt)) for _ in range(3))
        torch.cuda.synchronize()
        row = {"shape": f"b={b} s={s} h={h} d={d} causal={causal} {dt}"}
        try:
            for key in ("first_ms", "second_ms"):
                t = time.perf_counter()
                attn(q, k, v, causal=causal)
                torch.cuda.synchronize()
                row[key] = (time.perf_counter() - t) * 1e3
        except Exception as e:
            ok = False
            row["error"] = f"{type(e).__name__}: {e}"
        res["calls"].append(row)
        print(row, flush=True)
    res["jit_stats_after"] = _native.jit_stats()
    print("jit_stats before:", res["jit_stats_before"])
    print("jit_stats after: ", res["jit_stats_after"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
