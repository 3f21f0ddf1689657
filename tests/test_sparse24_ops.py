"""torch.ops.ferroattn.sparse24_linear / sparse24_decompress on CPU: fake (meta and FakeTensorMode)
shapes and the Rust validation at trace time, the FLOP formula, torch.compile tracing without
graph breaks, the autograd formula on meta tensors (x and bias; the weight is frozen)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
from test_sparse24_fakes import any_native  # noqa: F401  (fixture)

import ferroattn._native as _native
from ferroattn import sparse24
from ferroattn.errors import ArgumentError, DTypeError
from ferroattn.ops import sparse24 as ops

BF16, FP16 = torch.bfloat16, torch.float16


def _weight(n, k, dtype=BF16, device="meta"):
    lay = _native.sparse24_layout(n, k)
    return (torch.empty(tuple(lay["values_shape"]), dtype=dtype, device=device),
            torch.empty(tuple(lay["meta_shape"]), dtype=torch.int16, device=device))


@pytest.mark.parametrize("rows, n, k", [(1, 8, 16), (31, 100, 1001), (4096, 11008, 4096)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_fake_shapes_meta(any_native, rows, n, k, dtype):
    v, m = _weight(n, k, dtype)
    x = torch.empty(rows, k, dtype=dtype, device="meta")
    out = torch.ops.ferroattn.sparse24_linear(x, v, m, None, n, k, "silu", "auto")
    assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous() and out.device.type == "meta"
    d = torch.ops.ferroattn.sparse24_decompress(v, m, n, k)
    assert d.shape == (n, k) and d.dtype == dtype


def test_fake_mode_cuda_and_public_matmul(any_native):
    with FakeTensorMode():
        w = sparse24.Sparse24Tensor(*_weight(48, 64, device="cuda"), (48, 64))
        x = torch.empty(3, 5, 64, dtype=BF16, device="cuda").transpose(0, 1)
        y = sparse24.matmul(x, w, torch.empty(48, dtype=torch.float32, device="cuda"), "gelu", backend="sparse")
        assert y.shape == (5, 3, 48) and y.dtype == BF16 and y.device.type == "cuda"


def test_decompress_fake_validates_like_the_real_call(any_native):
    """The decompress op's fake rejects what the real call's Rust validation rejects (wrong or transposed
    values / meta, wrong dtypes, negative sizes), naming the part, so traced and compiled code fails at trace
    time too; a bool in Sparse24Tensor's shape is rejected."""
    v, m = _weight(8, 64)
    dec = torch.ops.ferroattn.sparse24_decompress
    with pytest.raises(ArgumentError, match="^values: expected shape"):
        dec(v[:, :-1], m, 8, 64)
    with pytest.raises(ArgumentError, match="^meta: expected shape"):
        dec(v, m[:-1], 8, 64)
    with pytest.raises(ArgumentError, match="^values: expected shape"):
        dec(v, m, 200, 64)
    with pytest.raises(ArgumentError, match="^shape: expected"):
        dec(v, m, -1, 64)
    with pytest.raises(DTypeError, match="^values: "):
        dec(v.float(), m, 8, 64)
    with pytest.raises(DTypeError, match="^meta: "):
        dec(v, m.to(torch.int32), 8, 64)
    vt = torch.empty(v.shape[1], v.shape[0], dtype=BF16, device="meta").t()
    with pytest.raises(ArgumentError, match="^values: expected a contiguous"):
        dec(vt, m, 8, 64)
    assert dec(v, m, 8, 64).shape == (8, 64)
    with pytest.raises(ArgumentError, match="^shape: "):
        sparse24.Sparse24Tensor(v, m, (True, 64))


def test_fake_runs_the_rust_validation(any_native):
    v, m = _weight(8, 64)
    x = torch.empty(4, 64, dtype=BF16, device="meta")
    with pytest.raises(ArgumentError, match="x"):
        torch.ops.ferroattn.sparse24_linear(torch.empty(4, 32, dtype=BF16, device="meta"), v, m, None, 8, 64,
                                            "none", "auto")
    with pytest.raises(ArgumentError, match="values"):
        torch.ops.ferroattn.sparse24_linear(x, v[:, :-1], m, None, 8, 64, "none", "auto")
    with pytest.raises(ArgumentError, match="meta"):
        torch.ops.ferroattn.sparse24_linear(x, v, m[:-1], None, 8, 64, "none", "auto")
    with pytest.raises(ArgumentError, match="bias"):
        torch.ops.ferroattn.sparse24_linear(x, v, m, torch.empty(9, dtype=BF16, device="meta"), 8, 64, "none", "auto")
    with pytest.raises(ArgumentError, match="activation"):
        torch.ops.ferroattn.sparse24_linear(x, v, m, None, 8, 64, "tanh", "auto")
    with pytest.raises((DTypeError, ArgumentError), match="x"):
        torch.ops.ferroattn.sparse24_linear(x.float(), v, m, None, 8, 64, "none", "auto")
    with pytest.raises(ArgumentError, match="x"):
        torch.ops.ferroattn.sparse24_linear(x[None], v, m, None, 8, 64, "none", "auto")


def test_flop_formula_counts_dense(any_native):
    v, m = _weight(4096, 11008)
    x = torch.empty(77, 11008, dtype=BF16, device="meta")
    with FlopCounterMode(display=False) as fc:
        torch.ops.ferroattn.sparse24_linear(x, v, m, None, 4096, 11008, "none", "auto")
    assert fc.get_total_flops() == 2 * 77 * 4096 * 11008
    assert ops.sparse24_linear_flops(x, v, m, None, 4096, 11008, "none", "auto") == 2 * 77 * 4096 * 11008


@pytest.mark.parametrize("activation", ["none", "relu", "gelu_erf", "gelu_tanh", "silu"])
def test_autograd_on_meta(any_native, activation):
    v, m = _weight(24, 40)
    x = torch.empty(6, 40, dtype=BF16, device="meta", requires_grad=True)
    b = torch.empty(24, dtype=BF16, device="meta", requires_grad=True)
    out = torch.ops.ferroattn.sparse24_linear(x, v, m, b, 24, 40, activation, "auto")
    out.sum().backward()
    assert x.grad.shape == (6, 40) and x.grad.dtype == BF16
    assert b.grad.shape == (24,) and b.grad.dtype == BF16


def test_frozen_weight_backward_raises(any_native):
    v, m = _weight(24, 40)
    v.requires_grad_(True)
    x = torch.empty(6, 40, dtype=BF16, device="meta", requires_grad=True)
    out = torch.ops.ferroattn.sparse24_linear(x, v, m, None, 24, 40, "none", "auto")
    with pytest.raises(NotImplementedError, match="values/meta: the 2:4 weight .* is frozen"):
        out.sum().backward()


def test_activation_backward_matches_torch():
    pre = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(5, 7, dtype=torch.float64)
    fns = {"none": lambda t: t, "relu": torch.relu, "gelu_erf": torch.nn.functional.gelu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"), "silu": torch.nn.functional.silu}
    for name, fn in fns.items():
        (g,) = torch.autograd.grad(fn(pre), pre, dout)
        assert torch.allclose(ops.activation_backward(dout, pre.detach(), name), g), name
    with pytest.raises(ValueError, match="activation: expected one of"):
        ops.activation_backward(dout, pre, "tanh")


def test_compile_no_graph_break(any_native):
    """torch.compile(fullgraph=True) traces the public matmul (kernel path) with fake tensors."""
    w = sparse24.Sparse24Tensor(*_weight(48, 64), (48, 64))

    def f(x):
        return sparse24.matmul(x, w, None, "relu", backend="sparse") * 2

    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(f, backend=cnt, fullgraph=True)
    y = compiled(torch.empty(2, 9, 64, dtype=BF16, device="meta"))
    assert y.shape == (2, 9, 48) and cnt.frame_count == 1
    ops_in_graph = [n.target for g in cnt.graphs for n in g.graph.nodes if n.op == "call_function"]
    op = torch.ops.ferroattn.sparse24_linear
    assert op in ops_in_graph or op.default in ops_in_graph


def test_dispatch_rule_traces_without_graph_breaks():
    """matmul's auto dispatch runs inside compiled graphs on CUDA: the rule (plain Python over the
    table) must trace under fullgraph=True, decided per row count at trace time."""
    saved = {a: {d: dict(s) for d, s in v.items()} for a, v in sparse24.DISPATCH_TABLE.items()}
    try:
        sparse24.set_dispatch_table({"sm_90": {"bfloat16": {(256, 256): [(16, 0.5), (1024, 1.5)]}}})

        def f(x):
            d = sparse24.choose_backend(x.shape[0], 256, 256, x.dtype, torch.device("cuda", 0), "sm_90")
            return x * 2 if d == "sparse" else x * 3
        cf = torch.compile(f, backend="eager", fullgraph=True, dynamic=False)
        assert float(cf(torch.ones(8, 4, dtype=BF16))[0, 0]) == 3.0           # dense below the crossover
        assert float(cf(torch.ones(2048, 4, dtype=BF16))[0, 0]) == 2.0        # sparse above it
    finally:
        sparse24.set_dispatch_table(saved)


# ---- adversarial review (issue 4) ----------------------------------------------------------
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_matmul_zero_rows_keeps_autograd(any_native, lead, activation):
    torch.manual_seed(0)
    ws = sparse24.compress(torch.randn(6, 8, dtype=BF16), prune=True)
    x = torch.randn(*lead, 8, dtype=BF16, requires_grad=True)
    bias = torch.randn(6, dtype=BF16, requires_grad=True)
    y = sparse24.matmul(x, ws, bias, activation)
    ref = torch.nn.functional.linear(x, sparse24.decompress(ws), bias)
    assert y.shape == ref.shape == (*lead, 6) and y.dtype == BF16
    assert y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert bias.grad is not None and torch.equal(bias.grad, torch.zeros(6, dtype=BF16))
