"""Adversarial GPU tests of the backward (``-m gpu``; skipped without CUDA): what only a GPU can
show. Odd-but-valid usage must give the right gradients (flash-attention pass rule against the
fp32 reference, factor 3); rejected calls of ``_native.attn_bwd`` with real device tensors must
leave the device usable (a valid backward afterwards, no sticky CUDA error); cu_seqlens corrupted
behind the value check must neither fault nor poison the context (subprocess). The CPU side of
the same findings: tests/test_adversarial_bwd.py. Batches beyond the grid's 65535 (split over
launches) forward and backward, padded and varlen, with dropout and S_dmask, in a CUDA graph.
Kept to a few seconds on an H200 (the 64-bit offset test allocates ~17 GiB, the S_dmask of the
large-batch dropout tests ~2 GiB, but they compute on small problems).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ferroattn import _native, errors
from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ferroattn.ops import attention as fwd_mod
from ferroattn.ops.variant import AttnVariant
from ferroattn.testing import assert_close_to_ref, attention_grads_ref, attention_ref, random_cu_seqlens

from _gpu_common import BF16, DEV, FP16, assert_lse_close, capture_graph, poison_allocator
from _gpu_common import check_grads as _check_grads
from _gpu_common import rand_leaf as _rand

pytestmark = pytest.mark.gpu

def _valid_backward_ok():
    """A valid forward + backward after a rejected call: right gradients, no sticky error."""
    torch.manual_seed(99)
    q, k, v = _rand(2, 33, 4, 64), _rand(2, 41, 2, 64), _rand(2, 41, 2, 64)
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    _check_grads(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, True)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# odd but valid usage: right gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_problems_backward_of_sum(case):
    """out.sum().backward() on empty shapes (the expanded empty dout was rejected before the fix);
    s_k = 0: dq = 0; s_q = 0: dk = dv = 0 (written by the kernels, not left uninitialised)."""
    qs, ks = {"batch0": ((0, 5, 4, 64), (0, 7, 2, 64)), "seqlen_q0": ((2, 0, 4, 64), (2, 7, 2, 64)),
              "seqlen_k0": ((2, 5, 4, 64), (2, 0, 2, 64))}[case]
    q, k, v = _rand(*qs), _rand(*ks), _rand(*ks)
    for deterministic in (False, True):
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        out.sum().backward()
        torch.cuda.synchronize()
        for x in (q, k, v):
            assert x.grad.shape == x.shape and torch.all(x.grad == 0)
            x.grad = None
    _valid_backward_ok()


def test_expanded_kv_heads_gradients_equal_mqa():
    """k/v (b, s, 1, d).expand(b, s, h, d) (stride-0 heads): dk/dv are summed over the heads by the
    expand's backward and must equal the MQA gradients (h_k = 1)."""
    torch.manual_seed(1)
    q, k1, v1 = _rand(2, 65, 4, 64), _rand(2, 77, 1, 64), _rand(2, 77, 1, 64)
    dout = torch.randn(2, 65, 4, 64, dtype=BF16, device=DEV)
    out = flash_attn_func(q, k1.expand(2, 77, 4, 64), v1.expand(2, 77, 4, 64), causal=True, deterministic=True)
    got = torch.autograd.grad(out, (q, k1, v1), dout)
    _check_grads(got, q, k1, v1, dout, True)


def test_overlapping_as_strided_inputs_gradients():
    """q and k as overlapping windows of one buffer: the gradient reaches the buffer summed."""
    torch.manual_seed(2)
    buf = _rand(2 * 4096)
    q = buf.as_strided((2, 100, 2, 64), (4096, 16, 64, 1))
    k = buf.as_strided((2, 120, 1, 64), (4096, 8, 64, 1), 8)
    v = _rand(2, 120, 1, 64)
    dout = torch.randn(2, 100, 2, 64, dtype=BF16, device=DEV)
    out = flash_attn_func(q, k, v, causal=False)
    (g_buf,) = torch.autograd.grad(out, buf, dout)
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    refs = attention_grads_ref(qd, kd, vd, dout, False)
    ref = torch.zeros(2 * 4096, dtype=torch.float32, device=DEV)
    # accumulate the reference the way autograd does for as_strided views: through index_add
    idx_q = torch.arange(2 * 4096, device=DEV).as_strided((2, 100, 2, 64), (4096, 16, 64, 1))
    idx_k = torch.arange(2 * 4096, device=DEV).as_strided((2, 120, 1, 64), (4096, 8, 64, 1), 8)
    ref.index_add_(0, idx_q.reshape(-1), refs[0].reshape(-1).float())
    ref.index_add_(0, idx_k.reshape(-1), refs[1].reshape(-1).float())
    scale = max(ref.abs().max().item(), 1e-3)
    assert (g_buf.float() - ref).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("scale", [1e-50, -1e-50])
def test_scale_zero_in_f32_backward(scale):
    """0 < |scale| <= 2^-150 (0 in fp32): the backward used to be rejected ("softmax_scale ... got
    0"); now uniform attention with dq = dk = 0 and dv = Pᵀ dout."""
    torch.manual_seed(3)
    q, k, v = _rand(2, 33, 4, 64), _rand(2, 45, 2, 64), _rand(2, 45, 2, 64)
    out = flash_attn_func(q, k, v, softmax_scale=scale)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    _check_grads(got, q, k, v, dout, False, 0.0)
    assert torch.all(got[0] == 0) and torch.all(got[1] == 0)


def test_offsets_past_2_pow_31_elements_backward():
    """q, k, dout read and dq/dk/dv written 2^31 elements (4 GiB) past their base pointer: the
    backward's offsets must be 64-bit. dq/dk/dv are given to the native launcher as views of big
    buffers too, and must equal the op's results."""
    torch.manual_seed(4)
    big = 2**31
    shapes = {"q": (2, 64, 4, 64), "k": (2, 96, 2, 64), "dout": (2, 64, 4, 64)}

    def far(shape):  # batch 1 starts 2^31 elements after batch 0
        n = shape[1] * shape[2] * shape[3]
        return torch.empty(big + n, dtype=BF16, device=DEV).as_strided(
            shape, (big, shape[2] * shape[3], shape[3], 1))

    q, k, dout = (far(shapes[n]) for n in ("q", "k", "dout"))
    for x in (q, k, dout):
        x.copy_(torch.randn(x.shape, device=DEV))
    v = torch.randn(2, 96, 2, 64, dtype=BF16, device=DEV)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qc, kc, doc = (x.detach().contiguous() for x in (q, k, dout))
    _check_grads((dq, dk, dv), qc.requires_grad_(), kc.requires_grad_(), v, doc, True)
    # the native launcher writing through 64-bit offsets
    out_c, lse = fwd_mod.attn_fwd(qc.detach(), kc.detach(), v.detach(), None, None, 64, 96, 64 ** -0.5, True, True)
    dq2, dk2, dv2 = far(shapes["q"]), far(shapes["k"]), far(shapes["k"])
    softmax_d = torch.empty(2, 4, 64, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    _native.attn_bwd(doc, qc.detach(), kc.detach(), v.detach(), out_c, lse, dq2, dk2, dv2, softmax_d, None,
                     None, None, 64, 96, 64 ** -0.5, AttnVariant(causal=True), True, stream)
    torch.cuda.synchronize()
    assert torch.equal(dq2, dq) and torch.equal(dk2, dk) and torch.equal(dv2, dv)
    del q, k, dout, dq2, dk2, dv2
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# batches beyond the grid's 65535 (the launches split the batch: src/ops/attention/batch.rs)
# ---------------------------------------------------------------------------------------------
BIG_B = 65537          # slices [0, 65535) and [65535, 65537)
SPLIT = [0, 1, 65533, 65534, 65535, 65536]   # entries on both sides of the split


def _check_out_lse(out, lse, ref, ref_lse, ref_lp):
    assert not torch.isnan(out).any(), "out has NaN (an element not written?)"
    assert not torch.isnan(lse).any(), "softmax_lse has NaN (an element not written?)"
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse.detach(), ref_lse.detach())


def _check_grads_ref(got, refs, refs_lp, inputs, pick=None):
    """got (dq, dk, dv) against the references with the pass rule (factor 3): whole, and, with
    ``pick`` (batch indices), the picked entries on their own (a bound of their own)."""
    for name, g, r, r_lp, x in zip(("dq", "dk", "dv"), got, refs, refs_lp, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), f"{name} is not finite (an element not written?)"
        assert_close_to_ref(g, r, r_lp, factor=3.0, name=name)
        if pick is not None:
            assert_close_to_ref(g[pick], r[pick], r_lp[pick], factor=3.0, name=f"{name}{pick}")


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_beyond_the_grid_padded(deterministic):
    """Batch 65537 (two launches per kernel), GQA, causal, (b, h) ALiBi slopes: forward (out,
    softmax_lse) and backward (every kernel of the plan: preprocess, dK/dV, dQ or convert) against
    the fp32 reference over the whole batch and over the entries at the split on their own;
    every output written (poisoned allocator)."""
    torch.manual_seed(65537)
    b, sq, sk, h, hk, d = BIG_B, 4, 5, 2, 1, 64
    q, k, v = _rand(b, sq, h, d), _rand(b, sk, hk, d), _rand(b, sk, hk, d)
    slopes = torch.rand(b, h, device=DEV) * 0.3
    poison_allocator(q, b * h * sq * 4)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, deterministic=deterministic,
                                  return_attn_probs=True)
    rk = dict(causal=True, alibi_slopes=slopes)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp)
    assert_close_to_ref(out[SPLIT], ref[SPLIT], ref_lp[SPLIT], name=f"out{SPLIT}")
    assert_lse_close(lse[SPLIT].detach(), ref_lse[SPLIT].detach())
    dout = torch.randn_like(out)
    poison_allocator(q, k, v, k, v, 2 * q.numel() * 4)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = attention_grads_ref(q, k, v, dout, **rk)
    refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **rk)
    _check_grads_ref(got, refs, refs_lp, (q, k, v), SPLIT)


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_beyond_the_grid_varlen(deterministic):
    """65540 sequences (two launches per kernel: cu_seqlens advanced by 65535 for the second),
    lengths repeating every 4 sequences, GQA, causal, (b, h) ALiBi slopes, fp16: forward and
    backward against the fp32 reference, computed per length class as a padded batch (sequence
    4m + j is entry m of class j)."""
    torch.manual_seed(65540)
    lq, lk = [3, 1, 4, 2], [5, 2, 4, 7]
    reps, h, hk, d = 65540 // 4, 2, 1, 64
    b = 4 * reps
    cu_q, cu_k = random_cu_seqlens(lq * reps, DEV), random_cu_seqlens(lk * reps, DEV)
    tq, tk = sum(lq) * reps, sum(lk) * reps
    q, k, v = _rand(tq, h, d, dtype=FP16), _rand(tk, hk, d, dtype=FP16), _rand(tk, hk, d, dtype=FP16)
    slopes = torch.rand(b, h, device=DEV) * 0.3
    poison_allocator(q, h * tq * 4)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, alibi_slopes=slopes,
                                         deterministic=deterministic, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, tq)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an element not written?"
    dout = torch.randn_like(out)
    poison_allocator(q, k, v, k, v, 2 * q.numel() * 4)
    got = torch.autograd.grad(out, (q, k, v), dout)

    def cls(x, lens, j):  # (reps, lens[j], ...) rows of class j of a packed (reps * sum(lens), ...) tensor
        o = sum(lens[:j])
        return x.reshape(reps, sum(lens), *x.shape[1:])[:, o:o + lens[j]]

    for j in range(4):
        qj, kj, vj, doj = cls(q, lq, j), cls(k, lk, j), cls(v, lk, j), cls(dout, lq, j)
        rk = dict(causal=True, alibi_slopes=slopes.view(reps, 4, h)[:, j])
        ref, ref_lse = attention_ref(qj, kj, vj, **rk)
        ref_lp, _ = attention_ref(qj, kj, vj, upcast=False, **rk)
        lse_j = lse.reshape(h, reps, sum(lq))[:, :, sum(lq[:j]):sum(lq[:j + 1])].permute(1, 0, 2)
        _check_out_lse(cls(out, lq, j), lse_j, ref, ref_lse, ref_lp)
        refs = attention_grads_ref(qj, kj, vj, doj, **rk)
        refs_lp = attention_grads_ref(qj, kj, vj, doj, upcast=False, **rk)
        mine = (cls(got[0], lq, j), cls(got[1], lk, j), cls(got[2], lk, j))
        _check_grads_ref(mine, refs, refs_lp, (qj, kj, vj), [0, 16383, 16384])  # sequences 4m + j, m at the split


def _dropout_batch_call(p):
    """Batch 65537 (h 1, s_q 4, s_k 8) with dropout p and S_dmask: (q, k, v, out, lse, keep),
    keep the kept positions (b, 1, 4, 8) read from S_dmask (negative = dropped)."""
    b, sq, sk, h, d = BIG_B, 4, 8, 1, 64
    q, k, v = _rand(b, sq, h, d), _rand(b, sk, h, d), _rand(b, sk, h, d)
    out, lse, S = flash_attn_func(q, k, v, p, None, return_attn_probs=True)
    assert S.shape == (b, h, 128, 128) and S.dtype == q.dtype
    keep = S[:, :, :sq, :sk] >= 0
    del S
    return q, k, v, out, lse, keep


def test_batch_beyond_the_grid_dropout_s_dmask():
    """Dropout over batch 65537: the forward, the S_dmask pass (its buffers offset per slice) and
    the backward use one mask across the split: out and gradients match the reference with the
    mask S_dmask shows, whole and at the split; the dropped fraction is p in each slice."""
    torch.manual_seed(31)
    p = 0.5
    q, k, v, out, lse, keep = _dropout_batch_call(p)
    for part in (keep[:65535], keep[65535:]):
        frac = 1.0 - part.float().mean().item()
        assert abs(frac - p) <= max(0.01, 5 * (p * (1 - p) / part.numel()) ** 0.5), frac
    rk = dict(dropout_p=p, dropout_mask=keep)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp)
    assert_close_to_ref(out[SPLIT], ref[SPLIT], ref_lp[SPLIT], name=f"out{SPLIT}")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = attention_grads_ref(q, k, v, dout, **rk)
    refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **rk)
    _check_grads_ref(got, refs, refs_lp, (q, k, v), SPLIT)


def test_batch_beyond_the_grid_dropout_mask_follows_the_global_batch_index():
    """The dropout mask is a function of the global batch index (the kernels add
    AttnFwdParams.dropout_batch0, the slice's first entry): entries 65535 and 65536 (entries 0
    and 1 of the second launch) do not repeat the masks of entries 0 and 1 (64 positions at
    p = 0.5: equal by chance with probability 2^-64)."""
    torch.manual_seed(32)
    *_, keep = _dropout_batch_call(0.5)
    assert not torch.equal(keep[65535:65537], keep[0:2]), "the second launch repeats the first's mask"


@pytest.mark.parametrize("varlen", [False, True])
def test_batch_beyond_the_grid_cuda_graph(varlen):
    """A split forward + deterministic backward captured in a CUDA graph (no host sync or
    allocation per slice): replay with new inputs equals the eager call bitwise."""
    torch.manual_seed(33)
    b, s, h, d = BIG_B, 3, 1, 64
    q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    dout = torch.randn(b, s, h, d, dtype=BF16, device=DEV)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=DEV)

    def f():
        if varlen:
            flat = [x.view(b * s, h, d) for x in (q, k, v)]
            out = flash_attn_varlen_func(*flat, cu, cu, s, s, causal=True, deterministic=True).view(b, s, h, d)
        else:
            out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    g, static = capture_graph(f)
    with torch.no_grad():
        for x in (q, k, v, dout):
            x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    eager = f()
    for name, a, e in zip(("out", "dq", "dk", "dv"), static, eager):
        assert torch.equal(a, e), f"{name}: replay differs from the eager call"
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_to_ref(static[0], ref, ref_lp)  # the replay computed the new inputs, every slice


# ---------------------------------------------------------------------------------------------
# rejected native calls with real device tensors leave the device usable
# ---------------------------------------------------------------------------------------------
def _native_args(**over):
    torch.manual_seed(5)
    q = torch.randn(2, 33, 4, 64, dtype=BF16, device=DEV)
    k = torch.randn(2, 41, 2, 64, dtype=BF16, device=DEV)
    v = torch.randn_like(k)
    out, lse = fwd_mod.attn_fwd(q, k, v, None, None, 33, 41, 0.125, True)
    a = dict(dout=torch.randn_like(q), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=torch.empty_like(q),
             dk=torch.empty_like(k), dv=torch.empty_like(v), softmax_d=torch.empty_like(lse),
             dq_accum=torch.empty(q.shape, dtype=torch.float32, device=DEV), cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=33, max_seqlen_k=41, softmax_scale=0.125, variant=AttnVariant(causal=True),
             deterministic=False,
             stream=torch.cuda.current_stream().cuda_stream)
    a.update({n: (f(a) if callable(f) else f) for n, f in over.items()})
    return a


NATIVE_REJECTED = {
    "dq_is_q": (errors.ArgumentError, "dq", dict(dq=lambda a: a["q"])),
    "dk_is_dv": (errors.ArgumentError, "dk", dict(dk=lambda a: a["dv"])),
    "dv_is_v": (errors.ArgumentError, "dv", dict(dv=lambda a: a["v"])),
    "dq_is_dout": (errors.ArgumentError, "dq", dict(dq=lambda a: a["dout"])),
    "softmax_d_is_lse": (errors.ArgumentError, "softmax_d", dict(softmax_d=lambda a: a["softmax_lse"])),
    "dq_accum_missing": (errors.ArgumentError, "dq_accum", dict(dq_accum=None)),
    "dq_accum_bf16": (errors.DTypeError, "dq_accum", dict(dq_accum=lambda a: torch.empty_like(a["q"]))),
    "dq_inside_dq_accum": (errors.ArgumentError, "dq", dict(dq=lambda a: a["dq_accum"].view(BF16)[..., :64])),
    "dk_expanded": (errors.ArgumentError, "dk", dict(dk=lambda a: torch.empty(2, 41, 1, 64, dtype=BF16, device=DEV)
                                                      .expand(2, 41, 2, 64))),
    "dout_cpu": (errors.DeviceError, "dout", dict(dout=lambda a: a["dout"].cpu())),
    "dout_misaligned": (errors.ArgumentError, "dout", dict(
        dout=lambda a: torch.empty(a["q"].numel() + 1, dtype=BF16, device=DEV)[1:].view(a["q"].shape))),
    "lse_of_other_call": (errors.ArgumentError, "softmax_lse", dict(softmax_lse=lambda a: torch.empty(2, 4, 32, device=DEV))),
    "scale_zero": (errors.ArgumentError, "softmax_scale", dict(softmax_scale=0.0)),
}


@pytest.mark.parametrize("case", list(NATIVE_REJECTED))
def test_native_attn_bwd_rejected_then_valid(case):
    exc, name, over = NATIVE_REJECTED[case]
    with pytest.raises(exc, match=rf"^({name})\b"):
        _native.attn_bwd(**_native_args(**over))
    torch.cuda.synchronize()
    _valid_backward_ok()


def test_forward_mode_ad_rejected_on_gpu():
    q, k = _rand(1, 9, 2, 64, grad=False), _rand(1, 9, 2, 64, grad=False)
    with pytest.raises(NotImplementedError, match=r"^q\b"):
        torch.func.jvp(lambda a: flash_attn_func(a, k, k), (q,), (torch.randn_like(q),))
    _valid_backward_ok()


# ---------------------------------------------------------------------------------------------
# cu_seqlens corrupted behind the value check: no fault (subprocess)
# ---------------------------------------------------------------------------------------------
def test_backward_with_unchecked_bad_cu_seqlens_does_not_fault():
    """FERROATTN_CHECK_CU_SEQLENS=0 (or a write the memo cannot see): the backward kernels clamp
    cu_seqlens to the tensors, so bad values may give wrong rows but never an illegal access or a
    poisoned context."""
    body = textwrap.dedent("""
        import torch
        from ferroattn.ops import attention as fwd_mod
        from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
        fwd_mod.CHECK_CU_SEQLENS_VALUES = False
        q = torch.randn(12, 4, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for vals, mq in (([0, 5, 1 << 20], 7), ([3, 1, 12], 7), ([0, -7, 12], 7), ([0, 5, 12], 2)):
            cu = torch.tensor(vals, dtype=torch.int32, device="cuda")
            for det in (False, True):
                out = flash_attn_varlen_func(q, q, q, cu, cu, mq, mq, causal=True, deterministic=det)
                out.float().sum().backward()
                torch.cuda.synchronize()
        print("SURVIVED", flush=True)
        x = torch.randn(2, 33, 4, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        flash_attn_func(x, x, x, causal=True).float().sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(x.grad).all()
        print("VALID_OK", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, f"process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert "SURVIVED" in proc.stdout and "VALID_OK" in proc.stdout, proc.stdout + proc.stderr[-2000:]
