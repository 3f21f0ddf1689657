"""wgmma_sp schedules on the GPU (sm_90a; src/tuning/sparse24/schedule.rs `wgmma_schedule`,
src/ops/sparse24 `launch_wgmma`): the 128 w-row x 128 token tile (kernel BM = 128, 4 stages), picked
where the 256-row tiles would leave most SMs idle, and the stream-K tail (kernel form Epi = 4): the first
dp_tiles tiles run whole, the remaining tiles' 128-k stages are cut into one contiguous range per CTA
and a tile cut between CTAs is finished by the CTA holding its first stage, which adds the other
segments' fp32 partial sums in k order.
Checked against the fp32 reference of act(x @ w.T + bias) with w the decompressed weight: ragged rows /
n / k (k_pad % 128 == 64), forced tails from one stage per CTA (most CTAs idle, an owner reading up to
32 partials) to all tiles, bias (x's dtype / fp32) with every activation, fp16 / bf16, a NaN-poisoned out
(every element written), run-to-run bitwise determinism, the auto rule's choices (launch records), and
the tuning knobs wgmma_sp_tile ("auto" | "256" | "128" | "band:H") and wgmma_sp_streamk ("auto" | "off" |
"on" | "dp:N"), set with the `knob` fixture."""
from __future__ import annotations

import pytest
import torch

from _sparse24_gpu import ACTS, BF16, DEV, FP16, NATIVE_ACT, launch_records, sm90 as _sm90
from _sparse24_gpu import activations as _x, check as _check, native_call as _native_call, weight as _w

pytestmark = pytest.mark.gpu


def _records(fn):
    """Launch records (kernel, config = name expression, grid) of the wgmma_sp kernels that `fn` launched."""
    return [r for r in launch_records(fn) if r["kernel"] == "sparse24_matmul_wgmma"]


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


# ---- the 128-row tile ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,n,k", [(1, 200, 64), (300, 1000, 1000), (512, 4096, 4096), (1100, 1030, 4160),
                                      (777, 128, 4160)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_bm128_matches_reference(knob, rows, n, k, dtype):
    """wgmma_sp_tile=128: n not a multiple of 128 (last tile partly padding), rows not a multiple
    of 128, k_pad % 128 == 64 (4160), one token; deterministic; close to the 256-row tile's output."""
    _sm90()
    from ferroattn import sparse24
    w = _w(n, k, dtype, seed=rows)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    knob("wgmma_sp_tile", "128")
    got = {}
    recs = _records(lambda: got.setdefault("y", _native_call(x, t, n, k)))
    assert len(recs) == 1 and recs[0]["config"].endswith(", 128, 4, 0, 128, 1>"), recs
    out = got["y"]
    _check(out, x, w)
    assert torch.equal(out, _native_call(x, t, n, k))
    # same sum order per output as the 256-row tile (k in the same stage order): bitwise equal
    knob("wgmma_sp_tile", "256")
    knob("wgmma_sp_streamk", "off")
    knob("sparse24_splitk", "off")
    assert torch.equal(out, _native_call(x, t, n, k))


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_bm128_bias_activation(knob, activation, bias_dtype, dtype):
    _sm90()
    from ferroattn import sparse24
    rows, n, k = 384, 1001, 1544
    w = _w(n, k, dtype, seed=7)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    bias = None if bias_dtype is None else torch.randn(
        n, device=DEV, dtype=dtype if bias_dtype == "x" else bias_dtype)
    knob("wgmma_sp_tile", "128")
    _check(_native_call(x, t, n, k, bias, NATIVE_ACT[activation]), x, w, bias, activation)
    y = sparse24.matmul(x, t, bias, activation, backend="sparse")
    _check(y, x, w, bias, activation)


# ---- the banded schedule (two launches: 256-row feature tiles, then the rest on the 128-row tile) ----------

# (rows, n, k, head): feature tiles = ceil(n / 256); the tail launch covers w rows 256 head .. n - 1
BAND_CASES = [
    (300, 1000, 1000, 1),          # 4 feature tiles: tail 744 rows (n not a multiple of 128)
    (1100, 1030, 4160, 2),         # 5: tail 518 rows, k_pad % 128 == 64
    (130, 777, 4160, 3),           # 4: tail of 9 w rows (one 128-row tile, 119 rows padding)
    (5, 513, 64, 1),               # 3: five tokens, one stage, tail 257 rows
    (2048, 11008, 4096, 41),       # the auto choice at 2048 x 11008 x 4096: tail 512 rows = 64 tiles
]


def _whole_tiles(knob):
    knob("wgmma_sp_tile", "256")
    knob("wgmma_sp_streamk", "off")
    knob("sparse24_splitk", "off")


@pytest.mark.parametrize("rows,n,k,head", BAND_CASES)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_banded_matches_whole_tiles(knob, rows, n, k, head, dtype):
    """wgmma_sp_tile=band:H: two launches (the 256-row tile over features 0 .. 256 H - 1, the
    128-row tile over the rest, its maps, out and bias offset); every element written (NaN-poisoned out),
    close to the reference, deterministic and bitwise the whole-tile output (both tiles add k in the same
    stage order per output)."""
    _sm90()
    from ferroattn import sparse24
    w = _w(n, k, dtype, seed=rows + n)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    knob("wgmma_sp_tile", f"band:{head}")
    got = {}
    recs = _records(lambda: got.setdefault("y", _native_call(x, t, n, k)))
    assert len(recs) == 2 and recs[0]["config"].endswith(", 256, 1>") and recs[1]["config"].endswith(", 128, 1>"), recs
    out = got["y"]
    _check(out, x, w)
    assert torch.equal(out, _native_call(x, t, n, k))
    _whole_tiles(knob)
    assert torch.equal(out, _native_call(x, t, n, k))


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("bias_dtype", ["x", torch.float32])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_banded_bias_activation_strided_x(knob, activation, bias_dtype, dtype):
    """band:2 with a bias (x's dtype / fp32: the tail's bias pointer is offset by its element size) and
    every activation, x a column slice of a wider tensor (row stride > k), through sparse24.matmul: bitwise
    the whole-tile output, close to the reference."""
    _sm90()
    from ferroattn import sparse24
    rows, n, k = 384, 1001, 1544
    w = _w(n, k, dtype, seed=11)
    t = sparse24.compress(w)
    x = _x(rows, k + 136, dtype)[:, :k]
    bias = torch.randn(n, device=DEV, dtype=dtype if bias_dtype == "x" else bias_dtype)
    knob("wgmma_sp_tile", "band:2")
    got = {}
    recs = _records(lambda: got.setdefault("y", _native_call(x, t, n, k, bias, NATIVE_ACT[activation])))
    assert len(recs) == 2, recs
    _check(got["y"], x, w, bias, activation)
    y = sparse24.matmul(x, t, bias, activation, backend="sparse")
    _whole_tiles(knob)
    assert torch.equal(got["y"], _native_call(x, t, n, k, bias, NATIVE_ACT[activation]))
    assert torch.equal(y, sparse24.matmul(x, t, bias, activation, backend="sparse"))


# ---- the stream-K tail ----------------------------------------------------------------------------------

def _tiles256(rows, n):
    m_pad = -(-n // 128) * 128
    return -(-rows // 128) * -(-m_pad // 256)


# (rows, n, k, dp): tiles and k_tiles per case in the comment; "last" = tiles - 1 (one tile of k_tiles
# stages over all CTAs: most ranges empty or one stage, the owner reads up to k_tiles - 1 partials)
SK_CASES = [
    (300, 1000, 1000, "0"),        # 3 x 4 = 12 tiles, 8 stages: 96 stages over the CTAs (< 1 stage each)
    (300, 1000, 1000, "last"),
    (1100, 1030, 4160, "0"),       # 9 x 5 = 45 tiles, 33 stages (k_pad % 128 == 64)
    (1100, 1030, 4160, "20"),
    (1100, 1030, 4160, "last"),
    (2048, 4096, 4160, "132"),     # 16 x 16 = 256 tiles, 33 stages: one whole wave then 124 tiles
    (2048, 4096, 4160, "200"),     # whole tiles not a multiple of the grid
    (777, 128, 64, "0"),           # 7 tiles of ONE stage: whole tiles only, most CTAs idle
    (1, 4096, 4096, "0"),          # one token: 16 tiles of 32 stages
]


@pytest.mark.parametrize("rows,n,k,dp", SK_CASES)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_stream_k_matches_reference(knob, rows, n, k, dp, dtype):
    _sm90()
    from ferroattn import sparse24
    w = _w(n, k, dtype, seed=rows + k)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    tiles = _tiles256(rows, n)
    dp_tiles = tiles - 1 if dp == "last" else min(int(dp), tiles - 1)
    knob("wgmma_sp_streamk", f"dp:{dp_tiles}")
    got = {}
    recs = _records(lambda: got.setdefault("y", _native_call(x, t, n, k)))
    assert len(recs) == 1 and recs[0]["config"].endswith(", 256, 4>"), recs
    assert recs[0]["grid"][0] == _sms(), recs
    out = got["y"]
    _check(out, x, w)
    # deterministic: the owner adds the partials in k order
    for _ in range(2):
        assert torch.equal(out, _native_call(x, t, n, k))
    # the same function as whole tiles (sum order differs only where a tile is cut)
    knob("wgmma_sp_streamk", "off")
    knob("sparse24_splitk", "off")
    ref = _native_call(x, t, n, k)
    assert (out.float() - ref.float()).abs().max().item() <= 0.05 * ref.float().abs().max().item()


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("bias_dtype", [None, "x", torch.float32])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_gpu_stream_k_bias_activation(knob, activation, bias_dtype, dtype):
    """Bias and activation run once, in the owner's epilogue, after every partial is added."""
    _sm90()
    from ferroattn import sparse24
    rows, n, k = 700, 1001, 1544          # 6 x 4 = 24 tiles of 13 stages; 10 whole, 14 spread
    w = _w(n, k, dtype, seed=11)
    t = sparse24.compress(w)
    x = _x(rows, k, dtype)
    bias = None if bias_dtype is None else torch.randn(
        n, device=DEV, dtype=dtype if bias_dtype == "x" else bias_dtype)
    knob("wgmma_sp_streamk", "dp:10")
    _check(_native_call(x, t, n, k, bias, NATIVE_ACT[activation]), x, w, bias, activation)
    y = sparse24.matmul(x, t, bias, activation, backend="sparse")
    _check(y, x, w, bias, activation)


@pytest.mark.parametrize("layout", ["row_step", "batched"])
def test_gpu_stream_k_noncontiguous_x(knob, layout):
    _sm90()
    from ferroattn import sparse24
    n, k = 1536, 2048
    w = _w(n, k, BF16)
    t = sparse24.compress(w)
    base = torch.randn(8, 96, k + 64, device=DEV, dtype=BF16)
    x = {"row_step": base[:, ::2, :k], "batched": base[..., :k].contiguous().reshape(2, 4, 96, k)}[layout]
    knob("wgmma_sp_streamk", "on")
    y = sparse24.matmul(x, t, backend="wgmma_sp")
    assert y.shape == (*x.shape[:-1], n)
    _check(y.reshape(-1, n), x.reshape(-1, k), w)


def test_gpu_stream_k_cuda_graph_capture(knob):
    """The workspace is the op layer's torch allocation (the graph's private pool) and its counters are
    zeroed by a memset node before the kernel on every replay: a captured call replays correctly,
    three times."""
    _sm90()
    from ferroattn import sparse24
    n, k = 2048, 4096
    w = _w(n, k, FP16)
    t = sparse24.compress(w)
    x = _x(1500, k, FP16)
    knob("wgmma_sp_streamk", "dp:40")
    sparse24.matmul(x, t, backend="wgmma_sp")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = sparse24.matmul(x, t, backend="wgmma_sp")
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(y, x, w)


# ---- the auto rule and the switches ----------------------------------------------------------------------

def test_gpu_schedule_auto_choices(knob):
    """132-SM H200: 512 x 4096 x 4096 (64 tiles of 256 rows) and 256 x 4096 x 4096 (32: split-k before) run
    the 128-row tile, and so do 1024 x 14336 x 4096 (448 tiles: 7 x 0.55 < 4 waves) and 512 x 11008 x 4096
    (172: 3 x 0.55 < 2) by the wave rule; 2048 x 11008 x 4096 (688 tiles = 5.2 waves) runs banded (41
    feature tiles whole, then 64 128-row tiles); 1024 x 11008 x 4096 (344), 8192 x 4096 x 4096 and
    1024 x 4096 x 4096 whole 256-row tiles (stream-K only on request: "on" gives it);
    "256" restores the 256-row tile."""
    _sm90()
    if _sms() != 132:
        pytest.skip("the expected choices are those of a 132-SM H200")
    from ferroattn import sparse24
    for name in ("wgmma_sp_tile", "wgmma_sp_streamk", "sparse24_splitk"):
        knob(name, "")      # the defaults

    def launched(rows, n, k, check=True):
        w = _w(n, k, FP16, seed=rows)
        t = sparse24.compress(w)
        x = _x(rows, k, FP16)
        got = {}
        recs = _records(lambda: got.setdefault("y", sparse24.matmul(x, t, backend="wgmma_sp")))
        if check:
            _check(got["y"], x, w)
        return [r["config"] for r in recs]

    for rows, n, k, want in [(512, 4096, 4096, [", 128, 1>"]), (256, 4096, 4096, [", 128, 1>"]),
                             (2048, 11008, 4096, [", 256, 1>", ", 128, 1>"]), (8192, 4096, 4096, [", 256, 1>"]),
                             (1024, 4096, 4096, [", 256, 1>"]), (1024, 14336, 4096, [", 128, 1>"]),
                             (512, 11008, 4096, [", 128, 1>"]), (1024, 11008, 4096, [", 256, 1>"])]:
        cfg = launched(rows, n, k)
        assert len(cfg) == len(want) and all(c.endswith(e) for c, e in zip(cfg, want)), (rows, n, k, cfg)
    knob("wgmma_sp_streamk", "on")
    cfg = launched(2048, 11008, 4096)
    assert len(cfg) == 1 and cfg[0].endswith(", 256, 4>"), cfg
    knob("wgmma_sp_streamk", "off")
    knob("wgmma_sp_tile", "256")
    cfg = launched(512, 4096, 4096, check=False)
    assert len(cfg) == 1 and cfg[0].endswith(", 256, 1>"), cfg
