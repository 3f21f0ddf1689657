"""The split-k / stream-K workspace of the dense GEMM and 2:4 launchers without a GPU
(src/ops/workspace.rs; the sizes of the plans are Rust unit tests beside the code:
``plans_size_their_workspace``, ``wgmma_plans_size_their_workspace``, ``ops::workspace::tests``).

Checked here: the native launchers reject a malformed workspace tensor with an error naming
``workspace`` before anything else (dtype, rank, contiguity: on any device); the planners
(``_native.gemm_workspace``, ``_native.sparse24_matmul_workspace``) run the launch's validation and
raise its errors; and the op layer's wiring: the ops pass their allocator
(ferroattn.ops._to_native.allocate_workspace, one uint8 tensor on the call's device) as the
launcher's workspace argument, just before the stream, and the launch validates before it asks
(emulated launchers where a GPU would be needed)."""
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
def test_allocate_workspace_is_one_uint8_tensor_on_the_device():
    """What the launchers call (here on CPU through a patched device constructor: the same torch
    call, the bytes and dtype the launch asked for)."""
    made = []
    real_empty = torch.empty

    def spy_empty(n, dtype, device):
        made.append((n, dtype, device))
        return real_empty(n, dtype=dtype)

    old = torch.empty
    torch.empty = spy_empty
    try:
        t = _to_native.allocate_workspace(4096, 1)
    finally:
        torch.empty = old
    assert made == [(4096, torch.uint8, torch.device("cuda", 1))] and t.dtype == torch.uint8 and t.numel() == 4096


class _AllocatingGemm(ContractNative):
    """The contract emulation whose launch plans ``nbytes`` and asks the op's allocator for them,
    as the Rust launch does (ops::workspace::Source::Alloc); records what it got."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.workspaces = nbytes, []

    def gemm(self, a, b, out, c, bias, aux, alpha, beta, activation, backend, workspace, stream):
        assert workspace is _to_native.allocate_workspace            # the op passes its allocator
        self.workspaces.append(torch.empty(self.nbytes, dtype=torch.uint8) if self.nbytes else None)
        return super().gemm(a, b, out, c, bias, aux, alpha, beta, activation, backend, None, stream)


@pytest.mark.parametrize("nbytes", [0, 4096])
def test_gemm_op_passes_its_allocator_to_the_launch(monkeypatch, nbytes):
    fake = _AllocatingGemm(nbytes)
    monkeypatch.setattr(ops_gemm, "_native", fake)
    a, b = torch.randn(3, 16, 64).to(BF16), torch.randn(64, 32).to(BF16)
    bias = torch.randn(32).to(BF16)
    y = matmul(a, b, bias=bias, activation="relu")
    torch.testing.assert_close(y, torch.relu(a.float() @ b.float() + bias.float()).to(BF16), rtol=2e-2, atol=2e-2)
    assert len(fake.workspaces) == 1


class _AllocatingSparse:
    """The real extension, except the 2:4 launcher (the fp32 result through the Rust host
    decompress; checks that it got the op's allocator)."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(_native, name)

    def sparse24_matmul(self, x, values, meta, out, bias, n, k, activation, backend, workspace, stream):
        assert workspace is _to_native.allocate_workspace
        self.calls += 1
        w = torch.empty((n, k), dtype=values.dtype)
        _native.sparse24_decompress_host(values, meta, w)
        out.copy_(x.float() @ w.float().T)
        return "wgmma_sp"


def test_sparse24_op_passes_its_allocator_to_the_launch(monkeypatch):
    fake = _AllocatingSparse()
    monkeypatch.setattr(ops_sparse24, "_native", fake)
    (x, values, meta, out, bias, n, k, act, backend), w = _sparse_problem()
    y = ops_sparse24._sparse24_linear_impl(x, values, meta, bias, n, k, act, backend)
    assert y.shape == (16, n) and y.dtype == BF16 and fake.calls == 1
    torch.testing.assert_close(y, (x.float() @ w.float().T).to(BF16))


def test_launchers_take_an_allocator_and_validate_before_calling_it():
    """The native launch with an allocator validates first: CPU tensors get the device error of
    a / x and the allocator is never called."""
    calls = []

    def alloc(n, device):
        calls.append((n, device))
        return torch.empty(n, dtype=torch.uint8)

    with pytest.raises(errors.DeviceError, match="^a: expected a CUDA tensor"):
        _native.gemm(*_gemm_args(), alloc, 0)
    with pytest.raises(errors.DeviceError, match="^x: expected a CUDA tensor"):
        _native.sparse24_matmul(*_sparse_args(), alloc, 0)
    assert calls == []


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
