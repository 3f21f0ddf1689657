"""Adversarial GPU tests (``-m gpu``; skipped without CUDA).

Valid-but-unusual inputs must give the right numbers (checked against ferroattn.testing with the
flash-attention pass rule): stride-0 broadcasts (the GQA trick of expanding one kv head), overlapping
rows, seqlen 1 against 4096, s_k = 0, empty batches, odd head dims, misaligned and non-contiguous
views, offsets past 2^31 elements. Invalid inputs must raise the ferroattn.errors class and leave the
device usable: after every rejected call a valid call runs and ``torch.cuda.synchronize()`` reports
no (sticky) error. Cases that could kill the CUDA context (garbage stream handles, cu_seqlens that
were made invalid behind the library's back) run in a subprocess.

Cases marked ``xfail(strict=True, reason="BUG: ...")`` assert the correct behaviour and fail today
(the same bugs are shown without a GPU in tests/test_adversarial.py).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ferroattn import _native, errors
from ferroattn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_varlen_func,
)
from ferroattn.ops.variant import AttnVariant
from ferroattn.testing import (
    assert_close_to_ref,
    attention_ref,
    attention_varlen_ref,
    max_abs_diff,
    random_cu_seqlens,
)

from _gpu_common import BF16, DEV, DTYPES
from _gpu_common import assert_lse_close as _lse_ok
from _gpu_common import rand as _rand

pytestmark = pytest.mark.gpu


def bug(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"BUG: {reason}")


def check_padded(q, k, v, causal=False, softmax_scale=None):
    """flash_attn_func against the fp32 reference (pass rule of DESIGN §5), out and lse."""
    out, lse, s = flash_attn_func(q, k, v, 0.0, softmax_scale, causal, return_attn_probs=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    ref_lp, _ = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype and s.numel() == 0
    assert not torch.isnan(out).any()
    assert_close_to_ref(out, ref, ref_lp)
    _lse_ok(lse, ref_lse)
    return out, lse


def check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, softmax_scale=None):
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, softmax_scale, causal,
                                         return_attn_probs=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale)
    ref_lp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale, upcast=False)
    rows = int(cu_q[-1])
    assert_close_to_ref(out[:rows], ref[:rows], ref_lp[:rows])
    _lse_ok(lse[:, :rows], ref_lse[:, :rows])
    return out, lse


def valid_call_ok():
    """A valid call after a rejected one: right numbers and no sticky CUDA error."""
    q = _rand(2, 33, 4, 64)
    check_padded(q, q[:, :, :2], q[:, :, 2:], True)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# stride-0 and overlapping views
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h", [1, 4, 8])
def test_gqa_by_expanding_one_kv_head(dtype, causal, h):
    """k/v (b, s_k, 1, d).expand(b, s_k, h, d): head stride 0, every query head reads kv head 0.
    Must equal MQA (h_k = 1) and the reference."""
    torch.manual_seed(h)
    q = _rand(2, 97, h, 64, dtype=dtype)
    k1, v1 = _rand(2, 113, 1, 64, dtype=dtype), _rand(2, 113, 1, 64, dtype=dtype)
    k, v = k1.expand(2, 113, h, 64), v1.expand(2, 113, h, 64)
    assert h == 1 or (k.stride(2) == 0 and v.stride(2) == 0)
    out, lse = check_padded(q, k, v, causal)
    out_mqa, lse_mqa = check_padded(q, k1, v1, causal)
    assert max_abs_diff(out, out_mqa) <= 1e-2 and max_abs_diff(lse, lse_mqa) <= 1e-3


@pytest.mark.parametrize("h,hk", [(6, 2), (8, 4)])
def test_gqa_expanded_kv_heads_with_fewer_distinct_heads(h, hk):
    """h_k > 1 kv heads that are all the same memory (stride 0): legal GQA with h % h_k == 0."""
    torch.manual_seed(0)
    q = _rand(2, 65, h, 128)
    k = _rand(2, 70, 1, 128).expand(2, 70, hk, 128)
    v = _rand(2, 70, 1, 128).expand(2, 70, hk, 128)
    check_padded(q, k, v, True)


@pytest.mark.parametrize("which", ["q", "kv", "all"])
def test_batch_stride_zero(which):
    torch.manual_seed(1)
    q = _rand(1, 40, 4, 64).expand(3, 40, 4, 64) if which in ("q", "all") else _rand(3, 40, 4, 64)
    k = _rand(1, 50, 2, 64).expand(3, 50, 2, 64) if which in ("kv", "all") else _rand(3, 50, 2, 64)
    v = _rand(1, 50, 2, 64).expand(3, 50, 2, 64) if which in ("kv", "all") else _rand(3, 50, 2, 64)
    out, _ = check_padded(q, k, v, True)
    assert 0 not in out.stride()
    if which == "all":
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])


def test_sequence_stride_zero_all_keys_equal():
    """k/v rows with stride 0: every key is the same, so every output row is that value row."""
    torch.manual_seed(2)
    q = _rand(2, 37, 4, 64)
    k = _rand(2, 1, 2, 64).expand(2, 129, 2, 64)
    v = _rand(2, 1, 2, 64).expand(2, 129, 2, 64)
    out, _ = check_padded(q, k, v, False)
    want = v[:, :1].repeat_interleave(2, dim=2).expand(2, 37, 4, 64)
    assert max_abs_diff(out, want) <= 1e-2


def test_overlapping_rows_as_strided():
    """Rows that overlap in memory (row stride 8 < head dim 64): legal for read-only inputs."""
    torch.manual_seed(3)
    buf = _rand(2 * 4096)
    k = buf.as_strided((2, 200, 1, 64), (4096, 8, 64, 1))
    v = buf.as_strided((2, 200, 1, 64), (4096, 16, 64, 1), 8)
    q = _rand(2, 31, 2, 64)
    check_padded(q, k, v, True)


# ---------------------------------------------------------------------------------------------
# sequence-length extremes, empty dims
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 4096), (4096, 1), (1, 1), (4096, 4096), (3, 4093), (4093, 3)])
def test_seqlen_one_vs_4096(sq, sk, causal):
    torch.manual_seed(sq + sk)
    q, k, v = _rand(1, sq, 2, 64), _rand(1, sk, 1, 64), _rand(1, sk, 1, 64)
    out, lse = check_padded(q, k, v, causal)
    if causal and sq > sk:  # the first sq - sk rows see no key: exactly 0 and +inf
        assert torch.all(out[:, : sq - sk] == 0) and torch.all(lse[:, :, : sq - sk] == math.inf)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_mix_of_1_and_4096(causal):
    torch.manual_seed(4)
    lq = [1, 4096, 1, 7, 0, 300]
    lk = [4096, 1, 0, 7, 3, 300]
    cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
    q, k, v = _rand(sum(lq), 4, 64), _rand(sum(lk), 2, 64), _rand(sum(lk), 2, 64)
    out, lse = check_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal)
    row = sum(lq[:2])  # the q row of the sequence with no keys
    assert torch.all(out[row] == 0) and torch.all(lse[:, row] == math.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [8, 64, 100])
def test_sk_zero_gives_zeros_and_inf(dtype, causal, d):
    q = _rand(2, 17, 4, d, dtype=dtype)
    k = _rand(2, 0, 2, d, dtype=dtype)
    out, lse, _ = flash_attn_func(q, k, k, causal=causal, return_attn_probs=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and torch.all(out == 0)
    assert lse.shape == (2, 4, 17) and torch.all(lse == math.inf)
    valid_call_ok()


def test_varlen_every_k_sequence_empty():
    q = _rand(12, 4, 64)
    k = _rand(0, 2, 64)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEV)
    out, lse, _ = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 7, 0, return_attn_probs=True)
    torch.cuda.synchronize()
    assert torch.all(out == 0) and torch.all(lse == math.inf)
    valid_call_ok()


@pytest.mark.parametrize("qs,ks", [((0, 5, 4, 64), (0, 7, 2, 64)), ((2, 0, 4, 64), (2, 7, 2, 64)),
                                   ((2, 5, 0, 64), (2, 7, 2, 64)), ((0, 0, 0, 8), (0, 0, 1, 8))])
def test_empty_problems(qs, ks):
    q, k = _rand(*qs), _rand(*ks)
    out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    torch.cuda.synchronize()
    assert out.shape == qs and lse.shape == (qs[0], qs[2], qs[1])
    cu = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = flash_attn_varlen_func(_rand(0, 4, 64), _rand(0, 2, 64), _rand(0, 2, 64), cu, cu, 0, 0)
    torch.cuda.synchronize()
    assert out.shape == (0, 4, 64)
    valid_call_ok()


@pytest.mark.parametrize("max_q,max_k", [(2**31 - 1, 7), (7, 2**31 - 1), (2**20, 2**20)])
def test_varlen_max_seqlen_far_above_the_longest(max_q, max_k):
    """max_seqlen only has to be >= the longest sequence: a huge value sizes a huge grid whose
    blocks have nothing to do; the result must still be right (and nothing hangs)."""
    torch.manual_seed(14)
    lq, lk = [5, 7], [7, 3]
    cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
    q, k, v = _rand(12, 1, 64), _rand(10, 1, 64), _rand(10, 1, 64)
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    valid_call_ok()


# ---------------------------------------------------------------------------------------------
# head dims, scales
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 9, 255, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_head_dims(dtype, d, causal):
    torch.manual_seed(d)
    q, k, v = _rand(2, 45, 6, d, dtype=dtype), _rand(2, 77, 3, d, dtype=dtype), _rand(2, 77, 3, d, dtype=dtype)
    out, _ = check_padded(q, k, v, causal)
    assert out.shape[-1] == d


@pytest.mark.parametrize("scale", [0.0, -0.125, -1.0, 1e-30, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_unusual_softmax_scales(scale, causal):
    torch.manual_seed(5)
    q, k, v = _rand(2, 33, 4, 64), _rand(2, 41, 2, 64), _rand(2, 41, 2, 64)
    out, _ = check_padded(q, k, v, causal, softmax_scale=scale)
    if scale == 0.0 and not causal:  # uniform weights: the mean of v
        want = v.float().mean(dim=1, keepdim=True).repeat_interleave(2, dim=2).expand(2, 33, 4, 64)
        assert max_abs_diff(out, want) <= 2e-2


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e300])
def test_non_finite_softmax_scale_rejected(scale):
    q = _rand(2, 33, 4, 64)
    with pytest.raises(errors.ArgumentError, match=r"^softmax_scale\b"):
        flash_attn_func(q, q, q, softmax_scale=scale)
    valid_call_ok()


def test_large_logits_are_stable():
    torch.manual_seed(6)
    q, k, v = _rand(1, 64, 2, 64) * 30, _rand(1, 64, 2, 64) * 30, _rand(1, 64, 2, 64)
    check_padded(q, k, v, True, softmax_scale=1.0)


# ---------------------------------------------------------------------------------------------
# layouts: misaligned, non-contiguous, different strides for k and v, 64-bit offsets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("offset", [1, 3, 4, 7])
def test_misaligned_storage_offsets(which, offset):
    torch.manual_seed(offset)
    shapes = {"q": (2, 29, 4, 64), "k": (2, 31, 2, 64), "v": (2, 31, 2, 64)}
    t = {n: _rand(*s) for n, s in shapes.items()}
    n = math.prod(shapes[which])
    buf = _rand(n + offset)
    t[which] = buf[offset:].view(shapes[which])
    assert t[which].data_ptr() % 16 != 0
    check_padded(t["q"], t["k"], t["v"], True)


def test_odd_row_strides():
    """Padded rows whose stride is not a multiple of 8 elements (e.g. a (.., 68) buffer sliced to 64)."""
    torch.manual_seed(7)
    q = _rand(2, 33, 4, 68)[..., :64]
    k = _rand(2, 40, 2, 66)[..., 1:65]
    v = _rand(2, 40, 2, 72)[..., 3:67]
    check_padded(q, k, v, False)


def test_non_contiguous_last_dim():
    torch.manual_seed(8)
    q = _rand(2, 33, 4, 128)[..., ::2]
    k = _rand(2, 40, 2, 64, 2)[..., 0]
    v = _rand(2, 40, 2, 64)
    assert q.stride(-1) == 2 and k.stride(-1) == 2
    check_padded(q, k, v, True)


def test_k_and_v_with_different_layouts():
    torch.manual_seed(9)
    q = _rand(2, 4, 33, 64).transpose(1, 2)       # (b, s, h, d) view of (b, h, s, d)
    k = _rand(2, 2, 40, 64).transpose(1, 2)
    v = _rand(40, 2, 2, 64).permute(1, 0, 2, 3)   # sequence-major batch
    out, _ = check_padded(q, k, v, True)
    assert out.stride() == q.stride()  # out keeps q's stride order


def test_offsets_past_2_pow_31_elements_padded():
    """The second batch of q/k/v starts 2^31 elements (4 GiB) after the first: 64-bit offsets."""
    torch.manual_seed(10)
    big = 2**31
    buf = torch.empty(big + 64 * 4 * 64, dtype=BF16, device=DEV)
    q = buf.as_strided((2, 64, 4, 64), (big, 256, 64, 1))
    q.copy_(torch.randn(2, 64, 4, 64, device=DEV))
    k = torch.empty(big + 96 * 2 * 64, dtype=BF16, device=DEV).as_strided((2, 96, 2, 64), (big, 128, 64, 1))
    k.copy_(torch.randn(2, 96, 2, 64, device=DEV))
    v = _rand(2, 96, 2, 64)
    check_padded(q, k, v, True)
    del buf
    torch.cuda.empty_cache()


def test_offsets_past_2_pow_31_elements_varlen():
    """Varlen k rows 2^23 elements apart: cu_seqlens row * row stride passes 2^31."""
    torch.manual_seed(11)
    rows, stride = 300, 2**23
    kbuf = torch.empty(rows * stride, dtype=BF16, device=DEV)
    k = kbuf.as_strided((rows, 1, 64), (stride, 64, 1))
    k.copy_(torch.randn(rows, 1, 64, device=DEV))
    v = _rand(rows, 1, 64)
    lq, lk = [50, 70, 9], [100, 100, 100]
    cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
    q = _rand(sum(lq), 2, 64)
    check_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    del kbuf
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# rejected calls leave the device usable
# ---------------------------------------------------------------------------------------------
def _native_call(q, k, v, out, lse, cu_q=None, cu_k=None, mq=0, mk=0, stream=None):
    if stream is None:
        stream = torch.cuda.current_stream().cuda_stream
    return _native.attn_fwd(q, k, v, out, lse, cu_q, cu_k, mq, mk, 0.125, AttnVariant(), stream)


REJECTED = {
    "fp32": (errors.DTypeError, "q", lambda q, k, qv, cu: flash_attn_func(q.float(), k.float(), k.float())),
    "fp64": (errors.DTypeError, "q", lambda q, k, qv, cu: flash_attn_func(q.double(), k.double(), k.double())),
    "mixed": (errors.DTypeError, "v", lambda q, k, qv, cu: flash_attn_func(q, k, k.half())),
    "head_dim_257": (errors.ArgumentError, "q", lambda q, k, qv, cu: flash_attn_func(_rand(2, 9, 4, 257), _rand(2, 9, 2, 257),
                                                                                     _rand(2, 9, 2, 257))),
    "hk_gt_h": (errors.ArgumentError, "k", lambda q, k, qv, cu: flash_attn_func(k, q, q)),
    "batch": (errors.ArgumentError, "k", lambda q, k, qv, cu: flash_attn_func(q, k[:1], k[:1])),
    "v_seqlen": (errors.ArgumentError, "v", lambda q, k, qv, cu: flash_attn_func(q, k, k[:, :-1])),
    "cu_int64": (errors.DTypeError, "cu_seqlens_q", lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu.long(), cu, 7, 7)),
    "cu_cpu": (errors.DeviceError, "cu_seqlens_k", lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu, cu.cpu(), 7, 7)),
    "cu_2d": (errors.ArgumentError, "cu_seqlens_q", lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu[None], cu, 7, 7)),
    "cu_decreasing": (errors.ArgumentError, "cu_seqlens_q",
                      lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu.flip(0).contiguous(), cu, 12, 7)),
    "cu_last_huge": (errors.ArgumentError, "cu_seqlens_k",
                     lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu, torch.tensor([0, 5, 2**31 - 1], dtype=torch.int32,
                                                                                              device=DEV), 7, 7)),
    "max_seqlen_small": (errors.ArgumentError, "max_seqlen_q", lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu, cu, 3, 7)),
    "max_seqlen_negative": (errors.ArgumentError, "max_seqlen_k", lambda q, k, qv, cu: flash_attn_varlen_func(qv, qv, qv, cu, cu, 7, -1)),
    "native_out_shape": (errors.ArgumentError, "out", lambda q, k, qv, cu: _native_call(
        q, k, k, torch.empty(2, 33, 4, 32, dtype=BF16, device=DEV), torch.empty(2, 4, 33, device=DEV))),
    "native_out_cpu": (errors.DeviceError, "out", lambda q, k, qv, cu: _native_call(
        q, k, k, torch.empty(2, 33, 4, 64, dtype=BF16), torch.empty(2, 4, 33, device=DEV))),
    "native_lse_dtype": (errors.DTypeError, "softmax_lse", lambda q, k, qv, cu: _native_call(
        q, k, k, torch.empty_like(q), torch.empty(2, 4, 33, device=DEV, dtype=BF16))),
    "native_lse_shape": (errors.ArgumentError, "softmax_lse", lambda q, k, qv, cu: _native_call(
        q, k, k, torch.empty_like(q), torch.empty(2, 33, 4, device=DEV))),
    "native_misaligned": (errors.ArgumentError, "q", lambda q, k, qv, cu: _native_call(
        torch.empty(2 * 33 * 4 * 64 + 1, dtype=BF16, device=DEV)[1:].view(2, 33, 4, 64), k, k,
        torch.empty_like(q), torch.empty(2, 4, 33, device=DEV))),
    "native_row_stride": (errors.ArgumentError, "k", lambda q, k, qv, cu: _native_call(
        q, _rand(2, 33, 2, 68)[..., :64], k, torch.empty_like(q), torch.empty(2, 4, 33, device=DEV))),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_rejected_then_valid_call(case):
    exc, name, call = REJECTED[case]
    q, k = _rand(2, 33, 4, 64), _rand(2, 33, 2, 64)
    qv, cu = _rand(12, 4, 64), torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV)
    with pytest.raises(exc, match=rf"^({name})\b"):
        call(q, k, qv, cu)
    valid_call_ok()


def test_cu_seqlens_first_value_nonzero_rejected():
    qv = _rand(12, 4, 64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV)
    with pytest.raises(errors.ArgumentError, match=r"^cu_seqlens_q\b"):
        flash_attn_varlen_func(qv, qv, qv, torch.tensor([3, 5, 12], dtype=torch.int32, device=DEV), cu, 7, 7)
    valid_call_ok()


@pytest.mark.parametrize("loss_on", ["out", "lse"])
def test_requires_grad_forward_then_backward(loss_on):
    """Forward with requires_grad gives the forward's numbers; the backward runs; a loss on the LSE
    alone gives zero gradients (its gradient is ignored, as in flash_attn)."""
    from ferroattn.testing import attention_grads_ref

    torch.manual_seed(12)
    q = _rand(2, 33, 4, 40).requires_grad_()
    k = _rand(2, 33, 2, 40).requires_grad_()
    v = _rand(2, 33, 2, 40).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
    ref_lp, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True, upcast=False)
    assert_close_to_ref(out.detach(), ref, ref_lp)
    (out.float().sum() if loss_on == "out" else lse.sum()).backward()
    if loss_on == "lse":
        assert all(torch.all(x.grad == 0) for x in (q, k, v))
    else:
        ones = torch.ones_like(out)
        refs = attention_grads_ref(q, k, v, ones, causal=True)
        refs_lp = attention_grads_ref(q, k, v, ones, causal=True, upcast=False)
        for name, x, r, r_lp in zip("qkv", (q, k, v), refs, refs_lp):
            assert_close_to_ref(x.grad, r, r_lp, factor=3.0, name=f"d{name}")
    valid_call_ok()


def test_kvpacked_with_expanded_kv():
    torch.manual_seed(13)
    q = _rand(2, 20, 4, 64)
    kv = _rand(2, 30, 2, 1, 64).expand(2, 30, 2, 4, 64)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    ref, _ = attention_ref(q, kv[:, :, 0], kv[:, :, 1], causal=True)
    ref_lp, _ = attention_ref(q, kv[:, :, 0], kv[:, :, 1], causal=True, upcast=False)
    assert_close_to_ref(out, ref, ref_lp)


# ---------------------------------------------------------------------------------------------
# crash isolation: run in a subprocess so that a dead context cannot take the test run down
# ---------------------------------------------------------------------------------------------
_PRELUDE = textwrap.dedent("""
    import torch, traceback
    from ferroattn import _native, errors
    from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    def valid():
        q = torch.randn(2, 33, 4, 64, dtype=torch.bfloat16, device="cuda")
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), q.transpose(1, 2).float(), q.transpose(1, 2).float()).transpose(1, 2)
        out = flash_attn_func(q, q, q)
        torch.cuda.synchronize()
        assert (out.float() - ref).abs().max().item() < 3e-2
        print("VALID_OK", flush=True)
""")


def _run_isolated(body: str, timeout: int = 300) -> subprocess.CompletedProcess:
    script = _PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def test_cu_seqlens_written_behind_the_memo():
    """The verified-values memo (ops.attention._VERIFIED) is keyed on torch's version counter.
    A write that bypasses it (``x.data[...] = ...``, numpy/DLPack/custom kernels) is not
    re-checked (documented limitation of check_cu_seqlens_values): the kernel clamps cu_seqlens
    to the tensors, so the call may give wrong rows but must neither fault nor poison the context.
    A write through the counter (``cu[2] = ...``) is re-checked: ArgumentError."""
    proc = _run_isolated("""
        q = torch.randn(12, 4, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)
        torch.cuda.synchronize()
        cu.data[2] = 1 << 20          # not seen by the version counter
        flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)
        torch.cuda.synchronize()
        print("BYPASS_SURVIVED", flush=True)
        cu[2] = 1 << 20               # seen by the version counter
        try:
            flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)
            torch.cuda.synchronize()
            print("RESULT accepted", flush=True)
        except errors.ArgumentError as e:
            print("RESULT ArgumentError", str(e), flush=True)
        valid()
    """)
    assert proc.returncode == 0, f"process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert "BYPASS_SURVIVED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "RESULT ArgumentError cu_seqlens_q" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "VALID_OK" in proc.stdout


def test_hf_mask_longer_than_kv_does_not_poison_the_context():
    proc = _run_isolated("""
        from ferroattn.integrations.transformers import ferroattn_attention_forward
        class Layer(torch.nn.Module):
            is_causal = True
        q = torch.randn(2, 4, 6, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 2, 6, 64, dtype=torch.bfloat16, device="cuda")
        mask = torch.ones(2, 8, dtype=torch.bool, device="cuda")
        try:
            ferroattn_attention_forward(Layer(), q, k, k, mask)
            torch.cuda.synchronize()
            print("RESULT accepted", flush=True)
        except errors.ArgumentError as e:
            print("RESULT ArgumentError", str(e), flush=True)
        valid()
    """)
    assert proc.returncode == 0, f"process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert "RESULT ArgumentError attention_mask" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "VALID_OK" in proc.stdout
