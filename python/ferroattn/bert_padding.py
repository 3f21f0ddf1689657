"""Remove and restore padding around the varlen attention call, as ``flash_attn.bert_padding``.

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens,
                                       max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)

Everything here is differentiable (plain torch indexing: the gradient of a gather is a scatter
into zeros and vice versa), so training through unpad -> varlen attention -> pad works; padded
positions get gradient 0. ``index_first_axis`` / ``index_put_first_axis`` are flash_attn's two
helpers under the same names. Source: flash_attn 2.8 ``bert_padding.py`` contract
(reference/api-contracts.md §1.1): ``unpad_input`` returns 5 values (older releases returned 4).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .errors import ArgumentError

__all__ = ["unpad_input", "unpad_indices", "pad_input", "index_first_axis", "index_put_first_axis"]


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """Rows ``indices`` of ``input`` along dim 0 (a gather; differentiable: the gradient is
    scattered back into zeros).

    Args:
        input: (n, ...) any dtype/device.
        indices: int64 (total,), values in [0, n) on input's device.

    Returns: (total, ...), a new tensor (not a view)."""
    return input[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """The inverse of :func:`index_first_axis`: a zero tensor (first_axis_dim, ...) with ``values``
    at rows ``indices`` (differentiable with respect to ``values``).

    Args:
        values: (total, ...); indices: int64 (total,), distinct values in [0, first_axis_dim).
        first_axis_dim: rows of the result.

    Returns: (first_axis_dim, ...) in values' dtype and device."""
    output = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return output.index_put((indices,), values)


def _check_mask(name: str, mask, shape) -> None:
    """A (batch, seqlen) bool or real mask (of ``shape`` when given; nonzero = a token);
    ArgumentError otherwise.
    Only metadata is read (no sync)."""
    if not isinstance(mask, Tensor):
        raise ArgumentError(f"{name}: expected a (batch, seqlen) bool or integer tensor, got {type(mask).__name__}")
    if mask.dim() != 2 or (shape is not None and tuple(mask.shape) != shape):
        want = "(batch, seqlen)" if shape is None else f"(batch, seqlen) = {shape}"
        raise ArgumentError(f"{name}: expected shape {want}, got {tuple(mask.shape)}")
    if mask.is_complex():
        raise ArgumentError(f"{name}: expected a bool or real tensor, got {mask.dtype}")


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Optional[Tensor] = None
                ) -> Tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """Gather the real tokens of a padded batch into one packed tensor.

    Args:
        hidden_states: (batch, seqlen, ...), any dtype/device.
        attention_mask: (batch, seqlen), bool or int (any real dtype); nonzero / True = real token (any position:
            left, right or middle padding all work; token order is kept).
        unused_mask: optional (batch, seqlen), same meaning: tokens that are kept in the packed
            tensor and counted in ``cu_seqlens`` but not in ``seqused`` (flash_attn semantics).

    Returns:
        hidden_unpad: (total, ...) the selected tokens, batch-major.
        indices: int64 (total,), their positions in the flattened (batch * seqlen) tensor.
        cu_seqlens: int32 (batch + 1,), prefix sums of the per-sequence token counts, from 0.
        max_seqlen_in_batch: Python int, the largest count (a host sync on CUDA).
        seqused: int32 (batch,), tokens per sequence selected by ``attention_mask`` alone.
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 2:
        raise ArgumentError(f"hidden_states: expected a (batch, seqlen, ...) tensor, got "
                            f"{tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__}")
    _check_mask("attention_mask", attention_mask, tuple(hidden_states.shape[:2]))
    indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch = unpad_indices(attention_mask, unused_mask)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def unpad_indices(attention_mask: Tensor, unused_mask: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Tensor, int, Tensor]:
    """The mask-only part of :func:`unpad_input` (one host sync, for ``max_seqlen``), so that
    callers that unpad several tensors with one mask (q, k and v of every layer) do it once.

    Returns ``(indices, cu_seqlens, max_seqlen_in_batch, seqused)`` as :func:`unpad_input` does.
    """
    _check_mask("attention_mask", attention_mask, None)
    # nonzero = a real token: as bools, the counts and the gathered positions agree for any mask
    # values (an int mask holding 2, or overlapping masks, would otherwise count a token twice)
    attention_mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, tuple(attention_mask.shape))
        unused = unused_mask if unused_mask.dtype == torch.bool else unused_mask != 0
        all_masks = attention_mask | unused
    else:
        all_masks = attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item()) if seqlens_in_batch.numel() else 0
    cu_seqlens = torch.zeros(seqlens_in_batch.shape[0] + 1, dtype=torch.int32, device=seqlens_in_batch.device)
    cu_seqlens[1:] = torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32)
    return indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Scatter packed tokens back into a zero-padded batch (inverse of :func:`unpad_input`).

    Args:
        hidden_states: (total, ...) packed tokens.
        indices: int64 (total,), positions in the flattened (batch * seqlen) tensor.
        batch, seqlen: the padded sizes.

    Returns:
        (batch, seqlen, ...) with ``hidden_states`` at ``indices`` and zeros elsewhere.
    """
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
