"""flash_attn 2.x parity of the public functions: signatures, argument normalisation (what reaches
the custom op), unsupported arguments."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ferroattn
from ferroattn import flash_attn_interface as fai

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
    """Replace the custom op by a recorder that returns correctly shaped outputs."""
    calls = []

    def fake_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, deterministic):
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=scale, causal=causal,
                          deterministic=deterministic))
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


@pytest.mark.parametrize("window,causal,expected", [
    ((-1, -1), False, False),
    ((6, 6), False, False),       # both sides >= seqlen_k (6) -> -1
    ((10, -1), True, True),
    ((-1, 0), False, True),       # (left < 0, right == 0) is causal in flash_attn
    ((-1, 3), True, True),        # causal forces right = 0
    ((-5, -2), False, False),     # any negative side is unbounded
])
def test_window_normalisation(captured, window, causal, expected):
    fai.flash_attn_func(_t(1, 4, 2, 32), _t(1, 6, 2, 32), _t(1, 6, 2, 32), causal=causal, window_size=window)
    assert captured[0]["causal"] is expected


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


# ---- unsupported arguments -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(window_size=(2, 2)), "window_size"),
    (dict(window_size=(2, -1)), "window_size"),
    (dict(window_size=(-1, 2)), "window_size"),
    (dict(window_size=(3, 0), causal=True), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
])
@pytest.mark.parametrize("fn", ["padded", "varlen", "qkvpacked"])
def test_unsupported_arguments_raise(captured, kwargs, needle, fn):
    with pytest.raises(NotImplementedError, match=needle):
        if fn == "padded":
            fai.flash_attn_func(_t(1, 4, 4, 32), _t(1, 6, 4, 32), _t(1, 6, 4, 32), **kwargs)
        elif fn == "varlen":
            cu = torch.tensor([0, 4, 8], dtype=torch.int32)
            fai.flash_attn_varlen_func(_t(8, 4, 32), _t(8, 4, 32), _t(8, 4, 32), cu, cu, 4, 4, **kwargs)
        else:
            fai.flash_attn_qkvpacked_func(_t(1, 6, 3, 4, 32), **kwargs)
    assert captured == []  # never silently ignored: nothing launched


def test_block_table_raises(captured):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        fai.flash_attn_varlen_func(_t(4, 4, 32), _t(4, 4, 32), _t(4, 4, 32), cu, cu, 4, 4,
                                   block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_kvcache_not_implemented():
    q = _t(1, 1, 4, 32)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache"):
        ferroattn.flash_attn_with_kvcache(q, _t(1, 8, 4, 32), _t(1, 8, 4, 32))


def test_unsupported_raise_on_fake_tensors_too():
    with FakeTensorMode():
        q = torch.empty(1, 4, 4, 32, dtype=BF16, device="cuda")
        with pytest.raises(NotImplementedError, match="softcap"):
            fai.flash_attn_func(q, q, q, softcap=5.0)
