"""wgmma_sp split-k on the GPU (sm_90a; src/ops/sparse24 `launch_wgmma_split`): the partial-product
kernel (Epi = 2) over (k chunk, tile) work units into an fp32 workspace, then the dense path's reduce
kernel (bias + activation). Checked against the fp32 reference of act(x @ w.T + bias) with w the
decompressed weight: forced chunk counts (even, odd and uneven chunking, k_pad % 128 == 64), rows
256..1023 and 1..255, bias (x's dtype / fp32) with every activation, fp16 / bf16, non-contiguous x,
a NaN-poisoned out (every element written), run-to-run determinism, and that the auto rule really
splits (the reduce kernel shows up in the launch records) where it should and not where it should not.
The `sparse24_splitk` tuning knob (set with the `knob` fixture): "off", "auto" (default) or a chunk count.
The fused form (Epi = 3, no reduce kernel; by default for 2 chunks, the `sparse24_splitk_fuse` knob "1" always,
"0" never) is checked bitwise against the unfused split."""
from __future__ import annotations

import pytest
import torch

from _sparse24_gpu import ACTS, BF16, DEV, FP16, NATIVE_ACT, launch_records, sm90 as _sm90
from _sparse24_gpu import activations as _x, check as _check, native_call as _native_call, weight as _w

pytestmark = pytest.mark.gpu


def _kernels(fn):
    """Short names of our kernels that `fn` launched (launch records of the native profiler)."""
    return [r["kernel"] for r in launch_records(fn)]


@pytest.mark.parametrize("splits", ["2", "3", "5", "7"])
@pytest.mark.parametrize("rows,n,k", [(256, 1030, 4160), (300, 512, 1000), (777, 640, 2048), (1023, 264, 4160)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_split_forced_matches_reference(knob, splits, rows, n, k, dtype):
    """Forced chunk counts: k_tiles 33 (k_pad % 128 == 64: a half last stage), 8, 16; n % 4 != 0 (1030:
    padded workspace rows) and n < one tile; odd / uneven chunking (33 stages in 5 or 7 chunks)."""
    _sm90()
    from ferroattn import sparse24
    w = _w(n, k, dtype, seed=rows)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    knob("sparse24_splitk", splits)
    out = _native_call(x, t, n, k)
    _check(out, x, w)
    # deterministic: the reduce sums the chunks in a fixed order
    assert torch.equal(out, _native_call(x, t, n, k))
    # and the same function as the unsplit kernel (different summation order only)
    knob("sparse24_splitk", "off")
    ref = _native_call(x, t, n, k)
    assert (out.float() - ref.float()).abs().max().item() <= 0.05 * ref.float().abs().max().item()


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_split_bias_activation(knob, activation, bias_dtype, dtype):
    _sm90()
    from ferroattn import sparse24
    rows, n, k = 384, 1001, 1544          # n and k not multiples of the tile; 13 stages in 3 chunks
    w = _w(n, k, dtype, seed=7)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    bias = None if bias_dtype is None else torch.randn(
        n, device=DEV, dtype=dtype if bias_dtype == "x" else bias_dtype)
    knob("sparse24_splitk", "3")
    out = _native_call(x, t, n, k, bias, NATIVE_ACT[activation])
    _check(out, x, w, bias, activation)
    # the public API with the same forced split (sparse backend, rows >= 256: wgmma_sp)
    y = sparse24.matmul(x, t, bias, activation, backend="sparse")
    _check(y, x, w, bias, activation)


@pytest.mark.parametrize("rows", [1, 7, 31, 64, 128, 255])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_split_small_rows(knob, rows, dtype):
    """Decode-sized calls on wgmma_sp with 8 chunks (one token tile, most of it zero fill)."""
    _sm90()
    from ferroattn import sparse24
    n, k = 768, 4096
    w = _w(n, k, dtype, seed=rows)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    knob("sparse24_splitk", "8")
    _check(_native_call(x, t, n, k), x, w)
    knob("sparse24_splitk", "auto")
    _check(_native_call(x, t, n, k), x, w)


@pytest.mark.parametrize("layout", ["row_step", "col_slice", "transposed", "batched"])
def test_gpu_split_noncontiguous_x(knob, layout):
    _sm90()
    from ferroattn import sparse24
    n, k = 512, 2048
    w = _w(n, k, BF16)
    t = sparse24.compress(w)
    base = torch.randn(8, 96, k + 64, device=DEV, dtype=BF16)
    x = {
        "row_step": base[:, ::2, :k],                                   # (8, 48, k), row stride 2 (k + 64)
        "col_slice": base[..., 64:],                                     # row stride k + 64, offset pointer
        "transposed": base[..., :k].contiguous().transpose(0, 1),       # (96, 8, k), rows out of memory order
        "batched": base[..., :k].contiguous().reshape(2, 4, 96, k),
    }[layout]
    knob("sparse24_splitk", "4")
    y = sparse24.matmul(x, t, backend="wgmma_sp")
    assert y.shape == (*x.shape[:-1], n)
    _check(y.reshape(-1, n), x.reshape(-1, k), w)


def test_gpu_split_auto_rule_launches(knob):
    """At the 256-row tile (knob wgmma_sp_tile=256; auto may take the 128-row tile instead, see
    tests/test_gpu_sparse24_sched.py) auto splits 256 x 4096 x 11008 (32 tiles x 86 stages: 4 chunks) and 512 x 4096 x 11008 (2 chunks):
    the reduce kernel runs after the partial-product kernel; it does not split 2048 x 4096 x 4096 (a
    full wave of tiles), nor anything with sparse24_splitk=off."""
    _sm90()
    from ferroattn import sparse24
    knob("sparse24_splitk", "auto")
    knob("sparse24_splitk_fuse", "0")      # the reduce kernel marks a split
    knob("wgmma_sp_tile", "256")           # the split rule of the 256-row tile
    for rows, n, k, split in [(256, 4096, 11008, True), (512, 4096, 11008, True), (2048, 4096, 4096, False)]:
        w = _w(n, k, BF16, seed=rows)
        t = sparse24.compress(w)
        x = _x(rows, k, BF16)
        got = {}
        names = _kernels(lambda: got.setdefault("y", sparse24.matmul(x, t, backend="wgmma_sp")))
        assert ("gemm_splitk_reduce" in names) == split, (rows, n, k, names)
        assert any("sparse24_matmul_wgmma" in s for s in names), names
        _check(got["y"], x, w)
        if split:
            knob("sparse24_splitk", "off")
            names = _kernels(lambda: sparse24.matmul(x, t, backend="wgmma_sp"))
            assert "gemm_splitk_reduce" not in names, names
            knob("sparse24_splitk", "auto")


@pytest.mark.parametrize("splits", ["4", "2"])      # 2: the fused form by default (counters zeroed by a memset)
def test_gpu_split_cuda_graph_capture(knob, splits):
    """The workspace is the op layer's torch allocation (the graph's private pool under capture; the
    fused form's counters zeroed by a captured memset): a captured split call replays correctly."""
    _sm90()
    from ferroattn import sparse24
    n, k = 1024, 4096
    w = _w(n, k, FP16)
    t = sparse24.compress(w)
    x = _x(256, k, FP16)
    knob("sparse24_splitk_fuse", "")
    knob("sparse24_splitk", splits)
    y = sparse24.matmul(x, t, backend="wgmma_sp")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse24.matmul(x, t, backend="wgmma_sp")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = sparse24.matmul(x, t, backend="wgmma_sp")
    x.copy_(_x(256, k, FP16, seed=9))
    g.replay()
    torch.cuda.synchronize()
    _check(yg, x, w)
    assert not torch.equal(yg, y)


# ---- fused split-k (kernel form Epi = 3: default for 2 chunks; sparse24_splitk_fuse=1 always) ---------


def test_gpu_fused_auto_rule(knob):
    """sparse24_splitk_fuse at its default, the 256-row tile: auto splits 512 x 4096 x 11008 into 2 chunks and fuses them (no
    reduce kernel; bitwise the unfused split's output), and 256 x 4096 x 11008 into 4 chunks, unfused (the
    reduce kernel runs)."""
    _sm90()
    from ferroattn import sparse24
    knob("sparse24_splitk", "auto")
    knob("wgmma_sp_tile", "256")           # the split rule of the 256-row tile
    for rows, n, k, fused in [(512, 4096, 11008, True), (256, 4096, 11008, False)]:
        w = _w(n, k, BF16, seed=rows)
        t = sparse24.compress(w)
        x = _x(rows, k, BF16)
        knob("sparse24_splitk_fuse", "")
        got = {}
        names = _kernels(lambda: got.setdefault("y", _native_call(x, t, n, k)))
        assert any("sparse24_matmul_wgmma" in s for s in names), names
        assert ("gemm_splitk_reduce" in names) == (not fused), (rows, n, k, names)
        _check(got["y"], x, w)
        knob("sparse24_splitk_fuse", "0")
        assert torch.equal(got["y"].view(torch.int16), _native_call(x, t, n, k).view(torch.int16))

@pytest.mark.parametrize("splits", ["2", "3", "7"])
@pytest.mark.parametrize("rows,n,k,activation,bias_dtype", [
    (256, 1030, 4160, None, None), (300, 512, 1000, "silu", "x"), (777, 640, 2048, "gelu", torch.float32),
    (1023, 264, 4160, "relu", "x"), (31, 768, 4096, "gelu_tanh", None)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_fused_split_equals_unfused(knob, splits, rows, n, k, activation, bias_dtype, dtype):
    """The fused form passes the running sum in chunk order and applies the same fp32 epilogue as the reduce
    kernel, so its output is bitwise the unfused split's; and it matches the fp32 reference."""
    _sm90()
    from ferroattn import sparse24
    w = _w(n, k, dtype, seed=rows + 3)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    bias = None if bias_dtype is None else torch.randn(
        n, device=DEV, dtype=dtype if bias_dtype == "x" else bias_dtype)
    knob("sparse24_splitk", splits)
    knob("sparse24_splitk_fuse", "1")
    fused = _native_call(x, t, n, k, bias, NATIVE_ACT[activation])
    names = _kernels(lambda: _native_call(x, t, n, k, bias, NATIVE_ACT[activation]))
    assert "gemm_splitk_reduce" not in names and any("sparse24_matmul_wgmma" in s for s in names), names
    _check(fused, x, w, bias, activation)
    assert torch.equal(fused, _native_call(x, t, n, k, bias, NATIVE_ACT[activation]))   # deterministic
    knob("sparse24_splitk_fuse", "0")
    unfused = _native_call(x, t, n, k, bias, NATIVE_ACT[activation])
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))


def test_gpu_fused_split_many_waves(knob):
    """More units than SMs (several per CTA, later chunks waiting on earlier ones in other CTAs)."""
    _sm90()
    from ferroattn import sparse24
    rows, n, k = 1024, 4096, 4096           # 8 x 16 = 128 tiles x 8 chunks = 1024 units
    w = _w(n, k, BF16)
    t = sparse24.compress(w)
    x = _x(rows, k, BF16)
    knob("sparse24_splitk", "8")
    knob("sparse24_splitk_fuse", "1")
    y = _native_call(x, t, n, k)
    _check(y, x, w)
    knob("sparse24_splitk_fuse", "0")
    assert torch.equal(y, _native_call(x, t, n, k))
