"""Paired GPU-time sweep of the wgmma_sp schedules (src/tuning/sparse24/schedule.rs `wgmma_schedule`) with the bench's method:
ferroattn.bench.timing.paired_gpu_ms (per window a torch.cuda._sleep covers the host, per call an L2 flush and
CUDA events around the call; R paired rounds, forward + reverse pass; a window that does not hold is retried
and never reported). Variants, all through sparse24.matmul(backend="sparse") = the bench's "ours":
  prod  : wgmma_sp_tile=256 + wgmma_sp_streamk=off  (= production before this change)
  new   : the new auto rule (knobs at their defaults)
  bm128 : wgmma_sp_tile=128 (forced 128-row tile)        [only --forced shapes]
  sk    : wgmma_sp_streamk=on (forced stream-K, rule's tail) [only --forced shapes]
  dense : F.linear on the dense 2:4 weight (cuBLAS);  peer: F.linear on to_sparse_semi_structured (cuSPARSELt)
Per shape: the max rel. error of each of ours vs the fp32 reference; per-round times; ratios = median over
rounds of per-round ratios.   python scripts/sparse24_schedule_timing.py --out FILE --shapes "bf16:512x4096x4096,..." [--forced "..."]"""
import argparse, json, statistics, time
import torch
import torch.nn.functional as F
from ferroattn import sparse24
from ferroattn.bench.timing import paired_gpu_ms

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--shapes", required=True, help="dtype:MxNxK,...  (M tokens, N w rows, K)")
ap.add_argument("--forced", default="", help="shapes (same syntax) that also time bm128 and sk")
ap.add_argument("--diag", default="", help="shapes (same syntax) that also time dp124 and dp0")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--rep-ms", type=float, default=30.0)
ap.add_argument("--budget-s", type=float, default=100)
a = ap.parse_args()
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
ENV = {"prod": {"wgmma_sp_tile": "256", "wgmma_sp_streamk": "off"},
       "new": {}, "bm128": {"wgmma_sp_tile": "128"}, "sk": {"wgmma_sp_streamk": "on"},
       # diagnostics of the stream-K form at 2048 x 4096 x 4096 (256 tiles of 32 stages): dp:124 -> the 132-tile
       # tail is cut into whole tiles (no partial sums: the form's fixed cost); dp:0 -> 62 stages per CTA, cut
       "dp124": {"wgmma_sp_streamk": "dp:124"}, "dp0": {"wgmma_sp_streamk": "dp:0"}}


def parse(s):
    out = []
    for item in filter(None, s.split(",")):
        dt, mnk = item.split(":")
        out.append((dt, *(int(v) for v in mnk.split("x"))))
    return out


def env(name):
    """The tuning knobs of variant ``name`` (the others at their defaults) inside a with block."""
    from ferroattn.knobs import override
    return override(**{"wgmma_sp_tile": "", "wgmma_sp_streamk": "", **ENV[name]})


def records(fn):
    from ferroattn import _native
    torch.cuda.synchronize(); _native.profiler_drain(); _native.profiler_enable(True)
    try:
        fn(); torch.cuda.synchronize()
    finally:
        _native.profiler_enable(False)
    return [(r["config"].split("<", 1)[-1], r["grid"][0]) for r in _native.profiler_drain()]


shapes = parse(a.shapes)
forced = set(parse(a.forced))
diag = set(parse(a.diag))
T0 = time.time(); rows_out = []
for sh in shapes:
    if time.time() - T0 > a.budget_s:
        print("budget reached", flush=True); break
    dt, m, n, k = sh
    dtype = DT[dt]
    torch.manual_seed(m + n + k)
    w = sparse24.prune(torch.randn(n, k, device="cuda", dtype=dtype))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ws = sparse24.compress(w)
    names = ["prod", "new"] + (["bm128", "sk"] if sh in forced else []) + (["dp124", "dp0"] if sh in diag else [])
    fns = {nm: (lambda: sparse24.matmul(x, ws, backend="sparse")) for nm in names}
    ctxs = {nm: (lambda nm=nm: env(nm)) for nm in names}
    fns["dense"] = lambda: F.linear(x, w)
    try:
        wp = torch.sparse.to_sparse_semi_structured(w)
        fns["peer"] = lambda: F.linear(x, wp)
    except Exception as ex:  # noqa: BLE001
        print("peer unavailable", ex)
    ref = F.linear(x.float(), w.float())
    err, launched, outs = {}, {}, {}
    for nm in names:
        with env(nm):
            y = fns[nm]()
            launched[nm] = records(fns[nm])
        err[nm] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        outs[nm] = y
    det = {}
    # determinism of each variant: a second call is bitwise equal
    for nm in names:
        with env(nm):
            det[nm] = bool(torch.equal(outs[nm], fns[nm]()))
    for nm in ("dense", "peer"):      # first calls (cuBLAS / cuSPARSELt set-up) outside the timing
        if nm in fns:
            fns[nm](); fns[nm]()
    torch.cuda.synchronize()
    res = paired_gpu_ms(fns, rounds=a.rounds, rep_ms=a.rep_ms, contexts=ctxs)
    per = res.ms
    row = {"dtype": dt, "m": m, "n": n, "k": k, "ms_rounds": per, "max_rel_err": err, "deterministic": det,
           "launched": launched, "invalid": res.invalid, "errors": {kk: repr(v) for kk, v in res.errors.items()}}
    row["vs"] = {}
    for nm in per:
        for other in ("peer", "dense", "prod"):
            if other in per and nm != other:
                row["vs"][f"{nm}/{other}"] = statistics.median(o / u for o, u in zip(per[other], per[nm]))
    rows_out.append(row)
    med = {nm: statistics.median(v) * 1e3 for nm, v in per.items()}
    print(f"{dt} {m:5d}x{n:5d}x{k:5d} " + " ".join(f"{nm} {v:7.1f}" for nm, v in med.items())
          + " | new/peer {:.3f} prod/peer {:.3f} new/prod {:.3f} new/dense {:.3f}".format(
              row["vs"].get("new/peer", float("nan")), row["vs"].get("prod/peer", float("nan")),
              row["vs"].get("new/prod", float("nan")), row["vs"].get("new/dense", float("nan")))
          + (" bm128/prod {:.3f}".format(row["vs"]["bm128/prod"]) if "bm128/prod" in row["vs"] else "")
          + (" sk/prod {:.3f}".format(row["vs"]["sk/prod"]) if "sk/prod" in row["vs"] else "")
          + f" | err {max(err.values()):.1e} det {all(det.values())} new={launched.get('new')}", flush=True)
meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": __doc__.split("\n")[0],
        "rounds": a.rounds, "rep_ms": a.rep_ms, "sms": torch.cuda.get_device_properties(0).multi_processor_count}
json.dump({"meta": meta, "rows": rows_out}, open(a.out, "w"), indent=1)
