"""Shared by the GPU test files (test_gpu.py, test_gpu_backward.py, test_gpu_adversarial.py,
test_gpu_adversarial_bwd.py): the device they run on, the dtypes they cover, the LSE tolerance,
random-input factories, the allocator poisoning, the gradient check, the transformers setup and
the Hopper-family knob forcing of the sm90 tests."""
from __future__ import annotations

import contextlib

import torch

BF16, FP16 = torch.bfloat16, torch.float16
DTYPES = [BF16, FP16]
LSE_ATOL = 2e-3  # fp32 softmax_lse against the fp32 reference, absolute (scaled by softmax_scale by users)
DEV = "cuda"  # one place, so the test logic can be dry-run elsewhere


def rand(*shape, dtype=BF16, grad=False):
    """A standard-normal tensor of ``shape`` and ``dtype`` on DEV; a leaf that requires grad when ``grad``."""
    return torch.randn(*shape, dtype=dtype, device=DEV).requires_grad_(grad)


def poison_allocator(*tensors_or_nbytes):
    """Fill free blocks of the caching allocator with 0xFF bytes (NaN in fp16, bf16 and fp32) for
    the sizes about to be allocated (two blocks each), so an output element the kernels forget to
    write shows up as NaN instead of a plausible stale value."""
    sizes = [x.numel() * x.element_size() if isinstance(x, torch.Tensor) else int(x) for x in tensors_or_nbytes]
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) for n in sizes if n > 0 for _ in range(2)]
    del blocks


def capture_graph(f, warmup: int = 2):
    """Capture ``f()`` in a CUDA graph after ``warmup`` eager calls on a side stream (the JIT and
    the caching allocator do their first-call work outside the capture); returns (graph, the
    tensors ``f`` returned during capture, which each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = f()
    return graph, static


def launch_records(fn):
    """Run ``fn`` with the launch recorder on; return (fn's result, the records of our kernels it
    launched: dicts with "kernel", "config", "grid", ... from ``_native.profiler_drain``)."""
    from ferroattn import _native

    torch.cuda.synchronize()
    _native.profiler_enable(False)
    _native.profiler_drain()
    _native.profiler_enable(True)
    try:
        result = fn()
        torch.cuda.synchronize()
    finally:
        _native.profiler_enable(False)
    return result, _native.profiler_drain()


def assert_lse_close(lse, ref_lse):
    """softmax_lse (fp32, the reference's shape) within LSE_ATOL · (1 + max|finite ref_lse|) of the
    fp32 reference; equal infinities (rows that see no key) count as equal."""
    from ferroattn.testing import max_abs_diff

    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    finite = ref_lse[torch.isfinite(ref_lse)]
    scale = 1.0 + (float(finite.abs().max()) if finite.numel() else 0.0)
    assert max_abs_diff(lse, ref_lse) <= LSE_ATOL * scale


def rand_leaf(*shape, dtype=BF16, grad=True):
    """``rand`` that requires grad unless ``grad`` is False (the backward tests' inputs)."""
    return rand(*shape, dtype=dtype, grad=grad)


def check_grads(got, q, k, v, dout, causal, scale=None, cu_q=None, cu_k=None):
    """got = (dq, dk, dv): shapes and dtypes of q, k, v, finite, and within the pass rule
    (:func:`ferroattn.testing.assert_close_to_ref`, factor 3) against the fp32 reference."""
    from ferroattn.testing import assert_close_to_ref, attention_grads_ref

    refs = attention_grads_ref(q, k, v, dout, causal, scale, cu_q, cu_k)
    refs_lp = attention_grads_ref(q, k, v, dout, causal, scale, cu_q, cu_k, upcast=False)
    for name, g, r, r_lp, x in zip("qkv", got, refs, refs_lp, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), f"d{name} is not finite"
        assert_close_to_ref(g, r, r_lp, factor=3.0, name=f"d{name}")


def llama_transformers():
    """The transformers module (the test is skipped without it), offline, with
    attn_implementation="ferroattn" registered; seeds torch with 0 for the model's weights."""
    import os

    import pytest

    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ferroattn.integrations.transformers import register

    register()
    torch.manual_seed(0)
    return transformers


#: (b, s_q, s_k, h, h_k) of the sm90 forward and backward tests: a single row and key, query and
#: key tails, s_q > s_k (with causal the first rows see no key), MQA, a long sequence, s_k = 1.
SM90_SHAPES = [
    (1, 1, 1, 2, 1),
    (2, 113, 203, 4, 2),
    (1, 203, 113, 4, 4),
    (2, 256, 256, 8, 1),
    (1, 1025, 1025, 2, 2),
    (3, 97, 1, 2, 1),
]


@contextlib.contextmanager
def sm90_knob_forced(knob: str):
    """Run the block with tuning knob ``knob`` (``attn_fwd_family`` / ``attn_bwd_family``) set to
    ``sm90`` and restore it after; skips the test off sm_90 (the Hopper kernels need sm_90a)."""
    import pytest

    import ferroattn._native as native

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the sm90 family needs an sm_90 GPU")
    before = native.tuning_knobs()[knob]
    native.set_tuning_knob(knob, "sm90")
    try:
        yield
    finally:
        native.set_tuning_knob(knob, before)
