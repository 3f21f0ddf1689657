"""GPU tests of the Rust launch recorder (src/profiler.rs; ``_native.profiler_*``, the contract in
python/ferroattn/_native.pyi, "profiler: launch records").

On bf16 causal flash_attn_func forward + backward (b 2, s 1024, h 8, d 128): the records name
our kernels in launch order with positive GPU times, start times increasing against a reference
event, registers and theoretical occupancy from the driver, and the exact FLOP counts (forward
4·pairs·d, backward 2.5× that); launches under CUDA-graph capture are skipped; torch.profiler
running at the same time lists our kernels by name; varlen records are marked inexact.

Marker ``gpu``: skipped without CUDA; run by scripts/gpu_check.sh (pytest stage)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

B, S, H, D = 2, 1024, 8, 128
BWD_KERNELS = ["attn_bwd_preprocess", "attn_bwd_dkdv_sm80", "attn_bwd_convert_dq"]


@pytest.fixture(scope="module", autouse=True)
def sm80_families():
    """The records pinned here (kernel names, configs, FLOPs of each launch) are the sm80
    family's: force it for forward and backward on every GPU (the Hopper family's records are
    tests/test_gpu_sm90.py's)."""
    from ferroattn import _native as n

    knobs = ("attn_fwd_family", "attn_bwd_family")
    before = {k: n.tuning_knobs()[k] for k in knobs}
    for k in knobs:
        n.set_tuning_knob(k, "sm80")
    yield
    for k in knobs:
        n.set_tuning_knob(k, before[k])


@pytest.fixture
def native():
    """The extension with the recorder off and drained before and after the test."""
    from ferroattn import _native as n

    n.profiler_enable(False)
    n.profiler_drain()
    yield n
    n.profiler_enable(False)
    n.profiler_drain()


@pytest.fixture(scope="module")
def inputs():
    import torch

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    _step(q, k, v, g)  # load every kernel first, unrecorded
    torch.cuda.synchronize()
    return q, k, v, g


def _step(q, k, v, g):
    import ferroattn

    out = ferroattn.flash_attn_func(q, k, v, causal=True)
    out.backward(g)
    return out


def test_records_of_forward_and_backward(native, inputs):
    import torch

    q, k, v, g = inputs
    assert native.profiler_drain() == []
    native.profiler_enable(True)
    assert native.profiler_enabled()
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    _step(q, k, v, g)
    native.profiler_enable(False)
    assert native.profiler_stats()["pending"] == 4
    recs = native.profiler_drain(ref.cuda_event)
    assert [r["kernel"] for r in recs] == ["attn_fwd_sm80"] + BWD_KERNELS
    assert [r["op"] for r in recs] == ["ferroattn::attn_fwd"] + ["ferroattn::attn_bwd"] * 3
    assert all(r["gpu_ms"] > 0 for r in recs)
    starts = [r["start_ms"] for r in recs]
    assert all(x is not None and x >= 0 for x in starts)
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(r["registers"] > 0 and 0 < r["occupancy"] <= 1 and r["max_active_blocks_per_sm"] >= 1 for r in recs)
    seqs = [r["seq"] for r in recs]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    assert recs[0]["config"].startswith("ferroattn::attn_fwd_sm80<128,")
    pairs = B * H * S * (S + 1) // 2
    assert recs[0]["flops"] == 4 * pairs * D
    assert sum(r["flops"] for r in recs[1:]) == 2.5 * recs[0]["flops"]
    assert recs[1]["flops"] == 0 and recs[3]["flops"] == 0
    assert recs[0]["bytes"] == 4 * B * S * H * D * 2 + B * H * S * 4  # q, k, v read, out written, LSE written
    assert all(r["exact"] for r in recs)
    major, minor = torch.cuda.get_device_capability()
    assert all(r["arch"].startswith(f"sm_{major}{minor}") and r["device"] == torch.cuda.current_device()
               for r in recs)
    assert all(r["stream"] == torch.cuda.current_stream().cuda_stream for r in recs)
    st = native.profiler_stats()
    assert st["pending"] == 0 and st["dropped"] == 0


def test_capture_is_skipped_and_replay_matches(native, inputs):
    import torch

    import ferroattn

    q, k, v, _ = (t.detach() for t in inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ferroattn.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    native.profiler_enable(True)
    before = native.profiler_stats()["skipped_capture"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ferroattn.flash_attn_func(q, k, v, causal=True)
    st = native.profiler_stats()
    assert st["skipped_capture"] == before + 1 and st["pending"] == 0
    graph.replay()
    eager = ferroattn.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    recs = native.profiler_drain()
    assert len(recs) == 1 and recs[0]["start_ms"] is None  # no reference event given


def test_torch_profiler_sees_our_kernels(native, inputs):
    import torch

    q, k, v, g = inputs
    native.profiler_enable(True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as tp:
        _step(q, k, v, g)
        torch.cuda.synchronize()
    native.profiler_enable(False)
    recs = native.profiler_drain()
    names = [e.name for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(recs) == 4
    for r in recs:
        assert any(r["kernel"] in x and "ferroattn::" in x for x in names), (r["kernel"], sorted(set(names))[:20])


def test_varlen_records_are_inexact(native):
    import torch

    import ferroattn

    cu = torch.tensor([0, 300, 1024, 2048], dtype=torch.int32, device="cuda")
    x = torch.randn(2048, H, D, device="cuda", dtype=torch.bfloat16)
    native.profiler_enable(True)
    ferroattn.flash_attn_varlen_func(x, x, x, cu, cu, 1024, 1024, causal=True)
    native.profiler_enable(False)
    recs = native.profiler_drain()
    assert len(recs) == 1 and recs[0]["exact"] is False and recs[0]["flops"] > 0
