"""flash_attn 2.x parity of the public functions: signatures, argument normalisation (what reaches
the custom op), unsupported arguments."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ferroattn
from ferroattn import flash_attn_interface as fai
from ferroattn.ops.variant import AttnVariant

BF16 = torch.bfloat16

# flash_attn 2.8 signatures (reference/api-contracts.md §1.3): (name, default) in positional order
_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
         ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_REQ = inspect.Parameter.empty
FA_SIGNATURES = {
    "flash_attn_func": [("q", _REQ), ("k", _REQ), ("v", _REQ)] + _TAIL,
    "flash_attn_qkvpacked_func": [("qkv", _REQ)] + _TAIL,
    "flash_attn_kvpacked_func": [("q", _REQ), ("kv", _REQ)] + _TAIL,
    "flash_attn_varlen_func": [("q", _REQ), ("k", _REQ), ("v", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                               ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQ), ("cu_seqlens", _REQ), ("max_seqlen", _REQ)] + _TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", _REQ), ("kv", _REQ), ("cu_seqlens_q", _REQ), ("cu_seqlens_k", _REQ),
                                        ("max_seqlen_q", _REQ), ("max_seqlen_k", _REQ)] + _TAIL,
    "flash_attn_with_kvcache": [
        ("q", _REQ), ("k_cache", _REQ), ("v_cache", _REQ), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("name", sorted(FA_SIGNATURES))
def test_signature_parity(name):
    params = list(inspect.signature(getattr(ferroattn, name)).parameters.values())
    positional = [p for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == FA_SIGNATURES[name]
    # beyond flash_attn 2: the attention sinks, keyword-only after flash_attn's parameters
    extra = [(p.name, p.default, p.kind) for p in params[len(positional):]]
    want = [] if name == "flash_attn_with_kvcache" else [("s_aux", None, inspect.Parameter.KEYWORD_ONLY)]
    assert extra == want


def test_transformers_introspection_sees_the_named_parameters():
    # transformers passes these only when they are named parameters of flash_attn_varlen_func
    names = inspect.signature(ferroattn.flash_attn_varlen_func).parameters
    for p in ("dropout_p", "window_size", "deterministic", "softcap", "max_seqlen_q", "max_seqlen_k", "s_aux"):
        assert p in names


# ---- what reaches the op -------------------------------------------------------------------
@pytest.fixture
def captured(monkeypatch):
    """Replace the op's entry point (``run_attn_fwd``) by a recorder that returns correctly shaped
    outputs; ``causal`` is the variant's, ``variant`` the whole AttnVariant."""
    calls = []

    def fake_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, variant, deterministic=False):
        assert isinstance(variant, AttnVariant)
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=scale,
                          causal=variant.causal, variant=variant, deterministic=deterministic))
        lse = torch.zeros((q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0]))
        return torch.full_like(q, 7.0), lse

    monkeypatch.setattr(fai, "_attn_fwd_op", fake_op)
    return calls


def _t(*shape):
    return torch.randn(*shape, dtype=BF16)


def test_default_scale_uses_unpadded_head_dim(captured):
    q, k = _t(1, 3, 2, 36), _t(1, 4, 2, 36)
    out = fai.flash_attn_func(q, k, k)
    c = captured[0]
    assert c["scale"] == pytest.approx(36 ** -0.5)
    assert c["q"].shape[-1] == 40 and c["k"].shape[-1] == 40 and c["v"].shape[-1] == 40
    assert torch.equal(c["q"][..., :36], q) and torch.all(c["q"][..., 36:] == 0)
    assert out.shape == q.shape  # sliced back
    fai.flash_attn_func(q, k, k, 0.0, 0.5)  # positional softmax_scale
    assert captured[1]["scale"] == 0.5


def test_head_dim_mismatch_rejected_before_padding(captured):
    # k's head dim differs: rejected with the user's (unpadded) values; nothing reaches the op
    with pytest.raises(ferroattn.errors.ArgumentError, match=r"^k: expected head dim 36 .*got head dim 40$"):
        fai.flash_attn_func(_t(1, 3, 2, 36), _t(1, 4, 2, 40), _t(1, 4, 2, 36))
    assert captured == []


def test_views_are_passed_untouched(captured):
    qkv = _t(2, 5, 3, 4, 32)
    fai.flash_attn_qkvpacked_func(qkv)
    c = captured[0]
    for i, name in enumerate("qkv"):
        assert c[name].data_ptr() == qkv[:, :, i].data_ptr() and c[name].stride() == qkv[:, :, i].stride()
    qt = _t(2, 4, 5, 32).transpose(1, 2)  # (b, s, h, d) view with stride(-1) == 1
    fai.flash_attn_func(qt, qt, qt)
    assert captured[1]["q"] is qt


def test_last_dim_not_contiguous_is_copied(captured):
    base = _t(2, 5, 4, 64)
    q = base[..., ::2]  # stride(-1) == 2
    fai.flash_attn_func(q, q, q)
    c = captured[0]
    assert c["q"].stride(-1) == 1 and torch.equal(c["q"], q)


@pytest.mark.parametrize("sq,causal,expected", [(1, True, False), (2, True, True), (1, False, False)])
def test_causal_off_for_single_query(captured, sq, causal, expected):
    fai.flash_attn_func(_t(2, sq, 4, 32), _t(2, 6, 4, 32), _t(2, 6, 4, 32), causal=causal)
    assert captured[0]["causal"] is expected


def test_varlen_causal_off_when_max_seqlen_q_is_one(captured):
    q, k = _t(3, 4, 32), _t(9, 4, 32)
    cu_q, cu_k = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 1, 3, causal=True)
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 2, 3, causal=True)
    assert captured[0]["causal"] is False and captured[1]["causal"] is True
    assert captured[0]["cu_q"] is cu_q and captured[0]["max_k"] == 3


# flash_attn 2.8's normalisation for s_q = 4, s_k = 6: (window, causal) -> (causal, left, right)
@pytest.mark.parametrize("window,causal,expected", [
    ((-1, -1), False, (False, -1, -1)),
    ((6, 6), False, (False, -1, -1)),       # both sides >= seqlen_k (6) -> -1
    ((10, -1), True, (True, -1, -1)),
    ((-1, 0), False, (True, -1, -1)),       # (left < 0, right == 0) is causal in flash_attn
    ((-1, 3), True, (True, -1, -1)),        # causal forces right = 0
    ((-5, -2), False, (False, -1, -1)),     # any negative side is unbounded
    ((2, 2), False, (False, 2, 2)),         # a real local window reaches the op as it is
    ((2, -1), False, (False, 2, 6)),        # one side set: the other becomes seqlen_k (flash_attn)
    ((-1, 2), False, (False, 6, 2)),
    ((0, 0), False, (False, 0, 0)),         # the diagonal only
    ((5, 5), False, (False, 5, 5)),         # 5 < seqlen_k: kept
    ((6, 2), False, (False, 6, 2)),         # the side >= seqlen_k is -1, then seqlen_k again
    ((2, 6), False, (False, 2, 6)),
    ((3, 0), True, (True, 3, 0)),           # causal + left window: right 0, causal kept
    ((3, 5), True, (True, 3, 0)),
    ((-7, 0), False, (True, -1, -1)),
])
def test_window_normalisation(captured, window, causal, expected):
    fai.flash_attn_func(_t(1, 4, 2, 32), _t(1, 6, 2, 32), _t(1, 6, 2, 32), causal=causal, window_size=window)
    v = captured[0]["variant"]
    assert (v.causal, v.window_left, v.window_right) == expected
    assert type(v.window_left) is int and type(v.window_right) is int and type(v.causal) is bool


def test_varlen_window_normalised_with_max_seqlen_k(captured):
    # flash_attn normalises a varlen window with max_seqlen_k, not with each sequence's length
    q, k = _t(7, 2, 32), _t(9, 2, 32)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 5, window_size=(4, 5))   # 5 >= 5 -> -1 -> max_seqlen_k
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 8, window_size=(4, 5))   # both < 8: kept
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 1, 5, causal=True, window_size=(2, 2))  # max_q 1: no causal
    got = [(c["variant"].causal, c["variant"].window_left, c["variant"].window_right) for c in captured]
    assert got == [(False, 4, 5), (False, 4, 5), (False, 2, 2)]
    fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 8, window_size=(-1, 3))  # the unset side: max_seqlen_k
    v = captured[3]["variant"]
    assert (v.causal, v.window_left, v.window_right) == (False, 8, 3)


def test_causal_kept_for_single_query_with_alibi(captured):
    # flash_attn drops causal for s_q == 1 only without ALiBi (with ALiBi the bias depends on it)
    slopes = torch.rand(2)
    fai.flash_attn_func(_t(1, 1, 2, 32), _t(1, 6, 2, 32), _t(1, 6, 2, 32), causal=True, alibi_slopes=slopes)
    fai.flash_attn_func(_t(1, 1, 2, 32), _t(1, 6, 2, 32), _t(1, 6, 2, 32), causal=True)
    assert captured[0]["causal"] is True and captured[0]["variant"].alibi_slopes is slopes
    assert captured[1]["causal"] is False


@pytest.mark.parametrize("value,expected", [(30.0, 30.0), (5, 5.0), (np.float32(2.5), 2.5), (0, 0.0), (None, 0.0),
                                            (1e-3, 1e-3)])
def test_softcap_reaches_the_op_as_a_float(captured, value, expected):
    q = _t(1, 4, 2, 32)
    fai.flash_attn_func(q, q, q, softcap=value)
    v = captured[0]["variant"]
    assert type(v.softcap) is float and v.softcap == expected


def test_alibi_and_sinks_reach_the_op(captured):
    q = _t(2, 4, 3, 32)
    slopes, slopes_b = torch.rand(3), torch.rand(2, 3)
    sinks = torch.randn(3)
    fai.flash_attn_func(q, q, q, alibi_slopes=slopes, s_aux=sinks)
    v = captured[0]["variant"]
    assert v.alibi_slopes is slopes and v.sinks is sinks   # fp32: passed untouched (no copy)
    fai.flash_attn_func(q, q, q, alibi_slopes=slopes_b)
    assert captured[1]["variant"].alibi_slopes is slopes_b and captured[1]["variant"].sinks is None
    # sinks of another float dtype are cast to fp32 (the kernels read fp32), values kept
    sinks_bf16 = torch.randn(3).to(BF16)
    fai.flash_attn_func(q, q, q, s_aux=sinks_bf16)
    got = captured[2]["variant"].sinks
    assert got.dtype == torch.float32 and torch.equal(got, sinks_bf16.float())
    # without any option the variant is the plain one
    fai.flash_attn_func(q, q, q)
    assert captured[3]["variant"] == AttnVariant() and captured[3]["variant"].is_plain


def test_sinks_cast_keeps_the_gradient(captured):
    # the fp32 cast of a bf16 s_aux is differentiable: the gradient reaches the caller's tensor
    q = _t(1, 4, 2, 32)
    sinks = torch.randn(2).to(BF16).requires_grad_(True)
    fai.flash_attn_func(q, q, q, s_aux=sinks)
    got = captured[0]["variant"].sinks
    assert got.requires_grad and got.grad_fn is not None
    (g,) = torch.autograd.grad(got.sum(), sinks)
    assert g.dtype == BF16 and torch.equal(g, torch.ones(2, dtype=BF16))


_EVERY_FORM = ["padded", "qkvpacked", "kvpacked", "varlen", "varlen_qkvpacked", "varlen_kvpacked"]


def _call_form(form, **kwargs):
    """One valid call of each public function (h = 4, d = 32; s_q = s_k = 6 / max lengths 4)."""
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    if form == "padded":
        return fai.flash_attn_func(_t(1, 6, 4, 32), _t(1, 6, 4, 32), _t(1, 6, 4, 32), **kwargs)
    if form == "qkvpacked":
        return fai.flash_attn_qkvpacked_func(_t(1, 6, 3, 4, 32), **kwargs)
    if form == "kvpacked":
        return fai.flash_attn_kvpacked_func(_t(1, 6, 4, 32), _t(1, 6, 2, 4, 32), **kwargs)
    if form == "varlen":
        return fai.flash_attn_varlen_func(_t(8, 4, 32), _t(8, 4, 32), _t(8, 4, 32), cu, cu, 4, 4, **kwargs)
    if form == "varlen_qkvpacked":
        return fai.flash_attn_varlen_qkvpacked_func(_t(8, 3, 4, 32), cu, 4, **kwargs)
    return fai.flash_attn_varlen_kvpacked_func(_t(8, 4, 32), _t(8, 2, 4, 32), cu, cu, 4, 4, **kwargs)


@pytest.mark.parametrize("form", _EVERY_FORM)
def test_every_variant_reaches_the_op_from_every_form(captured, form):
    slopes, sinks = torch.rand(4), torch.randn(4)
    out = _call_form(form, window_size=(2, 1), softcap=12.5, alibi_slopes=slopes, s_aux=sinks)
    assert out.shape[-2:] == (4, 32)
    v = captured[0]["variant"]
    assert (v.causal, v.window_left, v.window_right, v.softcap) == (False, 2, 1, 12.5)
    assert v.alibi_slopes is slopes and v.sinks is sinks
    _call_form(form, causal=True, window_size=(3, 3))
    v = captured[1]["variant"]
    assert (v.causal, v.window_left, v.window_right, v.softcap, v.alibi_slopes, v.sinks) == (True, 3, 0, 0.0, None, None)


def test_variant_positional_arguments(captured):
    # flash_attn's positional order: dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes
    q = _t(2, 4, 3, 32)
    slopes = torch.rand(3)
    fai.flash_attn_func(q, q, q, 0.0, 0.5, False, (1, 2), 3.0, slopes)
    c = captured[0]
    assert c["scale"] == 0.5
    assert (c["variant"].window_left, c["variant"].window_right, c["variant"].softcap) == (1, 2, 3.0)
    assert c["variant"].alibi_slopes is slopes
    with pytest.raises(TypeError):  # s_aux is keyword-only: no 12th positional argument
        fai.flash_attn_func(q, q, q, 0.0, None, False, (-1, -1), 0.0, None, False, False, torch.zeros(3))


def test_return_attn_probs_triple(captured):
    q = _t(2, 3, 4, 32)
    res = fai.flash_attn_func(q, q, q, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, s_dmask = res
    assert out.shape == q.shape and lse.shape == (2, 4, 3)
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
    assert isinstance(fai.flash_attn_func(q, q, q), torch.Tensor)


def test_deterministic_passed_to_the_op(captured):
    q = _t(2, 3, 4, 32)
    fai.flash_attn_func(q, q, q, deterministic=True)
    fai.flash_attn_func(q, q, q)
    fai.flash_attn_func(q, q, q, 0.0, None, False, (-1, -1), 0.0, None, 1)  # positional, int 1
    assert [c["deterministic"] for c in captured] == [True, False, True]
    qkv, kv = _t(2, 3, 3, 4, 32), _t(2, 3, 2, 4, 32)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    fai.flash_attn_qkvpacked_func(qkv, deterministic=True)
    fai.flash_attn_kvpacked_func(q, kv, deterministic=True)
    fai.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 2, 2, deterministic=True)
    fai.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 2, deterministic=True)
    fai.flash_attn_varlen_kvpacked_func(q[0], kv[0], cu, cu, 2, 2, deterministic=True)
    assert [c["deterministic"] for c in captured[3:]] == [True] * 5
    for c in captured:
        assert type(c["deterministic"]) is bool


@pytest.mark.parametrize("value", ["True", 2, 0.5, [1]])
def test_deterministic_must_be_a_bool(captured, value):
    q = _t(2, 3, 4, 32)
    with pytest.raises(ferroattn.errors.ArgumentError, match=r"^deterministic: expected a bool"):
        fai.flash_attn_func(q, q, q, deterministic=value)
    assert captured == []


@pytest.mark.parametrize("form", _EVERY_FORM)
def test_dropout_reaches_the_op_from_every_form(captured, form):
    # dropout is implemented: never NotImplementedError, never dropped. It combines with the other
    # variants (softcap too, which flash_attn rejects with dropout) and reaches the op as the
    # variant's dropout_p (a float) with a freshly drawn int64 (2,) Philox key on q's device.
    out = _call_form(form, dropout_p=0.1, window_size=(2, 2), softcap=5.0)
    assert out.shape[-2:] == (4, 32)
    v = captured[0]["variant"]
    assert type(v.dropout_p) is float and v.dropout_p == pytest.approx(0.1)
    assert (v.window_left, v.window_right, v.softcap) == (2, 2, 5.0)
    r = v.rng_state
    assert isinstance(r, torch.Tensor) and r.dtype == torch.int64 and r.shape == (2,) and r.is_contiguous()
    assert r.device == captured[0]["q"].device
    _call_form(form, dropout_p=0.0)
    assert captured[1]["variant"].dropout_p == 0.0 and captured[1]["variant"].rng_state is None
    assert captured[1]["variant"].is_plain


# ---- unsupported arguments -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(softcap=-1.0), ferroattn.errors.ArgumentError, r"^softcap: expected 0 \(no softcapping\) or a number in \[2\*\*-60, 2\*\*60\]"),
    (dict(softcap=float("inf")), ferroattn.errors.ArgumentError, r"^softcap: expected 0 \(no softcapping\) or a number in \[2\*\*-60, 2\*\*60\]"),
    (dict(softcap=float("nan")), ferroattn.errors.ArgumentError, r"^softcap: expected 0 \(no softcapping\) or a number in \[2\*\*-60, 2\*\*60\]"),
    (dict(alibi_slopes=[1.0, 2.0]), ferroattn.errors.DTypeError, r"^alibi_slopes: expected a torch.Tensor or None"),
    (dict(s_aux=(0.0,) * 4), ferroattn.errors.DTypeError, r"^s_aux: expected a torch.Tensor or None"),
    (dict(s_aux=np.zeros(4, np.float32)), ferroattn.errors.DTypeError, r"^s_aux: expected a torch.Tensor or None"),
])
@pytest.mark.parametrize("form", ["padded", "varlen", "qkvpacked"])
def test_bad_variant_arguments_rejected_before_the_op(captured, kwargs, exc, needle, form):
    with pytest.raises(exc, match=needle):
        _call_form(form, **kwargs)
    assert captured == []


def test_block_table_is_forward_only(captured, monkeypatch):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    pages = _t(2, 4, 4, 32)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    seen = []

    def fake_kvcache(q, *args):
        seen.append((q.requires_grad, torch.is_grad_enabled()))
        return torch.full_like(q, 3.0), torch.zeros(q.shape[1], q.shape[0])

    # a grad-requiring q runs the forward (flash_attn accepts it); the backward raises
    monkeypatch.setattr(fai._kvcache, "run_attn_fwd_kvcache", fake_kvcache)
    q = _t(4, 4, 32).requires_grad_()
    out, lse, _ = fai.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, block_table=bt, return_attn_probs=True)
    assert seen == [(True, False)] and out.requires_grad and not lse.requires_grad
    assert torch.all(out == 3.0)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()
    assert q.grad is None
    with torch.no_grad():
        fai.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, block_table=bt)
    assert seen[-1] == (True, False)
    with pytest.raises(NotImplementedError, match="block_table"):
        fai.flash_attn_varlen_func(_t(4, 4, 32), pages, pages, cu, cu, 4, 4, dropout_p=0.1, block_table=bt)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^k: expected rank 4"):
        fai.flash_attn_varlen_func(_t(4, 4, 32), _t(4, 4, 32), _t(4, 4, 32), cu, cu, 4, 4, block_table=bt)
    assert captured == []


def test_kvcache_on_cpu_tensors_names_the_device():
    q = _t(1, 1, 4, 32)
    with pytest.raises(ferroattn.errors.DeviceError, match="q"):
        ferroattn.flash_attn_with_kvcache(q, _t(1, 8, 4, 32), _t(1, 8, 4, 32))


def test_kvcache_split_planner_rejects_negative_sizes():
    from ferroattn import _native
    sizes = dict(batch=1, seqlen_q=1, heads=4, heads_k=4, key_len=8, head_dim=32)
    for name in sizes:
        args = {**sizes, name: -1}
        with pytest.raises(ferroattn.errors.ArgumentError, match=f"^{name}: expected a size >= 0, got -1"):
            _native.attn_kvcache_num_splits(0, *args.values(), False, 0)
    # an empty problem needs no device: one split
    assert _native.attn_kvcache_num_splits(0, *{**sizes, "batch": 0}.values(), False, 0) == 1


def test_kvcache_arguments_checked_before_the_op():
    q, kc = _t(1, 1, 4, 32), _t(1, 8, 4, 32)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^num_splits"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, num_splits=129)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^num_splits"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, num_splits=True)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^cache_seqlens"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, _t(1, 1, 4, 32), _t(1, 1, 4, 32), cache_seqlens=8)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^v"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, _t(1, 1, 4, 32))
    with pytest.raises(ferroattn.errors.ArgumentError, match="^rotary_cos"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, rotary_cos=_t(8, 8), rotary_sin=_t(8, 8))
    with pytest.raises(ferroattn.errors.DTypeError, match="^cache_seqlens"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=2.5)
    with pytest.raises(AssertionError):
        ferroattn.flash_attn_with_kvcache(q, kc.transpose(-1, -2), kc)
    # head dims: the user's sizes (not the padded ones) in the message
    q60, kc64 = _t(1, 1, 4, 60), _t(1, 8, 4, 64)
    with pytest.raises(ferroattn.errors.ArgumentError, match=r"^k_cache: expected head dim 60 .*got head dim 64$"):
        ferroattn.flash_attn_with_kvcache(q60, kc64, kc64)


def test_unsupported_raise_on_fake_tensors_too():
    with FakeTensorMode():
        q = torch.empty(1, 4, 4, 32, dtype=BF16, device="cuda")
        cu = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
        pages = torch.empty(3, 16, 4, 32, dtype=BF16, device="cuda")
        bt = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
        out = fai.flash_attn_varlen_func(q[0], pages, pages, cu, cu, 4, 4, block_table=bt)
        assert out.shape == q[0].shape
        # the kv-cache call traces through the fake impls of its two ops
        kc = torch.empty(1, 64, 2, 32, dtype=BF16, device="cuda")
        k1 = torch.empty(1, 4, 2, 32, dtype=BF16, device="cuda")
        cos = torch.empty(64, 8, dtype=BF16, device="cuda")
        out, lse = fai.flash_attn_with_kvcache(q, kc, kc, k1, k1, cos, cos, cache_seqlens=3, causal=True,
                                               return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (1, 4, 4)
        # the implemented variants, dropout included, trace through the fake impl
        slopes = torch.empty(4, dtype=torch.float32, device="cuda")
        out = fai.flash_attn_func(q, q, q, softcap=5.0, window_size=(1, 1), alibi_slopes=slopes, s_aux=slopes)
        assert out.shape == q.shape and out.dtype == BF16
        out = fai.flash_attn_func(q, q, q, dropout_p=0.5, softcap=5.0)
        assert out.shape == q.shape and out.dtype == BF16


@pytest.mark.parametrize("make, needle", [
    (lambda T, i32: dict(k=T(2, 2, 64), v=T(2, 2, 64)), "^k: expected shape"),
    (lambda T, i32: dict(k=T(2, 1, 3, 64), v=T(2, 1, 3, 64)), "^k: expected"),
    (lambda T, i32: dict(k=T(3, 1, 2, 64), v=T(3, 1, 2, 64)), "^k: expected shape"),
    (lambda T, i32: dict(k=T(2, 1, 2, 64), v=T(2, 1, 2, 64), rotary_cos=T(64, 12), rotary_sin=T(64, 12)), "^rotary_cos"),
    (lambda T, i32: dict(k=T(2, 1, 2, 64), v=T(2, 1, 2, 64), rotary_cos=T(10, 16), rotary_sin=T(10, 16)), "^rotary_cos"),
    (lambda T, i32: dict(k=T(2, 1, 2, 64), v=T(2, 1, 2, 64), rotary_cos=T(64, 40), rotary_sin=T(64, 40)), "^rotary_cos"),
])
def test_kvcache_append_is_validated_on_fake_tensors(make, needle):
    with FakeTensorMode():
        def T(*s, dt=BF16):
            return torch.empty(*s, dtype=dt, device="cuda")
        q, kc, sl = T(2, 1, 8, 64), T(2, 64, 2, 64), T(2, dt=torch.int32)
        with pytest.raises(ferroattn.errors.FerroattnError, match=needle):
            ferroattn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=sl, **make(T, torch.int32))
        # an empty page pool for a non-empty batch, and out-of-range scalars on the op itself
        with pytest.raises(ferroattn.errors.ArgumentError, match="^k_cache"):
            ferroattn.flash_attn_with_kvcache(q, T(0, 16, 2, 64), T(0, 16, 2, 64), block_table=T(2, 1, dt=torch.int32))
        with pytest.raises(ferroattn.errors.ArgumentError, match="^num_splits"):
            torch.ops.ferroattn.attn_fwd_kvcache(q, kc, kc, None, None, 0, sl, 0, None, None, None, 0.1, False,
                                                 num_splits=129)
        with pytest.raises(ferroattn.errors.ArgumentError, match="^softmax_scale"):
            torch.ops.ferroattn.attn_fwd_kvcache(q, kc, kc, None, None, 0, sl, 0, None, None, None, float("nan"), False)
        assert ferroattn.flash_attn_with_kvcache(q, kc, kc, softmax_scale=-1.0).shape == q.shape
        out = ferroattn.flash_attn_with_kvcache(q, kc, kc, T(2, 1, 2, 64), T(2, 1, 2, 64), T(64, 16), T(64, 16),
                                                cache_seqlens=sl)
        assert out.shape == q.shape


def test_one_call_forward_declines_what_the_python_path_must_handle():
    """``_native.attn_fwd_fast`` (flash_attn_func's one-call eager forward) returns None, never
    raises, for every call it does not take: off CUDA, an unusual argument type or value (the
    Python path then raises its own named errors), a variant."""
    from ferroattn import _native
    q = _t(1, 128, 4, 64)
    plain = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None)
    odd = [("causal", "yes"), ("causal", 1), ("deterministic", None), ("return_attn_probs", True),
           ("dropout_p", 0.1), ("dropout_p", "0"), ("softcap", 5.0), ("window_size", [-1, -1]),
           ("window_size", (4, 0)), ("window_size", (-1,)), ("softmax_scale", 1), ("softmax_scale", -0.1),
           ("alibi_slopes", torch.zeros(4)), ("s_aux", torch.zeros(4))]
    for name, value in [(None, None), *odd]:
        args = dict(plain) if name is None else {**plain, name: value}
        assert _native.attn_fwd_fast(q, q, q, *args.values()) is None, (name, value)
    assert _native.attn_fwd_fast([1], q, q, *plain.values()) is None
    with pytest.raises(ferroattn.errors.ArgumentError, match="^causal"):
        ferroattn.flash_attn_func(q, q, q, causal="yes")


def test_one_call_kvcache_declines_what_the_python_path_must_handle():
    """``_native.attn_kvcache_fast`` (flash_attn_with_kvcache's one-call path) returns None, never
    raises, for calls it does not take; the Python path then raises its own named errors."""
    from ferroattn import _native
    q, kc = _t(1, 1, 4, 32), _t(1, 8, 4, 32)
    plain = dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                 cache_leftpad=None, block_table=None, softmax_scale=None, causal=True, window_size=(-1, -1),
                 softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)
    odd = [("causal", "yes"), ("num_splits", True), ("num_splits", 1.0), ("return_softmax_lse", None),
           ("cache_seqlens", 3), ("k", _t(1, 1, 4, 32)), ("rotary_cos", _t(8, 8)), ("block_table", _t(1, 1)),
           ("cache_leftpad", _t(1)), ("softcap", 1.0), ("window_size", (2, 0)), ("softmax_scale", 0)]
    for name, value in [(None, None), *odd]:
        args = dict(plain) if name is None else {**plain, name: value}
        assert _native.attn_kvcache_fast(q, kc, kc, *args.values()) is None, (name, value)
    with pytest.raises(ferroattn.errors.ArgumentError, match="^num_splits"):
        ferroattn.flash_attn_with_kvcache(q, kc, kc, num_splits=True)


def test_one_call_functions_take_exactly_their_python_functions_positional_arguments():
    """The one-call functions take flash_attn_func's 12 / flash_attn_with_kvcache's 19 positional
    arguments: another count is a TypeError naming the function and both counts; keywords are
    refused (the Python callers pass positions only)."""
    from ferroattn import _native
    q = _t(1, 128, 4, 64)
    for fn, n in ((_native.attn_fwd_fast, 12), (_native.attn_kvcache_fast, 19)):
        for count in (0, n - 1, n + 1):
            with pytest.raises(TypeError, match=f"^{fn.__name__}: expected {n} positional arguments, got {count}$"):
                fn(*([q] * count))
        with pytest.raises(TypeError):
            fn(q=q)


def test_nested_sparse_and_scalar_inputs_are_named_errors():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.zeros(2, 4, 8), torch.zeros(3, 4, 8)])
    q = _t(1, 4, 4, 8)
    for call, name in [(lambda: ferroattn.flash_attn_func(nt, q, q), "q"),
                       (lambda: ferroattn.flash_attn_func(q, q.to_sparse(), q), "k"),
                       (lambda: ferroattn.flash_attn_qkvpacked_func(nt), "qkv"),
                       (lambda: ferroattn.flash_attn_with_kvcache(q, nt, nt), "k_cache")]:
        with pytest.raises(ferroattn.errors.ArgumentError, match=f"^{name}: expected a dense tensor"):
            call()
    with pytest.raises(ferroattn.errors.ArgumentError, match="^k_cache: expected rank 4"):
        ferroattn.flash_attn_with_kvcache(q, torch.tensor(1.0, dtype=torch.bfloat16), q)
