"""CPU tests of the A/B candidates of ``bench attention`` (python/ferroattn/bench/candidate.py): the
``--candidate`` list, its checks before any GPU work, and the forward / backward measurements with a
fake kernel that reads the knob it is measured under (so the candidate provably ran under its knobs
and ours did not), with the knobs restored after."""
from __future__ import annotations

import pytest

import ferroattn.__main__ as cli
import ferroattn._native as native
from ferroattn.bench import attention, attention_bwd, candidate, report, timing

KNOB = "attn_sm90_fwd_kv_release"


def test_parse_accepts_lists_and_rejects_malformed_ones():
    assert candidate.parse("a=1") == {"a": "1"}
    assert candidate.parse(" a = 1 , b=x,") == {"a": "1", "b": "x"}
    assert candidate.parse("a=") == {"a": ""}
    # a value with commas (the tile knobs): the pieces without "=" belong to the value before them
    assert candidate.parse("gemm_wmma_tile=128,128,32,2,4,4, b=x") == {"gemm_wmma_tile": "128,128,32,2,4,4", "b": "x"}
    for bad, needle in [("", "expected name=value"), ("a", "'a'"), ("=1", "'=1'"), ("a=1,a=2", "twice")]:
        with pytest.raises(ValueError, match=needle):
            candidate.parse(bad)


@pytest.mark.parametrize("argv, needle", [
    (["bench", "attention", "--candidate", "nope=1"], "nope"),
    (["bench", "attention", "--candidate", f"{KNOB}=sideways"], "sideways"),
    (["bench", "attention", "--backward", "--candidate", "a"], "expected name=value"),
    (["bench", "attention", "--variants", "--candidate", f"{KNOB}=separate"], "only for the plain grid"),
    (["bench", "attention", "--candidate", f"{KNOB}=separate", "--candidate", f" {KNOB} = separate"], "twice"),
    # the same knobs after canonicalisation: another spelling of a value, another order, a leading zero
    (["bench", "attention", "--candidate", "attn_sm90_fwd_persistent=1", "--candidate", "attn_sm90_fwd_persistent=on"],
     "given twice (as attn_sm90_fwd_persistent=1)"),
    (["bench", "attention", "--candidate", f"{KNOB}=separate,attn_sm90_fwd_stages=3",
      "--candidate", f"attn_sm90_fwd_stages=03,{KNOB}=separate"], "given twice"),
    # a knob at its current value changes nothing: the same candidate as without it
    (["bench", "attention", "--candidate", f"{KNOB}=separate",
      "--candidate", f"{KNOB}=separate,attn_sm90_fwd_stages=auto"], "given twice (as attn_sm90_fwd_kv_release=separate)"),
    # a candidate that changes nothing measures ours against ours
    (["bench", "attention", "--candidate", "attn_sm90_fwd_persistent=auto"], "sets every knob to its current value"),
    (["bench", "attention", "--backward", "--candidate", f"{KNOB}=auto"], "would measure ours again"),
    # a comma inside a value that takes none is the knob's own error, naming the value
    (["bench", "attention", "--candidate", f"{KNOB}=separate,3"], '"separate,3"'),
])
def test_bad_candidates_exit_2_before_any_gpu_work(argv, needle, capsys):
    before = native.tuning_knobs()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--candidate" in err and needle in err, err
    assert native.tuning_knobs() == before


def test_a_malformed_knob_variable_is_named_with_and_without_candidates():
    """A malformed FERROATTN_* variable fails ``bench`` with 2 before any GPU check, naming the
    variable (not as a --candidate error), also on a machine without a GPU."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FERROATTN_ATTN_SM90_FWD_STAGES="banana")
    for extra in ([], ["--candidate", f"{KNOB}=separate"], ["--backward"]):
        r = subprocess.run([sys.executable, "-m", "ferroattn", "bench", "attention", "--quick", *extra],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (extra, r.stderr)
        assert "FERROATTN_ATTN_SM90_FWD_STAGES" in r.stderr and "banana" in r.stderr, r.stderr
        assert "--candidate" not in r.stderr, r.stderr


def test_good_candidates_are_checked_labelled_and_leave_the_knobs_as_they_were():
    before = native.tuning_knobs()
    args = type("A", (), {"candidate": [f"{KNOB}=separate", f" {KNOB}=separate, attn_sm90_fwd_stages=3"]})()
    assert candidate.from_args("p", args) == (None, {
        f"{KNOB}=separate": {KNOB: "separate"},
        f"{KNOB}=separate,attn_sm90_fwd_stages=3": {KNOB: "separate", "attn_sm90_fwd_stages": "3"}})
    assert candidate.from_args("p", type("A", (), {"candidate": None})()) == (None, None)
    assert native.tuning_knobs() == before


def _timed_by_knob(ms_default: float, ms_candidate: float, ms_three: float | None = None):
    """A fake bench_gpu that runs fn a few times and reports the time of the knobs it runs under
    (``ms_three`` when attn_sm90_fwd_stages is 3 as well)."""
    def bench(fn, rep_ms=0.0, warmup_ms=0.0):
        for _ in range(2):
            fn()
        k = native.tuning_knobs()
        if k[KNOB] != "separate":
            return ms_default
        return ms_three if k["attn_sm90_fwd_stages"] == "3" else ms_candidate
    return bench


@pytest.fixture
def fakes(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    import ferroattn

    seen = []

    def fake_fa(q, k, v, causal=False, deterministic=False):
        seen.append(native.tuning_knobs()[KNOB])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
        # the candidate's output differs by a known amount, which its max_abs_diff must report
        return out + 0.25 if seen[-1] == "separate" else out

    monkeypatch.setattr(ferroattn, "flash_attn_func", fake_fa, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return seen


def test_forward_point_measures_each_candidate_under_its_knobs(fakes, monkeypatch):
    import torch
    monkeypatch.setattr(timing, "bench_gpu", _timed_by_knob(2.0, 1.6, 2.5))
    b, s, h, d = 1, 32, 2, 64
    ours = [tuple(torch.randn(b, s, h, d) for _ in range(3)) for _ in range(2)]
    sdpa = [tuple(x.transpose(1, 2).contiguous() for x in t) for t in ours]
    p = {"dtype": "bf16", "causal": True, "head_dim": d, "heads": h, "seqlen": s, "batch": b,
         "flops": report.fwd_flops(b, h, s, s, d, True)}
    before = native.tuning_knobs()
    cands = {"sep": {KNOB: "separate"}, "sep3": {KNOB: "separate", "attn_sm90_fwd_stages": "3"}}
    attention.measure_point(p, ours, sdpa, ["math"], None, 1.0, 1.0, candidates=cands)
    assert native.tuning_knobs() == before
    assert "auto" in fakes and "separate" in fakes
    c, c3 = p["candidates"]["sep"], p["candidates"]["sep3"]
    assert c["ms"] == 1.6 and c["speedup"] == pytest.approx(2.0 / 1.6)
    assert c3["ms"] == 2.5 and c3["speedup"] == pytest.approx(2.0 / 2.5)
    assert c["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert p["ours"]["ms"] == 2.0 and p["ratio"]["math"] is not None
    s = candidate.summarize([p], cands)
    assert s["sep"]["median_speedup"] == s["sep"]["min_speedup"] == s["sep"]["max_speedup"] == pytest.approx(1.25)
    assert s["sep3"]["median_speedup"] == pytest.approx(0.8) and s["sep3"]["knobs"] == cands["sep3"]
    assert s["sep"]["n"] == 1 and s["sep"]["n_failed"] == 0 and s["sep"]["min_at"] == report.point_label(p)
    text = candidate.format_summary(s)
    assert len(text.splitlines()) == 2 and "1.250" in text and "0.800" in text
    assert candidate.summarize([p], None) is None


def test_forward_point_records_a_failing_candidate(fakes, monkeypatch):
    import torch
    import ferroattn
    real = ferroattn.flash_attn_func

    def fails_under_the_knob(*a, **k):
        if native.tuning_knobs()[KNOB] == "separate":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*a, **k)
    monkeypatch.setattr(ferroattn, "flash_attn_func", fails_under_the_knob, raising=False)
    monkeypatch.setattr(timing, "bench_gpu", _timed_by_knob(2.0, 1.0))
    ours = [tuple(torch.randn(1, 16, 2, 64) for _ in range(3))]
    sdpa = [tuple(x.transpose(1, 2).contiguous() for x in t) for t in ours]
    p = {"dtype": "bf16", "causal": False, "head_dim": 64, "heads": 2, "seqlen": 16, "batch": 1,
         "flops": report.fwd_flops(1, 2, 16, 16, 64, False)}
    attention.measure_point(p, ours, sdpa, [], None, 1.0, 1.0, candidates={"sep": {KNOB: "separate"}})
    assert p["ours"]["ms"] == 2.0 and "illegal memory access" in p["candidate_errors"]["sep"] and "candidates" not in p
    assert candidate.summarize([p], {"sep": {KNOB: "separate"}})["sep"]["n_failed"] == 1


def test_backward_config_measures_the_candidate_in_both_modes(fakes, monkeypatch):
    import torch
    monkeypatch.setattr(timing, "bench_gpu", _timed_by_knob(3.0, 2.0))
    b, s, h, d = 1, 32, 2, 64
    ours, sdpa = [], []
    for _ in range(2):
        q, k, v, do = (torch.randn(b, s, h, d) for _ in range(4))
        ours.append({"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(), "dout": do})
        t = [x.detach().transpose(1, 2).contiguous() for x in (q, k, v, do)]
        sdpa.append({"q": t[0].requires_grad_(), "k": t[1].requires_grad_(), "v": t[2].requires_grad_(), "dout": t[3]})
    pts = {m: {"mode": m, "dtype": "bf16", "causal": True, "head_dim": d, "heads": h, "seqlen": s, "batch": b,
               "flops": attention_bwd.FLOPS[m](b, h, s, s, d, True)} for m in attention_bwd.MODES}
    before = native.tuning_knobs()
    attention_bwd.measure_config(pts, ours, sdpa, [], None, 1.0, 1.0, candidates={"sep": {KNOB: "separate"}})
    assert native.tuning_knobs() == before
    for p in pts.values():
        assert p["ours"]["ms"] == 3.0
        c = p["candidates"]["sep"]
        assert c["ms"] == 2.0 and c["speedup"] == pytest.approx(1.5)
        # the fake's +0.25 is a constant: it has no gradient, so the candidate's gradients equal ours
        assert c["max_abs_diff"] == pytest.approx(0.0, abs=1e-5)


def test_gpu_check_summary_reports_the_candidates(tmp_path, capsys):
    import json

    from _scripts import load_script

    gcs = load_script("gpu_check_summary")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("bench\t0\t100\t200\nbench_bwd\t0\t100\t200\n")
    c = {"knobs": {KNOB: "separate"}, "median_speedup": 1.07, "min_speedup": 0.99, "max_speedup": 1.2,
         "min_at": "bf16 full d=64 h=32 s=1024 b=16", "n": 6, "n_failed": 0}
    fwd = {"meta": {}, "config": {}, "summary": {"median_ratio": 1.0, "n_measured": 6, "n_points": 6},
           "ceilings": {}, "candidates": {f"{KNOB}=separate": c}}
    bwd = {"meta": {}, "config": {}, "summary": {"modes": {}}, "ceilings": {},
           "candidates": {"bwd": {"attn_sm90_bwd_dq_overlap=1": dict(c, median_speedup=1.11)}}}
    (out / "attention_nvidia-h200_20261205T000000.json").write_text(json.dumps(fwd))
    (out / "attention_bwd_nvidia-h200_20261205T000000.json").write_text(json.dumps(bwd))
    gcs.main(["--work", str(work), "--out", str(out), "--stages", "bench,bench_bwd"])
    printed = capsys.readouterr().out
    s = json.loads((out / "gpu_check.json").read_text())
    assert s["bench"]["candidates"][f"{KNOB}=separate"]["median_speedup"] == 1.07
    assert f"bench candidate {KNOB}=separate: speedup over ours median 1.070, min 0.990" in printed
    assert "bench_bwd bwd candidate attn_sm90_bwd_dq_overlap=1: speedup over ours median 1.110" in printed


@pytest.mark.parametrize("fwd_cands, bwd_cands, expected", [
    ({"a=1": None}, None, "bench candidate a=1: malformed entry (NoneType, expected a dict)"),
    ({"a=1": [1, 2]}, None, "bench candidate a=1: malformed entry (list, expected a dict)"),
    (["a=1"], None, "bench candidates: malformed record (list, expected a dict)"),
    ("a=1", None, "bench candidates: malformed record (str, expected a dict)"),
    ({"a=1": {"median_speedup": "fast"}}, None, "speedup over ours median 'fast' (not a number)"),
    (None, {"a=1": {"median_speedup": 1.1, "n": 3}}, "bench_bwd candidates: malformed record (mode 'a=1'"),
    (None, ["bwd"], "bench_bwd candidates: malformed record (expected {mode: {label: summary}})"),
    (None, {"bwd": {"a=1": 7}}, "bench_bwd bwd candidate a=1: malformed entry (int, expected a dict)"),
])
def test_gpu_check_summary_names_a_malformed_candidate_record(tmp_path, capsys, fwd_cands, bwd_cands, expected):
    """A malformed candidates record in a benchmark's JSON is reported as such, line by line; the
    summary still prints (no traceback) and the well-formed figures beside it still appear."""
    import json

    from _scripts import load_script

    gcs = load_script("gpu_check_summary")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "stages.tsv").write_text("bench\t0\t100\t200\nbench_bwd\t0\t100\t200\n")
    fwd = {"meta": {}, "config": {}, "summary": {"median_ratio": 1.25, "n_measured": 6, "n_points": 6},
           "ceilings": {}, "candidates": fwd_cands}
    bwd = {"meta": {}, "config": {}, "summary": {"modes": {}}, "ceilings": {}, "candidates": bwd_cands}
    (out / "attention_nvidia-h200_20261205T000000.json").write_text(json.dumps(fwd))
    (out / "attention_bwd_nvidia-h200_20261205T000000.json").write_text(json.dumps(bwd))
    gcs.main(["--work", str(work), "--out", str(out), "--stages", "bench,bench_bwd"])
    printed = capsys.readouterr().out
    assert expected in printed
    assert "median ours/SDPA-flash (d 64 & 128) 1.250" in printed
    assert "overall:" in printed
