"""The custom op under fake/meta tensors: output shapes, dtypes and strides; torch.compile tracing
without graph breaks; FLOP counting; the backward runs on meta tensors (more in test_backward.py)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import ferroattn
from ferroattn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ferroattn.ops.attention import causal_pairs

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_op_shapes_padded(fake, dtype):
    q, k = _cuda(3, 5, 6, 64, dtype=dtype), _cuda(3, 9, 2, 64, dtype=dtype)
    out, lse = torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 9, 0.125, True)
    assert out.shape == q.shape and out.dtype == dtype and out.stride() == q.stride()
    assert out.device == q.device
    assert lse.shape == (3, 6, 5) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_op_shapes_varlen(fake):
    q, k = _cuda(17, 8, 128), _cuda(23, 1, 128)
    cu_q = torch.empty(4, dtype=torch.int32, device="cuda")
    out, lse = torch.ops.ferroattn.attn_fwd(q, k, k, cu_q, cu_q, 9, 12, 0.1, False)
    assert out.shape == (17, 8, 128) and out.stride() == q.stride()
    assert lse.shape == (8, 17) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_out_keeps_q_stride_order(fake):
    # q as a transposed view of a (b, h, s, d) tensor: out must have the same strides
    q = _cuda(2, 6, 5, 64).transpose(1, 2)
    k = _cuda(2, 2, 7, 64).transpose(1, 2)
    assert not q.is_contiguous()
    out = flash_attn_func(q, k, k)
    assert out.shape == q.shape and out.stride() == q.stride()
    # lse is always contiguous (b, h, s_q)
    _, lse, s_dmask = flash_attn_func(q, k, k, return_attn_probs=True)
    assert lse.shape == (2, 6, 5) and lse.is_contiguous()
    assert s_dmask.shape == (0,) and s_dmask.dtype == BF16


def test_packed_views_are_not_copied(fake):
    qkv = _cuda(2, 5, 3, 4, 64)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    # out = empty_like(q view): q is not dense, so empty_like gives the dense (b, s, h, d) layout
    assert out.shape == (2, 5, 4, 64) and out.stride() == (5 * 4 * 64, 4 * 64, 64, 1)
    kv = _cuda(2, 7, 2, 2, 64)
    out = flash_attn_kvpacked_func(_cuda(2, 5, 4, 64), kv)
    assert out.shape == (2, 5, 4, 64)
    qkv_v = _cuda(12, 3, 4, 64)
    cu = torch.empty(3, dtype=torch.int32, device="cuda")
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv_v, cu, 7, return_attn_probs=True)
    assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
    out = flash_attn_varlen_kvpacked_func(_cuda(12, 4, 64), _cuda(15, 2, 1, 64), cu, cu, 7, 8)
    assert out.shape == (12, 4, 64)


@pytest.mark.parametrize("d", [8, 36, 100, 255, 256])
def test_head_dim_padding(fake, d):
    q, k = _cuda(2, 5, 4, d), _cuda(2, 7, 2, d)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == (2, 5, 4, d) and lse.shape == (2, 4, 5)


def test_meta_tensors():
    q = torch.empty(2, 5, 6, 40, dtype=BF16, device="meta")
    k = torch.empty(2, 7, 2, 40, dtype=BF16, device="meta")
    out, lse = torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 7, 0.1, True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 6, 5)
    out = flash_attn_func(q[..., :36], k[..., :36], k[..., :36])  # d = 36 -> padded to 40
    assert out.shape == (2, 5, 6, 36)


# ---- torch.compile ------------------------------------------------------------------------
class _CountingBackend:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _ops_in(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_fake_cuda(fake, varlen):
    torch._dynamo.reset()
    backend = _CountingBackend()
    if varlen:
        q, k = _cuda(17, 8, 36), _cuda(23, 2, 36)
        cu_q = torch.empty(4, dtype=torch.int32, device="cuda")

        def f(q, k, v, cu):
            return flash_attn_varlen_func(q, k, v, cu, cu, 9, 12, causal=True) * 2

        args = (q, k, k, cu_q)
    else:
        q, k = _cuda(2, 5, 6, 36).transpose(1, 2).transpose(1, 2), _cuda(2, 7, 2, 36)

        def f(q, k, v):
            return flash_attn_func(q, k, v, causal=True) * 2

        args = (q, k, k)
    out = torch.compile(f, fullgraph=True, backend=backend)(*args)
    assert out.shape == args[0].shape
    assert len(backend.graphs) == 1
    assert torch.ops.ferroattn.attn_fwd.default in _ops_in(backend.graphs[0])


def test_compile_dynamic_shapes_one_graph(fake):
    torch._dynamo.reset()
    backend = _CountingBackend()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, dynamic=True,
                      backend=backend)
    for s in (5, 9, 17):
        q, k = _cuda(2, s, 4, 64), _cuda(2, s + 3, 2, 64)
        assert f(q, k, k).shape == q.shape
    assert len(backend.graphs) == 1  # symbolic lengths: no recompilation per length
    assert torch.ops.ferroattn.attn_fwd.default in _ops_in(backend.graphs[0])


def test_compile_aot_eager_meta():
    torch._dynamo.reset()
    q = torch.empty(2, 5, 6, 64, dtype=BF16, device="meta")
    k = torch.empty(2, 7, 2, 64, dtype=BF16, device="meta")
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    assert f(q, k, k).shape == q.shape


def test_compile_rejects_bad_input_at_trace_time(fake):
    torch._dynamo.reset()
    q, k = _cuda(2, 5, 6, 32, dtype=torch.float32), _cuda(2, 7, 2, 32, dtype=torch.float32)
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(q, k, k)
    # dynamo wraps the error raised inside the fake impl; the DTypeError must be in the chain
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, ferroattn.DTypeError) for x in chain) or "DTypeError" in str(info.value), chain


def test_opcheck_meta():
    # on meta tensors every opcheck utility runs without a GPU (the GPU variant is in test_gpu.py)
    q = torch.empty(2, 5, 4, 32, dtype=BF16, device="meta")
    k = torch.empty(2, 7, 2, 32, dtype=BF16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    for args in [(q, k, k, None, None, 5, 7, 0.17, True), (q[0], k[0], k[0], cu, cu, 3, 4, 0.17, False)]:
        res = torch.library.opcheck(torch.ops.ferroattn.attn_fwd.default, args)
        assert all(v == "SUCCESS" for v in res.values()), res


# ---- FLOPs --------------------------------------------------------------------------------
def _brute_pairs(sq, sk):
    return sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)


@pytest.mark.parametrize("sq,sk", [(1, 1), (2, 5), (5, 2), (7, 7), (3, 11), (11, 3), (1, 9), (9, 1)])
def test_causal_pairs_formula(sq, sk):
    assert causal_pairs(sq, sk) == _brute_pairs(sq, sk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (8, 8)])
def test_flop_counter_padded(fake, causal, sq, sk):
    b, h, d = 2, 6, 64
    q, k = _cuda(b, sq, h, d), _cuda(b, sk, 2, d)
    with FlopCounterMode(display=False) as counter:
        flash_attn_func(q, k, k, causal=causal)
    pairs = _brute_pairs(sq, sk) if causal else sq * sk
    assert counter.get_total_flops() == 4 * b * h * d * pairs
    assert counter.get_flop_counts()["Global"][torch.ops.ferroattn.attn_fwd] == 4 * b * h * d * pairs


def test_flop_counter_varlen_fake_uses_max_lengths(fake):
    q, k = _cuda(10, 4, 32), _cuda(14, 4, 32)
    cu = torch.empty(3, dtype=torch.int32, device="cuda")  # values unknown: 2 sequences of max lengths
    with FlopCounterMode(display=False) as counter:
        flash_attn_varlen_func(q, k, k, cu, cu, 6, 8, causal=True)
    assert counter.get_total_flops() == 4 * 4 * 32 * 2 * _brute_pairs(6, 8)


def test_flop_formula_varlen_real_lengths():
    from ferroattn.ops.attention import attn_fwd_flops

    q = torch.empty(10, 4, 32, device="meta")
    k = torch.empty(14, 4, 32, device="meta")
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32)
    expected = 4 * 4 * 32 * (_brute_pairs(3, 6) + _brute_pairs(7, 8))
    assert attn_fwd_flops(q, k, k, cu_q, cu_k, 7, 8, 0.1, True) == expected
    expected_full = 4 * 4 * 32 * (3 * 6 + 7 * 8)
    assert attn_fwd_flops(q, k, k, cu_q, cu_k, 7, 8, 0.1, False) == expected_full


# ---- backward -----------------------------------------------------------------------------
@pytest.mark.parametrize("d", [32, 36])
def test_backward_runs_on_meta(d):
    # meta tensors: the autograd engine runs without a GPU (fake CUDA tensors would need one)
    q = torch.empty(2, 5, 4, d, dtype=BF16, device="meta", requires_grad=True)
    k = torch.empty(2, 7, 2, d, dtype=BF16, device="meta", requires_grad=True)
    out = flash_attn_func(q, k, k)
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert q.grad.shape == q.shape and q.grad.dtype == BF16 and q.grad.device.type == "meta"
    assert k.grad.shape == k.shape


# ---- attention variants (window, softcap, ALiBi, sinks) ------------------------------------
F32 = torch.float32


def _variant_args(h, b=None, window=(3, 0), softcap=5.0, device="cuda"):
    """The op's trailing arguments after ``deterministic``: (window_left, window_right, softcap,
    alibi_slopes (h,) or (b, h), sinks (h,))."""
    alibi = torch.empty((h,) if b is None else (b, h), dtype=F32, device=device)
    return (window[0], window[1], softcap, alibi, torch.empty(h, dtype=F32, device=device))


@pytest.mark.parametrize("per_batch_alibi", [False, True])
def test_op_shapes_padded_with_variants(fake, per_batch_alibi):
    q, k = _cuda(3, 5, 6, 64), _cuda(3, 9, 2, 64)
    extra = _variant_args(6, 3 if per_batch_alibi else None)
    out, lse = torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 9, 0.125, True, False, *extra)
    assert out.shape == q.shape and out.dtype == BF16 and out.stride() == q.stride()
    assert lse.shape == (3, 6, 5) and lse.dtype == F32 and lse.is_contiguous()
    dq, dk, dv = torch.ops.ferroattn.attn_bwd(out, q, k, k, out, lse, None, None, 5, 9, 0.125, True, False, *extra)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape and dq.dtype == BF16


def test_op_shapes_varlen_with_variants(fake):
    q, k = _cuda(17, 8, 128), _cuda(23, 1, 128)
    cu = torch.empty(4, dtype=torch.int32, device="cuda")
    extra = _variant_args(8, 3, window=(-1, 4), softcap=0.0)
    out, lse = torch.ops.ferroattn.attn_fwd(q, k, k, cu, cu, 9, 12, 0.1, False, False, *extra)
    assert out.shape == (17, 8, 128) and lse.shape == (8, 17)
    grads = torch.ops.ferroattn.attn_bwd(out, q, k, k, out, lse, cu, cu, 9, 12, 0.1, False, True, *extra)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


@pytest.mark.parametrize("extra,exc,message", [
    ((-2, -1, 0.0, None, None), ferroattn.ArgumentError, "window_size: expected sides >= -1 (-1 = unbounded), got (-2, -1)"),
    ((4, -9, 0.0, None, None), ferroattn.ArgumentError, "window_size: expected sides >= -1 (-1 = unbounded), got (4, -9)"),
    ((-1, -1, -1.0, None, None), ferroattn.ArgumentError, "softcap: expected 0 (no softcapping) or a number in [2**-60, 2**60], got -1"),
    ((-1, -1, float("nan"), None, None), ferroattn.ArgumentError,
     "softcap: expected 0 (no softcapping) or a number in [2**-60, 2**60], got NaN"),
    ((-1, -1, float("inf"), None, None), ferroattn.ArgumentError,
     "softcap: expected 0 (no softcapping) or a number in [2**-60, 2**60], got inf"),
    ((-1, -1, 0.0, "alibi_f16", None), ferroattn.DTypeError, "alibi_slopes: expected dtype float32, got float16"),
    ((-1, -1, 0.0, "alibi_5", None), ferroattn.ArgumentError,
     "alibi_slopes: expected shape (6,) or (3, 6) (heads or batch x heads), got shape (5,)"),
    ((-1, -1, 0.0, None, "sinks_bf16"), ferroattn.DTypeError, "s_aux: expected dtype float32, got bfloat16"),
    ((-1, -1, 0.0, None, "sinks_3x6"), ferroattn.ArgumentError,
     "s_aux: expected shape (6,) (one logit per query head), got shape (3, 6)"),
], ids=["left-2", "right-9", "softcap-1", "softcap_nan", "softcap_inf", "alibi_f16", "alibi_shape", "sinks_bf16",
        "sinks_shape"])
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_op_direct_variant_validation_names_the_argument(extra, exc, message, op):
    """The variant's Rust validation through the ops themselves (their fake impls, on meta tensors):
    the flash_attn functions never pass a side < -1 (they normalise it to -1), a direct caller can."""
    m = lambda *s, dtype=BF16: torch.empty(s, dtype=dtype, device="meta")  # noqa: E731
    tensors = {"alibi_f16": m(6, dtype=FP16), "alibi_5": m(5, dtype=F32), "sinks_bf16": m(6),
               "sinks_3x6": m(3, 6, dtype=F32)}
    extra = tuple(tensors.get(x, x) if isinstance(x, str) else x for x in extra)
    q, k = m(3, 5, 6, 64), m(3, 9, 2, 64)
    lse = m(3, 6, 5, dtype=F32)
    with pytest.raises(exc) as info:
        if op == "fwd":
            torch.ops.ferroattn.attn_fwd(q, k, k, None, None, 5, 9, 0.125, False, False, *extra)
        else:
            torch.ops.ferroattn.attn_bwd(q, q, k, k, q, lse, None, None, 5, 9, 0.125, False, False, *extra)
    assert str(info.value) == message


def test_opcheck_meta_with_variants():
    q = torch.empty(2, 5, 4, 32, dtype=BF16, device="meta")
    k = torch.empty(2, 7, 2, 32, dtype=BF16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    extra = _variant_args(4, 2, device="meta")
    lse = torch.empty(2, 4, 5, dtype=F32, device="meta")
    for op, args in [
        (torch.ops.ferroattn.attn_fwd.default, (q, k, k, None, None, 5, 7, 0.17, True, False) + extra),
        (torch.ops.ferroattn.attn_fwd.default, (q[0], k[0], k[0], cu, cu, 3, 4, 0.17, False, True, 1, 1, 2.0,
                                                 None, extra[4])),
        (torch.ops.ferroattn.attn_bwd.default, (q, q, k, k, q, lse, None, None, 5, 7, 0.17, True, False) + extra),
    ]:
        res = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in res.values()), res


def _op_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_fake_cuda_with_variants(fake, varlen):
    """The variant traces into the graph as the op's trailing arguments (normalised), one graph."""
    torch._dynamo.reset()
    backend = _CountingBackend()
    slopes, sinks = torch.empty(8, dtype=F32, device="cuda"), torch.empty(8, dtype=F32, device="cuda")
    if varlen:
        q, k = _cuda(17, 8, 36), _cuda(23, 2, 36)
        cu = torch.empty(4, dtype=torch.int32, device="cuda")

        def f(q, k, v, cu, slopes, sinks):
            return flash_attn_varlen_func(q, k, v, cu, cu, 9, 12, causal=True, window_size=(4, 100), softcap=30.0,
                                          alibi_slopes=slopes, s_aux=sinks) * 2

        args = (q, k, k, cu, slopes, sinks)
    else:
        q, k = _cuda(2, 5, 8, 36), _cuda(2, 7, 2, 36)

        def f(q, k, v, slopes, sinks):
            return flash_attn_func(q, k, v, causal=True, window_size=(4, 100), softcap=30.0, alibi_slopes=slopes,
                                   s_aux=sinks) * 2

        args = (q, k, k, slopes, sinks)
    out = torch.compile(f, fullgraph=True, backend=backend)(*args)
    assert out.shape == q.shape
    assert len(backend.graphs) == 1
    (node,) = _op_nodes(backend.graphs[0], torch.ops.ferroattn.attn_fwd.default)
    # (…, causal, deterministic, window_left, window_right, softcap, alibi_slopes, sinks)
    assert node.args[8] is True and node.args[10:13] == (4, 0, 30.0)
    assert all(a is not None for a in node.args[13:15])


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_forward_backward_meta_with_variants(varlen):
    """aot_autograd on meta tensors: one forward and one backward graph; attn_bwd receives the
    forward's variant; s_aux gets a gradient (h,) fp32 through the sinks' formula."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    m = lambda *s, dtype=BF16: torch.empty(s, dtype=dtype, device="meta", requires_grad=True)  # noqa: E731
    slopes = torch.empty(6, dtype=F32, device="meta")
    sinks = m(6, dtype=F32)
    if varlen:
        q, k = m(11, 6, 40), m(13, 2, 40)
        cu = torch.empty(3, dtype=torch.int32, device="meta")
        f = lambda q, k, v, s: flash_attn_varlen_func(q, k, v, cu, cu, 6, 7, window_size=(2, 3), softcap=4.0,  # noqa: E731
                                                      alibi_slopes=slopes, s_aux=s).float().sum()
    else:
        q, k = m(2, 5, 6, 40), m(2, 7, 2, 40)
        f = lambda q, k, v, s: flash_attn_func(q, k, v, window_size=(2, 3), softcap=4.0, alibi_slopes=slopes,  # noqa: E731
                                               s_aux=s).float().sum()
    loss = torch.compile(f, fullgraph=True, backend=backend)(q, k, k, sinks)
    loss.backward()
    assert q.grad.shape == q.shape and q.grad.dtype == BF16 and k.grad.shape == k.shape
    assert sinks.grad.shape == (6,) and sinks.grad.dtype == F32
    assert len(graphs) == 2
    (fwd,) = _op_nodes(graphs[0], torch.ops.ferroattn.attn_fwd.default)
    (bwd,) = _op_nodes(graphs[1], torch.ops.ferroattn.attn_bwd.default)
    assert fwd.args[10:13] == (2, 3, 4.0) and bwd.args[13:16] == (2, 3, 4.0)


@pytest.mark.parametrize("d", [32, 36])
def test_backward_runs_on_meta_with_variants(d):
    q = torch.empty(2, 5, 4, d, dtype=BF16, device="meta", requires_grad=True)
    k = torch.empty(2, 7, 2, d, dtype=BF16, device="meta", requires_grad=True)
    sinks = torch.empty(4, dtype=BF16, device="meta", requires_grad=True)  # cast to fp32 inside
    slopes = torch.empty(2, 4, dtype=F32, device="meta")
    out = flash_attn_func(q, k, k, causal=True, window_size=(1, 0), softcap=2.0, alibi_slopes=slopes, s_aux=sinks)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert sinks.grad.shape == (4,) and sinks.grad.dtype == BF16  # back through the fp32 cast
    assert slopes.grad is None  # ALiBi slopes are not differentiated (as in flash_attn)


# ---- FLOPs with a window -------------------------------------------------------------------
def _window_pairs(sq, sk, causal, window):
    """Visible pairs of the flash_attn mask (the contract: ferroattn.testing's window
    normalisation, flash_api.cpp's, then the bottom-right window row by row; plain Python, so it
    also runs under FakeTensorMode)."""
    left, right = ferroattn.testing.normalise_window(window, sk, causal)
    n = 0
    for i in range(sq):
        diag = i + sk - sq
        lo = 0 if left < 0 else max(0, diag - left)
        hi = sk - 1 if right < 0 else min(sk - 1, diag + right)
        n += max(0, hi - lo + 1)
    return n


def test_window_pairs_helper_is_the_visible_mask():
    for sq, sk, causal, window in [(8, 8, False, (2, 1)), (5, 9, True, (4, 0)), (7, 3, False, (1, -1)),
                                   (6, 2, False, (-1, 0)), (4, 4, False, (-1, -1)), (9, 4, True, (1, 5))]:
        assert _window_pairs(sq, sk, causal, window) == int(ferroattn.testing.visible_mask(sq, sk, causal, window).sum())


_WINDOWS = [((2, 1), False), ((0, 0), False), ((3, -1), False), ((-1, 2), False), ((4, 0), True), ((1, 5), True),
            ((100, 1), False), ((2, 100), False)]


@pytest.mark.parametrize("window,causal", _WINDOWS)
@pytest.mark.parametrize("sq,sk", [(8, 8), (5, 9), (1, 6), (9, 9)])
def test_flop_counter_padded_window(fake, window, causal, sq, sk):
    b, h, d = 2, 6, 64
    q, k = _cuda(b, sq, h, d), _cuda(b, sk, 2, d)
    with FlopCounterMode(display=False) as counter:
        flash_attn_func(q, k, k, causal=causal, window_size=window)
    pairs = _window_pairs(sq, sk, causal, window)
    assert pairs < sq * sk or window in ((100, 1), (2, 100)) or sq == 1  # the window does cut pairs
    assert counter.get_flop_counts()["Global"][torch.ops.ferroattn.attn_fwd] == 4 * b * h * d * pairs
    assert counter.get_total_flops() == 4 * b * h * d * pairs


def test_flop_counter_softcap_alibi_sinks_do_not_change_the_count(fake):
    q = _cuda(2, 8, 4, 64)
    vec = torch.empty(4, dtype=F32, device="cuda")
    with FlopCounterMode(display=False) as plain:
        flash_attn_func(q, q, q, causal=True)
    with FlopCounterMode(display=False) as variant:
        flash_attn_func(q, q, q, causal=True, softcap=3.0, alibi_slopes=vec, s_aux=vec)
    assert plain.get_total_flops() == variant.get_total_flops() == 4 * 2 * 4 * 64 * 36


def test_flop_counter_window_forward_and_backward_meta():
    q = torch.empty(2, 16, 4, 64, dtype=BF16, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        flash_attn_func(q, q, q, window_size=(3, 2)).sum().backward()
    pairs = _window_pairs(16, 16, False, (3, 2))
    assert pairs == 16 * 6 - (1 + 2 + 3) - (1 + 2)  # 6 keys a row, minus what falls off either edge
    fwd = 4 * 2 * 4 * 64 * pairs
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.ferroattn.attn_fwd] == fwd
    assert counts[torch.ops.ferroattn.attn_bwd] == fwd * 5 // 2
    assert counter.get_total_flops() == fwd * 7 // 2


def test_flop_counter_varlen_fake_window_uses_max_lengths(fake):
    q, k = _cuda(10, 4, 32), _cuda(14, 4, 32)
    cu = torch.empty(3, dtype=torch.int32, device="cuda")
    with FlopCounterMode(display=False) as counter:
        flash_attn_varlen_func(q, k, k, cu, cu, 6, 8, window_size=(1, 1))
    assert counter.get_total_flops() == 4 * 4 * 32 * 2 * _window_pairs(6, 8, False, (1, 1))


def test_flop_formula_varlen_real_lengths_window():
    from ferroattn.ops.attention import attn_fwd_flops
    from ferroattn.ops.attention_bwd import attn_bwd_flops

    q = torch.empty(10, 4, 32, device="meta")
    k = torch.empty(14, 4, 32, device="meta")
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32)
    for causal, (left, right) in ((False, (2, 1)), (True, (2, 0)), (False, (-1, 0)), (False, (0, -1))):
        # per sequence, with the sequence's own lengths (the window already normalised)
        pairs = sum(ferroattn.ops.attention.visible_pairs(a, b, causal, (left, right)) for a, b in ((3, 6), (7, 8)))
        assert pairs == _window_pairs(3, 6, causal, (left, right)) + _window_pairs(7, 8, causal, (left, right))
        fwd = attn_fwd_flops(q, k, k, cu_q, cu_k, 7, 8, 0.1, causal, False, left, right)
        assert fwd == 4 * 4 * 32 * pairs
        assert attn_bwd_flops(q, q, k, k, q, None, cu_q, cu_k, 7, 8, 0.1, causal, False, left, right) == fwd * 5 // 2


# ---- visible_pairs (the one count, native) ---------------------------------------------------
def _brute_variant_pairs(sq, sk, causal, left, right):
    """Row by row, the documented rule of a normalised variant (ferroattn.ops.variant): row i sees
    keys j in [i + s_k − s_q − left, i + s_k − s_q + right] ∩ [0, s_k), −1 = unbounded side,
    causal forcing right = 0."""
    if causal:
        right = 0
    n = 0
    for i in range(sq):
        diag = i + sk - sq
        lo = 0 if left < 0 else max(0, diag - left)
        hi = sk - 1 if right < 0 else min(sk - 1, diag + right)
        n += max(0, hi - lo + 1)
    return n


def test_visible_pairs_matches_the_row_by_row_count():
    from ferroattn.ops.attention import visible_pairs
    for sq in range(0, 7):
        for sk in range(0, 7):
            for causal in (False, True):
                for left in range(-1, 8):
                    for right in range(-1, 8):
                        got = visible_pairs(sq, sk, causal, (left, right))
                        assert got == _brute_variant_pairs(sq, sk, causal, left, right), (sq, sk, causal, left, right)


def test_visible_pairs_of_the_normalised_variant_are_the_flash_attn_mask():
    """The normalised variant (AttnVariant.from_flash_attn) shows exactly the pairs of
    flash_attn's mask (ferroattn.testing.visible_mask) for every window and causal flag, s_q > s_k
    included (where flash_attn bounds the unset side of a one-sided window at s_k)."""
    from ferroattn.ops.attention import visible_pairs
    for sq in range(1, 9):
        for sk in range(1, 8):
            for causal in (False, True):
                for left in range(-2, 9):
                    for right in range(-2, 9):
                        v = ferroattn.ops.variant.AttnVariant.from_flash_attn(causal, (left, right), 0.0, None, None,
                                                                              sq, sk)
                        got = visible_pairs(sq, sk, v.causal, (v.window_left, v.window_right))
                        assert got == _window_pairs(sq, sk, causal, (left, right)), (sq, sk, causal, left, right)


def test_visible_pairs_examples_and_large_sizes():
    from ferroattn.ops.attention import visible_pairs
    assert visible_pairs(4, 4, True) == 10 and visible_pairs(4, 4, False, (1, 0)) == 7
    n = 2**31 - 1
    assert visible_pairs(n, n) == n * n
    assert visible_pairs(n, n, True) == n * (n + 1) // 2
    w = 4096  # rows 0..w see i + 1 keys, the rest w + 1
    assert visible_pairs(n, n, True, (w, 0)) == (w + 1) * (w + 2) // 2 + (n - w - 1) * (w + 1)
    assert visible_pairs(n, n, False, (w, w)) == n * (2 * w + 1) - w * (w + 1)
    assert visible_pairs(0, n, True, (3, 3)) == 0 == visible_pairs(n, 0, False, (3, 3))
