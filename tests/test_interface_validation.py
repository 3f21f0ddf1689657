"""Argument validation of the flash_attn functions (flash_attn_interface.py), CPU only (meta tensors):

- torch.compile(fullgraph=True) with a float ``softmax_scale`` that dynamo makes symbolic (its
  second distinct value) has no graph break;
- the op's validation runs on the caller's tensors before the head-dim padding / last-dim copy:
  no copy of a bad input, and messages show the caller's shapes;
- packed ``qkv`` / ``kv`` must have the packed dim of size exactly 3 / 2 and the right rank;
- scalar arguments of the wrong type (tensors whose value cannot be read, strings, bools for
  floats) raise ArgumentError naming the argument, expected and actual value;
- torch.func.grad / vjp raise an error naming ferroattn.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferroattn import errors
from ferroattn import flash_attn_interface as fai
from ferroattn.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                            flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                            flash_attn_varlen_qkvpacked_func)

FP16 = torch.float16


def T(*shape, dtype=FP16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _cu(batch):
    return torch.zeros(batch + 1, dtype=torch.int32, device="meta")


# ---------------------------------------------------------------------------------------------
# finding 1: symbolic softmax_scale under torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------
class _Scaled(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, softmax_scale=self.scale)


def test_compile_fullgraph_second_softmax_scale_no_graph_break():
    torch._dynamo.reset()
    q = T(2, 16, 4, 64)
    try:
        for scale in (0.1, 0.2, 0.3):  # from 0.2 on dynamo makes the float attribute symbolic
            out = torch.compile(_Scaled(scale), backend="eager", fullgraph=True)(q, q, q)
            assert out.shape == q.shape and out.dtype == FP16
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e300])
def test_eager_non_finite_softmax_scale_still_rejected(scale):
    q = T(2, 16, 4, 64)
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_func(q, q, q, softmax_scale=scale)
    msg = str(info.value)
    assert msg.startswith("softmax_scale: expected a real number finite in float32") and repr(scale) in msg


# ---------------------------------------------------------------------------------------------
# findings 2+3: validation on the caller's tensors, before any copy
# ---------------------------------------------------------------------------------------------
def test_padded_head_dim_error_shows_user_shapes():
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_func(T(2, 16, 4, 100), T(2, 16, 4, 100), T(3, 16, 4, 100))
    assert str(info.value) == "v: expected shape (2, 16, 4, 100) (k's shape), got shape (3, 16, 4, 100)"


def _spy_copies(monkeypatch):
    calls = []

    def pad(x, p):
        calls.append(("pad", tuple(x.shape)))
        return F.pad(x, p)

    def maybe_contiguous(x):
        calls.append(("contiguous", tuple(x.shape)))
        return x.contiguous() if x.stride(-1) != 1 else x

    monkeypatch.setattr(fai, "F", types.SimpleNamespace(pad=pad))
    monkeypatch.setattr(fai, "_maybe_contiguous", maybe_contiguous)
    return calls


@pytest.mark.parametrize("case", ["batch", "gqa", "dtype"])
def test_padded_call_validated_before_pad(monkeypatch, case):
    calls = _spy_copies(monkeypatch)
    q = T(2, 16, 6, 100)
    k = {"batch": T(3, 16, 2, 100), "gqa": T(2, 16, 4, 100), "dtype": T(2, 16, 2, 100, dtype=torch.float32)}[case]
    v = T(*k.shape, dtype=k.dtype)
    cls = errors.DTypeError if case == "dtype" else errors.ArgumentError
    with pytest.raises(cls) as info:
        flash_attn_func(q, k, v)
    msg = str(info.value)
    assert msg.startswith("k:"), msg
    expected = {"batch": ("batch size 2", "batch size 3"), "gqa": ("divides q's 6", "4 heads"),
                "dtype": ("float16", "float32")}[case]
    assert all(e in msg for e in expected), msg
    assert "104" not in msg
    assert calls == [], "a copy was made before the validation"


def test_non_contiguous_last_dim_validated_before_copy(monkeypatch):
    calls = _spy_copies(monkeypatch)
    q = T(2, 16, 4, 64).transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    assert q.stride(-1) != 1
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_func(q, T(2, 16, 3, 64), T(2, 16, 3, 64))
    assert str(info.value).startswith("k: expected a number of heads >= 1 that divides q's 4, got 3 heads")
    assert calls == []


def test_valid_padded_call_still_pads_and_slices(monkeypatch):
    calls = _spy_copies(monkeypatch)
    q = T(2, 16, 6, 100)
    out = flash_attn_func(q, T(2, 9, 2, 100), T(2, 9, 2, 100))
    assert out.shape == (2, 16, 6, 100)
    assert [c[0] for c in calls] == ["pad"] * 3


def test_varlen_padded_error_shows_user_shapes():
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_varlen_func(T(9, 4, 36), T(7, 4, 36), T(8, 4, 36), _cu(2), _cu(2), 5, 5)
    assert str(info.value) == "v: expected shape (7, 4, 36) (k's shape), got shape (8, 4, 36)"


# ---------------------------------------------------------------------------------------------
# finding 4: packed forms
# ---------------------------------------------------------------------------------------------
_PACKED_BAD = [
    ("qkvpacked", "qkv", lambda x: flash_attn_qkvpacked_func(x), (2, 16, 4, 4, 64), 3),
    ("qkvpacked", "qkv", lambda x: flash_attn_qkvpacked_func(x), (2, 16, 2, 4, 64), 3),
    ("qkvpacked", "qkv", lambda x: flash_attn_qkvpacked_func(x), (2, 16, 3, 64), 3),
    ("kvpacked", "kv", lambda x: flash_attn_kvpacked_func(T(2, 16, 4, 64), x), (2, 16, 3, 4, 64), 2),
    ("kvpacked", "kv", lambda x: flash_attn_kvpacked_func(T(2, 16, 4, 64), x), (2, 16, 1, 4, 64), 2),
    ("kvpacked", "kv", lambda x: flash_attn_kvpacked_func(T(2, 16, 4, 64), x), (2, 16, 2, 64), 2),
    ("varlen_qkvpacked", "qkv", lambda x: flash_attn_varlen_qkvpacked_func(x, _cu(2), 8), (16, 4, 4, 64), 3),
    ("varlen_qkvpacked", "qkv", lambda x: flash_attn_varlen_qkvpacked_func(x, _cu(2), 8), (16, 3, 64), 3),
    ("varlen_kvpacked", "kv",
     lambda x: flash_attn_varlen_kvpacked_func(T(16, 4, 64), x, _cu(2), _cu(2), 8, 8), (16, 3, 4, 64), 2),
    ("varlen_kvpacked", "kv",
     lambda x: flash_attn_varlen_kvpacked_func(T(16, 4, 64), x, _cu(2), _cu(2), 8, 8), (16, 1, 4, 64), 2),
]


@pytest.mark.parametrize("form,name,call,shape,n", _PACKED_BAD,
                         ids=[f"{f}-{'x'.join(map(str, s))}" for f, _, _, s, _ in _PACKED_BAD])
def test_packed_dim_and_rank_checked(form, name, call, shape, n):
    with pytest.raises(errors.ArgumentError) as info:
        call(T(*shape))
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected shape "), msg
    assert f"of size {n}" in msg and f"got shape {shape}" in msg, msg


def test_packed_not_a_tensor():
    with pytest.raises(errors.DTypeError, match=r"^qkv: expected a torch.Tensor, got list"):
        flash_attn_qkvpacked_func([1, 2])
    with pytest.raises(errors.DTypeError, match=r"^kv: expected a torch.Tensor, got NoneType"):
        flash_attn_kvpacked_func(T(2, 16, 4, 64), None)


def test_valid_packed_forms_still_work():
    assert flash_attn_qkvpacked_func(T(2, 16, 3, 4, 64)).shape == (2, 16, 4, 64)
    assert flash_attn_kvpacked_func(T(2, 16, 4, 64), T(2, 9, 2, 2, 64)).shape == (2, 16, 4, 64)
    assert flash_attn_varlen_qkvpacked_func(T(16, 3, 4, 64), _cu(2), 8).shape == (16, 4, 64)
    assert flash_attn_varlen_kvpacked_func(T(16, 4, 64), T(9, 2, 2, 64), _cu(2), _cu(2), 8, 8).shape == (16, 4, 64)


# ---------------------------------------------------------------------------------------------
# findings 7+8+9: scalar arguments
# ---------------------------------------------------------------------------------------------
def _meta_scalar(value, dtype):
    return torch.tensor(value, dtype=dtype).to("meta")


_SCALARS_BAD = [
    ("softmax_scale", lambda: _meta_scalar(0.1, torch.float32), "a real number"),
    ("softmax_scale", lambda: True, "a real number"),
    ("softmax_scale", lambda: "0.1", "a real number"),
    ("dropout_p", lambda: _meta_scalar(0.0, torch.float32), "a real number"),
    ("dropout_p", lambda: True, "a real number"),
    ("softcap", lambda: "x", "a real number"),
    ("softcap", lambda: True, "a real number"),
    ("softcap", lambda: _meta_scalar(0.0, torch.float32), "a real number"),
    ("softcap", lambda: [0.0], "a real number"),
    ("causal", lambda: _meta_scalar(True, torch.bool), "a bool"),
    ("deterministic", lambda: _meta_scalar(False, torch.bool), "a bool"),
    ("deterministic", lambda: torch.tensor([1, 0]), "a bool"),
    ("return_attn_probs", lambda: _meta_scalar(True, torch.bool), "a bool"),
    ("return_attn_probs", lambda: torch.tensor([True, False]), "a bool"),
]


@pytest.mark.parametrize("name,make,expected", _SCALARS_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_SCALARS_BAD)])
def test_scalar_wrong_type_is_argument_error(name, make, expected):
    value = make()
    q = T(2, 16, 4, 64)
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_func(q, q, q, **{name: value})
    assert not isinstance(info.value, NotImplementedError)
    assert str(info.value) == f"{name}: expected {expected}, got {value!r}"


def test_valid_nonzero_softcap_accepted():
    q = T(2, 16, 4, 64)
    for value in (30.0, 0.5, 1e-6, np.float32(50.0), 0, 0.0, None):
        assert flash_attn_func(q, q, q, softcap=value).shape == q.shape


@pytest.mark.parametrize("value", [-1.0, -1e-30, float("inf"), float("-inf"), float("nan"), np.float64(-2.0)],
                         ids=["-1", "-tiny", "inf", "-inf", "nan", "np-2"])
def test_softcap_negative_or_not_finite_is_argument_error(value):
    q = T(2, 16, 4, 64)
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_func(q, q, q, softcap=value)
    assert not isinstance(info.value, NotImplementedError)
    assert str(info.value) == (f"softcap: expected 0 (no softcapping) or a number in [2**-60, 2**60] (the kernels "
                               f"divide by it in float32), got {value!r}")
    assert flash_attn_func(q, q, q, softcap=1.0).shape == q.shape  # the next valid call works


@pytest.mark.parametrize("name", ["alibi_slopes", "s_aux"])
@pytest.mark.parametrize("value", [[0.5] * 4, 0.5, "slopes", np.ones(4, np.float32)], ids=["list", "float", "str", "numpy"])
def test_variant_tensor_argument_not_a_tensor(name, value):
    q = T(2, 16, 4, 64)
    with pytest.raises(errors.DTypeError) as info:
        flash_attn_func(q, q, q, **{name: value})
    assert str(info.value) == f"{name}: expected a torch.Tensor or None, got {type(value).__name__}"


_VARIANT_TENSORS_BAD = [
    # (argument, tensor, error class, message); q: (2, 16, 4, 64) meta (described as cuda:0)
    ("alibi_slopes", lambda: T(4, dtype=FP16), errors.DTypeError, "alibi_slopes: expected dtype float32, got float16"),
    ("alibi_slopes", lambda: T(4, dtype=torch.float64), errors.DTypeError,
     "alibi_slopes: expected dtype float32, got float64"),
    ("alibi_slopes", lambda: T(3, dtype=torch.float32), errors.ArgumentError,
     "alibi_slopes: expected shape (4,) or (2, 4) (heads or batch x heads), got shape (3,)"),
    ("alibi_slopes", lambda: T(3, 4, dtype=torch.float32), errors.ArgumentError,
     "alibi_slopes: expected shape (4,) or (2, 4) (heads or batch x heads), got shape (3, 4)"),
    ("alibi_slopes", lambda: T(2, 4, 1, dtype=torch.float32), errors.ArgumentError,
     "alibi_slopes: expected shape (4,) or (2, 4) (heads or batch x heads), got shape (2, 4, 1)"),
    ("alibi_slopes", lambda: T(4, 2, dtype=torch.float32).t(), errors.ArgumentError,
     "alibi_slopes: expected a contiguous last dim (stride 1), got strides [1, 2] for shape (2, 4)"),
    ("alibi_slopes", lambda: torch.zeros(4), errors.DeviceError,
     "alibi_slopes: expected a tensor on cuda:0 (q's device), got cpu"),
    # s_aux (the op's ``sinks``) is named as the flash_attn functions name it
    ("s_aux", lambda: T(3, dtype=torch.float32), errors.ArgumentError,
     "s_aux: expected shape (4,) (one logit per query head), got shape (3,)"),
    ("s_aux", lambda: T(2, 4, dtype=torch.float32), errors.ArgumentError,
     "s_aux: expected shape (4,) (one logit per query head), got shape (2, 4)"),
    ("s_aux", lambda: T(4, dtype=torch.int32), errors.DTypeError, "s_aux: expected dtype float32, got int32"),
    ("s_aux", lambda: T(4, dtype=torch.bool), errors.DTypeError, "s_aux: expected dtype float32, got bool"),
    ("s_aux", lambda: torch.zeros(4), errors.DeviceError, "s_aux: expected a tensor on cuda:0 (q's device), got cpu"),
]


@pytest.mark.parametrize("name,make,exc,message", _VARIANT_TENSORS_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _, _) in enumerate(_VARIANT_TENSORS_BAD)])
def test_variant_tensor_dtype_shape_device_checked(name, make, exc, message):
    q = T(2, 16, 4, 64)
    with pytest.raises(exc) as info:
        flash_attn_func(q, q, q, **{name: make()})
    assert str(info.value) == message
    # the same tensors are checked before the head-dim padding (d = 100 -> 104) and in varlen
    with pytest.raises(exc) as info:
        flash_attn_func(T(2, 16, 4, 100), T(2, 16, 4, 100), T(2, 16, 4, 100), **{name: make()})
    assert str(info.value) == message


def test_valid_variant_tensors_accepted():
    q = T(2, 16, 4, 64)
    f32 = torch.float32
    assert flash_attn_func(q, q, q, alibi_slopes=T(4, dtype=f32)).shape == q.shape
    assert flash_attn_func(q, q, q, alibi_slopes=T(2, 4, dtype=f32)).shape == q.shape
    for dt in (f32, FP16, torch.bfloat16, torch.float64):  # s_aux of any float dtype: cast to fp32
        assert flash_attn_func(q, q, q, s_aux=T(4, dtype=dt)).shape == q.shape
    out = flash_attn_varlen_func(T(16, 4, 64), T(16, 4, 64), T(16, 4, 64), _cu(2), _cu(2), 8, 8, causal=True,
                                 window_size=(3, 0), softcap=10.0, alibi_slopes=T(2, 4, dtype=f32),
                                 s_aux=T(4, dtype=f32))
    assert out.shape == (16, 4, 64)
    # a varlen (b, h) alibi must have b = the number of sequences
    with pytest.raises(errors.ArgumentError, match=r"^alibi_slopes: expected shape \(4,\) or \(2, 4\)"):
        flash_attn_varlen_func(T(16, 4, 64), T(16, 4, 64), T(16, 4, 64), _cu(2), _cu(2), 8, 8,
                               alibi_slopes=T(3, 4, dtype=f32))


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("make", [lambda: torch.tensor(3), lambda: _meta_scalar(3, torch.int64), lambda: True],
                         ids=["cpu_tensor", "meta_tensor", "bool"])
def test_max_seqlen_not_an_int(which, make):
    value = make()
    args = dict(max_seqlen_q=8, max_seqlen_k=8)
    args[which] = value
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_varlen_func(T(16, 4, 64), T(16, 4, 64), T(16, 4, 64), _cu(2), _cu(2), **args)
    assert str(info.value) == f"{which}: expected an int, got {value!r}"


@pytest.mark.parametrize("which,value", [("max_seqlen_q", -5), ("max_seqlen_k", -1), ("max_seqlen_q", -1)])
def test_negative_max_seqlen_rejected_also_for_empty_batch(which, value):
    args = dict(max_seqlen_q=0, max_seqlen_k=0)
    args[which] = value
    with pytest.raises(errors.ArgumentError) as info:
        flash_attn_varlen_func(T(0, 4, 64), T(0, 4, 64), T(0, 4, 64), _cu(0), _cu(0), **args)
    assert str(info.value) == f"{which}: expected an int in [0, {2**31 - 1}], got {value}"


def test_scalar_forms_flash_attn_accepts_still_work():
    import numpy as np
    q = T(2, 16, 4, 64)
    assert flash_attn_func(q, q, q, 0, 1, 1, deterministic=np.bool_(True)).shape == q.shape
    assert flash_attn_func(q, q, q, softmax_scale=np.float32(0.1), dropout_p=np.float64(0.0)).shape == q.shape
    assert flash_attn_varlen_func(T(0, 4, 64), T(0, 4, 64), T(0, 4, 64), _cu(0), _cu(0), 0, np.int64(0)).shape \
        == (0, 4, 64)


# ---------------------------------------------------------------------------------------------
# finding 6: torch.func reverse-mode transforms
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_torch_func_reverse_transforms_name_ferroattn(transform):
    q = T(2, 5, 4, 32)
    with pytest.raises(errors.FerroattnError) as info:
        if transform == "grad":
            torch.func.grad(lambda a: flash_attn_func(a, q, q).float().sum())(q)
        else:
            torch.func.vjp(lambda a: flash_attn_func(q, a, q), q)
    msg = str(info.value)
    name = "q" if transform == "grad" else "k"
    assert msg.startswith(f"{name}: ferroattn's flash_attn functions do not support torch.func.grad"), msg
    assert "setup_context" in msg and ".backward()" in msg


# ---- rejected inputs, second set ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"softmax_scale": np.complex64(0.1 + 5j)}, "softmax_scale"),
    ({"softmax_scale": np.complex128(0.1)}, "softmax_scale"),
    ({"softcap": float("nan")}, "softcap"),
    ({"window_size": (torch.tensor(-1, device="meta"), -1)}, "window_size"),
])
def test_second_pass_scalar_arguments(kwargs, name):
    q, k, v = (T(2, 16, 4, 64) for _ in range(3))
    with pytest.raises(errors.ArgumentError, match=name):
        flash_attn_func(q, k, v, **kwargs)
    out = flash_attn_func(q, k, v)            # the next valid call still works
    assert out.shape == (2, 16, 4, 64)
