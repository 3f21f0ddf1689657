"""A simulated CUDA stream for the CPU tests of the GPU-time-only timing
(python/ferroattn/bench/timing.py: gpu_window, paired_gpu_ms, sleep_cycles_per_ms) and of the
benches that use it.

``FakeGpu`` has the methods of ``timing.CudaDevice``. It keeps two clocks in ms: the host's
(``host``: advanced by the host cost of every call into it) and the time the single stream is
free (``gpu_free``). Work enqueued at host time H starts at max(H, gpu_free) (the GPU waits for
the host when it has nothing queued: the effect under test) and lasts its GPU time scaled by
``slow(start)`` (a drifting clock). An event holds the time the stream reaches it; ``query()``
is True once that time is <= the host clock (the query's own host cost is spent after it
looked). ``sleep_cycles(c)`` lasts ``c / true_cycles_per_ms`` ms plus a fixed
``sleep_overhead_ms`` (what the calibration must cancel).

For the variant bench (python/ferroattn/bench/variants.py): ``FakeFlashAttn`` (a CPU
``flash_attn_func`` with per-variant simulated times and rejections), ``SimulatedBench`` (a
``bench_gpu`` that returns those times) and ``visible_pairs_reference`` (a row-by-row count).
"""
from __future__ import annotations

import functools
import itertools
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


_FAKE_KEYS = itertools.count()


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
        # a key no other FakeGpu of this process has (id() is reused once an instance is freed,
        # which would hand a new fake the calibration cached for a freed one)
        self.key = ("fake", next(_FAKE_KEYS))
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


# ---- the variant bench (python/ferroattn/bench/variants.py) -------------------------------------

def visible_pairs_reference(s_q: int, s_k: int, causal: bool = False, window_size=(-1, -1)) -> int:
    """Visible (query, key) pairs of one (batch, head), counted row by row with flash_attn's mask
    rules (as ferroattn.testing.visible_mask: bottom-right diagonal, sides >= s_k unbounded,
    causal forces right = 0): the reference the bench's count is checked against."""
    left, right = (int(w) for w in window_size)
    left = -1 if left >= s_k else left
    right = -1 if right >= s_k else right
    if causal:
        right = 0
    total = 0
    for i in range(s_q):
        diag = i + s_k - s_q
        lo = 0 if left < 0 else max(0, diag - left)
        hi = s_k - 1 if right < 0 else min(s_k - 1, diag + right)
        total += max(0, hi - lo + 1)
    return total


class SimulatedBench:
    """A stand-in for ``timing.bench_gpu``: runs the function twice and returns ``ms``, which is
    ``default_ms`` unless the function (a :class:`FakeFlashAttn` call) set it. ``calls`` counts
    the timings."""

    def __init__(self, default_ms: float = 2.0):
        self.default_ms, self.ms, self.calls = default_ms, default_ms, 0

    def __call__(self, fn, rep_ms: float = 0.0, warmup_ms: float = 0.0) -> float:
        self.calls += 1
        self.ms = self.default_ms
        fn()
        fn()
        return self.ms


class FakeFlashAttn:
    """A CPU stand-in for ``ferroattn.flash_attn_func`` in the variant bench: the fp32 reference
    (ferroattn.testing.attention_ref, differentiable) with the call's window / softcap / ALiBi, the
    sinks applied through the reference's LSE (out · sigmoid(lse − s_aux)); NotImplementedError for
    the variants in ``unsupported``, ``error`` (an exception) raised for those in ``failing``. Each
    call sets ``bench.ms`` to ``ms[variant]`` (default 1.0): the simulated GPU time of the call;
    the backward of its output sets it to ``bwd_ms[variant]`` (default 2.5 x the forward's)."""

    def __init__(self, bench: SimulatedBench, ms: dict | None = None, unsupported=(), failing=(),
                 error: BaseException | None = None, bwd_ms: dict | None = None):
        self.bench, self.ms = bench, dict(ms or {})
        self.bwd_ms = dict(bwd_ms or {})
        self.unsupported, self.failing = set(unsupported), set(failing)
        self.error = error or RuntimeError("CUDA error: an illegal memory access was encountered")
        self.calls: list[str] = []

    @staticmethod
    def variant(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, s_aux=None) -> str:
        if tuple(window_size) != (-1, -1):
            return "window"
        if softcap:
            return "softcap"
        if alibi_slopes is not None:
            return "alibi"
        if dropout_p:
            return "dropout"
        return "sinks" if s_aux is not None else "plain"

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None):
        import torch
        from ferroattn.testing import attention_ref
        name = self.variant(window_size, softcap, alibi_slopes, dropout_p, s_aux)
        self.calls.append(name)
        self.bench.ms = self.ms.get(name, 1.0)
        if name in self.unsupported:
            raise NotImplementedError(f"ferroattn: {name} is not implemented yet")
        if name in self.failing:
            raise self.error
        out, lse = attention_ref(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes)
        if dropout_p:
            out = torch.nn.functional.dropout(out, dropout_p)
        if s_aux is not None:
            out = out * torch.sigmoid(lse - s_aux[None, :, None]).transpose(1, 2).unsqueeze(-1)
        return _timed_backward().apply(out.to(q.dtype), self.bench,
                                       self.bwd_ms.get(name, 2.5 * self.ms.get(name, 1.0)))


@functools.lru_cache(maxsize=None)
def _timed_backward():
    import torch

    class TimedBackward(torch.autograd.Function):
        """Identity whose backward sets ``bench.ms`` (the simulated GPU time of the backward)."""

        @staticmethod
        def forward(ctx, x, bench, ms):
            ctx.bench, ctx.ms = bench, ms
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            ctx.bench.ms = ctx.ms
            return grad, None, None
    return TimedBackward

