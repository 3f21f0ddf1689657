#!/usr/bin/env python3
"""A few small attention calls for compute-sanitizer (memcheck, racecheck) on the GPU machine.

Run as ``compute-sanitizer --tool memcheck python scripts/sanitize_attention.py`` (with
``FERROATTN_LINEINFO=1`` so reports carry source lines). The cases cover tails (sequence
lengths and head dims that are not multiples of the tile), causal with s_q < s_k and s_q > s_k,
length 1, GQA, both dtypes, and varlen with an empty sequence; and the attention variants: a
local window narrow enough that whole key tiles are skipped, a window with only its left side
set and s_q > s_k (rows that see no key), a causal window with softcap at head dim 256, ALiBi
(per head and per batch entry), sinks (rows that see no key then have LSE = the sink), all of
them at once, varlen with a window and softcap and with causal sinks, and a batch of 65537
(beyond the grid's 65535: two launches, the second over entries 65535 and 65536 with offset
pointers), padded and varlen (with ALiBi). Then some of them again under the tuning knobs of the
Hopper forms the default cases do not reach or that are A/B candidates (:data:`CANDIDATE_FORMS`:
the non-persistent forms, varlen on the Hopper kernel, the dedicated d 192 kernel). Sizes are tiny: the
sanitizer slows kernels down by orders of magnitude.

Each case also checks its output against ``ferroattn.testing`` (DESIGN §5 pass rule) and that
every output element was written (the output buffer is never pre-filled by us, so a NaN or
an inf in it means an unwritten or wrong value); the variant cases check the LSE as well.
Prints one line per case; exit 1 if any case failed, 0 otherwise (sanitizer findings are
reported through the sanitizer's own exit code).

``--list`` prints the cases without running them (no GPU needed).
"""
from __future__ import annotations

import argparse
import sys
import traceback

DEVICE = "cuda"                # the CPU tests of the variant cases set "cpu" (emulated launchers)
LSE_ATOL = 2e-3                # the LSE (fp32) against the fp32 reference: LSE_ATOL · (1 + max|finite ref|)

# (name, b, s_q, s_k, h, h_k, d, causal, dtype)
PADDED_CASES = [
    ("tail-full-fp16", 2, 97, 97, 3, 3, 64, False, "float16"),
    ("tail-causal-bf16", 2, 97, 97, 3, 3, 64, True, "bfloat16"),
    ("causal-sq<sk-d128", 1, 33, 113, 2, 2, 128, True, "bfloat16"),
    ("causal-sq>sk-d40", 1, 70, 19, 2, 2, 40, True, "float16"),
    ("len1-d256", 3, 1, 1, 2, 2, 256, False, "bfloat16"),
    ("gqa-causal-d32", 2, 130, 130, 4, 2, 32, True, "float16"),
    ("decode-splits-gqa-d128", 2, 1, 3000, 8, 2, 128, True, "bfloat16"),   # the kv-cache kernel's route
    ("tail-causal-gqa-d160", 1, 97, 113, 2, 1, 160, True, "bfloat16"),
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


# Variant cases. ``variant``: flash_attn keyword arguments (causal, window_size, softcap), plus
# "alibi": "h" (slopes (h,)) or "bh" ((b, h)) and "sinks": True (s_aux (h,) fp32). The softcaps
# are small (2-3) so that they bend the unit-scale scores of random inputs visibly (30 would be
# within the output's rounding of no softcap at all). Every case but "all-variants" uses a
# variant kind and head dim that `ferroattn precompile` builds (src/tuning/attention.rs,
# production_points), so the sanitizer stage compiles one new kernel, not one per case.
# (name, b, s_q, s_k, h, h_k, d, dtype, variant)
VARIANT_PADDED_CASES = [
    ("window-skips-key-tiles-bf16", 1, 300, 300, 2, 1, 64, "bfloat16", dict(window_size=(16, 16))),
    ("window-left-only-sq>sk-fp16", 1, 200, 70, 2, 2, 64, "float16", dict(window_size=(8, -1))),
    ("causal-alibi-bh-tail-bf16", 2, 97, 113, 4, 2, 64, "bfloat16", dict(causal=True, alibi="bh")),
    ("sinks-causal-sq>sk-bf16", 1, 70, 19, 2, 2, 64, "bfloat16", dict(causal=True, sinks=True)),
    ("causal-window-softcap-sq<sk-d256-fp16", 1, 70, 200, 2, 1, 256, "float16",
     dict(causal=True, window_size=(40, 0), softcap=2.0)),
    ("all-variants-d128-fp16", 1, 65, 130, 2, 1, 128, "float16",
     dict(window_size=(24, 8), softcap=3.0, alibi="h", sinks=True)),
    ("batch-65537-causal-window-sinks-bf16", 65537, 2, 3, 1, 1, 64, "bfloat16",
     dict(causal=True, window_size=(1, 0), sinks=True)),
]
# (name, q lengths, k lengths, h, h_k, d, dtype, variant)
VARIANT_VARLEN_CASES = [
    ("varlen-window-softcap-bf16", [5, 130, 0, 87], [5, 260, 3, 40], 2, 1, 64, "bfloat16",
     dict(window_size=(20, 4), softcap=2.5)),
    ("varlen-causal-sinks-d128-fp16", [1, 65, 31, 7], [17, 65, 130, 0], 4, 2, 128, "float16",
     dict(causal=True, sinks=True)),
    ("varlen-batch-65537-alibi-bh-bf16", [2, 1, 3] * 21845 + [2, 2], [3, 3, 1] * 21845 + [0, 4], 1, 1, 64,
     "bfloat16", dict(alibi="bh")),
]


def variant_kwargs(variant: dict, b: int, h: int, device) -> dict:
    """flash_attn keyword arguments of a variant case: ALiBi slopes (h,) / (b, h) fp32 in
    [2^-8, 1) (the usual geometric range), sinks (h,) fp32 standard normal."""
    import torch
    kw = dict(variant)
    alibi, sinks = kw.pop("alibi", None), kw.pop("sinks", False)
    if alibi is not None:
        shape = (h,) if alibi == "h" else (b, h)
        kw["alibi_slopes"] = torch.exp2(-8 * torch.rand(shape, device=device))
    if sinks:
        kw["s_aux"] = torch.randn(h, device=device)
    return kw


def check_lse(name: str, lse, ref_lse) -> None:
    """The LSE (fp32) within LSE_ATOL · (1 + max|finite ref|) of the reference's; equal
    infinities (rows that see no key, without sinks) count as equal, a NaN fails."""
    import torch
    from ferroattn import testing
    finite = ref_lse[torch.isfinite(ref_lse)]
    bound = LSE_ATOL * (1.0 + (float(finite.abs().max()) if finite.numel() else 0.0))
    err = testing.max_abs_diff(lse, ref_lse)
    if not err <= bound:
        raise AssertionError(f"{name}: max|lse - ref| = {err:.3e} > {bound:.3e}")


def run_case_variant_padded(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, b, sq, sk, h, hk, d, dt, variant = case
    dtype = getattr(torch, dt)
    q = torch.randn(b, sq, h, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype)
    kw = variant_kwargs(variant, b, h, DEVICE)
    out, lse, _ = ferroattn.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    torch.cuda.synchronize()
    causal = kw.pop("causal", False)
    ref, ref_lse = testing.attention_ref(q, k, v, causal, **kw)
    ref_lp, _ = testing.attention_ref(q, k, v, causal, upcast=False, **kw)
    if not torch.isfinite(out).all():
        raise AssertionError("output has non-finite values")
    err, bound = testing.assert_close_to_ref(out, ref, ref_lp, name=name)
    check_lse(name, lse, ref_lse)
    return f"err {err:.2e} <= {bound:.2e}, lse ok"


def run_case_variant_varlen(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, lq, lk, h, hk, d, dt, variant = case
    dtype = getattr(torch, dt)
    cu_q = testing.random_cu_seqlens(lq, device=DEVICE)
    cu_k = testing.random_cu_seqlens(lk, device=DEVICE)
    q = torch.randn(sum(lq), h, d, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lk), hk, d, device=DEVICE, dtype=dtype)
    v = torch.randn(sum(lk), hk, d, device=DEVICE, dtype=dtype)
    kw = variant_kwargs(variant, len(lq), h, DEVICE)
    out, lse, _ = ferroattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True,
                                                   **kw)
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise AssertionError("output has non-finite values")
    if len(lq) > 1000:  # many sequences of a few lengths: the reference groups them (one call per shape)
        ref, ref_lse = _grouped_varlen_ref(q, k, v, lq, lk, kw, True)
        ref_lp, _ = _grouped_varlen_ref(q, k, v, lq, lk, kw, False)
    else:
        ref, ref_lse = testing.attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max(lk), **kw)
        ref_lp, _ = testing.attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, max_seqlen_k=max(lk), **kw)
    err, bound = testing.assert_close_to_ref(out, ref, ref_lp, name=name)
    check_lse(name, lse, ref_lse)
    return f"err {err:.2e} <= {bound:.2e}, lse ok"


def _grouped_varlen_ref(q, k, v, lq, lk, kw, upcast):
    """attention_varlen_ref for a batch of many short sequences: the sequences of one (s_q, s_k)
    pair go through one padded attention_ref call (the window normalised with max_seqlen_k, as
    flash_attn does in varlen mode). Returns (out (total_q, h, d) in fp32 or q's dtype, lse (h, total_q))."""
    import torch
    from ferroattn import testing
    kw = dict(kw)
    causal = kw.pop("causal", False)
    slopes = kw.pop("alibi_slopes", None)
    total_q, h = q.shape[0], q.shape[1]
    out = torch.zeros(total_q, h, v.shape[-1], dtype=torch.float32 if upcast else q.dtype, device=q.device)
    lse = torch.full((h, total_q), float("inf"), dtype=torch.float32, device=q.device)
    starts_q = [0]
    starts_k = [0]
    for a, c in zip(lq, lk):
        starts_q.append(starts_q[-1] + a)
        starts_k.append(starts_k[-1] + c)
    groups = {}
    for i, (a, c) in enumerate(zip(lq, lk)):
        groups.setdefault((a, c), []).append(i)
    for (a, c), seqs in groups.items():
        if a == 0:
            continue
        idx = torch.tensor(seqs, device=q.device)
        rows_q = (torch.tensor([starts_q[i] for i in seqs], device=q.device)[:, None]
                  + torch.arange(a, device=q.device)[None, :])
        rows_k = (torch.tensor([starts_k[i] for i in seqs], device=q.device)[:, None]
                  + torch.arange(c, device=q.device)[None, :])
        qs, ks, vs = q[rows_q], k[rows_k], v[rows_k]
        s = None if slopes is None else (slopes[idx] if slopes.dim() == 2 else slopes)
        o, l = testing.attention_ref(qs, ks, vs, causal, alibi_slopes=s, upcast=upcast,
                                     window_seqlen_k=max(lk), **kw)
        out[rows_q.reshape(-1)] = o.reshape(-1, h, v.shape[-1]).to(out.dtype)
        lse[:, rows_q.reshape(-1)] = l.permute(1, 0, 2).reshape(h, -1)
    return out, lse


def run_case_bogus_cu_seqlens(case) -> str:
    """The native entry point has no value check of cu_seqlens (the Python op does it, except
    during CUDA-graph capture): garbage values must stay inside the tensors (memcheck proves it)."""
    import torch
    from ferroattn import _native
    from ferroattn.ops.variant import AttnVariant
    name, cu_q_vals, cu_k_vals = case
    q = torch.randn(40, 2, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn_like(q[:30]), torch.randn_like(q[:30])
    out = torch.empty_like(q)
    lse = torch.empty(2, 40, device="cuda", dtype=torch.float32)
    cu_q = torch.tensor(cu_q_vals, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(cu_k_vals, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    _native.attn_fwd(q, k, v, out, lse, cu_q, cu_k, 16, 16, 0.125, AttnVariant(causal=True), stream)
    # a local window with ALiBi and sinks: the key-tile skipping must stay inside the tensors too
    variant = AttnVariant(window_left=3, window_right=2, softcap=5.0,
                          alibi_slopes=torch.rand(len(cu_q_vals) - 1, 2, device="cuda"),
                          sinks=torch.randn(2, device="cuda"))
    _native.attn_fwd(q, k, v, out, lse, cu_q, cu_k, 16, 16, 0.125, variant, stream)
    torch.cuda.synchronize()
    return "stayed in bounds (causal; window + softcap + ALiBi + sinks)"


BOGUS_CASES = [
    ("bogus-cu-seqlens-decreasing", [0, 30, 5, 40], [0, 20, 3, 30]),
    ("bogus-cu-seqlens-out-of-range", [-7, 1000, 2_000_000_000, 40], [-100, 29, 31, 1 << 30]),
]


def _short(x) -> str:
    """repr of a case field, a list longer than 8 items shown by its first 6 and its length, a
    function by its name."""
    if callable(x):
        return x.__name__
    if isinstance(x, list) and len(x) > 8:
        return "[" + ", ".join(map(repr, x[:6])) + f", ... ({len(x)} items)]"
    return repr(x)


def run_cases(prog: str, description: str, cases, argv=None) -> int:
    """The command line of the sanitizer scripts (this one and sanitize_attention_bwd.py).

    ``cases`` are (name, run function, case tuple); ``--list`` prints each name and the rest of
    its tuple (no GPU needed); ``--only a,b`` keeps the cases whose name contains a or b. Otherwise every case runs (seed 0), printing ``PASS name: what it
    returned`` or ``FAIL name: error`` and finally ``<prog>: N/M cases passed``. Returns 0 when
    all passed, 1 when one failed, 3 without a CUDA GPU.
    """
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the cases whose name contains one")
    args = ap.parse_args(argv)
    if args.only:
        keys = [k for k in args.only.split(",") if k]
        cases = [c for c in cases if any(k in c[0] for k in keys)]
    if args.list:
        for name, _, c in cases:
            print(name, "(" + ", ".join(_short(x) for x in c[1:]) + ")")
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


def cases():
    """The plain cases (no window, softcap, ALiBi or sinks) and the bogus cu_seqlens calls:
    (name, run function, case tuple)."""
    return ([(c[0], run_case_padded, c) for c in PADDED_CASES] + [(c[0], run_case_varlen, c) for c in VARLEN_CASES]
            + [(c[0], run_case_bogus_cu_seqlens, c) for c in BOGUS_CASES])


def variant_cases():
    """The attention-variant cases: (name, run function, case tuple)."""
    return ([(c[0], run_case_variant_padded, c) for c in VARIANT_PADDED_CASES]
            + [(c[0], run_case_variant_varlen, c) for c in VARIANT_VARLEN_CASES])


#: (tuning knobs, names of the cases above to run again under them): the Hopper forms that are A/B
#: candidates (docs/DEVELOPING.md, "Tuning knobs")
CANDIDATE_FORMS = [
    # the persistent form with the separate release is what the form rule takes for short keys and
    # masked calls, the cases' defaults; the non-persistent forms (together at d 64, separate
    # above) what it takes for long unmasked keys, which the tiny cases never reach
    ({"attn_sm90_fwd_persistent": "0"},
     ["tail-causal-bf16", "causal-sq>sk-d40", "len1-d256", "causal-window-softcap-sq<sk-d256-fp16",
      "all-variants-d128-fp16", "sinks-causal-sq>sk-bf16"]),
    ({"attn_sm90_fwd_kv_release": "together", "attn_sm90_fwd_persistent": "0"},
     ["tail-causal-bf16", "causal-sq>sk-d40", "all-variants-d128-fp16"]),
    ({"attn_sm90_fwd_varlen": "1"},
     ["varlen-causal-bf16", "varlen-full-fp16", "varlen-window-softcap-bf16", "varlen-causal-sinks-d128-fp16"]),
    ({"attn_sm90_fwd_d192": "1"}, ["tail-causal-gqa-d160"]),
]


def run_under_knobs(case) -> str:
    """Run ``(knobs, run function, inner case)``: the inner case with the tuning knobs set."""
    from ferroattn.knobs import override
    knobs, fn, inner = case
    with override(**knobs):
        return fn(inner)


def candidate_cases(base, forms):
    """The cases of ``base`` named in ``forms`` ((knobs, names) pairs), each under its knobs:
    (``name@knob=value,...``, run_under_knobs, (knobs, run function, case tuple)). KeyError
    naming a case that ``base`` lacks."""
    by_name = {name: (fn, c) for name, fn, c in base}
    out = []
    for knobs, names in forms:
        label = ",".join(f"{k}={v}" for k, v in knobs.items())
        for name in names:
            if name not in by_name:
                raise KeyError(f"CANDIDATE_FORMS: no case named {name!r}")
            fn, c = by_name[name]
            out.append((f"{name}@{label}", run_under_knobs, (knobs, fn, c)))
    return out


def all_cases():
    """What the script runs: :func:`cases`, :func:`variant_cases`, then some of them under the
    candidate forms' knobs (:data:`CANDIDATE_FORMS`)."""
    base = cases() + variant_cases()
    return base + candidate_cases(base, CANDIDATE_FORMS)


def main(argv=None) -> int:
    return run_cases("sanitize_attention", "small attention calls for compute-sanitizer", all_cases(), argv)


if __name__ == "__main__":
    sys.exit(main())
