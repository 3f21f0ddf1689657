"""The profiler's cost budget, and the verdict of a paired measurement against it.

The budget (what ``ferroattn.profiler.profile(model)`` may add to a model's forward):

1. on every forward, no more than ``torch.profiler.profile()`` (its defaults: CPU and CUDA
   activities) adds to the same forward, both measured in one run, paired;
2. on GPU-bound forwards (:func:`is_gpu_bound`: at least :data:`GPU_BOUND_TOKENS` tokens, i.e.
   4 x 1024 and larger for the Llama-3.2-1B config), at most :data:`BUDGET` (5 %).

On a small, host-bound forward (1 x 256 tokens: ~53 hooked module calls and ~11 ms of host work)
a fixed percentage measures the host's speed more than the profiler; torch.profiler's own cost
on that forward is the reference a user compares against. While a torch profiler runs,
ferroattn's ops go through the torch dispatcher (the eager fast path is off:
:mod:`ferroattn.ops._eager`), so its cost on this model includes that: it is what a user of
torch.profiler pays on it.

Measurement (``tests/test_gpu_profiler.py``, ``scripts/profiler_overhead.py``): rounds; in each
round the plain forward, the forward under ``profile`` and the forward under
``torch.profiler.profile`` run in an order rotated by one each round (so drift and order effects
hit all three alike); each time is the mean of a few timed forwards after one untimed forward in
that mode. Per round ``r``: our cost ``ours[r] / plain[r] - 1``, torch.profiler's
``torch[r] / plain[r] - 1``, and the paired difference ``d[r] = (ours[r] - torch[r]) / plain[r]``.

Verdict (:func:`cost_verdict`): rule 1 fails only when the rounds show that ours costs more, i.e.
the distribution-free 95 % confidence interval of the median of ``d``
(:func:`ferroattn._measure.median_ci`) lies entirely above 0; rule 2 holds when the median over
rounds of ``ours[r] / plain[r]`` is at most ``1 + BUDGET``.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from .._measure import median_ci
from ..errors import ArgumentError
from ._util import flag, real

__all__ = ["BUDGET", "GPU_BOUND_TOKENS", "is_gpu_bound", "cost_verdict", "format_verdict"]

#: the cost budget on GPU-bound forwards (a fraction of the plain forward's time)
BUDGET = 0.05
#: tokens (batch x seqlen) from which a Llama-3.2-1B-config forward counts as GPU-bound
GPU_BOUND_TOKENS = 4 * 1024


def is_gpu_bound(batch: int, seqlen: int) -> bool:
    """Whether a (batch, seqlen) forward falls under the 5 % budget (rule 2): ``batch · seqlen
    >= GPU_BOUND_TOKENS``."""
    return int(batch) * int(seqlen) >= GPU_BOUND_TOKENS


def cost_verdict(plain_ms: Sequence[float], ours_ms: Sequence[float], torch_ms: Sequence[float],
                 gpu_bound: bool, level: float = 0.95) -> dict[str, Any]:
    """The budget's verdict (module docstring) on paired rounds: ``plain_ms[r]``, ``ours_ms[r]``,
    ``torch_ms[r]`` are round ``r``'s times (ms, any positive unit) of the plain forward, the
    forward under ``ferroattn.profiler.profile`` and under ``torch.profiler.profile``.

    Returns a dict: ``rounds``; ``ours_pct`` / ``torch_pct`` (median over rounds of each cost, %);
    ``diff_pct`` (median of the paired differences, % of the plain forward; < 0: ours is cheaper),
    ``diff_ci_pct`` ([low, high], %) and ``diff_ci_level`` (its coverage); ``within_torch``
    (rule 1); ``budget_pct`` (5.0 when ``gpu_bound``, else None) and ``within_budget`` (rule 2;
    None when not GPU-bound); ``ok`` (every rule that applies holds).

    Raises:
        ArgumentError: the three lists differ in length, are empty, or hold a time that is not
            a finite number > 0; ``gpu_bound`` is not a bool."""
    gpu_bound = flag("gpu_bound", gpu_bound)
    lists = []
    for name, xs in (("plain_ms", plain_ms), ("ours_ms", ours_ms), ("torch_ms", torch_ms)):
        if isinstance(xs, (str, bytes)) or not hasattr(xs, "__len__"):
            raise ArgumentError(f"{name}: expected a list of times (ms), got {type(xs).__name__}")
        lists.append([real(f"{name}[{i}]", x, 0.0, strict=True) for i, x in enumerate(list(xs))])
    plain_ms, ours_ms, torch_ms = lists
    if not (len(plain_ms) == len(ours_ms) == len(torch_ms)) or not plain_ms:
        raise ArgumentError(f"plain_ms, ours_ms, torch_ms: expected three non-empty lists of equal length, got "
                            f"{len(plain_ms)}, {len(ours_ms)} and {len(torch_ms)} values")
    if any(not (float(x) > 0) for x in (*plain_ms, *ours_ms, *torch_ms)):
        raise ArgumentError("plain_ms, ours_ms, torch_ms: expected times > 0")
    ours = [o / p - 1.0 for o, p in zip(ours_ms, plain_ms)]
    theirs = [t / p - 1.0 for t, p in zip(torch_ms, plain_ms)]
    diff = [(o - t) / p for o, t, p in zip(ours_ms, torch_ms, plain_ms)]
    lo, hi, cov = median_ci(diff, level)
    ours_med = statistics.median(ours)
    within_budget = bool(ours_med <= BUDGET) if gpu_bound else None
    within_torch = bool(lo <= 0.0)
    return {"rounds": len(diff), "ours_pct": 100.0 * ours_med, "torch_pct": 100.0 * statistics.median(theirs),
            "diff_pct": 100.0 * statistics.median(diff), "diff_ci_pct": [100.0 * lo, 100.0 * hi],
            "diff_ci_level": cov, "within_torch": within_torch,
            "budget_pct": 100.0 * BUDGET if gpu_bound else None, "within_budget": within_budget,
            "ok": within_torch and within_budget is not False}


def format_verdict(v: dict[str, Any], label: str) -> str:
    """One line for a :func:`cost_verdict` dict, e.g. ``"1x256: ferroattn.profiler +7.4 %,
    torch.profiler +31.0 % (ours - torch -23.6 % [-26.0, -21.1]): within torch.profiler's cost: MET"``."""
    lo, hi = v["diff_ci_pct"]
    rules = [f"within torch.profiler's cost: {'MET' if v['within_torch'] else 'NOT MET'}"]
    if v["budget_pct"] is not None:
        rules.append(f"<= {v['budget_pct']:g} % (GPU-bound): {'MET' if v['within_budget'] else 'NOT MET'}")
    return (f"{label}: ferroattn.profiler {v['ours_pct']:+.1f} %, torch.profiler {v['torch_pct']:+.1f} % "
            f"(ours - torch {v['diff_pct']:+.1f} % [{lo:+.1f}, {hi:+.1f}], {v['rounds']} paired rounds): "
            + "; ".join(rules))
