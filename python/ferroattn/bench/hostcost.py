"""Host-side cost of one small attention call (b=1, s=128, h=16, d=64, bf16, causal=False):
ferroattn (``flash_attn_func``: argument normalisation, torch custom op, output allocation,
DLPack export, Rust validation, launch) against torch SDPA (default backend choice, and
restricted to the flash backend).

Method (:func:`ferroattn.bench.timing.host_us_per_call`): a loop of N calls without
synchronising inside it, wall time / N. The GPU time of one such call is a few microseconds,
so the loop is host-bound and the figure is the host cost per call; ``host_bound`` records
whether the wall time per call exceeded 1.5x the GPU time of one call.
"""
from __future__ import annotations

from typing import Any

from . import peers, timing

SHAPE = dict(b=1, s=128, h=16, d=64)


def measure(n_calls: int = 2000, dtype: str = "bfloat16") -> dict[str, Any]:
    import torch
    import ferroattn
    b, s, h, d = SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"]
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    import torch.nn.functional as F
    cases = {
        "ferroattn": (lambda: ferroattn.flash_attn_func(q, k, v), None),
        "sdpa_default": (lambda: F.scaled_dot_product_attention(qt, kt, vt), None),
        "sdpa_flash": (lambda: F.scaled_dot_product_attention(qt, kt, vt), "flash"),
    }
    out: dict[str, Any] = {"shape": f"b={b} s={s} h={h} d={d} {dtype}", "n_calls": n_calls,
                           "method": "wall time of N back-to-back calls / N (one sync after the loop)"}
    for name, (fn, backend) in cases.items():
        try:
            if backend:
                with peers.only(backend):
                    host = timing.host_us_per_call(fn, n_calls)
                    gpu = timing.gpu_us_per_call(fn)
            else:
                host = timing.host_us_per_call(fn, n_calls)
                gpu = timing.gpu_us_per_call(fn)
            out[name] = {"host_us": host, "gpu_us": gpu, "host_bound": bool(host > 1.5 * gpu)}
        except Exception as e:
            out[name] = {"host_us": None, "gpu_us": None, "error": f"{type(e).__name__}: {e}"}
    return out
