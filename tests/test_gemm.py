"""The dense GEMM ops and ``ferroattn.matmul`` without a GPU: output shapes/dtypes/strides on fake
and meta tensors for every layout, batch and broadcast; errors naming the argument; the FLOP
formula; torch.compile (fullgraph, one graph under dynamic shapes, errors at trace time);
opcheck on meta tensors; the backward on meta tensors. The metadata validation is
``_native.gemm_check`` (the Rust one; the contract emulation of test_gemm_emulated.py while the
built extension predates it)."""
from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import ferroattn.ops.gemm as ops_gemm
from ferroattn import _native, errors
from ferroattn.gemm import matmul

from test_gemm_emulated import rust_check_or_contract

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HAVE_RUST_CHECK = hasattr(_native, "gemm_check")


@pytest.fixture(autouse=True)
def contract(monkeypatch):
    rust_check_or_contract(monkeypatch)


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _meta(*shape, dtype=BF16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _t(x):
    return x.transpose(-1, -2)


# ---- shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_layouts_fake(fake, layout, dtype):
    m, n, k = 33, 17, 65
    a = _cuda(m, k, dtype=dtype) if layout[0] == "N" else _t(_cuda(k, m, dtype=dtype))
    b = _cuda(k, n, dtype=dtype) if layout[1] == "N" else _t(_cuda(n, k, dtype=dtype))
    out = matmul(a, b)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous() and out.device.type == "cuda"


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [
    ((5, 7), (7, 3), (5, 3)),
    ((4, 5, 7), (7, 3), (4, 5, 3)),               # broadcast b
    ((2, 3, 5, 7), (7, 3), (2, 3, 5, 3)),         # leading dims
    ((2, 3, 5, 7), (6, 7, 3), (2, 3, 5, 3)),      # batched b against flattened leading dims
    ((2, 3, 5, 7), (1, 7, 3), (2, 3, 5, 3)),      # batch-1 b
    ((5, 7), (4, 7, 3), (4, 5, 3)),               # broadcast a
    ((1, 5, 7), (4, 7, 3), (4, 5, 3)),
    ((65536, 2, 3), (3, 4), (65536, 2, 4)),       # large batch
    ((1, 7), (7, 1), (1, 1)),
    ((5, 7), (1, 7, 3), (1, 5, 3)),               # as torch.matmul
    ((3, 1, 5, 7), (3, 7, 3), (3, 1, 5, 3)),      # flattened batch 3 (torch.matmul would give (3, 3, 5, 3))
])
def test_batch_and_broadcast_shapes(fake, a_shape, b_shape, out_shape):
    out = matmul(_cuda(*a_shape), _cuda(*b_shape))
    assert out.shape == out_shape and out.is_contiguous()


@pytest.mark.parametrize("out_dtype", [None, FP16, BF16, FP32])
def test_out_dtype(fake, out_dtype):
    out = matmul(_cuda(5, 7, dtype=FP16), _cuda(7, 3, dtype=FP16), out_dtype=out_dtype)
    assert out.dtype == (out_dtype or FP16)


@pytest.mark.parametrize("with_aux,activation,aux_shape", [
    (True, "gelu_erf", (2, 5, 3)), (True, "none", (0,)), (False, "relu", (0,))])
def test_aux_output(fake, with_aux, activation, aux_shape):
    out, aux = torch.ops.ferroattn.gemm(_cuda(2, 5, 7), _cuda(7, 3), None, None, 1.0, 0.0, activation, FP32,
                                        "auto", with_aux)
    assert out.shape == (2, 5, 3) and aux.shape == aux_shape and aux.dtype == FP32


def test_epilogue_operands_fake(fake):
    a, b = _cuda(4, 5, 7), _cuda(7, 3)
    out = matmul(a, b, bias=_cuda(3, dtype=FP32), activation="gelu_tanh", alpha=2.0, beta=1.0, c=_cuda(4, 5, 3))
    assert out.shape == (4, 5, 3)
    out = matmul(a, b, c=_cuda(5, 3), beta=0.5)  # c broadcast over the batch
    assert out.shape == (4, 5, 3)


def test_meta_tensors():
    out = matmul(_meta(3, 5, 7), _meta(7, 2), activation="silu")
    assert out.device.type == "meta" and out.shape == (3, 5, 2)


@pytest.mark.parametrize("shape", [(0, 5, 7), (3, 0, 7), (3, 5, 0)])
def test_degenerate_sizes_fake(fake, shape):
    out = matmul(_cuda(*shape), _cuda(shape[2], 4))
    assert out.shape == shape[:2] + (4,)


def test_out_preallocated_fake(fake):
    out = _cuda(4, 5, 3, dtype=FP32)
    assert matmul(_cuda(4, 5, 7), _cuda(7, 3), out=out) is out


# ---- errors -------------------------------------------------------------------------------
def _raises(cls, pattern, fn):
    with pytest.raises(cls) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)
    return info.value


@pytest.mark.parametrize("call,cls,pattern", [
    (lambda: matmul(_cuda(7), _cuda(7, 3)), errors.ArgumentError, r"^a: expected rank >= 2"),
    (lambda: matmul(_cuda(5, 7), _cuda(7)), errors.ArgumentError, r"^b: expected rank 2 .* or 3"),
    (lambda: matmul(_cuda(5, 7), _cuda(2, 2, 7, 3)), errors.ArgumentError, r"^b: expected rank"),
    (lambda: matmul(_cuda(4, 5, 7), _cuda(3, 7, 3)), errors.ArgumentError, r"^b: expected a batch of 4 .* got 3"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), activation="gelu_fast"), errors.ArgumentError,
     r"^activation: .*'gelu_fast'"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), activation=1), errors.ArgumentError, r"^activation: "),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), backend="cublas"), errors.ArgumentError,
     r"^backend: expected one of 'auto', 'wmma', 'sm90', got 'cublas'"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), out_dtype=torch.float64), errors.DTypeError, r"^out_dtype: .*float64"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), alpha=float("nan")), errors.ArgumentError, r"^alpha: .*nan"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), beta=1e300, c=_cuda(5, 3)), errors.ArgumentError, r"^beta: "),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), alpha="2"), errors.ArgumentError, r"^alpha: expected a real number"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), beta=1.0), errors.ArgumentError, r"^c: expected a tensor .* got None"),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), beta=1.0, c=_cuda(5, 4)), errors.ArgumentError,
     r"^c: expected shape \(\.\.\., 5, 3\)"),
    (lambda: matmul(_cuda(4, 5, 7), _cuda(7, 3), beta=1.0, c=_cuda(2, 5, 3)), errors.ArgumentError,
     r"^c: expected leading dims that flatten to 4 or 1"),
    (lambda: matmul(_cuda(4, 5, 7), _cuda(7, 3), out=_cuda(4, 5, 4)), errors.ArgumentError,
     r"^out: expected shape \(4, 5, 3\)"),
    (lambda: matmul(_cuda(4, 5, 7), _cuda(7, 3), out=_cuda(4, 5, 3, dtype=torch.int32)), errors.DTypeError,
     r"^out: expected dtype"),
])
def test_python_errors(fake, call, cls, pattern):
    _raises(cls, pattern, call)


@pytest.mark.parametrize("call,cls,names", [
    (lambda: matmul(_cuda(5, 7, dtype=FP32), _cuda(7, 3, dtype=FP32)), errors.DTypeError, ("a",)),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3, dtype=FP16)), errors.DTypeError, ("b",)),
    (lambda: matmul(_cuda(5, 7), _cuda(6, 3)), errors.ArgumentError, ("a", "b")),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), bias=_cuda(4)), errors.ArgumentError, ("bias",)),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), bias=_cuda(3, dtype=FP16)), errors.DTypeError, ("bias",)),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), bias=_cuda(1, 3)), errors.ArgumentError, ("bias",)),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), beta=1.0, c=_cuda(5, 3, dtype=FP16)), errors.DTypeError, ("c",)),
    (lambda: matmul(_cuda(5, 7), _cuda(7, 3), beta=1.0, c=_cuda(5, 3, dtype=FP32), out_dtype=BF16),
     errors.DTypeError, ("c",)),
    (lambda: matmul(_cuda(5, 7), torch.empty(7, 3, dtype=BF16, device="cuda:1")), errors.DeviceError, ("b",)),
    # the degenerate sizes are validated as well
    (lambda: matmul(_cuda(5, 0), _cuda(0, 3, dtype=FP16)), errors.DTypeError, ("b",)),
    (lambda: matmul(_cuda(0, 7, dtype=FP32), _cuda(7, 3, dtype=FP32)), errors.DTypeError, ("a",)),
])
def test_validation_errors_name_the_argument(fake, call, cls, names):
    e = _raises(cls, "", call)
    assert re.match(rf"^({'|'.join(names)}): expected", str(e)), str(e)


@pytest.mark.skipif(not HAVE_RUST_CHECK, reason="needs the built extension with _native.gemm (issue 4)")
def test_cpu_tensors_reach_the_rust_validation():
    a, b = torch.randn(5, 7).to(BF16), torch.randn(7, 3).to(BF16)
    _raises(errors.DeviceError, r"^a: ", lambda: matmul(a, b))
    _raises(errors.DeviceError, r"^a: ", lambda: torch.ops.ferroattn.gemm(a, b, None, None, 1.0, 0.0, "none",
                                                                          None, "auto", False))


def test_public_activation_names():
    assert [ops_gemm.public_activation(x) for x in (None, "none", "relu", "gelu", "gelu_erf", "gelu_tanh", "silu")] \
        == ["none", "none", "relu", "gelu_erf", "gelu_erf", "gelu_tanh", "silu"]
    assert ops_gemm.ACTIVATIONS == ("none", "relu", "gelu_tanh", "gelu_erf", "silu")  # activation.cuh codes 0..4


def test_activation_codes_match_the_kernel_header():
    from pathlib import Path
    header = (Path(__file__).resolve().parents[1] / "kernels" / "common" / "activation.cuh").read_text()
    enum = re.search(r"enum ActivationKind : int \{([^}]*)\}", header).group(1)
    codes = [int(v) for v in re.findall(r"= (\d+)", enum)]
    assert codes == list(range(len(ops_gemm.ACTIVATIONS)))
    names = re.findall(r"kAct(\w+) =", enum)
    assert [n.lower() for n in names] == [a.replace("_", "") for a in ops_gemm.ACTIVATIONS]


# ---- FLOPs --------------------------------------------------------------------------------
@pytest.mark.parametrize("a_shape,b_shape,batch", [
    ((5, 7), (7, 3), 1), ((4, 5, 7), (7, 3), 4), ((2, 3, 5, 7), (6, 7, 3), 6), ((5, 7), (4, 7, 3), 4),
    ((5, 0), (0, 3), 1)])
def test_flop_counter(fake, a_shape, b_shape, batch):
    m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
    with FlopCounterMode(display=False) as counter:
        matmul(_cuda(*a_shape), _cuda(*b_shape), bias=_cuda(n), activation="relu")
    assert counter.get_total_flops() == 2 * batch * m * n * k
    assert counter.get_flop_counts()["Global"].get(torch.ops.ferroattn.gemm, 0) == 2 * batch * m * n * k


def test_flop_counter_out_and_backward():
    a, b = _meta(4, 5, 7, grad=True), _meta(7, 3, grad=True)
    with FlopCounterMode(display=False) as counter:
        out = matmul(a, b, activation="gelu")
        out.sum().backward()
    fwd = 2 * 4 * 5 * 3 * 7
    assert counter.get_total_flops() == 3 * fwd  # forward + da + db
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        matmul(a, b, out=_meta(4, 5, 3))
    assert counter.get_flop_counts()["Global"][torch.ops.ferroattn.gemm_out] == fwd


# ---- backward on meta tensors ---------------------------------------------------------------
@pytest.mark.parametrize("a_shape,b_shape", [((5, 7), (7, 3)), ((2, 3, 5, 7), (7, 3)), ((5, 7), (4, 7, 3)),
                                             ((4, 5, 7), (4, 7, 3))])
def test_backward_shapes_meta(a_shape, b_shape):
    a, b = _meta(*a_shape, grad=True), _meta(*b_shape, grad=True)
    bias, out_shape = _meta(3, dtype=FP32, grad=True), torch.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (5, 3)
    c = _meta(5, 3, dtype=FP32, grad=True)
    out = matmul(a, b, bias=bias, c=c, beta=0.5, activation="silu", out_dtype=FP32)
    assert out.shape == out_shape and out.grad_fn is not None
    out.sum().backward()
    for t in (a, b, bias, c):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"


# ---- torch.compile ------------------------------------------------------------------------
class _CountingBackend:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _ops_in(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_compile_fullgraph_fake_cuda(fake):
    torch._dynamo.reset()
    backend = _CountingBackend()

    def f(x, w, bias):
        return matmul(x, w.T, bias=bias, activation="gelu") * 2

    x, w, bias = _cuda(2, 5, 64), _cuda(32, 64), _cuda(32)
    out = torch.compile(f, fullgraph=True, backend=backend)(x, w, bias)
    assert out.shape == (2, 5, 32)
    assert len(backend.graphs) == 1
    assert torch.ops.ferroattn.gemm.default in _ops_in(backend.graphs[0])


def test_compile_dynamic_shapes_one_graph(fake):
    torch._dynamo.reset()
    backend = _CountingBackend()
    f = torch.compile(lambda x, w: matmul(x, w), fullgraph=True, dynamic=True, backend=backend)
    for m in (5, 9, 17):
        assert f(_cuda(m, 64), _cuda(64, 32)).shape == (m, 32)
    assert len(backend.graphs) == 1


def test_compile_out_variant(fake):
    torch._dynamo.reset()
    backend = _CountingBackend()

    def f(x, w, out):
        matmul(x, w, out=out)
        return out + 1

    res = torch.compile(f, fullgraph=True, backend=backend)(_cuda(5, 64), _cuda(64, 32), _cuda(5, 32, dtype=FP32))
    assert res.shape == (5, 32) and len(backend.graphs) == 1


def test_compile_aot_eager_meta_with_backward():
    torch._dynamo.reset()
    a, b = _meta(4, 5, 64, grad=True), _meta(64, 32, grad=True)
    f = torch.compile(lambda a, b: matmul(a, b, activation="relu"), fullgraph=True, backend="aot_eager")
    out = f(a, b)
    assert out.shape == (4, 5, 32)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_compile_rejects_bad_input_at_trace_time(fake):
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: matmul(a, b), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(_cuda(5, 8, dtype=FP32), _cuda(8, 3, dtype=FP32))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(x, errors.DTypeError) for x in chain) or "DTypeError" in str(info.value), chain


# ---- opcheck --------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    lambda: (_meta(5, 8), _meta(8, 3), None, None, 1.0, 0.0, "none", None, "auto", False),
    lambda: (_meta(2, 5, 8, grad=True), _t(_meta(3, 8, grad=True)), _meta(3, dtype=FP32, grad=True),
             _meta(2, 5, 3, dtype=FP32, grad=True), 0.5, 2.0, "gelu_tanh", FP32, "auto", True),
    lambda: (_t(_meta(8, 5, grad=True)), _meta(4, 8, 3, grad=True), None, None, 1.0, 0.0, "silu", None, "wmma",
             False),
])
def test_opcheck_meta(args):
    res = torch.library.opcheck(torch.ops.ferroattn.gemm.default, args())
    assert all(v == "SUCCESS" for v in res.values()), res


def test_opcheck_out_meta():
    args = (_meta(2, 5, 8), _meta(8, 3), _meta(2, 5, 3, dtype=FP32), _meta(3), None, 1.0, 0.0, "relu", "auto")
    res = torch.library.opcheck(torch.ops.ferroattn.gemm_out.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def test_forward_ad_is_rejected():
    import torch.autograd.forward_ad as fwad

    a, b = _meta(5, 8), _meta(8, 3)
    with fwad.dual_level():
        dual = fwad.make_dual(a, torch.empty_like(a))
        _raises(NotImplementedError, r"^a: .*forward-mode", lambda: matmul(dual, b))


# ---- adversarial review (issue 4) ----------------------------------------------------------
@pytest.mark.parametrize("a_shape,b_shape,k_a,k_b", [
    ((4, 0), (1, 3), 0, 1),          # k = 0 in a used to be replaced by 1 and return zeros
    ((4, 1), (0, 3), 1, 0),
    ((0, 4, 0), (1, 1, 3), 0, 1),
    ((4, 8), (7, 3), 8, 7),
])
def test_inner_dim_checked_on_the_real_shapes(a_shape, b_shape, k_a, k_b):
    for device in ("meta", "cpu"):   # cpu: the check comes before the device check
        a = torch.empty(*a_shape, dtype=BF16, device=device)
        b = torch.empty(*b_shape, dtype=BF16, device=device)
        _raises(errors.ArgumentError, rf"^b: expected shape \(\.\.\., k, n\) with k = a\.shape\[-1\] = {k_a} "
                rf".*got k = {k_b} ", lambda: matmul(a, b))


@pytest.mark.parametrize("kwargs,name", [
    (dict(a=[[1.0]], b=_meta(1, 3)), "a"),
    (dict(a=_meta(4, 8), b=None), "b"),
    (dict(a=_meta(4, 8), b=_meta(8, 3), bias=[1.0, 2.0, 3.0]), "bias"),
    (dict(a=_meta(4, 8), b=_meta(8, 3), beta=1.0, c=[1]), "c"),
    (dict(a=_meta(4, 8), b=_meta(8, 3), c="x"), "c"),
])
def test_non_tensor_operands_raise_type_error_naming_them(kwargs, name):
    a, b = kwargs.pop("a"), kwargs.pop("b")
    _raises(TypeError, rf"^{name}: expected a torch\.Tensor", lambda: matmul(a, b, **kwargs))
