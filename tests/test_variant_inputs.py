"""Variant arguments at the edges: softcaps float32 cannot hold, strided ALiBi slopes, window_size
forms flash_attn would not index, the dtype words of the variant's metadata checks, and the
S_dmask op validating before it allocates. CPU only (FakeTensorMode / meta tensors)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ferroattn.ops.attention  # noqa: F401  (registers the ops)
from ferroattn import _native, errors, flash_attn_func
from ferroattn.ops._to_native import tensor_meta
from ferroattn.ops.variant import AttnVariant

BF16 = torch.bfloat16


def _q():
    return torch.empty(2, 16, 4, 64, dtype=BF16, device="cuda")


@pytest.mark.parametrize("softcap", [1e300, 1e39, 2.0**61, 1e-50, 2.0**-61])
def test_softcaps_float32_cannot_hold_are_rejected(softcap):
    with FakeTensorMode():
        q = _q()
        with pytest.raises(errors.ArgumentError, match=r"^softcap: expected 0 \(no softcapping\) or a number in"):
            flash_attn_func(q, q, q, softcap=softcap)
        # the op's own validation says the same (a direct caller of the op)
        with pytest.raises(errors.ArgumentError, match=r"^softcap: expected 0 \(no softcapping\) or a number in"):
            torch.ops.ferroattn.attn_fwd(q, q, q, None, None, 16, 16, 0.125, False, False, -1, -1, softcap, None,
                                         None)
        # the range's ends are accepted
        for ok in (2.0**-60, 2.0**60, 50.0):
            assert flash_attn_func(q, q, q, softcap=ok).shape == q.shape


def test_strided_and_expanded_alibi_slopes_are_accepted():
    """flash_attn takes (b, h) slopes with any batch stride (contiguous last dim)."""
    with FakeTensorMode():
        q = _q()
        for slopes in (torch.empty(2, 8, device="cuda")[:, :4], torch.empty(4, device="cuda").expand(2, 4)):
            assert flash_attn_func(q, q, q, alibi_slopes=slopes).shape == q.shape
        with pytest.raises(errors.ArgumentError, match=r"^alibi_slopes: expected a contiguous last dim"):
            flash_attn_func(q, q, q, alibi_slopes=torch.empty(4, 2, device="cuda").t())


@pytest.mark.parametrize("window", [{1: 0, 2: 0}, iter([1, 2]), (True, False), (1, 2, 3), (1,), "ab",
                                    (np.bool_(True), 1)], ids=["dict", "iter", "bools", "3", "1", "str", "np-bool"])
def test_window_size_must_be_a_pair_of_ints(window):
    with FakeTensorMode():
        q = _q()
        with pytest.raises(errors.ArgumentError, match=r"^window_size: expected a pair of ints"):
            flash_attn_func(q, q, q, window_size=window)


def test_window_size_accepts_integer_tensors_and_arrays_of_two():
    """flash_attn's own tests pass ``torch.randint(0, s, (2,))`` as window_size."""
    from ferroattn.flash_attn_interface import _check_window
    assert _check_window(torch.tensor([684, 559])) == (684, 559)
    assert _check_window(torch.tensor([3, -1], dtype=torch.int32)) == (3, -1)
    assert _check_window(np.array([5, 0])) == (5, 0)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([True, False]), torch.tensor([1, 2, 3]),
                torch.tensor([[1, 2]]), np.array([1.5, 2.0]), torch.empty(2, dtype=torch.int64, device="meta")):
        with pytest.raises(errors.ArgumentError, match=r"^window_size: expected a pair of ints"):
            _check_window(bad)


def test_window_size_accepts_lists_and_numpy_ints():
    with FakeTensorMode():
        q = _q()
        for window in ([3, 0], (np.int64(3), np.int32(0))):
            assert flash_attn_func(q, q, q, window_size=window).shape == q.shape


@pytest.mark.parametrize("field,dtype,word", [("rng_state", "uint64", "int64"), ("s_dmask", "float8_e4m3fn",
                                                                                   "float16 or bfloat16"),
                                              ("alibi_slopes", "uint64", "float32")])
def test_variant_metadata_dtype_errors_name_the_expected_dtype(field, dtype, word):
    q = tensor_meta(torch.empty(2, 5, 4, 64, dtype=BF16, device="meta"))
    meta = ((2,), (1,), dtype, (2, 0))
    fields = dict(dropout_p=0.2, rng_state=tensor_meta(torch.empty(2, dtype=torch.int64, device="meta")))
    if field == "s_dmask":
        meta = ((2, 4, 128, 128), (65536, 16384, 128, 1), dtype, (2, 0))
        fields["s_dmask_max"] = tensor_meta(torch.empty(2, 4, 128, 8, device="meta"))
    fields[field] = meta
    variant = AttnVariant(**fields)
    with pytest.raises(errors.DTypeError, match=rf"^{field}: expected dtype {word}"):
        _native.attn_fwd_check(q, q, q, None, None, 5, 5, variant)


@pytest.mark.parametrize("mode", ["fake", "cpu"])
def test_dmask_op_validates_before_it_allocates(mode):
    """An empty cu_seqlens is the same ArgumentError as attn_fwd's, not a negative-size allocation."""
    def call(q, cu, key):
        return torch.ops.ferroattn.attn_fwd_dmask(q, q, q, cu, cu, 16, 16, 0.125, False, -1, -1, 0.0, None, None,
                                                  0.1, key)
    if mode == "fake":
        with FakeTensorMode():
            q = torch.empty(32, 4, 64, dtype=BF16, device="cuda")
            with pytest.raises(errors.ArgumentError, match=r"^cu_seqlens_q: expected length batch \+ 1 >= 1"):
                call(q, torch.zeros(0, dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda"))
    else:
        q = torch.zeros(32, 4, 64, dtype=BF16)
        with pytest.raises(errors.ArgumentError, match=r"^cu_seqlens_q: expected length batch \+ 1 >= 1"):
            call(q, torch.zeros(0, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("window", [(1.5, 2), (True, 1), "ab", (1, float("nan"))])
def test_bad_window_size_under_torch_compile_raises_argument_error(window):
    """torch.compile (Dynamo) reaches the ArgumentError, not an internal error from tracing
    ``operator.index`` of a float."""
    from ferroattn.flash_attn_interface import _check_window

    def f(x, w):
        left, _ = _check_window(w)
        return x + left

    torch._dynamo.reset()
    with pytest.raises(errors.ArgumentError, match=r"^window_size: expected a pair of ints"):
        torch.compile(f, backend="eager")(torch.zeros(2), window)


@pytest.mark.parametrize("window", [[torch.tensor(True), torch.tensor(False)], ([1], 2), (object(), 1), (None, 1)])
def test_window_size_rejects_bool_tensors_and_non_integers(window):
    from ferroattn.flash_attn_interface import _check_window
    with pytest.raises(errors.ArgumentError, match=r"^window_size: expected a pair of ints"):
        _check_window(window)


@pytest.mark.parametrize("flag", [[True], (1,), object(), "1"])
def test_bad_causal_under_torch_compile_raises_argument_error(flag):
    from ferroattn.flash_attn_interface import _check_flag

    def f(x, c):
        return x + int(_check_flag(c, "causal"))

    torch._dynamo.reset()
    with pytest.raises(errors.ArgumentError, match=r"^causal: expected a bool"):
        torch.compile(f, backend="eager")(torch.zeros(2), flag)


@pytest.mark.parametrize("value", [[0.1], None, object()])
def test_bad_real_argument_under_torch_compile_raises_argument_error(value):
    from ferroattn.flash_attn_interface import _as_float

    def f(x, p):
        return x + _as_float(p, "dropout_p")

    torch._dynamo.reset()
    with pytest.raises(errors.ArgumentError, match=r"^dropout_p: expected a real number"):
        torch.compile(f, backend="eager")(torch.zeros(2), value)
