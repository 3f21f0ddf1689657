"""A simulated CUDA stream for the CPU tests of the GPU-time-only timing
(python/ferroattn/bench/timing.py: gpu_window, paired_gpu_ms, sleep_cycles_per_ms) and of the
benches that use it.

``FakeGpu`` has the methods of ``timing.CudaDevice``. It keeps two clocks in ms: the host's
(``host``: advanced by the host cost of every call into it) and the time the single stream is
free (``gpu_free``). Work enqueued at host time H starts at max(H, gpu_free) (the GPU waits for
the host when it has nothing queued: the effect under test) and lasts its GPU time scaled by
``slow(start)`` (a drifting clock). An event is stamped when the stream reaches it; ``query()``
is True once that stamp is <= the host clock (the query's own host cost is spent after it
looked). ``sleep_cycles(c)`` lasts ``c / true_cycles_per_ms`` ms plus a fixed
``sleep_overhead_ms`` (what the calibration must cancel).
"""
from __future__ import annotations

from typing import Callable


class FakeEvent:
    def __init__(self, gpu: "FakeGpu"):
        self.gpu, self.t = gpu, None

    def record(self) -> None:
        g = self.gpu
        g.host += g.event_host_ms
        self.t = max(g.gpu_free, g.host)
        g.gpu_free = self.t + g.event_gpu_ms

    def query(self) -> bool:
        g = self.gpu
        done = self.t is not None and self.t <= g.host
        g.host += g.query_host_ms        # the call returns after it looked
        return done

    def elapsed_time(self, other: "FakeEvent") -> float:
        for ev in (self, other):
            if ev.t is None or ev.t > self.gpu.host:
                raise RuntimeError("elapsed_time: event not recorded or not yet complete")
        return other.t - self.t


class FakeGpu:
    """See the module docstring. ``kernel(host_ms, gpu_ms)`` is what a fake function calls: it
    spends ``host_ms`` of host time, then enqueues ``gpu_ms`` of GPU work."""

    def __init__(self, true_cycles_per_ms: float = 1.755e6, flush_gpu_ms: float = 0.08,
                 launch_host_ms: float = 0.004, event_host_ms: float = 0.002, event_gpu_ms: float = 0.0,
                 query_host_ms: float = 0.001, sleep_overhead_ms: float = 0.003,
                 slow: Callable[[float], float] = lambda t: 1.0):
        self.true_cycles_per_ms = true_cycles_per_ms
        self.flush_gpu_ms, self.launch_host_ms = flush_gpu_ms, launch_host_ms
        self.event_host_ms, self.event_gpu_ms, self.query_host_ms = event_host_ms, event_gpu_ms, query_host_ms
        self.sleep_overhead_ms, self.slow = sleep_overhead_ms, slow
        self.host = 0.0
        self.gpu_free = 0.0
        self.key = ("fake", id(self))
        self.kernels: list[tuple[str, float, float]] = []   # (tag, start, end) of every fake kernel

    def _enqueue(self, gpu_ms: float, tag: str = "") -> None:
        self.host += self.launch_host_ms
        start = max(self.gpu_free, self.host)
        self.gpu_free = start + gpu_ms * self.slow(start)
        if tag:
            self.kernels.append((tag, start, self.gpu_free))

    # the CudaDevice interface
    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def sleep_cycles(self, cycles: int) -> None:
        self._enqueue(self.sleep_overhead_ms + cycles / self.true_cycles_per_ms, "sleep")

    def flush(self) -> None:
        self._enqueue(self.flush_gpu_ms, "flush")

    def synchronize(self) -> None:
        self.host = max(self.host, self.gpu_free)

    def host_time_s(self) -> float:
        return self.host / 1e3

    # what fake functions call
    def kernel(self, host_ms: float, gpu_ms: float, tag: str = "call") -> None:
        self.host += host_ms
        self._enqueue(gpu_ms, tag)

    def fn(self, host_ms: float, gpu_ms: float, tag: str = "call") -> Callable[[], None]:
        return lambda: self.kernel(host_ms, gpu_ms, tag)


def small_gemm_point():
    """A ``bench gemm`` point (bf16 "square" matmul, m, n, k = 8, 16, 32) and two CPU input sets
    (a, b = w.T, bias) for ``measure_point`` under a simulated timer: (point, sets)."""
    import torch
    m, n, k = 8, 16, 32
    w = torch.randn(n, k).to(torch.bfloat16)
    sets = [(torch.randn(m, k).to(torch.bfloat16), w.T, torch.randn(n).to(torch.bfloat16)) for _ in range(2)]
    p = {"dtype": "bf16", "suite": "square", "kind": "matmul", "activation": None, "m": m, "n": n, "k": k,
         "flops": 2.0 * m * n * k}
    return p, sets
