"""CPU tests of the GEMM benchmark's pure parts (python/ferroattn/bench/gemm.py): the grid, the
target shapes, summary statistics and verdicts, table and summary text on synthetic numbers, the
command-line options, and that importing the module does not import torch."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from _bench_fakes import small_gemm_point
from ferroattn.bench import gemm as bench


def _parser():
    p = argparse.ArgumentParser(prog="bench gemm")
    bench.add_arguments(p)
    return p


# ---- grid -------------------------------------------------------------------------------
def test_full_grid_is_the_issue_grid():
    g = bench.grid()
    shapes = {(p["suite"], p["m"], p["n"], p["k"]) for p in g}
    assert {s for s in shapes if s[0] == "square"} == {("square", s, s, s) for s in (1024, 2048, 4096, 8192, 16384)}
    llm = {s for s in shapes if s[0] == "llm"}
    assert {(n, k) for _, _, n, k in llm} == {(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)}
    assert {m for _, m, _, _ in llm} == {2 ** i for i in range(4, 15)}  # 16 .. 16384
    assert {p["dtype"] for p in g} == {"bf16", "fp16"}
    # one matmul point and one epilogue point (gelu) per shape and dtype
    assert len(g) == 2 * len(shapes) * 2
    for p in g:
        assert p["flops"] == 2 * p["m"] * p["n"] * p["k"]
        assert (p["kind"] == "matmul") == (p["activation"] is None)


def test_quick_grid_and_filters():
    q = bench.grid(quick=True)
    assert {p["dtype"] for p in q} == {"bf16"} and 0 < len(q) < len(bench.grid()) / 4
    f = bench.grid(dtypes=["fp16"], suites=["llm"], ms=[16], activations=[])
    assert len(f) == 4 and all(p["kind"] == "matmul" and p["m"] == 16 and p["dtype"] == "fp16" for p in f)
    f = bench.grid(suites=["square"], sizes=[512], activations=["relu", "silu"], dtypes=["bf16"])
    assert [p["activation"] for p in f] == [None, "relu", "silu"]


@pytest.mark.parametrize("kwargs,opt", [({"dtypes": ["fp8"]}, "--dtypes"), ({"suites": ["cube"]}, "--suites"),
                                        ({"sizes": [0]}, "--sizes"), ({"ms": [-4]}, "--ms"),
                                        ({"activations": ["tanh"]}, "--activations")])
def test_grid_rejects_values_naming_the_option(kwargs, opt):
    with pytest.raises(ValueError, match=rf"^{opt}: "):
        bench.grid(**kwargs)


@pytest.mark.parametrize("suite,m,n,expect", [("square", 4096, 4096, True), ("square", 2048, 2048, False),
                                              ("llm", 4096, 4096, True), ("llm", 2048, 14336, False),
                                              ("llm", 16384, 4096, True)])
def test_target_shapes(suite, m, n, expect):
    assert bench.is_target_shape({"suite": suite, "m": m, "n": n, "k": 4096}) is expect


# ---- summary ----------------------------------------------------------------------------
def _pt(suite, m, n, kind, ratios, act=None):
    p = {"dtype": "bf16", "suite": suite, "kind": kind, "activation": act, "m": m, "n": n, "k": 4096,
         "flops": 2.0 * m * n * 4096, "peer": {"ms": 1.0, "tflops": 100.0}, "peer_error": None,
         "backends": {}, "backend_errors": {}, "ran": "sm90", "skipped": None}
    for name, r in ratios.items():
        if r is None:
            p["backends"][name] = None
            p["backend_errors"][name] = "ArgumentError: backend: cannot run"
        else:
            p["backends"][name] = {"ms": 1.0 / r, "tflops": 100.0 * r, "ratio": r, "pct_ceiling": 12.5 * r,
                                   "rel_err": 1e-3, "suspect": False}
    return p


def test_summary_statistics_and_verdicts():
    pts = [_pt("square", 8192, 8192, "matmul", {"sm90": 0.97, "wmma": 0.55, "auto": 0.97}),
           _pt("llm", 4096, 11008, "matmul", {"sm90": 0.93, "wmma": 0.6, "auto": 0.93}),
           _pt("llm", 16, 4096, "matmul", {"sm90": 0.4, "wmma": 0.3, "auto": 0.5}),   # not a target shape
           _pt("square", 8192, 8192, "epilogue", {"sm90": 1.2, "wmma": 0.7, "auto": 1.2}, "gelu"),
           _pt("llm", 4096, 4096, "epilogue", {"sm90": None, "wmma": 0.8, "auto": 1.3}, "gelu")]
    s = bench.summarize(pts)
    sm90 = s["kinds"]["matmul"]["sm90"]
    assert sm90["n_target"] == 2 and sm90["target_min"] == 0.93 and sm90["target_median"] == pytest.approx(0.95)
    assert sm90["grid_min"] == 0.4 and sm90["n_grid"] == 3 and "m=4096 n=11008" in sm90["target_min_at"]
    assert s["targets"]["matmul_sm90"]["met"] is False and s["targets"]["matmul_sm90"]["median_met"] is True
    assert s["targets"]["matmul_wmma"]["met"] is True
    assert s["targets"]["epilogue_auto"]["met"] is True and s["targets"]["epilogue_auto"]["min"] == 1.2
    assert s["kinds"]["epilogue"]["sm90"]["n_target"] == 1
    assert s["n_points"] == 5 and s["n_auto_measured"] == 5 and s["n_auto_failed"] == 0
    text = bench.format_summary(s, {"matmul_bf16": {"tflops": 720.0}}, None)
    assert "target matmul_sm90 >= 0.95x on every target shape: NOT MET (min 0.930" in text
    assert "target epilogue_auto median >= 1.0x over the target shapes, none below 0.95x: MET" in text
    assert "bf16 matmul 720 TFLOP/s" in text


@pytest.mark.parametrize("ratios, met", [((1.0, 0.96), False),    # median 0.98 < 1.0
                                         ((1.06, 0.94), False),   # median 1.0, one shape below 0.95
                                         ((1.05, 0.95), True),    # median 1.0, none below 0.95
                                         ((1.01, 1.0), True)])
def test_epilogue_target_is_median_parity_with_a_floor(ratios, met):
    """The fused epilogue's target: median over the target shapes >= 1.0x act(torch.addmm), no
    target shape below 0.95x."""
    pts = [_pt("square", 8192, 8192, "epilogue", {"sm90": r, "wmma": 0.7, "auto": r}, "gelu") for r in ratios]
    v = bench.summarize(pts)["targets"]["epilogue_auto"]
    assert (v["goal"], v["median_goal"]) == (0.95, 1.0)
    assert v["met"] is met


def test_summary_without_measurements_is_not_measured():
    s = bench.summarize([_pt("square", 4096, 4096, "matmul", {"sm90": None, "wmma": None, "auto": None})])
    assert s["targets"]["matmul_sm90"]["met"] is None and s["n_auto_failed"] == 1
    assert "not measured" in bench.format_summary(s)


def test_summary_skips_kinds_without_points():
    """A run without epilogue points (--activations "") prints no epilogue block of empty lines."""
    s = bench.summarize([_pt("square", 8192, 8192, "matmul", {"sm90": 0.97, "wmma": 0.55, "auto": 0.97})])
    text = bench.format_summary(s)
    assert "matmul vs torch.matmul (cuBLAS):" in text
    assert "matmul+bias+activation vs act(torch.addmm):" not in text


def test_table_rows():
    pts = [_pt("square", 4096, 4096, "matmul", {"sm90": 0.97, "wmma": None, "auto": 0.97}),
           dict(_pt("llm", 16, 4096, "epilogue", {}, "gelu"), skipped="time budget")]
    lines = bench.format_table(pts, ["sm90", "wmma", "auto"]).splitlines()
    assert len(lines) == 4 and "torch TF/s" in lines[0] and "xsm90" in lines[0]
    assert "97.0" in lines[2] and "0.97" in lines[2] and "n/a" in lines[2] and lines[2].rstrip().endswith("sm90")
    assert "skipped" in lines[3] and "bias+gelu" in lines[3]


# ---- command line -------------------------------------------------------------------------
def test_arguments_defaults_and_parsing():
    a = _parser().parse_args([])
    assert a.backends == ["wmma", "sm90", "auto"] and a.activations == ["gelu"] and a.layout == "linear"
    assert a.out == "bench/results" and not a.quick and a.dtypes is None
    a = _parser().parse_args(["--quick", "--dtypes", "fp16", "--backends", "auto", "--ms", "16,4096",
                              "--activations", "", "--layout", "nn", "--rep-ms", "20", "--time-budget-s", "60"])
    assert a.quick and a.dtypes == ["fp16"] and a.backends == ["auto"] and a.ms == [16, 4096]
    assert a.activations == [] and a.layout == "nn" and a.rep_ms == 20.0 and a.time_budget_s == 60.0


@pytest.mark.parametrize("argv", [["--dtypes", "fp32"], ["--backends", "cublas"], ["--ms", "0"], ["--sizes", "x"],
                                  ["--rep-ms", "-1"], ["--layout", "tt"], ["--suites", ""]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_run_without_gpu_exits_3(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.run(_parser().parse_args(["--quick"])) == 3
    assert "no CUDA GPU" in capsys.readouterr().err


def test_import_does_not_import_torch():
    code = "import sys, ferroattn.bench.gemm; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# ---- one point, end to end on CPU (the contract emulation as the kernel, a fixed timer) -------
def test_measure_point_emulated(monkeypatch):
    import torch

    import ferroattn.ops.gemm as ops_gemm
    from test_gemm_emulated import ContractNative

    monkeypatch.setattr(ops_gemm, "_native", ContractNative(backends=("wmma",)))
    timed = []

    def fake_bench(fn, rep_ms, warmup_ms):
        fn()
        timed.append(rep_ms)
        return 2.0

    monkeypatch.setattr(bench.timing, "bench_gpu", fake_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    m, n, k = 8, 16, 32
    w = torch.randn(n, k).to(torch.bfloat16)
    sets = [(torch.randn(m, k).to(torch.bfloat16), w.T, torch.randn(n).to(torch.bfloat16)) for _ in range(2)]
    for kind, act in (("matmul", None), ("epilogue", "gelu")):
        p = {"dtype": "bf16", "suite": "square", "kind": kind, "activation": act, "m": m, "n": n, "k": k,
             "flops": 2.0 * m * n * k}
        bench.measure_point(p, sets, ["wmma", "sm90", "auto"], ["wmma"], 1.0, 5.0, 1.0)
        assert p["peer"]["tflops"] == pytest.approx(2.0 * m * n * k / 2e-3 / 1e12)
        assert p["backends"]["sm90"] is None and "not supported" in p["backend_errors"]["sm90"]
        for name in ("wmma", "auto"):
            r = p["backends"][name]
            assert r["ratio"] == pytest.approx(1.0) and r["rel_err"] < 1e-2 and not r["suspect"]
            assert r["pct_ceiling"] == pytest.approx(100.0 * r["tflops"])
        assert p["ran"] == "wmma"


# ---- paired timing (timing.paired_ms) on a fake GPU whose clock drifts ---------------------------
def test_measure_point_paired_ratio_cancels_drift(monkeypatch):
    import torch

    import ferroattn.ops.gemm as ops_gemm
    from test_gemm_emulated import ContractNative

    monkeypatch.setattr(ops_gemm, "_native", ContractNative(backends=("wmma",)))
    calls: list[str] = []
    true_ms = {bench.PEER: 1.0, "wmma": 1.0 / 0.93, "auto": 1.0 / 0.97}
    orig_torch, orig_ours = bench._torch_fn, bench._ours_fn

    def tag(name, f):
        def g(*args):
            calls.append(name)
            return f(*args)
        return g

    monkeypatch.setattr(bench, "_torch_fn", lambda p: tag(bench.PEER, orig_torch(p)))
    monkeypatch.setattr(bench, "_ours_fn", lambda p, b: tag(b, orig_ours(p, b)))
    clock = {"t": 0.0}
    windows: list[tuple[str, float, float]] = []

    def drifting_bench(fn, rep_ms, warmup_ms):    # the clock slows 0.3 % per simulated ms
        fn()
        name = calls[-1]
        windows.append((name, rep_ms, warmup_ms))
        dur = rep_ms + warmup_ms + 5 * true_ms[name]
        clock["t"] += dur
        return true_ms[name] * (1.0 + 3e-3 * (clock["t"] - dur / 2))

    monkeypatch.setattr(bench.timing, "bench_gpu", drifting_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    p, sets = small_gemm_point()
    bench.measure_point(p, sets, ["wmma", "sm90", "auto"], ["wmma"], 1.0, 100.0, 25.0, rounds=5)
    # order: per round peer, wmma, auto, then reversed; 100 / 25 ms per function split over 10 windows
    assert [x[0] for x in windows] == [bench.PEER, "wmma", "auto", "auto", "wmma", bench.PEER] * 5
    assert {(r, wu) for _, r, wu in windows} == {(10.0, 2.5)}
    assert p["backends"]["sm90"] is None and "not supported" in p["backend_errors"]["sm90"]
    assert list(p["backends"]) == ["wmma", "sm90", "auto"]
    for name, goal in (("wmma", 0.93), ("auto", 0.97)):
        r = p["backends"][name]
        assert r["ratio"] == pytest.approx(goal, rel=1e-12)
        assert r["ratio_rounds"] == pytest.approx([goal] * 5, rel=1e-12)
        assert r["ratio_ci"] == pytest.approx([goal, goal]) and r["ratio_ci_level"] == pytest.approx(0.9375)
        assert len(r["ms_rounds"]) == 5 and all(len(wi) == 2 for wi in r["ms_windows"])
        assert r["ms"] == pytest.approx(sorted(r["ms_rounds"])[2]) and not r["suspect"]
        assert r["tflops"] == pytest.approx(p["flops"] / (r["ms"] * 1e-3) / 1e12)
    assert max(p["peer"]["ms_rounds"]) / min(p["peer"]["ms_rounds"]) > 1.5    # the clock did drift
    # what the old sequential method would have reported here: peer then wmma, one 125 ms window each
    clock["t"] = 0.0
    calls.append(bench.PEER)
    peer_seq = drifting_bench(lambda: None, 100.0, 25.0)
    calls.append("wmma")
    wmma_seq = drifting_bench(lambda: None, 100.0, 25.0)
    assert abs(peer_seq / wmma_seq - 0.93) > 0.2


def test_measure_point_rejects_bad_rounds():
    from ferroattn.errors import ArgumentError
    with pytest.raises(ArgumentError, match="rounds: expected a positive integer, got 0"):
        bench.measure_point({}, [], [], [], None, 10.0, 1.0, rounds=0)
    with pytest.raises(ArgumentError, match="rounds: expected a positive integer"):
        bench.run_bench(rounds=-3)


def test_rounds_option(capsys):
    assert _parser().parse_args([]).rounds == 5
    assert _parser().parse_args(["--rounds", "3"]).rounds == 3
    for bad in ("0", "-2", "x", "1.5", ""):
        with pytest.raises(SystemExit) as e:
            _parser().parse_args(["--rounds", bad])
        assert e.value.code == 2
        assert f"--rounds: expected a positive integer, got {bad!r}" in capsys.readouterr().err


def test_summary_states_the_paired_method_and_counts_below_goal():
    pts = [_pt("square", 8192, 8192, "matmul", {"sm90": 0.97, "auto": 0.97}),
           _pt("llm", 4096, 11008, "matmul", {"sm90": 0.93, "auto": 0.93}),
           _pt("llm", 8192, 4096, "matmul", {"sm90": 0.94, "auto": 0.94})]
    cis = [[0.95, 0.99], [0.90, 0.96], [0.92, 0.945]]
    for p, ci in zip(pts, cis):
        for b in ("sm90", "auto"):
            p["backends"][b].update(ratio_rounds=[0.9] * 5, ratio_ci=ci)
    s = bench.summarize(pts, ["sm90", "auto"])
    assert s["rounds"] == [5]
    v = s["targets"]["matmul_sm90"]
    assert v["n_below"] == 2 and v["n_ci_below"] == 1 and v["met"] is False
    text = bench.format_summary(s)
    assert "median of 5 paired rounds" in text
    assert "2 target shapes below, 1 of them with the whole interval below" in text
    assert bench.summarize([_pt("square", 4096, 4096, "matmul", {"sm90": 1.0})], ["sm90"])["rounds"] == []
