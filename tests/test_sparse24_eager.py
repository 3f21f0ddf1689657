"""The eager fast path (ferroattn.ops._eager.plain_eager) of ``ferroattn.sparse24.matmul`` and
``ferroattn.matmul`` on CPU: when a call runs the op's implementation directly and when it must
go through the custom op (autograd, torch.compile, dispatch/function modes, the profiler, vmap,
jit tracing, tensor subclasses, the off switch), and that both routes return the same values and
raise the same errors.

The selection only admits CUDA tensors; here ``_eager._DEVICE_TYPES`` also admits CPU and the
2:4 launcher ``_native.sparse24_matmul`` is replaced by an fp32 torch computation through the
Rust host decompress (every other native function is the real one), so both routes run on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

import ferroattn._native as _real_native
import ferroattn.ops.gemm as ops_gemm
from ferroattn import sparse24
from ferroattn.errors import DeviceError, DTypeError
from ferroattn.gemm import matmul as dense_matmul
from ferroattn.nn import SparseLinear
from ferroattn.ops import _eager
from ferroattn.ops import sparse24 as ops

BF16 = torch.bfloat16
ACT = {"none": lambda y: y, "relu": F.relu, "gelu_erf": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
       "silu": F.silu}


class _Native:
    """The real extension, except ``sparse24_matmul``: ``out = act(x @ w.T + bias)`` in fp32 with
    w from the Rust host decompress; records the backend asked for."""

    def __init__(self):
        self.backends = []

    def __getattr__(self, name):
        return getattr(_real_native, name)

    def sparse24_matmul(self, x, values, meta, out, bias, n, k, activation, backend, workspace, stream):
        assert callable(workspace)                                          # the op's allocator
        assert not (x.requires_grad or values.requires_grad or out.requires_grad)   # launch detaches
        w = torch.empty((n, k), dtype=values.dtype)
        _real_native.sparse24_decompress_host(values, meta, w)
        y = x.float() @ w.float().T
        if bias is not None:
            y = y + bias.float()
        out.copy_(ACT[activation](y))
        self.backends.append(backend)
        return "mma_sp"


class _Routes:
    def __init__(self):
        self.direct = self.op = 0


@pytest.fixture
def routes(monkeypatch):
    """CPU admitted by the selection, the emulated launcher, and counters of the two routes:
    ``direct`` counts calls of the implementation from :func:`ops.linear`, ``op`` calls of the
    custom op (the op itself still runs the real implementation)."""
    r = _Routes()
    monkeypatch.setattr(_eager, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(_eager, "ENABLED", True)
    monkeypatch.setattr(ops, "_native", _Native())
    impl, op = ops._sparse24_linear_impl, ops.sparse24_linear

    def spy_impl(*a):
        r.direct += 1
        return impl(*a)

    def spy_op(*a):
        r.op += 1
        return op(*a)
    monkeypatch.setattr(ops, "_sparse24_linear_impl", spy_impl)
    monkeypatch.setattr(ops, "sparse24_linear", spy_op)
    return r


def _problem(rows=5, n=24, k=40, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = sparse24.prune(torch.randn(n, k, generator=g).to(BF16))
    x = torch.randn(rows, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    return x, sparse24.compress(w), w, b


def _ref(x, w, b=None, act="none"):
    y = x.float() @ w.float().T
    if b is not None:
        y = y + b.float()
    return ACT[act](y).to(x.dtype)


def _route(r, fn):
    d, o = r.direct, r.op
    out = fn()
    took = (r.direct - d, r.op - o)
    assert took in ((1, 0), (0, 1)), took
    return ("direct" if took == (1, 0) else "op"), out


# ---- the routes and their results -------------------------------------------------------------

@pytest.mark.parametrize("act", [None, "silu", "gelu"])
def test_plain_call_runs_the_implementation_directly(routes, act):
    x, ws, w, b = _problem(bias=True)
    route, y = _route(routes, lambda: sparse24.matmul(x, ws, b, act, backend="sparse"))
    assert route == "direct"
    assert y.grad_fn is None and y.shape == (5, 24) and y.dtype == BF16
    torch.testing.assert_close(y, _ref(x, w, b, sparse24.ACTIVATIONS[act]), rtol=1e-2, atol=1e-2)
    assert ops._native.backends[-1] == "auto"          # backend "sparse" -> native "auto"


def test_both_routes_give_the_same_tensor(routes, monkeypatch):
    x, ws, _, b = _problem(rows=7, bias=True)
    x3 = x.reshape(1, 7, 40).expand(3, 7, 40).transpose(0, 1)    # (7, 3, 40): rows need a copy
    got = {}
    for enabled in (True, False):
        monkeypatch.setattr(_eager, "ENABLED", enabled)
        for name, xi in (("2d", x), ("3d", x3)):
            route, got[enabled, name] = _route(routes, lambda: sparse24.matmul(xi, ws, b, "relu", backend="mma_sp"))
            assert route == ("direct" if enabled else "op")
    for name in ("2d", "3d"):
        assert torch.equal(got[True, name], got[False, name])
    assert got[True, "3d"].shape == (7, 3, 24)


def test_x_requiring_grad_goes_through_the_op_and_gets_gradients(routes):
    x, ws, w, b = _problem(bias=True)
    x.requires_grad_(True)
    route, y = _route(routes, lambda: sparse24.matmul(x, ws, b, backend="sparse"))
    assert route == "op" and y.grad_fn is not None
    y.float().sum().backward()
    torch.testing.assert_close(x.grad.float(), w.float().sum(0).expand(5, -1), rtol=1e-2, atol=1e-2)


def test_bias_parameter_requiring_grad_goes_through_the_op(routes):
    x, ws, _, b = _problem(bias=True)
    bias = torch.nn.Parameter(b)
    route, y = _route(routes, lambda: sparse24.matmul(x, ws, bias, backend="sparse"))
    assert route == "op" and y.requires_grad
    y.float().sum().backward()
    assert torch.equal(bias.grad, torch.full((24,), 5.0, dtype=BF16))


def test_no_grad_and_frozen_parameters_take_the_direct_route(routes):
    x, ws, w, b = _problem(bias=True)
    with torch.no_grad():   # requires_grad tensors, grad mode off: nothing to record
        route, y = _route(routes, lambda: sparse24.matmul(x.requires_grad_(True), ws, b, backend="sparse"))
    assert route == "direct" and y.grad_fn is None and not y.requires_grad
    x.requires_grad_(False)
    frozen = torch.nn.Parameter(b, requires_grad=False)     # nn.Parameter is a plain tensor here
    assert _route(routes, lambda: sparse24.matmul(x, ws, frozen, backend="sparse"))[0] == "direct"
    with torch.inference_mode():
        xi, vi, mi = x.clone(), ws.values.clone(), ws.meta.clone()
        wi = sparse24.Sparse24Tensor(vi, mi, ws.shape)
        route, y = _route(routes, lambda: sparse24.matmul(xi, wi, backend="sparse"))
    assert route == "direct" and y.is_inference()
    torch.testing.assert_close(y, _ref(x, w), rtol=1e-2, atol=1e-2)


def test_sparse_linear_module_uses_the_direct_route_without_grad(routes, monkeypatch):
    monkeypatch.setattr(sparse24.product, "choose_backend", lambda *a: "sparse")   # CPU's "auto" is dense
    lin = torch.nn.Linear(40, 24, dtype=BF16)
    sl = SparseLinear.from_dense(lin, activation="silu")
    x = torch.randn(2, 3, 40).to(BF16)
    route, y = _route(routes, lambda: sl(x))
    assert route == "op"                          # the bias is a Parameter that requires grad
    with torch.no_grad():
        route2, y2 = _route(routes, lambda: sl(x))
    assert route2 == "direct" and torch.equal(y.detach(), y2)


def test_switch_off_sends_every_call_through_the_op(routes, monkeypatch):
    x, ws, _, _ = _problem()
    monkeypatch.setattr(_eager, "ENABLED", False)
    assert _route(routes, lambda: sparse24.matmul(x, ws, backend="sparse"))[0] == "op"


def test_switch_reads_the_environment_at_import():
    import os
    import subprocess
    import sys
    code = "from ferroattn.ops import _eager; print(_eager.ENABLED)"
    for value, expect in (("0", "False"), ("off", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "FERROATTN_EAGER_FASTPATH"}
        if value is not None:
            env["FERROATTN_EAGER_FASTPATH"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expect, (value, out.stdout, out.stderr[-2000:])


# ---- whatever watches or transforms the call sees the op ---------------------------------------

def test_dispatch_mode_sees_the_op_and_counts_flops(routes):
    x, ws, _, _ = _problem(rows=6, n=24, k=40)
    with FlopCounterMode(display=False) as fc:
        route, _ = _route(routes, lambda: sparse24.matmul(x, ws, backend="sparse"))
    assert route == "op" and fc.get_total_flops() == 2 * 6 * 24 * 40


def test_function_mode_sees_the_op(routes):
    seen = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, ws, _, _ = _problem()
    with Log():
        route, _ = _route(routes, lambda: sparse24.matmul(x, ws, backend="sparse"))
    assert route == "op" and any("sparse24_linear" in s for s in seen)


def test_profiler_names_the_op(routes):
    x, ws, _, _ = _problem()
    with torch.autograd.profiler.profile() as prof:
        route, _ = _route(routes, lambda: sparse24.matmul(x, ws, backend="sparse"))
    assert route == "op" and any(e.name == "ferroattn::sparse24_linear" for e in prof.function_events)


def test_subclass_goes_through_the_op(routes):
    class Sub(torch.Tensor):
        pass
    x, ws, _, _ = _problem()
    route, y = _route(routes, lambda: sparse24.matmul(x.as_subclass(Sub), ws, backend="sparse"))
    assert route == "op"


def test_transforms_and_tracing_are_not_plain_eager(monkeypatch):
    monkeypatch.setattr(_eager, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(_eager, "ENABLED", True)
    x = torch.randn(3, 4)
    assert _eager.plain_eager((x, None))
    seen = []

    def probe(t):
        seen.append(_eager.plain_eager((t,)))
        return t * 2
    torch.vmap(probe)(x)
    torch.func.grad(lambda t: probe(t).sum())(x)
    torch.jit.trace(probe, (x,), check_trace=False)
    assert len(seen) == 3 and not any(seen), seen
    # torch.compile: the traced branch is the op's (x - 1), the eager one the direct (x + 1)
    f = torch.compile(lambda t: t + 1 if _eager.plain_eager((t,)) else t - 1, fullgraph=True, backend="eager")
    assert torch.equal(f(x), x - 1)
    assert not _eager.plain_eager((torch.empty(2, device="meta"),))       # not a CUDA (here: CPU) tensor


def test_compiled_matmul_still_traces_the_op(routes, monkeypatch):
    monkeypatch.setattr(ops, "_check_meta", lambda *a: None)   # the Rust check rejects CPU at trace time
    x, ws, w, _ = _problem(rows=4)
    f = torch.compile(lambda t: sparse24.matmul(t, ws, backend="sparse"), fullgraph=True, backend="aot_eager")
    y = f(x)
    assert routes.direct == 0 and routes.op >= 1
    torch.testing.assert_close(y, _ref(x, w), rtol=1e-2, atol=1e-2)


# ---- errors are the same on both routes --------------------------------------------------------

def test_rust_validation_errors_are_the_same_on_both_routes(monkeypatch):
    """With the real launcher, a CPU x passes the (patched) selection and reaches the Rust
    validation directly; the op route raises the same error."""
    monkeypatch.setattr(_eager, "_DEVICE_TYPES", ("cuda", "cpu"))
    x, ws, _, _ = _problem()
    msgs = []
    for enabled in (True, False):
        monkeypatch.setattr(_eager, "ENABLED", enabled)
        with pytest.raises(DeviceError, match=r"^x: expected a CUDA tensor") as e:
            sparse24.matmul(x, ws, backend="sparse")
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def test_python_checks_run_before_the_route(routes):
    x, ws, _, _ = _problem()
    with pytest.raises(DTypeError, match=r"^bias: expected torch.bfloat16 or torch.float32, got torch.float16"):
        sparse24.matmul(x, ws, torch.zeros(24, dtype=torch.float16), backend="sparse")
    assert routes.direct == routes.op == 0


# ---- the dense fallback and the flattening --------------------------------------------------------

def test_dense_backend_is_f_linear_on_the_cached_weight(routes):
    x, ws, w, b = _problem(bias=True)
    y = sparse24.matmul(x, ws, b, backend="dense")
    assert torch.equal(y, F.linear(x, w, b)) and routes.direct == routes.op == 0
    assert ws.dense() is ws.dense()                                   # cached
    torch.testing.assert_close(sparse24.matmul(x, ws, b.float(), "relu", backend="dense"), F.relu(F.linear(x, w, b)))


def test_rows_view_returns_2d_x_itself():
    x = torch.randn(6, 8)
    x2, unflatten = sparse24.product.rows_view(x)
    y = torch.randn(6, 3)
    assert x2 is x and unflatten(y) is y
    x3 = torch.randn(2, 3, 8)
    x2, unflatten = sparse24.product.rows_view(x3)
    assert x2.data_ptr() == x3.data_ptr() and x2.shape == (6, 8) and unflatten(torch.randn(6, 5)).shape == (2, 3, 5)


# ---- ferroattn.matmul shares the selection ---------------------------------------------------------

def test_dense_matmul_uses_the_same_selection(monkeypatch):
    from test_gemm_emulated import ContractNative
    monkeypatch.setattr(_eager, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(_eager, "ENABLED", True)
    monkeypatch.setattr(ops_gemm, "_native", ContractNative())
    calls = []
    op = ops_gemm.gemm
    monkeypatch.setattr(ops_gemm, "gemm", lambda *a: calls.append("op") or op(*a))
    a, b = torch.randn(4, 8).to(BF16), torch.randn(8, 6).to(BF16)
    y = dense_matmul(a, b)
    assert calls == [] and y.grad_fn is None
    torch.testing.assert_close(y.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-2)
    a.requires_grad_(True)
    y2 = dense_matmul(a, b)
    assert calls == ["op"] and y2.grad_fn is not None and torch.equal(y.detach(), y2.detach())
    with FlopCounterMode(display=False) as fc:
        dense_matmul(a.detach(), b)
    assert calls == ["op", "op"] and fc.get_total_flops() == 2 * 4 * 6 * 8


@pytest.mark.parametrize("tensors, device_types, named", [
    (None, ("cpu",), "tensors"), (5, ("cpu",), "tensors"), (iter([]), ("cpu",), "tensors"),
    ((), None, "device_types"), ((), "cpu", "device_types"), ((), 5, "device_types"),
])
def test_the_native_rule_names_a_wrong_argument_type(tensors, device_types, named):
    with pytest.raises(TypeError, match=f"eager_plain: {named}: expected"):
        _real_native.eager_plain(tensors, device_types)
    assert _real_native.eager_plain([torch.zeros(2)], frozenset({"cpu"}))         # the next call works
