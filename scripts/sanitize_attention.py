#!/usr/bin/env python3
"""A few small attention calls for compute-sanitizer (memcheck, racecheck) on the GPU machine.

Run as ``compute-sanitizer --tool memcheck python scripts/sanitize_attention.py`` (with
``FERROATTN_LINEINFO=1`` so reports carry source lines). The cases cover tails (sequence
lengths and head dims that are not multiples of the tile), causal with s_q < s_k and s_q > s_k,
length 1, GQA, both dtypes, and varlen with an empty sequence. Sizes are tiny: the sanitizer
slows kernels down by orders of magnitude.

Each case also checks its output against ``ferroattn.testing`` (DESIGN §5 pass rule) and that
every output element was written (the output buffer is never pre-filled by us, so a NaN or
an inf in it means an unwritten or wrong value). Prints one line per case; exit 1 if any case
failed, 0 otherwise (sanitizer findings are reported through the sanitizer's own exit code).

``--list`` prints the cases without running them (no GPU needed).
"""
from __future__ import annotations

import argparse
import sys
import traceback

# (name, b, s_q, s_k, h, h_k, d, causal, dtype)
PADDED_CASES = [
    ("tail-full-fp16", 2, 97, 97, 3, 3, 64, False, "float16"),
    ("tail-causal-bf16", 2, 97, 97, 3, 3, 64, True, "bfloat16"),
    ("causal-sq<sk-d128", 1, 33, 113, 2, 2, 128, True, "bfloat16"),
    ("causal-sq>sk-d40", 1, 70, 19, 2, 2, 40, True, "float16"),
    ("len1-d256", 3, 1, 1, 2, 2, 256, False, "bfloat16"),
    ("gqa-causal-d32", 2, 130, 130, 4, 2, 32, True, "float16"),
]
# (name, q lengths, k lengths, h, h_k, d, causal, dtype)
VARLEN_CASES = [
    ("varlen-causal-bf16", [5, 108, 0, 87], [5, 108, 3, 87], 2, 2, 64, True, "bfloat16"),
    ("varlen-full-fp16", [1, 65, 31], [17, 65, 130], 4, 1, 96, False, "float16"),
]


def run_case_padded(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, b, sq, sk, h, hk, d, causal, dt = case
    dtype = getattr(torch, dt)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    out = ferroattn.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    ref, _ = testing.attention_ref(q, k, v, causal=causal)
    ref_lp, _ = testing.attention_ref(q, k, v, causal=causal, upcast=False)
    if not torch.isfinite(out).all():
        raise AssertionError("output has non-finite values")
    err, bound = testing.assert_close_to_ref(out, ref, ref_lp, name=name)
    return f"err {err:.2e} <= {bound:.2e}"


def run_case_varlen(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, lq, lk, h, hk, d, causal, dt = case
    dtype = getattr(torch, dt)
    cu_q = testing.random_cu_seqlens(lq, device="cuda")
    cu_k = testing.random_cu_seqlens(lk, device="cuda")
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype)
    out = ferroattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal)
    torch.cuda.synchronize()
    ref, _ = testing.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    ref_lp, _ = testing.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=False)
    if not torch.isfinite(out).all():
        raise AssertionError("output has non-finite values")
    err, bound = testing.assert_close_to_ref(out, ref, ref_lp, name=name)
    return f"err {err:.2e} <= {bound:.2e}"


def run_case_bogus_cu_seqlens(case) -> str:
    """The native entry point has no value check of cu_seqlens (the Python op does it, except
    during CUDA-graph capture): garbage values must stay inside the tensors (memcheck proves it)."""
    import torch
    from ferroattn import _native
    name, cu_q_vals, cu_k_vals = case
    q = torch.randn(40, 2, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q[:30]), torch.randn_like(q[:30])
    out = torch.empty_like(q)
    lse = torch.empty(2, 40, device="cuda", dtype=torch.float32)
    cu_q = torch.tensor(cu_q_vals, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(cu_k_vals, dtype=torch.int32, device="cuda")
    _native.attn_fwd(q, k, v, out, lse, cu_q, cu_k, 16, 16, 0.125, True, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return "stayed in bounds"


BOGUS_CASES = [
    ("bogus-cu-seqlens-decreasing", [0, 30, 5, 40], [0, 20, 3, 30]),
    ("bogus-cu-seqlens-out-of-range", [-7, 1000, 2_000_000_000, 40], [-100, 29, 31, 1 << 30]),
]


def run_cases(prog: str, description: str, cases, argv=None) -> int:
    """The command line of the sanitizer scripts (this one and sanitize_attention_bwd.py).

    ``cases`` are (name, run function, case tuple); ``--list`` prints each name and the rest of
    its tuple (no GPU needed). Otherwise every case runs (seed 0), printing ``PASS name: what it
    returned`` or ``FAIL name: error`` and finally ``<prog>: N/M cases passed``. Returns 0 when
    all passed, 1 when one failed, 3 without a CUDA GPU.
    """
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, _, c in cases:
            print(name, c[1:])
        return 0
    import torch
    if not torch.cuda.is_available():
        print(f"{prog}: cannot run: no CUDA GPU found", file=sys.stderr)
        return 3
    torch.manual_seed(0)
    failed = 0
    for name, fn, c in cases:
        try:
            print(f"PASS {name}: {fn(c)}", flush=True)
        except Exception as e:
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
    print(f"{prog}: {len(cases) - failed}/{len(cases)} cases passed", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    cases = ([(c[0], run_case_padded, c) for c in PADDED_CASES] + [(c[0], run_case_varlen, c) for c in VARLEN_CASES]
             + [(c[0], run_case_bogus_cu_seqlens, c) for c in BOGUS_CASES])
    return run_cases("sanitize_attention", "small attention calls for compute-sanitizer", cases, argv)


if __name__ == "__main__":
    sys.exit(main())
