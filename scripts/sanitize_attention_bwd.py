#!/usr/bin/env python3
"""A few small attention-BACKWARD calls for compute-sanitizer (memcheck, racecheck) on the GPU machine.

Run as ``compute-sanitizer --tool memcheck python scripts/sanitize_attention_bwd.py`` (with
``FERROATTN_LINEINFO=1``; scripts/gpu_check.sh runs it after scripts/sanitize_attention.py in the
memcheck and racecheck stages, with the kernel filter ``kns=attn_`` that matches the attn_fwd_*
and attn_bwd_* kernels). Sizes are tiny: the sanitizer slows kernels down by orders of magnitude.

Cases: tails (lengths and head dims that are not tile multiples), causal with s_q < s_k and
s_q > s_k (rows that see no key), GQA and causal s_q < s_k with head dim 256 (the single-pass wide dK/dV kernel), the deterministic d256 plan (wide kernel without dQ, then the dQ kernel), varlen with an
empty sequence, a sequence without keys and one without queries, the deterministic plan (run
twice: bitwise equal), and direct ``_native.attn_bwd`` calls with bogus cu_seqlens (values out
of order and out of range: the kernels must stay inside the tensors; both plans, plain and with
a local window, softcap and ALiBi). The attention variants (:func:`variant_cases`): a window
narrow enough that whole key tiles are skipped, causal + per-batch ALiBi, a
deterministic window + sinks case with s_q > s_k (rows that see no key), everything at head dim
256, a batch of 65537 (beyond the grid's 65535: two launches of every kernel of the plan, the
second over entries 65535 and 65536 with offset pointers), varlen with a window and softcap and a
deterministic causal window with sinks, and dropout on the Hopper kernel with and without its
mask warps (bitwise equal, deterministic plan); with sinks the gradient of ``s_aux`` is checked too.

Each autograd case runs forward + backward through ``ferroattn.flash_attn_func`` /
``flash_attn_varlen_func`` with a random ``grad_out`` and checks dq, dk, dv against an fp32
reference (autograd through plain torch attention) with the gradient pass rule (DESIGN §5:
``max|g - g_ref| <= 3 · max|g_lp - g_ref| + 1e-4``, g_lp = the same reference in the input
dtype), that every gradient is finite, and that dq rows of queries that see no key are exactly 0.
Prints one line per case and ``sanitize_attention_bwd: N/M cases passed``; exit 1 if a case
failed, 3 without a GPU, 0 otherwise (sanitizer findings come through the sanitizer's exit code).

``--list`` prints the cases without running them (no GPU needed).
"""
from __future__ import annotations

import os
import sys

# The command line is the forward script's (scripts/ is not a package; when run as a script, its
# folder is already on sys.path, not when a test imports this file by path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sanitize_attention import candidate_cases, run_cases, variant_kwargs  # noqa: E402

GRAD_FACTOR, GRAD_ATOL = 3.0, 1e-4
#: ds_aux sums one term per query row and head dim, exp(s_aux - lse) · dout · out, with ``out``
#: rounded to the input dtype: a sum of many independent rounding errors. Its bound adds
#: SINK_EPS · sqrt(sum of the squared terms) (:func:`_sink_scale`; 2^-6 = 8 units of bf16's
#: roundoff, several standard deviations of such a sum) to the pass rule's, whose low-precision
#: baseline -- a vector of a few heads -- is too noisy to bound it alone (a 3x ratio of two such
#: sums fails about one time in five).
SINK_EPS = 2.0**-6
DEVICE = "cuda"                # the CPU tests of this script's checks set "cpu"

# (name, b, s_q, s_k, h, h_k, d, causal, dtype, deterministic)
PADDED_CASES = [
    ("bwd-tail-full-fp16", 2, 97, 97, 3, 3, 64, False, "float16", False),
    ("bwd-causal-sq<sk-d128-bf16", 1, 33, 113, 2, 2, 128, True, "bfloat16", False),
    ("bwd-causal-sq>sk-d40-fp16", 1, 70, 19, 2, 2, 40, True, "float16", False),
    ("bwd-gqa-d256-bf16", 1, 65, 65, 4, 1, 256, False, "bfloat16", False),
    ("bwd-deterministic-gqa-causal-d96-fp16", 1, 150, 150, 4, 2, 96, True, "float16", True),
    ("bwd-causal-sq<sk-d256-fp16", 1, 70, 131, 2, 2, 256, True, "float16", False),
    ("bwd-deterministic-causal-d256-bf16", 1, 97, 97, 2, 1, 256, True, "bfloat16", True),
    # whole 64-row query tiles at head dims 64 / 128: what the tiled dq_accum takes
    ("bwd-whole-tiles-causal-sq<sk-d128-bf16", 2, 128, 150, 2, 1, 128, True, "bfloat16", False),
    ("bwd-whole-tiles-full-d64-fp16", 1, 192, 100, 2, 2, 64, False, "float16", False),
]
# (name, q lengths, k lengths, h, h_k, d, causal, dtype, deterministic)
VARLEN_CASES = [
    ("bwd-varlen-empty-causal-bf16", [5, 108, 0, 33], [5, 108, 3, 0], 2, 1, 64, True, "bfloat16", False),
]
# Variant cases; ``variant`` as in sanitize_attention.py (flash_attn keywords, "alibi": "h" / "bh",
# "sinks": True -- then s_aux requires grad and its gradient is checked). As there, every case but
# "all-variants" uses a precompiled variant kind and head dim.
# (name, b, s_q, s_k, h, h_k, d, dtype, deterministic, variant)
VARIANT_PADDED_CASES = [
    ("bwd-window-skips-key-tiles-bf16", 1, 300, 300, 2, 1, 64, "bfloat16", False, dict(window_size=(16, 16))),
    ("bwd-causal-alibi-bh-sq<sk-d128-fp16", 2, 70, 131, 2, 2, 128, "float16", False, dict(causal=True, alibi="bh")),
    ("bwd-deterministic-window-sinks-sq>sk-bf16", 1, 97, 40, 4, 2, 64, "bfloat16", True,
     dict(window_size=(10, 0), sinks=True)),
    ("bwd-all-variants-d256-bf16", 1, 65, 65, 2, 1, 256, "bfloat16", False,
     dict(window_size=(24, 8), softcap=3.0, alibi="h", sinks=True)),
    ("bwd-batch-65537-causal-window-sinks-fp16", 65537, 2, 3, 1, 1, 64, "float16", False,
     dict(causal=True, window_size=(1, 0), sinks=True)),
]
# (name, q lengths, k lengths, h, h_k, d, dtype, deterministic, variant)
VARIANT_VARLEN_CASES = [
    ("bwd-varlen-window-softcap-bf16", [5, 108, 0, 33], [5, 108, 3, 0], 2, 1, 64, "bfloat16", False,
     dict(window_size=(12, 3), softcap=1.5)),
    ("bwd-varlen-deterministic-causal-window-sinks-fp16", [1, 70, 31], [17, 65, 130], 4, 2, 128, "float16", True,
     dict(causal=True, window_size=(20, 0), sinks=True)),
]
# (name, cu_seqlens_q values, cu_seqlens_k values)
BOGUS_CASES = [
    ("bwd-bogus-cu-seqlens", [0, 30, 5, 40], [-100, 29, 31, 1 << 30]),
]


def attention_ref(q, k, v, causal: bool, dtype):
    """Attention in ``dtype`` with flash_attn semantics (bottom-right causal, GQA), safe to
    differentiate when a row sees no key (its probabilities are 0, so its gradients are 0).
    q (b, s_q, h, d), k/v (b, s_k, h_k, d) -> (b, s_q, h, d) in ``dtype``."""
    import torch
    from ferroattn import testing
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    if hk != h:
        kc, vc = kc.repeat_interleave(h // hk, dim=2), vc.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * d ** -0.5
    visible = testing.visible_mask(sq, sk, causal, device=q.device)
    empty = ~visible.any(dim=-1)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None], 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vc)


def _ref_grads(fn, leaves, dout, dtype):
    import torch
    xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
    out = fn(*xs, dtype)
    return torch.autograd.grad(out, xs, dout.to(dtype))


def _check(name, grads, ref, ref_lp, sink_scale: float = 0.0) -> str:
    """The gradient pass rule for (dq, dk, dv) and, when given, ds_aux (its atol widened by
    SINK_EPS · ``sink_scale``, :func:`_sink_scale`); every gradient finite."""
    import torch
    from ferroattn import testing
    parts = []
    for gname, g, r, rl in zip(("dq", "dk", "dv", "ds_aux"), grads, ref, ref_lp):
        if not torch.isfinite(g).all():
            raise AssertionError(f"{name}: {gname} has non-finite values")
        atol = GRAD_ATOL + (SINK_EPS * sink_scale if gname == "ds_aux" else 0.0)
        err, bound = testing.assert_close_to_ref(g, r, rl, factor=GRAD_FACTOR, atol=atol, name=f"{name} {gname}")
        parts.append(f"{gname} {err:.1e}<={bound:.1e}")
    return ", ".join(parts)


def run_case_padded(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, b, sq, sk, h, hk, d, causal, dt, det = case
    dtype = getattr(torch, dt)
    q = torch.randn(b, sq, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device=DEVICE, dtype=dtype)

    def ours():
        out = ferroattn.flash_attn_func(q, k, v, causal=causal, deterministic=det)
        return torch.autograd.grad(out, (q, k, v), dout)
    grads = ours()
    torch.cuda.synchronize()
    fn = lambda q_, k_, v_, dt_: attention_ref(q_, k_, v_, causal, dt_)  # noqa: E731
    msg = _check(name, grads, _ref_grads(fn, (q, k, v), dout, torch.float32), _ref_grads(fn, (q, k, v), dout, dtype))
    empty = ~testing.visible_mask(sq, sk, causal, device=q.device).any(dim=-1)
    if empty.any() and grads[0][:, empty].abs().max() != 0:
        raise AssertionError(f"{name}: dq rows of queries that see no key are not exactly 0")
    if det:
        again = ours()
        torch.cuda.synchronize()
        if not all(torch.equal(a, b_) for a, b_ in zip(grads, again)):
            raise AssertionError(f"{name}: deterministic backward differs between two runs")
        msg += ", bitwise equal twice"
    return msg


def _varlen_leaves(lq, lk, h, hk, d, dtype):
    """Random varlen inputs of sequence lengths lq / lk: cu_seqlens_q/k, q, k, v (leaves that
    require grad) and dout."""
    import torch
    from ferroattn import testing
    cu_q = testing.random_cu_seqlens(lq, device=DEVICE)
    cu_k = testing.random_cu_seqlens(lk, device=DEVICE)
    q = torch.randn(sum(lq), h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lk), hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lk), hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(sum(lq), h, d, device=DEVICE, dtype=dtype)
    return cu_q, cu_k, q, k, v, dout


def run_case_varlen(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, lq, lk, h, hk, d, causal, dt, det = case
    dtype = getattr(torch, dt)
    cu_q, cu_k, q, k, v, dout = _varlen_leaves(lq, lk, h, hk, d, dtype)
    out = ferroattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, deterministic=det)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()

    def fn(q_, k_, v_, dt_):
        outs, q0, k0 = [], 0, 0
        for a, c in zip(lq, lk):
            if a:
                if c:
                    outs.append(attention_ref(q_[None, q0:q0 + a], k_[None, k0:k0 + c], v_[None, k0:k0 + c],
                                              causal, dt_)[0])
                else:  # no keys: output 0 (and no gradient)
                    outs.append(q_[q0:q0 + a] * 0)
            q0, k0 = q0 + a, k0 + c
        return torch.cat(outs) + 0 * (k_.sum() + v_.sum())  # keep k, v in the graph (zero grads where unseen)
    msg = _check(name, grads, _ref_grads(fn, (q, k, v), dout, torch.float32), _ref_grads(fn, (q, k, v), dout, dtype))
    q0 = 0
    for a, c in zip(lq, lk):
        if a and not c and grads[0][q0:q0 + a].abs().max() != 0:
            raise AssertionError(f"{name}: dq of a sequence without keys is not exactly 0")
        q0 += a
    return msg


def _variant_leaves(variant, b, h):
    """The flash_attn keywords of a variant case (sanitize_attention.variant_kwargs) and the extra
    leaf to differentiate: s_aux (requires grad) when the case has sinks."""
    kw = variant_kwargs(variant, b, h, DEVICE)
    if "s_aux" in kw:
        kw["s_aux"].requires_grad_(True)
        return kw, (kw["s_aux"],)
    return kw, ()


def _sink_scale(kw, out, lse, dout) -> float:
    """max over heads of sqrt(sum over rows and head dims of (exp(s_aux - lse) · dout · out)^2)
    (0 without sinks): the scale of ds_aux's rounding error. Padded: lse (b, h, s_q), out/dout
    (b, s_q, h, d); varlen: lse (h, total_q), out/dout (total_q, h, d). Rows with lse = +inf
    (outside every sequence) count 0."""
    s_aux = kw.get("s_aux")
    if s_aux is None:
        return 0.0
    sq = (dout.double() * out.double()).square().sum(-1)        # (b, s_q, h) or (total_q, h)
    sink = s_aux.detach().double()
    if lse.dim() == 3:
        p = (sink[None, :, None] - lse.double()).exp()          # (b, h, s_q)
        return float((p.square() * sq.transpose(1, 2)).sum(dim=(0, 2)).max().sqrt())
    p = (sink[:, None] - lse.double()).exp()                     # (h, total_q)
    return float((p.square() * sq.transpose(0, 1)).sum(dim=1).max().sqrt())


def _ref_kwargs(kw):
    """(causal, the other keywords) for ferroattn.testing.attention_grads_ref."""
    rk = dict(kw)
    return rk.pop("causal", False), rk


def _bitwise_again(name, grads, again) -> str:
    """The deterministic plan's promise: a second run gives the same bits (every gradient)."""
    import torch
    if not all(torch.equal(a, b_) for a, b_ in zip(grads, again)):
        raise AssertionError(f"{name}: deterministic backward differs between two runs")
    return ", bitwise equal twice"


def run_case_variant_padded(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, b, sq, sk, h, hk, d, dt, det, variant = case
    dtype = getattr(torch, dt)
    q = torch.randn(b, sq, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device=DEVICE, dtype=dtype)
    kw, extra = _variant_leaves(variant, b, h)

    def ours():
        out, lse, _ = ferroattn.flash_attn_func(q, k, v, deterministic=det, return_attn_probs=True, **kw)
        return torch.autograd.grad(out, (q, k, v) + extra, dout), out.detach(), lse.detach()
    grads, out, lse = ours()
    torch.cuda.synchronize()
    causal, rk = _ref_kwargs(kw)
    ref = testing.attention_grads_ref(q, k, v, dout, causal, **rk)
    ref_lp = testing.attention_grads_ref(q, k, v, dout, causal, upcast=False, **rk)
    msg = _check(name, grads, ref, ref_lp, _sink_scale(kw, out, lse, dout))
    empty = ~testing.visible_mask(sq, sk, causal, rk.get("window_size", (-1, -1)), device=q.device).any(dim=-1)
    if empty.any() and grads[0][:, empty].abs().max() != 0:
        raise AssertionError(f"{name}: dq rows of queries that see no key are not exactly 0")
    if det:
        again, _, _ = ours()
        torch.cuda.synchronize()
        msg += _bitwise_again(name, grads, again)
    return msg


def run_case_variant_varlen(case) -> str:
    import torch
    import ferroattn
    from ferroattn import testing
    name, lq, lk, h, hk, d, dt, det, variant = case
    dtype = getattr(torch, dt)
    cu_q, cu_k, q, k, v, dout = _varlen_leaves(lq, lk, h, hk, d, dtype)
    kw, extra = _variant_leaves(variant, len(lq), h)

    def ours():
        out, lse, _ = ferroattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), deterministic=det,
                                                       return_attn_probs=True, **kw)
        return torch.autograd.grad(out, (q, k, v) + extra, dout), out.detach(), lse.detach()
    grads, out, lse = ours()
    torch.cuda.synchronize()
    causal, rk = _ref_kwargs(kw)
    ref = testing.attention_grads_ref(q, k, v, dout, causal, None, cu_q, cu_k, max_seqlen_k=max(lk), **rk)
    ref_lp = testing.attention_grads_ref(q, k, v, dout, causal, None, cu_q, cu_k, upcast=False,
                                         max_seqlen_k=max(lk), **rk)
    msg = _check(name, grads, ref, ref_lp, _sink_scale(kw, out, lse, dout))
    q0 = 0
    for a, c in zip(lq, lk):
        if a and not c and grads[0][q0:q0 + a].abs().max() != 0:
            raise AssertionError(f"{name}: dq of a sequence without keys is not exactly 0")
        q0 += a
    if det:
        again, _, _ = ours()
        torch.cuda.synchronize()
        msg += _bitwise_again(name, grads, again)
    return msg


# (name, b, s_q, s_k, h, h_k, d, causal): dropout on the Hopper backward with and without the
# mask warps (knob attn_sm90_bwd_mask_warps), the deterministic plan so all bits compare
DROPOUT_MASK_WARPS_CASES = [
    ("bwd-dropout-mask-warps-causal-sq<sk-d128-bf16", 1, 97, 150, 4, 2, 128, True),
    ("bwd-dropout-mask-warps-full-d64-bf16", 2, 70, 65, 2, 1, 64, False),
]


def run_case_dropout_mask_warps(case) -> str:
    """Dropout 0.2 under the sm90 family, deterministic: the mask warps' gradients are the
    consumers' bits (the same keep bits, the same products), every gradient finite."""
    import torch
    import ferroattn
    from ferroattn.knobs import override
    name, b, sq, sk, h, hk, d, causal = case
    q = torch.randn(b, sq, h, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device=DEVICE, dtype=torch.bfloat16)

    def grads(mask_warps):
        with override(attn_bwd_family="sm90", attn_sm90_bwd_mask_warps=mask_warps):
            torch.manual_seed(3)
            out = ferroattn.flash_attn_func(q, k, v, dropout_p=0.2, causal=causal, deterministic=True)
            g = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        return g

    base, warps = grads("0"), grads("1")
    for n_, a, b_ in zip(("dq", "dk", "dv"), base, warps):
        if not torch.isfinite(b_).all():
            raise AssertionError(f"{name}: {n_} is not finite")
        if not torch.equal(a, b_):
            raise AssertionError(f"{name}: {n_} differs with the mask warps")
    return "mask warps' gradients bitwise equal to the consumers'"


def run_case_bogus_cu_seqlens(case) -> str:
    """The native entry point has no value check of cu_seqlens (the Python op does it, except
    during CUDA-graph capture): garbage values must stay inside the tensors (memcheck proves it),
    for both backward plans (atomics and deterministic)."""
    import torch
    from ferroattn import _native
    from ferroattn.ops.variant import AttnVariant
    name, cu_q_vals, cu_k_vals = case
    dt = torch.float16
    q = torch.randn(40, 2, 64, device=DEVICE, dtype=dt)
    k, v = torch.randn_like(q[:30]), torch.randn_like(q[:30])
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(2, 40, device=DEVICE, dtype=torch.float32)
    cu_q = torch.tensor(cu_q_vals, dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor(cu_k_vals, dtype=torch.int32, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream
    local = AttnVariant(window_left=3, window_right=2, softcap=5.0,
                        alibi_slopes=torch.rand(len(cu_q_vals) - 1, 2, device=DEVICE, dtype=torch.float32),
                        sinks=torch.randn(2, device=DEVICE, dtype=torch.float32))
    for variant in (AttnVariant(causal=True), local):
        for det in (False, True):
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            softmax_d = torch.empty_like(lse)
            dq_accum = None if det else torch.empty(q.shape, device=DEVICE, dtype=torch.float32)
            _native.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_d, dq_accum, cu_q, cu_k, 16, 16,
                             0.125, variant, det, stream)
            torch.cuda.synchronize()
    return "stayed in bounds (atomic and deterministic plans; causal, and window + softcap + ALiBi)"


def cases():
    """The plain cases (no window, softcap, ALiBi or sinks) and the bogus cu_seqlens calls:
    (name, run function, case tuple)."""
    return ([(c[0], run_case_padded, c) for c in PADDED_CASES] + [(c[0], run_case_varlen, c) for c in VARLEN_CASES]
            + [(c[0], run_case_bogus_cu_seqlens, c) for c in BOGUS_CASES])


def variant_cases():
    """The attention-variant cases: (name, run function, case tuple)."""
    return ([(c[0], run_case_variant_padded, c) for c in VARIANT_PADDED_CASES]
            + [(c[0], run_case_variant_varlen, c) for c in VARIANT_VARLEN_CASES])


#: (tuning knobs, case names): the Hopper backward's A/B candidate forms (sanitize_attention.py's
#: CANDIDATE_FORMS), the family knob at sm90 so the head dim 64 cases reach the Hopper kernel
CANDIDATE_FORMS = [
    ({"attn_bwd_family": "sm90", "attn_sm90_bwd_dq_overlap": "1"},
     ["bwd-tail-full-fp16", "bwd-causal-sq<sk-d128-bf16", "bwd-causal-alibi-bh-sq<sk-d128-fp16",
      "bwd-window-skips-key-tiles-bf16"]),
    ({"attn_bwd_family": "sm90", "attn_sm90_bwd_varlen": "1"},
     ["bwd-varlen-empty-causal-bf16", "bwd-varlen-window-softcap-bf16",
      "bwd-varlen-deterministic-causal-window-sinks-fp16"]),
    ({"attn_bwd_family": "sm90", "attn_sm90_bwd_dq_tiled": "1"},
     ["bwd-whole-tiles-causal-sq<sk-d128-bf16", "bwd-whole-tiles-full-d64-fp16"]),
    ({"attn_bwd_family": "sm90", "attn_sm90_bwd_dq_tiled": "1", "attn_sm90_bwd_dq_overlap": "1"},
     ["bwd-whole-tiles-causal-sq<sk-d128-bf16"]),
    # the deterministic plan on the Hopper kernel (without dQ, then the dQ kernel)
    ({"attn_bwd_family": "sm90"},
     ["bwd-deterministic-gqa-causal-d96-fp16", "bwd-deterministic-window-sinks-sq>sk-bf16"]),
]


def all_cases():
    """What the script runs: :func:`cases`, :func:`variant_cases`, then some of them under the
    candidate forms' knobs (:data:`CANDIDATE_FORMS`), then the mask warps' dropout pairs
    (:data:`DROPOUT_MASK_WARPS_CASES`)."""
    base = cases() + variant_cases()
    return (base + candidate_cases(base, CANDIDATE_FORMS)
            + [(c[0], run_case_dropout_mask_warps, c) for c in DROPOUT_MASK_WARPS_CASES])


def main(argv=None) -> int:
    return run_cases("sanitize_attention_bwd", "small attention-backward calls for compute-sanitizer", all_cases(),
                     argv)


if __name__ == "__main__":
    sys.exit(main())
