"""ferroattn.profiler records, key_averages tables and the Chrome trace export (CPU)."""
from __future__ import annotations

import json

import pytest

from ferroattn.errors import ArgumentError
from ferroattn.profiler import (Ceilings, KernelRecord, ModuleRecord, Records, chrome_trace_events, key_averages,
                                sort_keys)

C = Ceilings(800.0, 4000.0, "mm", "cp", "TestGPU")


def kern(name="attn_fwd", config="fwd<128,128,64>", op="ferroattn::attn_fwd", grid=(4, 16, 1), ms=2.0,
         flops=1e12, nbytes=1e9, start=0.0, module=None, occ=0.25):
    return KernelRecord(name, config, op, grid, (128, 1, 1), 168, 49152, occ, flops, nbytes, ms, start, module)


def records(ceilings=C, total=None):
    mods = [ModuleRecord("model", "LlamaModel", 10.0, 0.0, 0)]
    t = 0.0
    for i in range(3):
        mods.append(ModuleRecord(f"model.layers.{i}", "LlamaDecoderLayer", 3.0 + i, t, 1))
        mods.append(ModuleRecord(f"model.layers.{i}.self_attn", "LlamaAttention", 1.0 + i, t, 2))
        t += (3.0 + i) * 1e3
    mods.append(ModuleRecord("model.layers.0", "LlamaDecoderLayer", 3.0, t, 1))  # a second call
    kers = [kern(ms=2.0, start=0.0, module="model.layers.0.self_attn"),
            kern(ms=4.0, grid=(8, 16, 1), start=3000.0, module="model.layers.1.self_attn"),
            kern(name="attn_bwd_dkdv", config="dkdv<128>", op="ferroattn::attn_bwd", ms=1.0, flops=2.5e12,
                 nbytes=2e9, start=9000.0, occ=None)]
    return Records(mods, kers, ceilings, total)


def test_module_grouping_and_percentages():
    ka = records().key_averages("module")
    assert [r.key for r in ka] == ["model", "model.layers.0", "model.layers.0.self_attn", "model.layers.1",
                                    "model.layers.1.self_attn", "model.layers.2", "model.layers.2.self_attn"]
    l0 = ka[1]
    assert (l0.count, l0.gpu_time_total_ms, l0.gpu_time_avg_ms, l0.kind) == (2, 6.0, 3.0, "LlamaDecoderLayer")
    assert ka.total_gpu_ms == 10.0 and l0.pct_of_total == 60.0      # outermost module = 10 ms
    ka2 = records(total=20.0).key_averages("module")
    assert ka2[1].pct_of_total == 30.0 and ka2.total_source == "measured window"
    assert [r.key for r in ka.top(2)] == ["model", "model.layers.0"]


def test_kernel_and_op_grouping():
    ka = key_averages(records(), group_by="kernel")
    assert len(ka) == 2
    fwd = ka[0]
    assert (fwd.key, fwd.kind, fwd.count, fwd.gpu_time_total_ms) == ("attn_fwd", "fwd<128,128,64>", 2, 6.0)
    assert fwd.grid == "varies" and fwd.block == (128, 1, 1) and fwd.registers == 168
    assert fwd.tflops == pytest.approx(2e12 / 6e-3 / 1e12) and fwd.gbps == pytest.approx(2e9 / 6e-3 / 1e9)
    # intensity 1000 >= ridge 200 -> attainable 800 TFLOP/s
    assert fwd.pct_of_roofline == pytest.approx(100 * fwd.tflops / 800.0)
    assert fwd.pct_of_total == pytest.approx(100 * 6 / 7)
    ops = records().key_averages("op")
    assert [(r.key, r.count, r.kernels) for r in ops] == [("ferroattn::attn_fwd", 2, 1), ("ferroattn::attn_bwd", 1, 1)]
    assert records(ceilings=None).key_averages("kernel")[0].pct_of_roofline is None


def test_table_layout_and_footer():
    text = records().key_averages("kernel").table()
    lines = text.splitlines()
    assert lines[0].startswith("----") and lines[2] == lines[0] and lines[0] == lines[-3]
    assert lines[1].split()[:4] == ["Name", "Config", "Calls", "GPU"]
    assert "TFLOP/s" in lines[1] and "% of roofline" in lines[1]
    assert "6.000ms" in lines[3] and "varies" in lines[3] and "25.0" in lines[3]   # occupancy 25 %
    assert lines[4].split()[0] == "attn_bwd_dkdv" and " -- " in lines[4]            # unknown occupancy
    assert lines[-2].startswith("GPU time total: 7.000ms")
    assert lines[-1] == C.label()                                                   # says which ceilings
    no_ceil = records(ceilings=None).key_averages("op").table()
    assert "no ceilings given" in no_ceil
    small = Records([ModuleRecord("a", "A", 0.0123), ModuleRecord("b", "B", 1500.0)]).key_averages("module")
    rows = small.table().splitlines()[3:5]
    assert "12.300us" in rows[0] and "1.500s" in rows[1]


def test_table_sorting_and_row_limit():
    ka = records().key_averages("module")
    names = [ln.split()[0] for ln in ka.table(sort_by="gpu_time_total").splitlines()[3:-2]]
    assert names[:3] == ["model", "model.layers.0", "model.layers.2"]            # 10, 6, 5 ms
    assert [ln.split()[0] for ln in ka.table(sort_by="name").splitlines()[3:5]] == ["model", "model.layers.0"]
    assert [r.key for r in ka.sorted("calls")][0] == "model.layers.0"
    limited = ka.table(sort_by="device_time_total", row_limit=2).splitlines()
    assert len(limited) == 3 + 2 + 1 + 2 and "Rows shown: 2 of 7" in limited[-1]
    assert len(ka.table(row_limit=-1).splitlines()) == len(ka.table(row_limit=None).splitlines()) == 3 + 7 + 2
    k = records().key_averages("kernel")
    assert [r.key for r in k.sorted("tflops")] == ["attn_bwd_dkdv", "attn_fwd"]     # 2500 vs 333 TFLOP/s
    assert [r.key for r in k.sorted("pct_total")] == ["attn_fwd", "attn_bwd_dkdv"]


def test_name_truncation():
    long = "model." + "x" * 100
    ka = Records([ModuleRecord(long, "M", 1.0)]).key_averages("module")
    row = ka.table(max_name_column_width=20).splitlines()[3]
    assert row.startswith("model.xxxxxxxxxxx...") and long not in row


@pytest.mark.parametrize("call, arg", [
    (lambda: records().key_averages("layer"), "group_by"),
    (lambda: key_averages([]), "records"),
    (lambda: key_averages(None), "records"),
    (lambda: records().key_averages("module").table(sort_by="tflops"), "sort_by"),
    (lambda: records().key_averages("kernel").table(sort_by="cpu_time_total"), "sort_by"),
    (lambda: records().key_averages("kernel").table(row_limit=0), "row_limit"),
    (lambda: records().key_averages("kernel").table(row_limit=2.5), "row_limit"),
    (lambda: records().key_averages("kernel").table(max_name_column_width=2), "max_name_column_width"),
    (lambda: records().key_averages("module").top(-1), "n"),
    (lambda: ModuleRecord("", "M", 1.0), "name"),
    (lambda: ModuleRecord("m", "M", -1.0), "gpu_ms"),
    (lambda: kern(grid=(0, 1, 1)), "grid"),
    (lambda: kern(grid=(1, 1)), "grid"),
    (lambda: kern(ms=float("nan")), "gpu_ms"),
    (lambda: kern(occ=1.5), "occupancy"),
    (lambda: kern(nbytes=-1), "nbytes"),
])
def test_bad_arguments(call, arg):
    with pytest.raises(ArgumentError, match=rf"^{arg}:"):
        call()


def test_sort_keys_per_group():
    assert "tflops" not in sort_keys("module") and "tflops" in sort_keys("kernel")
    assert {"gpu_time_total", "device_time_total", "cuda_time_total", "name"} <= set(sort_keys("op"))


def test_record_rates_and_utilisation():
    k = kern(ms=2.0)
    assert k.tflops == pytest.approx(500.0) and k.gbps == pytest.approx(500.0)
    u = k.utilisation(C)
    assert u.ceilings is C and u.pct_of_roofline == pytest.approx(62.5) and u.bound == "compute"
    assert kern(ms=0.0).tflops is None and kern(ms=0.0).utilisation(C) is None
    p = k.roofline_point()
    assert (p.name, p.intensity) == ("attn_fwd", 1000.0)


def test_chrome_trace(tmp_path):
    path = tmp_path / "trace.json"
    records().export_chrome_trace(path)
    with open(path) as f:
        doc = json.load(f)
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == 8 + 3
    for e in xs:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    kx = [e for e in xs if e["cat"] == "ferroattn_kernel"]
    assert kx[1]["dur"] == 4000.0 and kx[1]["ts"] == 3000.0                  # ms -> µs
    assert kx[1]["args"]["grid"] == [8, 16, 1] and kx[1]["args"]["registers per thread"] == 168
    assert kx[0]["args"]["theoretical occupancy %"] == 25.0
    assert kx[2]["args"]["theoretical occupancy %"] is None
    assert kx[0]["args"]["ceilings"] == C.label() and kx[0]["args"]["% of roofline"] == pytest.approx(62.5)
    mx = [e for e in xs if e["cat"] == "ferroattn_module"]
    assert mx[0]["name"] == "model" and mx[0]["dur"] == 10000.0 and mx[0]["args"]["kind"] == "LlamaModel"
    assert {e["tid"] for e in mx}.isdisjoint({e["tid"] for e in kx})
    meta = [e for e in ev if e["ph"] == "M"]
    assert {e["name"] for e in meta} == {"process_name", "thread_name"}
    assert doc["otherData"]["ceilings"] == C.label()


def test_chrome_trace_empty_and_without_ceilings(tmp_path):
    path = tmp_path / "t.json"
    Records().export_chrome_trace(path)
    assert json.loads(path.read_text())["traceEvents"] == []
    Records(kernels=[kern()]).export_chrome_trace(path)
    (e,) = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert "ceilings" not in e["args"] and e["args"]["TFLOP/s"] == pytest.approx(500.0)


# ---- review fixes: record field validation, numpy scalars, atomic trace export --------------------
def _kr(**kw):
    args = dict(name="k", config="c", op="op", grid=(1, 1, 1), block=(32, 1, 1), registers=64, smem_bytes=0,
                occupancy=0.5, flops=1.0, nbytes=1.0, gpu_ms=1.0)
    args.update(kw)
    return KernelRecord(**args)


@pytest.mark.parametrize("call, arg", [
    (lambda: _kr(config=None), "config"),
    (lambda: _kr(op=3), "op"),
    (lambda: _kr(module=1), "module"),
    (lambda: _kr(registers=-1), "registers"),
    (lambda: _kr(registers=1.5), "registers"),
    (lambda: _kr(smem_bytes="0"), "smem_bytes"),
    (lambda: _kr(occupancy="0.5"), "occupancy"),
    (lambda: _kr(occupancy=True), "occupancy"),
    (lambda: _kr(occupancy=float("nan")), "occupancy"),
    (lambda: _kr(device=-1), "device"),
    (lambda: _kr(step=1.0), "step"),
    (lambda: _kr(stream=None), "stream"),
    (lambda: _kr(grid=(1, True, 1)), "grid"),
    (lambda: ModuleRecord("m", None, 1.0), "kind"),
    (lambda: ModuleRecord("m", "M", 1.0, depth=-1), "depth"),
    (lambda: ModuleRecord("m", "M", 1.0, step="0"), "step"),
    (lambda: ModuleRecord("m", "M", 1.0, device=0.5), "device"),
    (lambda: ModuleRecord("m", "M", "1.0"), "gpu_ms"),
    (lambda: records().key_averages("kernel").table(row_limit=True), "row_limit"),
])
def test_record_fields_are_validated(call, arg):
    with pytest.raises(ArgumentError, match=rf"^{arg}: expected"):
        call()


def test_numpy_scalars_accepted_and_normalised():
    np = pytest.importorskip("numpy")
    k = _kr(grid=(np.int64(2), 1, 1), registers=np.int32(64), smem_bytes=np.uint16(1024),
            occupancy=np.float32(0.25), flops=np.float64(2e12), gpu_ms=np.float32(2.0), device=np.int64(1))
    assert k.grid == (2, 1, 1) and type(k.grid[0]) is int and type(k.registers) is int
    assert (k.smem_bytes, k.occupancy, k.device, k.tflops) == (1024, 0.25, 1, 1000.0)
    m = ModuleRecord("m", "M", np.float32(1.5), np.int64(3), depth=np.int8(1))
    assert (m.gpu_ms, m.start_us, m.depth) == (1.5, 3.0, 1) and type(m.depth) is int
    json.dumps(chrome_trace_events([m], [k]))                           # JSON-ready after normalising
    assert len(records().key_averages("kernel").table(row_limit=np.int64(1)).splitlines()) < 10


def test_chrome_trace_is_written_atomically(tmp_path):
    path = tmp_path / "t.json"
    records().export_chrome_trace(path)
    before = path.read_text()
    huge = Records(kernels=[kern(ms=1e306)])                            # 1e306 ms -> inf µs
    with pytest.raises(ArgumentError, match=r"^kernels: expected a gpu_ms whose duration in µs is finite"):
        huge.export_chrome_trace(path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["t.json"]
    (tmp_path / "d").mkdir()
    for bad, match in ((tmp_path / "d", "is a directory"), ("", "non-empty")):
        with pytest.raises(ArgumentError, match=f"^path: .*{match}"):
            records().export_chrome_trace(bad)
    with pytest.raises(FileNotFoundError):
        records().export_chrome_trace(tmp_path / "missing" / "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t.json"]   # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644                         # not mkstemp's 0600


def test_records_total_gpu_ms_must_be_a_finite_number():
    from ferroattn.errors import ArgumentError
    from ferroattn.profiler.events import Records
    for bad in (float("nan"), -1.0, float("inf"), True, "abc"):
        with pytest.raises(ArgumentError, match="^total_gpu_ms: expected a finite real number >= 0"):
            Records([], total_gpu_ms=bad)
    assert Records([], total_gpu_ms=2).total_gpu_ms == 2.0


def test_records_and_trace_events_refuse_what_is_not_a_record():
    from ferroattn.errors import ArgumentError
    from ferroattn.profiler.clocks import WallClockEvent
    from ferroattn.profiler.events import KernelRecord, ModuleRecord, Records, chrome_trace_events
    m = ModuleRecord("m", "M", 1.0)
    for bad, match in [([{"name": "x"}], r"^modules\[0\]: expected a ModuleRecord"), ("abc", "^modules: expected a list"),
                       ([5], r"^modules\[0\]: expected a ModuleRecord")]:
        with pytest.raises(ArgumentError, match=match):
            chrome_trace_events(bad)
        with pytest.raises(ArgumentError, match=match):
            Records(bad)
    with pytest.raises(ArgumentError, match=r"^kernels\[0\]: expected a KernelRecord"):
        Records([], [m])
    with pytest.raises(ArgumentError, match="^ceilings: expected None or a ferroattn.profiler.Ceilings"):
        chrome_trace_events([m], ceilings=5)
    with pytest.raises(ArgumentError, match=r"^input_shapes\[0\]: expected None or a shape"):
        ModuleRecord("m", "M", 1.0, input_shapes=(object(),))
    assert len(chrome_trace_events([m])) > 1
    e = WallClockEvent()
    e.record()
    with pytest.raises(ArgumentError, match="^other: expected a WallClockEvent"):
        e.elapsed_time(5)
