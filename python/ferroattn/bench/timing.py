"""How GPU work is timed.

- :func:`bench_gpu` returns the median milliseconds of one call. With triton installed it is
  ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``, which clears the L2
  cache (by writing a 256 MB buffer) before every timed call and times each call with CUDA
  events. Without triton the same is done here: a fixed number of warm-up calls, then CUDA
  events around each call, each preceded by zeroing a buffer larger than L2.
- :class:`Rotating` cycles over several copies of the inputs so that consecutive calls read
  different memory (together with the L2 flush, nobody is flattered by a warm L2).
- :func:`event_ms` times one call between two CUDA events on the current stream (no L2 flush,
  no repeats: for a model forward or a replayed graph, where the caller takes the median).
- :func:`paired_ms` times several functions against each other, interleaved, so that a clock that
  drifts during the measurement (the power-capped H200: one torch shape moved 670 -> 790 TFLOP/s
  within a run) moves every function alike: ``R`` rounds; in each round every function gets one
  :func:`bench_gpu` window in a forward pass and one in a reverse pass (A B C C B A), and its
  time for the round is the mean of the two windows. The centres of a function's two windows are
  symmetric about the middle of the round whatever the windows' lengths, so a drift linear in time
  over a round cancels exactly in the ratio of two functions' round times. :func:`paired_ratio`
  then takes the median over rounds of the per-round ratios (a paired ratio: a jump in one round
  moves one of R values) with a distribution-free confidence interval of that median.
- :func:`host_us_per_call` measures host-side cost: the wall time of a loop of N calls issued
  without synchronising inside the loop, divided by N. It reflects the host cost when the GPU
  work per call is shorter than the host work (checked by :func:`gpu_us_per_call`).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Sequence

from ferroattn.errors import ArgumentError

L2_FLUSH_BYTES = 256 * 1024 * 1024


def have_triton() -> bool:
    try:
        import triton.testing  # noqa: F401
        return True
    except Exception:
        return False


#: rounds of :func:`paired_ms` the GEMM benchmarks use unless told otherwise (``--rounds``)
DEFAULT_ROUNDS = 5


def method_name(rounds: int | None = None) -> str:
    """How :func:`bench_gpu` times one call; with ``rounds``, how :func:`paired_ms` and
    :func:`paired_ratio` combine ``rounds`` paired rounds of it."""
    base = "triton.testing.do_bench median (L2 cleared before each call)" if have_triton() else \
        "CUDA events median (L2 cleared before each call)"
    if rounds is None:
        return base
    return (f"median of {rounds} paired rounds: per round each function is timed in a forward and a reverse "
            f"pass (A B .. B A), one window each, {base}; time per round = mean of its two windows; "
            f"ms = median over rounds; ratio = median over rounds of the per-round ratio")


def bench_gpu(fn: Callable[[], Any], rep_ms: float = 100.0, warmup_ms: float = 25.0) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (see module docstring)."""
    if have_triton():
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _bench_events(fn, rep_ms, warmup_ms)


def _bench_events(fn: Callable[[], Any], rep_ms: float, warmup_ms: float) -> float:
    import torch
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    # estimate the time of one call from 5 calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    n_warm = max(1, int(warmup_ms / est))
    n_rep = max(1, int(rep_ms / est))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


def check_rounds(rounds: Any, name: str = "rounds") -> int:
    """``rounds`` as an int >= 1; ArgumentError (a ValueError) naming ``name`` otherwise."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ArgumentError(f"{name}: expected a positive integer, got {rounds!r}")
    return rounds


def round_order(names: Sequence[str]) -> list[str]:
    """The order of the windows of one round of :func:`paired_ms`: ``names`` forward, then
    reversed (``["a", "b"]`` -> ``["a", "b", "b", "a"]``)."""
    return list(names) + list(reversed(names))


@dataclass
class Paired:
    """What :func:`paired_ms` measured.

    - ``ms[name]``: per round, milliseconds of one call of that function (float; the mean of its
      forward- and reverse-pass window medians); only for functions that ran every window.
    - ``windows[name]``: per round, ``(forward, reverse)`` window medians in ms.
    - ``errors[name]``: the exception of a function that raised (it is dropped from the remaining
      windows; its ``ms`` / ``windows`` entries are absent).
    - ``sequence``: the names in the order their windows ran (``rounds`` x :func:`round_order`,
      less the windows of dropped functions).
    """
    ms: dict[str, list[float]] = field(default_factory=dict)
    windows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    sequence: list[str] = field(default_factory=list)


def paired_ms(fns: Mapping[str, Callable[[], Any]], rounds: int = DEFAULT_ROUNDS, rep_ms: float = 10.0,
              warmup_ms: float = 2.5,
              contexts: Mapping[str, Callable[[], ContextManager[Any]]] | None = None) -> Paired:
    """Time the functions ``fns`` (name -> zero-argument callable) against each other in
    ``rounds`` interleaved rounds (see the module docstring): every window is one
    ``bench_gpu(fn, rep_ms, warmup_ms)`` call (``rep_ms`` / ``warmup_ms`` are per window, ms),
    so a function costs about ``2 * rounds * (rep_ms + warmup_ms)`` ms of GPU time plus triton's
    5-call estimate per window. ``contexts[name]()``, when given, is entered around each of that
    function's windows (e.g. environment variables that select a kernel form).

    A function that raises is recorded in ``errors`` and not timed again; the others go on.
    Raises ArgumentError for an empty ``fns``, ``rounds`` not a positive int, a non-positive
    ``rep_ms`` or a negative ``warmup_ms``, or a ``contexts`` key that is not in ``fns``.
    """
    check_rounds(rounds)
    if not fns:
        raise ArgumentError("fns: expected at least one function to time, got none")
    if not (isinstance(rep_ms, (int, float)) and 0 < rep_ms < math.inf):
        raise ArgumentError(f"rep_ms: expected a positive number of milliseconds, got {rep_ms!r}")
    if not (isinstance(warmup_ms, (int, float)) and 0 <= warmup_ms < math.inf):
        raise ArgumentError(f"warmup_ms: expected a non-negative number of milliseconds, got {warmup_ms!r}")
    contexts = dict(contexts or {})
    unknown = sorted(set(contexts) - set(fns))
    if unknown:
        raise ArgumentError(f"contexts: expected names among fns ({', '.join(fns)}), got {', '.join(unknown)}")
    res = Paired()
    win: dict[str, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for per_round in win.values():
            per_round.append([])
        for name in round_order(list(fns)):
            if name not in win:
                continue
            try:
                with contexts.get(name, contextlib.nullcontext)():
                    ms = float(bench_gpu(fns[name], rep_ms, warmup_ms))
            except Exception as e:  # noqa: BLE001  (recorded; the other functions go on)
                res.errors[name] = e
                del win[name]
                continue
            res.sequence.append(name)
            win[name][-1].append(ms)
    for name, per_round in win.items():
        res.windows[name] = [(w[0], w[1]) for w in per_round]
        res.ms[name] = [(w[0] + w[1]) / 2.0 for w in per_round]
    return res


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median of ``xs`` from order statistics:
    ``(low, high, coverage)`` = ``(x_(k), x_(n+1-k), 1 - 2·P[Binomial(n, 1/2) < k])`` (sorted
    values, 1-based) for the largest ``k`` whose coverage is still >= ``level``; when even
    ``k = 1`` (min, max) covers less than ``level`` (n <= 5 at 0.95: n = 5 gives 0.9375) it is
    (min, max) with that smaller coverage. ArgumentError for an empty ``xs`` or a level outside
    (0, 1)."""
    if not xs:
        raise ArgumentError("xs: expected at least one value, got none")
    if not 0 < level < 1:
        raise ArgumentError(f"level: expected a number in (0, 1), got {level!r}")
    v = sorted(float(x) for x in xs)
    n = len(v)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return v[k - 1], v[n - k], coverage(k)


def paired_ratio(num_ms: Sequence[float], den_ms: Sequence[float]) -> dict[str, Any]:
    """The paired ratio of two functions timed together by :func:`paired_ms`: per round
    ``num_ms[r] / den_ms[r]`` (peer time / our time = our speedup), and

    - ``ratio``: the median over rounds of the per-round ratios;
    - ``ratio_rounds``: the per-round ratios (list of float, round order);
    - ``ratio_min`` / ``ratio_max``: their extremes;
    - ``ratio_ci`` / ``ratio_ci_level``: ``[low, high]`` and coverage of :func:`median_ci`.

    ArgumentError when the lists differ in length, are empty, or hold a time <= 0."""
    if len(num_ms) != len(den_ms) or not num_ms:
        raise ArgumentError(f"num_ms, den_ms: expected two non-empty lists of equal length, got "
                            f"{len(num_ms)} and {len(den_ms)} values")
    if any(not (x > 0) for x in (*num_ms, *den_ms)):
        raise ArgumentError(f"num_ms, den_ms: expected times > 0 ms, got {list(num_ms)} and {list(den_ms)}")
    ratios = [float(a) / float(b) for a, b in zip(num_ms, den_ms)]
    lo, hi, cov = median_ci(ratios)
    return {"ratio": float(statistics.median(ratios)), "ratio_rounds": ratios, "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_ci": [lo, hi], "ratio_ci_level": cov}


def event_ms(fn: Callable[[], Any]) -> float:
    """GPU milliseconds of one ``fn()`` between two ``torch.cuda.Event(enable_timing=True)``
    recorded on the current stream before and after it (waits for the end event)."""
    import torch  # noqa: PLC0415
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def rotation_count(bytes_per_set: int, l2_bytes: int, cap: int = 8) -> int:
    """How many input copies to rotate through so that together they are >= 3x the L2 size
    (at least 2, at most ``cap``)."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set: expected > 0, got {bytes_per_set}")
    return int(min(cap, max(2, math.ceil(3 * l2_bytes / bytes_per_set))))


class Rotating:
    """Cycle over input sets: ``next()`` returns sets[0], sets[1], ..., sets[0], ..."""

    def __init__(self, sets: Sequence[Any]):
        if not sets:
            raise ValueError("sets: expected at least one input set, got none")
        self.sets = list(sets)
        self.i = 0

    def next(self) -> Any:
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def host_us_per_call(fn: Callable[[], Any], n_calls: int = 2000, warmup: int = 50) -> float:
    """Wall-clock microseconds per call of a loop of ``n_calls`` calls issued back to back
    (synchronising once before and once after the loop)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n_calls * 1e6


def gpu_us_per_call(fn: Callable[[], Any], rep_ms: float = 20.0) -> float:
    """GPU microseconds of one call (median, :func:`bench_gpu`). When the wall time per call of
    :func:`host_us_per_call` is well above this, the loop was host-bound and its figure is the
    host-side cost."""
    return bench_gpu(fn, rep_ms=rep_ms, warmup_ms=5.0) * 1e3
