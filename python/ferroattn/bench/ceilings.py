"""Measured ceilings of the GPU the benchmark runs on.

- bf16 matmul: ``torch.matmul`` of two 8192x8192 bf16 matrices of random normal data
  (2*n^3 FLOPs per product), median time -> TFLOP/s. Zero data would run faster (lower
  power) and overstate the ceiling.
- device-to-device copy: ``dst.copy_(src)`` of 1 GiB, counting bytes read + written,
  median time -> GB/s (1e9 bytes).
"""
from __future__ import annotations

from typing import Any

from . import timing


def matmul_tflops(n: int = 8192, dtype: str = "bfloat16", rep_ms: float = 200.0) -> dict:
    import torch
    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device="cuda", dtype=dt)
    b = torch.randn(n, n, device="cuda", dtype=dt)
    ms = timing.bench_gpu(lambda: torch.matmul(a, b), rep_ms=rep_ms)
    del a, b
    return {"what": f"torch.matmul {n}x{n}x{n} {dtype}, random normal data", "ms": ms,
            "tflops": 2 * n ** 3 / (ms * 1e-3) / 1e12}


def copy_gbps(nbytes: int = 1 << 30, rep_ms: float = 200.0) -> dict:
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = timing.bench_gpu(lambda: dst.copy_(src), rep_ms=rep_ms)
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
