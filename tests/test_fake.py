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
