"""The experimental stamp clock (``attach(clock="stamp")``, hooks.StampClock) on CPU: a fake
``_native`` with the stamp functions over the synthetic clock of _profiler_fakes; the extension's
stamp functions without a driver; the pure helpers of scripts/profiler_overhead.py's stamp
experiment."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from _profiler_fakes import FakeNative, make
from ferroattn.errors import ArgumentError
from ferroattn.profiler import attach
from ferroattn.profiler.hooks import StampClock, native_stamps_available, stamp_pairs_ms

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeStampNative(FakeNative):
    """FakeNative plus the stamp contract: ``profiler_stamp`` returns an id whose value is the
    clock in integer ns (0 while ``capturing``); resolve / release as in _native.pyi (unknown or
    repeated ids: ArgumentError naming ``stamps``, nothing forgotten)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.stamps, self.next_stamp, self.stamp_resolves, self.stamp_streams = {}, 0, 0, []

    def profiler_stamp(self, stream, device):
        self.stamp_streams.append((stream, device))
        if self.capturing:
            return 0
        self.next_stamp += 1
        self.stamps[self.next_stamp] = round(self.clock.now * 1e6) + 10**15   # an arbitrary ns origin
        return self.next_stamp

    def profiler_stamps_resolve(self, stamps):
        if len(set(stamps)) != len(stamps) or any(s not in self.stamps for s in stamps):
            raise ArgumentError(f"stamps: expected unresolved stamp ids, got {list(stamps)}")
        self.stamp_resolves += 1
        return [self.stamps.pop(s) for s in stamps]

    def profiler_stamps_release(self, stamps):
        return sum(1 for s in stamps if self.stamps.pop(s, None) is not None)


def _native_forward_built() -> bool:
    try:
        from ferroattn import _native
    except Exception:
        return False
    return hasattr(_native, "ProfilerForward")


#: wrap (Python wrapper), torch hooks, and the native wrapper when built (it calls the clock's
#: mark here: the fake is not the extension)
MODES = [{"mode": "wrap", "native_wrap": False}, {"mode": "torch"}] + (
    [{"mode": "wrap", "native_wrap": True}] if _native_forward_built() else [])


@pytest.mark.parametrize("kw", MODES, ids=lambda k: k["mode"] + ("-native" if k.get("native_wrap") else ""))
def test_stamp_clock_gives_the_event_clocks_records(kw):
    clock, model, factory = make(2)
    native = FakeStampNative(clock)
    with attach(model, event_factory=factory, native=native, clock="stamp", **kw) as att:
        assert isinstance(att.clock, StampClock)
        assert native.stamps == {} and native.marks == {}, "prewarm: one stamp, resolved"
        clock.now = 12.0
        model(torch.zeros(1))
        assert len(native.stamps) == 2 * len(att.targets) and native.marks == {}, "stamps, no event marks"
        recs = att.resolve(reference=object())   # a reference cannot be placed on the stamp clock: ignored
    assert native.stamps == {}
    by = {r.name: r for r in recs}
    assert by["Decoder"].start_us == pytest.approx(0.0), "offsets from the first start"
    assert by["embed"].gpu_ms == pytest.approx(1.0)
    assert by["layers.0"].start_us == pytest.approx(1000.0)
    assert by["layers.1"].gpu_ms == pytest.approx(0.5 + 3.0 + 3.0)
    assert by["layers.1.self_attn"].gpu_ms == pytest.approx(3.0)
    assert by["Decoder"].gpu_ms == pytest.approx(1.0 + 5.5 + 6.5)


def test_stamps_not_recorded_under_capture_give_no_record_and_discard_releases():
    clock, model, factory = make(1)
    native = FakeStampNative(clock)
    with attach(model, event_factory=factory, native=native, clock="stamp") as att:
        native.capturing = True
        model(torch.zeros(1))
        native.capturing = False
        assert att.resolve() == [] and native.stamps == {}
        model(torch.zeros(1))
        assert att.discard() == len(att.targets) and native.stamps == {}
        model(torch.zeros(1))
        assert len(att.harvest(object())) == len(att.targets), "done() says True: a harvest resolves"


def test_stamp_pairs_ms_offsets_durations_and_missing_stamps():
    ns = {1: 5_000_000, 2: 7_500_000, 3: 4_000_000, 4: 9_000_000, 5: 1}
    reads = []

    def read(ids):
        reads.append(list(ids))
        return [ns[i] for i in ids]
    out = stamp_pairs_ms([(1, 2), (3, 4), (0, 5), (5, 0)], read)
    assert reads == [[1, 2, 3, 4, 5, 5]], "one read of every recorded id (an id may end one pair and start another)"
    assert out[0] == pytest.approx((1.0, 2.5)) and out[1] == pytest.approx((0.0, 5.0))
    assert out[2:] == [None, None], "a pair with an unrecorded stamp gives None; the earliest start is 3"
    assert stamp_pairs_ms([(0, 0)], read) == [None]
    assert len(reads) == 1, "nothing recorded: no read"


def test_clock_argument_is_checked():
    clock, model, factory = make(1)
    with pytest.raises(ArgumentError, match="clock"):
        attach(model, event_factory=factory, clock="cupti")
    with pytest.raises(ArgumentError, match="clock: 'stamp' needs"):
        attach(model, event_factory=factory, native=FakeNative(clock), clock="stamp")   # marks, no stamps
    with pytest.raises(ArgumentError, match="native"):
        StampClock(FakeNative(clock))
    assert native_stamps_available(FakeStampNative(clock)) and not native_stamps_available(None)
    assert all("forward" not in m.__dict__ for m in model.modules()), "nothing left attached"


# ---- the extension's stamp functions without a driver ------------------------------------------

def _ext():
    try:
        from ferroattn import _native
    except Exception:
        return None
    return _native if hasattr(_native, "profiler_stamp") else None


@pytest.mark.skipif(_ext() is None or torch.cuda.is_available(), reason="needs the extension's stamps, no GPU")
def test_extension_stamp_functions_without_a_driver():
    from ferroattn.errors import NoDeviceError
    n = _ext()
    stats = n.profiler_stamp_stats()
    assert stats == {"live": 0, "dropped": stats["dropped"], "slots": 65536}
    assert n.profiler_stamps_resolve([]) == [] and n.profiler_stamps_release([1, 2]) == 0
    with pytest.raises(ArgumentError, match="stamps"):
        n.profiler_stamps_resolve([1])
    with pytest.raises(TypeError, match="stamps"):
        n.profiler_stamps_release("x")
    with pytest.raises(ArgumentError, match="iters"):
        n.profiler_globaltimer_probe(0, 0)
    with pytest.raises(ArgumentError, match="device"):
        n.profiler_stamp(0, -1)
    with pytest.raises(NoDeviceError):
        n.profiler_stamp(0, 0)
    assert n.profiler_stamp_stats()["live"] == 0


# ---- scripts/profiler_overhead.py: the stamp experiment's pure parts ----------------------------

def _script():
    spec = importlib.util.spec_from_file_location("profiler_overhead_p2", ROOT / "scripts" / "profiler_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_agreement_summary_kinds_and_tolerance():
    po = _script()
    pairs = [("LlamaForCausalLM", 0, 10.0, 10.2), ("model.embed_tokens", 1, 0.1, 0.2),
             ("model.layers.0", 1, 1.0, 1.05), ("model.layers.1", 1, 1.0, 0.98),
             ("model.layers.0.self_attn", 2, 0.4, 0.4), ("model.layers.0.mlp", 2, 0.5, 0.6),
             ("model.layers.0", 1, 1.0, 1.07), ("model.norm", 1, 0.0, 0.1)]
    s = po.agreement_summary(pairs)
    assert s["ok"] is True and s["tol"] == 0.10
    assert s["layer"]["modules"] == 2
    assert s["layer"]["max_module_median_rel_diff"] == pytest.approx(0.06), "median of 0.05 and 0.07"
    assert s["root"]["median_rel_diff"] == pytest.approx(0.02)
    assert s["attn"]["median_rel_diff"] == 0.0 and s["mlp"]["median_rel_diff"] == pytest.approx(0.2)
    assert s["other"]["modules"] == 1, "embed; norm left out (event time 0)"
    bad = po.agreement_summary(pairs + [("model.layers.1", 1, 1.0, 1.5)] * 3)
    assert bad["ok"] is False
    assert po.agreement_summary([("Root", 0, 1.0, 1.0)])["ok"] is False, "no layer: not ok"


def test_in_situ_per_mark_from_modes():
    po = _script()
    row = {"modes": {"hooks_nomark_native": {"host_ms": 10.0, "wall_ms": 11.0},
                     "hooks_marks_only": {"host_ms": 10.5, "wall_ms": 11.6},
                     "hooks_stamp_marks_only": {"host_ms": 10.3, "wall_ms": 11.2}}}
    out = po.in_situ_per_mark(row, 100)
    assert out["event_host_us"] == pytest.approx(5.0) and out["stamp_host_us"] == pytest.approx(3.0)
    assert out["event_wall_us"] == pytest.approx(6.0) and out["stamp_wall_us"] == pytest.approx(2.0)
    assert out["stamp_minus_event_host_us"] == pytest.approx(-2.0)
    assert po.in_situ_per_mark({"modes": {"hooks_marks_only": {"host_ms": 1.0, "wall_ms": 1.0}}}, 10) == {}


def test_stamp_experiment_modes_are_known_modes():
    po = _script()
    assert set(po.STAMP_EXPERIMENT_MODES) <= set(po.MODES[1:] + po.DIAGNOSTIC_MODES)
    assert {"hooks_marks_only", "hooks_stamp_marks_only", "hooks_nomark_native"} <= set(po.STAMP_EXPERIMENT_MODES)
    nm = po._NoMarkNative()
    assert nm.profiler_mark(0, 0) == 0 and nm.profiler_marks_resolve([1]) == [None]
