"""CPU tests of the paired timing in python/ferroattn/bench/timing.py (paired_ms, paired_ratio,
median_ci, round_order, check_rounds, method_name) with a fake ``bench_gpu`` whose clock drifts:
the paired ratio must recover the true ratio where timing one function after the other does not."""
from __future__ import annotations

import pytest

from ferroattn.bench import timing
from ferroattn.errors import ArgumentError


class DriftingGpu:
    """A fake ``timing.bench_gpu``: a window of ``fn`` lasts ``rep_ms + warmup_ms + 5 * true``
    ms of simulated time (triton's 5-call estimate), and returns the true time of the function
    that ``fn`` names, scaled by ``slow(t)`` at the window's centre ``t`` (ms)."""

    def __init__(self, true_ms: dict[str, float], slow, fail: dict[str, int] | None = None):
        self.true_ms, self.slow, self.fail = true_ms, slow, dict(fail or {})
        self.t = 0.0
        self.log: list[tuple[str, float, float]] = []   # (name, rep_ms, warmup_ms)

    def fn(self, name: str):
        return lambda: name

    def __call__(self, fn, rep_ms=100.0, warmup_ms=25.0):
        name = fn()
        self.log.append((name, rep_ms, warmup_ms))
        if name in self.fail:
            self.fail[name] -= 1
            if self.fail[name] < 0:
                raise RuntimeError(f"{name} broke")
        dur = rep_ms + warmup_ms + 5 * self.true_ms[name]
        centre = self.t + dur / 2
        self.t += dur
        return self.true_ms[name] * self.slow(centre)


TRUE = {"peer": 1.0, "ours": 1.0 / 0.97, "other": 2.0}   # ours at 0.97x the peer's speed


def _linear(t):
    return 1.0 + 2e-3 * t          # the clock slows down 0.2 % per ms: +25 % over a 125 ms window


def test_round_order_forward_then_reverse():
    assert timing.round_order(["a", "b"]) == ["a", "b", "b", "a"]
    assert timing.round_order(["p", "x", "y"]) == ["p", "x", "y", "y", "x", "p"]


def test_paired_ms_sequence_windows_and_budget(monkeypatch):
    gpu = DriftingGpu(TRUE, lambda t: 1.0)
    monkeypatch.setattr(timing, "bench_gpu", gpu)
    res = timing.paired_ms({n: gpu.fn(n) for n in TRUE}, rounds=3, rep_ms=7.0, warmup_ms=1.5)
    assert res.sequence == ["peer", "ours", "other", "other", "ours", "peer"] * 3
    assert [(r, w) for _, r, w in gpu.log] == [(7.0, 1.5)] * 18
    assert set(res.ms) == set(TRUE) and not res.errors
    for name, true in TRUE.items():
        assert res.ms[name] == pytest.approx([true] * 3)
        assert res.windows[name] == [pytest.approx((true, true))] * 3


def test_linear_drift_paired_ratio_exact_sequential_biased(monkeypatch):
    gpu = DriftingGpu(TRUE, _linear)
    monkeypatch.setattr(timing, "bench_gpu", gpu)
    res = timing.paired_ms({n: gpu.fn(n) for n in TRUE}, rounds=5, rep_ms=10.0, warmup_ms=2.5)
    r = timing.paired_ratio(res.ms["peer"], res.ms["ours"])
    # every round's ratio is the true one: the two windows of each function centre on the round's middle
    assert r["ratio"] == pytest.approx(0.97, rel=1e-12)
    assert r["ratio_rounds"] == pytest.approx([0.97] * 5, rel=1e-12)
    assert timing.paired_ratio(res.ms["peer"], res.ms["other"])["ratio"] == pytest.approx(0.5, rel=1e-12)
    # the raw times did drift (so the test is not trivially drift-free)
    assert max(res.ms["peer"]) / min(res.ms["peer"]) > 1.5
    # the old method: one 100 ms window per function, one after the other
    seq = DriftingGpu(TRUE, _linear)
    peer_ms, ours_ms = seq(seq.fn("peer"), 100.0, 25.0), seq(seq.fn("ours"), 100.0, 25.0)
    assert abs(peer_ms / ours_ms - 0.97) > 0.15


def test_a_jump_in_one_round_does_not_move_the_median(monkeypatch):
    gpu = DriftingGpu(TRUE, lambda t: 1.0)
    monkeypatch.setattr(timing, "bench_gpu", gpu)
    # a clock step that lands between the peer's and ours' forward windows of round 2 only
    round_ms = 2 * sum(10.0 + 2.5 + 5 * TRUE[n] for n in TRUE)
    step_at = 2 * round_ms + (10.0 + 2.5 + 5 * TRUE["peer"])
    gpu.slow = lambda t: 1.3 if step_at <= t < step_at + 30.0 else 1.0
    res = timing.paired_ms({n: gpu.fn(n) for n in TRUE}, rounds=5, rep_ms=10.0, warmup_ms=2.5)
    r = timing.paired_ratio(res.ms["peer"], res.ms["ours"])
    assert r["ratio"] == pytest.approx(0.97, rel=1e-12)
    assert r["ratio_min"] < 0.9 and r["ratio_max"] == pytest.approx(0.97)
    assert r["ratio_ci"][0] == r["ratio_min"] and r["ratio_ci_level"] == pytest.approx(1 - 2 / 32)
    bad = [i for i, x in enumerate(r["ratio_rounds"]) if abs(x - 0.97) > 1e-9]
    assert bad == [2]


def test_a_failing_function_is_dropped_the_others_go_on(monkeypatch):
    gpu = DriftingGpu(TRUE, lambda t: 1.0, fail={"ours": 3})   # raises on its 4th window (round 1, reverse)
    monkeypatch.setattr(timing, "bench_gpu", gpu)
    res = timing.paired_ms({n: gpu.fn(n) for n in TRUE}, rounds=3)
    assert set(res.ms) == {"peer", "other"} and set(res.windows) == {"peer", "other"}
    assert isinstance(res.errors["ours"], RuntimeError) and "ours broke" in str(res.errors["ours"])
    assert res.sequence.count("ours") == 3 and res.sequence.count("peer") == 6
    assert res.sequence[6:12] == ["peer", "ours", "other", "other", "peer", "peer"]   # round 1 without ours' 2nd


def test_contexts_wrap_each_window_of_their_function(monkeypatch):
    gpu = DriftingGpu(TRUE, lambda t: 1.0)
    monkeypatch.setattr(timing, "bench_gpu", gpu)
    events = []

    class Ctx:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    seen = []
    fns = {"peer": gpu.fn("peer"), "ours": lambda: (seen.append(events[-1]), "ours")[1]}
    timing.paired_ms(fns, rounds=2, contexts={"ours": Ctx})
    assert events == ["enter", "exit"] * 4 and seen == ["enter"] * 4
    with pytest.raises(ArgumentError, match="contexts: expected names among fns"):
        timing.paired_ms(fns, rounds=1, contexts={"nope": Ctx})


@pytest.mark.parametrize("kwargs,match", [({"rounds": 0}, "rounds: expected a positive integer, got 0"),
                                          ({"rounds": 2.0}, "rounds: expected a positive integer, got 2.0"),
                                          ({"rounds": True}, "rounds: expected a positive integer, got True"),
                                          ({"rep_ms": 0.0}, "rep_ms: expected a positive number"),
                                          ({"warmup_ms": -1.0}, "warmup_ms: expected a non-negative number")])
def test_paired_ms_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        timing.paired_ms({"a": lambda: None}, **kwargs)
    with pytest.raises(ValueError):      # ArgumentError is a ValueError
        timing.paired_ms({"a": lambda: None}, **kwargs)


def test_paired_ms_needs_a_function():
    with pytest.raises(ArgumentError, match="fns: expected at least one function"):
        timing.paired_ms({})


def test_median_ci_order_statistics():
    assert timing.median_ci([5, 1, 3, 2, 4]) == (1.0, 5.0, pytest.approx(0.9375))
    lo, hi, cov = timing.median_ci(list(range(9)))            # k = 2: 1 - 2 * (1 + 9) / 512
    assert (lo, hi) == (1.0, 7.0) and cov == pytest.approx(1 - 20 / 512) and cov >= 0.95
    lo, hi, cov = timing.median_ci(list(range(20)))
    assert cov >= 0.95 and (lo, hi) == (5.0, 14.0)             # k = 6 for n = 20
    assert timing.median_ci([2.0]) == (2.0, 2.0, 0.0)
    with pytest.raises(ArgumentError, match="xs: expected at least one value"):
        timing.median_ci([])
    with pytest.raises(ArgumentError, match="level: expected a number in"):
        timing.median_ci([1.0], level=1.0)


def test_paired_ratio_math_and_errors():
    r = timing.paired_ratio([2.0, 2.2, 1.8, 2.0], [1.0, 1.0, 1.0, 2.0])
    assert r["ratio_rounds"] == pytest.approx([2.0, 2.2, 1.8, 1.0])
    assert r["ratio"] == pytest.approx(1.9)                    # median of the ratios, not ratio of medians
    assert (r["ratio_min"], r["ratio_max"]) == (pytest.approx(1.0), pytest.approx(2.2))
    with pytest.raises(ArgumentError, match="equal length"):
        timing.paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ArgumentError, match="times > 0"):
        timing.paired_ratio([1.0], [0.0])


def test_method_name_says_paired_rounds():
    assert "median of 7 paired rounds" in timing.method_name(7)
    assert "paired" not in timing.method_name() and "L2 cleared" in timing.method_name()
    assert timing.check_rounds(3) == 3
    with pytest.raises(ArgumentError, match="--rounds: expected a positive integer, got -1"):
        timing.check_rounds(-1, "--rounds")
