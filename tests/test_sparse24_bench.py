"""bench sparse24 on CPU: argument parsing (add_arguments / check_args), the grid, the dispatch
table it derives (and that ferroattn.sparse24 loads it), the summary's targets, the table
formatting, exit 3 without a GPU."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from ferroattn import sparse24
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
        monkeypatch.setattr(sparse24, "SPARSE_MIN_SPEEDUP", 1.0)
        sparse24.load_dispatch_table(path)
        assert sparse24._decide("sm_90", "bfloat16", 11008, 4096, 16) == "sparse"   # 1.0 >= 1.0
        assert sparse24._decide("sm_90", "bfloat16", 8192, 8192, 8192) == "dense"   # 0.6
        monkeypatch.setattr(sparse24, "SPARSE_MIN_SPEEDUP", 1.1)
        sparse24.load_dispatch_table(path)                                           # clears the memo
        assert sparse24._decide("sm_90", "bfloat16", 11008, 4096, 16) == "dense"    # 1.0 < 1.1
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
