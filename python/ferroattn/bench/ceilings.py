"""Measured ceilings of the GPU the benchmark runs on.

- bf16 matmul: ``torch.matmul`` of two 8192x8192 bf16 matrices of random normal data
  (2*n^3 FLOPs per product), median time -> TFLOP/s. Zero data would run faster (lower
  power) and overstate the ceiling.
- device-to-device copy: ``dst.copy_(src)`` of 1 GiB, counting bytes read + written,
  median time -> GB/s (1e9 bytes).
"""
from __future__ import annotations

# measured by ferroattn._measure (which the profiler uses too); imported here under their public names
from .._measure import copy_gbps, matmul_tflops, measure  # noqa: F401
