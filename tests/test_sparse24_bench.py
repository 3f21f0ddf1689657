"""bench sparse24 on CPU: argument parsing (add_arguments / check_args), the grid, the dispatch
table it derives (and that ferroattn.sparse24 loads it), the summary's targets, the table
formatting, exit 3 without a GPU."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from ferroattn import _native, sparse24
from ferroattn.bench import sparse24 as bench


def _parse(argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_defaults_and_options():
    a = _parse([])
    assert (a.quick, a.out, a.dtypes, a.shapes, a.rep_ms, a.time_budget_s, a.no_semi_structured) == \
        (False, "bench/results", None, "all", None, None, False)
    a = _parse(["--quick", "--dtypes", "fp16", "--shapes", "llm", "--rep-ms", "5", "--no-semi-structured",
                "--out", "/tmp/x"])
    assert a.quick and a.dtypes == "fp16" and a.shapes == "llm" and a.rep_ms == 5.0 and a.no_semi_structured


def test_grid_sizes():
    full = bench.grid()
    assert len(full) == 2 * (5 + 11 * 4) == 98
    assert {(p["n"], p["k"]) for p in full if p["kind"] == "llm"} == set(bench.LLM_NK)
    assert {p["m"] for p in full if p["kind"] == "llm"} == {16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
    sq = [p for p in full if p["kind"] == "square"]
    assert [p["m"] for p in sq[:5]] == [1024, 2048, 4096, 8192, 16384] and all(p["m"] == p["n"] == p["k"] for p in sq)
    assert all(p["flops"] == 2.0 * p["m"] * p["n"] * p["k"] for p in full)
    quick = bench.grid(quick=True)
    assert len(quick) == 2 + 3 * 2 and {p["dtype"] for p in quick} == {"bf16"}
    assert len(bench.grid(dtypes=["fp16"], shapes="square")) == 5


@pytest.mark.parametrize("argv, msg", [
    (["--dtypes", "fp32"], "--dtypes: expected a comma-separated subset of bf16,fp16"),
    (["--shapes", "cube"], "--shapes: expected one of all,square,llm"),
    (["--rep-ms", "0"], "--rep-ms: expected a positive number"),
    (["--rep-ms", "inf"], "--rep-ms: expected a positive number"),
    (["--time-budget-s", "inf"], "--time-budget-s: expected a positive number"),
    (["--time-budget-s", "-1"], "--time-budget-s: expected a positive number"),
])
def test_bad_arguments_exit_2(argv, msg, capsys):
    code, _ = bench.check_args(_parse(argv))
    assert code == 2 and msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_no_gpu_exit_3(capsys):
    assert bench.run(_parse(["--quick"])) == 3
    assert "no CUDA GPU" in capsys.readouterr().err


def _fake_points():
    pts = bench.grid(quick=True)
    for i, p in enumerate(pts):
        s = 0.5 + 0.1 * i
        p.update(ours={"ms": 1.0, "tflops": 1.0}, dense={"ms": s, "tflops": 1.0}, peer={"ms": 1.2, "tflops": 1.0},
                 speedup_vs_dense=s, speedup_vs_peer=1.2, auto_vs_dense=max(s, 1.0), peer_vs_dense=s / 1.2,
                 rel_err=1e-3, auto_choice="sparse" if s >= 1 else "dense", peer_error=None)
    pts[0]["peer_error"] = "RuntimeError: not supported"
    return pts


def test_dispatch_table_round_trip(tmp_path, monkeypatch):
    pts = _fake_points()
    table = bench.dispatch_table(pts, "sm_90")
    by_shape = table["sm_90"]["bfloat16"]
    assert set(by_shape) == {"4096,4096", "8192,8192", "11008,4096"}
    # the square 4096 point and the LLM (4096, 4096) points share a weight shape; sorted by rows
    assert by_shape["4096,4096"] == [[16, 0.7], [256, 0.8], [4096, 0.5], [4096, 0.9]]
    lit = bench.dispatch_literal(table)
    ns: dict = {}
    exec(lit, ns)                                                  # the printed literal is valid Python
    assert ns["DISPATCH_TABLE"]["sm_90"]["bfloat16"][(11008, 4096)][0] == (16, pytest.approx(1.0))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"dispatch_table": table}))
    saved = {a: {d: dict(s) for d, s in v.items()} for a, v in sparse24.DISPATCH_TABLE.items()}
    try:
        monkeypatch.setattr(sparse24.dispatch, "SPARSE_MIN_SPEEDUP", 1.0)
        sparse24.load_dispatch_table(path)
        assert sparse24.dispatch._decide("sm_90", "bfloat16", 11008, 4096, 16) == "sparse"   # 1.0 >= 1.0
        assert sparse24.dispatch._decide("sm_90", "bfloat16", 8192, 8192, 8192) == "dense"   # 0.6
        monkeypatch.setattr(sparse24.dispatch, "SPARSE_MIN_SPEEDUP", 1.1)
        sparse24.load_dispatch_table(path)                                           # clears the memo
        assert sparse24.dispatch._decide("sm_90", "bfloat16", 11008, 4096, 16) == "dense"    # 1.0 < 1.1
    finally:
        sparse24.set_dispatch_table(saved)


def test_summary_and_formatting():
    pts = _fake_points()
    pts[-1]["ours"], pts[-1]["ours_error"], pts[-1]["speedup_vs_dense"] = None, "CudaError: boom", None
    pts[-1]["speedup_vs_peer"] = None
    s = bench.summarize(pts)
    assert s["n_points"] == 8 and s["n_measured"] == 7 and s["n_ours_failed"] == 1
    large = [p["speedup_vs_dense"] for p in pts if p["speedup_vs_dense"] is not None
             and ((p["kind"] == "square" and p["m"] == 8192) or (p["kind"] == "llm" and p["m"] >= 4096))]
    assert s["speedup_vs_dense_large"]["min"] == min(large) and s["speedup_vs_dense_large"]["n"] == len(large)
    assert s["peer_refused"] == ["4096x4096 m=4096 bf16"]
    n_large_peer = sum(1 for p in pts if p["speedup_vs_peer"] is not None
                       and ((p["kind"] == "square" and p["m"] == 8192) or (p["kind"] == "llm" and p["m"] >= 4096)))
    assert s["speedup_vs_peer_large"]["n"] == n_large_peer and 0 < n_large_peer < s["speedup_vs_peer_all"]["n"]
    text = bench.format_table(pts)
    assert "ours: CudaError: boom" in text and len(text.splitlines()) == 2 + 8
    assert "target >= 1.3" in bench.format_summary(s)
    assert "ours / semi-structured peer, large: min" in bench.format_summary(s)


# ---- paired timing on a fake GPU whose clock drifts (no kernels: sparse24.matmul faked) --------
def test_measure_point_paired_speedups_cancel_drift(monkeypatch, knob):
    import torch.nn.functional as F

    knob("wgmma_sp_epilogue", "")
    true_ms = {"dense": 1.0, "sparse": 1 / 1.4, "mma_sp": 1 / 1.2, "wgmma_sp": 1 / 1.45,
               "wgmma_sp_direct": 1 / 1.43, "auto": 1 / 1.35, "peer": 1 / 1.3}
    calls: list[str] = []
    real_linear = F.linear
    ws = [{"dense": torch.randn(16, 32), "peer": torch.randn(16, 32)} for _ in range(2)]
    for w in ws:
        w["ours"], w["peer"] = w["dense"], w["dense"].clone()
    role = {id(w[key]): key for w in ws for key in ("dense", "peer")}

    def fake_linear(x, w, bias=None):
        calls.append(role.get(id(w), "other"))
        return real_linear(x, w, bias)

    def fake_matmul(x, w, bias=None, activation=None, backend="auto"):
        direct = _native.tuning_knobs()["wgmma_sp_epilogue"] == "direct"
        calls.append("wgmma_sp_direct" if (backend == "wgmma_sp" and direct) else backend)
        return real_linear(x, w)

    monkeypatch.setattr(F, "linear", fake_linear)
    monkeypatch.setattr(sparse24, "matmul", fake_matmul)
    monkeypatch.setattr(sparse24, "choose_backend", lambda *a: "sparse")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clock = {"t": 0.0}
    windows: list[str] = []

    def drifting_bench(fn, rep_ms, warmup_ms):      # the clock slows 0.2 % per simulated ms
        fn()
        windows.append(calls[-1])
        dur = rep_ms + warmup_ms + 5 * true_ms[calls[-1]]
        clock["t"] += dur
        return true_ms[calls[-1]] * (1.0 + 2e-3 * (clock["t"] - dur / 2))

    monkeypatch.setattr(bench.timing, "bench_gpu", drifting_bench)
    xs = [torch.randn(8, 32) for _ in range(2)]
    p = {"dtype": "bf16", "kind": "square", "m": 8, "n": 16, "k": 32, "flops": 2.0 * 8 * 16 * 32}
    bench.measure_point(p, xs, ws, None, "FakeSemi", 100.0, 25.0, rounds=5)
    order = ["dense", "sparse", "mma_sp", "wgmma_sp", "wgmma_sp_direct", "auto", "peer"]
    assert windows == (order + order[::-1]) * 5                   # the env variant ran inside its context
    assert _native.tuning_knobs()["wgmma_sp_epilogue"] == "smem"        # and was restored
    assert p["speedup_vs_dense"] == pytest.approx(1.4, rel=1e-12)
    assert p["speedup_vs_peer"] == pytest.approx(1.4 / 1.3, rel=1e-12)
    assert p["auto_vs_dense"] == pytest.approx(1.35, rel=1e-12)
    assert p["peer_vs_dense"] == pytest.approx(1.3, rel=1e-12)
    assert p["paired"]["wgmma_sp_direct_vs_dense"]["ratio"] == pytest.approx(1.43, rel=1e-12)
    assert p["paired"]["mma_sp_vs_dense"]["ratio_rounds"] == pytest.approx([1.2] * 5, rel=1e-12)
    assert p["dense_again"] is None and p["rel_err"] == 0.0 and p["peer_rel_err"] < 1e-6
    assert list(p["kernels"]) == list(bench.KERNELS) and p["kernel_rel_err"]["wgmma_sp_direct"] == 0.0
    for key in ("dense", "ours", "auto", "peer"):
        assert len(p[key]["ms_rounds"]) == 5 and p[key]["ms"] == pytest.approx(sorted(p[key]["ms_rounds"])[2])
    assert max(p["dense"]["ms_rounds"]) / min(p["dense"]["ms_rounds"]) > 1.5    # the clock did drift
    s = bench.summarize([p])
    assert s["rounds"] == [5] and s["below"]["vs_peer_min"]["n_below"] == 0
    assert "median of 5 paired rounds" in bench.format_summary(s)


def test_rounds_option_and_bad_values(capsys):
    assert _parse([]).rounds == 5 and _parse(["--rounds", "9"]).rounds == 9
    code, kwargs = bench.check_args(_parse(["--rounds", "0"]))
    assert code == 2 and "--rounds: expected a positive integer, got 0" in capsys.readouterr().err
    for bad in ("x", "2.5"):
        with pytest.raises(SystemExit) as e:
            _parse(["--rounds", bad])
        assert e.value.code == 2 and f"--rounds: expected a positive integer, got {bad!r}" in capsys.readouterr().err
    code, kwargs = bench.check_args(_parse(["--rounds", "3"]))
    assert kwargs["rounds"] == 3


def test_summary_counts_points_below_goal():
    pts = _fake_points()
    for p in pts:
        p["paired"] = {"speedup_vs_peer": {"ratio_rounds": [1.0] * 3, "ratio_ci": [0.9, 1.05]}}
    pts[1]["speedup_vs_peer"], pts[2]["speedup_vs_peer"] = 0.95, 0.9
    pts[2]["paired"]["speedup_vs_peer"]["ratio_ci"] = [0.85, 0.97]
    s = bench.summarize(pts)
    assert s["rounds"] == [3] and s["below"]["vs_peer_min"] == {"goal": 1.0, "n_below": 2, "n_ci_below": 1}
    text = bench.format_summary(s)
    assert "median of 3 paired rounds" in text and "2 points below 1.0, 1 of them with the whole interval" in text
