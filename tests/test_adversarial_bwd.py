"""Adversarial tests of the backward (CPU; no GPU needed): bad inputs and odd autograd usage of
``ferroattn::attn_bwd`` and of the autograd formula of ``ferroattn::attn_fwd``.

Every misuse must end in a clear exception (ferroattn.errors, TypeError/ValueError,
NotImplementedError, or torch's own autograd RuntimeError for the graph rules) -- never silently
wrong gradients -- and a valid call must succeed afterwards. Tensors are meta tensors (the
autograd engine runs the backward's fake impl), real CPU tensors (the real op up to the Rust
device check), CPU tensors with the two native launchers replaced by torch emulations
(test_backward._EmulatedNative) where numbers matter, and hand-made DLPack capsules claiming CUDA
memory (test_adversarial.fake_cuda) to drive ``_native.attn_bwd``'s own validation (aliasing,
workspaces, layouts) without a GPU. GPU-only behaviour: tests/test_gpu_adversarial_bwd.py.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from ferroattn import _native, errors
from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ferroattn.ops import attention as fwd_mod
from ferroattn.ops import attention_bwd as bwd_mod
from ferroattn.ops._to_native import tensor_meta
from ferroattn.ops.variant import AttnVariant

from test_adversarial import _FAKE_PTR, fake_cuda, fake_cuda_versioned, no_driver
from test_backward import _EmulatedNative, _grads_formula

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

BF16, FP16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
FWD = torch.ops.ferroattn.attn_fwd.default
BWD = torch.ops.ferroattn.attn_bwd.default


def _meta(*shape, dtype=BF16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(grad)


def _valid_backward_succeeds():
    """The contract's 'afterwards a valid call succeeds', forward + backward on meta tensors."""
    q, k = _meta(2, 5, 6, 32, grad=True), _meta(2, 7, 2, 32, grad=True)
    dq, dk = torch.autograd.grad(flash_attn_func(q, k, k, causal=True).float().sum(), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape and dq.dtype == BF16


def _bwd_args(**over):
    q, k = _meta(2, 5, 4, 32), _meta(2, 7, 2, 32)
    a = dict(dout=q, q=q, k=k, v=k, out=q, softmax_lse=_meta(2, 4, 5, dtype=F32), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.1, causal=False,
             deterministic=False)
    a.update(over)
    return list(a.values())


# ---------------------------------------------------------------------------------------------
# autograd usage: double backward, retain_graph, in-place writes, partial requires_grad
# ---------------------------------------------------------------------------------------------
def test_double_backward_raises_instead_of_wrong_second_derivatives():
    """create_graph=True: the first-order gradients are returned (and carry a graph), but a second
    derivative has no formula: a clear RuntimeError naming attn_bwd, not silent zeros."""
    q, k, v = _meta(2, 5, 4, 32, grad=True), _meta(2, 7, 2, 32, grad=True), _meta(2, 7, 2, 32, grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    dq, dk = torch.autograd.grad(out.float().sum(), (q, k), create_graph=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dq.requires_grad
    with pytest.raises(RuntimeError, match=r"attn_bwd.*no autograd formula"):
        torch.autograd.grad(dq.float().sum(), (q, k, v))
    _valid_backward_succeeds()


def test_backward_twice_needs_retain_graph():
    q, k = _meta(2, 5, 4, 32, grad=True), _meta(2, 7, 2, 32)
    out = flash_attn_func(q, k, k)
    out.float().sum().backward(retain_graph=True)
    out.float().sum().backward()  # allowed: the graph was retained
    assert q.grad.shape == q.shape
    out = flash_attn_func(q, k, k)
    out.float().sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.float().sum().backward()
    _valid_backward_succeeds()


@pytest.mark.parametrize("what", ["q_input", "out", "cu_seqlens"])
def test_in_place_write_between_forward_and_backward_is_detected(what):
    """q, out and cu_seqlens are saved for the backward: writing them in place afterwards must
    trip torch's version-counter check, not run the backward on the modified values."""
    if what == "cu_seqlens":
        cu = torch.tensor([0, 4, 9], dtype=I32, device="meta")
        q = _meta(9, 4, 32, grad=True)
        out = flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
        cu.add_(0)
    else:
        q0, k = _meta(2, 5, 4, 32, grad=True), _meta(2, 7, 2, 32)
        q = q0 * 1
        out = flash_attn_func(q, k, k)
        (q if what == "q_input" else out).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
    _valid_backward_succeeds()


@pytest.mark.parametrize("needs", ["q", "k", "v", "kv"])
def test_only_some_inputs_require_grad(needs):
    q, k, v = _meta(2, 5, 4, 32), _meta(2, 7, 2, 32), _meta(2, 7, 2, 32)
    xs = {"q": q, "k": k, "v": v}
    for name in needs:
        xs[name].requires_grad_(True)
    flash_attn_func(q, k, v, causal=True).float().sum().backward()
    for name, x in xs.items():
        assert (x.grad is not None) == (name in needs), name
        if x.grad is not None:
            assert x.grad.shape == x.shape and x.grad.dtype == BF16


@pytest.mark.parametrize("dtype", [F32, FP16])
def test_grad_out_of_another_dtype_is_cast_by_autograd(dtype):
    q, k = _meta(2, 5, 4, 32, grad=True), _meta(2, 7, 2, 32)
    out = flash_attn_func(q, k, k)
    (dq,) = torch.autograd.grad(out, q, _meta(2, 5, 4, 32, dtype=dtype))
    assert dq.dtype == BF16 and dq.shape == q.shape
    # the op itself does not cast: a direct call names dout
    with pytest.raises(errors.DTypeError, match=r"^dout\b"):
        BWD(*_bwd_args(dout=_meta(2, 5, 4, 32, dtype=dtype)))


# ---------------------------------------------------------------------------------------------
# empty problems: the gradient of out.sum() is an expanded (all strides 0) empty tensor
# ---------------------------------------------------------------------------------------------
EMPTY = {"batch0": ((0, 5, 4, 32), (0, 7, 2, 32)), "seqlen_q0": ((2, 0, 4, 32), (2, 7, 2, 32)),
         "seqlen_k0": ((2, 5, 4, 32), (2, 0, 2, 32)), "both0": ((2, 0, 4, 32), (2, 0, 2, 32))}


@pytest.mark.parametrize("case", list(EMPTY))
@pytest.mark.parametrize("head_dim", [32, 36])
def test_empty_problem_backward_of_sum(case, head_dim):
    """Was a bug: ``out.sum().backward()`` on an empty batch (or s_q = 0) raised "dout: expected
    stride 1 in the last dim, got stride 0": ``contiguous()`` leaves an empty expanded tensor as it
    is. The forward accepts these shapes, so the backward must too."""
    qs, ks = EMPTY[case]
    qs, ks = qs[:-1] + (head_dim,), ks[:-1] + (head_dim,)
    q, k, v = _meta(*qs, grad=True), _meta(*ks, grad=True), _meta(*ks, grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == BF16


def test_empty_varlen_backward_of_sum():
    cu = torch.tensor([0, 0, 0], dtype=I32, device="meta")
    q, k = _meta(0, 4, 32, grad=True), _meta(0, 2, 32, grad=True)
    flash_attn_varlen_func(q, k, k, cu, cu, 0, 0).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_op_direct_empty_expanded_dout():
    q = _meta(0, 5, 4, 32)
    dout = torch.ones((), dtype=BF16, device="meta").expand(0, 5, 4, 32)
    assert dout.stride() == (0, 0, 0, 0)
    dq, dk, dv = BWD(*_bwd_args(dout=dout, q=q, out=q, k=_meta(0, 7, 2, 32), v=_meta(0, 7, 2, 32),
                                softmax_lse=_meta(0, 4, 5, dtype=F32)))
    assert dq.shape == q.shape and dk.shape == (0, 7, 2, 32)


# ---------------------------------------------------------------------------------------------
# forward-mode AD and torch.func: a clear error, never a silently dropped tangent
# ---------------------------------------------------------------------------------------------
def _cpu(*shape):
    return torch.randn(*shape).to(BF16)


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "dual", "jvp_of_vmap", "dual_op_direct"])
def test_forward_mode_ad_raises_not_implemented(how):
    """Was a bug: torch's custom_op autograd wrapper runs the op on dual tensors that do not
    require grad and drops the tangent: torch.func.jvp returned a zero tangent, a forward_ad dual
    output had no tangent at all. Now: NotImplementedError naming the tracked input."""
    torch.manual_seed(0)
    q, k = _cpu(1, 3, 2, 32), _cpu(1, 4, 2, 32)
    t = torch.randn_like(q)
    with pytest.raises(NotImplementedError, match=r"^q\b.*forward-mode AD"):
        if how == "jvp":
            torch.func.jvp(lambda a: flash_attn_func(a, k, k), (q,), (t,))
        elif how == "jacfwd":
            torch.func.jacfwd(lambda a: flash_attn_func(a, k, k).float())(q)
        elif how == "jvp_of_vmap":
            qb = torch.stack([q, q])
            torch.func.jvp(torch.func.vmap(lambda a: flash_attn_func(a, k, k)), (qb,), (torch.randn_like(qb),))
        else:
            with fwAD.dual_level():
                dual = fwAD.make_dual(q, t)
                if how == "dual":
                    flash_attn_func(dual, k, k)
                else:  # the op called directly: its implementation checks
                    FWD(dual, k, k, None, None, 3, 4, 0.1, False)
    _valid_backward_succeeds()


@pytest.mark.parametrize("how", ["decode_func", "kvcache", "paged_varlen"])
def test_forward_mode_ad_on_the_kvcache_path_raises(how):
    """Was a bug: the kv-cache route (decode-shaped flash_attn_func, flash_attn_with_kvcache, paged
    varlen) had no forward-AD check, so torch.func.jvp returned a zero tangent. Now the same
    NotImplementedError as the forward op."""
    from ferroattn import flash_attn_varlen_func, flash_attn_with_kvcache

    q, kc = _cpu(1, 1, 4, 32), _cpu(1, 4096, 2, 32)
    with pytest.raises(NotImplementedError, match=r"^q\b.*forward-mode AD"):
        if how == "decode_func":
            torch.func.jvp(lambda a: flash_attn_func(a, kc, kc), (q,), (torch.randn_like(q),))
        elif how == "kvcache":
            torch.func.jvp(lambda a: flash_attn_with_kvcache(a, kc, kc), (q,), (torch.randn_like(q),))
        else:
            qv, pages = _cpu(4, 4, 32), _cpu(2, 16, 2, 32)
            cu, bt = torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32)
            torch.func.jvp(lambda a: flash_attn_varlen_func(a, pages, pages, cu, cu, 4, 4, block_table=bt),
                           (qv,), (torch.randn_like(qv),))
    _valid_backward_succeeds()


def test_lazy_negation_and_conjugation_take_the_op(monkeypatch):
    """Was a bug: a tensor with torch's lazy negation bit (``torch._neg_view``) reached the kernels
    through the eager fast path, and DLPack carries no such bit, so the kernel read the
    un-negated memory. Such tensors now take the op route, whose dispatcher materialises the bit."""
    from ferroattn.ops import _eager

    monkeypatch.setattr(_eager, "_DEVICE_TYPES", ("cuda", "cpu"))   # the selection, on CPU tensors
    x = torch.ones(2, 8)
    with torch.no_grad():
        assert _eager.plain_eager((x,))
        assert not _eager.plain_eager((torch._neg_view(x),))
        assert not _eager.plain_eager((x, torch._neg_view(x)))
        assert not _eager.plain_eager((torch.ones(2, 8, dtype=torch.complex64).conj(),))


def test_forward_mode_ad_through_the_backward_raises():
    """Forward-over-reverse (a dual grad_out into the backward): attn_bwd has no jvp either."""
    q, k = _meta(2, 5, 4, 32, grad=True), _meta(2, 7, 2, 32)
    out = flash_attn_func(q, k, k)
    with fwAD.dual_level():
        g = fwAD.make_dual(torch.zeros(2, 5, 4, 32, dtype=BF16, device="meta"),
                           torch.zeros(2, 5, 4, 32, dtype=BF16, device="meta"))
        with pytest.raises(NotImplementedError, match=r"^dout\b.*forward-mode AD"):
            torch.autograd.grad(out, q, g)
    _valid_backward_succeeds()


def test_jvp_not_touching_attention_inputs_still_works():
    """No false positive: a jvp whose tangent does not reach q/k/v runs (zero tangent is right)."""
    q = _meta(2, 5, 4, 32)
    s = torch.ones((), device="meta", dtype=BF16)
    out, tangent = torch.func.jvp(lambda a: flash_attn_func(q, q, q) * a, (s,), (torch.ones_like(s),))
    assert out.shape == tangent.shape == q.shape


@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_torch_func_reverse_transforms_raise(transform):
    """torch.func.grad / vjp do not support custom ops registered with register_autograd in torch
    2.11 (the generated autograd.Function has no setup_context): a RuntimeError, not garbage."""
    q, k = _meta(2, 5, 4, 32), _meta(2, 7, 2, 32)
    with pytest.raises(RuntimeError, match="setup_context"):
        if transform == "grad":
            torch.func.grad(lambda a: flash_attn_func(a, k, k).float().sum())(q)
        else:
            torch.func.vjp(lambda a: flash_attn_func(a, k, k), q)[1](_meta(2, 5, 4, 32))
    _valid_backward_succeeds()


def test_vmap_forward_matches_a_loop(monkeypatch):
    """vmap runs the op through torch's batching fallback (a loop): results equal per-sample calls."""
    stub = _EmulatedNative()
    monkeypatch.setattr(fwd_mod, "_native", stub)
    torch.manual_seed(1)
    q, k = _cpu(3, 1, 4, 2, 32), _cpu(3, 1, 6, 2, 32)
    got = torch.func.vmap(lambda a, b: flash_attn_func(a, b, b, causal=True))(q, k)
    want = torch.stack([flash_attn_func(q[i], k[i], k[i], causal=True) for i in range(3)])
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# softmax_scale in the backward
# ---------------------------------------------------------------------------------------------
class _F32ScaleNative(_EmulatedNative):
    """The emulated launchers, plus the native rule the plain emulation misses: the scale crosses
    the boundary as an f32 (``softmax_scale as f32``) and the backward wants it > 0 there."""

    def attn_bwd(self, *args):
        scale = args[15]
        assert np.float32(scale) > 0, f"attn_bwd would reject softmax_scale {scale!r} (0 in f32)"
        return super().attn_bwd(*args)


@pytest.mark.parametrize("scale", [1e-50, -1e-50, 2.0**-150, -(2.0**-150)])
def test_scale_that_is_zero_in_f32_trains(monkeypatch, scale):
    """Was a bug: 0 < |scale| <= 2^-150 is positive in Python but 0 in the kernels' fp32; the
    forward ran, the backward launcher rejected "softmax_scale ... got 0". Such a scale is now
    exactly the s = 0 case: uniform attention, dq = dk = 0."""
    stub = _F32ScaleNative()
    monkeypatch.setattr(fwd_mod, "_native", stub)
    monkeypatch.setattr(bwd_mod, "_native", stub)
    torch.manual_seed(2)
    q, k, v = (x.requires_grad_(True) for x in (_cpu(2, 5, 4, 32), _cpu(2, 7, 2, 32), _cpu(2, 7, 2, 32)))
    out = flash_attn_func(q, k, v, softmax_scale=scale)
    dout = _cpu(*out.shape)
    out.backward(dout)
    assert torch.all(q.grad == 0) and torch.all(k.grad == 0)
    _, _, dv_ref = _grads_formula(q.detach(), k.detach(), v.detach(), dout, False, 0.0)
    assert (v.grad.double() - dv_ref).abs().max() <= 2e-2 * dv_ref.abs().max()


def test_smallest_subnormal_scale_is_passed_through(monkeypatch):
    """2^-149 is the smallest positive fp32: it is not 0 in the kernels and is not remapped."""
    stub = _F32ScaleNative()
    monkeypatch.setattr(fwd_mod, "_native", stub)
    monkeypatch.setattr(bwd_mod, "_native", stub)
    q = _cpu(1, 3, 2, 32).requires_grad_(True)
    flash_attn_func(q, q.detach(), q.detach(), softmax_scale=2.0**-149).float().sum().backward()
    assert stub.calls[0] == ("fwd", 2.0**-149) and stub.calls[1][1] == 2.0**-149


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 1e300, -1e39])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_op_direct_non_finite_scale_names_the_value(scale, device):
    """Was a gap: the fake impls did not check the scale (a compiled graph traced fine), and the
    real ops reported the value after the s < 0 mapping / fp32 cast (-inf -> "got inf")."""
    q = torch.zeros(2, 5, 4, 32, dtype=BF16, device=device)
    k = torch.zeros(2, 7, 2, 32, dtype=BF16, device=device)
    lse = torch.zeros(2, 4, 5, device=device)
    for call in (lambda: FWD(q, k, k, None, None, 5, 7, scale, False),
                 lambda: BWD(q, q, k, k, q, lse, None, None, 5, 7, scale, False, False)):
        with pytest.raises(errors.ArgumentError, match=r"^softmax_scale\b") as info:
            call()
        assert repr(scale) in str(info.value), str(info.value)
    BWD(*_bwd_args())  # and a valid call works


# ---------------------------------------------------------------------------------------------
# other bad arguments of the backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["True", 2, 0.5, [True]])
def test_deterministic_not_a_bool(value):
    q = _meta(2, 5, 4, 32, grad=True)
    with pytest.raises(errors.ArgumentError, match=r"^deterministic\b"):
        flash_attn_func(q, q, q, deterministic=value)
    _valid_backward_succeeds()


def test_cpu_varlen_backward_value_checks():
    """The real op on CPU tensors: cu_seqlens values are checked in the backward too (a direct call
    need not follow a checked forward), before the device check."""
    q, k = _cpu(9, 4, 32), _cpu(11, 2, 32)
    lse = torch.zeros(4, 9)
    good_q, good_k = torch.tensor([0, 4, 9], dtype=I32), torch.tensor([0, 5, 11], dtype=I32)
    cases = [
        (torch.tensor([0, 4, 10], dtype=I32), good_k, 5, 6, "cu_seqlens_q"),  # last > rows
        (good_q, torch.tensor([0, 6, 5], dtype=I32), 5, 6, "cu_seqlens_k"),  # decreasing
        (good_q, good_k, 4, 6, "max_seqlen_q"),  # a sequence of 5 > 4
        (good_q, torch.tensor([0, 5, 8, 11], dtype=I32), 5, 6, "cu_seqlens_k"),  # length differs
    ]
    for cu_q, cu_k, mq, mk, name in cases:
        with pytest.raises(errors.ArgumentError, match=rf"^{name}\b"):
            BWD(q, q, k, k, q, lse, cu_q, cu_k, mq, mk, 0.1, False, False)
    with pytest.raises(errors.DeviceError, match=r"^q\b"):  # everything else valid
        BWD(q, q, k, k, q, lse, good_q, good_k, 5, 6, 0.1, False, True)


@pytest.mark.parametrize("case", ["gqa_7_of_3", "huge_seqlen", "huge_batch", "huge_heads", "lse_other_call"])
def test_bwd_bad_shapes_on_meta(case):
    if case == "gqa_7_of_3":
        args, name = _bwd_args(q=_meta(2, 5, 7, 32), dout=_meta(2, 5, 7, 32), out=_meta(2, 5, 7, 32),
                               k=_meta(2, 7, 3, 32), v=_meta(2, 7, 3, 32),
                               softmax_lse=_meta(2, 7, 5, dtype=F32)), "k"
    elif case == "huge_seqlen":
        s = 2**31
        args, name = _bwd_args(q=_meta(1, s, 1, 32), dout=_meta(1, s, 1, 32), out=_meta(1, s, 1, 32),
                               k=_meta(1, 7, 1, 32), v=_meta(1, 7, 1, 32),
                               softmax_lse=_meta(1, 1, s, dtype=F32)), "q"
    elif case == "huge_batch":  # beyond int32 (any batch below runs, split over launches)
        b = 2**31
        args, name = _bwd_args(q=_meta(b, 1, 1, 32), dout=_meta(b, 1, 1, 32), out=_meta(b, 1, 1, 32),
                               k=_meta(b, 1, 1, 32), v=_meta(b, 1, 1, 32),
                               softmax_lse=_meta(b, 1, 1, dtype=F32)), "q"
    elif case == "huge_heads":
        h = 65536
        args, name = _bwd_args(q=_meta(1, 1, h, 32), dout=_meta(1, 1, h, 32), out=_meta(1, 1, h, 32),
                               k=_meta(1, 1, 1, 32), v=_meta(1, 1, 1, 32),
                               softmax_lse=_meta(1, h, 1, dtype=F32)), "q"
    else:  # out / lse of a call with another s_q
        args, name = _bwd_args(out=_meta(2, 6, 4, 32), softmax_lse=_meta(2, 4, 6, dtype=F32)), "softmax_lse|out"
    with pytest.raises(errors.ArgumentError, match=rf"^({name})\b"):
        BWD(*args)
    BWD(*_bwd_args())


@pytest.mark.parametrize("b", [65535, 65536, 65537])
def test_bwd_large_batch_is_valid(b):
    """The grid's 65535 batch entries and beyond (the launches split the batch,
    src/ops/attention/batch.rs) in the backward: valid on meta, padded and varlen, with and without
    a variant. The numbers across the split: tests/test_gpu_adversarial_bwd.py."""
    args = _bwd_args(q=_meta(b, 1, 1, 32), dout=_meta(b, 1, 1, 32), out=_meta(b, 1, 1, 32), k=_meta(b, 2, 1, 32),
                     v=_meta(b, 2, 1, 32), softmax_lse=_meta(b, 1, 1, dtype=F32))
    dq, dk, dv = BWD(*args)
    assert dq.shape == (b, 1, 1, 32) and dk.shape == dv.shape == (b, 2, 1, 32)
    slopes = _meta(b, 1, dtype=F32)
    dq, dk, dv = BWD(*args[:-2], True, True, 1, 0, 2.0, slopes, _meta(1, dtype=F32))
    assert dq.shape == (b, 1, 1, 32)
    cu = torch.empty(b + 1, dtype=I32, device="meta")
    q, k = _meta(b, 1, 32), _meta(2 * b, 1, 32)
    dq, dk, dv = BWD(q, q, k, k, q, _meta(1, b, dtype=F32), cu, cu, 1, 2, 0.1, True, False)
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("extra,exc,name", [
    ((-2, -1, 0.0, None, None), errors.ArgumentError, "window_size"),
    ((-1, -1, float("inf"), None, None), errors.ArgumentError, "softcap"),
    ((-1, -1, 0.0, "alibi_shape", None), errors.ArgumentError, "alibi_slopes"),
    ((-1, -1, 0.0, "alibi_dtype", None), errors.DTypeError, "alibi_slopes"),
    ((-1, -1, 0.0, None, "sinks_shape"), errors.ArgumentError, "s_aux"),
    ((-1, -1, 0.0, None, "sinks_dtype"), errors.DTypeError, "s_aux"),
])
def test_bwd_op_rejects_a_bad_variant(extra, exc, name):
    """attn_bwd validates the variant it is given like the forward (a direct caller may pass one
    the forward never saw)."""
    tensors = {"alibi_shape": _meta(3, dtype=F32), "alibi_dtype": _meta(4, dtype=FP16),
               "sinks_shape": _meta(2, 4, dtype=F32), "sinks_dtype": _meta(4)}
    extra = tuple(tensors.get(x, x) if isinstance(x, str) else x for x in extra)
    with pytest.raises(exc, match=rf"^{name}\b"):
        BWD(*_bwd_args(), *extra)
    BWD(*_bwd_args(), 2, 1, 1.0, _meta(2, 4, dtype=F32), _meta(4, dtype=F32))  # a valid variant works


# ---------------------------------------------------------------------------------------------
# torch.compile with dynamic shapes, opcheck on edge shapes
# ---------------------------------------------------------------------------------------------
def test_compile_dynamic_seqlens_forward_backward():
    """dynamic=True: one forward and one backward graph serve every sequence length (the fake
    impls validate symbolic sizes through their hints) and the head-dim padding is traced."""
    torch._dynamo.reset()
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True).float().sum(),
                      fullgraph=True, backend=backend, dynamic=True)
    for s in (5, 9, 17):
        q, k = _meta(2, s, 4, 36, grad=True), _meta(2, s + 2, 2, 36, grad=True)
        f(q, k, k).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert len(graphs) == 2
    bwd_nodes = [n for n in graphs[1].graph.nodes if n.op == "call_function" and n.target == BWD]
    assert len(bwd_nodes) == 1 and bwd_nodes[0].args[10] == 36 ** -0.5


@pytest.mark.parametrize("case", ["batch0", "seqlen_q0", "d256_mqa", "varlen_empty_seq"])
def test_opcheck_bwd_edge_shapes(case):
    if case == "varlen_empty_seq":
        q, k = _meta(9, 4, 32), _meta(11, 1, 32)
        cu = torch.empty(4, dtype=I32, device="meta")
        args = (q, q, k, k, q, _meta(4, 9, dtype=F32), cu, cu, 5, 6, 0.2, True, True)
    else:
        qs, ks = {"batch0": ((0, 5, 4, 32), (0, 7, 2, 32)), "seqlen_q0": ((2, 0, 4, 32), (2, 7, 2, 32)),
                  "d256_mqa": ((2, 5, 8, 256), (2, 3, 1, 256))}[case]
        q, k = _meta(*qs), _meta(*ks)
        args = (q, q, k, k, q, _meta(qs[0], qs[2], qs[1], dtype=F32), None, None, qs[1], ks[1], 0.2, True, False)
    res = torch.library.opcheck(BWD, args)
    assert all(v == "SUCCESS" for v in res.values()), res


# ---------------------------------------------------------------------------------------------
# _native.attn_bwd with DLPack capsules claiming CUDA memory (validation only, no GPU)
# ---------------------------------------------------------------------------------------------
_MB = 1 << 20


def _p(i):
    """Distinct, non-overlapping fake device addresses, 1 MiB apart."""
    return _FAKE_PTR + i * _MB


def _native_bwd_args(**over):
    a = dict(dout=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(0)), q=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(1)),
             k=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(2)), v=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(3)),
             out=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(4)),
             softmax_lse=lambda: fake_cuda((2, 4, 5), "float32", ptr=_p(5)),
             dq=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(6)), dk=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(7)),
             dv=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(8)),
             softmax_d=lambda: fake_cuda((2, 4, 5), "float32", ptr=_p(9)),
             dq_accum=lambda: fake_cuda((2, 5, 4, 64), "float32", ptr=_p(10)), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.125, variant=AttnVariant(),
             deterministic=False, stream=0)
    a.update(over)
    return {k: (v() if callable(v) else v) for k, v in a.items()}


NATIVE_BWD_CASES = {
    # aliasing: a written tensor sharing memory with an input or another output
    "dq_is_q": (errors.ArgumentError, "dq", "overlap q", dict(dq=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(1)))),
    "dq_is_dk": (errors.ArgumentError, "dq", "overlap dk", dict(dk=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(6)))),
    "dv_inside_dout": (errors.ArgumentError, "dv", "overlap dout",
                       dict(dv=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(0) + 64))),
    "dk_is_v": (errors.ArgumentError, "dk", "overlap v", dict(dk=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(3)))),
    "softmax_d_is_lse": (errors.ArgumentError, "softmax_d", "overlap softmax_lse",
                         dict(softmax_d=lambda: fake_cuda((2, 4, 5), "float32", ptr=_p(5)))),
    "dq_accum_is_dq": (errors.ArgumentError, "dq", "overlap dq_accum",
                       dict(dq_accum=lambda: fake_cuda((2, 5, 4, 64), "float32", ptr=_p(6)))),
    "dq_self_overlap": (errors.ArgumentError, "dq", "non-overlapping",
                        dict(dq=lambda: fake_cuda((2, 5, 4, 64), strides=(0, 256, 64, 1), ptr=_p(6)))),
    "dk_rows_overlap": (errors.ArgumentError, "dk", "non-overlapping",
                        dict(dk=lambda: fake_cuda((2, 7, 2, 64), strides=(896, 8, 64, 1), ptr=_p(7)))),
    # workspaces
    "dq_accum_missing": (errors.ArgumentError, "dq_accum", "None", dict(dq_accum=None)),
    "dq_accum_bf16": (errors.DTypeError, "dq_accum", "float32", dict(dq_accum=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(10)))),
    "dq_accum_shape": (errors.ArgumentError, "dq_accum", "(2, 5, 4, 64)",
                       dict(dq_accum=lambda: fake_cuda((2, 5, 4, 32), "float32", ptr=_p(10)))),
    "dq_accum_misaligned": (errors.ArgumentError, "dq_accum", "aligned",
                            dict(dq_accum=lambda: fake_cuda((2, 5, 4, 64), "float32", ptr=_p(10) + 4))),
    "softmax_d_bf16": (errors.DTypeError, "softmax_d", "float32", dict(softmax_d=lambda: fake_cuda((2, 4, 5), ptr=_p(9)))),
    "softmax_d_other_layout": (errors.ArgumentError, "softmax_d", "softmax_lse's layout",
                               dict(softmax_d=lambda: fake_cuda((2, 4, 5), "float32", strides=(5, 10, 1), ptr=_p(9)))),
    "softmax_d_last_stride": (errors.ArgumentError, "softmax_d", "stride 1",
                              dict(softmax_d=lambda: fake_cuda((2, 4, 5), "float32", strides=(20, 1, 4), ptr=_p(9)))),
    # gradients
    "dq_dtype": (errors.DTypeError, "dq", "bfloat16", dict(dq=lambda: fake_cuda((2, 5, 4, 64), "float16", ptr=_p(6)))),
    "dk_shape": (errors.ArgumentError, "dk", "(2, 7, 2, 64)", dict(dk=lambda: fake_cuda((2, 7, 4, 64), ptr=_p(7)))),
    "dv_cpu": (errors.DeviceError, "dv", "cuda:0", dict(dv=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(8), device=(1, 0)))),
    "dk_other_gpu": (errors.DeviceError, "dk", "cuda:0", dict(dk=lambda: fake_cuda((2, 7, 2, 64), ptr=_p(7), device=(2, 1)))),
    "dq_misaligned": (errors.ArgumentError, "dq", "aligned", dict(dq=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(6) + 2))),
    "dq_null": (errors.ArgumentError, "dq", "NULL", dict(dq=lambda: fake_cuda((2, 5, 4, 64), ptr=0))),
    "dq_read_only": (errors.ArgumentError, "dq", "READ_ONLY",
                     dict(dq=lambda: fake_cuda_versioned((2, 5, 4, 64), flags=1, ptr=_p(6)))),
    # inputs
    "dout_misaligned": (errors.ArgumentError, "dout", "aligned", dict(dout=lambda: fake_cuda((2, 5, 4, 64), ptr=_p(0) + 2))),
    "dout_last_stride": (errors.ArgumentError, "dout", "stride 1",
                         dict(dout=lambda: fake_cuda((2, 5, 4, 64), strides=(2560, 512, 128, 2), ptr=_p(0)))),
    "dout_negative_stride": (errors.ArgumentError, "dout", "non-negative",
                             dict(dout=lambda: fake_cuda((2, 5, 4, 64), strides=(1280, 256, 64, -1), ptr=_p(0)))),
    "out_row_stride": (errors.ArgumentError, "out", "multiples of 8",
                       dict(out=lambda: fake_cuda((2, 5, 4, 64), strides=(1400, 280, 68, 1), ptr=_p(4)))),
    # scalars
    "scale_zero": (errors.ArgumentError, "softmax_scale", "> 0", dict(softmax_scale=0.0)),
    "scale_negative": (errors.ArgumentError, "softmax_scale", "> 0", dict(softmax_scale=-1.0)),
    "scale_nan": (errors.ArgumentError, "softmax_scale", "NaN", dict(softmax_scale=float("nan"))),
    "scale_overflows_f32": (errors.ArgumentError, "softmax_scale", "inf", dict(softmax_scale=1e300)),
}


@pytest.mark.parametrize("case", list(NATIVE_BWD_CASES))
def test_native_attn_bwd_rejects(case):
    exc, name, contains, over = NATIVE_BWD_CASES[case]
    with pytest.raises(exc) as info:
        _native.attn_bwd(**_native_bwd_args(**over))
    msg = str(info.value)
    assert re.match(rf"{name}\b", msg), msg
    assert contains in msg, msg
    assert isinstance(info.value, errors.FerroattnError) and isinstance(info.value, (ValueError, TypeError))
    _valid_backward_succeeds()


def _variant_caps(**fields):
    """An AttnVariant whose tensor fields are capsule factories (called here)."""
    import dataclasses
    return dataclasses.replace(AttnVariant(), **{n: (f() if callable(f) else f) for n, f in fields.items()})


NATIVE_BWD_VARIANT_CASES = {
    "left_-2": (errors.ArgumentError, "window_size", "(-2, 0)", dict(window_left=-2, window_right=0)),
    "softcap_nan": (errors.ArgumentError, "softcap", "NaN", dict(softcap=float("nan"))),
    "alibi_shape": (errors.ArgumentError, "alibi_slopes", "(4, 2)",
                    dict(alibi_slopes=lambda: fake_cuda((4, 2), "float32", ptr=_p(11)))),
    "alibi_dtype": (errors.DTypeError, "alibi_slopes", "bfloat16",
                    dict(alibi_slopes=lambda: fake_cuda((4,), "bfloat16", ptr=_p(11)))),
    "alibi_cpu": (errors.DeviceError, "alibi_slopes", "cpu",
                  dict(alibi_slopes=lambda: fake_cuda((4,), "float32", ptr=_p(11), device=(1, 0)))),
    "sinks_shape": (errors.ArgumentError, "s_aux", "(5,)", dict(sinks=lambda: fake_cuda((5,), "float32", ptr=_p(12)))),
    "sinks_dtype": (errors.DTypeError, "s_aux", "float16", dict(sinks=lambda: fake_cuda((4,), "float16", ptr=_p(12)))),
    "sinks_not_dlpack": (TypeError, "s_aux", "DLPack", dict(sinks=[0.0] * 4)),
}


@pytest.mark.parametrize("case", list(NATIVE_BWD_VARIANT_CASES))
def test_native_attn_bwd_rejects_a_bad_variant(case):
    exc, name, contains, fields = NATIVE_BWD_VARIANT_CASES[case]
    with pytest.raises(exc) as info:
        _native.attn_bwd(**_native_bwd_args(variant=lambda: _variant_caps(**fields)))
    msg = str(info.value)
    assert re.match(rf"{name}\b", msg), msg
    assert contains in msg, msg
    _valid_backward_succeeds()


@no_driver
@pytest.mark.parametrize("fields", [dict(causal=True), dict(window_left=4, window_right=1), dict(softcap=2.0),
                                    dict(alibi_slopes=lambda: fake_cuda((2, 4), "float32", ptr=_p(11))),
                                    dict(sinks=lambda: fake_cuda((4,), "float32", ptr=_p(12)))],
                         ids=["causal", "window", "softcap", "alibi", "sinks"])
def test_native_attn_bwd_valid_variants_reach_the_device(fields):
    with pytest.raises(errors.NoDeviceError):
        _native.attn_bwd(**_native_bwd_args(variant=lambda: _variant_caps(**fields)))


@pytest.mark.parametrize("value", [1, "yes", None, 0.0])
def test_native_attn_bwd_deterministic_type_names_it(value):
    with pytest.raises(TypeError) as info:
        _native.attn_bwd(**_native_bwd_args(deterministic=value))
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "deterministic" in text, text


@no_driver
@pytest.mark.parametrize("over", [{}, {"dq_accum": None, "deterministic": True}], ids=["atomics", "deterministic"])
def test_native_attn_bwd_valid_capsules_reach_the_device(over):
    """Everything valid (the deterministic path needs no dq_accum): only the missing GPU stops it."""
    with pytest.raises(errors.NoDeviceError):
        _native.attn_bwd(**_native_bwd_args(**over))


def test_native_attn_bwd_empty_batch_launches_nothing():
    shapes = dict(dout=(0, 5, 4, 64), q=(0, 5, 4, 64), k=(0, 7, 2, 64), v=(0, 7, 2, 64), out=(0, 5, 4, 64),
                  dq=(0, 5, 4, 64), dk=(0, 7, 2, 64), dv=(0, 7, 2, 64))
    over = {n: (lambda s=s: fake_cuda(s, ptr=0)) for n, s in shapes.items()}
    over.update(softmax_lse=lambda: fake_cuda((0, 4, 5), "float32", ptr=0),
                softmax_d=lambda: fake_cuda((0, 4, 5), "float32", ptr=0),
                dq_accum=lambda: fake_cuda((0, 5, 4, 64), "float32", ptr=0))
    assert _native.attn_bwd(**_native_bwd_args(**over)) is None


def test_native_attn_bwd_seqlen_q0_still_writes_dk_so_needs_pointers():
    """s_q = 0 with s_k > 0: dk = dv = 0 must still be written, so a NULL dk is rejected."""
    over = dict(dout=lambda: fake_cuda((2, 0, 4, 64), ptr=0), q=lambda: fake_cuda((2, 0, 4, 64), ptr=0),
                out=lambda: fake_cuda((2, 0, 4, 64), ptr=0), dq=lambda: fake_cuda((2, 0, 4, 64), ptr=0),
                softmax_lse=lambda: fake_cuda((2, 4, 0), "float32", ptr=0),
                softmax_d=lambda: fake_cuda((2, 4, 0), "float32", ptr=0),
                dq_accum=lambda: fake_cuda((2, 0, 4, 64), "float32", ptr=0),
                dk=lambda: fake_cuda((2, 7, 2, 64), ptr=0))
    with pytest.raises(errors.ArgumentError, match=r"^dk\b.*NULL"):
        _native.attn_bwd(**_native_bwd_args(**over))


def test_attn_bwd_check_metadata_garbage():
    q = tensor_meta(_meta(2, 5, 4, 32))
    k = tensor_meta(_meta(2, 7, 2, 32))
    lse = tensor_meta(_meta(2, 4, 5, dtype=F32))
    with pytest.raises(TypeError):
        _native.attn_bwd_check("x", q, k, k, q, lse, None, None, 5, 7)
    bad = ((2, 5, 4, 32), (640, 128, 32), "bfloat16", (2, 0))  # 3 strides for 4 dims
    with pytest.raises(errors.ArgumentError, match=r"^dout\b"):
        _native.attn_bwd_check(bad, q, k, k, q, lse, None, None, 5, 7)
    assert _native.attn_bwd_check(q, q, k, k, q, lse, None, None, 5, 7) is None
