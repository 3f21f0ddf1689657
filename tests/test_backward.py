"""The backward on CPU (no GPU): the ``ferroattn::attn_bwd`` op under fake/meta tensors (shapes,
dtypes, strides, validation errors), the autograd wiring of ``ferroattn::attn_fwd`` (forward +
backward on fake/meta tensors, what is saved, torch.compile's joint graph, opcheck), the FLOP
formula, and the whole Python path numerically with the two native launchers replaced by torch
emulations (scale <= 0 mapping, head-dim padding, packed views, GQA, varlen zero rows, grad_out
layouts, workspace allocation). The kernels themselves are checked in test_gpu_backward.py."""
from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import ferroattn
from ferroattn import _native, errors
from ferroattn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ferroattn.ops import attention as fwd_mod
from ferroattn.ops import attention_bwd as bwd_mod
from ferroattn.ops._to_native import tensor_meta
from ferroattn.testing import attention_grads_ref, attention_ref, attention_varlen_ref, random_cu_seqlens

BF16, FP16, F32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32
BWD = torch.ops.ferroattn.attn_bwd.default
FWD = torch.ops.ferroattn.attn_fwd.default


def _fake_cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


# ---------------------------------------------------------------------------------------------
# the attn_bwd op under FakeTensorMode: shapes, dtypes, strides
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_fake_shapes_padded(dtype, deterministic):
    with FakeTensorMode():
        q, k = _fake_cuda(3, 5, 6, 64, dtype=dtype), _fake_cuda(3, 9, 2, 64, dtype=dtype)
        v = _fake_cuda(3, 2, 9, 64, dtype=dtype).transpose(1, 2)  # dense, (b, h, s, d) order
        lse = torch.empty(3, 6, 5, device="cuda")
        dq, dk, dv = BWD(q, q, k, v, q, lse, None, None, 5, 9, 0.125, True, deterministic)
        for g, x in ((dq, q), (dk, k), (dv, v)):
            assert isinstance(g, FakeTensor) and g.device == x.device
            assert g.shape == x.shape and g.dtype == dtype and g.stride() == x.stride()


def test_bwd_fake_shapes_varlen_gqa_and_views():
    with FakeTensorMode():
        q = _fake_cuda(17, 8, 128)
        kv = _fake_cuda(23, 2, 1, 128)  # packed kv: k and v are non-dense views
        cu = torch.empty(4, dtype=I32, device="cuda")
        lse = torch.empty(8, 17, device="cuda")
        dq, dk, dv = BWD(q, q, kv[:, 0], kv[:, 1], q, lse, cu, cu, 9, 12, 0.1, False, False)
        assert dq.shape == (17, 8, 128) and dq.stride() == q.stride()
        assert dk.shape == dv.shape == (23, 1, 128) and dk.is_contiguous() and dv.is_contiguous()


def test_bwd_fake_accepts_any_dout_layout():
    # dout of any strides is accepted: stride(-1) != 1 (e.g. the all-zero strides of sum()'s
    # grad) is copied by the op, so the fake must accept it too
    with FakeTensorMode():
        q, k = _fake_cuda(2, 5, 4, 32), _fake_cuda(2, 7, 2, 32)
        lse = torch.empty(2, 4, 5, device="cuda")
        for dout in (torch.ones((), dtype=BF16, device="cuda").expand(2, 5, 4, 32),
                     _fake_cuda(2, 5, 32, 4).transpose(2, 3), _fake_cuda(2, 4, 5, 32).transpose(1, 2)):
            dq, dk, dv = BWD(dout, q, k, k, q, lse, None, None, 5, 7, 0.1, False, False)
            assert dq.shape == q.shape and dk.shape == k.shape
        # a non-contiguous LSE is copied as well
        lse_t = torch.empty(2, 5, 4, device="cuda").transpose(1, 2)
        assert BWD(q, q, k, k, q, lse_t, None, None, 5, 7, 0.1, False, False)[0].shape == q.shape


def test_bwd_meta_tensors():
    q = torch.empty(2, 5, 6, 40, dtype=BF16, device="meta")
    k = torch.empty(2, 7, 2, 40, dtype=BF16, device="meta")
    lse = torch.empty(2, 6, 5, device="meta")
    dq, dk, dv = BWD(q, q, k, k, q, lse, None, None, 5, 7, 0.1, True, True)
    assert dq.device.type == "meta" and dq.shape == q.shape and dk.shape == dv.shape == k.shape


# ---------------------------------------------------------------------------------------------
# validation: attn_bwd_check and the op name the argument
# ---------------------------------------------------------------------------------------------
def _bwd_args(**over):
    q, k = torch.empty(2, 5, 4, 32, dtype=BF16, device="meta"), torch.empty(2, 7, 2, 32, dtype=BF16, device="meta")
    a = dict(dout=q, q=q, k=k, v=k, out=q, softmax_lse=torch.empty(2, 4, 5, device="meta"), cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=7)
    a.update(over)
    return a


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


BAD_BWD = [
    ("dout_dtype", dict(dout=_meta(2, 5, 4, 32, dtype=FP16)), errors.DTypeError, "dout"),
    ("dout_shape", dict(dout=_meta(2, 5, 4, 40)), errors.ArgumentError, "dout"),
    ("out_dtype", dict(out=_meta(2, 5, 4, 32, dtype=F32)), errors.DTypeError, "out"),
    ("out_shape", dict(out=_meta(2, 6, 4, 32)), errors.ArgumentError, "out"),
    ("lse_dtype", dict(softmax_lse=_meta(2, 4, 5, dtype=BF16)), errors.DTypeError, "softmax_lse"),
    ("lse_shape", dict(softmax_lse=_meta(2, 5, 4, dtype=F32)), errors.ArgumentError, "softmax_lse"),
    ("lse_varlen_shape_for_padded", dict(softmax_lse=_meta(4, 10, dtype=F32)), errors.ArgumentError, "softmax_lse"),
    ("q_dtype", dict(q=_meta(2, 5, 4, 32, dtype=F32), dout=_meta(2, 5, 4, 32, dtype=F32),
                     out=_meta(2, 5, 4, 32, dtype=F32)), errors.DTypeError, "q"),
    ("k_heads", dict(k=_meta(2, 7, 3, 32), v=_meta(2, 7, 3, 32)), errors.ArgumentError, "k|q"),
    ("v_dtype", dict(v=_meta(2, 7, 2, 32, dtype=FP16)), errors.DTypeError, "v"),
    ("cu_int64_varlen", dict(q=_meta(9, 4, 32), dout=_meta(9, 4, 32), out=_meta(9, 4, 32), k=_meta(11, 2, 32),
                             v=_meta(11, 2, 32), softmax_lse=_meta(4, 9, dtype=F32),
                             cu_seqlens_q=_meta(3, dtype=torch.int64), cu_seqlens_k=_meta(3, dtype=I32)),
     errors.DTypeError, "cu_seqlens_q"),
]


@pytest.mark.parametrize("case,over,exc,names", BAD_BWD, ids=[c[0] for c in BAD_BWD])
def test_attn_bwd_check_names_the_argument(case, over, exc, names):
    a = _bwd_args(**over)
    metas = {n: tensor_meta(t) if isinstance(t, torch.Tensor) else t for n, t in a.items()}
    with pytest.raises(exc, match=rf"^({names})\b"):
        _native.attn_bwd_check(*metas.values())
    # the op (fake impl on meta tensors) raises the same error
    with pytest.raises(exc, match=rf"^({names})\b"):
        BWD(*a.values(), 0.1, False, False)
    BWD(*_bwd_args().values(), 0.1, False, False)  # and a valid call still works


def test_attn_bwd_check_strict_layouts():
    """The native check wants stride(-1) == 1 for dout and a contiguous LSE (the op copies both
    first, test_bwd_fake_accepts_any_dout_layout); and CUDA tensors."""
    a = {n: tensor_meta(t) if isinstance(t, torch.Tensor) else t for n, t in _bwd_args().items()}
    bad_dout = tensor_meta(_meta(2, 5, 32, 4).transpose(2, 3))
    with pytest.raises(errors.ArgumentError, match=r"^dout\b.*stride"):
        _native.attn_bwd_check(*{**a, "dout": bad_dout}.values())
    bad_lse = tensor_meta(_meta(2, 5, 4, dtype=F32).transpose(1, 2))
    with pytest.raises(errors.ArgumentError, match=r"^softmax_lse\b"):
        _native.attn_bwd_check(*{**a, "softmax_lse": bad_lse}.values())
    cpu_k = tensor_meta(torch.empty(2, 7, 2, 32, dtype=BF16))
    with pytest.raises(errors.DeviceError, match=r"^k\b"):
        _native.attn_bwd_check(*{**a, "k": cpu_k}.values())


def test_real_bwd_on_cpu_tensors_raises_device_error():
    q, k = torch.randn(2, 5, 4, 32).to(BF16), torch.randn(2, 7, 2, 32).to(BF16)
    lse = torch.zeros(2, 4, 5)
    with pytest.raises(errors.DeviceError):
        BWD(q, q, k, k, q, lse, None, None, 5, 7, 0.1, False, False)


@pytest.mark.parametrize("arg,pos,value", [("softmax_scale", 10, "x"), ("causal", 11, "x"),
                                           ("deterministic", 12, "x"), ("max_seqlen_q", 8, 1.5)])
def test_bwd_schema_errors_name_the_argument(arg, pos, value):
    args = list(_bwd_args().values()) + [0.1, False, False]
    args[pos] = value
    with pytest.raises(RuntimeError, match=arg):
        BWD(*args)


# ---------------------------------------------------------------------------------------------
# autograd wiring on fake / meta tensors
# ---------------------------------------------------------------------------------------------
def _requires_grad(*xs):
    return [x.requires_grad_(True) for x in xs]


@pytest.fixture
def fake_meta():
    """FakeTensorMode with tensors on the meta device: the autograd engine runs the backward
    without a GPU (fake *CUDA* tensors would need a CUDA context for the engine)."""
    with FakeTensorMode() as mode:
        yield mode


CASES = {
    # name: (q shape, k shape, varlen lengths or None)
    "padded": ((2, 5, 4, 64), (2, 7, 4, 64), None),
    "gqa": ((2, 5, 6, 64), (2, 9, 2, 64), None),
    "mqa_sq_gt_sk": ((1, 9, 8, 32), (1, 3, 1, 32), None),
    "head_dim_40": ((2, 5, 4, 40), (2, 7, 2, 40), None),
    "head_dim_36_padded": ((2, 5, 4, 36), (2, 7, 2, 36), None),
    "varlen": ((9, 4, 64), (11, 4, 64), ([4, 5], [5, 6])),
    "varlen_gqa_d40": ((9, 6, 40), (11, 2, 40), ([4, 0, 5], [5, 6, 0])),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_under_fake_tensor_mode(fake_meta, name, causal):
    qs, ks, lens = CASES[name]
    q, k, v = _requires_grad(_meta(*qs), _meta(*ks), _meta(*ks))
    if lens is None:
        out = flash_attn_func(q, k, v, causal=causal)
    else:
        cu_q, cu_k = _meta(len(lens[0]) + 1, dtype=I32), _meta(len(lens[1]) + 1, dtype=I32)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), causal=causal)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and out.requires_grad
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert isinstance(g, FakeTensor) and g.shape == x.shape and g.dtype == x.dtype and g.device == x.device


@pytest.mark.parametrize("varlen", [False, True])
def test_packed_functions_grads_reach_the_packed_tensor(fake_meta, varlen):
    if varlen:
        cu = _meta(3, dtype=I32)
        qkv = _meta(9, 3, 4, 40).requires_grad_(True)
        (g,) = torch.autograd.grad(flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True).sum(), (qkv,))
        q, kv = _requires_grad(_meta(9, 4, 40), _meta(9, 2, 2, 40))
        gq, gkv = torch.autograd.grad(flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 6, 6).sum(), (q, kv))
    else:
        qkv = _meta(2, 5, 3, 4, 40).requires_grad_(True)
        (g,) = torch.autograd.grad(flash_attn_qkvpacked_func(qkv, causal=True).sum(), (qkv,))
        q, kv = _requires_grad(_meta(2, 5, 4, 40), _meta(2, 7, 2, 2, 40))
        gq, gkv = torch.autograd.grad(flash_attn_kvpacked_func(q, kv).sum(), (q, kv))
    assert g.shape == qkv.shape and gq.shape == q.shape and gkv.shape == kv.shape


def test_requires_grad_no_longer_raises_and_only_some_inputs_need_grad():
    q = _meta(2, 5, 4, 32).requires_grad_(True)
    k, v = _meta(2, 7, 2, 32), _meta(2, 7, 2, 32)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad and lse.requires_grad
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert dq.shape == q.shape
    # a loss on the LSE alone runs (its gradient is ignored, as in flash_attn)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    (dq,) = torch.autograd.grad(lse.sum(), (q,))
    assert dq.shape == q.shape
    with torch.no_grad():
        assert not flash_attn_func(q, k, v).requires_grad


def test_fake_cuda_forward_with_requires_grad_records_the_backward():
    # fake CUDA tensors: the forward of every function records the op's backward node (running the
    # backward itself needs a CUDA context for the autograd engine; meta tensors above cover it)
    with FakeTensorMode():
        q, k = _requires_grad(_fake_cuda(2, 5, 4, 40), _fake_cuda(2, 7, 2, 40))
        qkv = _fake_cuda(2, 5, 3, 4, 36).requires_grad_(True)
        cu = torch.empty(3, dtype=I32, device="cuda")
        outs = [flash_attn_func(q, k, k, causal=True), flash_attn_qkvpacked_func(qkv),
                flash_attn_kvpacked_func(q, torch.stack([k, k], dim=2)),
                flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 3, 4, deterministic=True)]
        for out in outs:
            assert out.requires_grad and out.grad_fn is not None


def test_op_called_without_the_deterministic_default():
    q = _meta(2, 5, 4, 32).requires_grad_(True)
    out, lse = FWD(q, q, q, None, None, 5, 5, 0.1, True)  # deterministic left at its default
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_saved_tensors_are_inputs_and_outputs_only():
    """setup_context saves q, k, v, out, softmax_lse (O(b·h·s) beyond the inputs): nothing s×s."""
    q = _meta(2, 64, 4, 32).requires_grad_(True)
    k = _meta(2, 96, 2, 32).requires_grad_(True)
    out, lse, _ = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    node = out.grad_fn
    while node is not None and "attn_fwd" not in type(node).__name__:
        node = node.next_functions[0][0]
    assert node is not None
    saved = [t for t in node.saved_tensors if t is not None]
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([tuple(q.shape), tuple(k.shape), tuple(k.shape), tuple(out.shape), tuple(lse.shape)])


# ---------------------------------------------------------------------------------------------
# torch.compile: one joint graph, the two custom ops, no graph break
# ---------------------------------------------------------------------------------------------
def _capture_backend():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_compile_fullgraph_forward_backward(varlen, deterministic):
    torch._dynamo.reset()
    graphs, backend = _capture_backend()
    if varlen:
        cu = random_cu_seqlens([3, 6], "meta")
        q, k = _requires_grad(_meta(9, 4, 36), _meta(9, 2, 36))

        def f(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, deterministic=deterministic).float().sum()
    else:
        q, k = _requires_grad(_meta(2, 5, 4, 36), _meta(2, 7, 2, 36))

        def f(q, k, v):
            return flash_attn_func(q, k, v, causal=True, deterministic=deterministic).float().sum()

    loss = torch.compile(f, fullgraph=True, backend=backend)(q, k, k)
    loss.backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert len(graphs) == 2  # one forward graph, one backward graph
    fw, bw = graphs
    assert len(_nodes(fw, FWD)) == 1 and not _nodes(fw, BWD)
    (node,) = _nodes(bw, BWD)
    assert not _nodes(bw, FWD)
    assert node.args[12] is deterministic and node.args[11] is True  # deterministic, causal
    fwd_args = _nodes(fw, FWD)[0].args  # a default (deterministic=False) may be left out
    assert (fwd_args[9] if len(fwd_args) > 9 else False) is deterministic


def test_opcheck_meta_with_autograd():
    """Every opcheck utility on meta tensors, with inputs that require grad (so
    test_aot_dispatch_dynamic traces the backward through attn_bwd's fake), for both ops."""
    q, k = _meta(2, 5, 4, 32), _meta(2, 7, 2, 32)
    cu = torch.empty(3, dtype=I32, device="meta")
    lse, lse_v = torch.empty(2, 4, 5, device="meta"), torch.empty(4, 5, device="meta")
    fwd_samples = [
        (q.clone().requires_grad_(), k.clone().requires_grad_(), k.clone().requires_grad_(), None, None, 5, 7, 0.17,
         True, False),
        (q[0].clone().requires_grad_(), k[0].clone().requires_grad_(), k[0].clone().requires_grad_(), cu, cu, 3, 4,
         0.17, False, True),
    ]
    for args in fwd_samples:
        res = torch.library.opcheck(FWD, args)
        assert all(v == "SUCCESS" for v in res.values()), res
    bwd_samples = [(q, q, k, k, q, lse, None, None, 5, 7, 0.17, True, False),
                   (q[0], q[0], k[0], k[0], q[0], lse_v, cu, cu, 3, 4, 0.17, False, True)]
    for args in bwd_samples:
        res = torch.library.opcheck(BWD, args)
        assert all(v == "SUCCESS" for v in res.values()), res


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (8, 8)])
def test_flop_counter_forward_and_backward(causal, sq, sk):
    b, h, d = 2, 6, 64
    q = _meta(b, sq, h, d).requires_grad_(True)
    k = _meta(b, sk, 2, d).requires_grad_(True)
    pairs = fwd_mod.causal_pairs(sq, sk) if causal else sq * sk
    fwd_flops = 4 * b * h * d * pairs
    with FlopCounterMode(display=False) as counter:
        out = flash_attn_func(q, k, k, causal=causal)
        out.backward(torch.empty_like(out))
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.ferroattn.attn_fwd] == fwd_flops
    assert counts[torch.ops.ferroattn.attn_bwd] == fwd_flops * 5 // 2 == 10 * b * h * d * pairs
    assert counter.get_total_flops() == fwd_flops * 7 // 2


def test_bwd_flop_formula_varlen_real_lengths():
    q, k = _meta(10, 4, 32), _meta(14, 4, 32)
    cu_q = torch.tensor([0, 3, 10], dtype=I32)
    cu_k = torch.tensor([0, 6, 14], dtype=I32)
    lse = torch.empty(4, 10, device="meta")
    for causal in (False, True):
        fwd = fwd_mod.attn_fwd_flops(q, k, k, cu_q, cu_k, 7, 8, 0.1, causal)
        bwd = bwd_mod.attn_bwd_flops(q, q, k, k, q, lse, cu_q, cu_k, 7, 8, 0.1, causal, False)
        assert bwd == 5 * fwd // 2 and bwd % 5 == 0 and bwd > 0


# ---------------------------------------------------------------------------------------------
# the whole Python path, numerically, with emulated launchers on CPU tensors
# ---------------------------------------------------------------------------------------------
def _as_cuda_meta(t):
    """tensor_meta of a CPU tensor described as a CUDA tensor, for the real metadata checks."""
    m = tensor_meta(t)
    return None if m is None else (m[0], m[1], m[2], (2, 0))


def _grads_formula(q, k, v, dout, causal, scale):
    """dq, dk, dv of padded attention in fp64 by the closed form the kernels implement
    (FlashAttention-2 §3.2): P = softmax(s·q kᵀ), dV = Pᵀ dO, dP = dO vᵀ, D = rowsum(dO ∘ O),
    dS = P ∘ (dP − D), dQ = s·dS k, dK = s·dSᵀ q; GQA sums dK, dV over each group. No autograd
    (it runs inside the custom op, below the autograd dispatch key)."""
    f = torch.float64
    q, k, v, dout = (x.to(f) for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    visible = ferroattn.testing.visible_mask(q.shape[1], k.shape[1], causal)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1)
    p = torch.softmax(scores.masked_fill(empty[:, None], 0.0), -1).masked_fill(empty[:, None], 0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
    delta = (dout * o).sum(-1).transpose(1, 2)[..., None]  # (b, h, s_q, 1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    b, s_k, h_k, d = k.shape
    dk = dk.reshape(b, s_k, h_k, group, d).sum(3)
    dv = dv.reshape(b, s_k, h_k, group, d).sum(3)
    return dq, dk, dv


def test_grads_formula_matches_autograd_reference():
    torch.manual_seed(7)
    for causal, (sq, sk) in ((False, (5, 7)), (True, (7, 4)), (True, (3, 9))):
        q, k, v = torch.randn(2, sq, 6, 16), torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
        dout = torch.randn(2, sq, 6, 16)
        ref = attention_grads_ref(q, k, v, dout, causal, 0.3, reference_dtype=torch.float64)
        for g, r in zip(_grads_formula(q, k, v, dout, causal, 0.3), ref):
            assert torch.allclose(g, r, atol=1e-10)


class _EmulatedNative:
    """Stands in for ferroattn._native: attn_fwd / attn_bwd run the real metadata validation,
    check what the Python layer hands over (positive scale, workspaces, layouts), then compute the
    result with the fp64 references and write it like the kernels (varlen: only rows inside a
    sequence)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return getattr(_native, name)

    def attn_fwd(self, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, stream):
        _native.attn_fwd_check(*map(_as_cuda_meta, (q, k, v, cu_q, cu_k)), max_q, max_k)
        assert scale > 0 and stream == 0 and not q.requires_grad
        self.calls.append(("fwd", scale))
        f64 = torch.float64
        if cu_q is None:
            o, l = attention_ref(q, k, v, causal, scale, reference_dtype=f64)
            out.copy_(o.to(out.dtype))
            lse.copy_(l)
        else:
            o, l = attention_varlen_ref(q, k, v, cu_q, cu_k, causal, scale, reference_dtype=f64)
            n = int(cu_q[-1])
            out[:n] = o[:n].to(out.dtype)
            lse[:, :n] = l[:, :n]

    def attn_bwd(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_d, dq_accum, cu_q, cu_k, max_q, max_k,
                 scale, causal, deterministic, stream):
        _native.attn_bwd_check(*map(_as_cuda_meta, (dout, q, k, v, out, lse, cu_q, cu_k)), max_q, max_k)
        assert scale > 0 and stream == 0
        assert dout.stride(-1) == 1 and lse.is_contiguous()
        assert softmax_d.dtype == F32 and softmax_d.shape == lse.shape and softmax_d.is_contiguous()
        if deterministic:
            assert dq_accum is None
        else:
            assert dq_accum.dtype == F32 and dq_accum.shape == q.shape and dq_accum.is_contiguous()
        for g, x in ((dq, q), (dk, k), (dv, v)):
            assert g.shape == x.shape and g.dtype == x.dtype and g.stride(-1) == 1
        if cu_q is not None:  # varlen: the Python layer zero-fills, the kernels skip unused rows
            assert all(torch.all(g == 0) for g in (dq, dk, dv))
        self.calls.append(("bwd", scale, deterministic))
        if cu_q is None:
            for g, r in zip((dq, dk, dv), _grads_formula(q, k, v, dout, causal, scale)):
                g.copy_(r.to(g.dtype))
            return
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
            if q1 == q0 and k1 == k0:
                continue
            grads = _grads_formula(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], causal, scale)
            for g, r, (a, z) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
                g[a:z] = r[0].to(g.dtype)


@pytest.fixture
def emulated(monkeypatch):
    stub = _EmulatedNative()
    monkeypatch.setattr(fwd_mod, "_native", stub)
    monkeypatch.setattr(bwd_mod, "_native", stub)
    return stub


def _rand(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def _check_grads(got, q, k, v, dout, causal, scale, cu_q=None, cu_k=None, tol=2e-2):
    """got = (dq, dk, dv) vs the fp64 reference gradients of the same (rounded) inputs."""
    ref = attention_grads_ref(q, k, v, dout, causal, scale, cu_q, cu_k, reference_dtype=torch.float64)
    for name, g, r, x in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item()
        assert err <= tol * max(r.abs().max().item(), 1e-3), (name, err)


@pytest.mark.parametrize("d", [32, 36])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_emulated_padded_gqa_grads(emulated, d, causal, deterministic):
    torch.manual_seed(d)
    q, k, v = _requires_grad(_rand(2, 7, 6, d), _rand(2, 5, 2, d), _rand(2, 5, 2, d))
    out = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    dout = _rand(*out.shape)
    out.backward(dout)
    scale = d ** -0.5
    _check_grads((q.grad, k.grad, v.grad), q, k, v, dout, causal, scale)
    assert [c[0] for c in emulated.calls] == ["fwd", "bwd"] and emulated.calls[1][2] is deterministic
    if causal:  # s_q > s_k: the first two rows see no key
        assert torch.all(q.grad[:, :2] == 0)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_emulated_non_positive_scale_gradients_are_exact(emulated, scale):
    """The kernels need scale > 0: s < 0 runs with (−q, −s) and negates dq; s == 0 runs with
    (0, 1) and returns dq = 0. The gradients must be those of the user's (q, s)."""
    torch.manual_seed(1)
    q, k, v = _requires_grad(_rand(2, 6, 4, 32), _rand(2, 8, 4, 32), _rand(2, 8, 4, 32))
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    dout = _rand(*out.shape)
    out.backward(dout)
    assert all(c[1] > 0 for c in emulated.calls)
    _check_grads((q.grad, k.grad, v.grad), q, k, v, dout, True, scale)
    if scale == 0.0:
        assert torch.all(q.grad == 0) and torch.all(k.grad == 0) and v.grad.abs().max() > 0
    else:
        assert q.grad.abs().max() > 0


def test_emulated_varlen_grads_and_unused_rows(emulated):
    torch.manual_seed(2)
    lq, lk = [3, 0, 5, 1], [4, 2, 0, 3]  # an empty q sequence, an empty k sequence (rows see no key)
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    q, k, v = _requires_grad(_rand(sum(lq) + 2, 4, 32), _rand(sum(lk) + 1, 2, 32), _rand(sum(lk) + 1, 2, 32))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    dout = _rand(*out.shape)
    out.backward(dout)
    n_q, n_k = sum(lq), sum(lk)
    _check_grads((q.grad[:n_q], k.grad[:n_k], v.grad[:n_k]), q[:n_q], k[:n_k], v[:n_k], dout[:n_q], True,
                 32 ** -0.5, cu_q, cu_k)
    # rows after the last sequence: zero gradient (zero-filled before the kernels run)
    assert torch.all(q.grad[n_q:] == 0) and torch.all(k.grad[n_k:] == 0) and torch.all(v.grad[n_k:] == 0)
    # the q rows of the sequence with no keys (sequence 2, rows 3..8): dq exactly 0; others not
    assert torch.all(q.grad[3:8] == 0) and q.grad[:3].abs().max() > 0 and q.grad[8].abs().max() > 0


@pytest.mark.parametrize("varlen", [False, True])
def test_emulated_packed_views_and_grad_out_layouts(emulated, varlen):
    torch.manual_seed(3)
    if varlen:
        cu = random_cu_seqlens([3, 5])
        qkv = _rand(8, 3, 4, 40).requires_grad_(True)
        out = flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
        args = (qkv[:, 0], qkv[:, 1], qkv[:, 2])
    else:
        qkv = _rand(2, 6, 3, 4, 40).requires_grad_(True)
        out = flash_attn_qkvpacked_func(qkv, causal=True)
        args = (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        cu = None
    # grad_out with a non-contiguous last dim (copied by the op) and then all-zero strides (sum())
    dout_base = _rand(*out.shape[:-1], 80)
    dout = dout_base[..., ::2]
    (g,) = torch.autograd.grad(out, qkv, dout, retain_graph=True)
    refs = attention_grads_ref(*args, dout, True, 40 ** -0.5, cu, cu, reference_dtype=torch.float64)
    ref = torch.stack(refs, dim=-3)
    assert g.shape == qkv.shape
    assert (g.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    (g_sum,) = torch.autograd.grad(out.sum(), qkv)
    ones = torch.ones_like(out)
    ref = torch.stack(attention_grads_ref(*args, ones, True, 40 ** -0.5, cu, cu, reference_dtype=torch.float64),
                      dim=-3)
    assert (g_sum.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_emulated_transposed_views_and_kvpacked(emulated):
    torch.manual_seed(4)
    qt = _rand(2, 4, 6, 64).transpose(1, 2).requires_grad_(True)  # (b, s, h, d) view of (b, h, s, d)
    kv = _rand(2, 9, 2, 2, 64).requires_grad_(True)
    out = flash_attn_kvpacked_func(qt, kv, causal=True)
    assert out.stride() == qt.stride()
    dout = _rand(2, 4, 6, 64).transpose(1, 2)
    gq, gkv = torch.autograd.grad(out, (qt, kv), dout)
    assert gq.shape == qt.shape and gkv.shape == kv.shape
    ref = attention_grads_ref(qt, kv[:, :, 0], kv[:, :, 1], dout, True, 64 ** -0.5, reference_dtype=torch.float64)
    got = (gq, gkv[:, :, 0], gkv[:, :, 1])
    for g, r in zip(got, ref):
        assert (g.double() - r).abs().max() <= 2e-2 * max(r.abs().max().item(), 1e-3)


def test_emulated_lse_gradient_is_ignored(emulated):
    torch.manual_seed(5)
    q = _rand(1, 4, 2, 32).requires_grad_(True)
    out, lse, _ = flash_attn_func(q, q.detach(), q.detach(), return_attn_probs=True)
    (g,) = torch.autograd.grad(lse.sum(), q)
    assert torch.all(g == 0)


def test_emulated_deterministic_flag_reaches_the_kernel_via_every_function(emulated):
    torch.manual_seed(6)
    cu = random_cu_seqlens([2, 3])
    calls = [
        lambda: flash_attn_func(*_requires_grad(_rand(1, 3, 2, 32), _rand(1, 3, 2, 32), _rand(1, 3, 2, 32)),
                                deterministic=True),
        lambda: flash_attn_qkvpacked_func(_rand(1, 3, 3, 2, 32).requires_grad_(), deterministic=True),
        lambda: flash_attn_kvpacked_func(*_requires_grad(_rand(1, 3, 2, 32), _rand(1, 3, 2, 2, 32)),
                                         deterministic=True),
        lambda: flash_attn_varlen_func(*_requires_grad(_rand(5, 2, 32), _rand(5, 2, 32), _rand(5, 2, 32)), cu, cu, 3,
                                       3, deterministic=True),
        lambda: flash_attn_varlen_qkvpacked_func(_rand(5, 3, 2, 32).requires_grad_(), cu, 3, deterministic=True),
        lambda: flash_attn_varlen_kvpacked_func(*_requires_grad(_rand(5, 2, 32), _rand(5, 2, 2, 32)), cu, cu, 3, 3,
                                                deterministic=True),
    ]
    for call in calls:
        call().float().sum().backward()
    bwd = [c for c in emulated.calls if c[0] == "bwd"]
    assert len(bwd) == 6 and all(c[2] is True for c in bwd)


def test_public_names():
    assert callable(ferroattn.ops.attention_bwd.attn_bwd)
    assert "index_first_axis" in ferroattn.bert_padding.__all__
