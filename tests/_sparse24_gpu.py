"""Helpers of the wgmma_sp GPU tests (tests/test_gpu_sparse24_splitk.py, tests/test_gpu_sparse24_sched.py):
pruned weights and activations from seeded generators, the fp32 reference check of act(x @ w.T + bias), the
native launcher (with the workspace its planner asks for) into a NaN-poisoned out, and the launch records of the
native profiler."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"
ACTS = {None: lambda y: y, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
        "silu": F.silu}
NATIVE_ACT = {None: "none", "relu": "relu", "gelu": "gelu_erf", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def sm90():
    """Skip unless an sm_90 device (wgmma_sp is sm_90a only)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma_sp needs an sm_90 device")


def weight(n, k, dtype, seed=0):
    """A 2:4-pruned (n, k) weight on the GPU."""
    from ferroattn import sparse24
    g = torch.Generator(device=DEV).manual_seed(seed)
    return sparse24.prune(torch.randn(n, k, device=DEV, dtype=dtype, generator=g))


def activations(rows, k, dtype, seed=1):
    """A (rows, k) activation on the GPU."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, k, device=DEV, dtype=dtype, generator=g)


def check(out, x, w, bias=None, activation=None):
    """`out` has x's dtype and shape (rows, n), no NaN, and is within twice the error of the low-precision
    torch result from the fp32 reference act(x @ w.T + bias) (ferroattn.testing.assert_close_to_ref)."""
    from ferroattn.testing import assert_close_to_ref
    b32 = None if bias is None else bias.float()
    ref = ACTS[activation](F.linear(x.float(), w.float(), b32))
    ref_lp = ACTS[activation](F.linear(x, w, None if bias is None else bias.to(x.dtype)))
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert not bool(torch.isnan(out).any())
    assert_close_to_ref(out.float(), ref, ref_lp.float(), factor=2.0)


def native_workspace(x, t, out, bias, n, k, activation, backend):
    """The workspace the native planner asks for (``_native.sparse24_matmul_workspace``: the
    launch's own plan), as the op layer allocates it: a uint8 tensor of that many bytes, or None."""
    from ferroattn import _native
    nbytes = _native.sparse24_matmul_workspace(x, t.values, t.meta, out, bias, n, k, activation, backend)
    return torch.empty(nbytes, dtype=torch.uint8, device=DEV) if nbytes else None


def native_call(x, t, n, k, bias=None, activation="none", backend="wgmma_sp"):
    """The native launcher (with the planned workspace) into a NaN-poisoned out (so an unwritten
    element shows)."""
    from ferroattn import _native
    out = torch.full((x.shape[0], n), float("nan"), device=DEV, dtype=x.dtype)
    ws = native_workspace(x, t, out, bias, n, k, activation, backend)
    _native.sparse24_matmul(x, t.values, t.meta, out, bias, n, k, activation, backend, ws,
                            torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out


def launch_records(fn):
    """The native profiler's launch records (dicts: kernel, config = name expression, grid, ...) of
    everything `fn` launched."""
    from ferroattn import _native
    torch.cuda.synchronize()
    _native.profiler_drain()
    _native.profiler_enable(True)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        _native.profiler_enable(False)
    return _native.profiler_drain()
