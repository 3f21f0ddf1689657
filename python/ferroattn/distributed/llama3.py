"""All-gather context parallelism for packed sequences, the scheme Llama 3 was trained with
(Meta, "The Llama 3 Herd of Models", 2024, §3.3.2: the K/V of the whole context are all-gathered,
then each rank computes the attention of its own queries).

The packed tokens of the batch (global ``cu_seqlens``, total T a multiple of N) are split in order
across the N ranks: rank r holds tokens [r·T/N, (r + 1)·T/N) of q, k, v, whatever sequences they
belong to. :func:`llama3_flash_attn_prepare_cu_seqlens` says, for one rank, which of its rows
belong to which sequence and which gathered keys they see; :func:`llama3_flash_attn_varlen_func`
all-gathers K and V ``heads_k_stride`` kv heads at a time (the gather of the next group runs
while this group's attention does, and the gathered buffer holds T × heads_k_stride rows), runs
the local queries against the keys of ``local_k_slice`` with the block kernels of
:mod:`.ring`, and in the backward reduce-scatters dK/dV back to the ranks that own the tokens.
Argument names and order are those of the ring-flash-attention project's functions."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import ArgumentError
from ..flash_attn_interface import _as_int, _check_flag
from . import ring as _ring


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: Tensor, causal: bool, rank: int,
                                         world_size: int) -> Tuple[Tensor, Tensor, int, int, slice]:
    """What rank ``rank`` of ``world_size`` needs to call :func:`llama3_flash_attn_varlen_func`.

    Args:
        cu_seqlens: int32 (n + 1,), the global offsets of the packed sequences (total T, a
            multiple of ``world_size``); read on the host.
        causal: whether the attention is causal (a causal query needs no key after it).
        rank, world_size: this rank and the group's size.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: the
        offsets (int32, on cu_seqlens' device) of the sequences that meet this rank's rows
        [r·T/N, (r + 1)·T/N) within those rows, and within the gathered keys they see; the
        longest of each; and the slice of the gathered (all T) keys: from the start of this
        rank's first sequence to the end of its rows (causal) or of its last sequence.

    Raises: ArgumentError (a bad cu_seqlens, a total that is not a multiple of world_size, a rank
    outside the world)."""
    causal = _check_flag(causal, "causal")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if _as_int(value) is None or isinstance(value, (bool, np.bool_)):
            raise ArgumentError(f"{name}: expected an int, got {value!r}")
    rank, world_size = _as_int(rank), _as_int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ArgumentError(f"rank: expected in [0, world_size) with world_size >= 1, got rank {rank}, "
                            f"world_size {world_size}")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype != torch.int32:
        shown = (f"dtype {cu_seqlens.dtype}, shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor)
                 else type(cu_seqlens).__name__)
        raise ArgumentError(f"cu_seqlens: expected an int32 (n + 1,) tensor with n >= 1, got {shown}")
    c = cu_seqlens.tolist()
    total = c[-1]
    if c[0] != 0 or any(b < a for a, b in zip(c[:-1], c[1:])) or total % world_size != 0 or total == 0:
        raise ArgumentError(f"cu_seqlens: expected non-decreasing offsets from 0 to a positive total that is a "
                            f"multiple of world_size {world_size}, got {c}")
    per = total // world_size
    start, end = rank * per, (rank + 1) * per
    seqs = [(a, b) for a, b in zip(c[:-1], c[1:]) if b > start and a < end]
    lens_q = [min(b, end) - max(a, start) for a, b in seqs]
    lens_k = [(min(b, end) if causal else b) - a for a, b in seqs]
    k_start, k_end = seqs[0][0], (end if causal else seqs[-1][1])

    def offsets(lens: List[int]) -> Tensor:
        return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(cu_seqlens.device)

    return offsets(lens_q), offsets(lens_k), max(lens_q), max(lens_k), slice(k_start, k_end)


class _Gather:
    """All-gathers of one head group after another (the next one issued before this one is used)."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def start(self, x: Tensor):
        buf = torch.empty((x.shape[0] * self.world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return buf, dist.all_gather_into_tensor(buf, x.contiguous(), group=self.group, async_op=True)


def _head_groups(heads_k: int, stride: int) -> List[slice]:
    return [slice(h, h + stride) for h in range(0, heads_k, stride)]


def _gathered(gather: _Gather, k: Tensor, v: Tensor, groups: List[slice]):
    """Yield (kv head group, gathered k, gathered v) for every group, issuing the next group's
    gathers before yielding this one's."""
    pending = [gather.start(k[:, groups[0]]), gather.start(v[:, groups[0]])]
    for i, g in enumerate(groups):
        (kg, wk), (vg, wv) = pending
        if i + 1 < len(groups):
            pending = [gather.start(k[:, groups[i + 1]]), gather.start(v[:, groups[i + 1]])]
        wk.wait()
        wv.wait()
        yield g, kg, vg


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice, softmax_scale, causal, deterministic,
                group):
        world = dist.get_world_size(group)
        group_q = q.shape[1] // k.shape[1]
        groups = _head_groups(k.shape[1], stride)
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32),
                          device=q.device)   # fp32 for the 16-bit kernels, as their LSE
        for g, kg, vg in _gathered(_Gather(group, world), k, v, groups):
            qh = slice(g.start * group_q, g.stop * group_q)
            o, l = _ring._block_forward(q[:, qh], kg[k_slice], vg[k_slice], cu_q, cu_k, max_q, max_k,
                                        softmax_scale, causal)
            out[:, qh], lse[qh] = o, l
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, stride, k_slice, softmax_scale, causal, deterministic, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, stride, k_slice, softmax_scale, causal, deterministic, group = ctx.args
        world = dist.get_world_size(group)
        group_q = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for g, kg, vg in _gathered(_Gather(group, world), k, v, _head_groups(k.shape[1], stride)):
            qh = slice(g.start * group_q, g.stop * group_q)
            dq_g, dk_s, dv_s = _ring._block_backward(dout[:, qh], q[:, qh], kg[k_slice], vg[k_slice], out[:, qh],
                                                     lse[qh], cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                                     deterministic)
            dq[:, qh] = dq_g
            for grad, part in ((dk, dk_s), (dv, dv_s)):
                # every rank's gradient of the gathered keys, summed onto the ranks that own them (fp32)
                acc = torch.promote_types(k.dtype, torch.float32)
                full = torch.zeros(kg.shape, dtype=acc, device=k.device)
                full[k_slice] = part.to(acc)
                mine = torch.empty((k.shape[0], *kg.shape[1:]), dtype=acc, device=k.device)
                dist.reduce_scatter_tensor(mine, full, group=group)
                grad[:, g] = mine.to(grad.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def llama3_flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                  max_seqlen_q: int, max_seqlen_k: int, heads_k_stride: int, local_k_slice: slice,
                                  dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                  causal: bool = False, window_size=(-1, -1), alibi_slopes: Optional[Tensor] = None,
                                  deterministic: bool = False, return_attn_probs: bool = False, group=None):
    """Attention of this rank's packed rows over the whole context, all-gathering K/V (module docs).

    Args:
        q: (T/N, h, d); k, v: (T/N, h_k, d): this rank's rows [r·T/N, (r + 1)·T/N) of the packed
            batch; fp16/bf16 CUDA, d a multiple of 8, h a multiple of h_k.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice: from
            :func:`llama3_flash_attn_prepare_cu_seqlens` (with the same ``causal``).
        heads_k_stride: kv heads gathered at a time (a divisor of h_k): the gathered buffer holds
            T × heads_k_stride rows per tensor.
        softmax_scale, causal, deterministic: as flash_attn_varlen_func (causal: bottom-right per
            sequence, which is the standard causal mask here: a sequence's queries on this rank
            are the tail of the keys they see).
        group: a torch.distributed process group (default the world).

    Returns out (T/N, h, d), or (out, softmax_lse (h, T/N) fp32, None) with ``return_attn_probs``.
    Differentiable in q, k, v (dK/dV reduce-scattered to the ranks owning the tokens).
    Raises ArgumentError (shapes, heads_k_stride, local_k_slice, an uninitialised group) and
    NotImplementedError (dropout, window, ALiBi)."""
    scale = _ring._check(q, k, v, dropout_p, softmax_scale, window_size, alibi_slopes, group, False, True)
    if k.shape[0] != q.shape[0]:
        raise ArgumentError(f"k: expected q's {q.shape[0]} rows, got {k.shape[0]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ArgumentError(f"q: expected a multiple of k's {k.shape[1]} heads, got {q.shape[1]}")
    hk = k.shape[1]
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or not 1 <= heads_k_stride <= hk \
            or hk % heads_k_stride != 0:
        raise ArgumentError(f"heads_k_stride: expected a divisor of k's {hk} heads, got {heads_k_stride!r}")
    _ring.require_initialized()
    group = dist.group.WORLD if group is None else group
    total = q.shape[0] * dist.get_world_size(group)
    if (not isinstance(local_k_slice, slice) or local_k_slice.step not in (None, 1)
            or not 0 <= (local_k_slice.start or 0) <= (local_k_slice.stop or 0) <= total):
        raise ArgumentError(f"local_k_slice: expected a slice within the {total} gathered keys, got {local_k_slice!r}")
    out, lse = _Llama3Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      heads_k_stride, local_k_slice, scale, _check_flag(causal, "causal"),
                                      _check_flag(deterministic, "deterministic"), group)
    return (out, lse, None) if return_attn_probs else out


__all__ = ["llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func"]
