"""Magnitude 2:4 pruning (:func:`prune`, the rule of :mod:`ferroattn.sparse24`) and the 2:4 check
(:func:`is_sparse24`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ArgumentError, DTypeError

__all__ = ["prune", "is_sparse24"]

_KEY = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
        torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _magnitude_key(g: Tensor) -> Tensor:
    """Sign-cleared bit patterns as integers: |x| order, inf above finite, every NaN (any sign or
    payload) equal to each other and above inf."""
    int_dtype, mask = _KEY[g.dtype]
    bits = g.view(int_dtype)
    if int_dtype == torch.int16:
        bits = bits.to(torch.int32)
    return torch.where(torch.isnan(g), mask, bits & mask)


def _keep_mask(groups: Tensor) -> Tensor:
    """groups (..., 4) -> bool (..., 4): the 2 largest magnitudes, ties to the lower index."""
    key = _magnitude_key(groups)
    rank = torch.zeros(groups.shape, dtype=torch.int8, device=groups.device)
    for j in range(4):
        kj = key[..., j:j + 1]
        beats = kj > key                                   # element j outranks element i
        beats[..., j + 1:] |= kj == key[..., j + 1:]       # ties: the lower index (j < i) wins
        rank += beats
    return rank < 2


def prune(w: Tensor) -> Tensor:
    """Magnitude 2:4 pruning: a new tensor like ``w`` where every aligned group of 4 along the last
    dim keeps its 2 largest magnitudes (ties: the lower index; NaN/inf kept, see the module
    docstring) and the other 2 elements are ``+0.0``. A last partial group (k % 4 != 0) is ranked
    as if padded with zeros. Same rule as ``compress(w, prune=True)`` (kernels and host reference).

    Args:
        w: (..., k) floating tensor (fp16, bf16, fp32 or fp64) on any device, any strides.
    Returns: a contiguous tensor of w's shape, dtype and device (not sharing memory with w).
    Raises: TypeError for a non-tensor, DTypeError for another dtype, ArgumentError for a 0-d w.
    """
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _KEY:
        raise DTypeError(f"w: expected a float16, bfloat16, float32 or float64 tensor, got {w.dtype}")
    if w.dim() == 0:
        raise ArgumentError("w: expected a tensor of rank >= 1 (groups of 4 along the last dim), got a 0-d tensor")
    w = w.detach()
    k = w.shape[-1]
    if k == 0 or w.numel() == 0:
        return w.clone(memory_format=torch.contiguous_format)
    pad = -k % 4
    g = F.pad(w, (0, pad)) if pad else w.contiguous()
    g = g.reshape(-1, (k + pad) // 4, 4)
    out = torch.empty_like(g)
    step = max(1, (1 << 22) // g.shape[1])        # about 16M elements per chunk (bounded temporaries)
    for r in range(0, g.shape[0], step):
        chunk = g[r:r + step]
        out[r:r + step] = torch.where(_keep_mask(chunk), chunk, torch.zeros((), dtype=w.dtype, device=w.device))
    out = out.reshape(*w.shape[:-1], k + pad)
    return out[..., :k].contiguous() if pad else out


def is_sparse24(w: Tensor) -> bool:
    """True when every aligned group of 4 along the last dim of ``w`` has at most 2 non-zeros
    (NaN counts as non-zero). Reads the values (a sync for CUDA tensors).

    Args: w: (..., k) tensor of rank >= 1, any dtype and device. An empty ``w`` (k = 0 or no rows)
    has no group and is 2:4 (True).
    Raises: TypeError for a non-tensor, ArgumentError for a 0-d tensor."""
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() == 0:
        raise ArgumentError("w: expected a tensor of rank >= 1 (groups of 4 along the last dim), got a 0-d tensor")
    if w.numel() == 0:
        return True
    return _bad_groups(w) == 0


def _bad_groups(w: Tensor) -> int:
    k = w.shape[-1]
    pad = -k % 4
    g = F.pad(w.detach(), (0, pad)) if pad else w.detach()
    nz = (g.reshape(-1, (k + pad) // 4, 4) != 0).sum(-1)
    return int((nz > 2).sum())
