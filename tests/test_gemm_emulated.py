"""The Python layer of the dense GEMM end to end on CPU, with ``ferroattn._native`` replaced by
:class:`ContractNative`: an emulation of the ``_native.pyi`` "dense GEMM (issue 4)" contract
(the same argument rules, computed with torch in fp32 through the strides it is handed, every
call recorded). What this checks is what Python owns: flattening and broadcasting, the views
handed to the kernels (no copies for transposed operands, batch stride 0 for broadcasts), the
degenerate sizes, ``out=``, and the autograd formulas (against torch's fp32 autograd), which
the GPU tests (test_gpu_gemm.py) then repeat with the real kernels.

The contract emulation is also imported by test_gemm.py / test_nn_linear.py (as a stand-in for
``_native.gemm_check`` while the built extension predates it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ferroattn.ops.gemm as ops_gemm
from ferroattn import errors
from ferroattn.gemm import matmul

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_DTYPE_NAMES = {"float16", "bfloat16"}
_OUT_NAMES = {"float16", "bfloat16", "float32"}


class ContractNative:
    """``gemm_check`` / ``gemm_workspace`` / ``gemm`` / ``gemm_backends`` of the contract, on CPU (device type 1 is
    accepted like CUDA here; every tensor must be on the first one's device)."""

    def __init__(self, backends=("wmma",)):
        self.calls = []
        self.backends = list(backends)

    # -- validation on TensorMeta tuples ---------------------------------------------------
    def gemm_check(self, a, b, out, c, bias, aux, beta, activation):
        for name, t in (("a", a), ("b", b), ("out", out)):
            if t is None or len(t[0]) != 3:
                raise errors.ArgumentError(f"{name}: expected rank 3, got {None if t is None else t[0]}")
        (batch, m, k), (bb, kb, n) = a[0], b[0]
        if min(batch, m, k, n) < 1:
            raise errors.ArgumentError(f"a: expected m, k, batch >= 1, got {a[0]}")
        if bb != batch:
            raise errors.ArgumentError(f"b: expected batch {batch}, got {bb}")
        if kb != k:
            raise errors.ArgumentError(f"b: expected {k} rows (a's k), got {kb}")
        if tuple(out[0]) != (batch, m, n):
            raise errors.ArgumentError(f"out: expected shape {(batch, m, n)}, got {out[0]}")
        if a[2] not in _DTYPE_NAMES:
            raise errors.DTypeError(f"a: expected float16 or bfloat16, got {a[2]}")
        if b[2] != a[2]:
            raise errors.DTypeError(f"b: expected {a[2]} (a's dtype), got {b[2]}")
        if out[2] not in _OUT_NAMES:
            raise errors.DTypeError(f"out: expected float16, bfloat16 or float32, got {out[2]}")
        for name, t in (("a", a), ("b", b)):
            (_, r, cols), (_, rs, cs) = t[0], t[1]
            if not (cs == 1 or rs == 1 or r == 1 or cols == 1):
                raise errors.ArgumentError(f"{name}: expected a unit stride in the last two dims, got {t[1]}")
        for name, t in (("out", out), ("c", c), ("aux", aux)):
            if t is None:
                continue
            if tuple(t[0]) != (batch, m, n):
                raise errors.ArgumentError(f"{name}: expected shape {(batch, m, n)}, got {t[0]}")
            if name != "out" and t[2] != out[2]:
                raise errors.DTypeError(f"{name}: expected {out[2]} (out's dtype), got {t[2]}")
            if n > 1 and t[1][2] != 1:
                raise errors.ArgumentError(f"{name}: expected stride(-1) == 1, got {t[1]}")
            if name != "c" and batch > 1 and t[1][0] == 0:
                raise errors.ArgumentError(f"{name}: expected batch stride != 0, got {t[1]}")
        if beta != 0.0 and c is None:
            raise errors.ArgumentError("c: expected a tensor when beta != 0, got None")
        if bias is not None:
            if tuple(bias[0]) != (n,) or (n > 1 and bias[1] != (1,)):
                raise errors.ArgumentError(f"bias: expected shape ({n},) contiguous, got {bias[0]} {bias[1]}")
            if bias[2] not in (a[2], "float32"):
                raise errors.DTypeError(f"bias: expected {a[2]} or float32, got {bias[2]}")
        for name, t in (("b", b), ("out", out), ("c", c), ("bias", bias), ("aux", aux)):
            if t is not None and t[3] != a[3]:
                raise errors.DeviceError(f"{name}: expected device {a[3]} (a's), got {t[3]}")
        if activation not in ops_gemm.ACTIVATIONS:
            raise errors.ArgumentError(f"activation: expected one of {ops_gemm.ACTIVATIONS}, got {activation!r}")

    # -- the "launch" ------------------------------------------------------------------------
    def gemm_workspace(self, a, b, out, c, bias, aux, alpha, beta, activation, backend):
        return 0   # the emulation needs no split-k / stream-K workspace

    def gemm(self, a, b, out, c, bias, aux, alpha, beta, activation, backend, workspace, stream):
        assert workspace is None or callable(workspace)   # the emulation plans none: never asks
        meta = ops_gemm.tensor_meta
        self.gemm_check(meta(a), meta(b), meta(out), meta(c) if beta != 0.0 else None, meta(bias), meta(aux),
                        beta, activation)
        if backend not in ("auto", *self.backends):
            raise errors.ArgumentError(f"backend: expected one of auto, {', '.join(self.backends)}, got {backend!r}")
        self.calls.append({"a": (a.data_ptr(), tuple(a.shape), a.stride()),
                           "b": (b.data_ptr(), tuple(b.shape), b.stride()),
                           "out": (out.data_ptr(), tuple(out.shape), out.stride()),
                           "alpha": alpha, "beta": beta, "activation": activation, "backend": backend,
                           "c": None if c is None else c.stride(), "bias": bias is not None, "aux": aux is not None})
        pre = alpha * (a.float() @ b.float())
        if beta != 0.0:
            pre = pre + beta * c.float()
        if bias is not None:
            pre = pre + bias.float()
        if aux is not None:
            aux.copy_(pre)
        out.copy_(REF_ACT[activation](pre))
        return self.backends[0] if backend == "auto" else backend

    def gemm_backends(self, device=0):
        return list(self.backends)


def rust_check_or_contract(monkeypatch) -> None:
    """Metadata validation for fake/meta tests: the Rust ``_native.gemm_check`` when the built
    extension has it, else :class:`ContractNative`'s."""
    if not hasattr(ops_gemm._native, "gemm_check"):
        monkeypatch.setattr(ops_gemm, "_native", ContractNative())


@pytest.fixture
def native(monkeypatch):
    fake = ContractNative()
    monkeypatch.setattr(ops_gemm, "_native", fake)
    return fake


def rnd(*shape, dtype=BF16, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


#: Reference activations by op name, straight from torch (independent of ferroattn.ops.gemm.activate).
REF_ACT = {"none": lambda x: x, "relu": torch.relu, "gelu_erf": F.gelu,
           "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def ref_forward(a, b, bias=None, activation="none", alpha=1.0, beta=0.0, c=None):
    """fp32 torch reference of the op (torch.matmul broadcasting for the shapes used here)."""
    pre = alpha * torch.matmul(a.float(), b.float())
    if c is not None and beta != 0.0:
        pre = pre + beta * c.float()
    if bias is not None:
        pre = pre + bias.float()
    return REF_ACT[activation](pre)


def close(got, ref, tol=1e-2):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    got, ref = got.detach(), ref.detach()
    err = float((got.float() - ref.float()).abs().max()) if got.numel() else 0.0
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    assert err <= tol * scale + 1e-5, f"max|err| {err} vs max|ref| {scale}"


# ---- forward ----------------------------------------------------------------------------
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_layouts_are_passed_as_views(native, ta, tb):
    m, n, k = 5, 7, 9
    a = rnd(k, m).T if ta else rnd(m, k)
    b = rnd(n, k).T if tb else rnd(k, n)
    out = matmul(a, b)
    close(out, ref_forward(a, b))
    (call,) = native.calls
    assert call["a"][0] == a.data_ptr() and call["b"][0] == b.data_ptr()  # no copies
    assert call["a"][2][1:] == a.stride() and call["b"][2][1:] == b.stride()


def test_fully_strided_operand_is_copied(native):
    a = rnd(6, 16)[:, ::2]  # no unit stride
    b = rnd(8, 3)
    close(matmul(a, b), ref_forward(a, b))
    assert native.calls[0]["a"][0] != a.data_ptr() and native.calls[0]["a"][2][1:] == (8, 1)


def test_leading_dims_and_broadcast_b(native):
    a, b = rnd(2, 3, 5, 4), rnd(4, 6)
    out = matmul(a, b)
    assert out.shape == (2, 3, 5, 6) and out.is_contiguous()
    close(out, ref_forward(a, b))
    call = native.calls[0]
    assert call["a"][1] == (6, 5, 4) and call["b"][1] == (6, 4, 6) and call["b"][2][0] == 0
    assert call["b"][0] == b.data_ptr()


def test_batched_b_and_broadcast_a(native):
    a, b = rnd(5, 4), rnd(3, 4, 6)
    out = matmul(a, b)
    assert out.shape == (3, 5, 6)
    close(out, ref_forward(a, b))
    assert native.calls[0]["a"][2][0] == 0 and native.calls[0]["a"][0] == a.data_ptr()
    a1 = rnd(1, 1, 5, 4)
    assert matmul(a1, b).shape == (1, 3, 5, 6)  # torch.broadcast_shapes((1, 1), (3,))


def test_batched_b_matches_flattened_leading_dims(native):
    a, b = rnd(2, 3, 5, 4), rnd(6, 4, 7)
    out = matmul(a, b)
    assert out.shape == (2, 3, 5, 7)
    close(out, torch.matmul(a.float().reshape(6, 5, 4), b.float()).reshape(2, 3, 5, 7))


def test_batch_mismatch_names_b(native):
    with pytest.raises(errors.ArgumentError, match=r"^b: expected a batch of 6"):
        matmul(rnd(2, 3, 5, 4), rnd(4, 4, 7))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_dtype", [None, BF16, FP32])
def test_epilogue(native, activation, bias_dtype):
    a, b = rnd(2, 5, 8), rnd(8, 6)
    bias = None if bias_dtype is None else rnd(6, dtype=bias_dtype)
    c = rnd(2, 5, 6, dtype=FP32)
    out = matmul(a, b, bias=bias, activation=activation, alpha=0.5, beta=-2.0, c=c, out_dtype=FP32)
    act = ops_gemm.public_activation(activation)
    close(out, ref_forward(a, b, bias, act, 0.5, -2.0, c))
    assert native.calls[0]["activation"] == act


def test_c_broadcast_over_batch_and_ignored_when_beta_zero(native):
    a, b, c = rnd(3, 5, 8), rnd(8, 6), rnd(5, 6)
    close(matmul(a, b, c=c, beta=1.0), ref_forward(a, b, c=c, beta=1.0))
    assert native.calls[0]["c"][0] == 0
    nan_c = torch.full((5, 6), float("nan"), dtype=BF16)
    out = matmul(a, b, c=nan_c, beta=0.0)  # beta == 0: c is never read (as cuBLAS / torch.addmm)
    assert torch.isfinite(out).all() and native.calls[1]["c"] is None


def test_c_column_major_is_copied_to_rows(native):
    a, b = rnd(5, 8), rnd(8, 6)
    c = rnd(6, 5).T
    close(matmul(a, b, c=c, beta=1.0), ref_forward(a, b, c=c, beta=1.0))
    assert native.calls[0]["c"][-1] == 1


@pytest.mark.parametrize("shape", [(0, 4, 5, 3), (2, 0, 5, 3), (2, 4, 5, 0)])
def test_empty_outputs_launch_nothing(native, shape):
    batch, m, k, n = shape
    out = matmul(rnd(batch, m, k), rnd(k, n))
    assert out.shape == (batch, m, n) and native.calls == []


def test_k_zero_is_the_epilogue_of_zero(native):
    a, b = rnd(2, 4, 0), rnd(0, 3)
    out = matmul(a, b)
    assert out.shape == (2, 4, 3) and torch.equal(out, torch.zeros(2, 4, 3, dtype=BF16))
    assert torch.equal(out, torch.matmul(a, b))
    bias, c = rnd(3, dtype=FP32), rnd(4, 3, dtype=FP32)
    out = matmul(a, b, bias=bias, c=c, beta=2.0, activation="silu", out_dtype=FP32)
    torch.testing.assert_close(out, F.silu(2.0 * c.float() + bias).expand(2, 4, 3), rtol=1e-6, atol=1e-7)
    assert native.calls == []


def test_k_zero_still_validates(native):
    with pytest.raises(errors.DTypeError, match=r"^b: "):
        matmul(rnd(2, 4, 0), rnd(0, 3, dtype=FP16))
    with pytest.raises(errors.ArgumentError, match=r"^bias: "):
        matmul(rnd(2, 4, 0), rnd(0, 3), bias=rnd(4))


def test_out_preallocated(native):
    a, b = rnd(2, 5, 8), rnd(8, 6)
    out = torch.empty(2, 5, 6, dtype=FP32)
    res = matmul(a, b, out=out)
    assert res is out
    close(out, ref_forward(a, b))
    assert native.calls[0]["out"][0] == out.data_ptr()  # written in place


def test_out_without_row_view_goes_through_a_copy(native):
    a, b = rnd(2, 5, 8), rnd(8, 6)
    out = torch.zeros(2, 6, 5, dtype=BF16).transpose(1, 2)
    matmul(a, b, out=out)
    close(out, ref_forward(a, b))
    assert native.calls[0]["out"][0] != out.data_ptr()


def test_out_errors(native):
    a, b = rnd(2, 5, 8), rnd(8, 6)
    with pytest.raises(errors.ArgumentError, match=r"^out: expected shape \(2, 5, 6\)"):
        matmul(a, b, out=torch.empty(2, 5, 7))
    with pytest.raises(errors.DTypeError, match=r"^out_dtype: "):
        matmul(a, b, out=torch.empty(2, 5, 6), out_dtype=BF16)
    with pytest.raises(errors.ArgumentError, match=r"^out: .*automatic differentiation"):
        matmul(a.requires_grad_(), b, out=torch.empty(2, 5, 6))
    with torch.no_grad():
        matmul(a, b, out=torch.empty(2, 5, 6))


def test_backend_is_forwarded(native):
    matmul(rnd(3, 4), rnd(4, 5), backend="wmma")
    assert native.calls[0]["backend"] == "wmma"
    with pytest.raises(errors.ArgumentError, match=r"^backend: "):
        matmul(rnd(3, 4), rnd(4, 5), backend="sm90")  # the emulated GPU has wmma only


# ---- autograd ---------------------------------------------------------------------------
def _grads(fn, tensors):
    return torch.autograd.grad(fn(), [t for t in tensors if t.requires_grad])


def _ref_leaves(tensors):
    return [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize("activation", ["none", "relu", "gelu_erf", "gelu_tanh", "silu"])
@pytest.mark.parametrize("case", ["plain", "broadcast_b", "broadcast_a", "batched"])
def test_gradients_match_fp32_autograd(native, activation, case):
    torch.manual_seed(0)
    shapes = {"plain": ((5, 8), (8, 6)), "broadcast_b": ((2, 3, 5, 8), (8, 6)),
              "broadcast_a": ((5, 8), (4, 8, 6)), "batched": ((4, 5, 8), (4, 8, 6))}[case]
    a, b = rnd(*shapes[0], grad=True), rnd(*shapes[1], grad=True)
    bias = rnd(6, dtype=FP32, grad=True)
    out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (5, 6)
    c = rnd(*out_shape, grad=True)
    dout = torch.randn(out_shape)
    act = None if activation == "none" else {"gelu_erf": "gelu"}.get(activation, activation)

    def ours():
        return (matmul(a, b, bias=bias, activation=act, alpha=0.75, beta=0.5, c=c).float() * dout).sum()

    ra, rb, rbias, rc = _ref_leaves([a, b, bias, c])

    def ref():
        return (ref_forward(ra, rb, rbias, activation, 0.75, 0.5, rc) * dout).sum()

    got = _grads(ours, [a, b, bias, c])
    want = _grads(ref, [ra, rb, rbias, rc])
    for g, w, t in zip(got, want, (a, b, bias, c)):
        assert g.shape == t.shape and g.dtype == t.dtype
        close(g, w, tol=2e-2)


def test_backward_uses_transposed_views_not_copies(native):
    a, b = rnd(5, 8, grad=True), rnd(8, 6, grad=True)
    matmul(a, b, activation="gelu").sum().backward()
    fwd, d1, d2 = native.calls
    assert fwd["aux"] and fwd["activation"] == "gelu_erf"
    # da = dpre @ b^T: b read in place, transposed (column-major)
    assert d1["b"][0] == b.data_ptr() and d1["b"][2][1:] == (1, 6)
    # db = a^T @ dpre: a read in place, transposed
    assert d2["a"][0] == a.data_ptr() and d2["a"][2][1:] == (1, 8)
    assert d1["activation"] == d2["activation"] == "none" and not d1["aux"]


def test_broadcast_b_gradient_is_one_gemm_over_all_rows(native):
    a, b = rnd(4, 5, 8, grad=True), rnd(8, 6, grad=True)
    matmul(a, b).sum().backward()
    db_call = native.calls[-1]
    assert db_call["a"][1] == (1, 8, 20) and db_call["a"][0] == a.data_ptr()  # k = batch * m


def test_no_aux_without_grad_and_recomputed_when_missing(native):
    a, b = rnd(5, 8, grad=True), rnd(8, 6, grad=True)
    with torch.no_grad():
        matmul(a, b, activation="silu")
    assert not native.calls[0]["aux"]
    # calling the op directly with with_aux=False: the backward recomputes the pre-activation
    out, aux = torch.ops.ferroattn.gemm(a, b, None, None, 1.0, 0.0, "silu", None, "auto", False)
    assert aux.shape == (0,)
    (ga,) = torch.autograd.grad(out.float().sum(), [a])
    ra, rb = _ref_leaves([a, b])
    (wa,) = torch.autograd.grad(F.silu(ra @ rb).sum(), [ra])
    close(ga, wa, tol=2e-2)


def test_aux_output_is_differentiable(native):
    a, b = rnd(5, 8, grad=True), rnd(8, 6, grad=True)
    out, aux = torch.ops.ferroattn.gemm(a, b, None, None, 1.0, 0.0, "relu", None, "auto", True)
    assert aux.shape == out.shape
    (ga,) = torch.autograd.grad(aux.float().sum() + out.float().sum(), [a])
    ra, rb = _ref_leaves([a, b])
    pre = ra @ rb
    (wa,) = torch.autograd.grad(pre.sum() + torch.relu(pre).sum(), [ra])
    close(ga, wa, tol=2e-2)


def test_gradient_of_ignored_c_is_zero(native):
    a, b, c = rnd(5, 8, grad=True), rnd(8, 6, grad=True), rnd(5, 6, grad=True)
    (gc,) = torch.autograd.grad(matmul(a, b, c=c, beta=0.0).float().sum(), [c])
    assert torch.equal(gc, torch.zeros_like(c))


def test_k_zero_gradients(native):
    a, b = rnd(5, 0, grad=True), rnd(0, 6, grad=True)
    bias = rnd(6, grad=True)
    ga, gb, gbias = torch.autograd.grad(matmul(a, b, bias=bias).float().sum(), [a, b, bias])
    assert ga.shape == (5, 0) and gb.shape == (0, 6)
    assert torch.equal(gbias.float(), torch.full((6,), 5.0))


def test_fp32_output_gradient(native):
    a, b = rnd(5, 8, grad=True), rnd(8, 6, grad=True)
    out = matmul(a, b, out_dtype=FP32)
    assert out.dtype == FP32
    ga, gb = torch.autograd.grad(out.sum(), [a, b])
    assert ga.dtype == BF16 and gb.dtype == BF16
    close(ga, torch.ones(5, 6) @ b.float().T)


def test_nothing_is_launched_for_unneeded_gradients(native):
    a, b = rnd(5, 8, grad=True), rnd(8, 6)
    matmul(a, b).sum().backward()
    assert len(native.calls) == 2 and b.grad is None  # forward + da only

