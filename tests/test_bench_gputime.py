"""CPU tests of the GPU-time-only timing (python/ferroattn/bench/timing.py: sleep_cycles_per_ms,
gpu_window, window_verdict, plan_window, paired_gpu_ms, time_both) on a simulated CUDA stream
(tests/_bench_fakes.py: a host clock and a GPU clock; the GPU waits for the host when nothing is
queued). A host-bound fake function (host time per call >> GPU time) must be detected as invalid
when the sleep does not cover it, and give its GPU time when it does; a GPU-bound one gives its GPU
time; ratios come from GPU time; a function whose GPU time never holds is reported invalid, never
as GPU time."""
from __future__ import annotations

import pytest

from _bench_fakes import FakeGpu
from ferroattn.bench import timing
from ferroattn.errors import ArgumentError

PEER_HOST, PEER_GPU = 1.4, 0.05      # torch's semi-structured F.linear on a small shape (ms)
OURS_HOST, OURS_GPU = 0.02, 0.3      # a GPU-bound kernel


# ---- sleep calibration ----------------------------------------------------------------------
def test_calibration_recovers_cycles_per_ms_and_is_cached():
    gpu = FakeGpu(true_cycles_per_ms=1.98e6, sleep_overhead_ms=0.05)
    cpm = timing.sleep_cycles_per_ms(gpu)
    assert cpm == pytest.approx(1.98e6, rel=1e-9)        # the fixed launch/overhead cancels in the slope
    gpu.true_cycles_per_ms = 1.0e6                          # a second call is the cached value
    assert timing.sleep_cycles_per_ms(gpu) == cpm
    other = FakeGpu(true_cycles_per_ms=1.5e6)
    assert timing.sleep_cycles_per_ms(other) == pytest.approx(1.5e6, rel=1e-9)


def test_calibration_errors():
    flat = FakeGpu(true_cycles_per_ms=float("inf"))        # sleeps of any length take the same time
    with pytest.raises(RuntimeError, match="no usable clock"):
        timing.sleep_cycles_per_ms(flat)
    with pytest.raises(ArgumentError, match="low, high: expected integers with 0 < low < high"):
        timing.sleep_cycles_per_ms(FakeGpu(), low=10, high=10)
    with pytest.raises(ArgumentError, match="reps: expected a positive integer"):
        timing.sleep_cycles_per_ms(FakeGpu(), reps=0)


# ---- one window ---------------------------------------------------------------------------
def test_gpu_bound_window_gives_gpu_time():
    gpu = FakeGpu()
    w = timing.gpu_window(gpu.fn(OURS_HOST, OURS_GPU), 5, 0.5, gpu)
    assert w.valid and w.reason is None and w.covered and w.late == 0
    assert w.call_ms == pytest.approx([OURS_GPU] * 5, abs=1e-12)
    assert w.flush_ms == pytest.approx([gpu.flush_gpu_ms] * 5, abs=1e-12)
    assert w.idle_ms == pytest.approx(0.0, abs=1e-9) and w.span_ms == pytest.approx(5 * (0.08 + OURS_GPU))
    # even a sleep far too short for the host's enqueueing: the host stays ahead, no call is late
    w = timing.gpu_window(gpu.fn(OURS_HOST, OURS_GPU), 5, 0.0, gpu)
    assert w.valid and not w.covered and w.late == 0
    assert w.call_ms == pytest.approx([OURS_GPU] * 5, abs=1e-12)


def test_host_bound_window_is_detected_and_a_covering_sleep_fixes_it():
    gpu = FakeGpu()
    peer = gpu.fn(PEER_HOST, PEER_GPU)
    w = timing.gpu_window(peer, 5, 0.5, gpu)            # 0.5 ms of sleep for ~7 ms of host time
    assert not w.valid and not w.covered and w.late >= 4
    assert "host-bound" in w.reason and "start event" in w.reason
    # what the events saw is host time, not the 0.05 ms kernel: reporting it would be wrong
    assert max(w.call_ms) > 20 * PEER_GPU
    # the timeline check alone cannot see it: the idle time is inside the calls' intervals
    assert w.idle_ms < timing.IDLE_TOL_MS_PER_GAP * 6
    w = timing.gpu_window(peer, 5, 0.2 + 1.5 * 5 * (PEER_HOST + 0.02), gpu)
    assert w.valid and w.covered and w.late == 0
    assert w.call_ms == pytest.approx([PEER_GPU] * 5, abs=1e-12)
    assert w.host_ms == pytest.approx(5 * (PEER_HOST + 0.004 + 0.004 + 3 * 0.002 + 0.001), rel=1e-9)


def test_gap_between_calls_fails_the_timeline_check():
    # no call is late (the flush keeps the GPU busy while the host enqueues the call), but a slow
    # host step after each call leaves the GPU idle between calls once the sleep has run out
    gpu = FakeGpu(query_host_ms=0.5)
    w = timing.gpu_window(gpu.fn(0.01, 0.2), 5, 0.2, gpu)
    assert w.late == 0 and not w.covered
    assert w.idle_ms > 0.5 and not w.valid and "idled" in w.reason
    assert w.call_ms == pytest.approx([0.2] * 5, abs=1e-12)   # (the intervals themselves are clean)


def test_window_verdict_rules():
    assert timing.window_verdict(True, 3, 5, 10.0, 10.0) == (True, None)     # covered: nothing can be late
    ok, why = timing.window_verdict(False, 1, 5, 0.0, 2.0)
    assert not ok and "1 of 5 calls" in why
    tol = timing.IDLE_TOL_MS_PER_GAP * 6 + timing.IDLE_TOL_FRAC * 2.0
    assert timing.window_verdict(False, 0, 5, tol * 0.99, 2.0) == (True, None)
    ok, why = timing.window_verdict(False, 0, 5, tol * 1.01, 2.0)
    assert not ok and "idled" in why


def test_gpu_window_rejects_bad_arguments():
    gpu = FakeGpu()
    with pytest.raises(ArgumentError, match="n_calls: expected a positive integer, got 0"):
        timing.gpu_window(lambda: None, 0, 1.0, gpu)
    with pytest.raises(ArgumentError, match="sleep_ms: expected a non-negative number"):
        timing.gpu_window(lambda: None, 1, -1.0, gpu)


def test_plan_window():
    # GPU-bound: enough calls for the window, capped; the sleep covers margin x host time
    assert timing.plan_window(0.02, 0.1, 1.5, 1.5, 10, 50.0, 0.2) == (10, pytest.approx(0.2 + 1.5 * 0.02 * 10))
    assert timing.plan_window(0.02, 12.0, 1.5, 1.5, 10, 50.0, 0.2)[0] == 1
    # host-heavy: few calls so that the sleep stays short; above the cap: None
    n, sleep = timing.plan_window(1.4, 0.1, 1.5, 1.5, 10, 50.0, 0.2)
    assert n == 3 and sleep == pytest.approx(0.2 + 1.5 * 1.4 * 3)
    assert timing.plan_window(1.4, 0.1, 1.5, 1.5, 10, 4.0, 0.2) == (1, pytest.approx(0.2 + 2.1))
    assert timing.plan_window(5.0, 0.1, 1.5, 1.5, 10, 5.0, 0.2) is None


# ---- paired rounds ------------------------------------------------------------------------
def test_paired_gpu_ms_gives_gpu_times_and_ratio():
    gpu = FakeGpu()
    fns = {"peer": gpu.fn(PEER_HOST, PEER_GPU), "ours": gpu.fn(OURS_HOST, OURS_GPU)}
    res = timing.paired_gpu_ms(fns, rounds=3, rep_ms=30.0, device=gpu)
    assert not res.invalid and not res.errors
    assert res.sequence == ["peer", "ours", "ours", "peer"] * 3
    assert res.ms["peer"] == pytest.approx([PEER_GPU] * 3, abs=1e-9)
    assert res.ms["ours"] == pytest.approx([OURS_GPU] * 3, abs=1e-9)
    r = timing.paired_ratio(res.ms["peer"], res.ms["ours"])
    assert r["ratio"] == pytest.approx(PEER_GPU / OURS_GPU, rel=1e-6)
    st_peer, st_ours = res.stats["peer"], res.stats["ours"]
    # host per call: the function, its launch, the flush launch, three event records and one query
    host = PEER_HOST + 2 * gpu.launch_host_ms + 3 * gpu.event_host_ms + gpu.query_host_ms
    assert st_peer["host_ms_per_call"] == pytest.approx(host, rel=1e-9)
    assert max(st_peer["calls_per_window"][1:]) <= 5 and st_ours["calls_per_window"][-1] == 10
    assert min(st_peer["sleep_ms"][1:]) > 5 * max(st_ours["sleep_ms"])    # [0]: the one-call probe window
    assert st_peer["covered"] == len(st_peer["sleep_ms"]) and st_peer["retries"] == 0
    assert res.cycles_per_ms == pytest.approx(gpu.true_cycles_per_ms)
    s = timing.gpu_stats_summary(st_peer)
    assert s["windows"] == 7 and s["sleep_ms_max"] == max(st_peer["sleep_ms"]) and s["retries"] == 0


def test_est_ms_sizes_the_windows_without_a_probe():
    gpu = FakeGpu()
    res = timing.paired_gpu_ms({"ours": gpu.fn(OURS_HOST, OURS_GPU)}, rounds=2, rep_ms=4.0,
                               est_ms={"ours": 0.5}, device=gpu)
    assert res.stats["ours"]["calls_per_window"] == [2, 2, 2, 2]       # 1 ms per window / 0.5 ms


def test_a_faster_clock_than_calibrated_is_retried_until_valid():
    gpu = FakeGpu()
    timing.sleep_cycles_per_ms(gpu)
    gpu.true_cycles_per_ms *= 4          # the GPU clock boosts after calibration: sleeps last 1/4
    fns = {"peer": gpu.fn(PEER_HOST, PEER_GPU), "ours": gpu.fn(OURS_HOST, OURS_GPU)}
    res = timing.paired_gpu_ms(fns, rounds=2, rep_ms=20.0, device=gpu)
    assert not res.invalid
    assert res.stats["peer"]["retries"] >= 1
    assert res.ms["peer"] == pytest.approx([PEER_GPU] * 2, abs=1e-9)


def test_gpu_time_that_never_holds_is_reported_invalid():
    gpu = FakeGpu()

    def syncing():                       # a function that waits for the GPU inside: never GPU-only
        gpu.kernel(0.05, 0.05)
        gpu.synchronize()
        gpu.kernel(0.05, 0.05)

    fns = {"peer": gpu.fn(5.0, PEER_GPU), "ours": gpu.fn(OURS_HOST, OURS_GPU)}
    res = timing.paired_gpu_ms(fns, rounds=2, rep_ms=10.0, device=gpu, max_sleep_ms=5.0)
    assert set(res.ms) == {"ours"} and set(res.windows) == {"ours"}
    why = res.invalid["peer"]
    assert "host time per call 5.0" in why and "needs a sleep above the cap of 5 ms" in why
    assert "peer" not in res.sequence and res.sequence.count("ours") == 4
    assert res.ms["ours"] == pytest.approx([OURS_GPU] * 2, abs=1e-9)
    # waiting for the GPU inside the call: no sleep helps (the wait eats it); retried, then invalid
    res = timing.paired_gpu_ms({"sync": syncing, "ours": gpu.fn(OURS_HOST, OURS_GPU)}, rounds=2, rep_ms=10.0,
                               device=gpu, retries=2)
    assert set(res.ms) == {"ours"} and "sync" not in res.sequence and res.stats["sync"]["retries"] >= 1
    why = res.invalid["sync"]
    assert "no valid GPU-time window in 3 attempts: host-bound" in why or "needs a sleep above the cap" in why


def test_a_raising_function_is_dropped():
    gpu = FakeGpu()

    def boom():
        raise RuntimeError("kaput")
    res = timing.paired_gpu_ms({"boom": boom, "ours": gpu.fn(OURS_HOST, OURS_GPU)}, rounds=1, device=gpu)
    assert isinstance(res.errors["boom"], RuntimeError) and set(res.ms) == {"ours"}


def test_linear_drift_cancels_in_the_gpu_time_ratio():
    gpu = FakeGpu()
    timing.sleep_cycles_per_ms(gpu)
    gpu.slow = lambda t: 1.0 + 1e-2 * t            # every GPU duration stretches 1 % per ms
    fns = {"a": gpu.fn(0.02, 0.5), "b": gpu.fn(0.02, 0.5 / 0.97)}
    res = timing.paired_gpu_ms(fns, rounds=5, rep_ms=10.0, device=gpu)
    r = timing.paired_ratio(res.ms["b"], res.ms["a"])
    assert max(res.ms["a"]) / min(res.ms["a"]) > 1.1          # the clock did drift
    assert r["ratio"] == pytest.approx(1 / 0.97, rel=3e-3)
    # the same windows one after the other (all of a, then all of b) are biased by the drift
    gpu2 = FakeGpu()
    timing.sleep_cycles_per_ms(gpu2)
    gpu2.slow = gpu.slow
    a = timing.paired_gpu_ms({"a": gpu2.fn(0.02, 0.5)}, rounds=5, rep_ms=10.0, device=gpu2)
    b = timing.paired_gpu_ms({"b": gpu2.fn(0.02, 0.5 / 0.97)}, rounds=5, rep_ms=10.0, device=gpu2)
    assert abs(timing.paired_ratio(b.ms["b"], a.ms["a"])["ratio"] - 1 / 0.97) > 0.03


def test_contexts_wrap_gpu_windows():
    gpu = FakeGpu()
    events = []

    class Ctx:
        def __enter__(self):
            events.append("in")

        def __exit__(self, *exc):
            events.append("out")
    inside = []
    res = timing.paired_gpu_ms({"x": lambda: (inside.append(events[-1]), gpu.kernel(0.01, 0.1))},
                               rounds=2, device=gpu, contexts={"x": Ctx}, est_ms={"x": 0.1})
    assert set(inside) == {"in"} and events.count("in") == 1 + 4 and events[-1] == "out"   # probe + 4 windows
    assert res.ms["x"] == pytest.approx([0.1, 0.1], abs=1e-9)
    with pytest.raises(ArgumentError, match="contexts: expected names among fns"):
        timing.paired_gpu_ms({"x": lambda: None}, device=gpu, contexts={"y": Ctx})


@pytest.mark.parametrize("kwargs,match", [({"rounds": 0}, "rounds: expected a positive integer"),
                                          ({"rep_ms": 0.0}, "rep_ms: expected a positive number"),
                                          ({"max_sleep_ms": -1.0}, "max_sleep_ms: expected a positive number"),
                                          ({"margin": 0}, "margin: expected a positive number"),
                                          ({"min_sleep_ms": 60.0}, "min_sleep_ms: expected a number in"),
                                          ({"retries": -1}, "retries: expected a non-negative integer"),
                                          ({"max_calls": 0}, "max_calls: expected a positive integer")])
def test_paired_gpu_ms_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        timing.paired_gpu_ms({"a": lambda: None}, device=FakeGpu(), **kwargs)
    with pytest.raises(ArgumentError, match="fns: expected at least one function"):
        timing.paired_gpu_ms({}, device=FakeGpu())


# ---- both passes --------------------------------------------------------------------------
def _call_bench(true_call_ms):
    """A fake ``timing.bench_gpu`` (the per-call pass): the function's tag -> fixed per-call ms."""
    def bench(fn, rep_ms=100.0, warmup_ms=25.0):
        return true_call_ms[fn.tag]
    return bench


def _tagged(gpu, tag, host, g):
    f = gpu.fn(host, g)
    f.tag = tag
    return f


def test_time_both_modes(monkeypatch):
    gpu = FakeGpu()
    monkeypatch.setattr(timing, "bench_gpu", _call_bench({"peer": PEER_HOST, "ours": OURS_GPU + 0.01}))
    fns = {"peer": _tagged(gpu, "peer", PEER_HOST, PEER_GPU), "ours": _tagged(gpu, "ours", OURS_HOST, OURS_GPU)}
    two = timing.time_both(fns, "both", 3, 30.0, 7.5, 20.0, device=gpu)
    assert two.results["peer"]["call_ms"] == pytest.approx(PEER_HOST)         # host-inclusive
    assert two.results["peer"]["gpu_ms"] == pytest.approx(PEER_GPU, abs=1e-9)  # GPU time only
    assert two.results["peer"]["gpu_error"] is None and two.results["peer"]["gpu_stats"]["windows"] == 6
    call, g = two.ratios("peer", "ours")
    assert call["ratio"] == pytest.approx(PEER_HOST / (OURS_GPU + 0.01))
    assert g["ratio"] == pytest.approx(PEER_GPU / OURS_GPU, rel=1e-6)
    only_gpu = timing.time_both(fns, "gpu", 2, 30.0, 7.5, 20.0, device=gpu)
    assert only_gpu.call is None and only_gpu.results["ours"]["ms"] is None
    assert only_gpu.ratios("peer", "ours")[0] is None
    only_call = timing.time_both(fns, "call", 2, 30.0, 7.5, 20.0, device=gpu)
    assert only_call.gpu is None and "gpu_ms" not in only_call.results["ours"]
    with pytest.raises(ArgumentError, match="mode: expected one of both, gpu, call, got 'fast'"):
        timing.time_both(fns, "fast", 2, 30.0, 7.5, 20.0, device=gpu)


def test_pass_names_and_modes():
    assert [n.split(":")[0] for n in timing.pass_names("both", 5)] == ["GPU time only", "per call (host-inclusive)"]
    assert len(timing.pass_names("gpu", 5)) == 1 and "median of 5 paired rounds" in timing.pass_names("gpu", 5)[0]
    assert timing.check_timing_mode("call") == "call"
    with pytest.raises(ArgumentError, match="timing: expected one of"):
        timing.check_timing_mode("cpu")


def test_a_failing_gpu_pass_leaves_the_per_call_results(monkeypatch):
    flat = FakeGpu(true_cycles_per_ms=float("inf"))         # calibration fails: no usable clock
    monkeypatch.setattr(timing, "bench_gpu", _call_bench({"ours": 0.5}))
    two = timing.time_both({"ours": _tagged(flat, "ours", OURS_HOST, OURS_GPU)}, "both", 2, 10.0, 2.0, 10.0,
                           device=flat)
    r = two.results["ours"]
    assert r["call_ms"] == pytest.approx(0.5) and r["gpu_ms"] is None
    assert r["gpu_error"].startswith("GPU-time pass failed: RuntimeError: sleep calibration")
    assert two.ratios("ours", "ours")[1] is None and not two.errors
