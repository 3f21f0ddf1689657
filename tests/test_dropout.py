"""Attention dropout on the CPU (no GPU needed): ``dropout_p`` and its Philox key (``rng_state``,
int64 (2,) on q's device, drawn with torch's generator) reaching ``ferroattn::attn_fwd`` /
``attn_bwd`` / ``attn_fwd_dmask`` from every flash_attn function; the key following
``torch.manual_seed``; flash_attn's ``S_dmask`` (b, h, round128(s_q), round128(s_k)) on fake
tensors, padded and varlen; the validation naming ``dropout_p``, ``rng_state``, ``s_dmask`` and
``s_dmask_max`` (the ops' fake impls and ``_native.attn_*_check`` with
``AttnVariant.for_check()``); FLOP counts unchanged by dropout; torch.compile (fullgraph=True)
forward and backward; and the whole Python path on CPU tensors with emulated launchers whose
dropout mask is a pure function of (key, batch, head, i, j), as the kernels' Philox mask is:
the forward, the S_dmask pass and the backward must use one mask, S_dmask must hold the softmax
(rescaled from the kernels' running max per 16 keys to the row max) with the dropped positions
negative. Also: the capability gate of the GPU transformers tests fails (never skips) when
dropout goes missing; the S_dmask op checks the cu_seqlens values as attn_fwd does."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import ferroattn
from ferroattn import _native
from ferroattn import flash_attn_interface as fai
from ferroattn.errors import ArgumentError, DeviceError, DTypeError
from ferroattn.ops import attention as fwd_mod
from ferroattn.ops import attention_bwd as bwd_mod
from ferroattn.ops._to_native import tensor_meta
from ferroattn.ops.variant import DMASK_GROUP, AttnVariant, draw_rng_state
from ferroattn.testing import attention_grads_ref, attention_ref, attention_varlen_ref, visible_mask

BF16, FP16, F32, F64, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64
FWD, BWD, DMASK = (torch.ops.ferroattn.attn_fwd.default, torch.ops.ferroattn.attn_bwd.default,
                   torch.ops.ferroattn.attn_fwd_dmask.default)
# positions in the ops' schemas: attn_fwd (… sinks=14, dropout_p=15, rng_state=16); attn_bwd
# (dout first, deterministic=12, … sinks=17, dropout_p=18, rng_state=19); attn_fwd_dmask (no
# deterministic: … sinks=13, dropout_p=14, rng_state=15)
FWD_P, BWD_P, DMASK_P = 15, 18, 14


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


class _OpCalls(TorchDispatchMode):
    """Records every ferroattn op call (the op and its arguments) and runs it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (FWD, BWD, DMASK):
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def of(self, op):
        """The argument tuples of op's calls, completed with the schema's defaults (the
        dispatcher leaves trailing arguments that equal their defaults out)."""
        out = []
        for f, a in self.calls:
            if f == op:
                args = f._schema.arguments
                out.append(tuple(a) + tuple(x.default_value for x in args[len(a):]))
        return out


def _cuda(*shape, dtype=BF16, grad=False, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device, requires_grad=grad)


def _cu(*lens, device="cuda"):
    vals = [0, *np.cumsum(lens).tolist()]
    if device == "meta":
        return torch.empty(len(vals), dtype=I32, device="meta")
    return torch.tensor(vals, dtype=I32, device=device)


_FORMS = ["padded", "qkvpacked", "kvpacked", "varlen", "varlen_qkvpacked", "varlen_kvpacked"]


def _call_form(form, grad=False, **kw):
    """One valid call of each public function on fake CUDA tensors, or meta tensors that require
    grad with ``grad`` (the backward needs no device) (h = 4, d = 32; padded s_q = s_k = 6,
    varlen two sequences of 4 (max lengths 4))."""
    device = "meta" if grad else "cuda"
    c = lambda *s: _cuda(*s, grad=grad, device=device)  # noqa: E731
    cu = _cu(4, 4, device=device)
    if form == "padded":
        return fai.flash_attn_func(c(2, 6, 4, 32), c(2, 6, 2, 32), c(2, 6, 2, 32), **kw)
    if form == "qkvpacked":
        return fai.flash_attn_qkvpacked_func(c(2, 6, 3, 4, 32), **kw)
    if form == "kvpacked":
        return fai.flash_attn_kvpacked_func(c(2, 6, 4, 32), c(2, 6, 2, 2, 32), **kw)
    if form == "varlen":
        return fai.flash_attn_varlen_func(c(8, 4, 32), c(8, 2, 32), c(8, 2, 32), cu, cu, 4, 4, **kw)
    if form == "varlen_qkvpacked":
        return fai.flash_attn_varlen_qkvpacked_func(c(8, 3, 4, 32), cu, 4, **kw)
    return fai.flash_attn_varlen_kvpacked_func(c(8, 4, 32), c(8, 2, 2, 32), cu, cu, 4, 4, **kw)


def _is_key(r, device="cuda:0"):
    return (isinstance(r, torch.Tensor) and r.dtype == I64 and tuple(r.shape) == (2,) and r.is_contiguous()
            and r.device == torch.device(device))


# ---- dropout_p and rng_state reach the ops ------------------------------------------------------
@pytest.mark.parametrize("form", _FORMS)
def test_dropout_and_its_key_reach_the_ops_from_every_form(form):
    """Forward: attn_fwd gets dropout_p (a float) and an int64 (2,) key on q's device; backward:
    attn_bwd gets the forward's p and the same key (the mask is regenerated, not stored)."""
    with _OpCalls() as rec:
        out = _call_form(form, grad=True, dropout_p=0.125, causal=True)
        out.float().sum().backward()
    (fwd,) = rec.of(FWD)
    (bwd,) = rec.of(BWD)
    assert type(fwd[FWD_P]) is float and fwd[FWD_P] == 0.125
    assert _is_key(fwd[FWD_P + 1], "meta")  # on q's device
    assert bwd[BWD_P] == 0.125 and bwd[BWD_P + 1] is fwd[FWD_P + 1]
    assert fwd[8] is True and rec.of(DMASK) == []  # causal kept; no S_dmask pass without return_attn_probs


@pytest.mark.parametrize("form", _FORMS)
def test_no_dropout_passes_no_key(form):
    with _OpCalls() as rec:
        _call_form(form, grad=True, dropout_p=0.0).float().sum().backward()
    with FakeTensorMode(), _OpCalls() as rec2:
        _call_form(form, dropout_p=None)
    rec.calls += rec2.calls
    for args in rec.of(FWD):
        assert args[FWD_P] == 0.0 and args[FWD_P + 1] is None
    assert rec.of(BWD)[0][BWD_P] == 0.0 and rec.of(BWD)[0][BWD_P + 1] is None


@pytest.mark.parametrize("value,expected", [(0.3, 0.3), (np.float32(0.5), 0.5), (np.float64(0.25), 0.25),
                                            (1e-12, 1e-12), (0, 0.0), (0.0, 0.0)])
def test_dropout_p_reaches_the_op_as_a_float(value, expected):
    with FakeTensorMode(), _OpCalls() as rec:
        q = _cuda(1, 4, 2, 32)
        fai.flash_attn_func(q, q, q, value)  # positional, as flash_attn callers pass it
    (args,) = rec.of(FWD)
    assert type(args[FWD_P]) is float and args[FWD_P] == pytest.approx(expected, rel=1e-7)
    assert (args[FWD_P + 1] is not None) is (expected > 0)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.01, float("nan"), float("inf")])
@pytest.mark.parametrize("form", _FORMS)
def test_dropout_p_out_of_range_names_it_before_the_op(form, p):
    with FakeTensorMode(), _OpCalls() as rec:
        with pytest.raises(ArgumentError, match=r"^dropout_p: expected a probability in \[0, 1\)"):
            _call_form(form, dropout_p=p)
    assert rec.calls == []


# ---- the key follows torch's generator -------------------------------------------------------------
def test_draw_rng_state_follows_the_torch_seed():
    torch.manual_seed(1234)
    a, b = draw_rng_state("cpu"), draw_rng_state("cpu")
    torch.manual_seed(1234)
    a2 = draw_rng_state(torch.device("cpu"))
    for r in (a, b, a2):
        assert _is_key(r, "cpu") and int(r[1]) == 0  # flash_attn's (seed, offset) shape; offset 0
    assert torch.equal(a, a2) and not torch.equal(a, b)
    torch.manual_seed(99)
    assert not torch.equal(draw_rng_state("cpu"), a)


def test_from_flash_attn_draws_a_key_only_with_dropout():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    v0 = AttnVariant.from_flash_attn(False, (-1, -1), 0.0, None, None, 4, 4, 0.0, "cpu")
    assert v0.rng_state is None and v0.dropout_p == 0.0 and v0.is_plain
    assert torch.equal(torch.get_rng_state(), before)  # p = 0 does not consume the generator
    v1 = AttnVariant.from_flash_attn(True, (-1, -1), 0.0, None, None, 4, 4, 0.2, "cpu")
    torch.manual_seed(5)
    v2 = AttnVariant.from_flash_attn(True, (-1, -1), 0.0, None, None, 4, 4, 0.2, "cpu")
    assert v1.dropout_p == 0.2 and _is_key(v1.rng_state, "cpu") and torch.equal(v1.rng_state, v2.rng_state)
    assert not v1.is_plain
    assert v1.op_args() == (-1, -1, 0.0, None, None, 0.2, v1.rng_state)
    back = AttnVariant.from_op_args(True, *v1.op_args())
    assert back.dropout_p == 0.2 and back.rng_state is v1.rng_state


def test_the_same_seed_gives_the_same_key_through_the_functions(monkeypatch):
    keys = []

    def fake_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, variant, deterministic=False):
        keys.append(variant.rng_state)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0])
        return torch.zeros_like(q), torch.zeros(lse_shape)

    monkeypatch.setattr(fai, "_attn_fwd_op", fake_op)
    q = torch.randn(1, 4, 2, 32).to(BF16)
    cu = _cu(4, device="cpu")
    torch.manual_seed(7)
    fai.flash_attn_func(q, q, q, 0.1)
    fai.flash_attn_func(q, q, q, 0.1)
    torch.manual_seed(7)
    fai.flash_attn_func(q, q, q, 0.1)
    fai.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, 0.1)
    torch.manual_seed(7)
    fai.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, 0.1)
    assert all(_is_key(r, "cpu") for r in keys)
    assert torch.equal(keys[0], keys[2]) and torch.equal(keys[0], keys[4])   # one seed, one key
    assert torch.equal(keys[1], keys[3]) and not torch.equal(keys[0], keys[1])  # the generator moves on


# ---- S_dmask: fake shapes -----------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk", [(5, 7), (1, 1), (128, 128), (129, 100), (64, 300)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_s_dmask_fake_shape_padded(sq, sk, dtype):
    with FakeTensorMode(), _OpCalls() as rec:
        q, k = _cuda(3, sq, 4, 40, dtype=dtype), _cuda(3, sk, 2, 40, dtype=dtype)
        out, lse, s_dmask = fai.flash_attn_func(q, k, k, 0.2, None, True, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (3, 4, sq)
        assert s_dmask.shape == (3, 4, _round128(sq), _round128(sk))
        assert s_dmask.dtype == dtype and s_dmask.device == q.device
    (fwd,) = rec.of(FWD)
    (dm,) = rec.of(DMASK)
    # the S_dmask pass sees the forward's arguments and the same key (hence the same mask)
    assert dm[DMASK_P] == 0.2 and dm[DMASK_P + 1] is fwd[FWD_P + 1]
    assert dm[8] is fwd[8] and dm[9:14] == fwd[10:15]
    assert dm[0].shape[-1] == 40 and dm[7] == pytest.approx(40 ** -0.5)


@pytest.mark.parametrize("lens_q,lens_k", [([3, 0, 9], [5, 2, 130]), ([1], [1]), ([200, 7], [7, 129])])
def test_s_dmask_fake_shape_varlen(lens_q, lens_k):
    b, mq, mk = len(lens_q), max(lens_q), max(lens_k)
    with FakeTensorMode(), _OpCalls() as rec:
        q, k = _cuda(sum(lens_q), 6, 64), _cuda(sum(lens_k), 3, 64)
        cu_q, cu_k = _cu(*lens_q), _cu(*lens_k)
        out, lse, s_dmask = fai.flash_attn_varlen_func(q, k, k, cu_q, cu_k, mq, mk, 0.3, return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (6, sum(lens_q))
        assert s_dmask.shape == (b, 6, _round128(mq), _round128(mk)) and s_dmask.dtype == BF16
        # the packed varlen forms too
        qkv = _cuda(sum(lens_q), 3, 6, 64)
        s2 = fai.flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq, 0.3, return_attn_probs=True)[2]
        assert s2.shape == (b, 6, _round128(mq), _round128(mq))
        kv = _cuda(sum(lens_k), 2, 3, 64)
        s3 = fai.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, 0.3, return_attn_probs=True)[2]
        assert s3.shape == (b, 6, _round128(mq), _round128(mk))
    fwds, dms = rec.of(FWD), rec.of(DMASK)
    assert len(fwds) == len(dms) == 3
    for f, d in zip(fwds, dms):
        assert d[3] is f[3] and d[4] is f[4] and d[5:7] == (mq, f[6]) and d[DMASK_P + 1] is f[FWD_P + 1]


@pytest.mark.parametrize("form", _FORMS)
def test_s_dmask_from_every_form_and_empty_without_dropout(form):
    with FakeTensorMode(), _OpCalls() as rec:
        _, _, s_dmask = _call_form(form, dropout_p=0.5, return_attn_probs=True)
        # padded: b = 2, s = 6; varlen: two sequences, max lengths 4
        assert s_dmask.shape == (2, 4, 128, 128) and s_dmask.dtype == BF16
        assert len(rec.of(DMASK)) == 1
        _, _, empty = _call_form(form, dropout_p=0.0, return_attn_probs=True)
        assert empty.shape == (0,) and empty.dtype == BF16 and empty.device.type == "cuda"
        assert len(rec.of(DMASK)) == 1  # no S_dmask pass without dropout


def test_s_dmask_is_not_differentiated():
    q = torch.empty(1, 4, 2, 32, dtype=BF16, device="meta", requires_grad=True)
    out, lse, s_dmask = fai.flash_attn_func(q, q, q, 0.5, return_attn_probs=True)
    assert out.requires_grad and not s_dmask.requires_grad
    assert s_dmask.shape == (1, 2, 128, 128) and s_dmask.device.type == "meta"


def test_attn_fwd_dmask_op_fake_shapes():
    with FakeTensorMode():
        r = torch.empty(2, dtype=I64, device="cuda")
        q, k = _cuda(3, 5, 6, 64, dtype=FP16), _cuda(3, 200, 2, 64, dtype=FP16)
        s = torch.ops.ferroattn.attn_fwd_dmask(q, k, k, None, None, 5, 200, 0.125, True, -1, -1, 0.0, None, None,
                                               0.1, r)
        assert s.shape == (3, 6, 128, 256) and s.dtype == FP16 and s.device == q.device
        qv, kv = _cuda(17, 8, 128), _cuda(23, 1, 128)
        cu = torch.empty(4, dtype=I32, device="cuda")
        s = torch.ops.ferroattn.attn_fwd_dmask(qv, kv, kv, cu, cu, 9, 130, 0.1, False, 3, 4, 0.0, None, None, 0.5, r)
        assert s.shape == (3, 8, 128, 256) and s.dtype == BF16


def test_get_block_size_n():
    # S_dmask shares one scale across the whole row: one key block as wide as any sequence
    for args in [("cuda", 64, True, False), ("cuda", 256, True, True), (None, 32, False, False)]:
        n = fai._get_block_size_n(*args)
        assert isinstance(n, int) and n >= 1 << 30


# ---- validation naming the argument ---------------------------------------------------------------
def _m(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


_KEY_CASES = [
    # (dropout_p, rng_state, exception, message)
    (1.0, "key", ArgumentError, "dropout_p: expected a probability in [0, 1), got 1"),
    (1.5, "key", ArgumentError, "dropout_p: expected a probability in [0, 1), got 1.5"),
    (-0.1, "key", ArgumentError, "dropout_p: expected a probability in [0, 1), got -0.1"),
    (float("nan"), "key", ArgumentError, "dropout_p: expected a probability in [0, 1), got NaN"),
    (0.2, None, ArgumentError, "rng_state: expected an int64 (2,) tensor when dropout_p > 0, got None"),
    (0.2, "i32", DTypeError, "rng_state: expected dtype int64, got int32"),
    (0.2, "f32", DTypeError, "rng_state: expected dtype int64, got float32"),
    (0.2, "len3", ArgumentError, "rng_state: expected shape (2,) (seed, offset), got shape (3,)"),
    (0.2, "2x1", ArgumentError, "rng_state: expected shape (2,) (seed, offset), got shape (2, 1)"),
    (0.2, "strided", ArgumentError, "rng_state: expected a contiguous tensor"),
    (0.0, "i32", DTypeError, "rng_state: expected dtype int64, got int32"),  # checked whenever given
]
_KEY_IDS = ["p1", "p1.5", "p-0.1", "p_nan", "no_key", "key_i32", "key_f32", "key_len3", "key_2x1", "key_strided",
            "p0_key_i32"]


def _key(kind, device="meta"):
    return {None: None, "key": torch.empty(2, dtype=I64, device=device),
            "i32": torch.empty(2, dtype=I32, device=device), "f32": torch.empty(2, dtype=F32, device=device),
            "len3": torch.empty(3, dtype=I64, device=device), "2x1": torch.empty(2, 1, dtype=I64, device=device),
            "strided": torch.empty(4, dtype=I64, device=device)[::2]}[kind]


@pytest.mark.parametrize("p,kind,exc,message", _KEY_CASES, ids=_KEY_IDS)
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_ops_validate_dropout_and_key(op, p, kind, exc, message):
    """The Rust validation through the ops' fake impls (meta tensors) names the argument."""
    q, k, lse = _m(3, 5, 6, 64), _m(3, 9, 2, 64), _m(3, 6, 5, dtype=F32)
    tail = (-1, -1, 0.0, None, None, p, _key(kind))
    with pytest.raises(exc) as info:
        if op == "fwd":
            torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 9, 0.125, False, False, *tail)
        else:
            torch.ops.ferroattn.attn_bwd(q, q, k, k, q, lse, None, None, 5, 9, 0.125, False, False, *tail)
    assert str(info.value).startswith(message), str(info.value)
    # and the valid key passes
    good = (-1, -1, 0.0, None, None, 0.2, _key("key"))
    assert torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 9, 0.125, False, False, *good)[0].shape == q.shape


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_ops_reject_a_key_on_another_device(op):
    with FakeTensorMode():
        q, k = _cuda(2, 5, 4, 32), _cuda(2, 7, 2, 32)
        lse = torch.empty(2, 4, 5, dtype=F32, device="cuda")
        key = torch.empty(2, dtype=I64, device="cpu")
        with pytest.raises(DeviceError, match=r"^rng_state: expected a tensor on cuda:0 \(q's device\), got cpu"):
            if op == "fwd":
                torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 7, 0.1, False, False, -1, -1, 0.0, None, None,
                                             0.3, key)
            else:
                torch.ops.ferroattn.attn_bwd(q, q, k, k, q, lse, None, None, 5, 7, 0.1, False, False, -1, -1, 0.0,
                                             None, None, 0.3, key)


@pytest.mark.parametrize("varlen", [False, True])
def test_op_shapes_with_dropout(varlen):
    with FakeTensorMode():
        key = torch.empty(2, dtype=I64, device="cuda")
        if varlen:
            q, k = _cuda(17, 8, 128), _cuda(23, 1, 128)
            cu = torch.empty(4, dtype=I32, device="cuda")
            args, lse_shape = (q, k, k, cu, cu, 9, 12, 0.1, True), (8, 17)
        else:
            q, k = _cuda(3, 5, 6, 64), _cuda(3, 9, 2, 64)
            args, lse_shape = (q, k, k, None, None, 5, 9, 0.125, True), (3, 6, 5)
        tail = (-1, -1, 0.0, None, None, 0.25, key)
        out, lse = torch.ops.ferroattn.attn_fwd(*args, False, *tail)
        assert out.shape == q.shape and out.stride() == q.stride() and lse.shape == lse_shape and lse.dtype == F32
        grads = torch.ops.ferroattn.attn_bwd(out, *args[:3], out, lse, *args[3:], True, *tail)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_opcheck_meta_with_dropout():
    q, k = _m(2, 5, 4, 32), _m(2, 7, 2, 32)
    cu = _m(3, dtype=I32)
    key = _m(2, dtype=I64)
    lse = _m(2, 4, 5, dtype=F32)
    tail = (-1, -1, 0.0, None, None, 0.2, key)
    for op, args in [
        (FWD, (q, k, k, None, None, 5, 7, 0.17, True, False) + tail),
        (FWD, (q[0], k[0], k[0], cu, cu, 3, 4, 0.17, False, True, 1, 1, 2.0, None, None, 0.5, key)),
        (BWD, (q, q, k, k, q, lse, None, None, 5, 7, 0.17, True, False) + tail),
        (DMASK, (q, k, k, None, None, 5, 7, 0.17, True, -1, -1, 0.0, None, None, 0.2, key)),
    ]:
        res = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in res.values()), res


def _q_k_metas():
    return tensor_meta(_m(2, 5, 4, 64)), tensor_meta(_m(2, 7, 2, 64))


_CHECK_CASES = [
    # AttnVariant fields (tensors as meta tensors), exception, message start
    (dict(dropout_p=1.0, rng_state="key"), ArgumentError, "dropout_p: expected a probability in [0, 1), got 1"),
    (dict(dropout_p=-1e-3, rng_state="key"), ArgumentError, "dropout_p: expected a probability in [0, 1)"),
    (dict(dropout_p=0.2), ArgumentError, "rng_state: expected an int64 (2,) tensor when dropout_p > 0, got None"),
    (dict(dropout_p=0.2, rng_state=_m(2, dtype=I32)), DTypeError, "rng_state: expected dtype int64, got int32"),
    (dict(dropout_p=0.2, rng_state=_m(1, dtype=I64)), ArgumentError, "rng_state: expected shape (2,)"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 128)), ArgumentError,
     "s_dmask_max: expected given together with s_dmask, got only one of the two"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask_max=_m(2, 4, 128, 8, dtype=F32)), ArgumentError,
     "s_dmask_max: expected given together with s_dmask"),
    (dict(s_dmask=_m(2, 4, 128, 128), s_dmask_max=_m(2, 4, 128, 8, dtype=F32)), ArgumentError,
     "s_dmask: expected None unless dropout_p > 0, got a tensor"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 128, dtype=FP16),
          s_dmask_max=_m(2, 4, 128, 8, dtype=F32)), DTypeError, "s_dmask: expected dtype bfloat16 (q's dtype), got float16"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 120), s_dmask_max=_m(2, 4, 128, 7, dtype=F32)),
     ArgumentError, "s_dmask: expected shape (2, 4, >= 5, >= 7 and a multiple of 16), got shape (2, 4, 128, 120)"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 4, 16), s_dmask_max=_m(2, 4, 4, 1, dtype=F32)),
     ArgumentError, "s_dmask: expected shape (2, 4, >= 5, >= 7 and a multiple of 16), got shape (2, 4, 4, 16)"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 3, 128, 128), s_dmask_max=_m(2, 3, 128, 8, dtype=F32)),
     ArgumentError, "s_dmask: expected shape (2, 4,"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 128), s_dmask_max=_m(2, 4, 128, 8)),
     DTypeError, "s_dmask_max: expected dtype float32, got bfloat16"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 128), s_dmask_max=_m(2, 4, 128, 16, dtype=F32)),
     ArgumentError, "s_dmask_max: expected shape (2, 4, 128, 8) (s_dmask's rows, cols / 16), got shape (2, 4, 128, 16)"),
    (dict(dropout_p=0.2, rng_state="key", s_dmask=_m(2, 4, 128, 256)[..., :128],
          s_dmask_max=_m(2, 4, 128, 8, dtype=F32)), ArgumentError, "s_dmask: expected a contiguous tensor"),
]


def _variant(fields):
    fields = {n: (_m(2, dtype=I64) if f == "key" else f) for n, f in fields.items()}
    return AttnVariant(**fields)


@pytest.mark.parametrize("fields,exc,message", _CHECK_CASES, ids=[f"case{i}" for i in range(len(_CHECK_CASES))])
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_native_checks_name_the_dropout_arguments(fields, exc, message, which):
    """_native.attn_fwd_check / attn_bwd_check take the variant as AttnVariant.for_check()."""
    q, k = _q_k_metas()
    lse = tensor_meta(_m(2, 4, 5, dtype=F32))
    variant = _variant(fields).for_check()
    with pytest.raises(exc) as info:
        if which == "fwd":
            _native.attn_fwd_check(q, k, k, None, None, 5, 7, variant)
        else:
            _native.attn_bwd_check(q, q, k, k, q, lse, None, None, 5, 7, variant)
    assert str(info.value).startswith(message), str(info.value)


def test_native_check_accepts_the_valid_dropout_variants():
    q, k = _q_k_metas()
    lse = tensor_meta(_m(2, 4, 5, dtype=F32))
    key = _m(2, dtype=I64)
    for v in [AttnVariant(dropout_p=0.2, rng_state=key),
              AttnVariant(causal=True, window_left=3, window_right=0, softcap=5.0, dropout_p=0.999, rng_state=key),
              AttnVariant(dropout_p=0.0, rng_state=key),  # a key without dropout is allowed (and checked)
              AttnVariant(dropout_p=0.2, rng_state=key, s_dmask=_m(2, 4, 128, 128),
                          s_dmask_max=_m(2, 4, 128, 128 // DMASK_GROUP, dtype=F32)),
              AttnVariant(dropout_p=0.2, rng_state=key, s_dmask=_m(2, 4, 5, 16), s_dmask_max=_m(2, 4, 5, 1, dtype=F32))]:
        assert _native.attn_fwd_check(q, k, k, None, None, 5, 7, v.for_check()) is None
    assert _native.attn_bwd_check(q, q, k, k, q, lse, None, None, 5, 7, AttnVariant(dropout_p=0.3, rng_state=key)
                                  .for_check()) is None
    # for_check turns every tensor into metadata (a tensor itself is refused)
    meta = AttnVariant(dropout_p=0.2, rng_state=key, s_dmask=_m(2, 4, 128, 128),
                       s_dmask_max=_m(2, 4, 128, 8, dtype=F32)).for_check()
    assert meta.rng_state == tensor_meta(key) and meta.s_dmask[0] == (2, 4, 128, 128)
    assert meta.s_dmask_max[2] == "float32"
    with pytest.raises(TypeError):
        _native.attn_fwd_check(q, k, k, None, None, 5, 7, AttnVariant(dropout_p=0.2, rng_state=torch.zeros(2, dtype=I64)))


@pytest.mark.parametrize("p,kind,exc,message", [
    (1.5, "key", ArgumentError, "dropout_p: expected a probability in [0, 1), got 1.5"),
    (0.2, None, ArgumentError, "rng_state: expected an int64 (2,) tensor when dropout_p > 0, got None"),
    (0.2, "i32", DTypeError, "rng_state: expected dtype int64, got int32"),
    (0.0, "key", ArgumentError, "s_dmask: expected None unless dropout_p > 0, got a tensor"),
], ids=["p1.5", "no_key", "key_i32", "no_dropout"])
def test_attn_fwd_dmask_fake_validates(p, kind, exc, message):
    """The S_dmask op's fake impl runs the real op's validation (with the buffers the real op
    allocates): an invalid call fails while tracing, naming the argument, not only when run."""
    with FakeTensorMode():
        q, k = _cuda(3, 5, 6, 64), _cuda(3, 9, 2, 64)
        with pytest.raises(exc) as info:
            torch.ops.ferroattn.attn_fwd_dmask(q, k, k, None, None, 5, 9, 0.125, False, -1, -1, 0.0, None, None, p,
                                               _key(kind, "cuda"))
        assert str(info.value).startswith(message), str(info.value)
        ok = torch.ops.ferroattn.attn_fwd_dmask(q, k, k, None, None, 5, 9, 0.125, False, -1, -1, 0.0, None, None,
                                                0.2, _key("key", "cuda"))
        assert ok.shape == (3, 6, 128, 128)


# ---- FLOPs: dropout does not change the count ---------------------------------------------------------
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)), (True, (5, 0))])
def test_flop_counter_dropout_does_not_change_the_count(causal, window):
    with FakeTensorMode():
        q, k = _cuda(2, 16, 4, 64), _cuda(2, 20, 2, 64)
        with FlopCounterMode(display=False) as plain:
            fai.flash_attn_func(q, k, k, 0.0, None, causal, window)
        with FlopCounterMode(display=False) as dropped:
            fai.flash_attn_func(q, k, k, 0.3, None, causal, window)
    pairs = ferroattn.ops.variant.visible_pairs(16, 20, causal, window)
    assert plain.get_total_flops() == dropped.get_total_flops() == 4 * 2 * 4 * 64 * pairs > 0


def test_flop_counter_dropout_varlen_and_backward_meta():
    q = torch.empty(2, 16, 4, 64, dtype=BF16, device="meta", requires_grad=True)
    counts = []
    for p in (0.0, 0.4):
        with FlopCounterMode(display=False) as counter:
            fai.flash_attn_func(q, q, q, p, causal=True).sum().backward()
        counts.append(counter.get_flop_counts()["Global"])
    fwd = 4 * 2 * 4 * 64 * (16 * 17 // 2)
    for c in counts:
        assert c[torch.ops.ferroattn.attn_fwd] == fwd and c[torch.ops.ferroattn.attn_bwd] == fwd * 5 // 2
    with FakeTensorMode():
        qv = _cuda(24, 4, 64)
        cu = _cu(8, 16)
        with FlopCounterMode(display=False) as plain:
            fai.flash_attn_varlen_func(qv, qv, qv, cu, cu, 16, 16)
        with FlopCounterMode(display=False) as dropped:
            fai.flash_attn_varlen_func(qv, qv, qv, cu, cu, 16, 16, 0.5)
        with FlopCounterMode(display=False) as probs:
            fai.flash_attn_varlen_func(qv, qv, qv, cu, cu, 16, 16, 0.5, return_attn_probs=True)
    assert plain.get_total_flops() == dropped.get_total_flops() > 0
    # the attention itself counts the same with the testing-only S_dmask pass
    assert probs.get_flop_counts()["Global"][torch.ops.ferroattn.attn_fwd] == plain.get_total_flops()


# ---- torch.compile ---------------------------------------------------------------------------------
class _CountingBackend:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _op_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def _draws_from_the_generator(node) -> bool:
    """The node (or one it is computed from) draws random numbers (torch.randint)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and "randint" in str(n.target):
            return True
        todo.extend(n.all_input_nodes)
    return False


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_fake_cuda_with_dropout(varlen):
    """One graph; the key is drawn inside it (a compiled function draws a new key per call, never
    a constant baked in at trace time); the S_dmask pass gets the same key node."""
    torch._dynamo.reset()
    backend = _CountingBackend()
    with FakeTensorMode():
        if varlen:
            q, k = _cuda(17, 8, 36), _cuda(23, 2, 36)
            cu = torch.empty(4, dtype=I32, device="cuda")

            def f(q, k, v, cu):
                out, lse, s = fai.flash_attn_varlen_func(q, k, v, cu, cu, 9, 12, 0.2, causal=True,
                                                         window_size=(4, 100), return_attn_probs=True)
                return out * 2, s

            args = (q, k, k, cu)
            s_shape = (3, 8, 128, 128)
        else:
            q, k = _cuda(2, 5, 8, 36), _cuda(2, 7, 2, 36)

            def f(q, k, v):
                out, lse, s = fai.flash_attn_func(q, k, v, 0.2, None, True, (4, 100), 30.0, return_attn_probs=True)
                return out * 2, s

            args = (q, k, k)
            s_shape = (2, 8, 128, 128)
        out, s = torch.compile(f, fullgraph=True, backend=backend)(*args)
    assert out.shape == q.shape and s.shape == s_shape
    assert len(backend.graphs) == 1
    (node,) = _op_nodes(backend.graphs[0], FWD)
    (dm,) = _op_nodes(backend.graphs[0], DMASK)
    assert node.args[8] is True and node.args[10:12] == (4, 0) and node.args[FWD_P] == 0.2
    key = node.args[FWD_P + 1]
    assert isinstance(key, torch.fx.Node) and _draws_from_the_generator(key)
    assert dm.args[DMASK_P] == 0.2 and dm.args[DMASK_P + 1] is key


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_forward_backward_meta_with_dropout(varlen):
    """aot_autograd on meta tensors: one forward and one backward graph; attn_bwd gets the
    forward's dropout_p and its key (saved from the forward graph)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    m = lambda *s: torch.empty(s, dtype=BF16, device="meta", requires_grad=True)  # noqa: E731
    if varlen:
        q, k = m(11, 6, 40), m(13, 2, 40)
        cu = torch.empty(3, dtype=I32, device="meta")
        f = lambda q, k, v: fai.flash_attn_varlen_func(q, k, v, cu, cu, 6, 7, 0.1, window_size=(2, 3),  # noqa: E731
                                                       softcap=4.0).float().sum()
    else:
        q, k = m(2, 5, 6, 40), m(2, 7, 2, 40)
        f = lambda q, k, v: fai.flash_attn_func(q, k, v, 0.1, causal=True).float().sum()  # noqa: E731
    loss = torch.compile(f, fullgraph=True, backend=backend)(q, k, k)
    loss.backward()
    assert q.grad.shape == q.shape and q.grad.dtype == BF16 and k.grad.shape == k.shape
    assert len(graphs) == 2
    (fwd,) = _op_nodes(graphs[0], FWD)
    (bwd,) = _op_nodes(graphs[1], BWD)
    assert fwd.args[FWD_P] == 0.1 and _draws_from_the_generator(fwd.args[FWD_P + 1])
    assert bwd.args[BWD_P] == 0.1 and isinstance(bwd.args[BWD_P + 1], torch.fx.Node)
    assert bwd.args[BWD_P + 1].op == "placeholder"  # the key saved by the forward graph
    outputs = graphs[0].graph.find_nodes(op="output")[0].args[0]
    assert fwd.args[FWD_P + 1] in outputs  # … which is the forward's key


@pytest.mark.parametrize("d", [32, 36])
def test_backward_runs_on_meta_with_dropout(d):
    q = torch.empty(2, 5, 4, d, dtype=BF16, device="meta", requires_grad=True)
    k = torch.empty(2, 7, 2, d, dtype=BF16, device="meta", requires_grad=True)
    sinks = torch.empty(4, dtype=F32, device="meta", requires_grad=True)
    out = fai.flash_attn_func(q, k, k, 0.25, causal=True, window_size=(1, 0), s_aux=sinks)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and sinks.grad.shape == (4,)


# ---- the whole Python path on CPU tensors, with emulated launchers ------------------------------------
def _keep_mask(rng_state, p, b, h, rows, cols):
    """bool (b, h, rows, cols), True = kept: the emulated kernels' dropout mask, a pure function of
    (rng_state[0], batch (varlen: sequence), head, i, j) -- the kernels' Philox mask is one too --
    here a splitmix64 finaliser of the packed coordinates."""
    seed = np.uint64(int(rng_state[0]) & (2 ** 64 - 1))
    idx = np.meshgrid(np.arange(b), np.arange(h), np.arange(rows), np.arange(cols), indexing="ij")
    bi, hi, ii, jj = (a.astype(np.uint64) for a in idx)
    x = seed ^ (bi << np.uint64(48)) ^ (hi << np.uint64(36)) ^ (ii << np.uint64(18)) ^ jj
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    return torch.from_numpy(u >= p)


def _as_cuda_meta(t):
    """tensor_meta of a CPU tensor described as a CUDA tensor, for the real metadata checks."""
    m = tensor_meta(t)
    return None if m is None else (m[0], m[1], m[2], (2, 0))


def _cuda_variant(variant):
    return dataclasses.replace(variant, **{f: _as_cuda_meta(getattr(variant, f))
                                           for f in ("alibi_slopes", "sinks", "rng_state", "s_dmask", "s_dmask_max")})


class _DropoutNative:
    """Stands in for ferroattn._native's attention launchers: the real metadata validation (the
    variant and the S_dmask buffers included), then fp64 closed forms (ferroattn.testing) with
    the mask of :func:`_keep_mask`; for a variant with ``s_dmask`` it writes what the kernels
    write: ``±exp(s − m_g)`` (negative where dropped, 0 where masked) with m_g the row's running
    max through key group g (16 keys) in ``s_dmask_max``. ``calls``: (kind, dropout_p, key)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(_native, name)

    # the fake impls' checks (torch.compile on CPU tensors): the CPU metadata described as CUDA
    @staticmethod
    def _cuda(meta):
        return None if meta is None else (meta[0], meta[1], meta[2], (2, 0))

    def _cuda_check_variant(self, variant):
        if variant is None:
            return None
        fields = ("alibi_slopes", "sinks", "rng_state", "s_dmask", "s_dmask_max")
        return dataclasses.replace(variant, **{f: self._cuda(getattr(variant, f)) for f in fields})

    def attn_fwd_check(self, *metas_and_sizes, variant=None):
        *metas, max_q, max_k = metas_and_sizes[:7]
        variant = metas_and_sizes[7] if len(metas_and_sizes) > 7 else variant
        return _native.attn_fwd_check(*map(self._cuda, metas), max_q, max_k, self._cuda_check_variant(variant))

    def attn_bwd_check(self, *metas_and_sizes, variant=None):
        *metas, max_q, max_k = metas_and_sizes[:10]
        variant = metas_and_sizes[10] if len(metas_and_sizes) > 10 else variant
        return _native.attn_bwd_check(*map(self._cuda, metas), max_q, max_k, self._cuda_check_variant(variant))

    def _mask(self, variant, b, h, rows, cols):
        if variant.dropout_p == 0.0:
            return None
        return _keep_mask(variant.rng_state, variant.dropout_p, b, h, rows, cols)

    @staticmethod
    def _seqs(q, k, cu_q, cu_k):
        """[(batch index, q rows, k rows)] of the call (padded: every batch entry)."""
        if cu_q is None:
            return [(i, (i, slice(None)), (i, slice(None))) for i in range(q.shape[0])]
        cq, ck = cu_q.tolist(), cu_k.tolist()
        return [(i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]

    def attn_fwd(self, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, variant, stream):
        _native.attn_fwd_check(*map(_as_cuda_meta, (q, k, v, cu_q, cu_k)), max_q, max_k, _cuda_variant(variant))
        assert isinstance(variant, AttnVariant) and scale > 0 and stream == 0
        assert variant.window_left == variant.window_right == -1 and variant.softcap == 0.0  # what the tests use
        key = None if variant.rng_state is None else variant.rng_state.clone()
        self.calls.append(("dmask" if variant.s_dmask is not None else "fwd", variant.dropout_p, key))
        varlen = cu_q is not None
        h = q.shape[-2]
        b = cu_q.shape[0] - 1 if varlen else q.shape[0]
        s_q, s_k = (max_q, max_k) if varlen else (q.shape[1], k.shape[1])
        keep = self._mask(variant, b, h, s_q, s_k)
        kw = dict(causal=variant.causal, softmax_scale=scale, reference_dtype=F64, dropout_p=variant.dropout_p,
                  dropout_mask=keep)
        if varlen:
            o, l = attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max_k, **kw)
        else:
            o, l = attention_ref(q, k, v, **kw)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)
        if variant.s_dmask is not None:
            self._write_s_dmask(q, k, cu_q, cu_k, scale, variant, keep)

    def _write_s_dmask(self, q, k, cu_q, cu_k, scale, variant, keep):
        h, hk = q.shape[-2], k.shape[-2]
        for i, rq, rk in self._seqs(q, k, cu_q, cu_k):
            qi, ki = q[rq].double(), k[rk].double().repeat_interleave(h // hk, dim=-2)
            sq, sk = qi.shape[0], ki.shape[0]
            if sq == 0 or sk == 0:
                continue
            s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
            s = s.masked_fill(~visible_mask(sq, sk, variant.causal), float("-inf"))
            run = torch.cummax(s, dim=-1).values                          # running max through key j
            groups = math.ceil(sk / DMASK_GROUP)
            ends = [min((g + 1) * DMASK_GROUP, sk) - 1 for g in range(groups)]
            m = run[..., ends]                                            # (h, sq, groups)
            m_of_j = m.repeat_interleave(DMASK_GROUP, dim=-1)[..., :sk]
            e = torch.where(torch.isfinite(s), torch.exp(s - m_of_j), torch.zeros((), dtype=F64))
            e = torch.where(keep[i, :, :sq, :sk], e, -e)
            variant.s_dmask[i, :, :sq, :sk] = e.to(variant.s_dmask.dtype)
            variant.s_dmask_max[i, :, :sq, :groups] = m.float()

    def attn_bwd(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_d, dq_accum, cu_q, cu_k, max_q, max_k, scale,
                 variant, deterministic, stream):
        _native.attn_bwd_check(*map(_as_cuda_meta, (dout, q, k, v, out, lse, cu_q, cu_k)), max_q, max_k,
                               _cuda_variant(variant))
        key = None if variant.rng_state is None else variant.rng_state.clone()
        self.calls.append(("bwd", variant.dropout_p, key))
        varlen = cu_q is not None
        b = cu_q.shape[0] - 1 if varlen else q.shape[0]
        s_q, s_k = (max_q, max_k) if varlen else (q.shape[1], k.shape[1])
        keep = self._mask(variant, b, q.shape[-2], s_q, s_k)
        # autograd through the reference, in a thread of its own: the op's implementation runs
        # below the autograd dispatch key (thread-local), where autograd records nothing
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            grads = pool.submit(attention_grads_ref, q, k, v, dout, variant.causal, scale, cu_q, cu_k,
                                reference_dtype=F64, dropout_p=variant.dropout_p, dropout_mask=keep,
                                max_seqlen_k=max_k if varlen else None).result()
        for dst, g in zip((dq, dk, dv), grads):
            dst.copy_(g.to(dst.dtype))


@pytest.fixture
def emulated(monkeypatch):
    stub = _DropoutNative()
    monkeypatch.setattr(fwd_mod, "_native", stub)
    monkeypatch.setattr(bwd_mod, "_native", stub)
    return stub


def test_keep_mask_helper_is_a_pure_function_of_the_coordinates():
    key = torch.tensor([123456789, 0], dtype=I64)
    full = _keep_mask(key, 0.3, 3, 2, 40, 70)
    assert torch.equal(_keep_mask(key, 0.3, 3, 2, 17, 9), full[:, :, :17, :9])
    assert abs(1 - full.float().mean().item() - 0.3) < 0.02
    assert not torch.equal(_keep_mask(torch.tensor([123456790, 0]), 0.3, 3, 2, 40, 70), full)
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[:, 0], full[:, 1])


def _leaf(*shape):
    return torch.randn(*shape).to(BF16).requires_grad_(True)


def _check_s_dmask(s_dmask, keep, q, k, scale, causal):
    """S_dmask of one sequence (h, rows, cols) against the fp64 softmax: |S| = exp(s − max_j s)
    where visible (0 elsewhere, rows/cols past the sequence too), negative exactly where dropped,
    and |S| / Σ_j |S| = the softmax."""
    h, hk = q.shape[-2], k.shape[-2]
    sq, sk = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(h // hk, dim=-2)) * scale
    vis = visible_mask(sq, sk, causal)
    s = s.masked_fill(~vis, float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    want = torch.where(vis, torch.exp(s - row_max), torch.zeros((), dtype=F64))
    got = s_dmask[:, :sq, :sk].double()
    assert torch.allclose(got.abs(), want, rtol=2e-2, atol=1e-2), (got.abs() - want).abs().max()
    assert torch.equal((got < 0) & vis, ~keep[:, :sq, :sk] & vis & (want > 1e-30))
    assert (s_dmask[:, sq:] == 0).all() and (s_dmask[:, :, sk:] == 0).all()
    probs = got.abs() / got.abs().sum(-1, keepdim=True).clamp_min(1e-300)
    ref = torch.softmax(s, dim=-1).nan_to_num(0.0)
    assert torch.allclose(probs, ref, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_one_mask_for_forward_s_dmask_and_backward_padded(emulated, causal):
    torch.manual_seed(0)
    b, sq, sk, h, hk, d, p = 2, 37, 45, 4, 2, 32, 0.3
    q, k, v = _leaf(b, sq, h, d), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    scale = 0.2
    out, lse, s_dmask = fai.flash_attn_func(q, k, v, p, scale, causal, return_attn_probs=True)
    assert s_dmask.shape == (b, h, 128, 128) and s_dmask.dtype == BF16
    kinds = [c[0] for c in emulated.calls]
    assert kinds == ["fwd", "dmask"]
    key = emulated.calls[0][2]
    assert _is_key(key, "cpu") and torch.equal(emulated.calls[1][2], key) and emulated.calls[1][1] == p
    keep = _keep_mask(key, p, b, h, sq, sk)
    ref, ref_lse = attention_ref(q, k, v, causal, scale, reference_dtype=F64, dropout_p=p, dropout_mask=keep)
    assert torch.allclose(out.double(), ref, atol=2e-2)
    plain, _ = attention_ref(q, k, v, causal, scale, reference_dtype=F64)
    assert not torch.allclose(out.double(), plain, atol=5e-2)  # the dropout did happen
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-4)
    for i in range(b):
        _check_s_dmask(s_dmask[i], keep[i], q[i].detach(), k[i].detach(), scale, causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [c[0] for c in emulated.calls] == ["fwd", "dmask", "bwd"]
    assert emulated.calls[2][1] == p and torch.equal(emulated.calls[2][2], key)  # the forward's key
    want = attention_grads_ref(q, k, v, dout, causal, scale, reference_dtype=F64, dropout_p=p, dropout_mask=keep)
    for name, g, w in zip("qkv", grads, want):
        assert g.dtype == BF16 and torch.allclose(g.double(), w, atol=3e-2 * max(1.0, w.abs().max().item())), name


def test_one_mask_for_forward_s_dmask_and_backward_varlen(emulated):
    torch.manual_seed(1)
    lens_q, lens_k = [5, 0, 40, 1], [7, 3, 33, 0]
    h, hk, d, p, scale = 4, 1, 32, 0.25, 0.3
    cu_q, cu_k = _cu(*lens_q, device="cpu"), _cu(*lens_k, device="cpu")
    mq, mk = max(lens_q), max(lens_k)
    q, k, v = _leaf(sum(lens_q), h, d), _leaf(sum(lens_k), hk, d), _leaf(sum(lens_k), hk, d)
    out, lse, s_dmask = fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, p, scale, True,
                                                   return_attn_probs=True)
    assert s_dmask.shape == (4, h, 128, 128)
    key = emulated.calls[0][2]
    assert [c[0] for c in emulated.calls] == ["fwd", "dmask"] and torch.equal(emulated.calls[1][2], key)
    keep = _keep_mask(key, p, 4, h, mq, mk)
    ref, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, True, scale, reference_dtype=F64, dropout_p=p,
                                  dropout_mask=keep)
    assert torch.allclose(out.double(), ref, atol=2e-2)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(4):
        qi, ki = q[cq[i]:cq[i + 1]].detach(), k[ck[i]:ck[i + 1]].detach()
        if qi.shape[0] and ki.shape[0]:
            _check_s_dmask(s_dmask[i], keep[i], qi, ki, scale, True)
        else:
            assert (s_dmask[i] == 0).all()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert emulated.calls[-1][0] == "bwd" and torch.equal(emulated.calls[-1][2], key)
    want = attention_grads_ref(q, k, v, dout, True, scale, cu_q, cu_k, reference_dtype=F64, dropout_p=p,
                               dropout_mask=keep)
    for name, g, w in zip("qkv", grads, want):
        assert torch.allclose(g.double(), w, atol=3e-2 * max(1.0, w.abs().max().item())), name


def test_the_torch_seed_reproduces_the_result(emulated):
    q, k, v = _leaf(1, 20, 2, 32), _leaf(1, 20, 2, 32), _leaf(1, 20, 2, 32)
    torch.manual_seed(11)
    a = fai.flash_attn_func(q, k, v, 0.4)
    b = fai.flash_attn_func(q, k, v, 0.4)
    torch.manual_seed(11)
    a2 = fai.flash_attn_func(q, k, v, 0.4)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    keys = [c[2] for c in emulated.calls]
    assert torch.equal(keys[0], keys[2]) and not torch.equal(keys[0], keys[1])
    # p = 0: no key at all, and the plain result
    plain = fai.flash_attn_func(q, k, v, 0.0)
    assert emulated.calls[-1][1:] == (0.0, None)
    ref, _ = attention_ref(q, k, v, reference_dtype=F64)
    assert torch.allclose(plain.double(), ref, atol=2e-2)


def test_compiled_function_draws_a_new_key_per_call(emulated):
    """torch.compile (aot_eager, CPU tensors): the key is not a trace-time constant."""
    torch._dynamo.reset()
    q = torch.randn(1, 8, 2, 32).to(BF16)
    f = torch.compile(lambda q: fai.flash_attn_func(q, q, q, 0.5), fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    a, b = f(q), f(q)
    torch.manual_seed(3)
    a2 = f(q)
    keys = [c[2] for c in emulated.calls if c[0] == "fwd"]
    assert len(keys) == 3 and all(_is_key(r, "cpu") for r in keys)
    assert torch.equal(keys[0], keys[2]) and not torch.equal(keys[0], keys[1])
    assert torch.equal(a, a2) and not torch.equal(a, b)


# ---- transformers: the GPU architecture tests run their dropout tests -----------------------------------
def test_gpu_arch_tests_fail_rather_than_skip_when_dropout_is_missing(monkeypatch):
    pytest.importorskip("transformers")
    import test_gpu_transformers_archs as archs

    assert "dropout" in archs.IMPLEMENTED
    monkeypatch.setattr(archs, "missing", lambda features, causal: "ferroattn: something is not implemented yet")
    with pytest.raises(pytest.fail.Exception, match="dropout is implemented"):
        archs.require("llama", "dropout")
    with pytest.raises(pytest.skip.Exception, match="not implemented yet"):
        archs.require("gemma2")  # a combination without an implemented feature still skips
    monkeypatch.setattr(archs, "missing", lambda features, causal: None)
    archs.require("llama", "dropout")  # supported: neither skips nor fails


# ---- the S_dmask op checks the cu_seqlens values like attn_fwd ------------------------------------------
def _bad_varlen_args():
    """A varlen call whose first sequence (9 rows) is longer than max_seqlen_q (4)."""
    q, k = torch.randn(12, 2, 32).to(BF16), torch.randn(12, 2, 32).to(BF16)
    cu = torch.tensor([0, 9, 12], dtype=I32)
    return (q, k, k, cu, cu, 4, 9, 0.2, False)


def test_attn_fwd_rejects_a_sequence_longer_than_max_seqlen_q(emulated):
    with pytest.raises(ArgumentError, match=r"^max_seqlen_q: expected >= the longest sequence in cu_seqlens_q \(9\)"):
        torch.ops.ferroattn.attn_fwd(*_bad_varlen_args(), False, -1, -1, 0.0, None, None, 0.2,
                                     torch.zeros(2, dtype=I64))
    assert emulated.calls == []  # rejected before the launch


def test_attn_fwd_dmask_rejects_a_sequence_longer_than_max_seqlen_q(emulated):
    try:
        torch.ops.ferroattn.attn_fwd_dmask(*_bad_varlen_args(), -1, -1, 0.0, None, None, 0.2,
                                           torch.zeros(2, dtype=I64))
    except ArgumentError as e:
        assert str(e).startswith("max_seqlen_q: expected >= the longest sequence in cu_seqlens_q"), str(e)
        assert emulated.calls == []
        return
    except Exception:  # noqa: BLE001  (the emulated kernel failing on the inconsistent lengths)
        pass
    raise AssertionError("attn_fwd_dmask launched with a sequence longer than max_seqlen_q")
