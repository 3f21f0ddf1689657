"""CPU tests of the GPU-time pass inside ``bench sparse24`` and ``bench gemm`` (measure_point with
``timing_mode="both"`` on the simulated stream of tests/_bench_fakes.py, the per-call pass on a
fixed fake ``bench_gpu``): GPU-time ratios come from GPU time, per-call ratios keep the host cost,
the target verdicts use the GPU-time ratios, a host-bound function whose GPU time never holds is
reported invalid ("inv"), never as GPU time; the --timing / --gpu-rep-ms options."""
from __future__ import annotations

import argparse

import pytest
import torch

from _bench_fakes import FakeGpu, small_gemm_point
from ferroattn import _native, sparse24
from ferroattn.bench import gemm as gbench
from ferroattn.bench import sparse24 as sbench
from ferroattn.bench import timing


# ---- bench sparse24 -----------------------------------------------------------------------
#: (host ms, GPU ms) per function; the peer and auto are host-bound (host > flush + GPU time)
S24 = {"dense": (0.02, 1.0), "sparse": (0.02, 1 / 1.4), "mma_sp": (0.02, 1 / 1.2), "wgmma_sp": (0.02, 1 / 1.45),
       "wgmma_sp_direct": (0.02, 1 / 1.43), "auto": (1.5, 1 / 1.35), "peer": (2.0, 1 / 1.3)}


def _s24_setup(monkeypatch, knob, gpu, sync_peer=False):
    """Fake F.linear / sparse24.matmul that enqueue S24's work on ``gpu``; the per-call pass's
    bench_gpu returns each function's host-inclusive time max(host, GPU)."""
    import torch.nn.functional as F

    knob("wgmma_sp_epilogue", "")
    real_linear = F.linear
    calls: list[str] = []
    ws = [{"dense": torch.randn(16, 32)} for _ in range(2)]
    for w in ws:
        w["ours"], w["peer"] = w["dense"], w["dense"].clone()
    role = {id(w[key]): key for w in ws for key in ("dense", "peer")}

    def run(name):
        calls.append(name)
        host, g = S24[name]
        gpu.kernel(host, g, name)
        if name == "peer" and sync_peer:
            gpu.synchronize()                # waits for the GPU inside the call: never GPU-only

    def fake_linear(x, w, bias=None):
        run(role.get(id(w), "dense"))
        return real_linear(x, w, bias)

    def fake_matmul(x, w, bias=None, activation=None, backend="auto"):
        direct = _native.tuning_knobs()["wgmma_sp_epilogue"] == "direct"
        run("wgmma_sp_direct" if (backend == "wgmma_sp" and direct) else backend)
        return real_linear(x, w)

    def call_bench(fn, rep_ms, warmup_ms):
        fn()
        host, g = S24[calls[-1]]
        return max(host, g)

    monkeypatch.setattr(F, "linear", fake_linear)
    monkeypatch.setattr(sparse24, "matmul", fake_matmul)
    monkeypatch.setattr(sparse24, "choose_backend", lambda *a: "sparse")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "bench_gpu", call_bench)
    xs = [torch.randn(8, 32) for _ in range(2)]
    return xs, ws


def _s24_point(m=8192):
    return {"dtype": "bf16", "kind": "llm", "m": m, "n": 16, "k": 32, "flops": 2.0 * m * 16 * 32}


def test_sparse24_gpu_time_ratios_and_verdicts(monkeypatch, knob):
    gpu = FakeGpu()
    xs, ws = _s24_setup(monkeypatch, knob, gpu)
    p = _s24_point()
    sbench.measure_point(p, xs, ws, None, "FakeSemi", 100.0, 25.0, rounds=3, timing_mode="both",
                         gpu_rep_ms=20.0, gpu_device=gpu)
    assert p["gpu_timed"] and not p["gpu_errors"] and p["timing"] == "both"
    # GPU time only: the true kernel times
    assert p["peer"]["gpu_ms"] == pytest.approx(1 / 1.3, rel=1e-9)
    assert p["auto"]["gpu_ms"] == pytest.approx(1 / 1.35, rel=1e-9)
    assert p["gpu_speedup_vs_peer"] == pytest.approx(1.4 / 1.3, rel=1e-9)
    assert p["gpu_speedup_vs_dense"] == pytest.approx(1.4, rel=1e-9)
    assert p["gpu_auto_vs_dense"] == pytest.approx(1.35, rel=1e-9)
    assert p["paired_gpu"]["wgmma_sp_direct_vs_dense"]["ratio"] == pytest.approx(1.43, rel=1e-9)   # env variant
    assert _native.tuning_knobs()["wgmma_sp_epilogue"] == "smem"
    assert p["peer"]["gpu_tflops"] == pytest.approx(p["flops"] / (1 / 1.3 * 1e-3) / 1e12)
    # per call: host-inclusive (the peer's and auto's host floors)
    assert p["peer"]["call_ms"] == p["peer"]["ms"] == pytest.approx(2.0)
    assert p["speedup_vs_peer"] == pytest.approx(2.0 * 1.4, rel=1e-9)
    assert p["auto_vs_dense"] == pytest.approx(1.0 / 1.5, rel=1e-9)
    assert p["peer"]["gpu_stats"]["retries"] == 0 and p["peer"]["gpu_stats"]["sleep_ms_max"] > 3 * 2.0
    # the verdicts use GPU time: auto / dense is 0.67 per call (below 0.95) but 1.35 by GPU time
    s = sbench.summarize([p])
    assert s["basis"] == "gpu" and s["n_gpu_invalid"] == 0
    assert s["below"]["auto_vs_dense_min"]["n_below"] == 0 and s["auto_vs_dense_all"]["min"] < 0.95
    assert s["gpu"]["speedup_vs_peer_all"]["min"] == pytest.approx(1.4 / 1.3, rel=1e-9)
    assert s["gpu"]["speedup_vs_dense_large"]["n"] == 1 and s["rounds"] == [3]
    text = sbench.format_summary(s)
    assert "GPU time only" in text and "per call (host-inclusive" in text
    gpu_part, call_part = text.split("per call (host-inclusive")
    assert "(target >= 1.0)" in gpu_part and "(target >= 0.95)" in gpu_part and "target" not in call_part
    table = sbench.format_table([p]).splitlines()
    assert len(table) == 3 and "GPU-only:" in table[0] and "per call:" in table[0]
    assert f"{1.4 / 1.3:7.3f}" in table[2] and f"{2.8:7.3f}" in table[2]
    # the dispatch table takes the GPU-time speedup (the per-call one here is 1.4 as well: ours and dense
    # are GPU-bound); with a per-call-only point it takes that one
    assert sbench.dispatch_table([dict(p, gpu_speedup_vs_dense=1.25)], "sm_90")["sm_90"]["bfloat16"]["16,32"] == \
        [[8192, 1.25]]
    assert sbench.dispatch_table([dict(p, gpu_speedup_vs_dense=None)], "sm_90")["sm_90"]["bfloat16"]["16,32"] == \
        [[8192, 1.4]]
    line = sbench.progress_line(p)
    assert line.startswith("GPU time:") and f"x peer {1.4 / 1.3:.3f}" in line and "per call:" in line
    # a per-call-only point keeps the old basis
    assert sbench.summarize([dict(p, gpu_timed=False)])["basis"] == "call"


def test_sparse24_host_bound_peer_is_invalid_not_reported(monkeypatch, knob):
    gpu = FakeGpu()
    xs, ws = _s24_setup(monkeypatch, knob, gpu, sync_peer=True)
    p = _s24_point()
    sbench.measure_point(p, xs, ws, None, "FakeSemi", 100.0, 25.0, rounds=2, timing_mode="both",
                         gpu_rep_ms=10.0, gpu_device=gpu)
    assert set(p["gpu_errors"]) == {"peer"}
    assert p["peer"]["gpu_ms"] is None and p["peer"]["gpu_tflops"] is None and p["peer"]["gpu_error"]
    assert p["gpu_speedup_vs_peer"] is None and p["gpu_peer_vs_dense"] is None
    assert "speedup_vs_peer" not in p["paired_gpu"]
    assert p["speedup_vs_peer"] == pytest.approx(2.8, rel=1e-9)       # the per-call ratio is still there
    assert p["gpu_speedup_vs_dense"] == pytest.approx(1.4, rel=1e-9)
    s = sbench.summarize([p])
    assert s["n_gpu_invalid"] == 1 and s["gpu_invalid"][0].startswith("peer at bf16 m=8192")
    assert s["gpu"]["speedup_vs_peer_all"] is None                    # not replaced by the per-call ratio
    assert "GPU time did not hold" in sbench.format_summary(s)
    assert " inv " in sbench.format_table([p]).splitlines()[2]
    assert "x peer inv" in sbench.progress_line(p)


def test_sparse24_gpu_only_mode(monkeypatch, knob):
    gpu = FakeGpu()
    xs, ws = _s24_setup(monkeypatch, knob, gpu)
    p = _s24_point()
    sbench.measure_point(p, xs, ws, None, "FakeSemi", 100.0, 25.0, rounds=2, timing_mode="gpu",
                         gpu_rep_ms=10.0, gpu_device=gpu)
    assert p["ours"]["ms"] is None and p["speedup_vs_dense"] is None and not p["paired"]
    assert p["gpu_speedup_vs_dense"] == pytest.approx(1.4, rel=1e-9)
    s = sbench.summarize([p])
    assert s["n_measured"] == 1 and s["basis"] == "gpu"
    table = sbench.dispatch_table([p], "sm_90")
    assert table["sm_90"]["bfloat16"]["16,32"] == [[8192, 1.4]]
    with pytest.raises(ValueError, match="timing_mode: expected one of both, gpu, call"):
        sbench.measure_point(_s24_point(), xs, ws, None, None, 10.0, 1.0, timing_mode="cuda")


def _s24_parse(argv):
    ap = argparse.ArgumentParser()
    sbench.add_arguments(ap)
    return ap.parse_args(argv)


def test_sparse24_timing_options(capsys):
    a = _s24_parse([])
    assert a.timing == "both" and a.gpu_rep_ms is None
    code, kwargs = sbench.check_args(_s24_parse(["--timing", "gpu", "--gpu-rep-ms", "12"]))
    assert kwargs["timing_mode"] == "gpu" and kwargs["gpu_rep_ms"] == 12.0
    code, _ = sbench.check_args(_s24_parse(["--gpu-rep-ms", "0"]))
    assert code == 2 and "--gpu-rep-ms: expected a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        _s24_parse(["--timing", "wall"])
    assert e.value.code == 2
    # the defaults keep a run about as long as before: with the GPU-time pass the per-call pass gets 70 %
    assert sbench.DEFAULT_REP_MS["call"] == (100.0, 30.0) and sbench.DEFAULT_REP_MS["both"] == (70.0, 20.0)


# ---- bench gemm ---------------------------------------------------------------------------
#: (host ms, GPU ms); the per-call pass sees the peer at 1.2 ms (host floor), wmma at its 2.2 ms
GEMM = {gbench.PEER: (1.2, 1.0), "wmma": (0.02, 1 / 0.45), "auto": (0.02, 1 / 0.97)}


def _gemm_setup(monkeypatch, gpu, sync=None):
    import ferroattn.ops.gemm as ops_gemm
    from test_gemm_emulated import ContractNative

    monkeypatch.setattr(ops_gemm, "_native", ContractNative(backends=("wmma",)))
    calls: list[str] = []
    orig_torch, orig_ours = gbench._torch_fn, gbench._ours_fn

    def tag(name, f):
        def g(*args):
            calls.append(name)
            host, t = GEMM[name]
            gpu.kernel(host, t, name)
            if name == sync:
                gpu.synchronize()
            return f(*args)
        return g

    def call_bench(fn, rep_ms, warmup_ms):
        fn()
        host, t = GEMM[calls[-1]]
        return max(host, t)

    monkeypatch.setattr(gbench, "_torch_fn", lambda p: tag(gbench.PEER, orig_torch(p)))
    monkeypatch.setattr(gbench, "_ours_fn", lambda p, b: tag(b, orig_ours(p, b)))
    monkeypatch.setattr(timing, "bench_gpu", call_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    p, sets = small_gemm_point()
    return p, sets


def _as_target_shape(p):
    p.update(m=4096, n=4096, k=4096)       # relabel (the tensors were small) so the targets apply
    return p


def test_gemm_gpu_time_ratios_and_verdicts(monkeypatch):
    gpu = FakeGpu()
    p, sets = _gemm_setup(monkeypatch, gpu)
    gbench.measure_point(p, sets, ["wmma", "sm90", "auto"], ["wmma"], 1.0, 100.0, 25.0, rounds=3,
                         timing_mode="both", gpu_rep_ms=20.0, gpu_device=gpu)
    wmma, auto, peer = p["backends"]["wmma"], p["backends"]["auto"], p["peer"]
    assert peer["gpu_ms"] == pytest.approx(1.0, rel=1e-9) and peer["ms"] == pytest.approx(1.2)
    assert wmma["gpu_ratio"] == pytest.approx(0.45, rel=1e-9) and wmma["ratio"] == pytest.approx(1.2 * 0.45)
    assert wmma["gpu_paired"]["ratio_rounds"] == pytest.approx([0.45] * 3, rel=1e-9)
    assert auto["gpu_ratio"] == pytest.approx(0.97, rel=1e-9) and auto["gpu_error"] is None
    assert wmma["gpu_pct_ceiling"] == pytest.approx(100.0 * wmma["gpu_tflops"])
    assert p["backends"]["sm90"] is None and p["gpu_cycles_per_ms"] == pytest.approx(gpu.true_cycles_per_ms)
    s = gbench.summarize([_as_target_shape(p)], ["wmma", "sm90", "auto"])
    assert s["basis"] == "gpu"
    # per call the peer's host floor lifts wmma to 0.54 (>= 0.5: "met"); by GPU time it is 0.45: not met
    assert s["targets_call"]["matmul_wmma"]["met"] is True
    assert s["targets"]["matmul_wmma"]["met"] is False and s["targets"]["matmul_wmma"]["min"] == pytest.approx(0.45)
    assert s["kinds_gpu"]["matmul"]["auto"]["target_min"] == pytest.approx(0.97)
    assert s["rounds"] == [3]
    text = gbench.format_summary(s)
    assert "target verdicts by GPU time only:" in text
    assert "target matmul_wmma >= 0.5x on every target shape: NOT MET (min 0.450" in text
    ref = text.split("per call (host-inclusive; reference, not the verdicts): ")[1].splitlines()[0]
    assert "matmul_wmma min 0.540" in ref
    lines = gbench.format_table([p], ["wmma", "sm90", "auto"]).splitlines()
    assert "gpu xwmma" in lines[0] and "gpu torch TF/s" in lines[0] and len(lines) == 3
    assert "0.45" in lines[2] and "0.54" in lines[2] and lines[2].rstrip().endswith("wmma")


def test_gemm_host_bound_peer_is_invalid(monkeypatch):
    gpu = FakeGpu()
    p, sets = _gemm_setup(monkeypatch, gpu, sync=gbench.PEER)
    gbench.measure_point(p, sets, ["wmma", "auto"], ["wmma"], 1.0, 100.0, 25.0, rounds=2, timing_mode="both",
                         gpu_rep_ms=10.0, gpu_device=gpu)
    assert p["peer"]["gpu_ms"] is None and p["peer"]["gpu_error"]
    assert p["backends"]["wmma"]["gpu_ratio"] is None and p["backends"]["wmma"]["gpu_paired"] is None
    assert p["backends"]["wmma"]["gpu_ms"] == pytest.approx(1 / 0.45, rel=1e-9)
    assert p["backends"]["wmma"]["ratio"] == pytest.approx(0.54, rel=1e-9)
    s = gbench.summarize([_as_target_shape(p)], ["wmma", "auto"])
    assert s["n_gpu_invalid"] == 1 and s["targets"]["matmul_wmma"]["met"] is None     # not measured by GPU time
    assert "GPU time did not hold" in gbench.format_summary(s)
    row = gbench.format_table([p], ["wmma", "auto"]).splitlines()[2]
    assert row.count("inv") == 3        # torch GPU TF/s and both GPU ratios


def test_gemm_timing_options():
    ap = argparse.ArgumentParser()
    gbench.add_arguments(ap)
    a = ap.parse_args([])
    assert a.timing == "both" and a.gpu_rep_ms is None
    a = ap.parse_args(["--timing", "call", "--gpu-rep-ms", "5"])
    assert a.timing == "call" and a.gpu_rep_ms == 5.0
    for bad in (["--timing", "host"], ["--gpu-rep-ms", "0"], ["--gpu-rep-ms", "x"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    with pytest.raises(ValueError, match="timing_mode: expected one of"):
        gbench.run_bench(timing_mode="sometimes")
