"""Shared by the GPU test files (test_gpu.py, test_gpu_backward.py, test_gpu_adversarial.py): the
device they run on, the dtypes they cover, the LSE tolerance and a random-input factory."""
from __future__ import annotations

import torch

BF16, FP16 = torch.bfloat16, torch.float16
DTYPES = [BF16, FP16]
LSE_ATOL = 2e-3  # fp32 softmax_lse against the fp32 reference, absolute (scaled by softmax_scale by users)
DEV = "cuda"  # one place, so the test logic can be dry-run elsewhere


def rand(*shape, dtype=BF16, grad=False):
    """A standard-normal tensor of ``shape`` and ``dtype`` on DEV; a leaf that requires grad when ``grad``."""
    return torch.randn(*shape, dtype=dtype, device=DEV).requires_grad_(grad)


def assert_lse_close(lse, ref_lse):
    """softmax_lse (fp32, the reference's shape) within LSE_ATOL · (1 + max|finite ref_lse|) of the
    fp32 reference; equal infinities (rows that see no key) count as equal."""
    from ferroattn.testing import max_abs_diff

    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    finite = ref_lse[torch.isfinite(ref_lse)]
    scale = 1.0 + (float(finite.abs().max()) if finite.numel() else 0.0)
    assert max_abs_diff(lse, ref_lse) <= LSE_ATOL * scale
