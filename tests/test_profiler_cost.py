"""ferroattn.profiler.cost on CPU: the budget's verdict on synthetic paired rounds (ours against
torch.profiler's own cost on the same forward; <= 5 % on GPU-bound forwards)."""
from __future__ import annotations

import pytest

from ferroattn.errors import ArgumentError
from ferroattn.profiler import cost


def _rounds(ours_pct, torch_pct, n=41, noise=0.02):
    """Paired rounds whose plain time drifts (+-10 %) and whose costs carry a round-to-round
    spread of ``noise`` (alternating sign): the pairing must cancel the drift."""
    plain = [10.0 * (1 + 0.1 * ((r % 7) - 3) / 3) for r in range(n)]
    jit = [noise * (1 if r % 2 else -1) * (r % 5) / 4 for r in range(n)]
    ours = [p * (1 + ours_pct / 100 + j) for p, j in zip(plain, jit)]
    theirs = [p * (1 + torch_pct / 100 - j / 2) for p, j in zip(plain, jit)]
    return plain, ours, theirs


def test_ours_cheaper_than_torch_profiler_is_met():
    v = cost.cost_verdict(*_rounds(7.4, 30.0), gpu_bound=False)
    assert v["ok"] and v["within_torch"] and v["within_budget"] is None and v["budget_pct"] is None
    assert v["ours_pct"] == pytest.approx(7.4, abs=1.0) and v["torch_pct"] == pytest.approx(30.0, abs=1.0)
    assert v["diff_pct"] < 0 and v["diff_ci_pct"][1] < 0 and v["rounds"] == 41 and v["diff_ci_level"] >= 0.95


def test_ours_clearly_dearer_than_torch_profiler_fails():
    v = cost.cost_verdict(*_rounds(12.0, 6.0), gpu_bound=False)
    assert not v["within_torch"] and not v["ok"] and v["diff_ci_pct"][0] > 0


def test_a_tie_within_the_noise_is_met():
    """Equal costs: the interval of the paired difference holds 0, so the rule holds."""
    v = cost.cost_verdict(*_rounds(5.0, 5.0, noise=0.03), gpu_bound=False)
    assert v["diff_ci_pct"][0] <= 0 <= v["diff_ci_pct"][1] and v["within_torch"] and v["ok"]


@pytest.mark.parametrize("ours, met", [(1.5, True), (4.9, True), (6.0, False)])
def test_gpu_bound_forwards_keep_the_5_percent_budget(ours, met):
    v = cost.cost_verdict(*_rounds(ours, 20.0, noise=0.002), gpu_bound=True)
    assert v["budget_pct"] == 5.0 and v["within_budget"] is met and v["within_torch"] and v["ok"] is met


def test_gpu_bound_threshold():
    assert not cost.is_gpu_bound(1, 256) and not cost.is_gpu_bound(1, 2048)
    assert cost.is_gpu_bound(4, 1024) and cost.is_gpu_bound(4, 2048) and cost.is_gpu_bound(1, 8192)


def test_bad_rounds_are_argument_errors():
    with pytest.raises(ArgumentError, match="equal length"):
        cost.cost_verdict([1.0, 1.0], [1.0], [1.0, 1.0], gpu_bound=False)
    with pytest.raises(ArgumentError, match="equal length"):
        cost.cost_verdict([], [], [], gpu_bound=False)
    with pytest.raises(ArgumentError, match="> 0"):
        cost.cost_verdict([1.0], [0.0], [1.0], gpu_bound=False)
    with pytest.raises(ArgumentError, match=r"^ours_ms\[0\]: expected a finite real number > 0"):
        cost.cost_verdict([1.0], [float("inf")], [1.0], gpu_bound=False)
    with pytest.raises(ArgumentError, match=r"^plain_ms\[0\]: expected a finite real number"):
        cost.cost_verdict(["1"], ["1"], ["1"], gpu_bound=False)
    with pytest.raises(ArgumentError, match="^gpu_bound: expected a bool"):
        cost.cost_verdict([1.0], [1.0], [1.0], gpu_bound="no")
    with pytest.raises(ArgumentError, match="^plain_ms: expected a list of times"):
        cost.cost_verdict((x for x in [1.0]), [1.0], [1.0], gpu_bound=False)
    import numpy as np
    assert cost.cost_verdict(np.ones(3), np.ones(3), np.ones(3), True)["rounds"] == 3


def test_format_verdict_names_both_costs_and_each_rule():
    line = cost.format_verdict(cost.cost_verdict(*_rounds(1.5, 20.0, noise=0.002), gpu_bound=True), "4x1024")
    assert line.startswith("4x1024: ferroattn.profiler +1.5 %, torch.profiler +20.0 %")
    assert "within torch.profiler's cost: MET" in line and "<= 5 % (GPU-bound): MET" in line
    line = cost.format_verdict(cost.cost_verdict(*_rounds(12.0, 6.0), gpu_bound=False), "1x256")
    assert "within torch.profiler's cost: NOT MET" in line and "GPU-bound" not in line


# ---- scripts/profiler_overhead.py: both profilers' costs and the verdict per shape ---------------

def test_overhead_script_measures_torch_profiler_and_gives_the_verdict():
    """The script's round-robin measure() with fake modes (no GPU): a host clock advanced by each
    mode's cost; profile +5 %, torch_profiler +20 %: both costs reported, the budget met, and the
    5 % rule checked only on a GPU-bound shape."""
    import contextlib
    import importlib.util
    import pathlib
    import types

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "profiler_overhead.py"
    spec = importlib.util.spec_from_file_location("profiler_overhead_cost", path)
    po = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(po)
    assert "torch_profiler" in po.MODES
    po.MODES = ("off", "profile", "torch_profiler")
    clock, current = [0.0], ["off"]
    po.time = types.SimpleNamespace(perf_counter=lambda: clock[0])

    class FakeModes:
        torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))

        @contextlib.contextmanager
        def on(self, mode):
            current[0] = mode
            yield (lambda: None)
            current[0] = "off"

    def fwd():
        clock[0] += 0.010 * {"off": 1.0, "profile": 1.05, "torch_profiler": 1.20}[current[0]]

    for gpu_bound, budget in ((False, None), (True, True)):
        r = po.measure(FakeModes(), fwd, rounds=9, per_round=2, deadline=1e9, gpu_bound=gpu_bound)
        v = r["cost_rule"]
        assert v["rounds"] == 9 and v["ours_pct"] == pytest.approx(5.0) and v["torch_pct"] == pytest.approx(20.0)
        assert v["within_torch"] and v["within_budget"] is budget and v["ok"]
        assert r["modes"]["torch_profiler"]["wall"]["pct"] == pytest.approx(20.0)


def test_overhead_script_in_situ_mark_cost_from_its_modes():
    """(hooks_marks_only - hooks_nomark_native) / marks per forward, host and wall; nothing
    without both modes. The stand-in _native of hooks_nomark_native makes no mark."""
    from _scripts import load_script

    po = load_script("profiler_overhead")
    assert "hooks_nomark_native" in po.DIAGNOSTIC_MODES and "hooks_marks_only" in po.DIAGNOSTIC_MODES
    row = {"modes": {"hooks_nomark_native": {"host_ms": 10.0, "wall_ms": 11.0},
                     "hooks_marks_only": {"host_ms": 10.5, "wall_ms": 11.6}}}
    out = po.in_situ_per_mark(row, 100)
    assert out == {"event_host_us": pytest.approx(5.0), "event_wall_us": pytest.approx(6.0)}
    assert po.in_situ_per_mark({"modes": {"hooks_marks_only": {"host_ms": 1.0, "wall_ms": 1.0}}}, 10) == {}
    nm = po._NoMarkNative()
    assert nm.profiler_mark(0, 0) == 0 and nm.profiler_marks_resolve([1]) == [None]
