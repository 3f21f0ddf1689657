"""Bad inputs give the right ferroattn.errors class with a message that starts with the argument's
name, with CPU tensors (the real op: Rust validation of the imported tensors), fake CUDA tensors and
meta tensors (the fake impl: Rust validation of metadata); after every rejected call a valid call
succeeds.

Value checks of cu_seqlens (decreasing, last value > rows, sequence longer than max_seqlen) need
the data, so they run on real tensors only (CPU here; CUDA in test_gpu.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ferroattn
from ferroattn import errors
from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

from _bad_inputs import Env, env, padded, varlen

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass
class Case:
    id: str
    build: Callable[[Env], Callable[[], object]]
    exc: type
    names: str  # regex: the message must start with one of these argument names
    modes: tuple = ("cpu", "fake", "meta")


CASES = [
    Case("fp32", lambda e: padded(e, q=e.t(2, 5, 6, 32, dtype=torch.float32), k=e.t(2, 7, 2, 32, dtype=torch.float32),
                                  v=e.t(2, 7, 2, 32, dtype=torch.float32)), errors.DTypeError, "q"),
    Case("mixed_dtypes", lambda e: padded(e, k=e.t(2, 7, 2, 32, dtype=FP16)), errors.DTypeError, "k"),
    Case("mixed_dtypes_v", lambda e: padded(e, v=e.t(2, 7, 2, 32, dtype=FP16)), errors.DTypeError, "v"),
    Case("rank3_padded", lambda e: padded(e, q=e.t(5, 6, 32)), errors.ArgumentError, "q"),
    Case("rank5_padded_k", lambda e: padded(e, k=e.t(2, 7, 2, 1, 32)), errors.ArgumentError, "k"),
    Case("rank4_varlen", lambda e: varlen(e, q=e.t(1, 9, 6, 32)), errors.ArgumentError, "q"),
    Case("head_dims_differ_k", lambda e: padded(e, k=e.t(2, 7, 2, 64)), errors.ArgumentError, "k"),
    Case("head_dims_differ_v", lambda e: padded(e, v=e.t(2, 7, 2, 64)), errors.ArgumentError, "v"),
    Case("head_dim_over_256", lambda e: padded(e, q=e.t(2, 5, 6, 264), k=e.t(2, 7, 2, 264), v=e.t(2, 7, 2, 264)),
         errors.ArgumentError, "q|head_dim"),
    Case("heads_not_divisible", lambda e: padded(e, k=e.t(2, 7, 4, 32), v=e.t(2, 7, 4, 32)), errors.ArgumentError, "k|q"),
    Case("cu_seqlens_int64", lambda e: varlen(e, cu_seqlens_q=e.cu([0, 4, 9], dtype=torch.int64)),
         errors.DTypeError, "cu_seqlens_q"),
    Case("cu_seqlens_k_int64", lambda e: varlen(e, cu_seqlens_k=e.cu([0, 5, 11], dtype=torch.int64)),
         errors.DTypeError, "cu_seqlens_k"),
    Case("cu_seqlens_not_contiguous", lambda e: varlen(e, cu_seqlens_q=e.cu([0, 0, 4, 0, 9])[::2]),
         errors.ArgumentError, "cu_seqlens_q"),
    Case("cu_seqlens_wrong_length", lambda e: varlen(e, cu_seqlens_k=e.cu([0, 5, 8, 11])),
         errors.ArgumentError, "cu_seqlens_k|cu_seqlens_q"),
    Case("cu_seqlens_empty", lambda e: varlen(e, cu_seqlens_q=e.cu([]), cu_seqlens_k=e.cu([])),
         errors.ArgumentError, "cu_seqlens_q|cu_seqlens_k"),
    Case("max_seqlen_q_zero", lambda e: varlen(e, max_seqlen_q=0), errors.ArgumentError, "max_seqlen_q"),
    Case("max_seqlen_k_zero", lambda e: varlen(e, max_seqlen_k=0), errors.ArgumentError, "max_seqlen_k"),
    # value checks: real tensors only
    Case("cu_seqlens_decreasing", lambda e: varlen(e, cu_seqlens_q=e.cu([0, 6, 4])), errors.ArgumentError,
         "cu_seqlens_q", modes=("cpu",)),
    Case("cu_seqlens_k_decreasing", lambda e: varlen(e, cu_seqlens_k=e.cu([0, 7, 5])), errors.ArgumentError,
         "cu_seqlens_k", modes=("cpu",)),
    Case("cu_seqlens_last_exceeds_rows", lambda e: varlen(e, cu_seqlens_q=e.cu([0, 4, 10])), errors.ArgumentError,
         "cu_seqlens_q", modes=("cpu",)),
    Case("cu_seqlens_k_last_exceeds_rows", lambda e: varlen(e, cu_seqlens_k=e.cu([0, 5, 12])), errors.ArgumentError,
         "cu_seqlens_k", modes=("cpu",)),
    Case("cu_seqlens_negative_start", lambda e: varlen(e, cu_seqlens_q=e.cu([-1, 4, 9])), errors.ArgumentError,
         "cu_seqlens_q", modes=("cpu",)),
    Case("max_seqlen_too_small", lambda e: varlen(e, max_seqlen_k=3), errors.ArgumentError, "max_seqlen_k",
         modes=("cpu",)),
    # devices
    Case("cpu_tensors", lambda e: padded(e, q=e.t(2, 5, 6, 32, device="cpu"), k=e.t(2, 7, 2, 32, device="cpu"),
                                         v=e.t(2, 7, 2, 32, device="cpu")), errors.DeviceError, "q",
         modes=("cpu", "fake")),
    Case("cpu_varlen", lambda e: varlen(e, q=e.t(9, 6, 32, device="cpu"), k=e.t(11, 2, 32, device="cpu"),
                                        v=e.t(11, 2, 32, device="cpu"), cu_seqlens_q=e.cu([0, 4, 9], device="cpu"),
                                        cu_seqlens_k=e.cu([0, 5, 11], device="cpu")), errors.DeviceError, "q",
         modes=("cpu", "fake")),
    Case("k_on_other_gpu", lambda e: padded(e, k=e.t(2, 7, 2, 32, device="cuda:1")), errors.DeviceError, "k",
         modes=("fake",)),
    Case("v_on_cpu", lambda e: padded(e, v=e.t(2, 7, 2, 32, device="cpu")), errors.DeviceError, "v",
         modes=("fake",)),
    Case("cu_seqlens_on_cpu", lambda e: varlen(e, cu_seqlens_q=e.cu([0, 4, 9], device="cpu")), errors.DeviceError,
         "cu_seqlens_q", modes=("fake",)),
    # attention variants: checked in Python (every mode) or by the Rust validation (fake/meta;
    # with real CPU tensors q's device is rejected first)
    Case("softcap_negative", lambda e: padded(e, softcap=-3.0), errors.ArgumentError, "softcap"),
    Case("softcap_nan_varlen", lambda e: varlen(e, softcap=float("nan")), errors.ArgumentError, "softcap"),
    Case("alibi_not_a_tensor", lambda e: padded(e, alibi_slopes=[1.0] * 6), errors.DTypeError, "alibi_slopes"),
    Case("s_aux_not_a_tensor", lambda e: varlen(e, s_aux=1.0), errors.DTypeError, "s_aux"),
    Case("alibi_fp16", lambda e: padded(e, alibi_slopes=e.t(6, dtype=FP16)), errors.DTypeError, "alibi_slopes",
         modes=("fake", "meta")),
    Case("alibi_wrong_heads", lambda e: padded(e, alibi_slopes=e.t(2, dtype=torch.float32)), errors.ArgumentError,
         "alibi_slopes", modes=("fake", "meta")),
    Case("alibi_wrong_batch_varlen", lambda e: varlen(e, alibi_slopes=e.t(3, 6, dtype=torch.float32)),
         errors.ArgumentError, "alibi_slopes", modes=("fake", "meta")),
    Case("alibi_on_cpu", lambda e: padded(e, alibi_slopes=e.t(6, dtype=torch.float32, device="cpu")),
         errors.DeviceError, "alibi_slopes", modes=("fake", "meta")),
    Case("s_aux_wrong_heads", lambda e: padded(e, s_aux=e.t(2, dtype=torch.float32)), errors.ArgumentError,
         "s_aux|sinks", modes=("fake", "meta")),
    Case("s_aux_int", lambda e: varlen(e, s_aux=e.t(6, dtype=torch.int32)), errors.DTypeError, "s_aux|sinks",
         modes=("fake", "meta")),
    Case("s_aux_on_cpu", lambda e: padded(e, s_aux=e.t(6, dtype=torch.float32, device="cpu")), errors.DeviceError,
         "s_aux|sinks", modes=("fake", "meta")),
]

PARAMS = [pytest.param(c, m, id=f"{c.id}-{m}") for c in CASES for m in c.modes]


def _valid_fake_call():
    with FakeTensorMode():
        q = torch.empty(2, 5, 6, 32, dtype=BF16, device="cuda")
        k = torch.empty(2, 7, 2, 32, dtype=BF16, device="cuda")
        out = flash_attn_func(q, k, k, causal=True)
        assert out.shape == (2, 5, 6, 32) and out.dtype == BF16 and out.device.type == "cuda"
        qv = torch.empty(9, 6, 32, dtype=BF16, device="cuda")
        cu = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
        out = flash_attn_varlen_func(qv, qv[:, :2], qv[:, :2], cu, cu, 5, 5)
        assert out.shape == (9, 6, 32)


@pytest.mark.parametrize("case,mode", PARAMS)
def test_bad_input(case: Case, mode: str):
    with env(mode) as e:
        call = case.build(e)
        with pytest.raises(case.exc) as info:
            call()
    msg = str(info.value)
    assert re.match(rf"({case.names})\b", msg), f"message does not start with {case.names!r}: {msg!r}"
    assert isinstance(info.value, RuntimeError)  # flash_attn code catching RuntimeError keeps working
    _valid_fake_call()  # the next valid call succeeds


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_valid_variant_calls(mode):
    """Every variant argument valid, padded and varlen: the calls trace (output shape, dtype)."""
    with env(mode) as e:
        f32 = torch.float32
        kw = dict(window_size=(3, 1), softcap=20.0, alibi_slopes=e.t(2, 6, dtype=f32), s_aux=e.t(6, dtype=f32))
        out = padded(e, **kw)()
        assert out.shape == (2, 5, 6, 32) and out.dtype == BF16
        out = varlen(e, **kw)()
        assert out.shape == (9, 6, 32) and out.dtype == BF16
        assert padded(e, causal=False, window_size=(0, 0), alibi_slopes=e.t(6, dtype=f32))().shape == (2, 5, 6, 32)


def test_valid_variant_cpu_call_is_rejected_only_for_the_device():
    """A valid variant call on CPU tensors reaches the op's validation and fails for q's device."""
    q, k = torch.randn(2, 5, 6, 32, dtype=BF16), torch.randn(2, 7, 2, 32, dtype=BF16)
    with pytest.raises(errors.DeviceError, match=r"^q\b"):
        ferroattn.flash_attn_func(q, k, k, window_size=(2, 2), softcap=5.0, alibi_slopes=torch.rand(6),
                                  s_aux=torch.randn(6))


def test_valid_cpu_call_is_rejected_only_for_the_device():
    """A valid call on CPU tensors reaches the Rust validation and fails with DeviceError (not a
    dispatcher error, not a shape error)."""
    q, k = torch.randn(2, 5, 6, 32, dtype=BF16), torch.randn(2, 7, 2, 32, dtype=BF16)
    with pytest.raises(errors.DeviceError, match=r"^q\b"):
        ferroattn.flash_attn_func(q, k, k)
    with pytest.raises(errors.DeviceError, match=r"^q\b"):
        torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 7, 0.1, False)


def test_value_checks_skipped_for_fake_and_meta():
    """Decreasing cu_seqlens cannot be detected without data: fake/meta calls trace fine."""
    from ferroattn.ops.attention import values_available

    with FakeTensorMode():
        cu = torch.tensor([0, 6, 4], dtype=torch.int32, device="cuda")
        assert not values_available(cu)
        q = torch.empty(9, 6, 32, dtype=BF16, device="cuda")
        out = flash_attn_varlen_func(q, q, q, cu, cu, 6, 6)
        assert out.shape == q.shape
    meta = torch.tensor([0, 6, 4], dtype=torch.int32).to("meta")
    assert not values_available(meta)
    assert values_available(torch.tensor([0, 6, 4], dtype=torch.int32))
