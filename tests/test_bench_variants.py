"""CPU tests of the attention-variant benchmark (python/ferroattn/bench/variants.py, the variant
parts of peers.py and report.py, and `bench attention --variants` on the command line): the
visible-pair FLOP count, the grid, FlexAttention's and SDPA's formulations of each variant against
the fp32 reference, and the measurement / JSON / null-with-reason paths with a CPU stand-in for
ours (tests/_bench_fakes.py: FakeFlashAttn, SimulatedBench)."""
from __future__ import annotations

import glob
import json

import pytest

import ferroattn.__main__ as cli
from ferroattn.bench import peers, report, timing, variants

from _bench_fakes import FakeFlashAttn, SimulatedBench, visible_pairs_reference

torch = pytest.importorskip("torch")

S, H, D, WIN = 64, 2, 16, (16, 0)          # the CPU point: window 16 at seqlen 64


# ---- visible pairs and FLOPs ---------------------------------------------------------------

@pytest.mark.parametrize("s_q, s_k", [(1, 1), (4, 4), (7, 3), (3, 7), (64, 64), (97, 113)])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (16, 0)), (True, (0, 0)),
                                            (False, (5, 2)), (False, (-1, 2)), (True, (200, 0))])
def test_visible_pairs_count_the_visible_mask(s_q, s_k, causal, window):
    from ferroattn.testing import visible_mask
    expect = int(visible_mask(s_q, s_k, causal, window).sum())
    assert visible_pairs_reference(s_q, s_k, causal, window) == expect
    assert report.visible_pairs(s_q, s_k, causal, window) == expect
    assert report.fwd_flops(2, 3, s_q, s_k, 8, causal, window) == 4 * 2 * 3 * 8 * expect
    assert report.bwd_flops(2, 3, s_q, s_k, 8, causal, window) == pytest.approx(2.5 * 4 * 2 * 3 * 8 * expect)


def test_window_flops_at_the_grid_sizes():
    for s in (8192, 32768):
        pairs = 4097 * 4098 // 2 + (s - 4097) * 4097          # rows 0..4096 see i + 1 keys, the rest 4097
        assert report.visible_pairs(s, s, True, (4096, 0)) == pairs
        assert report.fwd_flops(1, 32, s, s, 128, True, (4096, 0)) == 4 * 32 * 128 * pairs
        assert report.fwd_flops(1, 32, s, s, 128, True) == 4 * 32 * 128 * (s * (s + 1) // 2)


# ---- grid ----------------------------------------------------------------------------------

def test_default_grid():
    g = variants.grid()
    assert [p["variant"] for p in g[:6]] == ["plain", "window", "softcap", "alibi", "dropout", "sinks"]
    assert len(g) == 2 * 6 and {p["mode"] for p in g} == {"fwd"}
    assert {p["seqlen"] for p in g} == {8192, 32768}
    for p in g:
        assert (p["batch"], p["heads"], p["head_dim"], p["dtype"], p["causal"]) == (1, 32, 128, "bf16", True)
        assert p["flops"] == report.fwd_flops(1, 32, p["seqlen"], p["seqlen"], 128, True, p["window_size"])
        assert p["target"] == {"plain": None, "softcap": 0.25}.get(p["variant"], 0.10)
        if p["variant"] != "window":
            assert p["visible_fraction"] == 1.0 and p["window_size"] == [-1, -1]
    win = {p["seqlen"]: p for p in g if p["variant"] == "window"}
    for s, p in win.items():
        assert p["window_size"] == [4096, 0] and p["variant_args"] == {"window_size": [4096, 0]}
        assert p["visible_fraction"] == pytest.approx(report.visible_pairs(s, s, True, (4096, 0)) / (s * (s + 1) / 2))
    assert win[32768]["visible_fraction"] < win[8192]["visible_fraction"] < 1.0
    gb = variants.grid(backward=True)
    assert len(gb) == 24 and [p["mode"] for p in gb[:12]] == ["fwd"] * 6 + ["bwd"] * 6
    bwd = [p for p in gb if p["mode"] == "bwd"]
    assert all(p["flops"] == pytest.approx(2.5 * q["flops"]) for p, q in zip(bwd, g[: len(bwd)]) if
               p["seqlen"] == q["seqlen"])


def test_grid_selection_and_errors():
    assert variants.parse_variants("window,softcap") == ["plain", "window", "softcap"]
    assert variants.parse_variants("sinks, plain") == ["plain", "sinks"]
    assert variants.parse_variants("all") == list(variants.VARIANTS) == variants.parse_variants(None)
    q = variants.grid("alibi", quick=True)
    assert [(p["variant"], p["seqlen"]) for p in q] == [("plain", 8192), ("alibi", 8192)]
    assert {p["seqlen"] for p in variants.grid(seqlens=[1000, 3000])} == {1000, 3000}
    for kw, needle in (({"variants": "window,flash"}, "--variants"), ({"variants": ","}, "--variants"),
                       ({"dtypes": ["fp8"]}, "--dtypes"), ({"seqlens": [0]}, "--seqlens")):
        with pytest.raises(ValueError, match=needle):
            variants.grid(**kw)


# ---- the peers' formulations against the fp32 reference ------------------------------------

@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention traced by dynamo (fullgraph) but run eagerly: CPU-friendly, same code path."""
    import torch._dynamo
    torch._dynamo.reset()
    monkeypatch.setattr(peers, "FLEX_COMPILE", {"fullgraph": True, "dynamic": False, "backend": "eager"})
    with peers.flex_settings():
        yield


def _inputs(s=S, h=H, d=D):
    q, k, v = (torch.randn(1, s, h, d) for _ in range(3))
    return (q, k, v), tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))


def _params(h=H):
    return variants.make_params(h, "cpu", backward=False)


@pytest.mark.parametrize("name", ["plain", "window", "softcap", "alibi", "sinks"])
def test_flex_variants_match_the_reference(eager_flex, name):
    from ferroattn.testing import attention_ref
    v = variants.variant_table(WIN)[name]
    prm = _params()
    (q, k, vv), (qt, kt, vt) = _inputs()
    fn, why = peers.flex_variant(v.window_size, v.softcap, prm["alibi_slopes"] if v.alibi else None, 0.0,
                                 prm["s_aux"] if v.sinks else None, S, S, "cpu")
    assert why is None
    out = fn(qt, kt, vt).transpose(1, 2)
    ref, lse = attention_ref(q, k, vv, True, None, v.window_size, v.softcap, prm["alibi_slopes"] if v.alibi else None)
    if v.sinks:     # the sink joins the denominator: out · Z / (Z + exp(s_aux))
        ref = ref * torch.sigmoid(lse - prm["s_aux"][None, :, None]).transpose(1, 2).unsqueeze(-1)
    assert (out - ref).abs().max() < 1e-5


def test_flex_sinks_against_a_sink_column(eager_flex):
    """The sinks formulation against the definition: softmax over [scores, s_aux[h]], column dropped."""
    prm = _params()
    _, (q, k, v) = _inputs()
    fn, _ = peers.flex_variant((-1, -1), 0.0, None, 0.0, prm["s_aux"], S, S, "cpu")
    sc = (q @ k.transpose(-1, -2)) * D ** -0.5
    sc = sc.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    full = torch.cat([sc, prm["s_aux"][None, :, None, None].expand(1, H, S, 1)], dim=-1)
    ref = torch.softmax(full, dim=-1)[..., :S] @ v
    assert (fn(q, k, v) - ref).abs().max() < 1e-5


def test_flex_has_no_dropout():
    fn, why = peers.flex_variant((-1, -1), 0.0, None, 0.1, None, S, S, "cpu")
    assert fn is None and why == peers.FLEX_NO_DROPOUT


@pytest.mark.parametrize("name", ["plain", "window", "alibi"])
def test_sdpa_variants_match_the_reference(name):
    from ferroattn.testing import attention_ref
    v = variants.variant_table(WIN)[name]
    prm = _params()
    (q, k, vv), (qt, kt, vt) = _inputs()
    slopes = prm["alibi_slopes"] if v.alibi else None
    fn, why = peers.sdpa_variant(v.window_size, 0.0, slopes, 0.0, None, S, S, torch.float32, "cpu")
    assert why is None
    with peers.only("math"):
        out = fn(qt, kt, vt).transpose(1, 2)
    ref, _ = attention_ref(q, k, vv, True, None, v.window_size, 0.0, slopes)
    assert (out - ref).abs().max() < 1e-5


def test_sdpa_cannot_express_softcap_or_sinks_and_caps_the_alibi_mask():
    prm = _params()
    assert peers.sdpa_variant((-1, -1), 50.0, None, 0.0, None, S, S, torch.bfloat16, "cpu") == \
        (None, peers.SDPA_NO_SOFTCAP)
    assert peers.sdpa_variant((-1, -1), 0.0, None, 0.0, prm["s_aux"], S, S, torch.bfloat16, "cpu") == \
        (None, peers.SDPA_NO_SINKS)
    slopes = variants.make_params(32, "cpu", False)["alibi_slopes"]
    fn, why = peers.sdpa_variant((-1, -1), 0.0, slopes, 0.0, None, 32768, 32768, torch.bfloat16, "meta")
    assert fn is None and "(1, 32, 32768, 32768) bfloat16" in why and "64 GiB" in why and "16 GiB cap" in why
    fn, why = peers.sdpa_variant((-1, -1), 0.0, None, 0.1, None, S, S, torch.bfloat16, "cpu")
    assert why is None and callable(fn)


def test_alibi_slopes_and_sinks_params():
    p = variants.make_params(8, "cpu", backward=True)
    assert torch.allclose(p["alibi_slopes"], torch.tensor([2.0 ** (-i) for i in range(1, 9)]))
    assert p["s_aux"].shape == (8,) and p["s_aux"].dtype == torch.float32 and p["s_aux"].requires_grad
    assert not variants.make_params(8, "cpu", backward=False)["s_aux"].requires_grad
    kw = variants.ours_kwargs(variants.variant_table()["sinks"], p, deterministic=True)
    assert kw == {"causal": True, "s_aux": p["s_aux"], "deterministic": True}
    assert variants.ours_kwargs(variants.variant_table()["plain"], p) == {"causal": True}
    assert variants.ours_kwargs(variants.variant_table()["window"], p)["window_size"] == (4096, 0)


def test_flex_settings_raise_the_recompile_limit():
    import torch._dynamo
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    before = getattr(cfg, key)
    with peers.flex_settings():
        assert getattr(cfg, key) >= peers.FLEX_RECOMPILE_LIMIT
    assert getattr(cfg, key) == before


def test_error_text_keeps_dynamos_context():
    e = RuntimeError("Observed exception\n  Explanation: x\n  Developer debug context: raised NotImplementedError(y)\n")
    assert peers.error_text(e) == ("RuntimeError: Observed exception "
                                   "(Developer debug context: raised NotImplementedError(y))")
    assert peers.error_text(ValueError("")) == "ValueError: "


# ---- measurement with a CPU stand-in for ours ----------------------------------------------

MS = {"plain": 1.0, "window": 0.6, "softcap": 1.2, "alibi": 1.15, "sinks": 1.05, "dropout": 1.3}


@pytest.fixture
def fake(monkeypatch, eager_flex):
    import ferroattn
    bench = SimulatedBench(default_ms=2.0)
    fa = FakeFlashAttn(bench, ms=MS)  # every variant, dropout included, as ferroattn implements them
    monkeypatch.setattr(ferroattn, "flash_attn_func", fa, raising=False)
    monkeypatch.setattr(timing, "bench_gpu", bench)
    return fa


def _group(mode, backward, names=variants.VARIANTS, peer_names=("flex", "math", "efficient")):
    table = variants.variant_table(WIN)
    pts = {p["variant"]: p for p in variants.grid(names, [S], backward, heads=H, head_dim=D, window=WIN)
           if p["mode"] == mode}
    ours_sets, peer_sets = variants.make_inputs(1, S, H, D, "bf16", 1 << 20, backward, device="cpu")
    params = variants.make_params(H, "cpu", backward)
    fns = variants.peer_fns(table, list(pts), peer_names, S, params, torch.bfloat16, "cpu")
    return variants.measure_group(pts, table, ours_sets, peer_sets, params, fns, peer_names, mode, 800.0, 1.0, 1.0,
                                  rounds=2)


def test_forward_group_overheads_peers_and_nulls(fake):
    pts = _group("fwd", backward=False)
    for n, p in pts.items():
        assert p["ours"]["ms"] == MS[n] and p["ours"]["ms_rounds"] == [MS[n]] * 2
        assert p["ours"]["tflops"] == pytest.approx(report.tflops(p["flops"], MS[n]))
        assert p["ours"]["pct_ceiling"] == pytest.approx(100 * p["ours"]["tflops"] / 800.0)
        assert p["ours_unsupported"] is None and p["ours_error"] is None
    f = pts["window"]["visible_fraction"]
    assert 0 < f < 1
    o = pts["window"]["overhead"]
    assert o["time_ratio"] == pytest.approx(0.6) and o["cost_ratio"] == pytest.approx(0.6 / f)
    assert o["overhead"] == pytest.approx(0.6 / f - 1) and o["ok"] is (0.6 / f - 1 <= 0.10)
    assert pts["softcap"]["overhead"]["overhead"] == pytest.approx(0.2) and pts["softcap"]["overhead"]["ok"] is True
    assert pts["alibi"]["overhead"]["overhead"] == pytest.approx(0.15) and pts["alibi"]["overhead"]["ok"] is False
    assert pts["sinks"]["overhead"]["ok"] is True and pts["plain"]["overhead"] is None
    # dropout is measured like the others: 1.3 x plain over the same pairs, against its 10% target
    assert pts["dropout"]["overhead"]["overhead"] == pytest.approx(0.3) and pts["dropout"]["overhead"]["ok"] is False
    # peers: FlexAttention runs everything but dropout; SDPA-math what SDPA can express; efficient has no CPU kernel
    for n in ("plain", "window", "softcap", "alibi", "sinks"):
        p = pts[n]
        assert p["peers"]["flex"] == {"ms": 2.0, "tflops": report.tflops(p["flops"], 2.0)}
        assert p["ratio"]["flex"] == pytest.approx(2.0 / MS[n])
        assert p["max_abs_diff"]["flex"] < 0.05 and p["first_call_s"]["flex"] >= 0
    assert pts["dropout"]["peers"]["flex"] is None and pts["dropout"]["peer_errors"]["flex"] == peers.FLEX_NO_DROPOUT
    for n in ("plain", "window", "alibi"):
        assert pts[n]["peers"]["math"]["ms"] == 2.0 and pts[n]["max_abs_diff"]["math"] < 0.05
    assert pts["softcap"]["peer_errors"]["math"] == peers.SDPA_NO_SOFTCAP
    assert pts["sinks"]["peer_errors"]["math"] == peers.SDPA_NO_SINKS
    # SDPA has dropout too: timed and compared in speed, never in values (the random masks differ)
    assert pts["dropout"]["peers"]["math"]["ms"] == 2.0
    assert pts["dropout"]["ratio"]["math"] == pytest.approx(2.0 / MS["dropout"])
    assert "math" not in pts["dropout"]["max_abs_diff"] and "math" not in pts["dropout"]["grad_diff"]
    for p in pts.values():
        assert p["peers"]["efficient"] is None and p["peer_errors"]["efficient"] and p["ratio"]["efficient"] is None


def test_forward_group_ours_unsupported_is_null_with_the_reason(fake):
    """A variant ours rejects with NotImplementedError (an older ferroattn without dropout): no
    timing, no overhead, the reason recorded; the peers are still measured."""
    fake.unsupported = {"dropout"}
    pts = _group("fwd", backward=False)
    p = pts["dropout"]
    assert p["ours"] is None and p["ours_error"] is None
    assert p["ours_unsupported"] == "NotImplementedError: ferroattn: dropout is not implemented yet"
    assert p["overhead"] is None
    assert p["peers"]["math"]["ms"] == 2.0 and p["ratio"]["math"] is None and "math" not in p["max_abs_diff"]
    for n in ("plain", "window", "softcap", "alibi", "sinks"):
        assert pts[n]["ours"]["ms"] == MS[n] and pts[n]["ours_unsupported"] is None


def test_window_diff_catches_a_wrong_window(fake, monkeypatch):
    """A peer (here: ours) that ignores the window is caught by max_abs_diff."""
    real = fake.__call__

    def no_window(q, k, v, **kw):
        kw.pop("window_size", None)
        return real(q, k, v, **kw)
    import ferroattn
    monkeypatch.setattr(ferroattn, "flash_attn_func", no_window)
    pts = _group("fwd", backward=False, names="window", peer_names=("math",))
    assert pts["plain"]["max_abs_diff"]["math"] < 0.05 and pts["window"]["max_abs_diff"]["math"] > 0.1


def test_backward_group(fake):
    pts = _group("bwd", backward=True)
    for n in ("plain", "window", "softcap", "alibi", "sinks"):
        assert pts[n]["ours"]["ms"] == pytest.approx(2.5 * MS[n])   # the simulated time of the backward
    assert pts["softcap"]["overhead"]["time_ratio"] == pytest.approx(1.2)
    for n in ("plain", "window", "alibi"):
        gd = pts[n]["grad_diff"]["math"]
        assert set(gd) == {"dq", "dk", "dv"} and max(gd.values()) == pts[n]["max_abs_diff"]["math"] < 0.05
    # FlexAttention has no CPU backward: null with its reason, not a crash
    assert pts["plain"]["peers"]["flex"] is None and "backward on CPU" in pts["plain"]["peer_errors"]["flex"]
    # dropout's backward is measured; SDPA-math's is timed but not compared (the masks differ)
    assert pts["dropout"]["ours"]["ms"] == pytest.approx(2.5 * MS["dropout"]) and pts["dropout"]["ours_unsupported"] is None
    assert pts["dropout"]["overhead"]["time_ratio"] == pytest.approx(1.3)
    assert pts["dropout"]["peers"]["math"] is not None and pts["dropout"]["grad_diff"] == {}
    assert "math" not in pts["dropout"]["max_abs_diff"]


def test_backward_of_sinks_includes_their_gradient(fake):
    v = variants.variant_table()["sinks"]
    params = variants.make_params(H, "cpu", backward=True)
    ours_sets, _ = variants.make_inputs(1, S, H, D, "bf16", 1 << 20, True, device="cpu")
    pr = variants.prepare(variants.ours_fn(v, params), ours_sets, variants._extra(v, params, "bwd"), "bwd")
    assert len(pr.check) == 4 and pr.check[3].shape == (H,) and pr.check[3].abs().sum() > 0
    assert len(variants._extra(v, params, "fwd")) == 0
    assert len(variants._extra(variants.variant_table()["alibi"], params, "bwd")) == 0


def test_ours_rejecting_an_argument_is_unsupported_not_failed(fake, monkeypatch):
    import ferroattn
    real = fake.__call__

    def old_signature(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, deterministic=False, return_attn_probs=False):
        return real(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    monkeypatch.setattr(ferroattn, "flash_attn_func", old_signature)
    pts = _group("fwd", backward=False, names="sinks", peer_names=("flex",))
    why = pts["sinks"]["ours_unsupported"]
    assert why.startswith("TypeError") and "s_aux" in why and pts["sinks"]["ours_error"] is None
    assert pts["sinks"]["peers"]["flex"]["ms"] == 2.0 and pts["sinks"]["ratio"]["flex"] is None
    assert variants.unsupported_reason(TypeError("bad operand")) is None
    assert variants.unsupported_reason(RuntimeError("x")) is None


# ---- the run: JSON, summary, exit codes ----------------------------------------------------

@pytest.fixture
def cpu_run(fake, monkeypatch, tmp_path):
    from ferroattn.bench import ceilings
    monkeypatch.setattr(ceilings, "measure", lambda: {"matmul_bf16": {"tflops": 800.0}, "copy_d2d": {"gbps": 4000.0}})

    def go(**kw):
        kw.setdefault("out_dir", str(tmp_path))
        kw.setdefault("peer_names", ["flex", "math"])
        return variants.run(seqlens=[S], heads=H, head_dim=D, window=WIN, device="cpu", rep_ms=1.0, **kw)
    return go


def test_run_end_to_end(cpu_run, tmp_path, capsys):
    result, code = cpu_run(backward=True)
    assert code == 0 and result["partial"] is False            # a missed overhead target is not a failure
    files = glob.glob(str(tmp_path / "attn_variants_*.json"))
    assert len(files) == 1 and not glob.glob(str(tmp_path / "attention_*.json"))
    data = json.loads(open(files[0]).read())
    assert data["config"]["modes"] == ["fwd", "bwd"] and data["config"]["peers"] == ["flex", "math"]
    assert data["config"]["variants"]["softcap"] == {"softcap": 50.0}
    assert data["config"]["variants"]["dropout"] == {"dropout_p": variants.DROPOUT_P}
    assert data["config"]["targets"] == {"window": 0.1, "softcap": 0.25, "alibi": 0.1, "dropout": 0.1, "sinks": 0.1}
    assert "visible_pairs" in data["config"]["flops"]
    assert len(data["points"]) == 12
    s = data["summary"]
    # every variant measured, dropout included (ferroattn implements it)
    assert (s["n_points"], s["n_measured"], s["n_unsupported"], s["n_ours_failed"], s["n_skipped"]) == (12, 12, 0, 0, 0)
    assert s["not_measured"] == []
    assert {"alibi fwd s=64", "dropout fwd s=64", "dropout bwd s=64"} <= set(s["target"]["failed"])
    assert s["target"]["met"] is False and s["target"]["complete"] is True and s["target"]["n_checked"] == 10
    assert [w["label"] for w in s["window"]] == ["window fwd s=64", "window bwd s=64"]
    assert s["per_peer"]["math"]["modes"]["fwd"]["n"] == 4 and s["max_abs_diff"]["math"] < 0.05
    out = capsys.readouterr().out
    assert "n/i" not in out and "OVER" in out and "raw JSON:" in out
    assert "not measured:" not in out
    assert "\nwindow fwd s=64: " in out and "of plain's visible pairs in" in out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("variant overhead targets") and "NOT MET" in last and "dropout fwd s=64" in last


def test_run_end_to_end_with_a_variant_ours_does_not_implement(cpu_run, fake, tmp_path, capsys):
    """A variant ours rejects with NotImplementedError (dropout on an older ferroattn): not
    measured, with the reason; not a failure (exit 0)."""
    fake.unsupported = {"dropout"}
    result, code = cpu_run(backward=True)
    assert code == 0 and result["partial"] is False
    s = result["summary"]
    assert (s["n_points"], s["n_measured"], s["n_unsupported"], s["n_ours_failed"], s["n_skipped"]) == (12, 10, 2, 0, 0)
    assert {r["label"] for r in s["not_measured"]} == {"dropout fwd s=64", "dropout bwd s=64"}
    assert "not implemented" in s["not_measured"][0]["reason"]
    assert "alibi fwd s=64" in s["target"]["failed"] and s["target"]["met"] is False
    assert s["target"]["complete"] is False and s["target"]["n_checked"] == 8
    assert s["per_peer"]["math"]["modes"]["fwd"]["n"] == 3
    out = capsys.readouterr().out
    assert "n/i" in out and "not measured: dropout fwd s=64: NotImplementedError" in out


def test_run_failure_budget_and_fatal(cpu_run, fake, tmp_path):
    fake.failing = {"alibi"}
    fake.error = RuntimeError("cuBLAS error")
    result, code = cpu_run(variants="alibi")
    p = {q["variant"]: q for q in result["points"]}
    assert code == 1 and p["alibi"]["ours_error"] == "RuntimeError: cuBLAS error" and p["plain"]["ours"]
    assert result["summary"]["n_ours_failed"] == 1
    result, code = cpu_run(variants="alibi", time_budget_s=0.0, out_dir=str(tmp_path / "b"))
    assert code == 1 and all("time budget" in q["skipped"] for q in result["points"])
    fake.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    result, code = cpu_run(variants="alibi", backward=True, out_dir=str(tmp_path / "c"))
    bwd = [q for q in result["points"] if q["mode"] == "bwd"]
    assert code == 1 and all("fatal CUDA error" in q["skipped"] for q in bwd)


def test_variant_overhead_and_format():
    r = timing.paired_ratio([1.3, 1.2, 1.25], [1.0, 1.0, 1.0])
    o = report.variant_overhead(r, 0.5, 0.10)
    assert o["time_ratio"] == pytest.approx(1.25) and o["cost_ratio"] == pytest.approx(2.5)
    assert o["overhead"] == pytest.approx(1.5) and o["ok"] is False
    assert o["overhead_ci"] == pytest.approx([1.2 / 0.5 - 1, 1.3 / 0.5 - 1])
    assert report.variant_overhead(r, 1.0, None)["ok"] is None
    with pytest.raises(ValueError, match="visible_fraction"):
        report.variant_overhead(r, 0.0, 0.1)
    pts = variants.grid("softcap", [S], heads=H, head_dim=D, window=WIN)
    pts[0].update(ours={"ms": 1.0, "tflops": 2.0}, peers={"flex": {"ms": 2.0, "tflops": 1.0}}, ratio={"flex": 2.0},
                  max_abs_diff={"flex": 1e-3})
    pts[1].update(ours=None, ours_unsupported="NotImplementedError: no", peers={"flex": None}, ratio={"flex": None},
                  max_abs_diff={})
    t = report.format_variants_table(pts, ["flex"]).splitlines()
    assert len(t) == 4 and "flex TF/s" in t[0] and "2.00" in t[2] and "n/i" in t[3] and "<=25%" in t[3]
    s = report.summarize_variants(pts, ["flex"])
    assert s["target"]["met"] is None and s["not_measured"][0]["reason"] == "NotImplementedError: no"
    assert report.format_variants_summary(s).splitlines()[-1].endswith("not measured, 0/0 within target, "
                                                                        "not measured: 1")


# ---- command line --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["bench", "attention", "--variants", "window,flash"], "--variants"),
    (["bench", "attention", "--variants", "--head-dims", "64"], "--head-dims"),
    (["bench", "attention", "--variants", "--peers", "flex,xformers"], "--peers"),
    (["bench", "attention", "--variants", "--dtypes", "fp8"], "--dtypes"),
    (["bench", "attention", "--variants", "--deterministic"], "--deterministic"),
])
def test_variants_argument_errors_exit_2(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("ferroattn bench attention --variants")


def test_variants_without_gpu_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "attention", "--variants", "--backward"]) == 3
    assert "no CUDA GPU" in capsys.readouterr().err


def test_variants_dispatch_and_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(variants, "run", lambda *a, **k: seen.append((a, k)) or ({}, 0))
    assert cli.main(["bench", "attention", "--variants"]) == 0
    assert cli.main(["bench", "attention", "--variants", "window,softcap", "--backward", "--deterministic",
                     "--seqlens", "4096", "--peers", "flex", "--time-budget-s", "80", "--rep-ms", "30"]) == 0
    (a0, k0), (a1, k1) = seen
    assert a0[:4] == (list(variants.VARIANTS), None, False, False) and a0[8] == list(variants.DEFAULT_PEERS)
    assert a1[:4] == (["plain", "window", "softcap"], [4096], True, False)
    assert a1[6:9] == (30.0, 80.0, ["flex"]) and k1 == {"deterministic": True}
    from ferroattn.bench import attention, attention_bwd
    monkeypatch.setattr(attention, "main_from_args", lambda a: seen.append("fwd") or 0)
    monkeypatch.setattr(attention_bwd, "main_from_args", lambda a: seen.append("bwd") or 0)
    assert cli.main(["bench", "attention"]) == 0 and cli.main(["bench", "attention", "--backward"]) == 0
    assert seen[2:] == ["fwd", "bwd"]
