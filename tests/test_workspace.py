"""The split-k / stream-K workspace of the dense GEMM and 2:4 launchers without a GPU
(src/ops/workspace.rs; the sizes of the plans are Rust unit tests beside the code:
``plans_size_their_workspace``, ``wgmma_plans_size_their_workspace``, ``ops::workspace::tests``).

Checked here: the native launchers reject a malformed workspace tensor with an error naming
``workspace`` before anything else (dtype, rank, contiguity: on any device); the planners
(``_native.gemm_workspace``, ``_native.sparse24_matmul_workspace``) run the launch's validation and
raise its errors; and the op layer's wiring (ferroattn.ops._to_native.workspace): it plans only on
the kernels' devices, hands the planner exactly the launcher's tensors and scalars, allocates the
planned bytes as one uint8 tensor on the call's device and passes it to the launcher just before
the stream (here with "cpu" admitted and emulated launchers)."""
from __future__ import annotations

import pytest
import torch

import ferroattn.ops.gemm as ops_gemm
import ferroattn.ops.sparse24 as ops_sparse24
from ferroattn import _native, errors, sparse24
from ferroattn.gemm import matmul
from ferroattn.ops import _to_native

from test_gemm_emulated import ContractNative

BF16 = torch.bfloat16

MALFORMED = [
    (lambda: torch.empty(256, dtype=torch.float32), errors.DTypeError, r"^workspace: expected dtype uint8"),
    (lambda: torch.empty(256, dtype=torch.int8), errors.DTypeError, r"^workspace: expected dtype uint8"),
    (lambda: torch.empty(4, 256, dtype=torch.uint8), errors.ArgumentError, r"^workspace: expected 1 dim"),
    (lambda: torch.empty(512, dtype=torch.uint8)[::2], errors.ArgumentError,
     r"^workspace: expected a contiguous tensor \(stride 1\), got stride 2"),
]


def _gemm_args(dtype_b=BF16, backend="auto"):
    """A valid-but-for-the-device call of _native.gemm without its workspace and stream."""
    a, b = torch.randn(1, 16, 64).to(BF16), torch.randn(1, 64, 32).to(dtype_b)
    out = torch.empty(1, 16, 32, dtype=BF16)
    return (a, b, out, None, None, None, 1.0, 0.0, "none", backend)


def _sparse_problem(backend="auto"):
    """(a valid-but-for-the-device call of _native.sparse24_matmul without its workspace and
    stream, the dense 2:4 weight)."""
    n, k = 48, 64
    w = sparse24.prune(torch.randn(n, k).to(BF16))
    t = sparse24.compress(w)
    x, out = torch.randn(16, k).to(BF16), torch.empty(16, n, dtype=BF16)
    return (x, t.values, t.meta, out, None, n, k, "none", backend), w


def _sparse_args(backend="auto"):
    return _sparse_problem(backend)[0]


# ---- the launchers' checks ----------------------------------------------------------------
@pytest.mark.parametrize("ws,cls,pattern", MALFORMED)
@pytest.mark.parametrize("family", ["gemm", "sparse24"])
def test_launchers_reject_a_malformed_workspace(family, ws, cls, pattern):
    """Before any other argument is looked at (the tensors here are on the CPU: a well-formed
    workspace would get the device error of a / x)."""
    if family == "gemm":
        call = lambda w: _native.gemm(*_gemm_args(), w, 0)   # noqa: E731
    else:
        call = lambda w: _native.sparse24_matmul(*_sparse_args(), w, 0)   # noqa: E731
    with pytest.raises(cls, match=pattern):
        call(ws())
    first = "a" if family == "gemm" else "x"
    for well_formed in (None, torch.empty(4096, dtype=torch.uint8)):
        with pytest.raises(errors.DeviceError, match=rf"^{first}: expected a CUDA tensor"):
            call(well_formed)


def test_launchers_take_the_workspace_before_the_stream():
    with pytest.raises(TypeError):
        _native.gemm(*_gemm_args(), 0)   # the workspace argument is required (None: no workspace)
    with pytest.raises(TypeError):
        _native.sparse24_matmul(*_sparse_args(), 0)


# ---- the planners: the launch's validation ---------------------------------------------------
def test_planners_validate_like_the_launchers():
    with pytest.raises(errors.DeviceError, match=r"^a: expected a CUDA tensor"):
        _native.gemm_workspace(*_gemm_args())
    with pytest.raises(errors.DTypeError, match=r"^b: "):
        _native.gemm_workspace(*_gemm_args(dtype_b=torch.float16))
    with pytest.raises(errors.ArgumentError, match=r"^backend: "):
        _native.gemm_workspace(*_gemm_args(backend="cublas"))
    with pytest.raises(errors.DeviceError, match=r"^x: expected a CUDA tensor"):
        _native.sparse24_matmul_workspace(*_sparse_args())
    x, values, meta, out, bias, n, k, act, backend = _sparse_args()
    with pytest.raises(errors.ArgumentError, match=r"^x: "):
        _native.sparse24_matmul_workspace(x[:, :32], values, meta, out, bias, n, k, act, backend)


# ---- the op layer's wiring ---------------------------------------------------------------
def test_workspace_is_planned_on_the_kernels_devices_only():
    def planner(*args):
        raise AssertionError("planned off CUDA")
    assert _to_native.workspace(planner, torch.device("cpu"), (), (), lambda: None) is None


@pytest.fixture
def cpu_planned(monkeypatch):
    """``_to_native.workspace`` plans CPU calls too (the allocation is then a CPU tensor)."""
    monkeypatch.setattr(_to_native, "_WORKSPACE_DEVICES", ("cuda", "cpu"))


class _PlannedGemm(ContractNative):
    """The contract emulation whose planner asks for ``nbytes``; records plans and workspaces."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.plans, self.workspaces = nbytes, [], []

    def gemm_workspace(self, *args):
        self.plans.append(args)
        return self.nbytes

    def gemm(self, a, b, out, c, bias, aux, alpha, beta, activation, backend, workspace, stream):
        self.workspaces.append(workspace)
        assert self.plans[-1] == (a, b, out, c, bias, aux, alpha, beta, activation, backend)
        return super().gemm(a, b, out, c, bias, aux, alpha, beta, activation, backend, None, stream)


@pytest.mark.parametrize("nbytes", [0, 4096])
def test_gemm_op_allocates_what_the_planner_asks(monkeypatch, cpu_planned, nbytes):
    fake = _PlannedGemm(nbytes)
    monkeypatch.setattr(ops_gemm, "_native", fake)
    a, b = torch.randn(3, 16, 64).to(BF16), torch.randn(64, 32).to(BF16)
    bias = torch.randn(32).to(BF16)
    y = matmul(a, b, bias=bias, activation="relu")
    torch.testing.assert_close(y, torch.relu(a.float() @ b.float() + bias.float()).to(BF16), rtol=2e-2, atol=2e-2)
    assert len(fake.plans) == len(fake.workspaces) == 1
    ws = fake.workspaces[0]
    if nbytes == 0:
        assert ws is None
    else:
        assert ws.dtype == torch.uint8 and tuple(ws.shape) == (nbytes,) and ws.is_contiguous()
        assert ws.device == a.device


class _PlannedSparse:
    """The real extension, except the 2:4 planner (asks for ``nbytes``) and launcher (the fp32
    result through the Rust host decompress; records its workspace)."""

    def __init__(self, nbytes):
        self.nbytes, self.plans, self.workspaces = nbytes, [], []

    def __getattr__(self, name):
        return getattr(_native, name)

    def sparse24_matmul_workspace(self, *args):
        self.plans.append(args)
        return self.nbytes

    def sparse24_matmul(self, x, values, meta, out, bias, n, k, activation, backend, workspace, stream):
        assert self.plans[-1] == (x, values, meta, out, bias, n, k, activation, backend)
        self.workspaces.append(workspace)
        w = torch.empty((n, k), dtype=values.dtype)
        _native.sparse24_decompress_host(values, meta, w)
        out.copy_(x.float() @ w.float().T)
        return "wgmma_sp"


@pytest.mark.parametrize("nbytes", [0, 132 * 128 * 1024 + 132 * 4])
def test_sparse24_op_allocates_what_the_planner_asks(monkeypatch, cpu_planned, nbytes):
    fake = _PlannedSparse(nbytes)
    monkeypatch.setattr(ops_sparse24, "_native", fake)
    (x, values, meta, out, bias, n, k, act, backend), w = _sparse_problem()
    y = ops_sparse24._sparse24_linear_impl(x, values, meta, bias, n, k, act, backend)
    assert y.shape == (16, n) and y.dtype == BF16
    torch.testing.assert_close(y, (x.float() @ w.float().T).to(BF16))
    assert len(fake.plans) == len(fake.workspaces) == 1
    ws = fake.workspaces[0]
    if nbytes == 0:
        assert ws is None
    else:
        assert ws.dtype == torch.uint8 and tuple(ws.shape) == (nbytes,) and ws.device == x.device


def test_planner_argument_errors_name_the_argument():
    """The planners take their launch's leading arguments positionally: a wrong count names the
    planner, a wrong type or an out-of-range int names the argument."""
    a = torch.zeros(1, 64, 64, dtype=torch.float16)
    x = torch.zeros(64, 64, dtype=torch.float16)
    gemm = (a, a, a, None, None, None, 1.0, 0.0, "none", "auto")
    sparse = (x, x, x, x, None, 64, 64, "none", "auto")
    with pytest.raises(errors.ArgumentError, match="gemm_workspace: expected its launch's 10 arguments"):
        _native.gemm_workspace(*gemm[:9])
    with pytest.raises(errors.ArgumentError, match="sparse24_matmul_workspace: expected its launch's 9 arguments"):
        _native.sparse24_matmul_workspace(*sparse, None)
    for i, bad in ((6, "1"), (7, None), (8, None), (9, 3)):
        name = ("alpha", "beta", "activation", "backend")[i - 6]
        with pytest.raises(TypeError, match=f"^{name}: "):
            _native.gemm_workspace(*gemm[:i], bad, *gemm[i + 1:])
    with pytest.raises(OverflowError, match="^n: "):
        _native.sparse24_matmul_workspace(*sparse[:5], 2 ** 63, *sparse[6:])
    with pytest.raises(TypeError, match="^k: "):
        _native.sparse24_matmul_workspace(*sparse[:6], "64", *sparse[7:])
