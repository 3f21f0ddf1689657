"""Where the host time of one small eager attention call goes (GPU machine; writes JSON).

For each case (a small ``flash_attn_func`` forward, a decode step through ``flash_attn_with_kvcache``
without and with a one-token append and through ``flash_attn_func``, the same calls through the
Python path with the one-call native path off, and SDPA on the same tensors), three figures:

- ``host_us``: wall time per call of back-to-back calls (:func:`ferroattn.bench.timing.host_us_per_call`),
  the median of ``--rounds`` paired rounds (each round times every case in turn, N / rounds calls
  each); ``vs_sdpa``: the median per-round ratio of each of our calls to SDPA on the same call;
- ``profile``: the ``cProfile`` top functions by own time over N calls (µs per call; cProfile's own
  cost inflates every Python-level entry alike, so read the shares, not the sums);
- ``pieces``: µs per call of the building blocks in isolation (DLPack import of a CUDA tensor,
  ``torch.empty`` on CUDA, the stream query, the eager-path check, the variant's construction, the
  native launcher called directly with ready arguments).

    PYTHONPATH=/tmp/site python3 scripts/host_time_breakdown.py [--out DIR] [--calls N]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import ferroattn
from ferroattn import _native, flash_attn_func, flash_attn_with_kvcache
from ferroattn.bench.timing import host_us_per_call
from ferroattn.ops import _eager
from ferroattn.ops.variant import AttnVariant


# (ours, SDPA on the same call): the per-round ratio ours / SDPA is reported for each
PAIRS = (("flash_attn_func_b1_s128_h16_d64", "sdpa_b1_s128_h16_d64"),
         ("kvcache_decode_b1_L1024_gqa32_8_d128", "sdpa_decode_gqa"),
         ("kvcache_append_decode", "sdpa_decode_gqa"),
         ("flash_attn_func_decode_L1024_gqa32_8_d128", "sdpa_decode_gqa"))


def per_call(fn, n: int) -> float:
    """µs per call of a host-only function (no GPU work to wait for)."""
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def profile(fn, n: int, top: int = 25) -> list[dict]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{os.path.basename(file)}:{line}:{name}", "calls_per_call": nc / n,
                     "own_us": tt / n * 1e6, "cum_us": ct / n * 1e6})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def _python_path(fn):
    """``fn`` with the eager fast path off (ops/_eager.ENABLED): flash_attn_func / with_kvcache take
    their Python path through the custom ops, as before the one-call native path existed."""
    def call():
        _eager.ENABLED = False
        try:
            return fn()
        finally:
            _eager.ENABLED = True
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10, help="paired rounds the calls are split into")
    a = ap.parse_args()
    if a.rounds < 1 or a.calls < a.rounds:
        ap.error(f"--rounds must be >= 1 and --calls >= --rounds, got --rounds {a.rounds} --calls {a.calls}")
    if not torch.cuda.is_available():
        raise SystemExit("host_time_breakdown.py: cannot run: no CUDA GPU found (torch.cuda.is_available() is False)")
    n = a.calls
    dev = "cuda"
    bf = torch.bfloat16
    q, k, v = (torch.randn(1, 128, 16, 64, device=dev, dtype=bf) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=bf)
    kc = torch.randn(1, 1024, 8, 128, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    k1, v1 = torch.randn(1, 1, 8, 128, device=dev, dtype=bf), torch.randn(1, 1, 8, 128, device=dev, dtype=bf)
    lens = torch.full((1,), 1000, dtype=torch.int32, device=dev)
    qdt, kct, vct = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    cases = {
        "flash_attn_func_b1_s128_h16_d64": lambda: flash_attn_func(q, k, v),
        "sdpa_b1_s128_h16_d64": lambda: F.scaled_dot_product_attention(qt, kt, vt),
        "kvcache_decode_b1_L1024_gqa32_8_d128": lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens),
        "kvcache_append_decode": lambda: flash_attn_with_kvcache(qd, kc, vc, k1, v1, cache_seqlens=lens, causal=True),
        "sdpa_decode_gqa": lambda: F.scaled_dot_product_attention(qdt, kct, vct, enable_gqa=True),
        # transformers' generate step: one token against the cache through flash_attn_func
        "flash_attn_func_decode_L1024_gqa32_8_d128": lambda: flash_attn_func(qd, kc, vc, causal=True),
        # the same calls through the Python path (the one-call native path switched off)
        "python_path_flash_attn_func_b1_s128_h16_d64": _python_path(lambda: flash_attn_func(q, k, v)),
        "python_path_kvcache_decode": _python_path(lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens)),
        "python_path_flash_attn_func_decode": _python_path(lambda: flash_attn_func(qd, kc, vc, causal=True)),
    }
    res: dict = {"torch": torch.__version__, "ferroattn": getattr(ferroattn, "__version__", None),
                 "device": torch.cuda.get_device_name(), "n_calls": n, "cases": {}}
    # paired: every round times each case in turn (n / rounds calls), so a slow phase of the host
    # hits all cases alike; the figure is the median round, the ratios are per round
    rounds = a.rounds
    per_round = {name: [] for name in cases}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in cases.items():
                per_round[name].append(host_us_per_call(fn, max(n // rounds, 1), warmup=10))
        for name, fn in cases.items():
            res["cases"][name] = {"host_us": statistics.median(per_round[name]), "rounds_us": per_round[name],
                                  "profile": profile(fn, n)}
        res["vs_sdpa"] = {
            ours: {"sdpa_case": peer,
                   "median_ratio": statistics.median(o / p for o, p in zip(per_round[ours], per_round[peer]))}
            for ours, peer in PAIRS}
        out = torch.empty_like(q)
        lse = torch.empty(1, 16, 128, device=dev, dtype=torch.float32)
        var = AttnVariant.from_flash_attn(False, (-1, -1), 0.0, None, None, 128, 128, 0.0, q.device)
        stream = torch._C._cuda_getCurrentRawStream(0)
        pieces = {
            "dlpack_info_cuda": lambda: _native.dlpack_info(q),
            "torch_empty_like_cuda": lambda: torch.empty_like(q),
            "torch_empty_lse_cuda": lambda: torch.empty(1, 16, 128, device=dev, dtype=torch.float32),
            "current_raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
            "current_device": lambda: torch.cuda.current_device(),
            "plain_eager": lambda: _eager.plain_eager((q, k, v)),
            "variant_from_flash_attn": lambda: AttnVariant.from_flash_attn(False, (-1, -1), 0.0, None, None, 128, 128,
                                                                          0.0, q.device),
            "native_attn_fwd_direct": lambda: _native.attn_fwd(q, k, v, out, lse, None, None, 128, 128, 0.125, var,
                                                               stream),
            "native_attn_fwd_fast": lambda: _native.attn_fwd_fast(q, k, v, 0.0, None, False, (-1, -1), 0.0, None,
                                                                  False, False, None),
            "native_eager_plain": lambda: _native.eager_plain((q, k, v), ("cuda",)),
            "tensor_dlpack_method": lambda: q.__dlpack__(),
            "torch_C_to_dlpack": lambda: torch._C._to_dlpack(q),
        }
        res["pieces_us"] = {}
        for name, fn in pieces.items():
            try:
                res["pieces_us"][name] = per_call(fn, n)
            except Exception as e:  # noqa: BLE001  (recorded)
                res["pieces_us"][name] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
        # the native launcher alone on each forward family (sm90: 4 tensor maps per launch)
        before = _native.tuning_knobs()["attn_fwd_family"]
        for family in ("sm80", "sm90"):
            _native.set_tuning_knob("attn_fwd_family", family)
            try:
                res["pieces_us"][f"native_attn_fwd_direct_{family}"] = per_call(pieces["native_attn_fwd_direct"], n)
            except Exception as e:  # noqa: BLE001  (recorded)
                res["pieces_us"][f"native_attn_fwd_direct_{family}"] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
        _native.set_tuning_knob("attn_fwd_family", before)
    path = os.path.join(a.out, "host_time_breakdown.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for name, c in res["cases"].items():
        print(f"{name}: {c['host_us']:.1f} us/call; top own-time:")
        for r in c["profile"][:12]:
            print(f"    {r['own_us']:7.2f} us  x{r['calls_per_call']:.0f}  {r['fn']}")
    for name, r in res["vs_sdpa"].items():
        print(f"{name} / {r['sdpa_case']}: {r['median_ratio']:.2f}x (median of {len(res['cases'][name]['rounds_us'])} paired rounds)")
    for name, t in res["pieces_us"].items():
        print(f"piece {name}: {t if isinstance(t, str) else f'{t:.2f} us'}")
    print("wrote", path)


if __name__ == "__main__":
    main()
