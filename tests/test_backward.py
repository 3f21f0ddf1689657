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
from ferroattn.ops.variant import AttnVariant
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
                                           ("deterministic", 12, "x"), ("max_seqlen_q", 8, 1.5),
                                           ("window_left", 13, 1.5), ("window_right", 14, "x"),
                                           ("softcap", 15, "x"), ("alibi_slopes", 16, 3), ("sinks", 17, [1.0])])
def test_bwd_schema_errors_name_the_argument(arg, pos, value):
    args = list(_bwd_args().values()) + [0.1, False, False, -1, -1, 0.0, None, None]
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


def _variant_visible(s_q, s_k, causal, window=(-1, -1)):
    """bool (s_q, s_k): the keys a row sees under an already normalised variant, as the kernels
    read it (ferroattn.ops.variant: [i + s_k − s_q − left, i + s_k − s_q + right], −1 = an
    unbounded side, causal forcing right = 0)."""
    left, right = window
    if causal:
        right = 0
    row = torch.arange(s_q)[:, None]
    col = torch.arange(s_k)[None, :]
    diag = row + s_k - s_q
    visible = torch.ones(s_q, s_k, dtype=torch.bool)
    if right >= 0:
        visible &= col <= diag + right
    if left >= 0:
        visible &= col >= diag - left
    return visible


def _variant_forward(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, alibi=None, sinks=None):
    """Padded attention in fp64 as the kernels compute it (ferroattn.ops.variant semantics):
    returns (out, lse, p, tanh) with p (b, h, s_q, s_k) the probabilities (sink column dropped),
    tanh the softcap's tanh(s / c) (None without softcap). GQA by repeat_interleave."""
    f = torch.float64
    q, k, v = (x.to(f) for x in (q, k, v))
    b, s_q, h, _ = q.shape
    s_k = k.shape[1]
    group = h // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    if alibi is not None:
        slopes = alibi.to(f).reshape(-1 if alibi.dim() == 2 else 1, h, 1, 1)
        dist = (torch.arange(s_q)[:, None] + s_k - s_q - torch.arange(s_k)[None, :]).abs().to(f)
        scores = scores - slopes * dist
    visible = _variant_visible(s_q, s_k, causal, window)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1)
    if sinks is not None:
        sink = sinks.to(f).reshape(1, h, 1, 1).expand(b, h, s_q, 1)
        full = torch.cat([scores, sink], dim=-1)
        lse = torch.logsumexp(full, dim=-1)
        p = torch.exp(scores - lse[..., None])
    else:
        lse = torch.logsumexp(scores, dim=-1).masked_fill(empty, float("inf"))
        p = torch.softmax(scores.masked_fill(empty[:, None], 0.0), -1).masked_fill(empty[:, None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    return out, lse, p, tanh


def _grads_formula(q, k, v, dout, causal, scale, *, window=(-1, -1), softcap=0.0, alibi=None, sinks=None):
    """dq, dk, dv of padded attention in fp64 by the closed form the kernels implement
    (FlashAttention-2 §3.2): P = softmax(S) (S = s·q kᵀ, softcapped, minus the ALiBi bias, masked;
    the sink logit joins the denominator only), dV = Pᵀ dO, dP = dO vᵀ, D = rowsum(dO ∘ O),
    dS = P ∘ (dP − D) (times 1 − tanh² with softcap), dQ = s·dS k, dK = s·dSᵀ q; GQA sums dK, dV
    over each group. No autograd (it runs inside the custom op, below the autograd dispatch key).
    The variant arguments are the normalised ones the native launchers receive."""
    f = torch.float64
    out, _, p, tanh = _variant_forward(q, k, v, causal, scale, window, softcap, alibi, sinks)
    q, k, v, dout = (x.to(f) for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
    delta = (dout * out).sum(-1).transpose(1, 2)[..., None]  # (b, h, s_q, 1)
    ds = p * (dp - delta)
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
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


@pytest.mark.parametrize("causal,window,softcap,alibi,sinks", [
    (False, (2, 1), 0.0, None, None), (True, (3, 0), 0.0, None, None), (False, (-1, -1), 1.5, None, None),
    (False, (-1, -1), 0.0, "h", None), (True, (-1, -1), 0.0, "bh", None), (True, (-1, -1), 0.0, None, "sinks"),
    (False, (1, 2), 2.0, "bh", "sinks"), (False, (1, -1), 0.0, None, "sinks"), (False, (-1, 2), 0.5, "h", None),
])
def test_variant_formula_matches_autograd_reference(causal, window, softcap, alibi, sinks):
    """The emulation's closed form (given the normalised window, as the launchers are) against
    ferroattn.testing (autograd through the reference, given the caller's window), s_q > s_k
    included (rows that see no key)."""
    torch.manual_seed(8)
    for sq, sk in ((5, 7), (7, 6), (6, 6), (8, 3)):
        q, k, v = torch.randn(2, sq, 6, 16), torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
        dout = torch.randn(2, sq, 6, 16)
        slopes = {None: None, "h": torch.rand(6), "bh": torch.rand(2, 6)}[alibi]
        s_aux = torch.randn(6) if sinks else None
        kw = dict(window_size=window, softcap=softcap, alibi_slopes=slopes, s_aux=s_aux)
        ref = attention_grads_ref(q, k, v, dout, causal, 0.3, reference_dtype=torch.float64, **kw)
        nv = AttnVariant.from_flash_attn(causal, window, softcap, slopes, None, sq, sk)
        window_n = (nv.window_left, nv.window_right)
        got = _grads_formula(q, k, v, dout, nv.causal, 0.3, window=window_n, softcap=softcap, alibi=slopes,
                             sinks=s_aux)
        for g, r in zip(got, ref[:3]):
            assert torch.allclose(g, r, atol=1e-10)
        o, lse, _, _ = _variant_forward(q, k, v, nv.causal, 0.3, window_n, softcap, slopes, s_aux)
        o_ref, lse_ref = attention_ref(q, k, v, causal, 0.3, reference_dtype=torch.float64, **kw)
        assert torch.allclose(o, o_ref, atol=1e-10) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        assert torch.allclose(lse.float().nan_to_num(posinf=0), lse_ref.nan_to_num(posinf=0), atol=1e-5)


def _cuda_variant(variant):
    """The variant with its tensors described as CUDA metadata (for the real metadata checks)."""
    import dataclasses
    return dataclasses.replace(variant, alibi_slopes=_as_cuda_meta(variant.alibi_slopes),
                               sinks=_as_cuda_meta(variant.sinks))


class _EmulatedNative:
    """Stands in for ferroattn._native: attn_fwd / attn_bwd run the real metadata validation
    (variant included), check what the Python layer hands over (positive scale, workspaces,
    layouts, the variant with detached fp32 tensors), then compute the result with the fp64
    closed forms and write it like the kernels (varlen: only rows inside a sequence). ``calls``
    records ("fwd", scale) / ("bwd", scale, deterministic), ``variants`` the variant of each call."""

    def __init__(self):
        self.calls = []
        self.variants = []

    def __getattr__(self, name):
        return getattr(_native, name)

    def _check_variant(self, variant):
        assert isinstance(variant, AttnVariant)
        for t in (variant.alibi_slopes, variant.sinks):
            assert t is None or (t.dtype == F32 and not t.requires_grad)
        self.variants.append(variant)

    @staticmethod
    def _kw(variant, i=None):
        """The closed forms' variant arguments (sequence i of a varlen call: its ALiBi row)."""
        alibi = variant.alibi_slopes
        if alibi is not None and i is not None and alibi.dim() == 2:
            alibi = alibi[i]
        return dict(window=(variant.window_left, variant.window_right), softcap=variant.softcap, alibi=alibi,
                    sinks=variant.sinks)

    def attn_fwd(self, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, variant, stream):
        _native.attn_fwd_check(*map(_as_cuda_meta, (q, k, v, cu_q, cu_k)), max_q, max_k, _cuda_variant(variant))
        assert scale > 0 and stream == 0 and not q.requires_grad
        self._check_variant(variant)
        self.calls.append(("fwd", scale))
        if cu_q is None:
            o, l, _, _ = _variant_forward(q, k, v, variant.causal, scale, **self._kw(variant))
            out.copy_(o.to(out.dtype))
            lse.copy_(l)
            return
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
            if q1 == q0:
                continue
            o, l, _, _ = _variant_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], variant.causal, scale,
                                          **self._kw(variant, i))
            out[q0:q1] = o[0].to(out.dtype)
            lse[:, q0:q1] = l[0]

    def attn_bwd(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_d, dq_accum, cu_q, cu_k, max_q, max_k,
                 scale, variant, deterministic, stream):
        _native.attn_bwd_check(*map(_as_cuda_meta, (dout, q, k, v, out, lse, cu_q, cu_k)), max_q, max_k,
                               _cuda_variant(variant))
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
        self._check_variant(variant)
        self.calls.append(("bwd", scale, deterministic))
        if cu_q is None:
            for g, r in zip((dq, dk, dv), _grads_formula(q, k, v, dout, variant.causal, scale, **self._kw(variant))):
                g.copy_(r.to(g.dtype))
            return
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
            if q1 == q0 and k1 == k0:
                continue
            grads = _grads_formula(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], variant.causal,
                                   scale, **self._kw(variant, i))
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


_VARIANTS = {
    "window": dict(window_size=(2, 1)),
    "window_left_only": dict(window_size=(1, -1), s_aux=F32),   # right side bounded at s_k (flash_attn)
    "causal_window": dict(causal=True, window_size=(3, 5)),
    "softcap": dict(softcap=1.5),
    "alibi_h": dict(alibi_slopes="h"),
    "alibi_bh_causal": dict(causal=True, alibi_slopes="bh"),
    "sinks_causal": dict(causal=True, s_aux=F32),
    "sinks_bf16": dict(s_aux=BF16),
    "everything": dict(causal=True, window_size=(2, 0), softcap=3.0, alibi_slopes="bh", s_aux=F32),
}


def _variant_kwargs(name, b, h):
    """The flash_attn keyword arguments of ``_VARIANTS[name]`` with its tensors made: ALiBi slopes
    (h,) or (b, h) fp32 in [0.1, 1), sinks (h,) that require grad."""
    kw = dict(_VARIANTS[name])
    if "alibi_slopes" in kw:
        shape = (h,) if kw["alibi_slopes"] == "h" else (b, h)
        kw["alibi_slopes"] = 0.1 + 0.9 * torch.rand(shape)
    if "s_aux" in kw:
        kw["s_aux"] = torch.randn(h).to(kw["s_aux"]).requires_grad_(True)
    return kw


def _ref_kwargs(kw):
    return dict(causal=kw.get("causal", False), window_size=kw.get("window_size", (-1, -1)),
                softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"), s_aux=kw.get("s_aux"))


def _close(got, ref, name, tol=2e-2):
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(ref.abs().max().item(), 1e-3), (name, err)


@pytest.mark.parametrize("name", sorted(_VARIANTS))
@pytest.mark.parametrize("sq,sk,d", [(7, 5, 32), (5, 9, 36)])
def test_emulated_variant_grads(emulated, name, sq, sk, d):
    """The variant through the whole Python path (normalisation, op, autograd formula, the sinks'
    gradient) with the launchers emulated: out, dq, dk, dv and ds_aux equal ferroattn.testing's
    references of the caller's arguments."""
    torch.manual_seed(sq * 100 + d)
    q, k, v = _requires_grad(_rand(2, sq, 6, d), _rand(2, sk, 2, d), _rand(2, sk, 2, d))
    kw = _variant_kwargs(name, 2, 6)
    out = flash_attn_func(q, k, v, **kw)
    dout = _rand(*out.shape)
    out.backward(dout)
    rk = _ref_kwargs(kw)
    causal = rk.pop("causal")
    o_ref, _ = attention_ref(q, k, v, causal, reference_dtype=torch.float64, **rk)
    _close(out, o_ref, "out")
    refs = attention_grads_ref(q, k, v, dout, causal, d ** -0.5, reference_dtype=torch.float64, **rk)
    for gname, g, r, x in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and torch.isfinite(g).all(), gname
        _close(g, r, gname)
    if kw.get("s_aux") is not None:
        s_aux = kw["s_aux"]
        assert s_aux.grad is not None and s_aux.grad.shape == (6,) and s_aux.grad.dtype == s_aux.dtype
        _close(s_aux.grad, refs[3], "ds_aux", tol=4e-2 if s_aux.dtype == BF16 else 2e-2)
    # what the launchers received: the normalised variant, the same in the forward and the backward
    fwd, bwd = emulated.variants
    window = kw.get("window_size", (-1, -1))
    want = AttnVariant.from_flash_attn(causal, window, kw.get("softcap", 0.0), kw.get("alibi_slopes"), None, sq, sk)
    for got in (fwd, bwd):
        assert (got.causal, got.window_left, got.window_right, got.softcap) == \
            (want.causal, want.window_left, want.window_right, want.softcap)
        assert got.alibi_slopes is kw.get("alibi_slopes")  # fp32, no grad: passed as it is
        assert (got.sinks is None) == (kw.get("s_aux") is None)
    if causal and sq > sk:  # rows 0..sq-sk-1 see no key: dq exactly 0 (also with sinks)
        assert torch.all(q.grad[:, :sq - sk] == 0)


def test_emulated_variant_negative_scale_and_deterministic(emulated):
    torch.manual_seed(11)
    q, k, v = _requires_grad(_rand(2, 6, 4, 32), _rand(2, 8, 4, 32), _rand(2, 8, 4, 32))
    kw = dict(window_size=(2, 2), softcap=2.0, alibi_slopes=torch.rand(4), s_aux=torch.randn(4).requires_grad_(True))
    out = flash_attn_func(q, k, v, softmax_scale=-0.3, deterministic=True, **kw)
    dout = _rand(*out.shape)
    out.backward(dout)
    assert all(c[1] > 0 for c in emulated.calls) and emulated.calls[1][2] is True
    rk = _ref_kwargs(kw)
    rk.pop("causal")
    refs = attention_grads_ref(q, k, v, dout, False, -0.3, reference_dtype=torch.float64, **rk)
    for gname, g, r in zip(("dq", "dk", "dv", "ds_aux"), (q.grad, k.grad, v.grad, kw["s_aux"].grad), refs):
        _close(g, r, gname)


def test_emulated_varlen_variant_grads_and_unused_rows(emulated):
    torch.manual_seed(12)
    lq, lk = [3, 0, 5, 1], [4, 2, 0, 3]  # an empty q sequence, an empty k sequence (rows see no key)
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    q, k, v = _requires_grad(_rand(sum(lq) + 2, 4, 32), _rand(sum(lk) + 1, 2, 32), _rand(sum(lk) + 1, 2, 32))
    slopes = 0.1 + torch.rand(4, 4)
    s_aux = torch.randn(4).requires_grad_(True)
    kw = dict(window_size=(1, 1), softcap=2.5, alibi_slopes=slopes, s_aux=s_aux)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
    dout = _rand(*out.shape)
    out.backward(dout)
    n_q, n_k = sum(lq), sum(lk)
    o_ref, _ = attention_varlen_ref(q[:n_q], k[:n_k], v[:n_k], cu_q, cu_k, reference_dtype=torch.float64,
                                    max_seqlen_k=max(lk), **kw)
    _close(out[:n_q], o_ref, "out")
    refs = attention_grads_ref(q[:n_q], k[:n_k], v[:n_k], dout[:n_q], False, 32 ** -0.5, cu_q, cu_k,
                               reference_dtype=torch.float64, max_seqlen_k=max(lk), **kw)
    for gname, g, r in zip(("dq", "dk", "dv", "ds_aux"), (q.grad[:n_q], k.grad[:n_k], v.grad[:n_k], s_aux.grad), refs):
        _close(g, r, gname)
    # rows after the last sequence: zero gradient, and they do not reach ds_aux (checked above)
    assert torch.all(q.grad[n_q:] == 0) and torch.all(k.grad[n_k:] == 0) and torch.all(v.grad[n_k:] == 0)
    assert torch.all(q.grad[3:8] == 0)  # the sequence without keys


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


# ---------------------------------------------------------------------------------------------
# the sanitizer scripts' variant cases, on CPU with the emulated launchers
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def sanitize_cpu(emulated, monkeypatch):
    """scripts/sanitize_attention.py and sanitize_attention_bwd.py with DEVICE = "cpu": their
    variant cases run through the whole Python path against the emulated launchers."""
    from _scripts import load_script
    fwd, bwd = load_script("sanitize_attention"), load_script("sanitize_attention_bwd")
    monkeypatch.setattr(fwd, "DEVICE", "cpu")
    monkeypatch.setattr(bwd, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    torch.manual_seed(0)
    return fwd, bwd, emulated


def _small(case):
    """A varlen case of many sequences cut to 1003 of them (still the grouped reference's path)."""
    if isinstance(case[1], list) and len(case[1]) > 1003:
        return (case[0], case[1][:1003], case[2][:1003]) + tuple(case[3:])
    return case


def test_sanitize_variant_cases_cover_the_variants(sanitize_cpu):
    fwd, bwd, _ = sanitize_cpu
    for mod in (fwd, bwd):
        names = " ".join(n for n, _, _ in mod.variant_cases())
        for needle in ("window-skips-key-tiles", "softcap", "alibi", "sinks", "varlen", "batch-65537"):
            assert needle in names, (mod.__name__, needle)
        base = mod.cases() + mod.variant_cases()
        extra = [c[0] for c in getattr(mod, "DROPOUT_MASK_WARPS_CASES", [])]
        assert [n for n, _, _ in mod.all_cases()] == [n for n, _, _ in base + fwd.candidate_cases(base, mod.CANDIDATE_FORMS)] + extra
    assert bwd.DROPOUT_MASK_WARPS_CASES
    assert any(v.get("window_size", (-1, -1))[1] == -1 for *_, v in fwd.VARIANT_PADDED_CASES)  # left side only
    assert any(det for *_, det, _ in bwd.VARIANT_PADDED_CASES)
    # a batch split over two launches (the grid holds 65535)
    assert all(c[1] == 65537 for c in fwd.VARIANT_PADDED_CASES + bwd.VARIANT_PADDED_CASES if "batch" in c[0])
    assert all(len(c[1]) == len(c[2]) == 65537 for c in fwd.VARIANT_VARLEN_CASES if "batch" in c[0])


def test_sanitize_forward_variant_checks_pass_with_a_correct_implementation(sanitize_cpu):
    fwd, _, emulated = sanitize_cpu
    for name, fn, case in fwd.variant_cases():
        msg = fn(_small(case))
        assert "lse ok" in msg, name
    assert any(v.sinks is not None for v in emulated.variants) and any(v.alibi_slopes is not None
                                                                      for v in emulated.variants)


def test_sanitize_backward_variant_checks_pass_with_a_correct_implementation(sanitize_cpu):
    _, bwd, _ = sanitize_cpu
    for name, fn, case in bwd.variant_cases():
        msg = fn(_small(case))
        assert "dq" in msg and "dk" in msg and "dv" in msg, name
        assert ("ds_aux" in msg) == bool(case[-1].get("sinks")), name
        assert ("bitwise equal twice" in msg) == case[-2], name


@pytest.mark.parametrize("drop", ["window", "softcap", "alibi", "sinks"])
def test_sanitize_variant_checks_catch_a_dropped_option(sanitize_cpu, monkeypatch, drop):
    """A launcher that ignores one option of the variant fails the case that uses it."""
    import dataclasses
    fwd, bwd, emulated = sanitize_cpu
    field = {"window": dict(window_left=-1, window_right=-1), "softcap": dict(softcap=0.0),
             "alibi": dict(alibi_slopes=None), "sinks": dict(sinks=None)}[drop]
    real_fwd, real_bwd = emulated.attn_fwd, emulated.attn_bwd
    monkeypatch.setattr(emulated, "attn_fwd", lambda *a: real_fwd(*a[:10], dataclasses.replace(a[10], **field), a[11]))
    monkeypatch.setattr(emulated, "attn_bwd", lambda *a: real_bwd(*a[:16], dataclasses.replace(a[16], **field),
                                                                   *a[17:]))
    fcase = next(c for c in fwd.VARIANT_PADDED_CASES if (drop == "window" and "window_size" in c[-1])
                 or c[-1].get(drop))
    with pytest.raises(AssertionError, match=r"max\|(out|lse) - ref\|"):
        fwd.run_case_variant_padded(fcase)
    bcase = next(c for c in bwd.VARIANT_PADDED_CASES if (drop == "window" and "window_size" in c[-1])
                 or c[-1].get(drop))
    with pytest.raises(AssertionError, match=r"max\|out - ref\|"):
        bwd.run_case_variant_padded(bcase)


def test_sanitize_candidate_cases_run_their_case_under_the_knobs(sanitize_cpu):
    """Every candidate form names existing cases; a candidate case runs its case with the knobs
    set and restores them after, also when the case fails."""
    import ferroattn._native as native
    fwd, bwd, _ = sanitize_cpu
    for mod in (fwd, bwd):
        names = [n for n, _, _ in mod.all_cases()]
        assert len(names) == len(set(names)), mod.__name__
        assert sum("@" in n for n in names) == sum(len(c) for _, c in mod.CANDIDATE_FORMS)
    with pytest.raises(KeyError, match="no-such-case"):
        fwd.candidate_cases(fwd.cases(), [({"attn_sm90_fwd_d192": "1"}, ["no-such-case"])])
    before = native.tuning_knobs()
    seen = []

    def inner(c):
        seen.append((c, native.tuning_knobs()["attn_sm90_fwd_persistent"]))
        if c == "boom":
            raise RuntimeError("boom")
        return "ok"
    base = [("a", inner, "a"), ("boom", inner, "boom")]
    cand = fwd.candidate_cases(base, [({"attn_sm90_fwd_persistent": "1"}, ["a", "boom"])])
    assert [n for n, _, _ in cand] == ["a@attn_sm90_fwd_persistent=1", "boom@attn_sm90_fwd_persistent=1"]
    assert cand[0][1](cand[0][2]) == "ok"
    with pytest.raises(RuntimeError, match="boom"):
        cand[1][1](cand[1][2])
    assert seen == [("a", "1"), ("boom", "1")] and native.tuning_knobs() == before
    # the forms' variant cases pass the emulated checks under their knobs
    for name, fn, case in fwd.all_cases():
        if "@" in name and case[1] in (fwd.run_case_variant_padded, fwd.run_case_variant_varlen):
            assert "lse ok" in fn((case[0], case[1], _small(case[2]))), name
    assert native.tuning_knobs() == before


def test_sanitize_grouped_varlen_reference_is_the_varlen_reference():
    from _scripts import load_script
    fwd = load_script("sanitize_attention")
    torch.manual_seed(3)
    lq, lk = [2, 1, 3] * 5 + [2, 2, 0], [3, 3, 1] * 5 + [0, 4, 2]
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    q, k, v = torch.randn(sum(lq), 2, 16), torch.randn(sum(lk), 1, 16), torch.randn(sum(lk), 1, 16)
    kw = dict(causal=True, window_size=(1, 1), alibi_slopes=torch.rand(len(lq), 2), s_aux=torch.randn(2))
    for upcast in (True, False):
        got = fwd._grouped_varlen_ref(q, k, v, lq, lk, kw, upcast)
        want = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, max_seqlen_k=max(lk), **kw)
        assert torch.allclose(got[0].float(), want[0].float(), atol=1e-6) and torch.equal(got[1], want[1])
