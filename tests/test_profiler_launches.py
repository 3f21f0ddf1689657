"""Kernel records in ferroattn.profiler on CPU: a fake Rust launch recorder (the _native.profiler_*
contract), fake events with a synthetic clock, fake torch.profiler FunctionEvents."""
from __future__ import annotations

import pytest
import torch

from _profiler_fakes import FakeTorchProfiler, FEvent, Kernel, make_launching
from ferroattn.errors import ArgumentError
from ferroattn.profiler import Ceilings, KernelRecord, ModuleRecord, Records, kernel_records, profile
from ferroattn.profiler.launches import Recorder, innermost_module

# make_launching(2): embed [0,1] ms; layer i: norm 0.5, attention = one launch of (2+i) ms, mlp 3 ms
#   layers.0: [1, 6.5], its self_attn [1.5, 3.5] (kernel starts at 1.5 ms)
#   layers.1: [6.5, 13], its self_attn [7, 10] (kernel starts at 7 ms); root [0, 13]


def raw(start_ms, **kw):
    d = {"seq": 0, "op": "ferroattn::attn_fwd", "kernel": "attn_fwd_sm80", "config": "cfg<1, __half>",
         "arch": "sm_90a", "device": 0, "stream": 5, "grid": [4, 2, 1], "block": [128, 1, 1],
         "dynamic_smem_bytes": 1000, "static_smem_bytes": 24, "registers": 96, "max_active_blocks_per_sm": 2,
         "occupancy": 0.125, "flops": 3e9, "bytes": 5e6, "exact": True, "gpu_ms": 0.5, "start_ms": start_ms}
    d.update(kw)
    return d


MODS = [ModuleRecord("root", "M", 10.0, 0.0, 0, step=4), ModuleRecord("root.a", "A", 4.0, 1000.0, 1, step=4),
        ModuleRecord("root.a.x", "X", 1.0, 2000.0, 2, step=4), ModuleRecord("root.b", "B", 4.0, 5000.0, 1, step=4)]


def test_kernel_records_from_drain_dicts():
    k1, k2, k3 = kernel_records([raw(2.5), raw(4.0, gpu_ms=0.25), raw(None)], MODS, step=9)
    assert (k1.name, k1.config, k1.op, k1.grid, k1.block) == ("attn_fwd_sm80", "cfg<1, __half>",
                                                              "ferroattn::attn_fwd", (4, 2, 1), (128, 1, 1))
    assert (k1.registers, k1.smem_bytes, k1.occupancy, k1.stream, k1.device) == (96, 1024, 0.125, 5, 0)
    assert (k1.flops, k1.nbytes, k1.gpu_ms, k1.start_us) == (3e9, 5e6, 0.5, 2500.0)
    assert (k1.module, k1.step) == ("root.a.x", 4)              # innermost holding 2500 us
    assert (k2.module, k2.gpu_ms) == ("root.a", 0.25)            # 4000 us: after root.a.x ended
    assert (k3.module, k3.start_us, k3.step) == (None, 0.0, 9)   # no start from the driver
    assert k1.dtype == "float16"
    (k,) = kernel_records([raw(2.5)], MODS, with_flops=False)
    assert k.flops == 0.0 and k.nbytes == 5e6


def test_innermost_module_rule():
    assert innermost_module(-1.0, MODS) is None and innermost_module(20000.0, MODS) is None
    assert innermost_module(0.0, MODS).name == "root"
    assert innermost_module(3000.0, MODS).name == "root.a.x"     # end is inclusive
    assert innermost_module(5000.0, MODS).name == "root.b"       # ties: the later start wins
    assert innermost_module(9500.0, MODS).name == "root"


def test_profile_fills_kernels_from_the_recorder():
    clock, model, factory, native, rec = make_launching(2)
    with profile(model, event_factory=factory, recorder=rec) as prof:
        assert native.on
        model(torch.zeros(1))
    assert not native.on and native.enable_calls == [True, False]
    ks = prof.records.kernels
    assert [(k.name, k.module, k.start_us, k.gpu_ms) for k in ks] == [
        ("attn_fwd_sm80", "layers.0.self_attn", 1500.0, 2.0), ("attn_fwd_sm80", "layers.1.self_attn", 7000.0, 3.0)]
    assert ks[0].smem_bytes == 40976 and ks[0].registers == 168 and ks[0].flops == 4e9
    by = {m.name: m for m in prof.records.modules}
    for k in ks:   # module and kernel start_us share the window's reference
        m = by[k.module]
        assert m.start_us <= k.start_us <= m.start_us + m.gpu_ms * 1e3
    assert prof.records.total_gpu_ms == pytest.approx(13.0)
    ka = prof.key_averages("kernel")
    assert len(ka) == 1 and ka[0].count == 2 and ka[0].gpu_time_total_ms == 5.0
    assert ka[0].pct_of_total == pytest.approx(100 * 5 / 13)
    assert "attn_fwd_sm80" in ka.table()


def test_with_flops_false_gives_zero_flops():
    clock, model, factory, native, rec = make_launching(1)
    with profile(model, with_flops=False, event_factory=factory, recorder=rec) as prof:
        model(torch.zeros(1))
    assert [k.flops for k in prof.records.kernels] == [0.0] and prof.records.kernels[0].nbytes > 0
    assert prof.key_averages("op")[0].tflops is None          # not counted: shown as "--", not 0


def test_warmup_and_wait_launches_are_discarded():
    clock, model, factory, native, rec = make_launching(1)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=1)
    with profile(model, schedule=sched, event_factory=factory, recorder=rec) as prof:
        for _ in range(4):
            model(torch.zeros(1))     # 7.5 ms per forward
            prof.step()
    ks = prof.records.kernels
    assert len(ks) == 1 and ks[0].step == 2 and ks[0].module == "layers.0.self_attn"
    assert ks[0].start_us == pytest.approx(1500.0)   # relative to the active window's start
    assert native.kept == [] and prof.windows == 1


def test_recorder_left_on_when_it_was_on_and_nested_profiles_share_launches():
    clock, model, factory, native, rec = make_launching(2, enabled=True)
    with profile(model, event_factory=factory, recorder=rec) as outer:
        model(torch.zeros(1))                                   # launches at 1.5 and 7 ms
        with profile(None, event_factory=factory, recorder=rec) as inner:
            model(torch.zeros(1))                               # at 14.5 and 20 ms; inner window from 13 ms
        assert native.on
    assert native.on and native.enable_calls == [True, True]   # turned on by each, never off
    assert [k.start_us for k in inner.records.kernels] == [1500.0, 7000.0]
    assert inner.records.modules == [] and inner.records.total_gpu_ms == pytest.approx(13.0)
    assert [k.start_us for k in outer.records.kernels] == [1500.0, 7000.0, 14500.0, 20000.0]
    assert [k.module for k in outer.records.kernels] == ["layers.0.self_attn", "layers.1.self_attn"] * 2


def test_nested_profile_restores_off_state():
    clock, model, factory, native, rec = make_launching(1)
    with profile(None, event_factory=factory, recorder=rec):
        with profile(model, event_factory=factory, recorder=rec):
            model(torch.zeros(1))
        assert native.on                      # the outer one still records
    assert not native.on


def test_exception_drops_the_window_and_restores_the_recorder():
    clock, model, factory, native, rec = make_launching(1)
    with pytest.raises(RuntimeError, match="x"):
        with profile(model, event_factory=factory, recorder=rec) as prof:
            model(torch.zeros(1))
            raise RuntimeError("x")
    assert not native.on and native.kept == [] and prof.records.kernels == []


def test_unavailable_recorder_gives_no_kernels():
    clock, model, factory, native, rec = make_launching(1)
    rec_none = Recorder(native=object())
    assert not rec_none.available and rec_none.drain(None) == [] and rec_none.stats() == {}
    with profile(model, event_factory=factory, recorder=rec_none) as prof:
        model(torch.zeros(1))
    assert prof.records.kernels == [] and len(prof.records.modules) == 5
    with pytest.raises(ArgumentError, match="recorder"):
        profile(model, recorder=native)
    with pytest.raises(ArgumentError, match="ceilings"):
        profile(model, ceilings=800.0)


def test_ceilings_argument_and_dtype_specific_compute_ceiling():
    c = Ceilings(800.0, 4000.0, "mm bf16", "cp", "TestGPU",
                 by_dtype=(("bfloat16", 800.0, "mm bf16"), ("float16", 400.0, "mm fp16")))
    clock, model, factory, native, rec = make_launching(1)
    with profile(model, event_factory=factory, recorder=rec, ceilings=c) as prof:
        model(torch.zeros(1))
    assert prof.records.ceilings is c
    (k,) = prof.records.kernels                                  # bf16 config, intensity 2000 FLOP/B
    u = k.utilisation(c)
    assert u.ceilings.compute_source == "mm bf16" and u.pct_of_compute == pytest.approx(100 * 2.0 / 800.0)
    k16 = KernelRecord("k", "x<64, __half>", "op", (1, 1, 1), (1, 1, 1), None, None, None, 4e9, 2e6, 2.0)
    u16 = k16.utilisation(c)
    assert u16.ceilings.compute_source == "mm fp16" and u16.attainable_tflops == 400.0
    table = Records(kernels=[k16], ceilings=c).key_averages("kernel")
    assert table[0].pct_of_roofline == pytest.approx(100 * 2.0 / 400.0)
    assert "float16 400.0 TFLOP/s" in table.table()


# ---- import_torch_profiler ------------------------------------------------------------------

OURS_NAME = "void ferroattn::attn_fwd_sm80<64, 128, 64, 4, 2, true, __nv_bfloat16>(ferroattn::AttnFwdParams)"


def fake_trace():
    root = FEvent("Decoder", 0, 1000)
    layer = FEvent("layers.0", 100, 900, root)
    attn = FEvent("layers.0.self_attn", 200, 400, layer)
    ours = FEvent("ferroattn::attn_fwd", 210, 390, attn, [Kernel(OURS_NAME, 2000)])
    mlp = FEvent("layers.0.mlp", 400, 800, layer)
    linear = FEvent("aten::linear", 410, 600, mlp)
    mm = FEvent("aten::mm", 420, 590, linear, [Kernel("sm90_xmma_gemm_bf16", 3000)], flops=1e9)
    add = FEvent("aten::add", 610, 700, mlp, [Kernel("elementwise_kernel", 500), Kernel("elementwise_kernel", 100)],
                 flops=5.0)
    memset = FEvent("Memset launcher", 950, 990, root, [Kernel("Memset (Device)", 50)])
    device = [FEvent(OURS_NAME, 5000, 7000, cuda=True), FEvent("sm90_xmma_gemm_bf16", 8000, 11000, cuda=True),
              FEvent("elementwise_kernel", 11000, 11500, cuda=True),
              FEvent("elementwise_kernel", 11600, 11700, cuda=True), FEvent("Memset (Device)", 12000, 12050, cuda=True)]
    return FakeTorchProfiler([root, layer, attn, ours, mlp, linear, mm, add, memset] + device)


def test_import_torch_profiler_attributes_other_kernels():
    clock, model, factory, native, rec = make_launching(1)
    with profile(model, event_factory=factory, recorder=rec) as prof:
        model(torch.zeros(1))
    (ours,) = prof.records.kernels                   # starts at 1500 us in our time base
    added = prof.import_torch_profiler(fake_trace())
    assert prof.records.kernels == [ours] + added
    got = [(k.name, k.op, k.module, k.gpu_ms, k.flops, k.start_us) for k in added]
    assert got == [("sm90_xmma_gemm_bf16", "aten::mm", "layers.0.mlp", 3.0, 1e9, 4500.0),
                   ("elementwise_kernel", "aten::add", "layers.0.mlp", 0.5, 0.0, 7500.0),
                   ("elementwise_kernel", "aten::add", "layers.0.mlp", 0.1, 0.0, 8100.0),
                   ("Memset (Device)", "torch", "Decoder", 0.05, 0.0, 8500.0)]
    assert all(k.registers is None and k.occupancy is None and k.smem_bytes is None and k.nbytes == 0
               for k in added)
    ops = {r.key: r for r in prof.key_averages("op")}
    assert ops["aten::mm"].gpu_time_total_ms == 3.0 and ops["ferroattn::attn_fwd"].count == 1


def test_import_torch_profiler_without_our_kernels_or_flops():
    clock, model, factory, native, rec = make_launching(1)
    with profile(model, with_flops=False, event_factory=factory, recorder=Recorder(native=object())) as prof:
        model(torch.zeros(1))
    added = prof.import_torch_profiler(fake_trace())
    # no anchor: start relative to the trace's first device event (5000 us)
    assert [k.start_us for k in added] == [3000.0, 6000.0, 6600.0, 7000.0]
    assert all(k.flops == 0.0 for k in added)


def test_import_torch_profiler_rejects_unfinished_or_other_objects():
    prof = profile(None)
    with pytest.raises(ArgumentError, match="tp"):
        prof.import_torch_profiler(object())

    class Unfinished:
        def events(self):
            raise AssertionError("Profiler must be finished before")
    with pytest.raises(ArgumentError, match="tp: expected a finished"):
        prof.import_torch_profiler(Unfinished())


def test_import_a_real_cpu_torch_profiler_trace():
    clock, model, factory, native, rec = make_launching(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        with profile(model, event_factory=factory, recorder=rec) as prof:
            model(torch.ones(3) + 1)
    assert prof.import_torch_profiler(tp) == []      # CPU only: no device kernels to add
    assert len(prof.records.kernels) == 1


# ---- review fixes -----------------------------------------------------------------------------
def test_a_raising_on_trace_ready_does_not_break_the_next_window():
    from torch.profiler import ProfilerAction
    clock, model, factory, native, rec = make_launching()
    calls = []

    def ready(p):
        calls.append(len(p.records.kernels))
        if len(calls) == 1:
            raise ValueError("first trace handler fails")

    counts = []
    with profile(model, schedule=lambda s: ProfilerAction.RECORD_AND_SAVE, on_trace_ready=ready,
                 event_factory=factory, recorder=rec) as p:
        for _ in range(3):
            model(torch.zeros(1))
            try:
                p.step()
            except ValueError:
                pass
            counts.append(len(p.records.kernels))
    assert counts == [3, 3, 3] and calls == [3, 3, 3, 0] and p.windows == 4   # the 4th: empty, at exit


def test_overlapping_profiles_exiting_out_of_order_keep_recording():
    clock, model, factory, native, rec = make_launching(1)
    a = profile(None, event_factory=factory, recorder=rec)
    b = profile(model, event_factory=factory, recorder=rec)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert native.on                                    # b is still open
    model(torch.zeros(1))
    b.__exit__(None, None, None)
    assert not native.on and native.kept == []          # the state before a, nothing left behind
    assert [k.module for k in b.records.kernels] == ["layers.0.self_attn"]
    # a recorder that was on before stays on, in any exit order
    native.on = True
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert native.on


def test_recorder_enable_needs_a_bool():
    clock, model, factory, native, rec = make_launching(1)
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match="^enabled: expected a bool"):
            rec.enable(bad)
    assert not native.on and native.enable_calls == []


@pytest.mark.parametrize("make_event", [lambda: None, lambda: 3, object])
@pytest.mark.parametrize("with_model", [True, False])
def test_event_factory_returning_a_non_event_is_named(make_event, with_model):
    clock, model, factory, native, rec = make_launching(1)
    p = profile(model if with_model else None, event_factory=make_event, recorder=rec)
    with pytest.raises(ArgumentError, match="^event_factory: expected a callable returning an event"):
        p.__enter__()
    assert not native.on and sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    with profile(model, event_factory=factory, recorder=rec) as ok:    # nothing left broken
        model(torch.zeros(1))
    assert len(ok.records.kernels) == 1


def test_import_a_torch_profiler_still_running_is_refused():
    clock, model, factory, native, rec = make_launching(1)
    with profile(model, event_factory=factory, recorder=rec) as prof:
        model(torch.zeros(1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        torch.ones(2) + 1
        with pytest.raises(ArgumentError, match="^tp: expected a finished torch.profiler.profile.*still running"):
            prof.import_torch_profiler(tp)
    prof.import_torch_profiler(tp)                      # finished: accepted


# ---- native marks: the _native contract without a driver ------------------------------------------

def test_native_mark_functions_name_bad_arguments_and_need_no_driver_when_empty():
    from ferroattn import _native as n
    if not all(hasattr(n, f) for f in ("profiler_mark", "profiler_marks_query", "profiler_marks_resolve",
                                       "profiler_marks_release")):
        pytest.skip("extension built without the mark functions")
    from ferroattn.errors import ArgumentError
    for args, exc, arg in [((-1, 0), ArgumentError, "stream"), (("x", 0), TypeError, "stream"),
                           ((0, "y"), TypeError, "device"), ((0, -2), ArgumentError, "device"),
                           ((0, 2 ** 40), ArgumentError, "device")]:
        with pytest.raises(exc, match=f"^{arg}:"):
            n.profiler_mark(*args)
    for bad in (["a"], 5, "ab"):
        with pytest.raises(TypeError, match="^marks:"):
            n.profiler_marks_release(bad)
        with pytest.raises(TypeError, match="^marks:"):
            n.profiler_marks_query(bad)
    with pytest.raises(ArgumentError, match="^marks:"):
        n.profiler_marks_resolve([2 ** 63])              # never made
    with pytest.raises(TypeError, match="^reference_event:"):
        n.profiler_marks_resolve([1], "ref")
    assert n.profiler_marks_release((2 ** 63, 2 ** 63 + 1)) == 0
    assert n.profiler_marks_query(()) == [] and n.profiler_marks_resolve([]) == []
