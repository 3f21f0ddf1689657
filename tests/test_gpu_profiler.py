"""GPU tests of ferroattn.profiler (issue 5) on the Llama-3.2-1B config (seeded random weights,
bf16, attn "ferroattn"), prefill of b=4 x s=2048 random tokens (GPU-bound: ~50 ms of GPU work per
forward against ~10-20 ms of host work; at b=4 x s=1024 the forward is closer to host-bound and the
hooks' host cost shows more: reported in (b), asserted in (i)):

(a) depth-1 module records (embed, rotary, 16 layers, norm, lm_head) sum to within 5% of the
    root record, and the root record to within 5% of a forward timed with CUDA events alone;
(b) overhead: median forward time with profile() on vs off (interleaved) <= 1.05x;
(c) the Chrome trace loads with json and has "X" events with ts/dur (modules and our kernels);
(d) a simultaneous torch.profiler (CPU + CUDA) trace lists our kernels by name
    ("ferroattn::attn_fwd..."), and import_torch_profiler adds torch's kernels (GEMMs) with an
    aten op and one of our modules;
(e) measure_ceilings: copy within 20% of 4.2-4.3 TB/s (3.4-5.2 TB/s), bf16 matmul within 20% of
    700-800 TFLOP/s (560-960), fp16 matmul within 20% of the bf16 one;
(f) our kernel records: registers > 0, 0 < occupancy <= 1, flops > 0, gpu_ms > 0, module = a
    self_attn, start inside that module's interval;
(g) launch_overhead: finite, graph_ms <= 1.1 x eager_ms;
(h) ``python -m ferroattn profile --model tiny --batch 1,2 --seq 128,256 --trace --plot`` exits 0
    and writes both files;
(i) the profiler's cost budget (:mod:`ferroattn.profiler.cost`): on the host-bound 1 x 256 forward
    (~10-15 ms of host time, 53 hooked module calls; 41 rounds) and the GPU-bound 4 x 1024 one
    (15 rounds), plain / profile() / torch.profiler.profile() forwards in paired rounds (order
    rotated): profile() costs no more than torch.profiler (the 95 % interval of the median paired
    difference is not entirely above 0), and at 4 x 1024 at most 5 %;
(j) native marks (``_native.profiler_mark*``): a mark pair around ``torch.cuda._sleep`` resolves to
    a positive time against a torch event, query/resolve/release keep their contract, a capturing
    stream gets no mark; torch-hook mode (``mode="torch"``) gives the same records as the default;
(k) launch_overhead of the whole model forward (``model_forward``, 1 x 128 tokens) captures and
    replays: finite, graph_ms <= eager_ms;
(l) the native per-call path (``_native.ProfilerForward``, the default wrapper on a GPU) gives the
    Python wrapper's records (names, depths; root time within 5 %), and a hooked module called
    while a CUDA graph captures records nothing and leaves the capture valid (replays).

Numbers are printed (run pytest with -s to see them) and, when $FERROATTN_RESULTS_DIR is set,
written to $FERROATTN_RESULTS_DIR/profiler_gpu.json. Marker ``gpu``: skipped without CUDA.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from ferroattn.bench.timing import event_ms
from ferroattn.profiler import build_model, launch_overhead, measure_ceilings, model_forward, profile

pytestmark = pytest.mark.gpu

BATCH, SEQ = 4, 2048
SMALL = (4, 1024)   # reported only (b)
RESULTS: dict = {}


def _report(key, value):
    """Print a figure and keep it in $FERROATTN_RESULTS_DIR/profiler_gpu.json (when set)."""
    RESULTS[key] = value
    print(f"[profiler gpu] {key}: {json.dumps(value)}", flush=True)
    d = os.environ.get("FERROATTN_RESULTS_DIR")
    if d:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "profiler_gpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def _records_and_roots(model, fwd, variants, rounds=3, check=None):
    """Profile one forward per variant (``{key: profile() kwargs}``), interleaved over ``rounds``
    rounds: the last round's module records per key, and per key the median over the rounds of
    the root (depth-0) GPU ms. One forward's time moves by several % with the clocks; comparing
    medians of interleaved rounds keeps two variants' times comparable."""
    recs, roots = {}, {k: [] for k in variants}
    for _ in range(rounds):
        for key, kwargs in variants.items():
            with profile(model, **kwargs) as prof:
                if check is not None:
                    assert check(key, prof), key
                fwd()
            recs[key] = prof.records.modules
            roots[key].append(sum(r.gpu_ms for r in recs[key] if r.depth == 0))
    return recs, {k: statistics.median(v) for k, v in roots.items()}


_timed = event_ms   # GPU ms of one call between two CUDA events


@pytest.fixture(scope="module")
def llama():
    model = build_model("llama-3.2-1b", attn="ferroattn", dtype="bfloat16", seed=0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen).cuda()

    def fwd(x=ids):
        with torch.inference_mode():
            model(input_ids=x, use_cache=False)
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    yield model, fwd
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def profiled(llama):
    """Three profiled forwards (one window, steps 0-2)."""
    model, fwd = llama
    with profile(model) as prof:
        for _ in range(3):
            fwd()
            prof.step()
    return prof


def test_a_depth1_records_sum_to_the_root_and_the_forward_time(llama, profiled):
    model, fwd = llama
    plain = [_timed(fwd) for _ in range(5)]
    mods = profiled.records.modules
    roots, sums = [], []
    for step in range(3):
        (root,) = [r for r in mods if r.depth == 0 and r.step == step]
        d1 = [r for r in mods if r.depth == 1 and r.step == step]
        names = {r.name for r in d1}
        assert len(d1) == 16 + 4 and {"model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"} <= names
        roots.append(root.gpu_ms)
        sums.append(sum(r.gpu_ms for r in d1))
    med_plain, med_root = statistics.median(plain), statistics.median(roots)
    _report("a_forward_ms", {"plain_median": med_plain, "root_records": roots, "depth1_sums": sums})
    for root, s in zip(roots, sums):
        assert abs(s - root) <= 0.05 * root, f"depth-1 records sum {s:.3f} ms vs root {root:.3f} ms"
    assert abs(med_root - med_plain) <= 0.05 * med_plain, f"root {med_root:.3f} ms vs plain forward {med_plain:.3f} ms"
    assert profiled.records.total_gpu_ms == pytest.approx(sum(roots))


def test_b_profiler_overhead_at_most_5_percent(llama):
    model, fwd = llama
    off, on = [], []
    for _ in range(7):                     # interleaved: drift hits both alike
        off.append(_timed(fwd))
        with profile(model):
            on.append(_timed(fwd))
    ratio = statistics.median(on) / statistics.median(off)
    small = torch.randint(0, model.config.vocab_size, SMALL, device="cuda")
    s_off, s_on = [], []
    for _ in range(7):
        s_off.append(_timed(lambda: fwd(small)))
        with profile(model):
            s_on.append(_timed(lambda: fwd(small)))
    s_ratio = statistics.median(s_on) / statistics.median(s_off)
    _report("b_overhead", {"shape": [BATCH, SEQ], "off_ms_median": statistics.median(off),
                           "on_ms_median": statistics.median(on), "ratio": ratio, "pct": 100 * (ratio - 1),
                           "small_shape": list(SMALL), "small_off_ms_median": statistics.median(s_off),
                           "small_on_ms_median": statistics.median(s_on), "small_pct": 100 * (s_ratio - 1)})
    assert ratio <= 1.05, f"profile() makes the forward {100 * (ratio - 1):.1f}% slower (> 5%)"


def test_c_chrome_trace_loads(profiled, tmp_path):
    path = tmp_path / "trace.json"
    profiled.export_chrome_trace(path)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert xs and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in xs)
    cats = {e["cat"] for e in xs}
    assert cats == {"ferroattn_module", "ferroattn_kernel"}, cats
    _report("c_trace_events", {"X": len(xs), "bytes": path.stat().st_size})


def test_f_kernel_records(profiled):
    recs = profiled.records
    ours = [k for k in recs.kernels if k.op == "ferroattn::attn_fwd"]
    assert len(ours) >= 3 * 16, f"{len(recs.kernels)} kernel records: {[k.name for k in recs.kernels[:5]]}"
    by = {}
    for m in recs.modules:
        by.setdefault(m.name, []).append(m)
    for k in ours:
        assert k.registers is not None and k.registers > 0, k
        assert k.occupancy is not None and 0 < k.occupancy <= 1, k
        assert k.flops > 0 and k.nbytes > 0 and k.gpu_ms > 0, k
        assert k.module is not None and k.module.endswith("self_attn"), k
        assert any(m.start_us <= k.start_us <= m.start_us + m.gpu_ms * 1e3 for m in by[k.module]), k
    k = ours[0]
    _report("f_attn_kernel", {"name": k.name, "config": k.config, "registers": k.registers, "smem": k.smem_bytes,
                              "occupancy": k.occupancy, "gpu_ms": k.gpu_ms, "tflops": k.tflops})
    print(recs.key_averages("kernel").table(sort_by="gpu_time_total", row_limit=5))


def test_d_torch_profiler_sees_our_kernels_and_import_adds_torchs(llama):
    model, fwd = llama
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        with profile(model) as prof:
            fwd()
        torch.cuda.synchronize()
    dev_names = [e.name for e in tp.events() if getattr(e.device_type, "name", "") == "CUDA"]
    ours = [n for n in dev_names if "ferroattn::attn_fwd" in n]
    assert ours, f"no ferroattn::attn_fwd kernel among {len(dev_names)} CUDA events, e.g. {sorted(set(dev_names))[:10]}"
    added = prof.import_torch_profiler(tp)
    assert added and not any("ferroattn::" in k.name for k in added)
    mlp = [k for k in added if k.module is not None and k.module.endswith(".mlp") and k.op.startswith("aten::")]
    assert mlp, f"no torch kernel attributed to an MLP module: {[(k.name, k.op, k.module) for k in added[:10]]}"
    assert all(k.gpu_ms >= 0 for k in added) and sum(k.gpu_ms for k in added) > 0
    attributed = sum(1 for k in added if k.module is not None) / len(added)
    _report("d_torch_profiler", {"our_kernel_events": len(ours), "added": len(added), "attributed": attributed,
                                 "example": ours[0][:120]})
    print(prof.key_averages("op").table(sort_by="gpu_time_total", row_limit=8))


def test_e_measured_ceilings(tmp_path):
    c = measure_ceilings(refresh=True, cache_dir=tmp_path)
    f16 = c.for_dtype("float16")
    _report("e_ceilings", {"copy_gbps": c.bandwidth_gbps, "bf16_tflops": c.peak_tflops,
                           "fp16_tflops": f16.peak_tflops, "label": c.label()})
    # a device-to-device copy on the Hopper cards this runs on: ~3.0 TB/s on an H100 SXM (3.35 TB/s
    # by its datasheet), ~4.3 TB/s on an H200 (4.8 TB/s)
    assert 2000 <= c.bandwidth_gbps <= 5200, c.label()
    assert 560 <= c.peak_tflops <= 960, c.label()
    assert dict((d, s) for d, _, s in c.by_dtype).keys() == {"bfloat16", "float16"}, c.by_dtype
    assert abs(f16.peak_tflops - c.peak_tflops) <= 0.2 * c.peak_tflops, c.label()
    assert "float16" in f16.compute_source and "bfloat16" in c.compute_source


def test_g_launch_overhead():
    from ferroattn import flash_attn_func
    torch.manual_seed(0)
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 256, device="cuda")

    def fn():
        y = x
        for _ in range(20):
            y = torch.tanh(y)
        return flash_attn_func(q, q, q, causal=True), y
    lo = launch_overhead(fn, repeats=20, warmup=3)
    _report("g_launch_overhead", {"eager_ms": lo.eager_ms, "graph_ms": lo.graph_ms, "overhead_pct": lo.overhead_pct})
    assert all(math.isfinite(v) for v in (lo.eager_ms, lo.graph_ms, lo.overhead_ms, lo.overhead_pct))
    assert 0 < lo.graph_ms <= lo.eager_ms * 1.1, str(lo)


def test_h_cli_profile_tiny(tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    r = subprocess.run([sys.executable, "-m", "ferroattn", "profile", "--model", "tiny", "--batch", "1,2",
                        "--seq", "128,256", "--trace", str(trace), "--plot", str(plot)],
                       capture_output=True, text=True, timeout=180)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(trace.read_text())["traceEvents"] and plot.read_bytes()[:4] == b"\x89PNG"
    assert "latency ms" in r.stdout and "knee" in r.stdout and "attn_fwd" in r.stdout


def _paired_costs(model, fwd, ids, rounds, per_round=2):
    """Paired rounds of the plain forward, the forward under ``profile(model)`` and under
    ``torch.profiler.profile()`` (order rotated each round; in each mode one untimed forward, then
    the mean wall time of ``per_round`` synchronised forwards): three lists of seconds, one value
    per round (the measurement of :mod:`ferroattn.profiler.cost`)."""
    def wall():
        torch.cuda.synchronize()
        t = time.perf_counter()
        fwd(ids)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def under(context):
        with context() as c:
            fwd(ids)   # untimed: the first forward in the mode
            if c is not None:
                c.step()
            return statistics.fmean(wall() for _ in range(per_round))

    modes = (("plain", contextlib.nullcontext), ("ours", lambda: profile(model)), ("torch", torch.profiler.profile))
    for _ in range(3):
        fwd(ids)
    out = {name: [] for name, _ in modes}
    for r in range(rounds):
        k = r % len(modes)
        for name, context in modes[k:] + modes[:k]:
            out[name].append(under(context))
    return out["plain"], out["ours"], out["torch"]


@pytest.mark.parametrize("shape, rounds", [((1, 256), 41), ((4, 1024), 15)], ids=["host-bound-1x256", "gpu-bound-4x1024"])
def test_i_profiler_cost_within_torch_profilers_and_5_percent_when_gpu_bound(llama, shape, rounds):
    """The profiler's cost budget (ferroattn.profiler.cost): no more than torch.profiler's own cost
    on the same forward, measured paired in this run; <= 5 % on GPU-bound forwards (4 x 1024).
    41 rounds at 1 x 256: the host-bound forward's round-to-round spread is ~+-10 %."""
    from ferroattn.profiler.cost import cost_verdict, format_verdict, is_gpu_bound
    model, fwd = llama
    ids = torch.randint(0, model.config.vocab_size, shape, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    plain, ours, theirs = _paired_costs(model, fwd, ids, rounds)
    v = cost_verdict(plain, ours, theirs, gpu_bound=is_gpu_bound(*shape))
    label = f"{shape[0]}x{shape[1]}"
    _report(f"i_cost_{label}", {"shape": list(shape), "plain_ms_median": 1e3 * statistics.median(plain),
                                "ours_ms_median": 1e3 * statistics.median(ours),
                                "torch_profiler_ms_median": 1e3 * statistics.median(theirs), **v})
    print(format_verdict(v, label))
    assert v["within_torch"], (f"profile() costs more than torch.profiler on a {label} forward beyond the noise: "
                               + format_verdict(v, label))
    assert v["within_budget"] is not False, f"profile() costs more than 5 % on a GPU-bound forward: " \
                                            + format_verdict(v, label)


def test_j_native_marks_and_torch_mode(llama):
    from ferroattn import _native as n
    from ferroattn.errors import ArgumentError
    dev = torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream(dev)
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    a = n.profiler_mark(raw, dev)
    torch.cuda._sleep(2_000_000)              # ~1 ms of GPU time
    b = n.profiler_mark(raw, dev)
    assert a > 0 and b > a
    assert n.profiler_marks_query([a, b]) in ([True, True], [True, False], [False, False])
    ta, tb = n.profiler_marks_resolve([a, b], ref.cuda_event)
    assert 0 <= ta < tb and tb - ta > 0.1, (ta, tb)
    assert n.profiler_marks_query([]) == []
    with pytest.raises(ArgumentError, match="marks"):
        n.profiler_marks_resolve([a])        # resolved already
    c = n.profiler_mark(raw, dev)
    assert n.profiler_marks_release([c, c, 123456789]) == 1
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(8, device="cuda")
    with torch.cuda.graph(g, stream=side):
        x += 1
        assert n.profiler_mark(torch._C._cuda_getCurrentRawStream(dev), dev) == 0, "no mark while capturing"
    _report("j_marks", {"sleep_ms": tb - ta})
    # torch-hook mode: same records (names, depths) and the same forward time within 5 %
    model, fwd = llama
    recs, roots = _records_and_roots(model, fwd, {"wrap": {"mode": "wrap"}, "torch": {"mode": "torch"}})
    assert [(r.name, r.depth) for r in recs["wrap"]] == [(r.name, r.depth) for r in recs["torch"]]
    assert abs(roots["wrap"] - roots["torch"]) <= 0.05 * roots["torch"], roots


def test_k_launch_overhead_of_the_whole_model(llama):
    model, _ = llama
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(2))
    lo = launch_overhead(model_forward(model, ids), repeats=10, warmup=3)
    _report("k_model_launch_overhead", {"shape": [1, 128], "eager_ms": lo.eager_ms, "graph_ms": lo.graph_ms,
                                        "overhead_pct": lo.overhead_pct})
    assert all(math.isfinite(v) for v in (lo.eager_ms, lo.graph_ms, lo.overhead_pct))
    assert 0 < lo.graph_ms <= lo.eager_ms, str(lo)


def test_l_native_wrapper_records_and_capture(llama):
    from ferroattn.profiler import attach
    model, fwd = llama
    recs, roots = _records_and_roots(model, fwd, {True: {"native_wrap": True}, False: {"native_wrap": False}},
                                     check=lambda key, prof: (prof._att._native_forward is not None) is key)
    assert [(r.name, r.depth) for r in recs[True]] == [(r.name, r.depth) for r in recs[False]]
    assert abs(roots[True] - roots[False]) <= 0.05 * roots[False], roots
    # capture: the hooked call inside torch.cuda.graph gets no record; the graph replays
    lin = torch.nn.Linear(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda")
    with attach(lin) as att:
        assert att._native_forward is not None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lin(x)                                 # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert len(att.resolve()) == 1
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lin(x)
        assert att.resolve() == [], "no record for a call made while capturing"
        g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y, lin(x))
        assert len(att.resolve()) == 1, "recording resumes after the capture"
    _report("l_native_wrapper", {"root_ms": {str(k): v for k, v in roots.items()}})
