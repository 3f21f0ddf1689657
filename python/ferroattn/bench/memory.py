"""Peak GPU memory of one attention forward + backward: ferroattn against SDPA-flash.

Shape (issue 3): b = 1, s = 16384, h = 16, d = 128, bf16, causal (a training call). For each
implementation: q, k, v (leaves, requires_grad) and dout are allocated first; then
``torch.cuda.reset_peak_memory_stats()``, ``out = attention(q, k, v)``,
``torch.autograd.grad(out, (q, k, v), dout)``, synchronise, and

    peak_extra_bytes = torch.cuda.max_memory_allocated() - memory allocated before the forward,

i.e. everything the call pair needs on top of its inputs: out, saved LSE, dq/dk/dv and every
workspace (allocated through torch's allocator, so all of it is counted). A flash-style
backward needs O(b·h·s·d) of it: out, dq, dk, dv (4 q-sized tensors), an fp32 dq accumulator (2)
and O(b·h·s) rows (LSE, D) -- about 6 q-sized tensors, 384 MiB here; one s x s score matrix per
head would be ``score_matrix_bytes = b·h·s²·2`` (8 GiB here).

Pass rule (:data:`MAX_RATIO`, :data:`MAX_Q_TENSORS`): ours needs at most 1.5 x SDPA-flash's
extra memory (+ 16 MiB of slack for allocator rounding), and at most 16 q-sized tensors
(``16·b·s·h·d·2`` bytes, 1 GiB here: linear in s, far below any s x s buffer). When SDPA-flash
cannot run, the second part alone decides; when ours fails, the check fails. Layouts: ours
(b, s, h, d), SDPA (b, h, s, d), each contiguous.
"""
from __future__ import annotations

from typing import Any, Callable

SHAPE = dict(b=1, s=16384, h=16, d=128, dtype="bfloat16", causal=True)
MAX_RATIO = 1.5
SLACK_BYTES = 16 * 2**20
MAX_Q_TENSORS = 16


def score_matrix_bytes(b: int, h: int, s: int, elem_bytes: int = 2) -> int:
    """Bytes of one s x s score matrix per (batch, head) in a 2-byte dtype: b·h·s²·2."""
    return b * h * s * s * elem_bytes


def verdict(ours_extra: int | None, flash_extra: int | None, q_bytes: int) -> dict:
    """The pass rule above on measured numbers (``q_bytes``: bytes of one q tensor; None = not
    measured -> ok None)."""
    out: dict[str, Any] = {"max_ratio": MAX_RATIO, "slack_bytes": SLACK_BYTES, "max_q_tensors": MAX_Q_TENSORS,
                           "linear_bound_bytes": MAX_Q_TENSORS * q_bytes}
    if ours_extra is None:
        out.update(ratio=None, ok=None, linear_ok=None, vs_flash_ok=None)
        return out
    out["linear_ok"] = bool(ours_extra <= MAX_Q_TENSORS * q_bytes)
    if flash_extra:
        out["ratio"] = ours_extra / flash_extra
        out["vs_flash_ok"] = bool(ours_extra <= MAX_RATIO * flash_extra + SLACK_BYTES)
    else:
        out["ratio"], out["vs_flash_ok"] = None, None
    out["ok"] = out["linear_ok"] and out["vs_flash_ok"] is not False
    return out


def peak_extra(fwd: Callable, layout: str, b: int, s: int, h: int, d: int, dtype: str) -> dict:
    """Peak extra bytes of ``fwd(q, k, v)`` + its backward on fresh inputs of ``layout``
    ("bshd" or "bhsd"). Returns {"peak_extra_bytes", "inputs_bytes", "peak_bytes"}."""
    import torch
    dt = getattr(torch, dtype)
    shape = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before_inputs = torch.cuda.memory_allocated()
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dt)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fwd(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out, grads, q, k, v, dout
    torch.cuda.empty_cache()
    return {"peak_extra_bytes": int(peak - base), "inputs_bytes": int(base - before_inputs), "peak_bytes": int(peak)}


def measure(b: int = SHAPE["b"], s: int = SHAPE["s"], h: int = SHAPE["h"], d: int = SHAPE["d"],
            dtype: str = SHAPE["dtype"], causal: bool = SHAPE["causal"]) -> dict:
    """Peak extra memory of ours and of SDPA-flash for one forward + backward (needs CUDA)."""
    import torch.nn.functional as F
    import ferroattn
    from . import peers

    res: dict[str, Any] = {"shape": dict(b=b, s=s, h=h, d=d, dtype=dtype, causal=causal),
                           "method": "torch.cuda.max_memory_allocated() during forward + autograd.grad, minus "
                                     "the memory allocated before the forward (inputs q, k, v, dout)",
                           "score_matrix_bytes": score_matrix_bytes(b, h, s),
                           "q_bytes": b * s * h * d * 2}
    cases = {
        "ferroattn": (lambda q, k, v: ferroattn.flash_attn_func(q, k, v, causal=causal), "bshd", None),
        "sdpa_flash": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), "bhsd", "flash"),
    }
    for name, (fn, layout, backend) in cases.items():
        try:
            if backend:
                with peers.only(backend):
                    res[name] = peak_extra(fn, layout, b, s, h, d, dtype)
            else:
                res[name] = peak_extra(fn, layout, b, s, h, d, dtype)
        except Exception as e:
            res[name] = {"peak_extra_bytes": None, "error": f"{type(e).__name__}: {e}"}
    res["verdict"] = verdict(res["ferroattn"].get("peak_extra_bytes"), res["sdpa_flash"].get("peak_extra_bytes"),
                             res["q_bytes"])
    res["ok"] = False if res["ferroattn"].get("error") else res["verdict"]["ok"]
    return res


def format_memory(m: dict) -> str:
    """One line: ours vs SDPA-flash peak extra MiB and the verdict."""
    def mib(r: dict) -> str:
        x = (r or {}).get("peak_extra_bytes")
        return f"{x / 2**20:.0f} MiB" if x is not None else f"n/a ({(r or {}).get('error')})"
    sh = m.get("shape", {})
    v = m.get("verdict", {})
    ratio = v.get("ratio")
    ok = {True: "PASS", False: "FAIL", None: "n/a"}[m.get("ok")]
    return (f"attention fwd+bwd peak extra memory (b={sh.get('b')} s={sh.get('s')} h={sh.get('h')} d={sh.get('d')} "
            f"{sh.get('dtype')}): ferroattn {mib(m.get('ferroattn'))}, SDPA-flash {mib(m.get('sdpa_flash'))}"
            + (f" (ratio {ratio:.2f})" if ratio is not None else "")
            + f"; one s x s score matrix per head: {m.get('score_matrix_bytes', 0) / 2**30:.1f} GiB  {ok}")
