"""GPU tests of split-k on the Hopper GEMM path (``-m gpu``; skipped without an sm_90 device):
``ferroattn.matmul`` on decode-sized problems (m 1..512, n 256 / 4096, k 1000 / 4096 / 11008)
against the fp32 torch reference (max|ours − ref| <= 1e-2 · max|ref|, tests/test_gpu_gemm.py's
rule), and whether split-k ran, read from the launch recorder (``_native.profiler_*``): a split
call launches the sm90 GEMM with an fp32 workspace output and then ``gemm_splitk_reduce``; an
unsplit call launches the GEMM alone.

The rule under test (src/tuning/gemm_sm90.rs ``splitk_plan``): batch 1, fewer than SMs / 2
128 x 256 tiles, k a multiple of 64 with a divisor >= 2 of k / 64 that keeps chunks >= 128 deep
and splits * tiles <= SMs. On a 132-SM H200 every shape here with k = 4096 or 11008 splits
(<= 64 tiles) and k = 1000 never does. The gemm_sm90_splitk tuning knob 0 turns it off.

Covered: bf16 / fp16 in, out fp16 / bf16 / fp32, bias (a's dtype, fp32), alpha, beta with C,
every activation, aux (pre-activation), all four NN/NT/TN/TT layouts, non-contiguous rows of
a, b, c and out, determinism (bitwise equal reruns), CUDA-graph capture (the workspace is a torch
allocation of the graph's private pool, sized by ``_native.gemm_workspace``), and the off switch.
tests/test_gpu_workspace.py checks the workspace itself (planner sizes, errors, every schedule)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ferroattn import _native
from ferroattn.gemm import matmul

from _gpu_common import launch_records

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEV = "cuda"
TOL = 1e-2
REF_ACT = {None: lambda x: x, "relu": torch.relu, "gelu": F.gelu,
           "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
OP_ACT = {None: "none", "relu": "relu", "gelu": "gelu_erf", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def _sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    return "sm90" in _native.gemm_backends(torch.cuda.current_device())


if not _sm90():
    pytest.skip("split-k runs on the sm90 path only (an sm_90 GPU)", allow_module_level=True)

SMS = torch.cuda.get_device_properties(0).multi_processor_count


def expect_split(m: int, n: int, k: int) -> bool:
    """Python mirror of the rule for batch 1, the cooperative 128 x 256 schedule."""
    tiles = -(-m // 128) * -(-n // 256)
    if 2 * tiles >= SMS or k % 64 or k < 256:
        return False
    kt = k // 64
    return any(kt % s == 0 for s in range(2, min(SMS // tiles, kt // 2) + 1))


def rnd(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def operand(rows, cols, layout, dtype=BF16, scale=1.0, pad=0):
    """(rows, cols), row-major ("N") or column-major ("T"); ``pad`` extra elements per line
    (a non-contiguous view of a wider buffer)."""
    if layout == "N":
        return rnd(rows, cols + pad, dtype=dtype, scale=scale)[:, :cols]
    return rnd(cols, rows + pad, dtype=dtype, scale=scale)[:, :rows].t()


def ref(a, b, bias=None, activation=None, alpha=1.0, beta=0.0, c=None):
    pre = alpha * (a.float() @ b.float())
    if c is not None and beta != 0.0:
        pre = pre + beta * c.float()
    if bias is not None:
        pre = pre + bias.float()
    return REF_ACT[activation](pre)


def assert_close(got, want, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= TOL * scale + 1e-6, f"{what}: max|err| {err:.3e} > {TOL} * max|ref| {scale:.3e}"


recorded = launch_records   # (fn's result, the launch records of our kernels)


def kernels(recs):
    return [r["kernel"] for r in recs]


def assert_split(recs, split: bool, what=""):
    names = kernels(recs)
    if split:
        assert len(names) == 2 and "gemm_sm90" in names[0] and "splitk_reduce" in names[1], (what, names)
        # the GEMM wrote the fp32 workspace, whatever out's dtype
        assert ", float," in recs[0]["config"], (what, recs[0]["config"])
    else:
        assert len(names) == 1 and "gemm_sm90" in names[0], (what, names)


@pytest.fixture(autouse=True)
def _splitk_on(knob):
    knob("gemm_sm90_splitk", "")
    yield
    _native.profiler_enable(False)
    _native.profiler_drain()


# ---- shapes ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("k", [1000, 4096, 11008])
def test_shapes_split_and_match(dtype, k):
    """m in {1, 16, 100, 512} x n in {256, 4096}: split exactly where the rule says (k = 1000:
    never), results within tolerance, every element written (NaN-filled out)."""
    torch.manual_seed(k)
    for m, n in itertools.product((1, 16, 100, 512), (256, 4096)):
        a, b = rnd(m, k, dtype=dtype), rnd(k, n, dtype=dtype, scale=k ** -0.5)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        _, recs = recorded(lambda: matmul(a, b, out=out))
        split = expect_split(m, n, k)
        assert split == (k != 1000), (m, n, k)
        assert_split(recs, split, (m, n, k))
        assert_close(out, ref(a, b), (m, n, k, dtype))


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 11008), (104, 256, 4096), (512, 4096, 4096)])
def test_layouts(layout, m, n, k):
    """Every layout splits (m = 104, not 100: a column-major a needs a leading dim of a multiple of
    8 elements for TMA, else the call goes to the wmma path, unsplit)."""
    torch.manual_seed(m + n + k)
    a = operand(m, k, layout[0])
    b = operand(k, n, layout[1], scale=k ** -0.5)
    out, recs = recorded(lambda: matmul(a, b))
    assert_split(recs, True, (layout, m, n, k))
    assert_close(out, ref(a, b), (layout, m, n, k))


# ---- epilogues ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_dtype", [None, "same", FP32])
@pytest.mark.parametrize("out_dtype", [None, FP32])
@pytest.mark.parametrize("scaled", [False, True])
def test_epilogues(dtype, activation, bias_dtype, out_dtype, scaled):
    """bias (a's dtype / fp32), alpha, beta with C (out's dtype), every activation, out bf16 /
    fp16 / fp32, on a split problem (m 100, n 256, k 4096: 32 chunks)."""
    torch.manual_seed(7)
    m, n, k = 100, 256, 4096
    a, b = rnd(m, k, dtype=dtype), rnd(k, n, dtype=dtype, scale=k ** -0.5)
    bias = None if bias_dtype is None else rnd(n, dtype=dtype if bias_dtype == "same" else FP32)
    alpha, beta = (0.75, -1.5) if scaled else (1.0, 0.0)
    c = rnd(m, n, dtype=out_dtype or dtype) if scaled else None
    out, recs = recorded(lambda: matmul(a, b, bias=bias, activation=activation, alpha=alpha, beta=beta, c=c,
                                        out_dtype=out_dtype))
    assert_split(recs, True)
    assert out.dtype == (out_dtype or dtype)
    assert_close(out, ref(a, b, bias, activation, alpha, beta, c))


@pytest.mark.parametrize("out_dtype", [BF16, FP32])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_aux_is_the_pre_activation(out_dtype, activation):
    torch.manual_seed(16)
    m, n, k = 16, 4096, 4096
    a, b, bias = rnd(1, m, k), rnd(k, n, scale=k ** -0.5), rnd(n, dtype=FP32)
    c = rnd(1, m, n, dtype=out_dtype)
    (out, aux), recs = recorded(lambda: torch.ops.ferroattn.gemm(a, b, bias, c, 0.5, 1.5, OP_ACT[activation],
                                                                 out_dtype, "auto", True))
    assert_split(recs, True)
    assert aux.shape == out.shape == (1, m, n) and aux.dtype == out_dtype
    assert_close(aux, ref(a, b, bias, None, 0.5, 1.5, c), "aux")
    assert_close(out, ref(a, b, bias, activation, 0.5, 1.5, c), "out")


def test_non_contiguous_rows():
    """a, b, c and out are row views of wider buffers (row strides k + 64, n + 40, n + 8, n + 24);
    the padding of out stays untouched."""
    torch.manual_seed(5)
    m, n, k = 100, 4096, 4096
    a = operand(m, k, "N", pad=64)
    b = operand(k, n, "N", scale=k ** -0.5, pad=40)
    c = rnd(m, n + 8, dtype=BF16)[:, :n]
    bias = rnd(n, dtype=BF16)
    buf = torch.full((m, n + 24), 7.0, dtype=BF16, device=DEV)
    out = buf[:, :n]
    assert out.stride() == (n + 24, 1) and c.stride() == (n + 8, 1) and a.stride() == (k + 64, 1)
    _, recs = recorded(lambda: matmul(a, b, out=out, c=c, beta=0.5, bias=bias, activation="relu"))
    assert_split(recs, True)
    assert_close(out, ref(a, b, bias, "relu", 1.0, 0.5, c))
    assert (buf[:, n:] == 7.0).all(), "split-k wrote outside out's rows"


# ---- determinism, capture, the switch -----------------------------------------------------
def test_deterministic_reruns():
    torch.manual_seed(9)
    a, b = rnd(16, 11008), rnd(11008, 4096, scale=11008 ** -0.5)
    first = matmul(a, b, out_dtype=FP32)
    for _ in range(3):
        assert torch.equal(matmul(a, b, out_dtype=FP32), first)


def test_cuda_graph_capture():
    """The split call captured (its workspace allocated by the op layer from the graph's private pool,
    the same memory on every replay) and replayed twice with new a and bias: bitwise the eager result
    on the same inputs (the reduce sums the chunks in a fixed order)."""
    torch.manual_seed(11)
    a, b, bias = rnd(16, 4096), rnd(4096, 4096, scale=4096 ** -0.5), rnd(4096)
    _, recs = recorded(lambda: matmul(a, b, bias=bias, activation="silu"))  # compiles outside capture
    assert_split(recs, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        matmul(a, b, bias=bias, activation="silu")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = matmul(a, b, bias=bias, activation="silu")
    for _ in range(2):
        a.copy_(rnd(16, 4096))
        bias.copy_(rnd(4096))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, matmul(a, b, bias=bias, activation="silu"))
        assert_close(static_out, ref(a, b, bias, "silu"))


def test_off_switch(knob):
    """gemm_sm90_splitk=0: one unsplit launch, same values within
    tolerance; unset again: split."""
    torch.manual_seed(13)
    a, b = rnd(16, 4096), rnd(4096, 4096, scale=4096 ** -0.5)
    knob("gemm_sm90_splitk", "0")
    off, recs = recorded(lambda: matmul(a, b, out_dtype=FP32))
    assert_split(recs, False, "off")
    knob("gemm_sm90_splitk", "1")
    on, recs = recorded(lambda: matmul(a, b, out_dtype=FP32))
    assert_split(recs, True, "on")
    want = ref(a, b)
    assert_close(off, want, "off")
    assert_close(on, want, "on")


def test_batched_and_large_problems_do_not_split():
    torch.manual_seed(17)
    a, b = rnd(2, 16, 4096), rnd(2, 4096, 4096, scale=4096 ** -0.5)
    out, recs = recorded(lambda: matmul(a, b))
    assert_split(recs, False, "batch 2")
    assert_close(out, ref(a, b))
    a = rnd(2048, 4096)
    out, recs = recorded(lambda: matmul(a, b[0]))
    assert_split(recs, False, "m 2048")
    assert_close(out, ref(a, b[0]))
