"""The 2:4 sparse product :func:`matmul` (``F.linear`` semantics with a fused activation) and the
row view it hands the kernel (:func:`rows_view`)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ArgumentError, DeviceError, DTypeError
from ..ops import sparse24 as _ops
from ..ops.activation import PUBLIC, activate, is_public
from .dispatch import choose_backend
from .tensor import Sparse24Tensor

__all__ = ["matmul", "rows_view", "BACKENDS"]

#: matmul backends: "auto" (dispatch table), "dense" (F.linear on the decompressed weight),
#: "sparse" (the 2:4 kernel, native auto), "mma_sp" (sm_80+), "wgmma_sp" (sm_90a)
BACKENDS = ("auto", "dense", "sparse", "mma_sp", "wgmma_sp")


def _same(o: Tensor) -> Tensor:
    return o


def rows_view(x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(x2, unflatten): x2 a (rows, k) tensor with stride(-1) == 1 holding x's rows, and a function
    mapping the (rows, n) result back to x's leading shape. x2 is a view when x's last dim is
    unit-stride and its leading dims, ordered by stride, collapse to one row stride (contiguous,
    transposed batch/sequence dims, row slices with a step); otherwise a copy. A 2-D x with
    unit-stride rows is returned itself (and unflatten is the identity): no view to make."""
    if x.dim() == 2 and x.stride(-1) == 1:     # the common cases first, with the fewest torch calls
        return x, _same
    k = x.shape[-1]
    if x.is_contiguous():
        lead = tuple(x.shape[:-1])
        return x.view(-1, k), lambda o: o.view(*lead, o.shape[-1])
    lead = tuple(x.shape[:-1])
    if x.stride(-1) != 1:
        x2 = x.reshape(-1, k).contiguous()
        return x2, lambda o: o.reshape(*lead, o.shape[-1])
    if x.dim() <= 2:
        return x.reshape(-1, k), lambda o: o.reshape(*lead, o.shape[-1])
    # order the leading dims by stride (largest first), ignoring size-1 dims
    order = sorted(range(len(lead)), key=lambda i: -x.stride(i))
    xp = x.permute(*order, x.dim() - 1)
    try:
        x2 = xp.view(-1, k)
    except RuntimeError:
        x2 = xp.reshape(-1, k).contiguous()
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    shape_p = tuple(lead[i] for i in order)

    def unflatten(o: Tensor) -> Tensor:
        return o.view(*shape_p, o.shape[-1]).permute(*inv, len(lead))
    return x2, unflatten



def matmul(x: Tensor, w_sparse: Sparse24Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           *, backend: str = "auto") -> Tensor:
    """``act(x @ w.T + bias)`` with ``w`` (n, k) the 2:4 matrix of ``w_sparse``:
    ``torch.nn.functional.linear`` semantics (plus a fused activation).

    Args:
        x: (..., k) float16/bfloat16 of w's dtype, on w's device; any leading shape (including
            none: a (k,) x gives (n,)) and any strides. Leading dims are flattened to rows without
            a copy when they can be (see :func:`rows_view`); a copy is made only when the last
            dim is not unit-stride or the leading dims cannot share one row stride.
        w_sparse: :class:`Sparse24Tensor` (n, k) from :func:`compress`.
        bias: None or (n,) of x's dtype or float32 (the kernel adds it to the fp32 accumulator;
            the dense path adds it in x's dtype, as F.linear does).
        activation: None, "relu", "gelu" (erf form; also "gelu_erf"), "gelu_tanh" or "silu".
        backend: "auto" (the dispatch rule of the module docstring), "dense" (F.linear on the
            cached decompressed weight), "sparse" (the 2:4 kernel, best for the device),
            "mma_sp" (sm_80+) or "wgmma_sp" (sm_90a).
    Returns: (..., n) of x's dtype. Gradients flow to x and bias; the sparse weight is frozen
        (see :mod:`ferroattn.ops.sparse24`).
    Raises: TypeError for a w_sparse that is not a Sparse24Tensor; DTypeError / DeviceError /
        ArgumentError naming x, bias, activation or backend; the kernel's validation errors.
    """
    if not isinstance(w_sparse, Sparse24Tensor):
        raise TypeError(f"w_sparse: expected a Sparse24Tensor (from ferroattn.sparse24.compress), "
                        f"got {type(w_sparse).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not is_public(activation):
        raise ArgumentError(f"activation: expected None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got {activation!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ArgumentError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    act = PUBLIC[activation]
    n, k = w_sparse.shape
    if x.dtype != w_sparse.dtype:
        raise DTypeError(f"x: expected the weight's dtype {w_sparse.dtype}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ArgumentError(f"x: expected a last dim of {k} (the weight's in_features), got shape {tuple(x.shape)}")
    if x.device != w_sparse.device:
        raise DeviceError(f"x: expected the weight's device {w_sparse.device}, got {x.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ArgumentError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype not in (x.dtype, torch.float32):
            raise DTypeError(f"bias: expected {x.dtype} or torch.float32, got {bias.dtype}")
        if bias.device != x.device:
            raise DeviceError(f"bias: expected x's device {x.device}, got {bias.device}")
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    if rows == 0:   # empty (..., n), connected to x and bias like F.linear's (zero gradients)
        y = x.sum(-1, keepdim=True).expand(*lead, n).clone()
        if bias is not None:
            y = y + bias.to(x.dtype)
        return activate(y, act)
    if backend == "auto":
        backend = choose_backend(rows, n, k, x.dtype, x.device, w_sparse.arch)
    if backend == "dense":
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        y = F.linear(x, w_sparse.dense(), bias)
        return y if act == "none" else activate(y, act)
    x2, unflatten = rows_view(x)
    # _ops.linear: the op, or in a plain eager call its implementation directly (same code, less
    # host time; ferroattn.ops._eager)
    out = _ops.linear(x2, w_sparse.values, w_sparse.meta, bias, n, k, act,
                      "auto" if backend == "sparse" else backend)
    return unflatten(out)
