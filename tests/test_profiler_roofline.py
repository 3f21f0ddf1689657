"""ferroattn.profiler roofline math, the roofline plot and the ceilings cache (CPU)."""
from __future__ import annotations

import json

import pytest

from ferroattn.errors import ArgumentError, FerroattnError
from ferroattn.profiler import (Ceilings, RooflinePoint, arithmetic_intensity, attainable_tflops,
                                measure_ceilings, plot_roofline, ridge_point, utilisation)

C = Ceilings(800.0, 4000.0, "matmul test", "copy test", "TestGPU", "2026-11-29T00:00:00+00:00")


def test_math_exact():
    assert arithmetic_intensity(1e12, 1e9) == 1000.0
    assert arithmetic_intensity(0, 5) == 0.0
    assert ridge_point(C) == 200.0                       # 1000 * 800 / 4000 FLOP/byte
    assert attainable_tflops(50.0, C) == 200.0           # memory-bound: 50 * 4000 / 1000
    assert attainable_tflops(200.0, C) == 800.0          # the ridge
    assert attainable_tflops(1e4, C) == 800.0            # compute-bound: the roof


def test_utilisation_memory_and_compute_bound():
    # 1e10 FLOPs, 1e9 bytes in 1 ms: 10 TFLOP/s, 1000 GB/s, intensity 10 -> attainable 40
    u = utilisation(1e10, 1e9, 1.0, C)
    assert (u.intensity, u.achieved_tflops, u.achieved_gbps, u.attainable_tflops) == (10.0, 10.0, 1000.0, 40.0)
    assert u.pct_of_roofline == 25.0 and u.pct_of_compute == 1.25 and u.pct_of_bandwidth == 25.0
    assert u.bound == "memory" and u.ceilings is C
    # 4e11 FLOPs, 1e9 bytes in 1 ms: intensity 400 -> attainable 800; 400 TFLOP/s = 50 %
    v = utilisation(4e11, 1e9, 1.0, C)
    assert v.bound == "compute" and v.pct_of_roofline == 50.0 and v.pct_of_compute == 50.0
    assert utilisation(2e11, 1e9, 1.0, C).bound == "compute"  # exactly at the ridge


def test_label_names_both_ceilings():
    lab = C.label()
    for part in ("TestGPU", "800.0 TFLOP/s", "matmul test", "4000 GB/s", "copy test", "2026-11-29"):
        assert part in lab


@pytest.mark.parametrize("call, arg", [
    (lambda: arithmetic_intensity(1.0, 0), "nbytes"),
    (lambda: arithmetic_intensity(-1.0, 1), "flops"),
    (lambda: utilisation(1.0, 1.0, 0.0, C), "ms"),
    (lambda: utilisation(1.0, 1.0, 1.0, "H200"), "ceilings"),
    (lambda: attainable_tflops(float("nan"), C), "intensity"),
    (lambda: Ceilings(0.0, 1.0), "peak_tflops"),
    (lambda: Ceilings(1.0, float("inf")), "bandwidth_gbps"),
    (lambda: plot_roofline([("k", 1.0, 2.0)], C), "points"),
    (lambda: plot_roofline([RooflinePoint("k", 0.0, 1.0)], C), r"points\[0\].intensity"),
])
def test_bad_inputs(call, arg):
    with pytest.raises(ArgumentError, match=rf"^{arg}:"):
        call()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    pts = [RooflinePoint.from_measurement("attn_fwd d128", 4e11, 1e9, 1.0),
           RooflinePoint.from_measurement("copy-like", 1e9, 1e10, 5.0)]
    assert pts[0].intensity == 400.0 and pts[0].tflops == 400.0
    path = tmp_path / "roof.png"
    fig = plot_roofline(pts, C, path=path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("4000 GB/s" in s for s in labels) and any("800.0 TFLOP/s" in s for s in labels)
    # memory roof ends at the ridge at the peak; compute roof is flat at the peak
    mem, comp = ax.get_lines()[0], ax.get_lines()[1]
    assert mem.get_xdata()[-1] == 200.0 and mem.get_ydata()[-1] == 800.0
    assert list(comp.get_ydata()) == [800.0, 800.0]
    assert [t.get_text() for t in ax.texts] == ["attn_fwd d128", "copy-like"]


# ---- measure_ceilings: caching with an injected measurement -------------------------------------
KEY = {"device": "TestGPU", "driver": "580.1", "torch": "2.11.0", "cuda": "13.0"}


def fake_measure(counter, tflops=770.0, gbps=4200.0):
    def measure():
        counter.append(1)
        return {"matmul_bf16": {"tflops": tflops, "what": "mm"}, "copy_d2d": {"gbps": gbps, "what": "cp"}}
    return measure


def test_measure_once_then_cached(tmp_path):
    calls = []
    c1 = measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls), key=KEY)
    c2 = measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls), key=KEY)
    assert len(calls) == 1 and c1 == c2
    assert (c1.peak_tflops, c1.bandwidth_gbps, c1.device) == (770.0, 4200.0, "TestGPU")
    assert c1.compute_source == "mm" and c1.memory_source == "cp" and c1.measured_at
    doc = json.loads((tmp_path / "profiler_ceilings.json").read_text())
    assert doc["version"] == 2 and len(doc["entries"]) == 1
    (entry,) = doc["entries"].values()
    assert entry["key"] == KEY and entry["ceilings"]["peak_tflops"] == 770.0


def test_other_key_or_refresh_measures_again(tmp_path):
    calls = []
    measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls), key=KEY)
    c = measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls, tflops=500.0),
                         key={**KEY, "driver": "590.0"})
    assert len(calls) == 2 and c.peak_tflops == 500.0
    c = measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls, tflops=600.0), key=KEY, refresh=True)
    assert len(calls) == 3 and c.peak_tflops == 600.0
    assert measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls), key=KEY).peak_tflops == 600.0
    doc = json.loads((tmp_path / "profiler_ceilings.json").read_text())
    assert len(doc["entries"]) == 2 and len(calls) == 3


def test_corrupt_cache_is_replaced(tmp_path):
    (tmp_path / "profiler_ceilings.json").write_text("{not json")
    calls = []
    c = measure_ceilings(cache_dir=tmp_path, measure=fake_measure(calls), key=KEY)
    assert len(calls) == 1 and c.peak_tflops == 770.0
    json.loads((tmp_path / "profiler_ceilings.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["profiler_ceilings.json"]  # no temp files left


def test_failed_measurement_raises_and_caches_nothing(tmp_path):
    def measure():
        return {"matmul_bf16": None, "matmul_bf16_error": "RuntimeError: no GPU",
                "copy_d2d": {"gbps": 1.0, "what": "cp"}}
    with pytest.raises(FerroattnError, match="no GPU"):
        measure_ceilings(cache_dir=tmp_path, measure=measure, key=KEY)
    assert not (tmp_path / "profiler_ceilings.json").exists()


def test_default_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FERROATTN_CACHE_DIR", str(tmp_path / "c"))
    calls = []
    measure_ceilings(measure=fake_measure(calls), key=KEY)
    assert (tmp_path / "c" / "profiler_ceilings.json").is_file()


def test_bad_device():
    with pytest.raises(ArgumentError, match="^device:"):
        measure_ceilings(-1, key=KEY, measure=lambda: {})


def test_import_needs_neither_torch_nor_matplotlib():
    import subprocess
    import sys
    code = ("import sys, ferroattn.profiler as p; "
            "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad; assert all(getattr(p, n).__doc__ for n in p.__all__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install"):
        plot_roofline([RooflinePoint("k", 1.0, 1.0)], C)


# ---- bf16 and fp16 compute ceilings ----------------------------------------------------------

def fake_measure_both(counter):
    def measure():
        counter.append(1)
        return {"matmul_bf16": {"tflops": 760.0, "what": "mm bf16"}, "matmul_fp16": {"tflops": 740.0, "what": "mm fp16"},
                "copy_d2d": {"gbps": 4250.0, "what": "cp"}}
    return measure


def test_bf16_and_fp16_ceilings_are_cached_and_selectable(tmp_path):
    from ferroattn.profiler import cached_ceilings
    assert cached_ceilings(cache_dir=tmp_path, key=KEY) is None          # never measures
    calls = []
    c = measure_ceilings(cache_dir=tmp_path, measure=fake_measure_both(calls), key=KEY)
    assert c.by_dtype == (("bfloat16", 760.0, "mm bf16"), ("float16", 740.0, "mm fp16"))
    assert (c.peak_tflops, c.compute_source) == (760.0, "mm bf16")
    f16 = c.for_dtype("fp16")
    assert (f16.peak_tflops, f16.compute_source, f16.bandwidth_gbps) == (740.0, "mm fp16", 4250.0)
    assert c.for_dtype("__nv_bfloat16") == c and c.for_dtype(None) is c and c.for_dtype("float32") is c
    assert "float16 740.0 TFLOP/s" in c.label() and "[mm bf16]" in c.label()
    assert "[mm fp16]" in f16.label() and "bfloat16 760.0 TFLOP/s" in f16.label()
    assert cached_ceilings(cache_dir=tmp_path, key=KEY) == c and len(calls) == 1
    assert Ceilings.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    u = utilisation(4e12, 1e9, 10.0, f16)
    assert u.ceilings.compute_source == "mm fp16" and u.pct_of_compute == pytest.approx(100 * 400 / 740)


def test_old_cache_entries_without_fp16_are_measured_again(tmp_path):
    (tmp_path / "profiler_ceilings.json").write_text(json.dumps({"version": 1, "entries": {}}))
    calls = []
    measure_ceilings(cache_dir=tmp_path, measure=fake_measure_both(calls), key=KEY)
    assert len(calls) == 1 and json.loads((tmp_path / "profiler_ceilings.json").read_text())["version"] == 2


def test_config_dtype_and_bad_by_dtype():
    from ferroattn.profiler import config_dtype
    assert config_dtype("ferroattn::attn_fwd_sm80<64, 128, 64, 4, 2, true, __nv_bfloat16>") == "bfloat16"
    assert config_dtype("ferroattn::attn_bwd_dq_sm80<128, 64, 64, 8, 2, false, __half>") == "float16"
    assert config_dtype("no template") is None and config_dtype("") is None and config_dtype(None) is None
    with pytest.raises(ArgumentError, match="by_dtype"):
        Ceilings(1.0, 1.0, by_dtype=(("int8", 1.0, "x"),))
    with pytest.raises(ArgumentError, match="by_dtype"):
        Ceilings(1.0, 1.0, by_dtype=(("bf16", -1.0, "x"),))
    assert Ceilings(1.0, 1.0, by_dtype=(("bf16", 2.0, "x"),)).by_dtype == (("bfloat16", 2.0, "x"),)


# ---- review fixes: paths, numbers, no GPU ---------------------------------------------------------
@pytest.mark.parametrize("name, match", [("d", "is a directory"), ("roof", "no suffix in"),
                                         ("roof.notafmt", r"suffix \.notafmt")])
def test_plot_path_must_be_an_image_file_name(tmp_path, name, match):
    pytest.importorskip("matplotlib")
    (tmp_path / "d").mkdir()
    with pytest.raises(ArgumentError, match=rf"^path: .*{match}"):
        plot_roofline([RooflinePoint("k", 1.0, 1.0)], C, path=tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]                # nothing written


def test_numpy_scalars_accepted_bools_and_strings_named():
    np = pytest.importorskip("numpy")
    c = Ceilings(np.float32(800.0), np.int64(4000))
    assert (c.peak_tflops, c.bandwidth_gbps) == (800.0, 4000.0) and type(c.peak_tflops) is float
    u = utilisation(np.float64(4e11), np.int64(10**9), np.float32(1.0), c)
    assert u.achieved_tflops == pytest.approx(400.0) and u.pct_of_roofline == pytest.approx(50.0)
    assert arithmetic_intensity(np.int32(8), np.int32(2)) == 4.0
    for call, arg in ((lambda: arithmetic_intensity(True, 1), "flops"),
                      (lambda: utilisation(1.0, 1.0, "1", C), "ms"),
                      (lambda: Ceilings("800", 1.0), "peak_tflops")):
        with pytest.raises(ArgumentError, match=rf"^{arg}: expected a finite real number .*, got (bool|str) "):
            call()


def test_ceilings_without_a_gpu_no_raw_torch_error(tmp_path):
    import torch
    from ferroattn.errors import NoDeviceError
    from ferroattn.profiler import cached_ceilings
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU")
    assert cached_ceilings(0, cache_dir=tmp_path) is None               # documented: never measures
    with pytest.raises(NoDeviceError, match="^device:"):
        measure_ceilings(0, cache_dir=tmp_path)
    with pytest.raises(ArgumentError, match="^device:"):
        cached_ceilings(-1, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---- plot layout: labels do not pile up, the legend hides no point --------------------------------

def _render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _overlap(a, b):
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


def test_plot_labels_of_close_points_do_not_overlap_and_legend_hides_no_point():
    pytest.importorskip("matplotlib")
    # six kernels at (nearly) the same place, as one attention config x several launches gives
    pts = [RooflinePoint(f"attn_fwd_sm80 cfg{i} (x16)", 100.0 * (1 + 0.01 * i), 300.0 * (1 + 0.01 * i))
           for i in range(6)] + [RooflinePoint("copy-like", 0.1, 0.4), RooflinePoint("gemm", 400.0, 700.0)]
    fig = plot_roofline(pts, C)
    r = _render(fig)
    ax = fig.axes[0]
    boxes = [t.get_window_extent(r) for t in ax.texts]
    assert [t.get_text() for t in ax.texts] == [p.name for p in pts]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not _overlap(boxes[i], boxes[j]), (ax.texts[i].get_text(), ax.texts[j].get_text())
    legend = ax.get_legend().get_window_extent(r)
    for p in pts:
        x, y = ax.transData.transform((p.intensity, p.tflops))
        assert not (legend.x0 <= x <= legend.x1 and legend.y0 <= y <= legend.y1), p.name
    assert legend.x0 >= ax.get_window_extent(r).x1, "the legend is outside the axes"


def test_ceilings_from_dict_and_by_dtype_errors_name_the_field():
    from ferroattn.errors import ArgumentError
    with pytest.raises(ArgumentError, match="^bandwidth_gbps: expected in the ceilings dict"):
        Ceilings.from_dict({"peak_tflops": 1})
    with pytest.raises(ArgumentError, match="^d: expected a mapping"):
        Ceilings.from_dict(None)
    full = {"peak_tflops": "x", "bandwidth_gbps": 1.0, "compute_source": "s", "memory_source": "s", "device": "d"}
    with pytest.raises(ArgumentError, match="^peak_tflops: expected a finite real number"):
        Ceilings.from_dict(full)
    with pytest.raises(ArgumentError, match="^by_dtype: expected a tuple of"):
        Ceilings(1.0, 1.0, by_dtype=5)
    with pytest.raises(ArgumentError, match="^by_dtype: expected dtypes among"):
        Ceilings(1.0, 1.0, by_dtype=[([1], 1.0, "s")])
