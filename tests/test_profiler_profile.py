"""ferroattn.profiler.profile on CPU: schedule cycle, on_trace_ready, key_averages, chrome trace."""
from __future__ import annotations

import json

import pytest
import torch

from _profiler_fakes import make
from ferroattn.errors import ArgumentError, FerroattnError
from ferroattn.profiler import profile


def test_no_schedule_one_window_at_exit(tmp_path):
    clock, model, factory = make(2)
    seen = []
    with profile(model, event_factory=factory, on_trace_ready=lambda p: seen.append(p.windows)) as prof:
        for _ in range(3):
            model(torch.zeros(1))
            prof.step()
        assert seen == [] and clock.synced == 0
    assert seen == [1]
    ka = prof.key_averages(group_by="module")
    row = {r.key: r for r in ka}["layers.1.self_attn"]
    assert (row.count, row.gpu_time_total_ms) == (3, pytest.approx(9.0))
    assert prof.records.kernels == []
    assert "layers.1.self_attn" in ka.table(sort_by="gpu_time_total", row_limit=5)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(path)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 * 8 and {e["cat"] for e in xs} == {"ferroattn_module"}
    assert all(e["dur"] >= 0 for e in xs)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_torch_schedule_records_only_active_steps_and_calls_on_trace_ready(tmp_path):
    clock, model, factory = make(1)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=2)
    windows = []

    def ready(p):
        windows.append(sorted({r.step for r in p.records.modules}))
        p.export_chrome_trace(tmp_path / f"w{p.windows}.json")

    with profile(model, schedule=sched, on_trace_ready=ready, event_factory=factory) as prof:
        for _ in range(10):
            model(torch.zeros(1))
            prof.step()
    # cycle of 4: wait (0), warmup (1), record (2), record_and_save (3); then 4..7; then NONE
    assert windows == [[2, 3], [6, 7]]
    assert (tmp_path / "w1.json").exists() and (tmp_path / "w2.json").exists()
    assert {r.key: r.count for r in prof.key_averages()}["layers.0"] == 2   # the latest window


def test_exit_during_an_active_window_saves_it():
    clock, model, factory = make(1)
    sched = torch.profiler.schedule(wait=0, warmup=0, active=3)
    seen = []
    with profile(model, schedule=sched, on_trace_ready=lambda p: seen.append(len(p.records.modules)),
                 event_factory=factory) as prof:
        model(torch.zeros(1))
        prof.step()
    assert seen == [5]       # root, embed, layer, attn, mlp of the one recorded step


def test_model_none_and_misuse():
    prof = profile(None)
    with prof:
        prof.step()
    assert prof.records.modules == [] and prof.key_averages("kernel") == []
    with pytest.raises(FerroattnError, match="step"):
        prof.step()
    with pytest.raises(ArgumentError, match="schedule"):
        profile(None, schedule=3)
    with pytest.raises(ArgumentError, match="on_trace_ready"):
        profile(None, on_trace_ready="x")
    with pytest.raises(ArgumentError, match="^record_shapes: expected a bool, got str 'no'"):
        profile(None, record_shapes="no")
    with pytest.raises(ArgumentError, match="^bogus: unexpected keyword argument of profile"):
        profile(None, bogus=1)
    assert profile(None, include_root=False, record_shapes=False).hook_options == {"include_root": False}
    with pytest.raises(ArgumentError, match="schedule"):
        with profile(None, schedule=lambda s: "RECORD"):
            pass


def test_exception_in_the_block_removes_hooks_and_saves_nothing():
    clock, model, factory = make(1)
    seen = []
    with pytest.raises(RuntimeError):
        with profile(model, event_factory=factory, on_trace_ready=seen.append):
            model(torch.zeros(1))
            raise RuntimeError("x")
    assert seen == [] and sum(len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_usable_inside_torch_profiler():
    clock, model, factory = make(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        with profile(model, event_factory=factory) as prof:
            model(torch.zeros(1))
    assert "layers.0.self_attn" in {e.key for e in tp.key_averages()}
    assert len(prof.records.modules) == 5


@pytest.mark.parametrize("every", [1, 4])
def test_long_window_harvests_finished_calls_between_steps_and_reuses_events(every):
    """harvest_forwards = every: a step resolves the finished calls once `every` forwards' worth
    are unresolved (1, the default: at every step; 4: at every 4th), and later forwards reuse
    their events."""
    from _profiler_fakes import FakeEvent
    assert profile.harvest_forwards == 1
    n = 8

    def run(with_query):
        clock, model, _ = make(3)
        made = []

        class QEvent(FakeEvent):
            def query(self):              # the fake GPU is always done with recorded events
                return self.t is not None

        def factory():
            e = QEvent(clock) if with_query else FakeEvent(clock)
            made.append(e)
            return e

        with profile(model, event_factory=factory) as prof:
            prof.harvest_forwards = every
            for _ in range(n):
                model(torch.zeros(1))
                prof.step()
        return prof.records.modules, len(made)

    harvested, made_q = run(True)
    plain, made_plain = run(False)
    key = lambda r: (r.name, r.step, r.depth, round(r.start_us, 6), round(r.gpu_ms, 6))  # noqa: E731
    assert [key(r) for r in harvested] == [key(r) for r in plain]        # same records, same (call) order
    per_forward = len(plain) // n
    assert made_plain == n * 2 * per_forward + 1                         # two events per call + the window's reference
    assert made_q == every * 2 * per_forward + 1                         # later forwards reuse harvested events


# ---- native marks (fake _native) ----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["wrap", "torch"])
def test_profile_with_native_marks_attributes_kernels_and_frees_every_mark(mode):
    from _profiler_fakes import make_launching
    clock, model, factory, native, rec = make_launching(2)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=2)
    with profile(model, schedule=sched, event_factory=factory, recorder=rec, native=native, mode=mode) as prof:
        for _ in range(5):
            model(torch.zeros(1))
            prof.step()
    assert native.marks == {}, "warmup discards, harvests, saves and the exit return every mark"
    mods = prof.records.modules
    assert sorted({r.step for r in mods}) == [2, 3]
    by = {}
    for r in mods:
        by.setdefault(r.name, []).append(r)
    assert [r.gpu_ms for r in by["layers.1.self_attn"]] == pytest.approx([3.0, 3.0])
    attn = [k for k in prof.records.kernels if k.name == "attn_fwd_sm80"]
    assert len(attn) == 4 and {k.module for k in attn} == {"layers.0.self_attn", "layers.1.self_attn"}
    assert "forward" not in model.layers[0].__dict__ and not model.layers[0]._forward_hooks


def test_profile_left_by_an_exception_frees_its_marks():
    from _profiler_fakes import make_launching
    clock, model, factory, native, rec = make_launching(1)
    with pytest.raises(RuntimeError, match="boom"):
        with profile(model, event_factory=factory, recorder=rec, native=native):
            model(torch.zeros(1))
            raise RuntimeError("boom")
    assert native.marks == {} and "forward" not in model.__dict__
