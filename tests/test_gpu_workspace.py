"""The caller-allocated split-k / stream-K workspace on the GPU (``-m gpu``; sm_90a: src/ops/workspace.rs).

The op layer passes the launch its allocator (``ops._to_native.allocate_workspace``); the launch plans,
asks it for exactly the bytes its planner (``_native.gemm_workspace`` / ``_native.sparse24_matmul_workspace``)
reports, checks and uses the torch tensor and zeroes its counters on the stream. Checked here:

- every schedule that has a workspace, captured in a CUDA graph (``torch.cuda.graph``) and replayed twice
  with new inputs copied into the captured ones, bitwise equal to the eager call on the same inputs (all
  of them sum in a fixed order): the dense sm90 split-k (chunks + reduce), the dense wmma stream-k tail
  (partial tiles + flags: the flags must be zeroed again on every replay, by the captured memset), the
  2:4 wgmma_sp split-k (chunks + the reduce kernel), fused split-k (a slot + a counter per tile) and
  stream-K (a slot + a counter per CTA);
- the planners' sizes against the rules they implement (Python mirrors, for the device's SM count);
- the workspace is torch memory (the caching allocator's peak grows by at least its size);
- the launchers' errors for a missing, too small, misaligned or wrongly typed workspace name it.

Knobs force each schedule (the ``knob`` fixture); the default rules are covered by
tests/test_gpu_gemm_splitk.py, tests/test_gpu_sparse24_splitk.py and tests/test_gpu_sparse24_sched.py."""
from __future__ import annotations

import pytest
import torch

from ferroattn import _native, errors
from ferroattn.gemm import matmul

from _gpu_common import launch_records

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEV = "cuda"


def _sm90() -> bool:
    return torch.cuda.is_available() and "sm90" in _native.gemm_backends(torch.cuda.current_device())


if not _sm90():
    pytest.skip("the workspace schedules run on the sm90 / wgmma_sp paths (an sm_90 GPU)", allow_module_level=True)

SMS = torch.cuda.get_device_properties(0).multi_processor_count


def rnd(*shape, dtype=BF16, scale=1.0, seed=None):
    g = None if seed is None else torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def kernels(fn):
    """(fn's result, the names of our kernels it launched)."""
    result, recs = launch_records(fn)
    return result, [r["kernel"] for r in recs]


def replay_matches_eager(run, inputs, rounds=2):
    """Capture ``run()`` (after two eager calls on a side stream: JIT and allocator warm-up), then
    ``rounds`` times: copy fresh random values into ``inputs`` (the captured tensors), replay, and
    compare the graph's output bitwise with an eager ``run()`` on the same inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run()
    scales = [float(t.float().std()) or 1.0 for t in inputs]
    for r in range(rounds):
        for i, (t, scale) in enumerate(zip(inputs, scales)):
            g = torch.Generator(device=DEV).manual_seed(100 * r + i)
            t.copy_((torch.randn(t.shape, device=DEV, generator=g) * scale).to(t.dtype))
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = run()
        torch.cuda.synchronize()
        assert torch.isfinite(static).all(), f"replay {r}: unwritten or non-finite outputs"
        assert torch.equal(static, eager), f"replay {r}: graph and eager results differ"
    return static


# ---- the dense GEMM ---------------------------------------------------------------------------
def splitk_chunks(m: int, n: int, k: int) -> int:
    """The sm90 split-k chunk count (src/tuning/gemm_sm90.rs ``splitk_plan``; 1: unsplit) for batch 1,
    the cooperative 128 x 256 schedule."""
    tiles = -(-m // 128) * -(-n // 256)
    if 2 * tiles >= SMS or k % 64 or k < 256:
        return 1
    kt = k // 64
    return next((s for s in range(min(SMS // tiles, kt // 2), 1, -1) if kt % s == 0), 1)


def gemm_native_args(a, b, out, backend="auto"):
    return (a, b, out, None, None, None, 1.0, 0.0, "none", backend)


def test_gemm_splitk_graph_replays_new_inputs(knob):
    knob("gemm_sm90_splitk", "1")
    m, n, k = 16, 4096, 4096
    a, b, bias = rnd(m, k), rnd(k, n, scale=k ** -0.5), rnd(n)
    _, names = kernels(lambda: matmul(a, b, bias=bias, activation="silu"))
    assert len(names) == 2 and "gemm_sm90" in names[0] and "splitk_reduce" in names[1], names
    replay_matches_eager(lambda: matmul(a, b, bias=bias, activation="silu"), [a, b, bias])


def test_gemm_wmma_stream_k_graph_replays_new_inputs(knob):
    """backend "wmma": the persistent 128 x 256 tile with a stream-k tail over one CTA per SM (forced
    "on": whenever the last wave is partial); its flags are zeroed by the launch on every replay."""
    knob("gemm_wmma_streamk", "on")
    m, n, k = 26 * 128, 41 * 256, 512            # 1066 items: a partial last wave on 132 SMs
    if (26 * 41) % SMS == 0:
        pytest.skip("no partial last wave on this SM count")
    a, b = rnd(m, k), rnd(k, n, scale=k ** -0.5)
    out = torch.empty(1, m, n, dtype=BF16, device=DEV)
    nbytes = _native.gemm_workspace(*gemm_native_args(a.unsqueeze(0), b.unsqueeze(0), out, "wmma"))
    # a 128 x 256 fp32 partial tile per CTA (one per SM), then 8 warps' flags per CTA
    assert nbytes == SMS * 128 * 256 * 4 + SMS * 8 * 4
    replay_matches_eager(lambda: matmul(a, b, backend="wmma"), [a, b])


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 4096, 11008), (100, 256, 4096), (16, 4096, 1000),
                                   (2048, 4096, 4096)])
def test_gemm_planner_sizes(knob, m, n, k):
    """splits x m x n fp32 where the rule splits, 0 elsewhere; 0 with the gemm_sm90_splitk knob off."""
    knob("gemm_sm90_splitk", "1")
    a, b, out = rnd(1, m, k), rnd(1, k, n), torch.empty(1, m, n, dtype=BF16, device=DEV)
    s = splitk_chunks(m, n, k)
    want = s * m * n * 4 if s > 1 else 0
    assert _native.gemm_workspace(*gemm_native_args(a, b, out)) == want
    assert _native.gemm_workspace(*gemm_native_args(a, b, out, "sm90")) == want
    knob("gemm_sm90_splitk", "0")
    assert _native.gemm_workspace(*gemm_native_args(a, b, out)) == 0


def test_gemm_workspace_is_torch_memory(knob):
    knob("gemm_sm90_splitk", "1")
    m, n, k = 16, 4096, 4096
    a, b = rnd(m, k), rnd(k, n, scale=k ** -0.5)
    nbytes = splitk_chunks(m, n, k) * m * n * 4
    assert nbytes > 0
    matmul(a, b)   # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = matmul(a, b)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base >= nbytes + out.numel() * out.element_size()


def _split_gemm_call(knob):
    """A dense sm90 split-k call (its native arguments before the workspace, a, b, out, the planned
    bytes, the current stream)."""
    knob("gemm_sm90_splitk", "1")
    m, n, k = 16, 4096, 4096
    a, b = rnd(1, m, k), rnd(1, k, n, scale=k ** -0.5)
    out = torch.empty(1, m, n, dtype=BF16, device=DEV)
    args = gemm_native_args(a, b, out)
    nbytes = _native.gemm_workspace(*args)
    assert nbytes > 0
    return args, a, b, out, nbytes, torch.cuda.current_stream().cuda_stream


def test_gemm_workspace_errors_name_it(knob):
    args, a, b, out, nbytes, stream = _split_gemm_call(knob)
    with pytest.raises(errors.ArgumentError, match=rf"^workspace: expected a uint8 tensor of at least {nbytes} bytes"):
        _native.gemm(*args, None, stream)
    with pytest.raises(errors.ArgumentError, match=rf"^workspace: expected at least {nbytes} bytes .* got {nbytes - 16}"):
        _native.gemm(*args, torch.empty(nbytes - 16, dtype=torch.uint8, device=DEV), stream)
    with pytest.raises(errors.DTypeError, match=r"^workspace: expected dtype uint8"):
        _native.gemm(*args, torch.empty(nbytes // 4, dtype=FP32, device=DEV), stream)
    with pytest.raises(errors.ArgumentError, match=r"^workspace: expected a 16-byte aligned data pointer"):
        _native.gemm(*args, torch.empty(nbytes + 16, dtype=torch.uint8, device=DEV)[8:], stream)
    # a workspace whose first bytes hold out
    buf = torch.empty(nbytes + out.numel() * out.element_size(), dtype=torch.uint8, device=DEV)
    out_in_buf = buf[:out.numel() * out.element_size()].view(BF16).view(out.shape)
    with pytest.raises(errors.ArgumentError, match=r"^workspace: expected memory that does not overlap out"):
        _native.gemm(*gemm_native_args(a, b, out_in_buf), buf, stream)
    # the planned workspace (or a larger one) runs, with the result of the op
    out.fill_(float("nan"))
    assert _native.gemm(*args, torch.empty(nbytes + 4096, dtype=torch.uint8, device=DEV), stream) == "sm90"
    torch.cuda.synchronize()
    assert torch.equal(out[0], matmul(a[0], b[0]))


# ---- 2:4 wgmma_sp ----------------------------------------------------------------------------
SPARSE_SCHEDULES = {
    # name: (knobs, rows, n, k)
    "split": ({"sparse24_splitk": "4", "sparse24_splitk_fuse": "0", "wgmma_sp_streamk": "off"}, 256, 1024, 4096),
    "fused": ({"sparse24_splitk": "2", "sparse24_splitk_fuse": "1", "wgmma_sp_streamk": "off"}, 512, 1024, 4096),
    "stream_k": ({"wgmma_sp_streamk": "on", "sparse24_splitk": "off"}, 1500, 2048, 4096),
}


def _sparse_call(schedule, knob, dtype=FP16):
    from ferroattn import sparse24
    knobs, rows, n, k = SPARSE_SCHEDULES[schedule]
    knob("wgmma_sp_tile", "256")
    for name, value in knobs.items():
        knob(name, value)
    w = sparse24.prune(rnd(n, k, dtype=dtype, seed=n + k))
    t = sparse24.compress(w)
    x = rnd(rows, k, dtype=dtype, seed=rows)
    return sparse24, t, x, w, (rows, n, k)


def _sparse_workspace(t, x, n, k):
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=DEV)
    return _native.sparse24_matmul_workspace(x, t.values, t.meta, out, None, n, k, "none", "wgmma_sp"), out


@pytest.mark.parametrize("schedule", list(SPARSE_SCHEDULES))
def test_sparse24_graph_replays_new_inputs(knob, schedule):
    sparse24, t, x, w, (rows, n, k) = _sparse_call(schedule, knob)
    bias = rnd(n, dtype=FP16, seed=3)
    _, names = kernels(lambda: sparse24.matmul(x, t, bias, "gelu", backend="wgmma_sp"))
    assert any("sparse24_matmul_wgmma" in s for s in names), names
    assert ("gemm_splitk_reduce" in names) == (schedule == "split"), (schedule, names)
    assert _sparse_workspace(t, x, n, k)[0] > 0
    y = replay_matches_eager(lambda: sparse24.matmul(x, t, bias, "gelu", backend="wgmma_sp"), [x, bias])
    from _sparse24_gpu import check
    check(y, x, w, bias, "gelu")


def test_sparse24_planner_sizes(knob):
    """split-k: splits x rows x (n rounded up to 4) fp32; fused: a 128 KiB slot + a counter per
    128 x 256 tile; stream-K: a slot + a counter per CTA (one per SM); whole tiles / mma_sp: 0."""
    sparse24, t, x, _, (rows, n, k) = _sparse_call("split", knob)
    assert _sparse_workspace(t, x, n, k)[0] == 4 * rows * n * 4
    n2, k2 = 1030, 4160
    t2 = sparse24.compress(sparse24.prune(rnd(n2, k2, dtype=FP16, seed=1)))
    x2 = rnd(300, k2, dtype=FP16)
    assert _sparse_workspace(t2, x2, n2, k2)[0] == 4 * 300 * 1032 * 4
    sparse24, t, x, _, (rows, n, k) = _sparse_call("fused", knob)
    tiles = -(-rows // 128) * -(-n // 256)
    assert _sparse_workspace(t, x, n, k)[0] == tiles * 128 * 1024 + tiles * 4
    sparse24, t, x, _, (rows, n, k) = _sparse_call("stream_k", knob)
    assert _sparse_workspace(t, x, n, k)[0] == SMS * 128 * 1024 + SMS * 4
    knob("wgmma_sp_streamk", "off")
    assert _sparse_workspace(t, x, n, k)[0] == 0
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=DEV)
    assert _native.sparse24_matmul_workspace(x, t.values, t.meta, out, None, n, k, "none", "mma_sp") == 0


def test_sparse24_workspace_errors_name_it(knob):
    sparse24, t, x, w, (rows, n, k) = _sparse_call("stream_k", knob)
    nbytes, out = _sparse_workspace(t, x, n, k)
    args = (x, t.values, t.meta, out, None, n, k, "none", "wgmma_sp")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(errors.ArgumentError, match=r"^workspace: expected a uint8 tensor of at least"):
        _native.sparse24_matmul(*args, None, stream)
    with pytest.raises(errors.ArgumentError, match=rf"^workspace: expected at least {nbytes} bytes"):
        _native.sparse24_matmul(*args, torch.empty(nbytes - 4, dtype=torch.uint8, device=DEV), stream)
    with pytest.raises(errors.ArgumentError, match=r"^workspace: expected a contiguous tensor"):
        _native.sparse24_matmul(*args, torch.empty(2 * nbytes, dtype=torch.uint8, device=DEV)[::2], stream)
    # a workspace full of non-zero bytes: the launch zeroes the counters itself
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEV)
    out.fill_(float("nan"))
    assert _native.sparse24_matmul(*args, ws, stream) == "wgmma_sp"
    torch.cuda.synchronize()
    from _sparse24_gpu import check
    check(out, x, w)


def test_the_launch_asks_its_allocator_for_the_planned_bytes(knob):
    args, a, b, out, nbytes, stream = _split_gemm_call(knob)
    asked = []

    def alloc(n_, device):
        asked.append((n_, device))
        return torch.empty(n_, dtype=torch.uint8, device=DEV)

    _native.gemm(*args, alloc, stream)
    assert asked == [(nbytes, torch.cuda.current_device())]
    ref = torch.empty_like(out)
    _native.gemm(*gemm_native_args(a, b, ref), torch.empty(nbytes, dtype=torch.uint8, device=DEV), stream)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(errors.ArgumentError, match=rf"^workspace: expected at least {nbytes} bytes"):
        _native.gemm(*args, lambda n_, d: torch.empty(n_ - 16, dtype=torch.uint8, device=DEV), stream)
    with pytest.raises(KeyError, match="no memory today"):
        _native.gemm(*args, lambda n_, d: {}["no memory today"], stream)
    _native.gemm(*args, alloc, stream)                       # the next valid call works
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
