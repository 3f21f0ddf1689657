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
- :func:`paired_gpu_ms` times the same functions by GPU time only (see "GPU time only" below),
  in the same paired forward / reverse rounds; :func:`paired_ratio` applies to its times as well.
- :func:`host_us_per_call` measures host-side cost: the wall time of a loop of N calls issued
  without synchronising inside the loop, divided by N. It reflects the host cost when the GPU
  work per call is shorter than the host work (checked by :func:`gpu_us_per_call`).

GPU time only
-------------
:func:`bench_gpu` puts CUDA events right around each call, after an L2 flush. When the host needs
longer to issue a call than the GPU needs for the flush, the GPU reaches the start event first and
then idles until the call's kernels arrive: the event time is then host time (torch's
semi-structured ``F.linear`` costs ~0.5-1.4 ms of host time per call; its kernel on a small shape
~20-60 us). :func:`gpu_window` removes the host from the measurement: it first enqueues a
``torch.cuda._sleep`` kernel long enough to cover the host time of everything enqueued behind it
(the sleep is given in GPU clock cycles; :func:`sleep_cycles_per_ms` calibrates cycles per ms once
per process and device), records a *mark* event, then per call: event ``f``, L2 flush, event
``s``, the call, event ``e``. While the GPU sleeps the host enqueues all of it, so the GPU runs
the calls back to back and ``s -> e`` is the call's GPU time only.

Validity (a check that can fail; a window that fails it is never reported as GPU time):

- *covered*: after the last call is enqueued the host asks whether the GPU has passed the mark
  (``mark.query()``); not yet = the whole window was enqueued before the GPU started on it, so the
  GPU cannot have waited for the host anywhere inside it;
- otherwise, per call: right after enqueuing call i the host asks whether the GPU has already
  passed ``s_i`` (``s_i.query()``); if it has, the GPU may have idled between ``s_i`` and the
  call's kernels (``late`` calls), and the window is host-bound; and the GPU timeline must have no
  gap: the sum of the per-call intervals ``f_i -> e_i`` (flush + call) must not be clearly
  shorter than the span from the mark to the last ``e`` (``idle_ms``; tolerance
  :data:`IDLE_TOL_MS_PER_GAP` per gap plus :data:`IDLE_TOL_FRAC` of the span).

  The timeline check alone cannot see a GPU that idles *inside* a call's interval (the idle time
  is then part of ``s_i -> e_i``, so the intervals still tile the span): that is the host-bound
  peer's case, caught by the ``query`` checks.

:func:`paired_gpu_ms` plans each window from the function's measured host time per call: ``n``
calls (enough for ``rep_ms / (2 * rounds)`` ms of GPU work, at most ``max_calls``; a host-heavy
function gets fewer calls so that its sleep stays short) behind a sleep of
``min_sleep_ms + margin * n * host_ms_per_call`` (capped at ``max_sleep_ms``). A window that fails
validity is retried with the margin doubled (``retries`` times); when it never holds, the
function's GPU time is reported invalid with the reason (``PairedGpu.invalid``) and the function
is not timed further in that pass.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Mapping, Sequence

from ferroattn.errors import ArgumentError

# the timing primitives profiler/ shares live in ferroattn._measure; imported here under their
# public names (ferroattn.bench.timing.bench_gpu, ...)
from .._measure import L2_FLUSH_BYTES, bench_gpu, event_ms, have_triton, median_ci  # noqa: F401


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


# ---- GPU time only (see "GPU time only" in the module docstring) -----------------------------------
#: what :func:`paired_gpu_ms` times per function and point unless told otherwise (ms of GPU work)
DEFAULT_GPU_REP_MS = 30.0
#: timing passes of the GEMM benchmarks (``--timing``): both, GPU time only, per call only
TIMING_MODES = ("both", "gpu", "call")
#: the benches' default per-call budget (``--rep-ms``) by timing mode: (full grid, ``--quick``);
#: with the GPU-time pass the per-call pass gets 70 % so that a run takes about as long as before
DEFAULT_REP_MS = {"call": (100.0, 30.0), "both": (70.0, 20.0), "gpu": (70.0, 20.0)}
#: the benches' default GPU-time budget (``--gpu-rep-ms``): (full grid, ``--quick``)
DEFAULT_GPU_REP = (DEFAULT_GPU_REP_MS, 10.0)
#: tolerance of the timeline check: per gap between two windows' events (ms) ...
IDLE_TOL_MS_PER_GAP = 0.01
#: ... plus this fraction of the window's span
IDLE_TOL_FRAC = 0.02


def check_timing_mode(mode: Any, name: str = "timing") -> str:
    """``mode`` if it is one of :data:`TIMING_MODES`; ArgumentError naming ``name`` otherwise."""
    if mode not in TIMING_MODES:
        raise ArgumentError(f"{name}: expected one of {', '.join(TIMING_MODES)}, got {mode!r}")
    return mode


class CudaDevice:
    """What the GPU-time measurement uses of CUDA, on the current stream of the current device:
    ``event()`` (a ``torch.cuda.Event(enable_timing=True)``: record / query / elapsed_time in ms),
    ``sleep_cycles(c)`` (``torch.cuda._sleep``: a one-thread kernel spinning ``c`` GPU clock
    cycles), ``flush()`` (zeroes a :data:`L2_FLUSH_BYTES` int32 buffer: clears the L2),
    ``synchronize()``, ``host_time_s()`` (``time.perf_counter``) and ``key`` (the device index,
    the key of the sleep calibration). Tests pass a simulated device with the same methods."""

    def __init__(self, flush_bytes: int = L2_FLUSH_BYTES):
        import torch  # noqa: PLC0415
        self._torch = torch
        self.key = ("cuda", torch.cuda.current_device())
        self._flush = torch.empty(max(1, flush_bytes // 4), dtype=torch.int32, device="cuda")

    def event(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def sleep_cycles(self, cycles: int) -> None:
        self._torch.cuda._sleep(int(cycles))

    def flush(self) -> None:
        self._flush.zero_()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def host_time_s(self) -> float:
        return time.perf_counter()


_DEVICES: dict[Any, CudaDevice] = {}
_CYCLES_PER_MS: dict[Any, float] = {}


def cuda_device() -> CudaDevice:
    """The :class:`CudaDevice` of the current CUDA device (one per process and device: its flush
    buffer is allocated once)."""
    import torch  # noqa: PLC0415
    idx = torch.cuda.current_device()
    if idx not in _DEVICES:
        _DEVICES[idx] = CudaDevice()
    return _DEVICES[idx]


def sleep_cycles_per_ms(device: Any = None, low: int = 2_000_000, high: int = 10_000_000, reps: int = 3) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` on ``device`` (default
    :func:`cuda_device`), measured once per process and device (cached by ``device.key``): per
    repetition, CUDA events around a sleep of ``low`` and one of ``high`` cycles; cycles per ms =
    the median over ``reps`` of ``(high - low) / (t_high - t_low)`` (the slope: the launch latency
    inside both intervals cancels). ~``reps * (low + high)`` cycles of GPU time (~20 ms on an
    H200). ArgumentError for ``0 < low < high`` not holding or ``reps < 1``; RuntimeError when the
    measured times do not grow with the cycles (no usable clock)."""
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low < high):
        raise ArgumentError(f"low, high: expected integers with 0 < low < high, got {low!r}, {high!r}")
    check_rounds(reps, "reps")
    dev = device if device is not None else cuda_device()
    key = getattr(dev, "key", id(dev))
    if key in _CYCLES_PER_MS:
        return _CYCLES_PER_MS[key]
    dev.sleep_cycles(1000)     # load the kernel
    dev.synchronize()
    slopes = []
    for _ in range(reps):
        ms = {}
        for c in (low, high):
            a, b = dev.event(), dev.event()
            a.record()
            dev.sleep_cycles(c)
            b.record()
            dev.synchronize()
            ms[c] = float(a.elapsed_time(b))
        if not ms[high] > ms[low]:
            raise RuntimeError(f"sleep calibration: a sleep of {high} cycles took {ms[high]:.4f} ms, not longer than "
                               f"{low} cycles ({ms[low]:.4f} ms); torch.cuda._sleep gives no usable clock here")
        slopes.append((high - low) / (ms[high] - ms[low]))
    _CYCLES_PER_MS[key] = float(statistics.median(slopes))
    return _CYCLES_PER_MS[key]


@dataclass
class GpuWindow:
    """One window of :func:`gpu_window` (times in ms).

    - ``call_ms``: per call, start -> end event (the call's GPU time when ``valid``);
    - ``flush_ms``: per call, the L2 flush before it (f -> s);
    - ``span_ms``: mark (right after the sleep) -> the last end event; ``idle_ms``: ``span_ms``
      minus the sum of the per-call intervals f -> e (>= 0): GPU time between the calls;
    - ``host_ms``: host wall time to enqueue the ``n`` calls (flushes and events included);
    - ``sleep_ms``: the sleep that preceded them; ``covered``: the GPU had not passed the mark
      when the host had enqueued the last call; ``late``: calls whose start event the GPU had
      already passed when the call was enqueued;
    - ``valid`` / ``reason``: the verdict of :func:`window_verdict` (reason None when valid).
    """
    call_ms: list[float]
    flush_ms: list[float]
    span_ms: float
    idle_ms: float
    host_ms: float
    sleep_ms: float
    covered: bool
    late: int
    valid: bool
    reason: str | None

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.call_ms))


def window_verdict(covered: bool, late: int, n_calls: int, idle_ms: float, span_ms: float) -> tuple[bool, str | None]:
    """(valid, reason) of a GPU-time window (see the module docstring): valid when the sleep
    covered the host's enqueueing (``covered``), else when no call was ``late`` and the timeline
    has no gap beyond ``IDLE_TOL_MS_PER_GAP * (n_calls + 1) + IDLE_TOL_FRAC * span_ms``."""
    if covered:
        return True, None
    if late:
        return False, (f"host-bound: the GPU passed the start event of {late} of {n_calls} calls before the call "
                       f"was enqueued (the sleep ran out)")
    tol = IDLE_TOL_MS_PER_GAP * (n_calls + 1) + IDLE_TOL_FRAC * span_ms
    if idle_ms > tol:
        return False, (f"host-bound: the GPU idled {idle_ms:.3f} ms of a {span_ms:.3f} ms window between calls "
                       f"(tolerance {tol:.3f} ms; the sleep ran out)")
    return True, None


def gpu_window(fn: Callable[[], Any], n_calls: int, sleep_ms: float, device: Any = None,
               cycles_per_ms: float | None = None) -> GpuWindow:
    """Time ``n_calls`` calls of ``fn`` by GPU time only, behind a sleep of ``sleep_ms`` (see the
    module docstring); waits for the GPU. ``cycles_per_ms`` defaults to
    :func:`sleep_cycles_per_ms` of ``device`` (default :func:`cuda_device`). ArgumentError for
    ``n_calls`` not a positive int or a negative / non-finite ``sleep_ms``."""
    check_rounds(n_calls, "n_calls")
    if not (isinstance(sleep_ms, (int, float)) and 0 <= sleep_ms < math.inf):
        raise ArgumentError(f"sleep_ms: expected a non-negative number of milliseconds, got {sleep_ms!r}")
    dev = device if device is not None else cuda_device()
    cpm = cycles_per_ms if cycles_per_ms is not None else sleep_cycles_per_ms(dev)
    evs = [(dev.event(), dev.event(), dev.event()) for _ in range(n_calls)]
    mark = dev.event()
    dev.sleep_cycles(int(sleep_ms * cpm))
    mark.record()
    t0 = dev.host_time_s()
    late = 0
    for f, s, e in evs:
        f.record()
        dev.flush()
        s.record()
        fn()
        e.record()
        if s.query():
            late += 1
    host_ms = (dev.host_time_s() - t0) * 1e3
    covered = not mark.query()
    dev.synchronize()
    call_ms = [float(s.elapsed_time(e)) for _, s, e in evs]
    flush_ms = [float(f.elapsed_time(s)) for f, s, _ in evs]
    busy = sum(float(f.elapsed_time(e)) for f, _, e in evs)
    span = float(mark.elapsed_time(evs[-1][2]))
    idle = max(0.0, span - busy)
    valid, reason = window_verdict(covered, late, n_calls, idle, span)
    return GpuWindow(call_ms, flush_ms, span, idle, host_ms, float(sleep_ms), covered, late, valid, reason)


def host_ms_per_call(fn: Callable[[], Any], device: Any = None, calls: int = 3) -> float:
    """Host milliseconds to enqueue one call of ``fn`` the way :func:`gpu_window` does (event,
    L2 flush, event, ``fn()``, event, event query): the largest of ``calls`` single-call timings
    (no sleep; waits for the GPU after them)."""
    check_rounds(calls, "calls")
    dev = device if device is not None else cuda_device()
    worst = 0.0
    for _ in range(calls):
        f, s, e = dev.event(), dev.event(), dev.event()
        t0 = dev.host_time_s()
        f.record()
        dev.flush()
        s.record()
        fn()
        e.record()
        s.query()
        worst = max(worst, (dev.host_time_s() - t0) * 1e3)
    dev.synchronize()
    return worst


def plan_window(host_ms: float, est_ms: float, window_ms: float, margin: float, max_calls: int,
                max_sleep_ms: float, min_sleep_ms: float) -> tuple[int, float] | None:
    """(calls, sleep ms) of one window: ``ceil(window_ms / est_ms)`` calls (``est_ms``: GPU ms of
    one call and its flush), at most ``max_calls`` and, for a host-heavy function, at most what a
    sleep of ``max(2 * window_ms, 3 calls)`` covers; sleep = ``min_sleep_ms + margin * calls *
    host_ms``. None when even one call needs a sleep above ``max_sleep_ms``."""
    per = margin * max(host_ms, 0.0)
    if min_sleep_ms + per > max_sleep_ms:
        return None
    n = max(1, min(max_calls, math.ceil(window_ms / max(est_ms, 1e-4))))
    if per > 0:
        n = min(n, max(1, min(3, max_calls), math.floor(2 * window_ms / per)),
                max(1, math.floor((max_sleep_ms - min_sleep_ms) / per)))
    return n, min(max_sleep_ms, min_sleep_ms + per * n)


@dataclass
class PairedGpu:
    """What :func:`paired_gpu_ms` measured.

    - ``ms[name]``: per round, GPU ms of one call (mean of the forward and reverse window medians);
      only for functions with a valid GPU time in every window;
    - ``windows[name]``: per round, ``(forward, reverse)`` window medians in ms;
    - ``invalid[name]``: why a function has no GPU time (its windows never held: host-bound, or
      its host time per call needs a sleep above the cap); it is not timed further;
    - ``errors[name]``: the exception of a function that raised (dropped like in :func:`paired_ms`);
    - ``stats[name]``: ``calls_per_window``, ``sleep_ms`` (per window that counted), ``host_ms_per_call``
      (the last measured), ``retries`` (windows re-run after failing validity), ``idle_ms_max``,
      ``covered`` (windows whose sleep covered all the host's enqueueing);
    - ``sequence``: names in the order their (valid) windows ran; ``cycles_per_ms``: the sleep
      calibration used.
    """
    ms: dict[str, list[float]] = field(default_factory=dict)
    windows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    sequence: list[str] = field(default_factory=list)
    cycles_per_ms: float | None = None


def paired_gpu_ms(fns: Mapping[str, Callable[[], Any]], rounds: int = DEFAULT_ROUNDS,
                  rep_ms: float = DEFAULT_GPU_REP_MS,
                  contexts: Mapping[str, Callable[[], ContextManager[Any]]] | None = None,
                  est_ms: Mapping[str, float] | None = None, *, max_calls: int = 10, max_sleep_ms: float = 50.0,
                  min_sleep_ms: float = 0.2, margin: float = 1.5, retries: int = 3, device: Any = None) -> PairedGpu:
    """Time ``fns`` (name -> zero-argument callable) by GPU time only, in ``rounds`` paired rounds
    (each function one :func:`gpu_window` in a forward and one in a reverse pass per round, like
    :func:`paired_ms`); ``rep_ms`` = ms of GPU work per function, split over its 2·rounds windows.
    ``est_ms[name]`` (optional): ms per call (e.g. the per-call time of :func:`paired_ms`, an upper
    bound of the GPU time) to size the windows; without it a one-call window measures it first.
    The host time per call is measured first (:func:`host_ms_per_call`) and then taken from each
    window; windows are planned by :func:`plan_window`; an invalid window is retried with the
    margin doubled, at most ``retries`` times; then the function is ``invalid`` (reason kept).
    ``contexts[name]()`` is entered around each of that function's windows.

    ArgumentError for an empty ``fns``, ``rounds`` / ``max_calls`` not a positive int, a
    non-positive ``rep_ms`` / ``max_sleep_ms`` / ``margin``, a negative ``min_sleep_ms`` or
    ``retries``, or a ``contexts`` key not in ``fns``."""
    check_rounds(rounds)
    check_rounds(max_calls, "max_calls")
    if not fns:
        raise ArgumentError("fns: expected at least one function to time, got none")
    for nm, v, lo in (("rep_ms", rep_ms, 0), ("max_sleep_ms", max_sleep_ms, 0), ("margin", margin, 0)):
        if not (isinstance(v, (int, float)) and lo < v < math.inf):
            raise ArgumentError(f"{nm}: expected a positive number, got {v!r}")
    if not (isinstance(min_sleep_ms, (int, float)) and 0 <= min_sleep_ms < max_sleep_ms):
        raise ArgumentError(f"min_sleep_ms: expected a number in [0, max_sleep_ms={max_sleep_ms}), "
                            f"got {min_sleep_ms!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ArgumentError(f"retries: expected a non-negative integer, got {retries!r}")
    contexts = dict(contexts or {})
    unknown = sorted(set(contexts) - set(fns))
    if unknown:
        raise ArgumentError(f"contexts: expected names among fns ({', '.join(fns)}), got {', '.join(unknown)}")
    dev = device if device is not None else cuda_device()
    res = PairedGpu(cycles_per_ms=sleep_cycles_per_ms(dev))
    window_ms = rep_ms / (2 * rounds)
    host: dict[str, float] = {}
    est: dict[str, float] = {}
    mult: dict[str, float] = {}
    live = list(fns)

    def ctx(name):
        return contexts.get(name, contextlib.nullcontext)()

    def drop(name, why=None, err=None):
        if name in live:
            live.remove(name)
        if err is not None:
            res.errors[name] = err
        else:
            res.invalid[name] = why

    def measured_window(name) -> GpuWindow | None:
        """A valid window of ``name`` (retrying), or None after dropping it."""
        st = res.stats[name]
        for _ in range(retries + 1):
            plan = plan_window(host[name], est[name], window_ms, margin * mult[name], max_calls, max_sleep_ms,
                               min_sleep_ms)
            if plan is None:
                drop(name, f"host time per call {host[name]:.3f} ms needs a sleep above the cap of "
                           f"{max_sleep_ms:g} ms (margin {margin * mult[name]:g})")
                return None
            n, sleep = plan
            with ctx(name):
                w = gpu_window(fns[name], n, sleep, dev, res.cycles_per_ms)
            host[name] = max(w.host_ms / n, 1e-6)
            st["host_ms_per_call"] = host[name]
            st["idle_ms_max"] = max(st["idle_ms_max"], w.idle_ms)
            if w.valid:
                st["calls_per_window"].append(n)
                st["sleep_ms"].append(sleep)
                st["covered"] += int(w.covered)
                return w
            st["retries"] += 1
            st["last_reason"] = w.reason
            mult[name] *= 2.0
        drop(name, f"no valid GPU-time window in {retries + 1} attempts: {st['last_reason']}")
        return None

    for name in list(live):
        res.stats[name] = {"calls_per_window": [], "sleep_ms": [], "host_ms_per_call": None, "retries": 0,
                           "idle_ms_max": 0.0, "covered": 0, "last_reason": None}
        mult[name] = 1.0
        try:
            with ctx(name):
                host[name] = max(host_ms_per_call(fns[name], dev), 1e-6)
            if est_ms and est_ms.get(name) and est_ms[name] > 0:
                est[name] = float(est_ms[name])
            else:
                est[name] = window_ms     # one call for the probe window
                w = measured_window(name)
                if w is not None:
                    est[name] = max(w.median_ms + statistics.median(w.flush_ms), 1e-4)
        except Exception as e:  # noqa: BLE001  (recorded; the other functions go on)
            drop(name, err=e)
    win: dict[str, list[list[float]]] = {name: [] for name in live}
    for _ in range(rounds):
        for per_round in win.values():
            per_round.append([])
        for name in round_order(list(win)):
            if name not in live:
                continue
            try:
                w = measured_window(name)
            except Exception as e:  # noqa: BLE001
                drop(name, err=e)
                continue
            if w is None:
                continue
            res.sequence.append(name)
            win[name][-1].append(w.median_ms)
    for name, per_round in win.items():
        if name in live:
            res.windows[name] = [(w[0], w[1]) for w in per_round]
            res.ms[name] = [(w[0] + w[1]) / 2.0 for w in per_round]
    return res


def gpu_method_name(rounds: int, rep_ms: float = DEFAULT_GPU_REP_MS) -> str:
    """How :func:`paired_gpu_ms` times (for the JSON and the printed header)."""
    return (f"GPU time only: median of {rounds} paired rounds (forward and reverse pass per round); per window a "
            f"torch.cuda._sleep pre-fills the stream to cover the host time of the window's calls, then per call "
            f"L2 flush + CUDA events around the call; a window whose sleep ran out with a call enqueued after the "
            f"GPU reached it (event query) or with a gap in the GPU timeline is retried with a longer sleep and "
            f"never reported; {rep_ms:g} ms of calls per function and point")


def gpu_stats_summary(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The compact per-function record of :attr:`PairedGpu.stats` kept in the benches' JSON:
    ``windows`` (valid windows), ``calls_per_window`` (median), ``sleep_ms_max``,
    ``host_ms_per_call`` (last measured), ``retries``, ``covered`` (windows whose sleep covered the
    host's enqueueing), ``idle_ms_max``."""
    cpw, sl = list(stats.get("calls_per_window") or []), list(stats.get("sleep_ms") or [])
    return {"windows": len(cpw), "calls_per_window": statistics.median(cpw) if cpw else None,
            "sleep_ms_max": max(sl) if sl else None, "host_ms_per_call": stats.get("host_ms_per_call"),
            "retries": stats.get("retries", 0), "covered": stats.get("covered", 0),
            "idle_ms_max": stats.get("idle_ms_max", 0.0)}


@dataclass
class TwoPass:
    """What :func:`time_both` measured: ``call`` (:class:`Paired` of :func:`paired_ms`, None when
    that pass did not run), ``gpu`` (:class:`PairedGpu`, None when not run), ``errors[name]``
    (exception text of a function that raised in the per-call pass, or in the GPU-time pass when
    that is the only pass; a raise in the GPU-time pass after a per-call pass is its
    ``gpu_error``) and ``results[name]``: the per
    function record of the benches' JSON -- ``ms`` / ``call_ms`` (per-call time, median over
    rounds; None without that pass), ``ms_rounds``, ``ms_windows``, and with the GPU-time pass
    ``gpu_ms`` (None when invalid), ``gpu_ms_rounds``, ``gpu_ms_windows``, ``gpu_error`` (why no GPU
    time) and ``gpu_stats`` (:func:`gpu_stats_summary`)."""
    call: Paired | None = None
    gpu: PairedGpu | None = None
    errors: dict[str, str] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def call_ms(self) -> dict[str, list[float]]:
        return dict(self.call.ms) if self.call else {}

    def gpu_ms(self) -> dict[str, list[float]]:
        return dict(self.gpu.ms) if self.gpu else {}

    def ratios(self, num: str, den: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(per-call, GPU-time) :func:`paired_ratio` of ``num`` over ``den`` (None where either
        side has no times in that pass)."""
        c, g = self.call_ms(), self.gpu_ms()
        return (paired_ratio(c[num], c[den]) if num in c and den in c else None,
                paired_ratio(g[num], g[den]) if num in g and den in g else None)


def time_both(fns: Mapping[str, Callable[[], Any]], mode: str, rounds: int, rep_ms: float, warmup_ms: float,
              gpu_rep_ms: float, contexts: Mapping[str, Callable[[], ContextManager[Any]]] | None = None,
              device: Any = None, err: Callable[[BaseException], str] = lambda e: f"{type(e).__name__}: {e}"
              ) -> TwoPass:
    """The timing of one benchmark point: per ``mode`` (:data:`TIMING_MODES`) the per-call pass
    (:func:`paired_ms` with ``rep_ms`` / ``warmup_ms`` per function split over the 2·rounds
    windows) and / or the GPU-time pass (:func:`paired_gpu_ms` with ``gpu_rep_ms`` per function,
    sized by the per-call times when that pass ran; a function that raised in the per-call pass is
    not timed again; when the GPU-time pass itself fails -- e.g. the sleep calibration finds no
    usable clock -- every function's GPU time is invalid with that reason, the per-call results
    stand). ``err`` formats an exception for ``errors``. ArgumentError for a bad ``mode`` (and what
    the two passes reject)."""
    check_timing_mode(mode, "mode")
    out = TwoPass()
    contexts = dict(contexts or {})
    live = dict(fns)
    if mode in ("both", "call"):
        out.call = paired_ms(live, rounds, rep_ms / (2 * rounds), warmup_ms / (2 * rounds), contexts)
        for name, e in out.call.errors.items():
            out.errors[name] = err(e)
            live.pop(name, None)
        for name, per_round in out.call.ms.items():
            ms = float(statistics.median(per_round))
            out.results[name] = {"ms": ms, "call_ms": ms, "ms_rounds": per_round,
                                 "ms_windows": [list(w) for w in out.call.windows[name]]}
    if mode in ("both", "gpu") and live:
        est = {n: statistics.median(v) for n, v in out.call_ms().items() if n in live}
        try:
            out.gpu = paired_gpu_ms(live, rounds, gpu_rep_ms, {n: c for n, c in contexts.items() if n in live},
                                    est, device=device)
        except ArgumentError:
            raise
        except Exception as e:  # noqa: BLE001  (e.g. no usable sleep clock: no GPU time, the rest stands)
            out.gpu = PairedGpu(invalid={n: f"GPU-time pass failed: {err(e)}" for n in live})
        for name, e in out.gpu.errors.items():
            if out.call is None:
                out.errors[name] = err(e)
            out.results.setdefault(name, {"ms": None, "call_ms": None})["gpu_error"] = f"raised: {err(e)}"
        for name in live:
            if name in out.gpu.errors:
                continue
            r = out.results.setdefault(name, {"ms": None, "call_ms": None})
            per_round = out.gpu.ms.get(name)
            r.update(gpu_ms=float(statistics.median(per_round)) if per_round else None, gpu_ms_rounds=per_round,
                     gpu_ms_windows=[list(w) for w in out.gpu.windows.get(name, [])],
                     gpu_error=out.gpu.invalid.get(name),
                     gpu_stats=gpu_stats_summary(out.gpu.stats.get(name) or {}))
    return out


def pass_names(mode: str, rounds: int, gpu_rep_ms: float = DEFAULT_GPU_REP_MS) -> list[str]:
    """The descriptions of the timing passes of ``mode`` (:data:`TIMING_MODES`), GPU time first."""
    check_timing_mode(mode, "mode")
    out = []
    if mode in ("both", "gpu"):
        out.append(gpu_method_name(rounds, gpu_rep_ms))
    if mode in ("both", "call"):
        out.append("per call (host-inclusive): " + method_name(rounds))
    return out
