"""Ring attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023) on
torch.distributed: each rank holds one part of the sequence's q, k, v; the K/V blocks pass around
the ring (send to rank + 1, receive from rank − 1, issued before the block's attention so the
transfer overlaps it); each rank merges the blocks' outputs through their LSE in fp32
(:mod:`.merge`). The backward passes the K/V blocks around again with their dK/dV accumulators
(fp32), which arrive back at their owner after a full turn; each block's gradients come from the
attention kernels' backward with the merged output and LSE (FlashAttention-2's backward needs only
those, Dao 2023 §3.2).

Which (query part, key part) pairs of a step run, and with which mask, is :func:`block_plan`."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import ArgumentError
from ..flash_attn_interface import _check_flag
from .merge import merge_attention

Part = Tuple[slice, slice, bool]   # (query rows, key rows, causal) of one block


def block_plan(rank: int, src: int, seqlen: int, causal: bool, zigzag: bool) -> List[Part]:
    """The blocks rank ``rank`` computes while it holds the K/V of rank ``src`` (local lengths
    ``seqlen`` on every rank). Plain ring: chunk r of N; causal keeps src < rank whole, src ==
    rank causal, src > rank nothing. Zigzag (ranks hold chunks r and 2N − 1 − r, halves of
    ``seqlen``): src == rank causal over both halves (the concatenation keeps causal order), src <
    rank every query row against the first key half, src > rank the second query half against
    every key row. Without ``causal`` every pair is whole. Each (query, key) pair of the sequence
    is in exactly one block of one (rank, src) step."""
    whole = slice(0, seqlen)
    if not causal:
        return [(whole, whole, False)]
    if src == rank:
        return [(whole, whole, True)]
    if not zigzag:
        return [(whole, whole, False)] if src < rank else []
    half = seqlen // 2
    if src < rank:
        return [(whole, slice(0, half), False)]
    return [(slice(half, seqlen), whole, False)]


def _block_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    """(out, softmax_lse) of one block: ``ferroattn::attn_fwd`` (padded layout)."""
    return torch.ops.ferroattn.attn_fwd(q, k, v, None, None, q.shape[1], k.shape[1], softmax_scale, causal, False)


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                    causal: bool, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block: ``ferroattn::attn_bwd`` with the merged out and LSE."""
    return torch.ops.ferroattn.attn_bwd(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], softmax_scale,
                                        causal, deterministic)


class _Ring:
    """The ring of a process group: send to the next rank, receive from the previous one."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors):
        """Issue the send of ``tensors`` to the next rank and the receive of the same shapes from
        the previous one; returns (receive buffers, requests)."""
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests) -> None:
        for r in requests:
            r.wait()


def _forward(ring: _Ring, q, k, v, softmax_scale, causal, zigzag):
    b, s, h, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)   # fp32 for the 16-bit kernels' blocks
    out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.start(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for qs, ks, c in block_plan(ring.rank, src, s, causal, zigzag):
            o_b, l_b = _block_forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], softmax_scale, c)
            out[:, qs], lse[:, :, qs] = merge_attention(out[:, qs], lse[:, :, qs], o_b, l_b)
        if pending is not None:
            ring.wait(pending[1])
            kv = pending[0]
    # the kernels' convention: +inf for a row that saw no key
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out.to(q.dtype), lse


def _backward(ring: _Ring, dout, q, k, v, out, lse, softmax_scale, causal, zigzag, deterministic):
    s = q.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.start(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for qs, ks, c in block_plan(ring.rank, src, s, causal, zigzag):
            dq_b, dk_b, dv_b = _block_backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                               lse[:, :, qs], softmax_scale, c, deterministic)
            dq[:, qs] += dq_b.to(acc)
            dkv[0][:, ks] += dk_b.to(acc)
            dkv[1][:, ks] += dv_b.to(acc)
        # the accumulators follow their K/V block: after the last step they reach its owner
        if ring.world > 1:
            recv, reqs = ring.start(dkv)
            ring.wait(reqs)
            dkv = recv
        if pending is not None:
            ring.wait(pending[1])
            kv = pending[0]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, zigzag, deterministic, group):
        ring = _Ring(group)
        out, lse = _forward(ring, q, k, v, softmax_scale, causal, zigzag)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, zigzag, deterministic, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        softmax_scale, causal, zigzag, deterministic, group = ctx.args
        dq, dk, dv = _backward(_Ring(group), dout, q, k, v, out, lse, softmax_scale, causal, zigzag, deterministic)
        return dq, dk, dv, None, None, None, None, None


def _check(q, k, v, dropout_p, softmax_scale, window_size, alibi_slopes, group, zigzag) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ArgumentError(f"{name}: expected a 4-D tensor (b, s, h, d), got "
                                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ArgumentError(f"k, v: expected q's (b, s) = {tuple(q.shape[:2])} on every rank (the ring's blocks are "
                            f"equal), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if d % 8 != 0 or k.shape[-1] != d or v.shape[-1] != d:
        raise ArgumentError(f"q, k, v: expected one head dim, a multiple of 8, got {q.shape[-1]}, {k.shape[-1]}, "
                            f"{v.shape[-1]}")
    if zigzag and q.shape[1] % 2 != 0:
        raise ArgumentError(f"q: expected an even local length (the zigzag layout's two chunks), got {q.shape[1]}")
    if dropout_p not in (0, 0.0) or (isinstance(dropout_p, float) and dropout_p != dropout_p):
        raise NotImplementedError(f"dropout_p: the ring runs without dropout, got {dropout_p!r}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size: the ring runs full or causal attention, got {tuple(window_size)}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: the ring runs without ALiBi")
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    if softmax_scale is None:
        return d ** -0.5
    return float(softmax_scale)


def _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group, zigzag):
    scale = _check(q, k, v, dropout_p, softmax_scale, window_size, alibi_slopes, group, zigzag)
    group = dist.group.WORLD if group is None else group
    out, lse = _RingAttention.apply(q, k, v, scale, _check_flag(causal, "causal"), zigzag,
                                    _check_flag(deterministic, "deterministic"), group)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                         softmax_scale: Optional[float] = None, causal: bool = False,
                         window_size=(-1, -1), alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                         return_attn_probs: bool = False, group=None):
    """Attention over a sequence split in order across the ranks of ``group``: rank r holds
    positions [r·s, (r + 1)·s) of q, k, v (b, s, h, d) / (b, s, h_k, d), fp16/bf16 CUDA, d a
    multiple of 8; the result is rank r's rows of flash_attn_func over the whole sequence (same
    semantics: ``softmax_scale`` default d^-1/2, bottom-right ``causal`` = standard causal here).

    Returns out (b, s, h, d), or (out, softmax_lse (b, h, s) fp32, None) with
    ``return_attn_probs``. Differentiable in q, k, v. ``group``: a torch.distributed process group
    (default the world). Raises ArgumentError (shapes, an uninitialised group) and
    NotImplementedError (dropout, window, ALiBi)."""
    return _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=False)


def zigzag_ring_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                                softmax_scale: Optional[float] = None, causal: bool = False,
                                window_size=(-1, -1), alibi_slopes: Optional[Tensor] = None,
                                deterministic: bool = False, return_attn_probs: bool = False, group=None):
    """:func:`ring_flash_attn_func` for the zigzag layout (:func:`ferroattn.distributed.zigzag_shard`):
    rank r holds chunks r and 2N − 1 − r of the sequence's 2N, so every rank does the same causal
    work. Same arguments, returns and errors; the local length must be even."""
    return _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=True)


__all__ = ["block_plan", "ring_flash_attn_func", "zigzag_ring_flash_attn_func"]
