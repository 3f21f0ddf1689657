"""What ferroattn.bench and ferroattn.profiler both measure with (the profiler does not import
the benchmark package):

- :func:`bench_gpu`: the median milliseconds of one call, L2 cleared before each call
  (``triton.testing.do_bench`` when triton is installed, else CUDA events here);
  :func:`event_ms`: one call between two CUDA events on the current stream;
- the measured ceilings: bf16 matmul (``torch.matmul`` of two 8192x8192 matrices of random normal
  data, 2*n^3 FLOPs per product; zero data would run faster and overstate the ceiling) and
  device-to-device copy (``dst.copy_(src)`` of 1 GiB, bytes read + written), median time each;
- :func:`driver_version`, which the results are labelled (and the profiler's ceilings cached) by;
- :func:`median_ci`: a distribution-free confidence interval of a median (the paired-round
  statistics of the benchmarks and of the profiler's cost rule).

:mod:`ferroattn.bench.timing`, :mod:`ferroattn.bench.ceilings` and :mod:`ferroattn.bench.report`
import these under the same names (their module docstrings describe the methods in full).
"""
from __future__ import annotations

import math
import shutil
import statistics
import subprocess
from typing import Any, Callable, Sequence

from .errors import ArgumentError

L2_FLUSH_BYTES = 256 * 1024 * 1024


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


def have_triton() -> bool:
    try:
        import triton.testing  # noqa: F401
        return True
    except Exception:
        return False


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


def driver_version() -> str | None:
    """The NVIDIA driver version: from ferroattn._native.device_info, else nvidia-smi, else None."""
    try:
        from ferroattn import _native
        v = _native.device_info(0).get("driver_version")
        if v:
            return str(v)
    except Exception:
        pass
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def matmul_tflops(n: int = 8192, dtype: str = "bfloat16", rep_ms: float = 200.0) -> dict:
    import torch
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device="cuda", dtype=dt)
    b = torch.randn(n, n, device="cuda", dtype=dt)
    ms = bench_gpu(lambda: torch.matmul(a, b), rep_ms=rep_ms)
    del a, b
    return {"what": f"torch.matmul {n}x{n}x{n} {dtype}, random normal data", "ms": ms,
            "tflops": 2 * n ** 3 / (ms * 1e-3) / 1e12}


def copy_gbps(nbytes: int = 1 << 30, rep_ms: float = 200.0) -> dict:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_gpu(lambda: dst.copy_(src), rep_ms=rep_ms)
    del src, dst
    return {"what": f"device-to-device copy_ of {nbytes / 2**30:.0f} GiB, bytes read + written",
            "ms": ms, "gbps": 2 * nbytes / (ms * 1e-3) / 1e9}


def measure() -> dict[str, Any]:
    """Both ceilings; a failure is recorded as null with the reason."""
    out: dict[str, Any] = {}
    for key, fn in (("matmul_bf16", matmul_tflops), ("copy_d2d", copy_gbps)):
        try:
            out[key] = fn()
        except Exception as e:
            out[key] = None
            out[f"{key}_error"] = f"{type(e).__name__}: {e}"
    return out
