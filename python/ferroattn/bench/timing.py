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
- :func:`host_us_per_call` measures host-side cost: the wall time of a loop of N calls issued
  without synchronising inside the loop, divided by N. It reflects the host cost when the GPU
  work per call is shorter than the host work (checked by :func:`gpu_us_per_call`).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

L2_FLUSH_BYTES = 256 * 1024 * 1024


def have_triton() -> bool:
    try:
        import triton.testing  # noqa: F401
        return True
    except Exception:
        return False


def method_name() -> str:
    return "triton.testing.do_bench median (L2 cleared before each call)" if have_triton() else \
        "CUDA events median (L2 cleared before each call)"


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
