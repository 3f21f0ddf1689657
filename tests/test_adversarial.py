"""Adversarial argument tests (CPU; no GPU needed).

Every bad input must give a clear exception: a class of :mod:`ferroattn.errors` (a RuntimeError
and a ValueError/TypeError), or NotImplementedError for unsupported features, whose message starts
with the argument's name and carries the expected and actual value; never a crash, a
PanicException, a raw ZeroDivisionError/AttributeError/IndexError, or silent acceptance. After every
rejected call a valid call must succeed.

Tensors come in three kinds:
- "fake": FakeTensorMode CUDA tensors (the fake impl: Rust validation of metadata);
- "meta": meta tensors (same path, described as CUDA device 0);
- "cpu":  real CPU tensors (the real op: value checks of cu_seqlens, then Rust validation of the
  DLPack-imported tensors, which ends in DeviceError for q when everything else is right);
plus hand-made DLPack capsules that claim to be CUDA memory (ctypes), to drive
``_native.attn_fwd``'s validation of ``out`` / ``softmax_lse`` / alignment without a GPU. Capsules
whose arguments are all valid would launch on a fake pointer, so those tests are skipped when a
CUDA driver is present.

Cases marked ``xfail(strict=True, reason="BUG: ...")`` assert the correct behaviour and fail today.
"""
from __future__ import annotations

import ctypes
import logging
import re

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ferroattn import _native, errors
from ferroattn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ferroattn.ops.variant import AttnVariant

from _bad_inputs import Env, env, padded, varlen

# FakeTensorMode logs every exception a fake impl raises at ERROR level; these are expected here.
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

BF16, FP16 = torch.bfloat16, torch.float16
I32 = torch.int32
HAS_CUDA_DRIVER = _native.cuda_available()
no_driver = pytest.mark.skipif(
    HAS_CUDA_DRIVER, reason="passes fake CUDA pointers that would reach a real launch")


def bug(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"BUG: {reason}")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def valid_call_succeeds():
    """The contract's 'afterwards a valid call succeeds', on fake CUDA tensors (padded + varlen)."""
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        k = torch.empty(2, 7, 2, 32, dtype=BF16, device="cuda")
        out = flash_attn_func(q, k, k, causal=True)
        assert out.shape == (2, 5, 6, 32) and out.dtype == BF16
        qv = torch.empty(9, 6, 32, dtype=BF16, device="cuda")
        cu = torch.tensor([0, 4, 9], dtype=I32, device="cuda")
        out = flash_attn_varlen_func(qv, qv[:, :2], qv[:, :2], cu, cu, 5, 5)
        assert out.shape == (9, 6, 32)


def expect(exc, names: str, call, *, ferro: bool = True, contains=()):
    """``call()`` raises ``exc`` whose message starts with one of ``names`` (a regex alternation)
    and contains every string of ``contains``; then a valid call succeeds."""
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert re.match(rf"({names})\b", msg), f"message does not start with {names!r}: {msg!r}"
    for s in contains:
        assert s in msg, f"message lacks {s!r}: {msg!r}"
    if ferro:
        assert isinstance(info.value, errors.FerroattnError) and isinstance(info.value, RuntimeError)
        assert isinstance(info.value, (ValueError, TypeError))
    valid_call_succeeds()
    return info.value





MODES = ["fake", "meta", "cpu"]
META_MODES = ["fake", "meta"]


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.int8,
                                   torch.uint8, torch.bool])
def test_q_k_v_unsupported_dtype(mode, dtype):
    with env(mode) as e:
        call = padded(e, q=e.t(2, 5, 6, 32, dtype=dtype), k=e.t(2, 7, 2, 32, dtype=dtype),
                      v=e.t(2, 7, 2, 32, dtype=dtype))
        expect(errors.DTypeError, "q", call, contains=("float16", str(dtype).removeprefix("torch.")))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("qdt,kdt", [(BF16, FP16), (FP16, BF16), (FP16, torch.float32)])
def test_mixed_dtypes(mode, which, qdt, kdt):
    with env(mode) as e:
        over = {"q": e.t(2, 5, 6, 32, dtype=qdt), "k": e.t(2, 7, 2, 32, dtype=qdt), "v": e.t(2, 7, 2, 32, dtype=qdt)}
        over[which] = e.t(2, 7, 2, 32, dtype=kdt)
        expect(errors.DTypeError, which, padded(e, **over))


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.int16])
def test_exotic_dtype_message_names_the_supported_dtypes(mode, dtype):
    with env(mode) as e:
        call = padded(e, q=e.t(2, 5, 6, 32, dtype=dtype), k=e.t(2, 7, 2, 32, dtype=dtype),
                      v=e.t(2, 7, 2, 32, dtype=dtype))
        err = expect(errors.DTypeError, "q", call, contains=("float16 or bfloat16",))
        assert "float32" not in str(err)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.uint8])
def test_cu_seqlens_wrong_dtype(mode, which, dtype):
    with env(mode) as e:
        vals = [0, 4, 9] if which == "cu_seqlens_q" else [0, 5, 11]
        expect(errors.DTypeError, which, varlen(e, **{which: e.cu(vals, dtype=dtype)}), contains=("int32",))


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(32,), (5, 32), (5, 6, 32), (2, 5, 6, 1, 32)])
def test_q_wrong_rank_padded(mode, shape):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t(*shape)))


@pytest.mark.parametrize("mode", MODES)
def test_q_zero_dim(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which,shape", [("k", (7, 2, 32)), ("v", (2, 7, 2, 1, 32)), ("k", (2, 7, 2, 32, 1))])
def test_kv_wrong_rank_padded(mode, which, shape):
    with env(mode) as e:
        expect(errors.ArgumentError, which, padded(e, **{which: e.t(*shape)}))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which,shape", [("q", (1, 9, 6, 32)), ("k", (1, 11, 2, 32)), ("q", (9, 192))])
def test_varlen_wrong_rank(mode, which, shape):
    with env(mode) as e:
        over = {which: e.t(*shape)}
        if which == "k":
            over["v"] = e.t(*shape)
        expect(errors.ArgumentError, which, varlen(e, **over))


@pytest.mark.parametrize("what", [None, [[1.0]], 3.0, np.zeros((2, 5, 6, 32), np.float16)])
def test_q_not_a_tensor(what):
    with FakeTensorMode():
        k = torch.empty(2, 7, 2, 32, dtype=BF16, device="cuda")
    with pytest.raises(TypeError, match=r"^q\b"):
        flash_attn_func(what, k, k)
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# zero-sized dims
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("qs,ks,causal", [
    ((0, 5, 6, 32), (0, 7, 2, 32), True),   # b = 0
    ((2, 0, 6, 32), (2, 7, 2, 32), True),   # s_q = 0
    ((2, 5, 6, 32), (2, 0, 2, 32), True),   # s_k = 0 (rows see no key: out 0, lse +inf on GPU)
    ((2, 5, 6, 32), (2, 0, 2, 32), False),
    ((2, 5, 0, 32), (2, 7, 2, 32), False),  # h = 0 (0 % 2 == 0)
    ((0, 0, 0, 32), (0, 0, 1, 32), False),
])
def test_zero_sized_dims_are_valid(mode, qs, ks, causal):
    with env(mode) as e:
        q, k = e.t(*qs), e.t(*ks)
        out, lse, s = flash_attn_func(q, k, k, causal=causal, return_attn_probs=True)
        assert out.shape == qs and out.dtype == BF16
        assert lse.shape == (qs[0], qs[2], qs[1]) and lse.dtype == torch.float32
        assert s.shape == (0,)


@pytest.mark.parametrize("mode", MODES)
def test_zero_kv_heads_rejected(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "k", padded(e, q=e.t(2, 5, 0, 32), k=e.t(2, 7, 0, 32), v=e.t(2, 7, 0, 32)))


@pytest.mark.parametrize("mode", MODES)
def test_zero_head_dim_with_scale(mode):
    with env(mode) as e:
        q, k = e.t(2, 5, 6, 0), e.t(2, 7, 2, 0)
        expect(errors.ArgumentError, "q", lambda: flash_attn_func(q, k, k, softmax_scale=1.0), contains=("0",))


@pytest.mark.parametrize("mode", MODES)
def test_zero_head_dim_default_scale(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t(2, 5, 6, 0), k=e.t(2, 7, 2, 0), v=e.t(2, 7, 2, 0)))


@pytest.mark.parametrize("mode", META_MODES)
def test_varlen_zero_sized(mode):
    with env(mode) as e:
        q, k = e.t(0, 6, 32), e.t(11, 2, 32)
        cu0, cuk = e.cu([0, 0, 0]), e.cu([0, 5, 11])
        out, lse, _ = flash_attn_varlen_func(q, k, k, cu0, cuk, 0, 6, return_attn_probs=True)
        assert out.shape == (0, 6, 32) and lse.shape == (6, 0)
        q = e.t(9, 6, 32)
        out = flash_attn_varlen_func(q, e.t(0, 2, 32), e.t(0, 2, 32), e.cu([0, 4, 9]), cu0, 5, 0)
        assert out.shape == (9, 6, 32)


# ---------------------------------------------------------------------------------------------
# head dims
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("d", [1, 7, 8, 36, 255, 256])
def test_supported_head_dims(mode, d):
    with env(mode) as e:
        q, k = e.t(2, 5, 6, d), e.t(2, 7, 2, d)
        out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
        assert out.shape == (2, 5, 6, d) and lse.shape == (2, 6, 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [264, 512, 1024])
def test_head_dim_too_large(mode, d):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t(2, 5, 6, d), k=e.t(2, 7, 2, d), v=e.t(2, 7, 2, d)),
               contains=(str(d), "256"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [257, 300])
def test_head_dim_too_large_message_reports_user_value(mode, d):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t(2, 5, 6, d), k=e.t(2, 7, 2, d), v=e.t(2, 7, 2, d)),
               contains=(str(d),))


@pytest.mark.parametrize("mode", MODES)
def test_k_head_dim_differs(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "k", padded(e, k=e.t(2, 7, 2, 64), v=e.t(2, 7, 2, 64)), contains=("32", "64"))


@pytest.mark.parametrize("mode", MODES)
def test_k_head_dim_differs_unpadded_message(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "k", padded(e, q=e.t(2, 5, 6, 7), k=e.t(2, 7, 2, 9), v=e.t(2, 7, 2, 9)),
               contains=("7", "9"))


# ---------------------------------------------------------------------------------------------
# heads, batch, k/v shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h,hk", [(6, 4), (2, 4), (6, 12), (1, 2), (7, 2)])
def test_heads_not_divisible_or_hk_greater(mode, h, hk):
    with env(mode) as e:
        expect(errors.ArgumentError, "k", padded(e, q=e.t(2, 5, h, 32), k=e.t(2, 7, hk, 32), v=e.t(2, 7, hk, 32)),
               contains=(str(h), str(hk)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which,shape", [
    ("v", (2, 8, 2, 32)),   # different seqlen
    ("v", (2, 7, 1, 32)),   # different heads
    ("v", (2, 7, 2, 64)),   # different head dim
    ("v", (3, 7, 2, 32)),   # different batch
    ("k", (3, 7, 2, 32)),   # k batch != q batch (v too)
])
def test_kv_shape_mismatch(mode, which, shape):
    with env(mode) as e:
        over = {which: e.t(*shape)}
        if which == "k":
            over["v"] = e.t(*shape)
        expect(errors.ArgumentError, which, padded(e, **over))


@pytest.mark.parametrize("mode", MODES)
def test_varlen_kv_rows_differ(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "v", varlen(e, v=e.t(12, 2, 32)))


# ---------------------------------------------------------------------------------------------
# strides: stride 0, non-contiguous last dim, negative (through DLPack / metadata)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("which,dim", [("k", 2), ("k", 0), ("q", 0), ("q", 1), ("k", 1)])
def test_stride_zero_broadcast_views_accepted(mode, which, dim):
    """expand() gives stride 0: GQA broadcast of one kv head (dim 2), one batch row (dim 0), one
    position (dim 1). Legal inputs; out must be a dense tensor of q's shape (never stride 0)."""
    with env(mode) as e:
        full = {"q": (2, 5, 6, 32), "k": (2, 7, 6, 32)}
        small = list(full[which])
        small[dim] = 1
        x = e.t(*small).expand(*full[which])
        assert x.stride(dim) == 0
        q = x if which == "q" else e.t(*full["q"])
        k = x if which == "k" else e.t(*full["k"])
        out = flash_attn_func(q, k, k)
        assert out.shape == full["q"]
        assert 0 not in out.stride() and out.is_contiguous()


@pytest.mark.parametrize("mode", META_MODES)
def test_non_contiguous_last_dim_is_copied(mode):
    with env(mode) as e:
        q = e.t(2, 5, 6, 64)[..., ::2]
        k = e.t(2, 7, 2, 1).expand(2, 7, 2, 32)  # last-dim stride 0
        assert q.stride(-1) == 2 and k.stride(-1) == 0
        out = flash_attn_func(q, k, k)
        assert out.shape == (2, 5, 6, 32)


@pytest.mark.parametrize("mode", META_MODES)
def test_op_direct_rejects_non_contiguous_last_dim(mode):
    with env(mode) as e:
        q, k = e.t(2, 5, 6, 32), e.t(2, 7, 2, 64)[..., ::2]
        expect(errors.ArgumentError, "k", lambda: torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 7, 0.1, False),
               contains=("stride",))


def _meta(shape, strides, dtype="bfloat16", device=(2, 0)):
    return (tuple(shape), tuple(strides), dtype, device)


Q_META = _meta((2, 5, 4, 64), (1280, 256, 64, 1))
K_META = _meta((2, 7, 2, 64), (896, 128, 64, 1))


def test_attn_fwd_check_accepts_baseline():
    assert _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 0, 0) is None


@pytest.mark.parametrize("strides", [(-1280, 256, 64, 1), (1280, -256, 64, 1), (1280, 256, -64, 1),
                                     (1280, 256, 64, -1)])
def test_attn_fwd_check_negative_strides(strides):
    expect(errors.ArgumentError, "q", lambda: _native.attn_fwd_check(_meta((2, 5, 4, 64), strides), K_META, K_META,
                                                                     None, None, 0, 0), contains=("stride",))


@pytest.mark.parametrize("meta,name", [
    (_meta((2, -5, 4, 64), (1280, 256, 64, 1)), "size"),
    (_meta((2, 5, 4, 64), (256, 64, 1)), "strides"),
    (_meta((2, 5, 4, 64), (1280, 256, 64, 0)), "stride"),
    (_meta((2, 5, 4, 64), (1280, 256, 64, 2)), "stride"),
])
def test_attn_fwd_check_malformed_metadata(meta, name):
    expect(errors.ArgumentError, "q", lambda: _native.attn_fwd_check(meta, K_META, K_META, None, None, 0, 0),
           contains=(name,))


def test_attn_fwd_check_unknown_dtype_and_device():
    expect(errors.DTypeError, "q", lambda: _native.attn_fwd_check(_meta((2, 5, 4, 64), (1280, 256, 64, 1), "float17"),
                                                                  K_META, K_META, None, None, 0, 0))
    bad = lambda m: (m[0], m[1], m[2], (99, 0))  # noqa: E731
    expect(errors.DeviceError, "q", lambda: _native.attn_fwd_check(bad(Q_META), bad(K_META), bad(K_META),
                                                                   None, None, 0, 0))


def test_native_negative_strides_from_numpy():
    """numpy exports negative strides through DLPack: the Rust validation must reject them."""
    q = np.zeros((2, 5, 4, 64), np.float16)[::-1]
    k = np.zeros((2, 7, 2, 64), np.float16)
    out, lse = np.zeros((2, 5, 4, 64), np.float16), np.zeros((2, 4, 5), np.float32)
    assert _native.dlpack_info(q)["strides"][0] < 0
    expect(errors.ArgumentError, "q", lambda: _native.attn_fwd(q, k, k, out, lse, None, None, 5, 7, 0.1, AttnVariant(),
                                                               0), contains=("negative",))
    k_neg = np.zeros((2, 7, 2, 64), np.float16)[:, ::-1]
    q_ok = np.zeros((2, 5, 4, 64), np.float16)
    expect(errors.ArgumentError, "k", lambda: _native.attn_fwd(q_ok, k_neg, k_neg, out, lse, None, None, 5, 7, 0.1,
                                                               AttnVariant(), 0), contains=("negative",))


# ---------------------------------------------------------------------------------------------
# misaligned views (storage offsets not multiples of 8 elements)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [1, 3, 5, 7])
def test_misaligned_cpu_views_reach_validation(offset):
    """A misaligned view is copied by the op (it cannot be read in place); on CPU the call then
    fails for the device, not for the alignment, and not with a crash."""
    buf = torch.randn(2 * 5 * 6 * 32 + offset).to(BF16)
    q = buf[offset:].view(2, 5, 6, 32)
    assert q.data_ptr() % 16 != 0
    k = torch.randn(2, 7, 2, 32).to(BF16)
    expect(errors.DeviceError, "q", lambda: flash_attn_func(q, k, k))


# ---------------------------------------------------------------------------------------------
# huge shapes (meta / fake): 32-bit limits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
def test_huge_heads_rejected(mode):
    with env(mode) as e:
        expect(errors.ArgumentError, "q", padded(e, q=e.t(1, 5, 70000, 32), k=e.t(1, 7, 1, 32), v=e.t(1, 7, 1, 32)),
               contains=("65535", "70000"))
        assert padded(e, q=e.t(1, 5, 65535, 32), k=e.t(1, 7, 1, 32), v=e.t(1, 7, 1, 32))().shape == (1, 5, 65535, 32)


@pytest.mark.parametrize("mode", META_MODES)
def test_batch_beyond_int32_rejected(mode):
    """Any batch up to 2^31 - 1 is valid (a batch beyond the grid's 65535 runs as several launches);
    beyond, an ArgumentError naming q (padded) or cu_seqlens_q (varlen: the batch is its length - 1)
    with the limit and the value."""
    with env(mode) as e:
        b = 2**31
        expect(errors.ArgumentError, "q", padded(e, q=e.t(b, 1, 2, 32), k=e.t(b, 1, 2, 32), v=e.t(b, 1, 2, 32)),
               contains=("batch size <= 2147483647", str(b)))
        cu = e.t(b + 1, dtype=torch.int32)  # values unread on fake/meta tensors
        expect(errors.ArgumentError, "cu_seqlens_q", varlen(e, q=e.t(3, 2, 32), k=e.t(3, 1, 32), v=e.t(3, 1, 32),
                                                            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                                                            max_seqlen_k=1),
               contains=("batch size <= 2147483647", str(b)))


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("b", [65535, 65536, 65537, 200_000])
def test_large_batch_is_valid(mode, b):
    """The grid's 65535 batch entries and beyond (the launches split the batch,
    src/ops/attention/batch.rs): forward and backward, padded and varlen, with a variant."""
    with env(mode) as e:
        q, k = e.t(b, 2, 2, 32), e.t(b, 3, 1, 32)
        out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (b, 2, 2)
        slopes = e.t(b, 2, dtype=torch.float32)
        assert flash_attn_func(q, k, k, window_size=(1, 0), softcap=3.0, alibi_slopes=slopes).shape == q.shape
        cu = e.cu([0] * (b + 1))
        qv, kv = e.t(b, 2, 32), e.t(b, 1, 32)
        assert flash_attn_varlen_func(qv, kv, kv, cu, cu, 1, 1, causal=True, alibi_slopes=slopes).shape == qv.shape
        assert torch.ops.ferroattn.attn_bwd(q, q, k, k, q, lse, None, None, 2, 3, 0.1, True, False)[0].shape == q.shape
    if mode == "meta":  # the backward through autograd (meta tensors run the engine without a GPU)
        q = torch.empty(b, 2, 2, 32, dtype=BF16, device="meta", requires_grad=True)
        flash_attn_func(q, q, q, causal=True, window_size=(1, 0)).float().sum().backward()
        assert q.grad.shape == q.shape


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("which", ["q", "k"])
def test_huge_padded_seqlen_names_the_tensor(mode, which):
    with env(mode) as e:
        s = 2**31
        over = {"q": e.t(1, s, 1, 32)} if which == "q" else {"k": e.t(1, s, 1, 32), "v": e.t(1, s, 1, 32)}
        over.setdefault("q", e.t(1, 5, 1, 32))
        over.setdefault("k", e.t(1, 7, 1, 32))
        over.setdefault("v", e.t(1, 7, 1, 32))
        expect(errors.ArgumentError, which, padded(e, **over), contains=(str(s),))


@pytest.mark.parametrize("mode", META_MODES)
def test_huge_but_legal_numel(mode):
    """More than 2^31 (and 2^40) elements per tensor is legal: strides are 64-bit."""
    with env(mode) as e:
        q = e.t(4, 2**20, 16, 64)
        assert q.numel() > 2**31
        out, lse, _ = flash_attn_func(q, q, q, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (4, 16, 2**20)
        q = e.t(65535, 2**20, 16, 64)
        assert flash_attn_func(q, q[:, :, :1], q[:, :, :1]).shape == q.shape


# ---------------------------------------------------------------------------------------------
# max_seqlen
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", [-1, -(2**31), 2**31, 2**40])
def test_max_seqlen_out_of_range(mode, which, value):
    with env(mode) as e:
        expect(errors.ArgumentError, which, varlen(e, **{which: value}), contains=(str(value),))


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", [5.5, 6.0, None, "6", 2**63, 2**64], ids=["5.5", "6.0", "None", "str", "2^63", "2^64"])
def test_max_seqlen_wrong_type(mode, which, value):
    with env(mode) as e:
        with pytest.raises((errors.ArgumentError, errors.DTypeError)) as info:
            varlen(e, **{which: value})()
        assert re.match(rf"{which}\b", str(info.value)), str(info.value)
    valid_call_succeeds()


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("value", [np.int64(6), np.int32(6), True], ids=["np.int64", "np.int32", "bool"])
def test_max_seqlen_int_like_accepted(mode, value):
    with env(mode) as e:
        assert varlen(e, max_seqlen_k=value if value is not True else 6)().shape == (9, 6, 32)


# ---------------------------------------------------------------------------------------------
# softmax_scale
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.0, -0.125, 1e-30, 1e4, 1, "tensor"], ids=str)
def test_softmax_scale_unusual_but_valid(scale):
    with FakeTensorMode():
        scale = torch.tensor(0.5) if scale == "tensor" else scale
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        assert flash_attn_func(q, q[:, :, :2], q[:, :, :2], softmax_scale=scale).shape == q.shape


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 1e300, 2**1100, "0.5",
                                   [0.5], "tensor2"],
                         ids=["nan", "inf", "-inf", "1e300_overflows_f32", "2^1100", "str", "list", "tensor2"])
def test_softmax_scale_invalid(scale):
    with FakeTensorMode():
        scale = torch.tensor([0.5, 1.0]) if scale == "tensor2" else scale
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        with pytest.raises((errors.ArgumentError, errors.DTypeError)) as info:
            flash_attn_func(q, q[:, :, :2], q[:, :, :2], softmax_scale=scale)
        assert str(info.value).startswith("softmax_scale")
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# causal
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False, 1, 0, np.bool_(True), "tensor", None],
                         ids=["True", "False", "1", "0", "np.bool_", "tensor", "None"])
def test_causal_bool_like_accepted(causal):
    with FakeTensorMode():
        causal = torch.tensor(True) if isinstance(causal, str) else causal
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        assert flash_attn_func(q, q, q, causal=causal).shape == q.shape


@pytest.mark.parametrize("causal", ["False", "no", [], (0,), "tensor2"],
                         ids=["str_False", "str_no", "empty_list", "tuple", "tensor2"])
def test_causal_not_a_bool(causal):
    with FakeTensorMode():
        causal = torch.tensor([True, False]) if causal == "tensor2" else causal
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        with pytest.raises(errors.ArgumentError, match=r"^causal\b"):
            flash_attn_func(q, q, q, causal=causal)
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# dropout_p, softcap, window_size, return_attn_probs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.1, 0.5, 0.999, 1e-9])
def test_dropout_positive_runs(p):
    """Dropout is implemented: any p in (0, 1) is accepted (no NotImplementedError), with
    flash_attn's S_dmask (b, h, round128(s_q), round128(s_k)) in q's dtype for return_attn_probs."""
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        out = flash_attn_func(q, q, q, dropout_p=p)
        assert out.shape == q.shape and out.dtype == BF16
        out, lse, s_dmask = flash_attn_func(q, q, q, dropout_p=p, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (2, 6, 5)
        assert s_dmask.shape == (2, 6, 128, 128) and s_dmask.dtype == BF16 and s_dmask.device == q.device
    valid_call_succeeds()


@pytest.mark.parametrize("p", [-0.1, -1.0, float("-inf"), float("nan"), 1.0, 1.5, float("inf"), "0.1"],
                         ids=["-0.1", "-1", "-inf", "nan", "1.0", "1.5", "inf", "str"])
def test_dropout_invalid(p):
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        with pytest.raises((ValueError, TypeError)) as info:
            flash_attn_func(q, q, q, dropout_p=p)
        assert not isinstance(info.value, NotImplementedError)
        assert str(info.value).startswith("dropout_p"), str(info.value)
    valid_call_succeeds()


@pytest.mark.parametrize("kw,exc,contains", [
    (dict(softcap=-1.0), errors.ArgumentError, ("-1.0",)),
    (dict(softcap=float("inf")), errors.ArgumentError, ("inf",)),
    (dict(alibi_slopes="cpu"), errors.DeviceError, ("cuda:0", "cpu")),
    (dict(alibi_slopes="other_gpu"), errors.DeviceError, ("cuda:0", "cuda:1")),
    (dict(alibi_slopes="f64"), errors.DTypeError, ("float32", "float64")),
    (dict(alibi_slopes="2d_wrong"), errors.ArgumentError, ("(6,) or (2, 6)", "(6, 2)")),
    (dict(alibi_slopes=[0.5] * 6), errors.DTypeError, ("list",)),
], ids=["softcap_neg", "softcap_inf", "alibi_cpu", "alibi_other_gpu", "alibi_f64", "alibi_shape", "alibi_list"])
def test_variant_arguments_name_the_argument(kw, exc, contains):
    """Window, softcap and ALiBi are implemented: a bad value is an error naming the argument
    (never NotImplementedError, never silently ignored)."""
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        name = next(iter(kw))
        made = {"cpu": lambda: torch.ones(6), "other_gpu": lambda: torch.ones(6, device="cuda:1"),
                "f64": lambda: torch.ones(6, dtype=torch.float64, device="cuda"),
                "2d_wrong": lambda: torch.ones(6, 2, device="cuda")}
        value = kw[name]
        value = made[value]() if isinstance(value, str) else value
        with pytest.raises(exc) as info:
            flash_attn_func(q, q, q, **{name: value})
        assert not isinstance(info.value, NotImplementedError)
        msg = str(info.value)
        assert msg.startswith(f"{name}: "), msg
        assert all(c in msg for c in contains), msg
        # the valid forms of the same arguments
        assert flash_attn_func(q, q, q, softcap=1.0, alibi_slopes=torch.ones(6, device="cuda")).shape == q.shape
        assert flash_attn_func(q, q, q, alibi_slopes=torch.ones(2, 6, device="cuda")).shape == q.shape
    valid_call_succeeds()


@pytest.mark.parametrize("make,names,exc", [
    (lambda: torch.ones(5, device="cuda"), "s_aux", errors.ArgumentError),
    (lambda: torch.ones(6, dtype=torch.int64, device="cuda"), "s_aux", errors.DTypeError),
    (lambda: torch.ones(6), "s_aux", errors.DeviceError),
    (lambda: [0.0] * 6, "s_aux", errors.DTypeError),
], ids=["shape", "int64", "cpu", "list"])
def test_s_aux_errors_name_s_aux_or_the_ops_sinks(make, names, exc):
    """The dtype/shape/device of s_aux are checked by the op (its argument ``sinks``); the message
    names s_aux, the flash_attn functions' name."""
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        expect(exc, names, lambda: flash_attn_func(q, q, q, s_aux=make()))


def test_s_aux_shape_error_names_s_aux():
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        expect(errors.ArgumentError, "s_aux", lambda: flash_attn_func(q, q, q, s_aux=torch.ones(5, device="cuda")))


@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-5, -7), False), ((-1, 0), False),
                                           ((7, 7), False), ((100, -1), True), ((-1, 2**70), False)])
def test_window_size_forms_that_normalise_to_full_or_causal(window, causal):
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        k = torch.empty(2, 7, 2, 32, dtype=BF16, device="cuda")
        assert flash_attn_func(q, k, k, causal=causal, window_size=window).shape == q.shape


@pytest.mark.parametrize("window,pairs", [((3, 3), 28), ((0, -1), 15), ((2, 0), 15), ([1, 1], 14), ((0, 0), 5)])
def test_window_size_local_accepted(window, pairs):
    """A real local window runs (the FLOP count shows it reached the op: s_q 5, s_k 7, the
    bottom-right window's visible pairs)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        k = torch.empty(2, 7, 2, 32, dtype=BF16, device="cuda")
        with FlopCounterMode(display=False) as counter:
            assert flash_attn_func(q, k, k, window_size=window).shape == q.shape
        assert counter.get_total_flops() == 4 * 2 * 6 * 32 * pairs
    valid_call_succeeds()


@pytest.mark.parametrize("sq,sk,window", [(3, 1, (0, -1)), (7, 3, (1, -1)), (9, 4, (2, 6)), (9, 4, (-1, 1))])
def test_one_sided_window_with_more_queries_than_keys_matches_flash_attn(sq, sk, window):
    """Only the left side set (right -1 or >= s_k) and s_q > s_k + 1: flash_attn bounds the right
    side at s_k (flash_api.cpp: "if only one side is set, the other becomes seqlen_k"), so the
    first s_q - s_k - 1 rows see fewer keys; the normalised variant must show the same pairs."""
    from ferroattn.ops.attention import visible_pairs
    from ferroattn.ops.variant import AttnVariant as V
    from ferroattn.testing import visible_mask
    v = V.from_flash_attn(False, window, 0.0, None, None, sq, sk)
    assert visible_pairs(sq, sk, v.causal, (v.window_left, v.window_right)) == int(visible_mask(sq, sk, False, window).sum())


@pytest.mark.parametrize("window", [(1,), None, (-1, -1, -1), ("a", "b"), 5, "ab", (float("nan"), -1),
                                    (float("inf"), -1), (0.5, -1)],
                         ids=["len1", "None", "len3", "strs", "int", "str", "nan", "inf", "float"])
def test_window_size_malformed(window):
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        with pytest.raises(errors.ArgumentError, match=r"^window_size\b"):
            flash_attn_func(q, q, q, window_size=window)
    valid_call_succeeds()


@pytest.mark.parametrize("rap", [True, 1, "yes"])
def test_return_attn_probs_forms(rap):
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 7, dtype=FP16, device="cuda")  # padded head dim: out sliced back
        k = torch.empty(2, 9, 3, 7, dtype=FP16, device="cuda")
        res = flash_attn_func(q, k, k, return_attn_probs=rap)
        assert isinstance(res, tuple) and len(res) == 3
        out, lse, s = res
        assert out.shape == (2, 5, 6, 7) and out.dtype == FP16
        assert lse.shape == (2, 6, 5) and lse.dtype == torch.float32 and lse.device == q.device
        assert s.shape == (0,) and s.dtype == FP16 and s.device == q.device
        assert torch.is_tensor(flash_attn_func(q, k, k, return_attn_probs=False))
        assert torch.is_tensor(flash_attn_func(q, k, k, return_attn_probs=0))


def test_return_attn_probs_every_variant():
    with FakeTensorMode():
        c = lambda *s: torch.empty(*s, dtype=BF16, device="cuda")  # noqa: E731
        cu = torch.tensor([0, 4, 9], dtype=I32, device="cuda")
        for res, lse_shape in [
            (flash_attn_qkvpacked_func(c(2, 5, 3, 4, 40), return_attn_probs=True), (2, 4, 5)),
            (flash_attn_kvpacked_func(c(2, 5, 4, 40), c(2, 7, 2, 2, 40), return_attn_probs=True), (2, 4, 5)),
            (flash_attn_varlen_func(c(9, 4, 40), c(9, 2, 40), c(9, 2, 40), cu, cu, 5, 5, return_attn_probs=True),
             (4, 9)),
            (flash_attn_varlen_qkvpacked_func(c(9, 3, 4, 40), cu, 5, return_attn_probs=True), (4, 9)),
            (flash_attn_varlen_kvpacked_func(c(9, 4, 40), c(9, 2, 2, 40), cu, cu, 5, 5, return_attn_probs=True),
             (4, 9)),
        ]:
            out, lse, s = res
            assert lse.shape == lse_shape and lse.dtype == torch.float32 and s.numel() == 0


# ---------------------------------------------------------------------------------------------
# cu_seqlens: metadata errors (every mode)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["2d", "0d", "empty", "len_mismatch", "strided", "stride0", "k_missing",
                                  "q_missing"])
def test_cu_seqlens_malformed(mode, case):
    with env(mode) as e:
        over, names = {
            "2d": ({"cu_seqlens_q": e.cu([[0, 4, 9]])}, "cu_seqlens_q"),
            "0d": ({"cu_seqlens_k": e.cu(0)}, "cu_seqlens_k"),
            "empty": ({"cu_seqlens_q": e.cu([]), "cu_seqlens_k": e.cu([])}, "cu_seqlens_q|cu_seqlens_k"),
            "len_mismatch": ({"cu_seqlens_k": e.cu([0, 5, 8, 11])}, "cu_seqlens_k"),
            "strided": ({"cu_seqlens_q": e.cu([0, 0, 4, 0, 9])[::2]}, "cu_seqlens_q"),
            "stride0": ({"cu_seqlens_q": e.cu([0]).expand(3)}, "cu_seqlens_q"),
            "k_missing": ({"cu_seqlens_k": None}, "cu_seqlens_k"),
            "q_missing": ({"cu_seqlens_q": None}, "cu_seqlens_q"),
        }[case]
        expect(errors.ArgumentError, names, varlen(e, **over))


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_on_cpu_while_q_on_cuda(which):
    with FakeTensorMode():
        e = Env("fake")
        vals = [0, 4, 9] if which == "cu_seqlens_q" else [0, 5, 11]
        expect(errors.DeviceError, which, varlen(e, **{which: e.cu(vals, device="cpu")}), contains=("cpu",))


def test_cu_seqlens_as_list_is_rejected_naming_it():
    with FakeTensorMode():
        e = Env("fake")
        with pytest.raises(RuntimeError, match="cu_seqlens_q"):
            varlen(e, cu_seqlens_q=[0, 4, 9])()
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# cu_seqlens: value errors (real CPU tensors: the check runs before the device check, so a missed
# check shows up as DeviceError for q instead of ArgumentError for cu_seqlens)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,name", [
    (dict(cu_seqlens_q=[0, 6, 4]), "cu_seqlens_q"),
    (dict(cu_seqlens_k=[0, 7, 5]), "cu_seqlens_k"),
    (dict(cu_seqlens_q=[0, 4, 10]), "cu_seqlens_q"),
    (dict(cu_seqlens_k=[0, 5, 2**31 - 1]), "cu_seqlens_k"),
    (dict(cu_seqlens_q=[-1, 4, 9]), "cu_seqlens_q"),
    (dict(cu_seqlens_q=[-(2**31), 4, 9]), "cu_seqlens_q"),
    (dict(max_seqlen_q=4), "max_seqlen_q"),
    (dict(max_seqlen_k=3), "max_seqlen_k"),
], ids=["q_decreasing", "k_decreasing", "q_last_too_large", "k_last_int32_max", "q_negative_first",
        "q_int32_min_first", "max_q_too_small", "max_k_too_small"])
def test_cu_seqlens_bad_values_cpu(over, name):
    e = Env("cpu")
    over = {k: (e.cu(v) if isinstance(v, list) else v) for k, v in over.items()}
    expect(errors.ArgumentError, name, varlen(e, **over))


@pytest.mark.parametrize("over,name", [
    (dict(cu_seqlens_q=[2, 4, 9]), "cu_seqlens_q"),
    (dict(cu_seqlens_k=[1, 5, 11]), "cu_seqlens_k"),
], ids=["q_first_2", "k_first_1"])
def test_cu_seqlens_first_value_nonzero(over, name):
    e = Env("cpu")
    over = {k: e.cu(v) for k, v in over.items()}
    expect(errors.ArgumentError, name, varlen(e, **over))


def test_cu_seqlens_memo_rechecks_writes_through_views():
    """The verified-values memo is keyed on torch's version counter, which views and ``out=``
    share with their base: a write through either makes the next call re-check the values.
    (Writes that bypass the counter, through ``.data``, numpy or DLPack, are not seen: the
    documented limitation of ops.attention.check_cu_seqlens_values; the kernel clamps the values.)"""
    e = Env("cpu")
    cu = e.cu([0, 4, 9])
    call = varlen(e, cu_seqlens_q=cu)
    with pytest.raises(errors.DeviceError):  # values are fine: fails for the device only
        call()
    cu[1:2].fill_(20)  # through a view: decreasing now
    expect(errors.ArgumentError, "cu_seqlens_q", call)
    cu[1:2].fill_(4)
    with pytest.raises(errors.DeviceError):
        call()
    torch.add(cu, torch.tensor([0, 0, 1], dtype=I32), out=cu)  # out=: last value 10 > 9 rows
    expect(errors.ArgumentError, "cu_seqlens_q", call)


def test_cu_seqlens_in_place_torch_write_is_rechecked():
    e = Env("cpu")
    cu = e.cu([0, 4, 9])
    call = varlen(e, cu_seqlens_q=cu)
    with pytest.raises(errors.DeviceError):
        call()
    cu[1] = 20
    expect(errors.ArgumentError, "cu_seqlens_q", call)


# ---------------------------------------------------------------------------------------------
# torch.ops.ferroattn.attn_fwd called directly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("case", ["d7", "rank_varlen", "only_cu_q", "only_cu_k", "k_last_stride", "fp32"])
def test_op_direct_bad_tensors(mode, case):
    op = torch.ops.ferroattn.attn_fwd
    with env(mode) as e:
        q4, k4 = e.t(2, 5, 4, 64), e.t(2, 7, 2, 64)
        q3, k3 = e.t(9, 4, 64), e.t(11, 2, 64)
        cu_q, cu_k = e.cu([0, 4, 9]), e.cu([0, 5, 11])
        exc, name, call = {
            "d7": (errors.ArgumentError, "q", lambda: op(e.t(2, 5, 4, 7), e.t(2, 7, 2, 7), e.t(2, 7, 2, 7), None, None,
                                                          5, 7, 0.1, False)),
            "rank_varlen": (errors.ArgumentError, "q", lambda: op(q4, k4, k4, cu_q, cu_k, 5, 7, 0.1, False)),
            "only_cu_q": (errors.ArgumentError, "cu_seqlens_k", lambda: op(q3, k3, k3, cu_q, None, 5, 6, 0.1, False)),
            "only_cu_k": (errors.ArgumentError, "cu_seqlens_q", lambda: op(q4, k4, k4, None, cu_k, 5, 7, 0.1, False)),
            "k_last_stride": (errors.ArgumentError, "k", lambda: op(q4, e.t(2, 7, 2, 128)[..., ::2], k4, None, None,
                                                                     5, 7, 0.1, False)),
            "fp32": (errors.DTypeError, "q", lambda: op(q4.float(), k4.float(), k4.float(), None, None, 5, 7, 0.1,
                                                         False)),
        }[case]
        expect(exc, name, call)


@pytest.mark.parametrize("mode", META_MODES)
@pytest.mark.parametrize("case", ["left_-2", "right_-3", "softcap_neg", "softcap_nan", "alibi_f16", "alibi_3d",
                                  "alibi_strided", "alibi_cpu", "sinks_f64", "sinks_2d", "sinks_cpu"])
def test_op_direct_bad_variant(mode, case):
    """The variant's validation through ``torch.ops.ferroattn.attn_fwd`` (its fake impl), where
    no flash_attn normalisation runs first: window sides < -1, softcap, the tensors."""
    op = torch.ops.ferroattn.attn_fwd
    with env(mode) as e:
        q4, k4 = e.t(2, 5, 4, 64), e.t(2, 7, 2, 64)
        f32 = lambda *s, device=None: e.t(*s, dtype=torch.float32, device=device)  # noqa: E731
        exc, name, contains, extra = {
            "left_-2": (errors.ArgumentError, "window_size", "(-2, 3)", (-2, 3, 0.0, None, None)),
            "right_-3": (errors.ArgumentError, "window_size", "(1, -3)", (1, -3, 0.0, None, None)),
            "softcap_neg": (errors.ArgumentError, "softcap", "2**-60", (-1, -1, -0.5, None, None)),
            "softcap_nan": (errors.ArgumentError, "softcap", "NaN", (-1, -1, float("nan"), None, None)),
            "alibi_f16": (errors.DTypeError, "alibi_slopes", "float16", (-1, -1, 0.0, e.t(4, dtype=FP16), None)),
            "alibi_3d": (errors.ArgumentError, "alibi_slopes", "(2, 4, 1)", (-1, -1, 0.0, f32(2, 4, 1), None)),
            "alibi_strided": (errors.ArgumentError, "alibi_slopes", "contiguous", (-1, -1, 0.0, f32(8)[::2], None)),
            "alibi_cpu": (errors.DeviceError, "alibi_slopes", "cpu", (-1, -1, 0.0, f32(4, device="cpu"), None)),
            "sinks_f64": (errors.DTypeError, "s_aux", "float64", (-1, -1, 0.0, None, e.t(4, dtype=torch.float64))),
            "sinks_2d": (errors.ArgumentError, "s_aux", "(1, 4)", (-1, -1, 0.0, None, f32(1, 4))),
            "sinks_cpu": (errors.DeviceError, "s_aux", "cpu", (-1, -1, 0.0, None, f32(4, device="cpu"))),
        }[case]
        expect(exc, name, lambda: op(q4, k4, k4, None, None, 5, 7, 0.1, False, False, *extra), contains=(contains,))


@pytest.mark.parametrize("arg,pos,value", [("max_seqlen_q", 5, 5.5), ("softmax_scale", 7, "x"), ("causal", 8, "x"),
                                           ("max_seqlen_k", 6, 2**64), ("window_left", 10, 1.5),
                                           ("window_right", 11, "x"), ("softcap", 12, "x"), ("alibi_slopes", 13, 2),
                                           ("sinks", 14, [0.0])])
def test_op_direct_schema_errors_name_the_argument(arg, pos, value):
    """torch's dispatcher checks the schema types before our code runs: a RuntimeError that names
    the argument (torch's own message)."""
    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 64, dtype=BF16, device="cuda")
        args = [q, q, q, None, None, 5, 5, 0.1, False, False, -1, -1, 0.0, None, None]
        args[pos] = value
        with pytest.raises(RuntimeError, match=arg):
            torch.ops.ferroattn.attn_fwd(*args)
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# autograd: forward with requires_grad and backward run (meta tensors: shapes only)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [32, 7])
@pytest.mark.parametrize("loss_on", ["out", "lse"])
def test_backward_runs(d, loss_on):
    q = torch.empty(2, 5, 4, d, dtype=BF16, device="meta", requires_grad=True)
    k = torch.empty(2, 7, 2, d, dtype=BF16, device="meta", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert out.requires_grad and lse.requires_grad
    loss = (out.float().sum() if loss_on == "out" else lse.sum())
    loss.backward()  # a loss on the LSE alone is fine too (its gradient is ignored, as in flash_attn)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    with torch.no_grad():  # and without grad everything is fine
        assert not flash_attn_func(q, k, k).requires_grad
    valid_call_succeeds()


def test_backward_runs_varlen_and_packed():
    qkv = torch.empty(9, 3, 4, 32, dtype=FP16, device="meta", requires_grad=True)
    cu = torch.zeros(3, dtype=I32, device="meta")
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 5)
    (g,) = torch.autograd.grad(out.float().sum(), qkv)
    assert g.shape == qkv.shape and g.dtype == FP16
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# meta tensors mixed with other devices
# ---------------------------------------------------------------------------------------------
def test_meta_q_with_cpu_k():
    q = torch.empty(2, 5, 6, 32, dtype=BF16, device="meta")
    k = torch.randn(2, 7, 2, 32).to(BF16)
    expect(errors.DeviceError, "k", lambda: flash_attn_func(q, k, k))


def test_cpu_q_with_meta_kv():
    q = torch.randn(2, 5, 6, 32).to(BF16)
    k = torch.empty(2, 7, 2, 32, dtype=BF16, device="meta")
    expect(errors.DeviceError, "q", lambda: flash_attn_func(q, k, k))


@pytest.mark.parametrize("which", ["k", "v"])
def test_fake_kv_on_other_gpu(which):
    with FakeTensorMode():
        e = Env("fake")
        expect(errors.DeviceError, which, padded(e, **{which: e.t(2, 7, 2, 32, device="cuda:1")}), contains=("cuda:1",))


# ---------------------------------------------------------------------------------------------
# _native.attn_fwd called directly: non-DLPack objects, consumed capsules, stream garbage
# ---------------------------------------------------------------------------------------------
def _cpu_native_args(**over):
    q, k = torch.randn(2, 5, 4, 64).to(BF16), torch.randn(2, 7, 2, 64).to(BF16)
    a = dict(q=q, k=k, v=k, out=torch.empty_like(q), softmax_lse=torch.empty(2, 4, 5), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.125, variant=AttnVariant(), stream=0)
    a.update(over)
    return a


@pytest.mark.parametrize("which", ["q", "k", "v", "out", "softmax_lse", "cu_seqlens_q"])
@pytest.mark.parametrize("obj", [object(), [1, 2], None, 3, "tensor"], ids=["object", "list", "None", "int", "str"])
def test_native_non_dlpack_objects(which, obj):
    if obj is None and which == "cu_seqlens_q":
        pytest.skip("None is a legal cu_seqlens")
    with pytest.raises(TypeError, match=rf"^{which}\b"):
        _native.attn_fwd(**_cpu_native_args(**{which: obj}))
    valid_call_succeeds()


@pytest.mark.parametrize("which", ["q", "k", "out"])
def test_native_consumed_capsule(which):
    t = _cpu_native_args()[which]
    cap = t.__dlpack__()
    with pytest.raises(errors.DeviceError):  # first use: imported fine (fails for the CPU device)
        _native.attn_fwd(**_cpu_native_args(**{which: cap}))
    with pytest.raises(ValueError, match=rf"^{which}\b.*consumed"):
        _native.attn_fwd(**_cpu_native_args(**{which: cap}))
    valid_call_succeeds()


def test_native_tensor_requiring_grad():
    """DLPack export of a tensor that requires grad: either imported or a clear error naming it."""
    q = torch.randn(2, 5, 4, 64).to(BF16).requires_grad_()
    with pytest.raises((errors.DeviceError, BufferError)) as info:
        _native.attn_fwd(**_cpu_native_args(q=q))
    assert str(info.value).startswith("q")
    valid_call_succeeds()


@pytest.mark.parametrize("arg,value", [("stream", 1.5), ("stream", None), ("stream", "0"), ("max_seqlen_q", 1.5),
                                       ("softmax_scale", "x")])
def test_native_scalar_type_errors(arg, value):
    """PyO3 conversion errors: a TypeError; the argument is named (PyO3 0.30 puts it in a note)."""
    with pytest.raises(TypeError) as info:
        _native.attn_fwd(**_cpu_native_args(**{arg: value}))
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert arg in text, text
    valid_call_succeeds()


def _variant(**fields):
    import dataclasses
    return dataclasses.replace(AttnVariant(), **fields)


@pytest.mark.parametrize("fields,field", [(dict(causal=None), "causal"), (dict(causal=1), "causal"),
                                          (dict(causal="x"), "causal"), (dict(window_left=1.5), "window_left"),
                                          (dict(window_right=2**70), "window_right"), (dict(softcap="x"), "softcap")])
def test_native_variant_field_type_errors(fields, field):
    """The variant is read by attribute (src/python/variant.rs): a field of the wrong type is a
    TypeError naming the field, noted as the ``variant`` argument's."""
    with pytest.raises(TypeError) as info:
        _native.attn_fwd(**_cpu_native_args(variant=_variant(**fields)))
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert field in text and "variant" in text, text
    valid_call_succeeds()


@pytest.mark.parametrize("value", [None, 1, object(), "causal"], ids=["None", "int", "object", "str"])
def test_native_variant_not_a_variant(value):
    """Not an AttnVariant at all (no ``causal`` attribute): an error naming ``variant`` (an
    AttributeError from PyO3's by-attribute extraction today, a TypeError would be the norm)."""
    with pytest.raises((TypeError, AttributeError)) as info:
        _native.attn_fwd(**_cpu_native_args(variant=value))
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "variant" in text and "causal" in text, text
    valid_call_succeeds()


@pytest.mark.parametrize("which,name", [("alibi_slopes", "alibi_slopes"), ("sinks", "s_aux")])
@pytest.mark.parametrize("obj", [object(), [1.0] * 4, 3], ids=["object", "list", "int"])
def test_native_variant_tensors_not_dlpack(which, name, obj):
    with pytest.raises(TypeError, match=rf"^{name}\b"):
        _native.attn_fwd(**_cpu_native_args(variant=_variant(**{which: obj})))
    valid_call_succeeds()


@pytest.mark.parametrize("value", [-1, -(2**63), 2**64, 2**100])
def test_native_stream_out_of_range(value):
    with pytest.raises((ValueError, TypeError)) as info:
        _native.attn_fwd(**_cpu_native_args(stream=value))
    assert str(info.value).startswith("stream"), str(info.value)
    valid_call_succeeds()


def test_attn_fwd_check_garbage_metadata():
    with pytest.raises(TypeError) as info:
        _native.attn_fwd_check("x", K_META, K_META, None, None, 0, 0)
    assert "q" in str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    valid_call_succeeds()


# ---------------------------------------------------------------------------------------------
# _native.attn_fwd with hand-made DLPack capsules that claim CUDA memory (validation only)
# ---------------------------------------------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = b"dltensor"
_KEEP_ALIVE: list = []  # the ctypes structs must outlive the capsules (no deleter is set)
_DL_CODES = {"float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "int32": (0, 32), "int64": (0, 64)}
_FAKE_PTR = 1 << 24  # 16-byte aligned, never dereferenced (validation fails first / no driver)


def fake_cuda(shape, dtype="bfloat16", strides=None, ptr=_FAKE_PTR, device=(2, 0), lanes=1):
    """A legacy DLPack capsule describing CUDA memory at ``ptr`` that does not exist."""
    n = len(shape)
    if strides is None:
        strides, acc = [0] * n, 1
        for i in range(n - 1, -1, -1):
            strides[i] = acc
            acc *= max(shape[i], 1)
    sh, st = (ctypes.c_int64 * max(n, 1))(*shape), (ctypes.c_int64 * max(n, 1))(*strides)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = _DLDevice(*device)
    mt.dl_tensor.ndim = n
    code, bits = _DL_CODES[dtype]
    mt.dl_tensor.dtype = _DLDataType(code, bits, lanes)
    mt.dl_tensor.shape = ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = None
    _KEEP_ALIVE.append((sh, st, mt))
    return _PyCapsule_New(ctypes.addressof(mt), _CAPSULE_NAME, None)


def _capsule_args(**over):
    a = dict(q=lambda: fake_cuda((2, 5, 4, 64)), k=lambda: fake_cuda((2, 7, 2, 64)),
             v=lambda: fake_cuda((2, 7, 2, 64)), out=lambda: fake_cuda((2, 5, 4, 64)),
             softmax_lse=lambda: fake_cuda((2, 4, 5), "float32"), cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=5, max_seqlen_k=7, softmax_scale=0.125, variant=AttnVariant(), stream=0)
    a.update(over)
    return {k: (v() if callable(v) else v) for k, v in a.items()}


def _varlen_capsule_args(**over):
    a = dict(q=lambda: fake_cuda((9, 4, 64)), k=lambda: fake_cuda((11, 2, 64)), v=lambda: fake_cuda((11, 2, 64)),
             out=lambda: fake_cuda((9, 4, 64)), softmax_lse=lambda: fake_cuda((4, 9), "float32"),
             cu_seqlens_q=lambda: fake_cuda((3,), "int32"), cu_seqlens_k=lambda: fake_cuda((3,), "int32"),
             max_seqlen_q=5, max_seqlen_k=6)
    a.update(over)
    return _capsule_args(**a)


@no_driver
@pytest.mark.parametrize("varlen_mode", [False, True])
def test_capsule_baseline_is_valid(varlen_mode):
    """All capsule arguments valid: validation passes and the call fails only for want of a GPU."""
    args = _varlen_capsule_args() if varlen_mode else _capsule_args()
    with pytest.raises(errors.NoDeviceError):
        _native.attn_fwd(**args)
    with pytest.raises(errors.NoDeviceError):  # any u64 stream is only used at launch
        _native.attn_fwd(**_capsule_args(stream=2**64 - 1))


def test_capsule_empty_problem_launches_nothing():
    """b = 0: nothing to compute, no device needed, even with NULL data pointers."""
    args = _capsule_args(q=lambda: fake_cuda((0, 5, 4, 64), ptr=0), k=lambda: fake_cuda((0, 7, 2, 64), ptr=0),
                         v=lambda: fake_cuda((0, 7, 2, 64), ptr=0), out=lambda: fake_cuda((0, 5, 4, 64), ptr=0),
                         softmax_lse=lambda: fake_cuda((0, 4, 5), "float32", ptr=0))
    assert _native.attn_fwd(**args) is None


CAPSULE_CASES = {
    "out_shape": (errors.ArgumentError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 32)))),
    "out_rank": (errors.ArgumentError, "out", dict(out=lambda: fake_cuda((10, 4, 64)))),
    "out_dtype": (errors.DTypeError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), "float16"))),
    "out_cpu": (errors.DeviceError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), device=(1, 0)))),
    "out_other_gpu": (errors.DeviceError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), device=(2, 1)))),
    "out_last_stride": (errors.ArgumentError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), strides=(2560, 512, 128, 2)))),
    "out_negative_stride": (errors.ArgumentError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), strides=(-1280, 256, 64, 1)))),
    "out_misaligned": (errors.ArgumentError, "out", dict(out=lambda: fake_cuda((2, 5, 4, 64), ptr=_FAKE_PTR + 8))),
    "lse_shape": (errors.ArgumentError, "softmax_lse", dict(softmax_lse=lambda: fake_cuda((2, 5, 4), "float32"))),
    "lse_dtype": (errors.DTypeError, "softmax_lse", dict(softmax_lse=lambda: fake_cuda((2, 4, 5), "bfloat16"))),
    "lse_cpu": (errors.DeviceError, "softmax_lse", dict(softmax_lse=lambda: fake_cuda((2, 4, 5), "float32", device=(1, 0)))),
    "lse_last_stride": (errors.ArgumentError, "softmax_lse",
                        dict(softmax_lse=lambda: fake_cuda((2, 4, 5), "float32", strides=(40, 10, 2)))),
    "q_misaligned_ptr": (errors.ArgumentError, "q", dict(q=lambda: fake_cuda((2, 5, 4, 64), ptr=_FAKE_PTR + 6))),
    "k_row_stride_not_x8": (errors.ArgumentError, "k", dict(k=lambda: fake_cuda((2, 7, 2, 64), strides=(7 * 2 * 68, 2 * 68, 68, 1)))),
    "v_head_stride_not_x8": (errors.ArgumentError, "v", dict(v=lambda: fake_cuda((2, 7, 2, 64), strides=(7 * 132, 132, 66, 1)))),
    "q_lanes2": (errors.DTypeError, "q", dict(q=lambda: fake_cuda((2, 5, 4, 64), lanes=2))),
    "q_cuda_host": (errors.DeviceError, "q", dict(q=lambda: fake_cuda((2, 5, 4, 64), device=(3, 0)),
                                                  k=lambda: fake_cuda((2, 7, 2, 64), device=(3, 0)),
                                                  v=lambda: fake_cuda((2, 7, 2, 64), device=(3, 0)))),
    "k_other_gpu": (errors.DeviceError, "k", dict(k=lambda: fake_cuda((2, 7, 2, 64), device=(2, 1)))),
}


@pytest.mark.parametrize("case", list(CAPSULE_CASES))
def test_capsule_bad_out_lse_layout(case):
    exc, name, over = CAPSULE_CASES[case]
    expect(exc, name, lambda: _native.attn_fwd(**_capsule_args(**over)))


VARLEN_CAPSULE_CASES = {
    "lse_padded_shape": (errors.ArgumentError, "softmax_lse", dict(softmax_lse=lambda: fake_cuda((1, 4, 9), "float32"))),
    "cu_int64": (errors.DTypeError, "cu_seqlens_q", dict(cu_seqlens_q=lambda: fake_cuda((3,), "int64"))),
    "cu_cpu": (errors.DeviceError, "cu_seqlens_k", dict(cu_seqlens_k=lambda: fake_cuda((3,), "int32", device=(1, 0)))),
    "cu_strided": (errors.ArgumentError, "cu_seqlens_q", dict(cu_seqlens_q=lambda: fake_cuda((3,), "int32", strides=(2,)))),
    "cu_2d": (errors.ArgumentError, "cu_seqlens_k", dict(cu_seqlens_k=lambda: fake_cuda((1, 3), "int32"))),
}


@pytest.mark.parametrize("case", list(VARLEN_CAPSULE_CASES))
def test_capsule_bad_varlen_args(case):
    exc, name, over = VARLEN_CAPSULE_CASES[case]
    expect(exc, name, lambda: _native.attn_fwd(**_varlen_capsule_args(**over)))


def _alibi(shape=(4,), dtype="float32", ptr=_FAKE_PTR + (1 << 22), **kw):
    """A factory of fp32 capsules for the variant's tensors (apart from q/k/v's fake memory)."""
    return lambda: fake_cuda(shape, dtype, ptr=ptr, **kw)


#: the variant's own validation in _native.attn_fwd (q (2, 5, 4, 64), k (2, 7, 2, 64)): argument,
#: error class, a string of the message, the variant's fields (tensors as capsule factories)
VARIANT_CAPSULE_CASES = {
    "left_-2": (errors.ArgumentError, "window_size", "(-2, -1)", dict(window_left=-2)),
    "right_-5": (errors.ArgumentError, "window_size", "(3, -5)", dict(window_left=3, window_right=-5)),
    "softcap_neg": (errors.ArgumentError, "softcap", "-1", dict(softcap=-1.0)),
    "softcap_nan": (errors.ArgumentError, "softcap", "NaN", dict(softcap=float("nan"))),
    "softcap_inf": (errors.ArgumentError, "softcap", "inf", dict(softcap=float("inf"))),
    "alibi_f16": (errors.DTypeError, "alibi_slopes", "float16", dict(alibi_slopes=_alibi(dtype="float16"))),
    "alibi_shape": (errors.ArgumentError, "alibi_slopes", "(5,)", dict(alibi_slopes=_alibi((5,)))),
    "alibi_batch": (errors.ArgumentError, "alibi_slopes", "(3, 4)", dict(alibi_slopes=_alibi((3, 4)))),
    "alibi_cpu": (errors.DeviceError, "alibi_slopes", "cpu", dict(alibi_slopes=_alibi(device=(1, 0)))),
    "alibi_other_gpu": (errors.DeviceError, "alibi_slopes", "cuda:1", dict(alibi_slopes=_alibi(device=(2, 1)))),
    "alibi_strided": (errors.ArgumentError, "alibi_slopes", "contiguous",
                      dict(alibi_slopes=_alibi((2, 4), strides=(1, 2)))),
    "alibi_null": (errors.ArgumentError, "alibi_slopes", "NULL", dict(alibi_slopes=_alibi(ptr=0))),
    "sinks_bf16": (errors.DTypeError, "s_aux", "bfloat16", dict(sinks=_alibi(dtype="bfloat16"))),
    "sinks_shape": (errors.ArgumentError, "s_aux", "(3,)", dict(sinks=_alibi((3,)))),
    "sinks_2d": (errors.ArgumentError, "s_aux", "(2, 4)", dict(sinks=_alibi((2, 4)))),
    "sinks_cpu": (errors.DeviceError, "s_aux", "cpu", dict(sinks=_alibi(device=(1, 0)))),
}


def _capsule_variant(fields):
    return _variant(**{n: (f() if callable(f) else f) for n, f in fields.items()})


@pytest.mark.parametrize("case", list(VARIANT_CAPSULE_CASES))
@pytest.mark.parametrize("varlen_mode", [False, True])
def test_capsule_bad_variant(case, varlen_mode):
    exc, name, contains, fields = VARIANT_CAPSULE_CASES[case]
    args = _varlen_capsule_args if varlen_mode else _capsule_args
    if varlen_mode and case == "alibi_batch":  # 2 sequences: (3, 4) is still wrong, (2, 4) right
        contains = "(3, 4)"
    expect(exc, name, lambda: _native.attn_fwd(**args(variant=_capsule_variant(fields))), contains=(contains,))


@no_driver
@pytest.mark.parametrize("fields", [dict(causal=True), dict(window_left=3, window_right=0, causal=True),
                                    dict(window_left=0, window_right=0), dict(softcap=30.0),
                                    dict(alibi_slopes=_alibi()), dict(alibi_slopes=_alibi((2, 4))),
                                    dict(sinks=_alibi()),
                                    dict(window_left=2, window_right=5, softcap=1.0, alibi_slopes=_alibi((2, 4)),
                                         sinks=_alibi(ptr=_FAKE_PTR + (1 << 23)))],
                         ids=["causal", "causal_window", "diagonal", "softcap", "alibi_h", "alibi_bh", "sinks", "all"])
def test_capsule_valid_variants_reach_the_device(fields):
    """Valid variants pass the native validation: only the missing GPU stops the call."""
    with pytest.raises(errors.NoDeviceError):
        _native.attn_fwd(**_capsule_args(variant=_capsule_variant(fields)))


def test_attn_fwd_check_with_a_variant():
    """_native.attn_fwd_check takes the variant with metadata tuples (AttnVariant.for_check) as
    its optional last argument; None is the plain call."""
    meta = lambda *s, dt="float32": _meta(s, tuple(int(np.prod(s[i + 1:])) for i in range(len(s))), dt)  # noqa: E731
    assert _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 5, 7) is None
    assert _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 5, 7, None) is None
    ok = _variant(causal=True, window_left=2, softcap=3.0, alibi_slopes=meta(2, 4), sinks=meta(4))
    assert _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 5, 7, ok) is None
    for fields, exc, name in [(dict(window_left=-3), errors.ArgumentError, "window_size"),
                              (dict(softcap=-2.0), errors.ArgumentError, "softcap"),
                              (dict(alibi_slopes=meta(4, dt="bfloat16")), errors.DTypeError, "alibi_slopes"),
                              (dict(alibi_slopes=meta(8)), errors.ArgumentError, "alibi_slopes"),
                              (dict(sinks=meta(2, 2)), errors.ArgumentError, "s_aux"),
                              (dict(sinks=meta(4, dt="int32")), errors.DTypeError, "s_aux")]:
        expect(exc, name, lambda: _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 5, 7, _variant(**fields)))
    with pytest.raises(TypeError):  # a tensor where a metadata tuple is expected
        _native.attn_fwd_check(Q_META, K_META, K_META, None, None, 5, 7, _variant(sinks=torch.zeros(4)))


@no_driver
@pytest.mark.parametrize("case", ["batch_stride0", "row_stride0", "rows_overlap"])
def test_capsule_overlapping_out(case):
    strides = {"batch_stride0": (0, 256, 64, 1), "row_stride0": (1280, 0, 64, 1),
               "rows_overlap": (1280, 8, 64, 1)}[case]
    expect(errors.ArgumentError, "out", lambda: _native.attn_fwd(**_capsule_args(out=lambda: fake_cuda((2, 5, 4, 64), strides=strides))))


@no_driver
@pytest.mark.parametrize("which", ["q", "k", "out", "softmax_lse"])
def test_capsule_null_data_pointer(which):
    shapes = {"q": ((2, 5, 4, 64), "bfloat16"), "k": ((2, 7, 2, 64), "bfloat16"), "out": ((2, 5, 4, 64), "bfloat16"),
              "softmax_lse": ((2, 4, 5), "float32")}
    shape, dt = shapes[which]
    over = {which: lambda: fake_cuda(shape, dt, ptr=0)}
    if which == "k":
        over["v"] = lambda: fake_cuda(shape, dt, ptr=0)
    names = "k|v" if which == "k" else which
    expect(errors.ArgumentError, names, lambda: _native.attn_fwd(**_capsule_args(**over)))


# ---------------------------------------------------------------------------------------------
# transformers integration (integrations/transformers.py), real CPU tensors
# ---------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    is_causal = True


def _hf_call(mask=None, b=2, s=6, **kwargs):
    from ferroattn.integrations.transformers import ferroattn_attention_forward

    q, k = torch.randn(b, 4, s, 32).to(BF16), torch.randn(b, 2, s, 32).to(BF16)
    return lambda: ferroattn_attention_forward(_Layer(), q, k, k, mask, **kwargs)


@pytest.mark.parametrize("shape", [(2, 1, 6, 6), (6,), (2, 6, 1)])
def test_hf_mask_wrong_rank(shape):
    expect(errors.ArgumentError, "attention_mask", _hf_call(torch.ones(shape, dtype=torch.bool)))


def test_hf_valid_mask_reaches_the_device_check():
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    expect(errors.DeviceError, "q", _hf_call(mask))


@pytest.mark.parametrize("shape", [(2, 8), (3, 6)], ids=["longer_than_kv", "batch_3_for_2"])
def test_hf_mask_shape_mismatch(shape):
    expect(errors.ArgumentError, "attention_mask", _hf_call(torch.ones(shape, dtype=torch.bool)))


def test_hf_zero_sized_query_rejected_naming_it():
    expect(errors.ArgumentError, "query", _hf_call(b=0))


def test_hf_packed_position_ids_first_run_not_at_min():
    from ferroattn.integrations.transformers import _cu_seqlens_from_position_ids

    cu, longest = _cu_seqlens_from_position_ids(torch.tensor([[5, 6, 7, 0, 1, 2]]))
    assert cu.tolist() == [0, 3, 6] and longest == 3


# ---------------------------------------------------------------------------------------------
# DLPack >= 1.0 read-only flag: `out` / `softmax_lse` must be writable
# ---------------------------------------------------------------------------------------------
class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_VERSIONED_NAME = b"dltensor_versioned"
_DLPACK_FLAG_READ_ONLY = 1


def fake_cuda_versioned(shape, dtype="bfloat16", flags=0, ptr=_FAKE_PTR):
    """A DLPack 1.0 versioned capsule describing (non-existent) contiguous CUDA memory."""
    n = len(shape)
    strides, acc = [0] * n, 1
    for i in range(n - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    sh, st = (ctypes.c_int64 * n)(*shape), (ctypes.c_int64 * n)(*strides)
    mt = _DLManagedTensorVersioned()
    mt.version = _DLPackVersion(1, 0)
    mt.manager_ctx = None
    mt.deleter = None
    mt.flags = flags
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = _DLDevice(2, 0)
    mt.dl_tensor.ndim = n
    code, bits = _DL_CODES[dtype]
    mt.dl_tensor.dtype = _DLDataType(code, bits, 1)
    mt.dl_tensor.shape = ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.byte_offset = 0
    _KEEP_ALIVE.append((sh, st, mt))
    return _PyCapsule_New(ctypes.addressof(mt), _VERSIONED_NAME, None)


def test_versioned_capsule_is_imported():
    info = _native.dlpack_info(fake_cuda_versioned((2, 5, 4, 64)))
    assert info["versioned"] and info["shape"] == (2, 5, 4, 64) and info["device"] == (2, 0)


@no_driver
@pytest.mark.parametrize("which", ["out", "softmax_lse"])
def test_read_only_output_rejected(which):
    shape, dt = ((2, 5, 4, 64), "bfloat16") if which == "out" else ((2, 4, 5), "float32")
    over = {which: lambda: fake_cuda_versioned(shape, dt, flags=_DLPACK_FLAG_READ_ONLY)}
    expect(errors.ArgumentError, which, lambda: _native.attn_fwd(**_capsule_args(**over)))
