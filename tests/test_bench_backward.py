"""CPU tests of the backward benchmark (python/ferroattn/bench/attention_bwd.py and the backward
parts of report.py), its command line, and the gpu_check pieces that run it: stage selection in
scripts/gpu_check.sh, the backward-benchmark / training sections and --merge of
scripts/gpu_check_summary.py, and scripts/sanitize_attention_bwd.py's checks (run on CPU with a
reference standing in for our kernels)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

import ferroattn.__main__ as cli
from ferroattn.bench import attention, attention_bwd, report, timing

from _scripts import ROOT
from _scripts import load_script as _load_script


# ---- FLOPs and grid ---------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q, s_k", [(1024, 1024), (3, 7), (7, 3)])
def test_bwd_flops_are_2_5_and_3_5_times_forward(s_q, s_k, causal):
    f = report.fwd_flops(2, 4, s_q, s_k, 64, causal)
    assert report.bwd_flops(2, 4, s_q, s_k, 64, causal) == pytest.approx(2.5 * f)
    assert report.fwd_bwd_flops(2, 4, s_q, s_k, 64, causal) == pytest.approx(3.5 * f)
    assert report.bwd_flops(1, 16, 16384, 16384, 128, True) == 2.5 * 4 * 16 * (16384 * 16385 // 2) * 128
    with pytest.raises(ValueError, match="d"):
        report.bwd_flops(1, 1, 4, 4, -8, False)


def test_backward_grid_is_the_forward_grid_in_two_modes():
    g = attention_bwd.grid()
    fwd = attention.grid()
    assert set(g) == {"bwd", "fwd_bwd"}
    for mode, factor in (("bwd", 2.5), ("fwd_bwd", 3.5)):
        assert len(g[mode]) == len(fwd) == 72
        for p, f in zip(g[mode], fwd):
            assert p["mode"] == mode
            assert {k: p[k] for k in ("dtype", "causal", "head_dim", "heads", "seqlen", "batch")} == \
                {k: f[k] for k in ("dtype", "causal", "head_dim", "heads", "seqlen", "batch")}
            assert p["fwd_flops"] == f["flops"] and p["flops"] == pytest.approx(factor * f["flops"])
    q = attention_bwd.grid(dtypes=["fp16"], head_dims=[128], seqlens=[16384])
    assert [len(v) for v in q.values()] == [2, 2]
    with pytest.raises(ValueError, match="--head-dims"):
        attention_bwd.grid(head_dims=[96])


# ---- summary / rendering on synthetic points --------------------------------------------

def _pt(mode, d, s, causal, ours, flash, cudnn=None, dtype="bf16", skipped=None, error=None):
    h = 2048 // d
    fl = attention_bwd.FLOPS[mode](16384 // s, h, s, s, d, causal)
    p = {"mode": mode, "dtype": dtype, "causal": causal, "head_dim": d, "heads": h, "seqlen": s, "batch": 16384 // s,
         "flops": fl, "skipped": skipped, "ours_error": error,
         "ours": None if ours is None else {"ms": 1.0, "tflops": ours, "pct_ceiling": 100 * ours / 800},
         "peers": {"flash": None if flash is None else {"ms": 1.0, "tflops": flash},
                   "cudnn": None if cudnn is None else {"ms": 1.0, "tflops": cudnn}},
         "peer_errors": {}, "max_abs_diff": 0.01, "diff_ref": "flash"}
    p["ratio"] = {"flash": ours / flash if ours and flash else None, "cudnn": ours / cudnn if ours and cudnn else None}
    return p


@pytest.fixture
def bwd_points():
    bwd = [_pt("bwd", 64, 1024, False, 240.0, 200.0, 400.0),    # 1.2 / 0.6
           _pt("bwd", 64, 8192, True, 180.0, 200.0, 360.0),     # 0.9 / 0.5
           _pt("bwd", 128, 1024, False, 300.0, 250.0, 500.0),   # 1.2 / 0.6
           _pt("bwd", 128, 8192, True, 330.0, 300.0, 550.0),    # 1.1 / 0.6
           _pt("bwd", 256, 1024, False, 160.0, 200.0),          # 0.8: whole grid only
           _pt("bwd", 256, 8192, True, None, None, skipped="time budget of 60 s used up")]
    fb = [_pt("fwd_bwd", p["head_dim"], p["seqlen"], p["causal"], 250.0, 250.0, 500.0) for p in bwd]
    return {"bwd": bwd, "fwd_bwd": fb}


def test_summarize_backward(bwd_points):
    s = report.summarize_backward(bwd_points)
    b = s["modes"]["bwd"]
    assert b["median_ratio"] == pytest.approx(statistics.median([1.2, 0.9, 1.2, 1.1]))
    assert b["min_ratio"] == pytest.approx(0.9) and "d=64" in b["min_ratio_at"] and "causal" in b["min_ratio_at"]
    assert b["grid_min_ratio"] == pytest.approx(0.8) and "d=256" in b["grid_min_ratio_at"]
    assert b["grid_median_ratio"] == pytest.approx(1.1)
    assert b["per_peer_sel"]["cudnn"]["median_ratio"] == pytest.approx(0.6)
    assert b["per_peer_sel"]["cudnn"]["min_ratio"] == pytest.approx(0.5)
    assert b["per_peer"]["cudnn"]["n"] == 4 and b["per_peer"]["flash"]["n"] == 5
    assert (b["n_points"], b["n_measured"], b["n_skipped"]) == (6, 5, 1)
    assert s["modes"]["fwd_bwd"]["median_ratio"] == pytest.approx(1.0)
    # per-configuration rows: both modes side by side
    assert len(s["per_config"]) == 6
    row = s["per_config"][1]
    assert row["bwd"]["flash"] == pytest.approx(0.9) and row["fwd_bwd"]["flash"] == pytest.approx(1.0)
    # target: median 1.15 >= 1.0 but grid min 0.8 < 0.85, and one point skipped
    t = s["target"]
    assert (t["median_ok"], t["min_ok"], t["met"], t["complete"]) == (True, False, False, False)


def test_backward_target_met_and_not_measured(bwd_points):
    pts = {m: v[:4] for m, v in bwd_points.items()}
    pts["bwd"][1] = _pt("bwd", 64, 8192, True, 190.0, 200.0)          # 0.95 >= 0.85
    t = report.summarize_backward(pts)["target"]
    assert (t["median_ok"], t["min_ok"], t["met"], t["complete"]) == (True, True, True, True)
    none = report.summarize_backward({"bwd": [_pt("bwd", 64, 1024, False, None, None, error="RuntimeError: x")]})
    assert none["target"]["met"] is None
    assert "not measured" in report.format_summary_backward(none)


def test_format_backward_summary_table_and_per_config(bwd_points):
    s = report.summarize_backward(bwd_points)
    text = report.format_summary_backward(s, {"matmul_bf16": {"tflops": 790.0}})
    assert "790 TFLOP/s" in text
    assert "backward alone" in text and "forward + backward" in text
    assert "median ratio ours/SDPA-flash over d 64 & 128: 1.150 (4 points); minimum 0.900" in text
    assert "whole grid: median 1.100, minimum 0.800 at bf16 full d=256" in text
    assert "vs SDPA-cudnn: d 64 & 128 median 0.600, min 0.500" in text
    assert "NOT MET (grid incomplete)" in text.splitlines()[-1]
    pc = report.format_per_config(s, ["flash", "cudnn"]).splitlines()
    assert len(pc) == 2 + 6 and "bwd xflash" in pc[0] and "fwd_bwd xcudnn" in pc[0]
    assert "0.90" in pc[3] and "—" in pc[-1]
    t = report.format_table(bwd_points["bwd"], ["flash", "cudnn"])
    assert "skipped" in t and "1.20" in t


def test_backward_json_name_and_standard_json(bwd_points, tmp_path):
    bwd_points["bwd"][0]["max_abs_diff"] = float("inf")
    res = {"meta": {"device": "NVIDIA H200", "date": "2026-11-30T01:02:03Z"}, "points": bwd_points,
           "summary": report.summarize_backward(bwd_points)}
    path = report.write_json(res, tmp_path, kind="attention_bwd")
    assert path.name == "attention_bwd_nvidia-h200_20261130T010203.json"
    data = json.loads(path.read_text())
    assert data["points"]["bwd"][0]["max_abs_diff"] == "inf"
    assert data["summary"]["target"]["met"] is False


# ---- plumbing on CPU: ours = SDPA math in flash_attn layout, timer stubbed ---------------

def _cpu_sets(n=2, b=2, s=48, h=2, d=64):
    import torch
    ours, sdpa = [], []
    for _ in range(n):
        q, k, v, do = (torch.randn(b, s, h, d) for _ in range(4))
        ours.append({"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(), "dout": do})
        t = [x.detach().transpose(1, 2).contiguous() for x in (q, k, v, do)]
        sdpa.append({"q": t[0].requires_grad_(), "k": t[1].requires_grad_(), "v": t[2].requires_grad_(), "dout": t[3]})
    return ours, sdpa


def _cfg(causal, b=2, s=48, h=2, d=64):
    return {m: {"mode": m, "dtype": "bf16", "causal": causal, "head_dim": d, "heads": h, "seqlen": s, "batch": b,
                "flops": attention_bwd.FLOPS[m](b, h, s, s, d, causal)} for m in attention_bwd.MODES}


@pytest.fixture
def cpu_bwd(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    import ferroattn

    calls = {"fa": [], "det": [], "grad": 0, "retain": []}

    def fake_fa(q, k, v, causal=False, deterministic=False):
        calls["fa"].append(q.data_ptr())
        calls["det"].append(deterministic)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)

    real_grad = torch.autograd.grad

    def counting_grad(outputs, inputs, grad_outputs=None, retain_graph=None, **kw):
        calls["grad"] += 1
        calls["retain"].append(bool(retain_graph))
        return real_grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, **kw)

    def fake_bench(fn, rep_ms=0.0, warmup_ms=0.0):
        for _ in range(3):
            fn()
        return 2.0

    monkeypatch.setattr(ferroattn, "flash_attn_func", fake_fa, raising=False)
    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    monkeypatch.setattr(timing, "bench_gpu", fake_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_measure_config_times_both_modes_and_checks_gradients(cpu_bwd, causal):
    ours, sdpa = _cpu_sets()
    pts = attention_bwd.measure_config(_cfg(causal), ours, sdpa, ["math", "efficient"], 800.0, 1.0, 1.0,
                                       deterministic=True)
    for mode, p in pts.items():
        assert p["ours"]["ms"] == 2.0 and p["ours"]["tflops"] == pytest.approx(report.tflops(p["flops"], 2.0))
        assert p["ours"]["pct_ceiling"] == pytest.approx(100 * p["ours"]["tflops"] / 800.0)
        assert p["peers"]["math"]["ms"] == 2.0 and p["ratio"]["math"] == pytest.approx(1.0)
        assert p["peers"]["efficient"] is None and p["ratio"]["efficient"] is None and p["peer_errors"]["efficient"]
        assert p["diff_ref"] == "math" and set(p["grad_diff"]) == {"dq", "dk", "dv"}
        assert p["max_abs_diff"] == max(p["grad_diff"].values()) < 1e-4
    assert pts["fwd_bwd"]["flops"] == pytest.approx(1.4 * pts["bwd"]["flops"])
    assert all(cpu_bwd["det"]) and len(set(cpu_bwd["fa"])) == 2      # deterministic passed; both sets used
    # the backward-alone calls keep the graph; the fwd+bwd calls build a new one each time
    assert True in cpu_bwd["retain"] and False in cpu_bwd["retain"]


def test_backward_mode_times_backward_only(cpu_bwd, monkeypatch):
    """In the bwd mode the timed function runs no forward: count forwards inside each timed fn."""
    timed_forwards = []

    def bench(fn, rep_ms=0.0, warmup_ms=0.0):
        n0 = len(cpu_bwd["fa"])
        fn()
        fn()
        timed_forwards.append(len(cpu_bwd["fa"]) - n0)
        return 1.0
    monkeypatch.setattr(timing, "bench_gpu", bench)
    ours, sdpa = _cpu_sets()
    attention_bwd.measure_config(_cfg(False), ours, sdpa, [], None, 1.0, 1.0)
    assert timed_forwards == [0, 2]          # bwd: no forward timed; fwd_bwd: one forward per call


def test_measure_config_records_our_failure(cpu_bwd, monkeypatch):
    import ferroattn

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(ferroattn, "flash_attn_func", broken, raising=False)
    ours, sdpa = _cpu_sets(1)
    pts = attention_bwd.measure_config(_cfg(True), ours, sdpa, ["math"], None, 1.0, 1.0)
    for p in pts.values():
        assert p["ours"] is None and "illegal memory access" in p["ours_error"]
        assert p["peers"]["math"] is not None and p["ratio"]["math"] is None and p["max_abs_diff"] is None


def test_measure_config_records_a_timing_failure_of_one_mode(cpu_bwd, monkeypatch):
    n = {"i": 0}

    def bench(fn, rep_ms=0.0, warmup_ms=0.0):
        n["i"] += 1
        if n["i"] == 2:                       # ours, fwd_bwd
            raise RuntimeError("CUDA out of memory")
        fn()
        return 4.0
    monkeypatch.setattr(timing, "bench_gpu", bench)
    ours, sdpa = _cpu_sets(1)
    pts = attention_bwd.measure_config(_cfg(False), ours, sdpa, ["math"], None, 1.0, 1.0)
    assert pts["bwd"]["ours"]["ms"] == 4.0 and pts["bwd"]["ratio"]["math"] == pytest.approx(1.0)
    assert pts["fwd_bwd"]["ours"] is None and "out of memory" in pts["fwd_bwd"]["ours_error"]
    assert pts["fwd_bwd"]["peers"]["math"]["ms"] == 4.0 and pts["fwd_bwd"]["ratio"]["math"] is None


def test_run_end_to_end_with_stubs(cpu_bwd, monkeypatch, tmp_path, capsys):
    from ferroattn.bench import ceilings
    monkeypatch.setattr(attention_bwd, "make_inputs", lambda b, s, h, d, dt, l2: _cpu_sets())
    monkeypatch.setattr(ceilings, "measure", lambda: {"matmul_bf16": {"tflops": 800.0}, "copy_d2d": {"gbps": 4000.0}})
    result, code = attention_bwd.run(out_dir=str(tmp_path), dtypes=["bf16"], head_dims=[64, 128], seqlens=[16384],
                                     peer_names=["math"])
    assert code == 0 and result["partial"] is False
    assert [len(v) for v in result["points"].values()] == [4, 4]
    files = list(tmp_path.glob("attention_bwd_*.json"))
    assert len(files) == 1 and not list(tmp_path.glob("attention_[!b]*.json"))
    data = json.loads(files[0].read_text())
    assert data["summary"]["modes"]["bwd"]["n_measured"] == 4 and data["summary"]["target"]["met"] is True
    assert data["config"]["modes"] == ["bwd", "fwd_bwd"] and "2.5x" in data["config"]["flops"]
    assert data["meta"]["commit"] and data["meta"]["date"] and "torch" in data["meta"]
    out = capsys.readouterr().out
    assert "== backward alone" in out and "== forward + backward" in out and "== ratios ours/peer" in out
    assert out.rstrip().splitlines()[-1].startswith("target (backward >= 1.0x SDPA-math")

    result, code = attention_bwd.run(out_dir=str(tmp_path / "b"), dtypes=["bf16"], head_dims=[64], seqlens=[16384],
                                     peer_names=["math"], time_budget_s=0.0)
    assert code == 1 and all(p["skipped"] for v in result["points"].values() for p in v)


def test_run_stops_after_a_fatal_error(cpu_bwd, monkeypatch, tmp_path):
    import ferroattn
    from ferroattn.bench import ceilings

    def broken(*a, **k):
        raise RuntimeError("CUDA error: unspecified launch failure")
    monkeypatch.setattr(ferroattn, "flash_attn_func", broken, raising=False)
    monkeypatch.setattr(attention_bwd, "make_inputs", lambda b, s, h, d, dt, l2: _cpu_sets(1))
    monkeypatch.setattr(ceilings, "measure", lambda: {"matmul_bf16": None})
    result, code = attention_bwd.run(out_dir=str(tmp_path), dtypes=["bf16"], head_dims=[64], seqlens=[8192, 16384],
                                     peer_names=["math"])
    bwd = result["points"]["bwd"]
    assert code == 1 and bwd[0]["ours_error"] and "fatal CUDA error" in bwd[-1]["skipped"]


# ---- command line -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["bench", "attention", "--backward", "--dtypes", "fp8"], "--dtypes"),
    (["bench", "attention", "--backward", "--head-dims", "96"], "--head-dims"),
    (["bench", "attention", "--backward", "--seqlens", "1000"], "--seqlens"),
    (["bench", "attention", "--backward", "--peers", "flash,xformers"], "--peers"),
    (["bench", "attention", "--backward", "--peers", ","], "--peers"),
    (["bench", "attention", "--deterministic"], "--deterministic"),
    (["bench", "training", "--llm-config", "gpt-17"], "gpt-17"),
])
def test_bench_argument_errors_exit_2_before_gpu_work(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["bench", "training", "--steps", "0"], "--steps"),
    (["bench", "training", "--batch", "x"], "--batch"),
    (["bench", "training", "--seqlen", "-4"], "--seqlen"),
    (["bench", "training", "--lr", "0"], "--lr"),
    (["bench", "training", "--lr", "inf"], "--lr"),
    (["bench", "training", "--memory-seqlen", "1.5"], "--memory-seqlen"),
])
def test_training_argument_errors_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_backward_and_training_without_gpu_exit_3(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "attention", "--backward", "--quick"]) == 3
    assert "no CUDA GPU" in capsys.readouterr().err
    assert cli.main(["bench", "training", "--steps", "2"]) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no CUDA GPU" in err[0] and err[0].startswith("ferroattn bench training")


def test_bench_dispatch(monkeypatch):
    from ferroattn.bench import training
    seen = []
    monkeypatch.setattr(attention, "main_from_args", lambda a: seen.append(("fwd", a.peers)) or 0)
    monkeypatch.setattr(attention_bwd, "main_from_args", lambda a: seen.append(("bwd", a.deterministic)) or 0)
    monkeypatch.setattr(training, "main_from_args", lambda a: seen.append(("train", a.steps, a.batch, a.seqlen)) or 0)
    assert cli.main(["bench", "attention"]) == 0
    assert cli.main(["bench", "attention", "--backward", "--deterministic"]) == 0
    assert cli.main(["bench", "training", "--steps", "3"]) == 0
    assert seen == [("fwd", None), ("bwd", True), ("train", 3, 4, 512)]


def test_help_lists_training():
    r = subprocess.run([sys.executable, "-m", "ferroattn", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "training" in r.stdout


# ---- gpu_check.sh: stage selection ------------------------------------------------------

def _list_stages(value):
    env = dict(os.environ)
    env.pop("GPU_CHECK_STAGES", None)
    if value is not None:
        env["GPU_CHECK_STAGES"] = value
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--list-stages"], capture_output=True,
                          text=True, env=env, timeout=60)


def test_gpu_check_stage_selection():
    r = _list_stages(None)
    assert r.returncode == 0
    assert r.stdout.split() == ["install", "info", "precompile", "warm", "demo", "profile", "notebooks", "train", "host",
                                "bench",
                                "bench_bwd", "bench_decode", "bench_generate", "bench_gemm", "bench_sparse24", "pytest",
                                "memcheck", "racecheck", "synccheck"]
    r = _list_stages("info, train,bench_bwd,memcheck,racecheck")
    assert r.returncode == 0 and r.stdout.split() == ["install", "info", "train", "bench_bwd", "memcheck", "racecheck"]
    r = _list_stages("bench,benchbwd")
    assert r.returncode == 2 and "benchbwd" in r.stderr and "bench_bwd" in r.stderr


def test_gpu_check_script_parses_and_defaults():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    assert 'SANITIZER_FILTER-"--kernel-name kns=attn_"' in text
    assert "scripts/sanitize_attention_bwd.py" in text and "--backward" in text and "bench training" in text
    assert "scripts/sanitize_gemm.py" in text and "bench gemm" in text and "bench sparse24" in text


# ---- gpu_check summary: backward bench, training, sanitizer sums, merge -----------------

def _training_json():
    return {"meta": {"device": "NVIDIA H200"}, "ok": True, "elapsed_s": 71.5,
            "training": {"losses": {"sdpa": [11.9, 9.1], "ferroattn": [11.9, 9.12], "eager": [11.91, 9.13]},
                         "median_step_ms": {"sdpa": 90.5, "ferroattn": 91.0, "eager": 120.0},
                         "check": {"ok": True, "max_diff": 0.02, "worst_step": 1, "bound": 0.091, "noise_max": 0.03}},
            "gradients": {"ok": True, "worst_ratio": 1.21, "worst_at": "padded: model.layers.3.self_attn.k_proj.weight",
                          "batches": {"dense": {"ok": True, "worst_ratio": 1.1, "worst_param": "p", "n_failed": 0,
                                                "n_params": 146, "max_err": {"sdpa": 0.01}}}},
            "memory": {"ok": True, "shape": {"s": 16384}, "ferroattn": {"peak_extra_bytes": 400 * 2**20},
                       "sdpa_flash": {"peak_extra_bytes": 420 * 2**20}, "verdict": {"ratio": 400 / 420}}}


def test_gpu_check_summary_with_backward_and_training(tmp_path, bwd_points, capsys):
    gcs = _load_script("gpu_check_summary")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("install\t0\t1\t120\ntrain\t0\t75\t180\nbench_bwd\t0\t200\t320\n"
                                     "memcheck\t0\t40\t120\n")
    (work / "logs" / "memcheck.log").write_text(
        "--- memcheck: scripts/sanitize_attention.py\nsanitize_attention: 10/10 cases passed\n"
        "========= ERROR SUMMARY: 0 errors\n--- memcheck: scripts/sanitize_attention_bwd.py\n"
        "sanitize_attention_bwd: 6/7 cases passed\n========= ERROR SUMMARY: 2 errors\n")
    (work / "logs" / "racecheck.log").write_text(
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
        "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n")
    bwd_res = {"meta": {"device": "NVIDIA H200"}, "config": {"elapsed_s": 190.0, "deterministic": False},
               "partial": False, "summary": report.summarize_backward(bwd_points),
               "ceilings": {"matmul_bf16": {"tflops": 790.0}}}
    (out / "attention_bwd_nvidia-h200_20261130T000000.json").write_text(json.dumps(bwd_res))
    (out / "training_nvidia-h200_20261130T000000.json").write_text(json.dumps(_training_json()))

    assert gcs.main(["--work", str(work), "--out", str(out), "--elapsed", "330", "--stages",
                     "info,train,bench_bwd,memcheck"]) == 0
    printed = capsys.readouterr().out
    s = json.loads((out / "gpu_check.json").read_text())
    assert "bench" not in s                       # attention_bwd_*.json is not the forward benchmark
    assert s["stages_selected"] == "info,train,bench_bwd,memcheck"
    assert s["bench_bwd"]["summary"]["modes"]["bwd"]["min_ratio"] == pytest.approx(0.9)
    assert "per_config" not in s["bench_bwd"]["summary"] and s["bench_bwd"]["elapsed_s"] == 190.0
    assert s["train"]["ok"] is True and s["train"]["grad"]["worst_ratio"] == 1.21
    assert s["train"]["memory"]["ferroattn_mib"] == 400 and s["train"]["loss"]["first_last"]["sdpa"] == [11.9, 9.1]
    m = s["sanitizer"]["memcheck"]
    assert (m["errors"], m["cases_passed"], m["cases"]) == (2, 16, 17)
    assert m["scripts"] == {"sanitize_attention": [10, 10], "sanitize_attention_bwd": [6, 7]}
    r = s["sanitizer"]["racecheck"]
    assert (r["hazards"], r["errors"], r["warnings"]) == (3, 1, 2)
    assert "bench_bwd backward: median ours/SDPA-flash (d 64 & 128) 1.150, min 0.900" in printed
    assert "xcudnn 0.600" in printed and "bench_bwd target (median >= 1.0, min >= 0.85): NOT MET" in printed
    assert "train losses: max |ferroattn - sdpa| 2.00e-02 (step 1) <= 9.10e-02" in printed
    assert "train step-0 grads: worst err_ferroattn/err_sdpa 1.210" in printed
    assert "train memory s=16384: ferroattn 400 MiB, SDPA-flash 420 MiB (ratio 0.95) PASS" in printed
    assert "train verdict: PASS | median step sdpa 90.5 ms" in printed
    assert printed.rstrip().splitlines()[-1].startswith("overall: OK")


def test_gpu_check_summary_training_failure_and_error(tmp_path, capsys):
    gcs = _load_script("gpu_check_summary")
    out = tmp_path / "out"
    out.mkdir()
    t = _training_json()
    t.update(ok=False, error="RuntimeError: boom")
    t["memory"] = {"error": "RuntimeError: OOM", "ok": False}
    (out / "training_x_1.json").write_text(json.dumps(t))
    s = gcs.build_summary(tmp_path / "nowork", out)
    lines = gcs.format_train(s["train"])
    assert lines[0] == "train: ERROR RuntimeError: boom"
    assert any("ERROR RuntimeError: OOM" in line for line in lines) and lines[-1].startswith("train verdict: FAIL")


def test_gpu_check_summary_merge(tmp_path, capsys):
    gcs = _load_script("gpu_check_summary")
    a = {"device": "NVIDIA H200", "torch": "2.11.0", "elapsed_s": 500, "ok": True,
         "stages": [{"stage": "install", "rc": 0, "skipped": False, "seconds": 1, "limit": 120, "timed_out": False},
                    {"stage": "pytest", "rc": 0, "skipped": False, "seconds": 200, "limit": 240, "timed_out": False}],
         "tests": {"passed": 400}, "sanitizer": {"memcheck": {"ran": False, "tool": "memcheck"}},
         "bench": {"summary": {"median_ratio": 1.03}}}
    b = {"device": "NVIDIA H200", "elapsed_s": 450, "ok": False, "tests": None,
         "stages": [{"stage": "install", "rc": 0, "skipped": False, "seconds": 1, "limit": 120, "timed_out": False},
                    {"stage": "train", "rc": 1, "skipped": False, "seconds": 80, "limit": 180, "timed_out": False}],
         "sanitizer": {"memcheck": {"ran": True, "errors": 0, "tool": "memcheck"}}, "train": _training_json()}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert gcs.main(["--merge", str(pa), str(pb), "--out", str(tmp_path / "m")]) == 1
    m = json.loads((tmp_path / "m" / "gpu_check.json").read_text())
    assert [(st["stage"], st["call"]) for st in m["stages"]] == [("install", 0), ("pytest", 0), ("install", 1), ("train", 1)]
    assert m["tests"] == {"passed": 400} and m["bench"]["summary"]["median_ratio"] == 1.03 and "train" in m
    assert m["sanitizer"]["memcheck"]["ran"] is True and m["elapsed_s"] == 950 and m["ok"] is False
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("overall: NOT OK")
    with pytest.raises(SystemExit):
        gcs.main(["--out", str(tmp_path)])                  # neither --work nor --merge


# ---- scripts/sanitize_attention_bwd.py ----------------------------------------------------

def test_sanitize_bwd_cases_list():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sanitize_attention_bwd.py"), "--list"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert len(out.splitlines()) >= 6
    for needle in ("causal-sq<sk", "causal-sq>sk", "gqa", "varlen-empty", "deterministic", "bogus-cu-seqlens"):
        assert needle in out


@pytest.fixture
def sanitize_bwd_cpu(monkeypatch):
    """The script's autograd cases on CPU, with an fp32 reference standing in for our kernels."""
    torch = pytest.importorskip("torch")
    import ferroattn
    mod = _load_script("sanitize_attention_bwd")
    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    state = {"scale": 1.0, "noise": False}

    def fa(q, k, v, causal=False, deterministic=False, **kw):
        out = mod.attention_ref(q * state["scale"], k, v, causal, torch.float32).to(q.dtype)
        if state["noise"]:
            out = out * (1 + 1e-3 * torch.rand_like(out))       # non-deterministic gradients
        return out

    def fav(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, deterministic=False, **kw):
        pieces, cq, ck = [], cu_q.tolist(), cu_k.tolist()
        for a0, a1, c0, c1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
            if a1 == a0:
                continue
            if c1 == c0:
                pieces.append(q[a0:a1] * 0)
                continue
            pieces.append(mod.attention_ref(q[None, a0:a1], k[None, c0:c1], v[None, c0:c1], causal,
                                            torch.float32)[0].to(q.dtype))
        return torch.cat(pieces) + 0 * (k.sum() + v.sum())
    monkeypatch.setattr(ferroattn, "flash_attn_func", fa, raising=False)
    monkeypatch.setattr(ferroattn, "flash_attn_varlen_func", fav, raising=False)
    torch.manual_seed(0)
    return mod, state


def test_sanitize_bwd_checks_pass_with_a_correct_implementation(sanitize_bwd_cpu):
    mod, _ = sanitize_bwd_cpu
    for name, fn, case in mod.cases():
        if fn is mod.run_case_bogus_cu_seqlens:
            continue
        msg = fn(case)
        assert "dq" in msg and "dk" in msg and "dv" in msg, name
        if "deterministic" in name:
            assert "bitwise equal twice" in msg


def test_sanitize_bwd_checks_catch_wrong_gradients(sanitize_bwd_cpu):
    mod, state = sanitize_bwd_cpu
    state["scale"] = 1.5
    with pytest.raises(AssertionError, match="max\\|out - ref\\|"):
        mod.run_case_padded(mod.PADDED_CASES[0])


def test_sanitize_bwd_checks_catch_nondeterminism(sanitize_bwd_cpu):
    mod, state = sanitize_bwd_cpu
    state["noise"] = True
    det = next(c for c in mod.PADDED_CASES if c[-1])
    with pytest.raises(AssertionError, match="deterministic backward differs"):
        mod.run_case_padded(det)


def test_gpu_check_kernel_cache_round_trip(tmp_path):
    """gpu_check.sh's kernel-cache parts (GPU_CHECK_SAVE_CACHE=1, then carried as .kernel-cache/):
    packed into parts of GPU_CHECK_CACHE_PART_MIB (here 1) and unpacked to the same files; more
    than 4 parts are not saved."""
    cache = tmp_path / "cache" / "13.0" / "sm_90a"
    cache.mkdir(parents=True)
    (cache / "a.cubin").write_bytes(os.urandom(3 * 2**19))          # 1.5 MiB, incompressible: two parts
    (cache / "b.cubin").write_bytes(b"x" * 1000)
    out, restored = tmp_path / "out", tmp_path / "restored"
    out.mkdir()
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = {**os.environ, "GPU_CHECK_CACHE_PART_MIB": "1"}

    def run(*args):
        return subprocess.run(["bash", script, "__fn", *args], capture_output=True, text=True, timeout=120, env=env)
    r = run("cache_pack", str(tmp_path / "cache"), str(out / "kernel-cache"))
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(p.name for p in out.iterdir())
    assert parts == ["kernel-cache.tar.xz.0", "kernel-cache.tar.xz.1"]
    assert all((out / p).stat().st_size <= 2**20 for p in parts)
    r = run("cache_unpack", str(out), str(restored))
    assert r.returncode == 0, r.stdout + r.stderr
    for f in ("a.cubin", "b.cubin"):
        assert (restored / "13.0" / "sm_90a" / f).read_bytes() == (cache / f).read_bytes()
    (cache / "a.cubin").write_bytes(os.urandom(11 * 2**19))         # 5.5 MiB: 6 parts > 4, not saved
    r = run("cache_pack", str(tmp_path / "cache"), str(out / "kernel-cache"))
    assert r.returncode == 1 and "not saved" in r.stdout and not list(out.iterdir())
