"""``ferroattn.matmul``: dense tensor-core GEMM with a fused epilogue.

::

    out = act(alpha · a @ b + beta · c + bias)

fp16/bf16 inputs, fp32 accumulation and epilogue, one rounding to the output dtype, in one
kernel (kernels/gemm/wmma.cuh on sm_80+, kernels/gemm/sm90.cuh with wgmma + TMA on sm_90a).
Autograd, ``torch.compile(fullgraph=True)``, CUDA graphs and ``FlopCounterMode`` work through the
custom ops of :mod:`ferroattn.ops.gemm`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import ArgumentError, DTypeError
from .ops import gemm as _ops
from .ops._eager import plain_eager as _plain_eager
from .ops._to_native import reject_forward_ad as _reject_forward_ad

__all__ = ["matmul"]


def matmul(a: Tensor, b: Tensor, *, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           out_dtype: Optional[torch.dtype] = None, out: Optional[Tensor] = None, alpha: float = 1.0,
           beta: float = 0.0, c: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """``act(alpha · a @ b + beta · c + bias)`` on tensor cores.

    Args:
        a: (..., m, k), fp16 or bf16, CUDA. The leading dims are flattened into one batch dim
            (a view when the strides allow, else a copy: ``reshape`` semantics).
        b: (k, n) -- the same matrix for every batch entry -- or (batch, k, n) with ``batch``
            equal to a's flattened leading dims, or 1; a 2-D ``a`` is then broadcast over b's
            batch. a's dtype and device.
        bias: None or (n,), added to every row; a's dtype or float32.
        activation: None, "relu", "gelu" (exact, erf form: torch's default ``F.gelu``),
            "gelu_tanh" (``F.gelu(approximate="tanh")``) or "silu", applied last.
        out_dtype: None (a's dtype), torch.float16, torch.bfloat16 or torch.float32.
        out: None, or a preallocated tensor of the result's shape whose dtype is the output
            dtype (``out_dtype`` must then be None or equal). As for torch, ``out=`` does not
            support autograd: with grad mode on, an input that requires grad raises. ``out`` may
            have any strides (written through a temporary when it has no view of rows with unit
            stride) and must not overlap an input.
        alpha: scales ``a @ b`` (a real number finite in fp32).
        beta: scales ``c`` (finite in fp32); ``c`` is read only when ``beta != 0``.
        c: None or (..., m, n) of the output dtype whose leading dims flatten to the batch or to 1
            (broadcast); required when ``beta != 0``.
        backend: "auto" (the fastest path that supports the problem on this GPU), "wmma"
            (sm_80+) or "sm90" (sm_90a: H100/H200). An explicit backend that cannot run the
            problem raises ArgumentError naming ``backend`` and the reason.

    Returns:
        (..., m, n), contiguous, the output dtype (``out`` itself when given). The leading dims
        are ``torch.matmul``'s (a's leading dims broadcast with (batch,) of a 3-D b) when they
        hold the batch, else a's: a (2, 3, m, k) @ b (6, k, n) -> (2, 3, m, n).

    Layouts: every operand may be row- or column-major by its strides (``x.T`` / ``x.mT`` views
    are read in place, all four NN/NT/TN/TT cases, any alignment); an operand with no unit stride
    in its last two dims (e.g. ``x[:, ::2]``) is copied with ``.contiguous()`` first.

    Sizes: any m, n, k >= 1; batch up to at least 2**20. m, n or batch = 0 return an empty
    tensor; k = 0 returns ``act(beta · c + bias)`` -- zeros without c and bias, which is what
    ``torch.matmul`` returns for k = 0 -- without launching a kernel.

    Raises:
        ArgumentError (a ``ValueError``): bad ranks, batch counts, shapes (``a.shape[-1] !=
            b.shape[-2]`` names ``b`` and both k, also when one of them is 0), strides, alpha/beta,
            activation or backend names, ``c`` missing with ``beta != 0``, ``out`` with the
            wrong shape, ``out=`` with autograd; the message names the argument, the expected and
            the actual value.
        DTypeError (a ``TypeError``): a/b not fp16/bf16 or different, bad out_dtype, bias or c
            dtype.
        TypeError: a or b not a tensor, bias or c neither a tensor nor None (naming it).
        DeviceError: a tensor not on a's CUDA device.
        NotImplementedError: forward-mode AD (no jvp formula).

    Differences from ``torch.matmul``: fp16/bf16 inputs only (fp32 inputs raise DTypeError);
    b is 2-D or 3-D (no 1-D vectors); a's leading dims are flattened and matched against b's
    batch as one dim (``torch.matmul`` broadcasts dim by dim).

    Sources: cuBLASLt epilogue order (scale, + C, + bias, activation; ``cublasLtEpilogue_t``);
    GELU (Hendrycks & Gimpel, 2016) exact and tanh forms as ``torch.nn.functional.gelu``.
    """
    for name, t, optional in (("a", a, False), ("b", b, False), ("bias", bias, True), ("c", c, True)):
        if not (isinstance(t, Tensor) or (optional and t is None)):
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, "
                            f"got {type(t).__name__}")
    _reject_forward_ad("ferroattn.matmul", (("a", a), ("b", b), ("bias", bias), ("c", c)))
    act = _ops.public_activation(activation)
    _ops.check_args(alpha, beta, act, backend, out_dtype)  # before the op's schema sees them
    if out is not None:
        return _matmul_out(a, b, out, bias, c, alpha, beta, act, out_dtype, backend)
    if _plain_eager((a, b, bias, c)):
        # A plain eager call: the op's implementation directly (the same code) without tens of
        # µs of dispatcher and autograd-wrapper overhead per call (decode-sized GEMMs are short);
        # ferroattn.ops._eager lists the conditions.
        result, _ = _ops.run_gemm(a, b, bias, c, alpha, beta, act, out_dtype, backend)
        return result
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, bias, c))
    result, _ = _ops.gemm(a, b, bias, c, alpha, beta, act, out_dtype, backend, needs_grad and act != "none")
    return result


def _matmul_out(a, b, out, bias, c, alpha, beta, act, out_dtype, backend) -> Tensor:
    if not isinstance(out, Tensor):
        raise ArgumentError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if out_dtype is not None and out_dtype != out.dtype:
        raise DTypeError(f"out_dtype: expected None or out's dtype ({out.dtype}), got {out_dtype}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, bias, c, out)):
        raise ArgumentError("out: expected no tensor that requires grad with out= (as torch, functions with "
                            "out= do not support automatic differentiation), got inputs that require grad; "
                            "call without out= or under torch.no_grad()")
    torch.ops.ferroattn.gemm_out(a, b, out, bias, c, alpha, beta, act, backend)
    return out
