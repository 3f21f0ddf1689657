"""CPU tests of the benchmark's pure parts (python/ferroattn/bench/): FLOP formulas, the grid,
summary statistics, table and JSON formatting on synthetic numbers, input rotation, and the
gpu_check summary (scripts/gpu_check_summary.py) on synthetic stage outputs."""
from __future__ import annotations

import json
import subprocess

import pytest

from ferroattn.bench import attention, report, timing

from _scripts import ROOT
from _scripts import load_script as _load_script


# ---- FLOPs ------------------------------------------------------------------------------

def test_fwd_flops_full_and_causal():
    assert report.fwd_flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    # causal with s_q == s_k: the s (s + 1) / 2 visible pairs, the diagonal included
    assert report.fwd_flops(2, 16, 1024, 1024, 128, True) == 4 * 2 * 16 * (1024 * 1025 // 2) * 128


@pytest.mark.parametrize("s_q, s_k", [(3, 7), (7, 3), (1, 5), (5, 1), (4, 4)])
def test_fwd_flops_causal_counts_visible_bottom_right_pairs(s_q, s_k):
    visible = sum(1 for i in range(s_q) for j in range(s_k) if j <= i + s_k - s_q)
    assert report.fwd_flops(1, 1, s_q, s_k, 8, True) == 4 * visible * 8


def test_fwd_flops_rejects_negative():
    with pytest.raises(ValueError, match="s_q"):
        report.fwd_flops(1, 1, -1, 4, 8, False)


def test_flop_counts_refuse_mistyped_arguments():
    from ferroattn.errors import ArgumentError
    for args, name in [((1.5, 1, 4, 4, 8, False), "b"), (("1", 1, 4, 4, 8, False), "b"),
                       ((1, 1, 4, 4, 8, "no"), "causal"), ((1, True, 4, 4, 8, False), "h")]:
        with pytest.raises(ArgumentError, match=f"^{name}: expected"):
            report.fwd_flops(*args)
    for window in [(1,), 3, (1.0, 2)]:
        with pytest.raises(ArgumentError, match="^window_size: expected a pair of ints"):
            report.visible_pairs(4, 4, False, window)
    import numpy as np
    assert report.fwd_flops(np.int64(1), 1, 4, 4, 8, np.bool_(False)) == 4 * 16 * 8


def test_tflops():
    assert report.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert report.tflops(1e12, None) is None and report.tflops(1e12, 0.0) is None


# ---- grid -------------------------------------------------------------------------------

def test_full_grid_is_the_fa3_paper_grid():
    g = attention.grid()
    assert len(g) == 3 * 6 * 2 * 2
    for p in g:
        assert p["batch"] * p["seqlen"] == 16384
        assert p["heads"] * p["head_dim"] == 2048
        assert p["flops"] == report.fwd_flops(p["batch"], p["heads"], p["seqlen"], p["seqlen"], p["head_dim"], p["causal"])
    assert {p["seqlen"] for p in g} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {p["dtype"] for p in g} == {"bf16", "fp16"}


def test_quick_grid_and_filters():
    q = attention.grid(quick=True)
    assert 0 < len(q) < len(attention.grid())
    f = attention.grid(dtypes=["fp16"], head_dims=[128], seqlens=[2048, 16384])
    assert len(f) == 4 and all(p["dtype"] == "fp16" and p["head_dim"] == 128 and p["heads"] == 16 for p in f)


@pytest.mark.parametrize("kw, needle", [({"dtypes": ["fp8"]}, "--dtypes"), ({"head_dims": [96]}, "--head-dims"),
                                        ({"seqlens": [1000]}, "--seqlens")])
def test_grid_rejects_bad_filters(kw, needle):
    with pytest.raises(ValueError, match=needle):
        attention.grid(**kw)


# ---- rotation ---------------------------------------------------------------------------

def test_rotation_count_covers_three_l2():
    assert timing.rotation_count(192 << 20, 60 << 20) == 2
    assert timing.rotation_count(10 << 20, 60 << 20) == 8          # capped
    assert timing.rotation_count(40 << 20, 60 << 20) == 5
    with pytest.raises(ValueError):
        timing.rotation_count(0, 1)


def test_rotating_cycles():
    r = timing.Rotating(["a", "b", "c"])
    assert [r.next() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    with pytest.raises(ValueError):
        timing.Rotating([])


# ---- summary / table / JSON on synthetic points -----------------------------------------

def _point(d, s, causal, ours_tf, flash_tf, dtype="bf16", cudnn_tf=None, skipped=None, ours_error=None):
    h = 2048 // d
    p = {"dtype": dtype, "causal": causal, "head_dim": d, "heads": h, "seqlen": s, "batch": 16384 // s,
         "flops": report.fwd_flops(16384 // s, h, s, s, d, causal), "skipped": skipped, "ours_error": ours_error,
         "ours": None if ours_tf is None else {"ms": 1.0, "tflops": ours_tf, "pct_ceiling": 100 * ours_tf / 800},
         "peers": {"flash": None if flash_tf is None else {"ms": 1.0, "tflops": flash_tf},
                   "cudnn": None if cudnn_tf is None else {"ms": 1.0, "tflops": cudnn_tf}},
         "peer_errors": {} if cudnn_tf else {"cudnn": "RuntimeError: No available kernel"},
         "max_abs_diff": 1e-3, "diff_ref": "flash"}
    p["ratio"] = {"flash": (ours_tf / flash_tf) if ours_tf and flash_tf else None,
                  "cudnn": (ours_tf / cudnn_tf) if ours_tf and cudnn_tf else None}
    return p


@pytest.fixture
def points():
    return [
        _point(64, 1024, False, 300.0, 400.0),             # 0.75
        _point(64, 8192, True, 450.0, 450.0, cudnn_tf=500.0),  # 1.0
        _point(128, 1024, False, 500.0, 400.0),            # 1.25
        _point(128, 8192, True, 550.0, 500.0),             # 1.1
        _point(256, 1024, False, 100.0, 400.0),            # 0.25, excluded from the d 64/128 summary
        _point(128, 16384, False, None, 500.0, ours_error="CompileError: boom"),
        _point(64, 16384, False, None, None, skipped="time budget of 60 s used up"),
    ]


def test_summarize(points):
    s = report.summarize(points)
    assert s["median_ratio"] == pytest.approx(statistics_median([0.75, 1.0, 1.25, 1.1]))
    assert s["min_ratio"] == pytest.approx(0.75)
    assert "d=64" in s["min_ratio_at"] and "s=1024" in s["min_ratio_at"]
    assert s["n_ratio_points"] == 4
    assert s["per_peer"]["flash"]["min_ratio"] == pytest.approx(0.25)
    assert s["per_peer"]["cudnn"]["n"] == 1
    assert s["best_pct_ceiling"] == pytest.approx(100 * 550 / 800)
    assert (s["n_points"], s["n_measured"], s["n_ours_failed"], s["n_skipped"]) == (7, 5, 1, 1)


def statistics_median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def test_summarize_with_nothing_measured():
    s = report.summarize([_point(64, 1024, False, None, None)])
    assert s["median_ratio"] is None and s["min_ratio"] is None and s["min_ratio_at"] is None
    assert "—" in report.format_summary(s)


def test_format_table_and_summary(points):
    t = report.format_table(points, ["flash", "cudnn"])
    lines = t.splitlines()
    assert len(lines) == 2 + len(points)
    assert "ours TF/s" in lines[0] and "xflash" in lines[0]
    assert "n/a" in t and "skipped" in t and "ERR" in t and "0.75" in t
    host = {"shape": "b=1 s=128 h=16 d=64 bfloat16",
            "ferroattn": {"host_us": 21.5, "gpu_us": 6.0, "host_bound": True},
            "sdpa_default": {"host_us": 12.25, "gpu_us": 7.0, "host_bound": True},
            "sdpa_flash": {"host_us": None, "gpu_us": None, "error": "RuntimeError: x"}}
    ceil = {"matmul_bf16": {"tflops": 789.4}, "copy_d2d": {"gbps": 4301.0}}
    out = report.format_summary(report.summarize(points), ceil, host)
    assert "median ratio ours/SDPA-flash over d 64 & 128: 1.050" in out
    assert "minimum ratio ours/SDPA-flash over d 64 & 128: 0.750" in out
    assert "789 TFLOP/s" in out and "4301 GB/s" in out
    assert "ferroattn: 21.5 us" in out and "sdpa_flash: n/a" in out


def test_write_json_is_standard_json_and_named_by_device(points, tmp_path):
    points[0]["max_abs_diff"] = float("nan")
    result = {"meta": {"device": "NVIDIA H200", "date": "2026-11-29T18:00:00Z"}, "points": points,
              "summary": report.summarize(points)}
    path = report.write_json(result, tmp_path / "results")
    assert path.name == "attention_nvidia-h200_20261129T180000.json"
    data = json.loads(path.read_text())        # strict: no NaN literal
    assert data["points"][0]["max_abs_diff"] == "nan"
    assert data["summary"]["min_ratio"] == pytest.approx(0.75)
    assert not list(path.parent.glob("*.tmp"))


def test_git_commit_prefers_env(monkeypatch):
    monkeypatch.setenv("FERROATTN_COMMIT", "abc123")
    assert report.git_commit() == "abc123"
    monkeypatch.delenv("FERROATTN_COMMIT")
    c = report.git_commit(ROOT)
    assert c == "unknown" or len(c) >= 40


def test_bench_package_import_does_not_import_torch():
    code = "import sys; import ferroattn.bench.attention, ferroattn.bench.report; print('torch' in sys.modules)"
    r = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


# ---- gpu_check summary ------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="3" tests="20" time="12.0"><testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="test_err" time="0.1"><error message="y"/></testcase>
</testsuite></testsuites>"""


def test_gpu_check_summary(tmp_path, points, capsys):
    gcs = _load_script("gpu_check_summary")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("install\t0\t3\t120\nprecompile\t1\t95\t200\nbench\t124\t150\t150\n"
                                     "racecheck\tskipped\t0\t0\n")
    (work / "logs" / "junit.xml").write_text(JUNIT)
    (work / "logs" / "memcheck.log").write_text("PASS x\nsanitize_attention: 8/8 cases passed\n"
                                                "========= ERROR SUMMARY: 0 errors\n")
    (work / "logs" / "info.json").write_text(json.dumps({"version": "0.1.0", "nvrtc_version": "13.0",
                                                         "gpu": {"name": "NVIDIA H200", "driver_version": 13000}}))
    (work / "logs" / "nvidia_driver.txt").write_text("580.159.04\n")
    (work / "logs" / "precompile.json").write_text(json.dumps({"archs": ["sm_90a"], "spilled": 2, "errors": [],
                                                               "kernels": [{"compile_seconds": 2.5, "registers": 255}] * 4}))
    (out / "demo.json").write_text(json.dumps({"ok": True, "minilm": {"min_cosine": 0.99999, "ms_ferroattn": 1.5,
                                                                      "ms_sdpa": 1.7},
                                               "llm": {"seqlens": {"2048": {"rel_err": 3e-3, "max_abs_diff": 0.06,
                                                                            "argmax_agreement": 0.995,
                                                                            "ms_ferroattn": 20.0, "ms_sdpa": 21.0}}}}))
    res = {"meta": {"device": "NVIDIA H200"}, "summary": report.summarize(points),
           "ceilings": {"matmul_bf16": {"tflops": 790.0}},
           "host_cost": {"ferroattn": {"host_us": 20.0, "gpu_us": 5.0, "host_bound": True}}, "config": {"elapsed_s": 100}}
    (out / "attention_nvidia-h200_20261129T180000.json").write_text(json.dumps(res))

    assert gcs.main(["--work", str(work), "--out", str(out), "--elapsed", "480"]) == 1
    printed = capsys.readouterr().out
    s = json.loads((out / "gpu_check.json").read_text())
    assert s["device"] == "NVIDIA H200" and s["driver"] == "580.159.04" and s["cuda_driver_api"] == 13000 and s["elapsed_s"] == 480
    assert s["tests"]["tests"] == 20 and s["tests"]["passed"] == 14 and len(s["tests"]["failed_names"]) == 2
    assert s["sanitizer"]["memcheck"]["errors"] == 0 and s["sanitizer"]["memcheck"]["cases"] == 8
    assert s["sanitizer"]["racecheck"]["ran"] is False
    assert [st["stage"] for st in s["stages"]] == ["install", "precompile", "bench", "racecheck"]
    assert s["stages"][2]["timed_out"] and s["stages"][3]["skipped"]
    assert s["precompile"]["compile_seconds"] == 10.0 and s["precompile"]["spilled"] == 2
    assert s["demo"]["minilm_min_cosine"] == 0.99999
    assert s["bench"]["summary"]["min_ratio"] == pytest.approx(0.75)
    assert s["ok"] is False
    assert printed.rstrip().splitlines()[-1].startswith("overall: NOT OK")
    assert "TIMEOUT" in printed and "skipped" in printed and "min cosine 0.999990" in printed
    assert "ferroattn 20.0 us" in printed


def test_gpu_check_summary_parsers():
    gcs = _load_script("gpu_check_summary")
    assert gcs.parse_pytest_log("...\n===== 2 failed, 10 passed, 1 skipped, 5 deselected in 4.20s =====\n") == \
        {"failed": 2, "passed": 10, "skipped": 1, "deselected": 5}
    r = gcs.parse_sanitizer("========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n", "racecheck")
    assert (r["hazards"], r["errors"], r["warnings"]) == (3, 1, 2)
    # racecheck checks every kernel: the summary names the kernels its races were reported in
    log = ("========= Error: Race reported between Read access at nvjet_sm90_tst_64x8+0xb00\n"
           "=========     and Write access at nvjet_sm90_tst_64x8+0x2820 [128 hazards]\n"
           "========= Error: Race reported between Write access at attn_fwd_sm90+0x10\n"
           "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")
    assert gcs.parse_sanitizer(log, "racecheck")["race_kernels"] == ["attn_fwd_sm90", "nvjet_sm90_tst_64x8"]
    assert gcs.parse_sanitizer("", "memcheck")["ran"] is False


def test_gpu_check_scripts_parse():
    for script in ("gpu_check.sh", "build_wheel.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_sanitize_cases_list():
    r = subprocess.run([__import__("sys").executable, str(ROOT / "scripts" / "sanitize_attention.py"), "--list"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and len(r.stdout.splitlines()) >= 6 and "varlen" in r.stdout


# ---- one grid point's plumbing on CPU (ours = SDPA in flash_attn layout, timer stubbed) ---

def _small_point(causal):
    b, s, h, d = 2, 48, 2, 64
    return {"dtype": "bf16", "causal": causal, "head_dim": d, "heads": h, "seqlen": s, "batch": b,
            "flops": report.fwd_flops(b, h, s, s, d, causal)}


def _cpu_sets(n=2):
    import torch
    ours = [tuple(torch.randn(2, 48, 2, 64) for _ in range(3)) for _ in range(n)]
    sdpa = [tuple(x.transpose(1, 2).contiguous() for x in qkv) for qkv in ours]
    return ours, sdpa


@pytest.fixture
def cpu_bench(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    import ferroattn

    calls = []

    def fake_fa(q, k, v, causal=False):
        calls.append(q.data_ptr())
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)

    def fake_bench(fn, rep_ms=0.0, warmup_ms=0.0):
        for _ in range(3):
            fn()
        return 2.0

    monkeypatch.setattr(ferroattn, "flash_attn_func", fake_fa, raising=False)
    monkeypatch.setattr(timing, "bench_gpu", fake_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_measure_point_records_peers_ratios_and_diff(cpu_bench, causal):
    ours, sdpa = _cpu_sets()
    p = attention.measure_point(_small_point(causal), ours, sdpa, ["math", "efficient"], 800.0, 1.0, 1.0)
    assert p["ours"]["ms"] == 2.0 and p["ours"]["tflops"] == pytest.approx(report.tflops(p["flops"], 2.0))
    assert p["ours"]["pct_ceiling"] == pytest.approx(100 * p["ours"]["tflops"] / 800.0)
    assert p["peers"]["math"]["ms"] == 2.0 and p["ratio"]["math"] == pytest.approx(1.0)
    assert p["peers"]["efficient"] is None and p["ratio"]["efficient"] is None   # no CPU kernel
    assert "efficient" in p["peer_errors"] and p["peer_errors"]["efficient"]
    assert p["diff_ref"] == "math" and p["max_abs_diff"] < 1e-5
    assert len(set(cpu_bench)) == 2          # the timed calls rotated over both input sets


def test_measure_point_records_our_failure(monkeypatch, cpu_bench):
    import ferroattn

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(ferroattn, "flash_attn_func", broken, raising=False)
    ours, sdpa = _cpu_sets(1)
    p = attention.measure_point(_small_point(False), ours, sdpa, ["math"], None, 1.0, 1.0)
    assert p["ours"] is None and "illegal memory access" in p["ours_error"]
    assert p["peers"]["math"] is not None and p["ratio"]["math"] is None and p["max_abs_diff"] is None
    assert attention._is_fatal(p["ours_error"]) and not attention._is_fatal("ArgumentError: head_dim")


def test_run_end_to_end_with_stubs(cpu_bench, monkeypatch, tmp_path, capsys):
    """attention.run on CPU: inputs shrunk, ceilings/host cost stubbed, timer stubbed."""
    from ferroattn.bench import ceilings, hostcost
    monkeypatch.setattr(attention, "make_inputs", lambda b, s, h, d, dt, l2: _cpu_sets())
    monkeypatch.setattr(ceilings, "measure", lambda: {"matmul_bf16": {"tflops": 800.0}, "copy_d2d": {"gbps": 4000.0}})
    monkeypatch.setattr(hostcost, "measure", lambda: {"shape": "b=1 s=128 h=16 d=64 bfloat16",
                                                      "ferroattn": {"host_us": 20.0, "gpu_us": 5.0, "host_bound": True}})
    result, code = attention.run(out_dir=str(tmp_path), dtypes=["bf16"], head_dims=[64], seqlens=[8192, 16384],
                                 peer_names=["math"])
    assert code == 0 and result["partial"] is False
    assert len(result["points"]) == 4 and all(p["ratio"]["math"] is not None for p in result["points"])
    files = list(tmp_path.glob("attention_*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["summary"]["n_measured"] == 4 and data["ceilings"]["matmul_bf16"]["tflops"] == 800.0
    out = capsys.readouterr().out
    assert "median ratio ours/SDPA-math over d 64 & 128" in out and "raw JSON:" in out
    assert out.rstrip().splitlines()[-1].startswith("host cost per call")

    result, code = attention.run(out_dir=str(tmp_path / "b"), dtypes=["bf16"], head_dims=[64], seqlens=[8192],
                                 peer_names=["math"], time_budget_s=0.0)
    assert code == 1 and all(p["skipped"] for p in result["points"])


def test_flop_counts_share_the_native_formula():
    """The benchmarks' and the ops' FLOP counts come from ``_native.attn_flops`` (one formula):
    forward 2 products, backward 5, over the same visible pairs."""
    import torch

    from ferroattn import _native
    from ferroattn.bench.report import bwd_flops, fwd_bwd_flops, fwd_flops, visible_pairs
    from ferroattn.ops.attention import attn_fwd_flops
    from ferroattn.ops.attention_bwd import attn_bwd_flops

    assert (_native.ATTN_FWD_PRODUCTS, _native.ATTN_BWD_PRODUCTS) == (2, 5)
    assert _native.attn_flops(2, 10, 128) == 2 * 2 * 10 * 128
    b, h, hk, s_q, s_k, d = 2, 4, 2, 300, 517, 64
    for causal, window in [(False, (-1, -1)), (True, (-1, -1)), (False, (33, 7))]:
        pairs = b * h * visible_pairs(s_q, s_k, causal, window)
        assert fwd_flops(b, h, s_q, s_k, d, causal, window) == 4 * pairs * d
        assert bwd_flops(b, h, s_q, s_k, d, causal, window) == 10 * pairs * d
        assert fwd_bwd_flops(b, h, s_q, s_k, d, causal, window) == 14 * pairs * d
        q = torch.empty(b, s_q, h, d, device="meta", dtype=torch.float16)
        k = torch.empty(b, s_k, hk, d, device="meta", dtype=torch.float16)
        args = (q, k, k, None, None, s_q, s_k, 0.125, causal, False, window[0], window[1])
        assert attn_fwd_flops(*args) == 4 * pairs * d
        lse = torch.empty(b, h, s_q, device="meta")
        assert attn_bwd_flops(q, q, k, k, q, lse, *args[3:]) == 10 * pairs * d


def test_visible_pairs_counts_the_mask_flash_attn_runs():
    """The window normalised as flash_attn does (a side >= s_k unbounded, the unset side s_k),
    checked against the reference mask (ferroattn.testing.visible_mask), s_q > s_k included."""
    import itertools
    from ferroattn.testing import visible_mask
    for s_q, s_k in itertools.product(range(1, 7), repeat=2):
        for causal in (False, True):
            for w in [(-1, -1), (0, 0), (0, 2), (-1, 2), (2, -1), (1, 0), (3, 1), (10, 10), (-5, 0)]:
                want = int(visible_mask(s_q, s_k, causal, w).sum())
                assert report.visible_pairs(s_q, s_k, causal, w) == want, (s_q, s_k, causal, w)


def test_head_dim_192_is_opt_in():
    assert all(p["head_dim"] != 192 for p in attention.grid())
    pts = attention.grid(quick=True, head_dims=[192])
    assert pts and all((p["head_dim"], p["heads"]) == (192, 8) for p in pts)
    assert [p["head_dim"] for p in attention.grid(quick=True, head_dims=[256, 192])][::4] == [192, 256]
