"""GPU tests of the dense GEMM (``-m gpu``; skipped without CUDA): ``ferroattn.matmul`` against
the fp32 torch reference (pass rule: max|ours − ref| <= 1e-2 · max|ref|), every layout NN/NT/TN/TT
by strides, fp16/bf16 in, fp16/bf16/fp32 out, every epilogue (bias, activation, alpha/beta/C),
tails, huge batch counts and broadcasts, leading dims, any alignment, 64-bit offsets, the
degenerate sizes, every output element written, gradients against fp32 autograd, nn.Linear
against torch.nn.Linear, torch.compile(fullgraph=True), CUDA-graph capture, streams, opcheck,
errors followed by valid calls.

Runtime on an H200: about 1-2 min after the kernels are compiled (cold JIT cache: + one NVRTC
compile per kernel configuration hit), of which the inductor compile is ~30-60 s."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import ferroattn.ops.gemm as ops_gemm
from ferroattn import errors
from ferroattn.gemm import matmul

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, FP16]
DEV = "cuda"
TAILS = (1, 3, 17, 127, 1000, 1001)
LAYOUTS = ("NN", "NT", "TN", "TT")
TOL = 1e-2
#: Reference activations (torch's own functions) by public name.
REF_ACT = {None: lambda x: x, "relu": torch.relu, "gelu": F.gelu,
           "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def rnd(*shape, dtype=BF16, grad=False, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype).requires_grad_(grad)


def operand(rows, cols, layout, dtype=BF16, batch=(), grad=False):
    """A (..., rows, cols) matrix, row-major ("N") or column-major ("T": the transposed view of a
    row-major (..., cols, rows) tensor)."""
    if layout == "N":
        return rnd(*batch, rows, cols, dtype=dtype, grad=grad)
    t = rnd(*batch, cols, rows, dtype=dtype).transpose(-1, -2)
    return t.detach().requires_grad_(grad) if grad else t


def ref(a, b, bias=None, activation=None, alpha=1.0, beta=0.0, c=None):
    """fp32 reference of act(alpha·a@b + beta·c + bias) (the inputs' values, computed in fp32;
    differentiable)."""
    pre = alpha * torch.matmul(a.float(), b.float())
    if c is not None and beta != 0.0:
        pre = pre + beta * c.float()
    if bias is not None:
        pre = pre + bias.float()
    return REF_ACT[activation](pre)


def close_err(got, want) -> tuple[float, float]:
    got, want = got.detach().float(), want.detach().float()
    if got.numel() == 0:
        return 0.0, 0.0
    return float((got - want).abs().max()), float(want.abs().max())


def assert_close(got, want, tol=TOL, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got.detach().float()).all(), f"{what}: non-finite values"
    err, scale = close_err(got, want)
    assert err <= tol * scale + 1e-6, f"{what}: max|err| {err:.3e} > {tol} * max|ref| {scale:.3e}"


def backends():
    return list(ops_gemm._native.gemm_backends(torch.cuda.current_device() if DEV == "cuda" else 0))


# ---- layouts, dtypes, tails --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tails_every_layout(dtype, layout):
    """Every (m, n, k) in TAILS³, written into a NaN-filled ``out`` (every element must be written)."""
    torch.manual_seed(0)
    failures = []
    for m, n, k in itertools.product(TAILS, TAILS, TAILS):
        a, b = operand(m, k, layout[0], dtype), operand(k, n, layout[1], dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        matmul(a, b, out=out)
        err, scale = close_err(out, ref(a, b))
        if not (err <= TOL * scale + 1e-6):  # also catches NaN (unwritten)
            failures.append((m, n, k, err, scale))
    assert not failures, f"{len(failures)} shapes fail, first: (m, n, k, err, max|ref|) = {failures[:5]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, FP16, BF16, FP32])
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_out_dtypes(dtype, out_dtype, layout):
    torch.manual_seed(1)
    a, b = operand(127, 1000, layout[0], dtype), operand(1000, 1001, layout[1], dtype)
    out = matmul(a, b, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or dtype) and out.shape == (127, 1001) and out.is_contiguous()
    assert_close(out, ref(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_dtype", [None, "same", FP32])
@pytest.mark.parametrize("scaled", [False, True])
def test_epilogues(dtype, activation, bias_dtype, scaled):
    torch.manual_seed(2)
    m, n, k = 1001, 127, 1000
    a, b = rnd(m, k, dtype=dtype), rnd(k, n, dtype=dtype, scale=k ** -0.5)
    bias = None if bias_dtype is None else rnd(n, dtype=dtype if bias_dtype == "same" else FP32)
    alpha, beta = (0.75, -1.5) if scaled else (1.0, 0.0)
    c = rnd(m, n, dtype=FP32) if scaled else None
    out_dtype = FP32 if scaled else None
    out = matmul(a, b, bias=bias, activation=activation, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype)
    assert_close(out, ref(a, b, bias, activation, alpha, beta, c))


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_epilogue_c_broadcast_and_transposed_layouts(activation):
    torch.manual_seed(3)
    a, b = operand(17, 1000, "T", batch=(3,)), operand(1000, 127, "T", batch=(3,))
    c, bias = rnd(17, 127), rnd(127)
    out = matmul(a, b, c=c, beta=2.0, bias=bias, activation=activation, alpha=0.5)
    assert_close(out, ref(a, b, bias, activation, 0.5, 2.0, c))


@pytest.mark.parametrize("out_dtype", [BF16, FP32])
def test_aux_is_the_pre_activation(out_dtype):
    torch.manual_seed(16)
    a, b, bias = rnd(2, 127, 1000), rnd(1000, 129, scale=1000 ** -0.5), rnd(129, dtype=FP32)
    c = rnd(2, 127, 129, dtype=out_dtype)
    out, aux = torch.ops.ferroattn.gemm(a, b, bias, c, 0.5, 1.5, "gelu_tanh", out_dtype, "auto", True)
    assert aux.shape == out.shape == (2, 127, 129) and aux.dtype == out_dtype
    assert_close(aux, ref(a, b, bias, None, 0.5, 1.5, c), what="aux")
    assert_close(out, ref(a, b, bias, "gelu_tanh", 0.5, 1.5, c), what="out")


def test_beta_zero_never_reads_c():
    a, b = rnd(17, 64), rnd(64, 33)
    c = torch.full((17, 33), float("nan"), dtype=BF16, device=DEV)
    assert_close(matmul(a, b, c=c, beta=0.0), ref(a, b))


def test_deterministic():
    a, b = rnd(1000, 1001), rnd(1001, 127)
    assert torch.equal(matmul(a, b, activation="silu"), matmul(a, b, activation="silu"))


# ---- batches, broadcasts, leading dims, offsets -------------------------------------------
@pytest.mark.parametrize("case", ["broadcast_b", "batched_b", "broadcast_a"])
def test_batch_65536(case):
    torch.manual_seed(4)
    batch, m, k, n = 65536, 3, 17, 5
    a = rnd(m, k) if case == "broadcast_a" else rnd(batch, m, k)
    b = rnd(k, n) if case == "broadcast_b" else rnd(batch, k, n)
    bias = rnd(n)
    out = matmul(a, b, bias=bias, activation="relu")
    assert out.shape == (batch, m, n)
    assert_close(out, ref(a, b, bias, "relu"))


def test_wmma_batch_65600_interior_tiles():
    """wmma backend, batch 65600 > 65535 grid rows of interior tiles only (m 128, n 256: one
    128 x 256 default tile; k 64: one 64-deep k tile). On sm_90a the default tile is persistent:
    each CTA loops over (batch entry, tile) items with its mbarrier phases continuing across them
    and the next item's copies issued under the current one's epilogue; on other archs blocks with
    blockIdx.y < 65 run a second batch entry z = y + 65535 (the __syncthreads loop). a is an overlapping strided
    view (entry z = rows z .. z + 127 of one (65727, 64) matrix, batch stride 64 elements), so
    every entry differs (a stale ring slot from entry z - 65535 gives a wrong result) while a
    takes 8 MB; b (64, 256) is broadcast (batch stride 0); out (65600, 128, 256) bf16 is 4.0 GiB.
    Checked against the fp32 torch reference on every entry of the blocks with a second entry
    (z < 65 and z >= 65535) and on a few in between."""
    if "wmma" not in backends():
        pytest.skip("wmma backend not supported on this device")
    torch.manual_seed(11)
    batch, m, n, k = 65600, 128, 256, 64
    rows = rnd(batch + m - 1, k)
    a = rows.as_strided((batch, m, k), (k, k, 1))
    b = rnd(k, n, scale=k ** -0.5)
    out = matmul(a, b, backend="wmma")
    assert out.shape == (batch, m, n)
    second = batch - 65535
    idx = torch.cat([torch.arange(0, second + 1), torch.arange(30000, 30004),
                     torch.arange(65535 - 2, batch)]).to(DEV)
    assert_close(out[idx], ref(a[idx], b), what="batch entries of blocks with two entries")
    del rows, a, out
    torch.cuda.empty_cache()


def test_batch_2_pow_20():
    torch.manual_seed(5)
    a, b = rnd(2 ** 20, 2, 8), rnd(2 ** 20, 8, 3)
    assert_close(matmul(a, b), ref(a, b))


def test_leading_dims():
    torch.manual_seed(6)
    a = rnd(2, 3, 127, 64)
    for b in (rnd(64, 17), rnd(6, 64, 17), rnd(1, 64, 17)):
        out = matmul(a, b)
        assert out.shape == (2, 3, 127, 17)
        assert_close(out, torch.matmul(a.float().reshape(6, 127, 64), b.float()).reshape(2, 3, 127, 17))
    # permuted leading dims (not flattenable into one batch stride): copied, same result
    ap, b = rnd(3, 2, 127, 64).transpose(0, 1), rnd(64, 17)
    assert_close(matmul(ap, b), ref(ap, b))


def test_64bit_offsets():
    """a and out of 2**31 elements (4 GiB each in bf16): the last batch entries lie beyond 2**31
    elements from the base pointer."""
    torch.manual_seed(7)
    batch, m, k, n = 2 ** 17, 128, 128, 128
    a = torch.empty(batch, m, k, dtype=BF16, device=DEV)
    a[-4:] = rnd(4, m, k)
    a[:4] = rnd(4, m, k)
    b = rnd(k, n)
    out = matmul(a[:, :, :], b)  # uninitialised middle entries are computed and ignored
    for idx in (slice(0, 4), slice(batch - 4, batch)):
        assert_close(out[idx], ref(a[idx], b), what=f"batch {idx}")
    del a, out
    torch.cuda.empty_cache()


def test_any_alignment():
    torch.manual_seed(8)
    buf = rnd(130, 66)
    a = buf[1:128, 1:65]                     # 2-byte offset, row stride 66 elements
    b = rnd(65, 34)[1:, 1:33]                # (64, 32) at an odd offset
    bias = rnd(33)[1:]
    c = rnd(128, 33, dtype=FP32)[1:, 1:]     # (127, 32)
    out_buf = torch.full((127 * 32 + 1,), float("nan"), dtype=FP32, device=DEV)
    out = out_buf[1:].view(127, 32)
    matmul(a, b, bias=bias, c=c, beta=1.0, activation="silu", out=out)
    assert_close(out, ref(a, b, bias, "silu", 1.0, 1.0, c))


def test_fully_strided_operand_is_copied():
    a, b = rnd(64, 256)[:, ::2], rnd(128, 96)[:, ::3]
    assert a.stride(-1) != 1 and a.stride(-2) != 1
    assert_close(matmul(a, b), ref(a, b))


# ---- degenerate sizes -----------------------------------------------------------------------
def test_k_zero():
    a, b = rnd(4, 7, 0), rnd(0, 5)
    out = matmul(a, b)
    assert torch.equal(out, torch.matmul(a, b)) and torch.equal(out, torch.zeros(4, 7, 5, dtype=BF16, device=DEV))
    bias, c = rnd(5, dtype=FP32), rnd(7, 5, dtype=FP32)
    out = matmul(a, b, bias=bias, c=c, beta=0.5, activation="gelu", out_dtype=FP32)
    assert_close(out, F.gelu(0.5 * c + bias).expand(4, 7, 5))


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [((0, 7, 9), (9, 5), (0, 7, 5)), ((7, 9), (9, 0), (7, 0)),
                                                       ((0, 9), (9, 5), (0, 5))])
def test_empty(a_shape, b_shape, out_shape):
    out = matmul(rnd(*a_shape), rnd(*b_shape), bias=rnd(b_shape[-1]), activation="relu")
    assert out.shape == out_shape


# ---- backends -------------------------------------------------------------------------------
def test_every_supported_backend():
    names = backends()
    assert names and set(names) <= {"wmma", "sm90"}
    torch.manual_seed(9)
    for name in names + ["auto"]:
        for layout in LAYOUTS:
            # 16-byte aligned rows and columns (every backend's fast path), tails in m, n and k
            a, b, bias = operand(1000, 1000, layout[0]), operand(1000, 136, layout[1]), rnd(136)
            assert_close(matmul(a, b, bias=bias, activation="gelu", backend=name), ref(a, b, bias, "gelu"),
                         what=f"{name} {layout}")
            # n = 127: rows of b / out not 16-byte aligned; "auto" and wmma run it, sm90 refuses it
            # by name (the contract: an explicit backend that cannot run a problem is an ArgumentError)
            a, b, bias = operand(1001, 1000, layout[0]), operand(1000, 127, layout[1]), rnd(127)
            if name == "sm90":
                with pytest.raises(errors.ArgumentError, match="backend"):
                    matmul(a, b, bias=bias, activation="gelu", backend=name)
                continue
            assert_close(matmul(a, b, bias=bias, activation="gelu", backend=name), ref(a, b, bias, "gelu"),
                         what=f"{name} {layout} n=127")


# ---- autograd -------------------------------------------------------------------------------
def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("case", ["plain", "layout_TT", "broadcast_b", "broadcast_a", "batched"])
def test_gradients(dtype, activation, case):
    torch.manual_seed(10)
    m, k, n = 127, 1000, 65
    lay = "TT" if case == "layout_TT" else "NN"
    batch_a = {"broadcast_b": (2, 3), "batched": (4,)}.get(case, ())
    batch_b = {"broadcast_a": (4,), "batched": (4,)}.get(case, ())
    a = operand(m, k, lay[0], dtype, batch_a, grad=True)
    b = (operand(k, n, lay[1], dtype, batch_b) * k ** -0.5).detach().requires_grad_()
    bias = rnd(n, dtype=FP32, grad=True)
    out_shape = torch.broadcast_shapes(batch_a, batch_b) + (m, n)
    c = rnd(*out_shape, dtype=dtype, grad=True)
    dout = rnd(*out_shape, dtype=FP32)
    out = matmul(a, b, bias=bias, activation=activation, alpha=0.5, beta=0.25, c=c)
    got = _grads((out.float() * dout).sum(), [a, b, bias, c])
    leaves = [t.detach().float().requires_grad_() for t in (a, b, bias, c)]
    want = _grads((ref(*leaves[:2], leaves[2], activation, 0.5, 0.25, leaves[3]) * dout).sum(), leaves)
    for name, g, w, t in zip(("a", "b", "bias", "c"), got, want, (a, b, bias, c)):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert_close(g, w, what=f"d{name}")


def test_gradients_fp32_out_and_partial_requires_grad():
    torch.manual_seed(11)
    a, b = rnd(33, 64, grad=True), rnd(64, 17)
    out = matmul(a, b, out_dtype=FP32)
    (ga,) = torch.autograd.grad(out.sum(), [a])
    assert_close(ga, torch.ones(33, 17, device=DEV) @ b.float().T)


# ---- nn.Linear --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_nn_linear_matches_torch(dtype, bias):
    from ferroattn.nn import Linear
    torch.manual_seed(12)
    lin = torch.nn.Linear(1000, 127, bias=bias, device=DEV, dtype=dtype)
    ours = Linear(1000, 127, bias=bias, device=DEV, dtype=dtype)
    ours.load_state_dict(lin.state_dict())
    x = rnd(2, 33, 1000, dtype=dtype, grad=True)
    x_ref = x.detach().float().requires_grad_()
    ref_lin = torch.nn.Linear(1000, 127, bias=bias, device=DEV)
    ref_lin.load_state_dict({k: v.float() for k, v in lin.state_dict().items()})
    y, y_ref = ours(x), ref_lin(x_ref)
    assert y.dtype == dtype
    assert_close(y, y_ref)
    dy = rnd(2, 33, 127, dtype=FP32)
    got = _grads((y.float() * dy).sum(), [x, ours.weight, ours.bias])
    want = _grads((y_ref * dy).sum(), [x_ref, ref_lin.weight, ref_lin.bias])
    for g, w in zip(got, want):
        assert_close(g, w)


def test_nn_linear_from_torch_activation_and_autocast():
    from ferroattn.nn import Linear
    torch.manual_seed(13)
    lin = torch.nn.Linear(256, 64, device=DEV, dtype=BF16)
    ours = Linear.from_torch(lin, activation="silu")
    assert ours.weight is lin.weight
    x = rnd(5, 256)
    assert_close(ours(x), F.silu(ref(x, lin.weight.T, lin.bias)))
    fp32 = Linear(256, 64, device=DEV)
    x32 = rnd(5, 256, dtype=FP32)
    with torch.autocast("cuda", dtype=BF16):
        y = fp32(x32)
    assert y.dtype == BF16
    assert_close(y, ref(x32.to(BF16), fp32.weight.to(BF16).T, fp32.bias.to(BF16)), what="autocast")


# ---- torch.compile, CUDA graphs, streams --------------------------------------------------------
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward(backend):
    from ferroattn.nn import Linear
    torch._dynamo.reset()
    torch.manual_seed(14)
    mlp = torch.nn.Sequential(Linear(256, 512, activation="gelu", device=DEV, dtype=BF16),
                              Linear(512, 256, device=DEV, dtype=BF16))
    x = rnd(8, 64, 256, grad=True)
    eager = mlp(x)
    (g_eager,) = torch.autograd.grad(eager.float().sum(), [x])
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    out = compiled(x)
    (g_comp,) = torch.autograd.grad(out.float().sum(), [x])
    assert_close(out, eager.float(), tol=1e-2)
    assert_close(g_comp, g_eager.float(), tol=1e-2)


def test_cuda_graph_capture_and_replay():
    torch.manual_seed(15)
    a, b, bias = rnd(127, 1000), rnd(1000, 129), rnd(129)
    matmul(a, b, bias=bias, activation="gelu")  # compile the kernel outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g):
        out = matmul(a, b, bias=bias, activation="gelu")
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        a.copy_(rnd(127, 1000))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, ref(a, b, bias, "gelu"))


def test_side_stream():
    a, b = rnd(1001, 1000), rnd(1000, 127)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = matmul(a, b)
    s.synchronize()
    assert_close(out, ref(a, b))


# ---- errors, then a valid call ------------------------------------------------------------------
def test_rejected_calls_then_a_valid_one():
    a, b = rnd(33, 64), rnd(64, 17)
    bad = [
        (errors.DTypeError, lambda: matmul(a.float(), b.float())),
        (errors.ArgumentError, lambda: matmul(a, rnd(65, 17))),
        (errors.DeviceError, lambda: matmul(a, b.cpu())),
        (errors.DTypeError, lambda: matmul(a, b, bias=rnd(17, dtype=FP16))),
        (errors.ArgumentError, lambda: matmul(a, b, backend="nope")),
        (errors.ArgumentError, lambda: matmul(a, b, out=a[:, :17])),  # out overlaps a
    ]
    for cls, call in bad:
        with pytest.raises(cls):
            call()
        torch.cuda.synchronize()  # no sticky error
        assert_close(matmul(a, b), ref(a, b))


def test_unsupported_explicit_backend_names_backend():
    missing = [name for name in ("wmma", "sm90") if name not in backends()]
    if not missing:
        pytest.skip("every backend is supported on this GPU")
    with pytest.raises(errors.ArgumentError, match=r"^backend: "):
        matmul(rnd(33, 64), rnd(64, 17), backend=missing[0])


def test_auto_picks_the_fastest_backend_and_falls_back():
    """An aligned problem runs on the first (fastest) supported backend under "auto"; a problem
    the sm90 path cannot take (rows not 16-byte aligned: no TMA) raises ArgumentError naming
    ``backend`` when "sm90" is asked for, and runs on wmma under "auto"."""
    names = backends()
    a, b = rnd(256, 512), rnd(512, 256)
    out = torch.empty(1, 256, 256, dtype=BF16, device=DEV)
    assert ops_gemm.gemm_into(a, b, out, None, None, None, 1.0, 0.0, "none", "auto") == names[0]
    odd_a, odd_b = rnd(256, 513)[:, 1:], rnd(512, 257)[:, 1:]
    assert ops_gemm.gemm_into(odd_a, odd_b, out, None, None, None, 1.0, 0.0, "none", "auto") == "wmma"
    assert_close(out[0], ref(odd_a, odd_b))
    if "sm90" in names:
        with pytest.raises(errors.ArgumentError, match=r"^backend: "):
            matmul(odd_a, odd_b, backend="sm90")


def test_opcheck_cuda():
    a, b = rnd(2, 33, 64, grad=True), rnd(64, 17, grad=True)
    args = (a, b, rnd(17, dtype=FP32, grad=True), rnd(2, 33, 17, grad=True), 0.5, 1.0, "gelu_erf", None, "auto", True)
    res = torch.library.opcheck(torch.ops.ferroattn.gemm.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def test_flop_counter_cuda():
    from torch.utils.flop_counter import FlopCounterMode
    a, b = rnd(4, 33, 64), rnd(64, 17)
    with FlopCounterMode(display=False) as counter:
        matmul(a, b)
    assert counter.get_total_flops() == 2 * 4 * 33 * 17 * 64
