"""Merging attention over disjoint key blocks through the softmax LSE.

For rows that attend to key sets K1 and K2 (disjoint), with outputs o_i = softmax over K_i and
lse_i = log Σ_{K_i} exp(s): lse = log(exp(lse_1) + exp(lse_2)) and
o = exp(lse_1 − lse)·o_1 + exp(lse_2 − lse)·o_2 (FlashAttention's online softmax, Dao et al. 2022
§3.1, applied to whole blocks). Computed in fp32 with the max subtracted, so it neither overflows
nor loses the smaller block."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..errors import ArgumentError


def _check_merge(out, lse, block_out, block_lse) -> None:
    """merge_attention's argument checks (shapes only: no data is read)."""
    for name, t in (("out", out), ("lse", lse), ("block_out", block_out), ("block_lse", block_lse)):
        if not isinstance(t, Tensor):
            raise ArgumentError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if out.dim() != 4:
        raise ArgumentError(f"out: expected (b, s, h, d), got shape {tuple(out.shape)}")
    b, s, h, _ = out.shape
    if tuple(block_out.shape) != tuple(out.shape):
        raise ArgumentError(f"block_out: expected out's shape {tuple(out.shape)}, got {tuple(block_out.shape)}")
    for name, t in (("lse", lse), ("block_lse", block_lse)):
        if tuple(t.shape) != (b, h, s):
            raise ArgumentError(f"{name}: expected (b, h, s) = {(b, h, s)}, got {tuple(t.shape)}")
    for name, t in (("out", out), ("lse", lse)):
        if t.dtype not in (torch.float32, torch.float64):
            raise ArgumentError(f"{name}: expected float32 or float64 (the running pair), got {t.dtype}")
    if lse.dtype != out.dtype:
        raise ArgumentError(f"lse: expected out's dtype {out.dtype}, got {lse.dtype}")
    for name, t in (("block_out", block_out), ("block_lse", block_lse)):
        if not t.is_floating_point():
            raise ArgumentError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def lse_for_merge(lse: Tensor) -> Tensor:
    """The kernels' LSE (+inf for a row that saw no key) as a merge operand (−inf there: the row's
    block contributes nothing)."""
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


def merge_attention(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge ``block_out`` / ``block_lse`` into the running ``out`` / ``lse``.

    Args:
        out: (b, s, h, d), fp32 (or wider), the running output (0 where lse is −inf).
        lse: (b, h, s), out's dtype, the running natural-log LSE (−inf: no key seen yet).
        block_out: (b, s, h, d), any float dtype: the block's output.
        block_lse: fp32 (b, h, s): the block's LSE (−inf or +inf: the block has no key for the row).

    Returns (out, lse), new tensors of out's dtype. Rows where both LSEs are −inf stay (0, −inf).
    Raises ArgumentError (not tensors, other shapes, a running pair that is not fp32 or wider)."""
    _check_merge(out, lse, block_out, block_lse)
    block_lse = lse_for_merge(block_lse.to(lse.dtype))
    new = torch.logaddexp(lse, block_lse)
    empty = torch.isneginf(new)
    w_old = torch.where(empty, torch.zeros_like(new), torch.exp(lse - new))
    w_blk = torch.where(empty, torch.zeros_like(new), torch.exp(block_lse - new))
    # (b, h, s) weights onto (b, s, h, 1)
    merged = out * w_old.transpose(1, 2).unsqueeze(-1) + block_out.to(out.dtype) * w_blk.transpose(1, 2).unsqueeze(-1)
    return merged, new
