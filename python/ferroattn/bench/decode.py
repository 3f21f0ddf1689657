"""``python -m ferroattn bench decode``: the kv-cache (decode) path against SDPA cuDNN and SDPA flash.

One process, paired interleaved rounds (:func:`ferroattn.bench.timing.paired_ms`): for every point
(batch b x cache length L, q of s_q tokens, h / h_k heads, head dim d, bf16) ours
(``flash_attn_with_kvcache`` over a contiguous cache and over paged caches of several page sizes,
the same keys) and each SDPA backend on the same q / K / V ((b, h, s_q, d) and the cache as
(b, h_k, L, d) views, ``enable_gqa``). Reported: time, GB/s of K/V read (2 · b · L · h_k · d · 2
bytes), % of the measured copy bandwidth (:func:`ferroattn._measure.copy_gbps`), the ratio of each
peer's time to ours, and the paged / contiguous ratio. The JSON summary has the shape of
``bench attention``'s: ``summary.per_peer.<peer>.median_ratio / min_ratio`` (peer time / ours).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from .report import cannot_run, out_dir_error

__all__ = ["add_arguments", "run", "grid"]

PEERS = ("cudnn", "flash")


def grid(quick: bool) -> list[dict[str, Any]]:
    """The points: q of 1 (and 4) tokens, GQA 32/8 and MHA 32/32, d 128 (and 64), batch x cache."""
    batches = (1, 8, 32, 128)
    caches = (1024, 8192, 32768) if quick else (1024, 8192, 32768, 131072)
    heads = ((32, 8),) if quick else ((32, 8), (32, 32))
    dims = (128,) if quick else (128, 64)
    s_qs = (1,) if quick else (1, 4)
    pts = []
    for (h, h_k) in heads:
        for d in dims:
            for s_q in s_qs:
                for b in batches:
                    for L in caches:
                        kv_bytes = 2 * b * L * h_k * d * 2
                        if kv_bytes > 24 * 2**30:   # two copies (contiguous and paged) must fit
                            continue
                        pts.append(dict(b=b, L=L, h=h, h_k=h_k, d=d, s_q=s_q, kv_bytes=kv_bytes))
    return pts


def _pages(k, v, page: int):
    """The same keys as a paged cache: pages in a shuffled pool and the block table."""
    import torch
    b, L = k.shape[0], k.shape[1]
    n = L // page
    perm = torch.randperm(b * n, device=k.device)
    kp = torch.empty((b * n, page) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
    vp = torch.empty_like(kp)
    kp[perm] = k.reshape(b * n, page, *k.shape[2:])
    vp[perm] = v.reshape(b * n, page, *v.shape[2:])
    return kp, vp, perm.to(torch.int32).reshape(b, n)


def measure_point(p: dict, pages: tuple, rounds: int, rep_ms: float, splits: tuple = ()) -> dict[str, Any]:
    """One point: ours (contiguous; paged at each page size of ``pages`` dividing L; with each
    forced ``num_splits`` of ``splits``) and the SDPA peers, timed in paired rounds."""
    import torch
    import torch.nn.functional as F
    from ferroattn import _native, flash_attn_with_kvcache
    from . import peers
    from .timing import paired_ms
    b, L, h, h_k, d, s_q = p["b"], p["L"], p["h"], p["h_k"], p["d"], p["s_q"]
    q = torch.randn(b, s_q, h, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, L, h_k, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    fns = {"ours": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)}
    for n in splits:
        fns[f"ours_splits{n}"] = (lambda n=n: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                                                      num_splits=n))
    for page in pages:
        if L % page == 0:
            kp, vp, bt = _pages(k, v, page)
            fns[f"ours_paged{page}"] = (lambda kp=kp, vp=vp, bt=bt: flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=bt, causal=True))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    contexts = {}
    errors = {}
    for name in PEERS:
        fn = (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=s_q > 1, enable_gqa=h != h_k))
        out, err = peers.probe(name, fn)
        if err is None:
            fns[name] = fn
            contexts[name] = (lambda name=name: peers.only(name))
        else:
            errors[name] = err
    res = paired_ms(fns, rounds=rounds, rep_ms=rep_ms, contexts=contexts)
    row: dict[str, Any] = dict(p)
    row["ms"] = {n: statistics.median(ms) for n, ms in res.ms.items()}
    row["gbps"] = {n: p["kv_bytes"] / (ms * 1e-3) / 1e9 for n, ms in row["ms"].items()}
    row["ratio"] = {n: row["ms"][n] / row["ms"]["ours"] for n in row["ms"] if n in PEERS and "ours" in row["ms"]}
    row["paged_vs_contiguous"] = {n: row["ms"]["ours"] / row["ms"][n] for n in row["ms"] if n.startswith("ours_paged")}
    if splits:
        # the heuristic's count (num_splits=0) and each forced count's speed relative to it
        row["num_splits_auto"] = _native.attn_kvcache_num_splits(torch.cuda.current_device(), b, s_q, h, h_k, L, d,
                                                                 False, 0)
        row["splits_vs_auto"] = {n: row["ms"]["ours"] / row["ms"][n] for n in row["ms"] if n.startswith("ours_splits")}
    row["errors"] = {**errors, **{n: peers.error_text(e) for n, e in res.errors.items()}}
    for t in (q, k, v):
        del t
    torch.cuda.empty_cache()
    return row


def host_cost(n_calls: int = 2000) -> dict[str, Any]:
    """Host time per call (µs) of one decode step, b 1, L 1024, GQA 32/8, d 128, bf16: ours through
    ``flash_attn_with_kvcache`` (without and with a one-token append) and ``flash_attn_func``
    (routed to the same kernel), against SDPA (default backend) on the same q / K / V
    (:func:`ferroattn.bench.timing.host_us_per_call`: N back-to-back calls, one sync)."""
    import torch
    import torch.nn.functional as F
    from ferroattn import flash_attn_func, flash_attn_with_kvcache
    from .timing import host_us_per_call
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 1024, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    k1, v1 = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda"), torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cases = {
        "ours_kvcache": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
        "ours_kvcache_append": lambda: flash_attn_with_kvcache(q, k, v, k1, v1, cache_seqlens=lens, causal=True),
        "ours_flash_attn_func": lambda: flash_attn_func(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
    }
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, fn in cases.items():
            try:
                out[name] = host_us_per_call(fn, n_calls)
            except Exception as e:  # noqa: BLE001  (recorded)
                out[name] = f"{type(e).__name__}: {e}"
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m ferroattn bench decode``."""
    parser.add_argument("--quick", action="store_true", help="GQA 32/8, d 128, q of 1 token, caches 1k/8k/32k")
    parser.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")
    parser.add_argument("--pages", default="16,64,256", help="comma-separated page sizes of the paged runs")
    parser.add_argument("--num-splits", default="",
                        help="comma-separated num_splits values (1..128) also timed at every point on the contiguous "
                             "cache, against the heuristic's count (num_splits_auto, splits_vs_auto in the JSON)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds per point (default 3)")
    parser.add_argument("--rep-ms", type=float, default=20.0, help="ms of calls per timing window (default 20)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop measuring new points after this many seconds (the rest recorded as skipped)")


def run(args: argparse.Namespace) -> int:
    """Exit code: 0 ok, 2 bad arguments, 3 no GPU."""
    from .. import _native
    prog = "ferroattn bench decode"
    try:
        pages = tuple(int(x) for x in str(args.pages).split(","))   # an empty item is an error
        budget = args.time_budget_s
        if (not pages or any(pg < 1 for pg in pages) or args.rounds < 1 or not 0 < args.rep_ms < math.inf
                or (budget is not None and not 0 < budget < math.inf)):
            raise ValueError
    except ValueError:
        print(f"{prog}: --pages must be a non-empty list of positive ints, --rounds >= 1, --rep-ms and "
              f"--time-budget-s finite numbers > 0", file=sys.stderr)
        return 2
    try:
        splits = tuple(int(x) for x in str(args.num_splits).split(",")) if str(args.num_splits).strip() else ()
        if any(not 1 <= n <= _native.ATTN_KVCACHE_MAX_SPLITS for n in splits):
            raise ValueError
    except ValueError:
        print(f"{prog}: --num-splits: expected comma-separated ints in 1..{_native.ATTN_KVCACHE_MAX_SPLITS}, "
              f"got {args.num_splits!r}", file=sys.stderr)
        return 2
    error = out_dir_error(args.out)
    if error is not None:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    code = cannot_run(prog)
    if code is not None:
        return code
    from .._measure import copy_gbps
    from .report import run_metadata
    start = time.time()
    copy = copy_gbps()
    rows, skipped = [], []
    for p in grid(args.quick):
        if args.time_budget_s is not None and time.time() - start > args.time_budget_s:
            skipped.append(p)
            continue
        row = measure_point(p, pages, args.rounds, args.rep_ms, splits)
        row["pct_of_copy"] = {n: 100.0 * g / copy["gbps"] for n, g in row["gbps"].items()} if "gbps" in copy else {}
        rows.append(row)
        peer_txt = " ".join(f"{n} {row['ratio'][n]:.2f}x" for n in PEERS if n in row["ratio"])
        paged_txt = " ".join(f"{n[10:]}:{r:.2f}" for n, r in row["paged_vs_contiguous"].items())
        if splits:
            paged_txt += (f" | splits (auto {row['num_splits_auto']}) "
                          + " ".join(f"{n[11:]}:{r:.2f}" for n, r in row["splits_vs_auto"].items()))
        print(f"b {p['b']:4d} L {p['L']:6d} h {p['h']}/{p['h_k']} d {p['d']} s_q {p['s_q']}: ours "
              f"{row['ms']['ours'] * 1e3:8.1f} us {row['gbps']['ours']:7.0f} GB/s | {peer_txt} | paged/contig {paged_txt}",
              flush=True)
    host = host_cost() if not skipped or rows else {}
    if host:
        print("host us per call (b 1, L 1024, h 32/8, d 128):",
              " ".join(f"{n} {v:.1f}" for n, v in host.items() if isinstance(v, float)), flush=True)
    per_peer = {}
    for n in PEERS:
        ratios = [r["ratio"][n] for r in rows if n in r["ratio"]]
        if ratios:
            per_peer[n] = dict(median_ratio=statistics.median(ratios), min_ratio=min(ratios), points=len(ratios))
    paged = [x for r in rows for x in r["paged_vs_contiguous"].values()]
    big = [r["gbps"]["ours"] for r in rows if r["b"] * r["L"] >= 256 * 1024]
    summary = dict(per_peer=per_peer, host_us=host, paged_vs_contiguous_min=min(paged) if paged else None,
                   ours_min_gbps_where_b_x_L_ge_256k=min(big) if big else None, copy=copy)
    result = dict(meta=run_metadata(), args=vars(args) | {"func": None}, rows=rows, skipped=skipped, summary=summary)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"decode_{time.strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(summary, indent=1, default=str))
    print(f"raw JSON: {path}")
    return 0
