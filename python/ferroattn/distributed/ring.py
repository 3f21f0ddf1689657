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
from ..flash_attn_interface import _check_dropout, _check_flag, _check_softmax_scale, _check_window
from .merge import merge_attention

Part = Tuple[slice, slice, bool]   # (query rows, key rows, causal) of one block
#: which rows of a rank's local part a block uses: all of them, or the first / second half of
#: every sequence (zigzag: a sequence's first half is its chunk r, the second its chunk 2N − 1 − r)
ALL, FRONT, BACK = "all", "front", "back"


def block_parts(rank: int, src: int, causal: bool, zigzag: bool) -> List[Tuple[str, str, bool]]:
    """The blocks rank ``rank`` computes while it holds the K/V of rank ``src``, as (query part,
    key part, causal) with parts :data:`ALL` / :data:`FRONT` / :data:`BACK`. Plain ring: chunk r of
    N; causal keeps src < rank whole, src == rank causal, src > rank nothing. Zigzag (ranks hold
    chunks r and 2N − 1 − r): src == rank causal over both halves (the concatenation keeps causal
    order), src < rank every query row against the first key half, src > rank the second query
    half against every key row. Without ``causal`` every pair is whole. Each (query, key) pair of
    the sequence is in exactly one block of one (rank, src) step."""
    if not causal:
        return [(ALL, ALL, False)]
    if src == rank:
        return [(ALL, ALL, True)]
    if not zigzag:
        return [(ALL, ALL, False)] if src < rank else []
    return [(ALL, FRONT, False)] if src < rank else [(BACK, ALL, False)]


def block_plan(rank: int, src: int, seqlen: int, causal: bool, zigzag: bool) -> List[Part]:
    """:func:`block_parts` as row slices of a padded local part of ``seqlen`` rows."""
    half = seqlen // 2
    rows = {ALL: slice(0, seqlen), FRONT: slice(0, half), BACK: slice(half, seqlen)}
    return [(rows[qp], rows[kp], c) for qp, kp, c in block_parts(rank, src, causal, zigzag)]


def _block_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Optional[Tensor], cu_k: Optional[Tensor], max_q: int,
                   max_k: int, softmax_scale: float, causal: bool) -> Tuple[Tensor, Tensor]:
    """(out, softmax_lse) of one block: ``ferroattn::attn_fwd`` (padded when cu_q is None, else varlen)."""
    return torch.ops.ferroattn.attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, False)


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Optional[Tensor],
                    cu_k: Optional[Tensor], max_q: int, max_k: int, softmax_scale: float, causal: bool,
                    deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block: ``ferroattn::attn_bwd`` with the merged out and LSE."""
    return torch.ops.ferroattn.attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                        deterministic)


class _Padded:
    """Local parts (b, s, h, d), LSE (b, h, s): a part is a slice of dim 1."""

    def __init__(self, seqlen: int):
        self.s = seqlen
        self.rows = {ALL: slice(0, seqlen), FRONT: slice(0, seqlen // 2), BACK: slice(seqlen // 2, seqlen)}

    def take(self, x: Tensor, part: str) -> Tensor:
        return x[:, self.rows[part]]

    def take_lse(self, lse: Tensor, part: str) -> Tensor:
        return lse[:, :, self.rows[part]]

    def add(self, acc: Tensor, part: str, x: Tensor) -> None:
        acc[:, self.rows[part]] += x

    def merge(self, out: Tensor, lse: Tensor, part: str, o_b: Tensor, l_b: Tensor) -> None:
        r = self.rows[part]
        out[:, r], lse[:, :, r] = merge_attention(out[:, r], lse[:, :, r], o_b, l_b)

    def lse_like(self, q: Tensor, dtype) -> Tensor:
        b, s, h, _ = q.shape
        return torch.full((b, h, s), float("-inf"), dtype=dtype, device=q.device)

    def lengths(self, part: str):
        n = self.rows[part].stop - self.rows[part].start
        return None, n


def _ranges(starts: Tensor, counts: Tensor) -> Tensor:
    """The concatenated row ranges [starts[i], starts[i] + counts[i]) as one int64 index tensor,
    built with tensor ops on their device (no loop over the rows)."""
    total = int(counts.sum())
    first = torch.cumsum(counts, 0) - counts                     # each range's offset in the result
    pos = torch.arange(total, device=starts.device)
    return torch.repeat_interleave(starts - first, counts, output_size=total) + pos


class _Varlen:
    """Local parts (total, h, d) packing the sequences of ``cu_seqlens`` (this rank's share of
    each), LSE (h, total): a part is every sequence's rows, or the first / second half of each."""

    def __init__(self, cu_seqlens: Tensor, max_seqlen: int):
        starts = cu_seqlens[:-1].long()
        half = (cu_seqlens[1:] - cu_seqlens[:-1]).long() // 2
        self.idx = {ALL: None, FRONT: _ranges(starts, half), BACK: _ranges(starts + half, half)}
        cu_half = torch.cat([half.new_zeros(1), half.cumsum(0)]).to(torch.int32)
        self.cu = {ALL: cu_seqlens, FRONT: cu_half, BACK: cu_half}
        self.max = {ALL: int(max_seqlen), FRONT: int(max_seqlen) // 2, BACK: int(max_seqlen) // 2}

    def take(self, x: Tensor, part: str) -> Tensor:
        i = self.idx[part]
        return x if i is None else x[i]

    def take_lse(self, lse: Tensor, part: str) -> Tensor:
        i = self.idx[part]
        return lse if i is None else lse[:, i]

    def add(self, acc: Tensor, part: str, x: Tensor) -> None:
        i = self.idx[part]
        if i is None:
            acc += x
        else:
            acc.index_add_(0, i, x)

    def merge(self, out: Tensor, lse: Tensor, part: str, o_b: Tensor, l_b: Tensor) -> None:
        # (total, h, d) / (h, total) are merged as a batch of one (b, s, h, d) / (b, h, s)
        o, l = merge_attention(self.take(out, part)[None], self.take_lse(lse, part)[None], o_b[None], l_b[None])
        i = self.idx[part]
        if i is None:
            out.copy_(o[0])
            lse.copy_(l[0])
        else:
            out[i], lse[:, i] = o[0], l[0]

    def lse_like(self, q: Tensor, dtype) -> Tensor:
        return torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype, device=q.device)

    def lengths(self, part: str):
        return self.cu[part], self.max[part]


class _Ring:
    """The ring of a process group: send to the next rank, receive from the previous one.

    The transport the ring loops use is anything with ``rank``, ``world``, ``start(tensors) ->
    (receive buffers, requests)`` and ``wait(requests)``; a ``group`` argument that has those
    (e.g. the one-process simulation of tests/_ring_sim.py, N ranks as threads on one device) is
    used as it is (:func:`_transport`)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors):
        """Issue the send of ``tensors`` to the next rank and the receive of the same shapes from
        the previous one; returns (receive buffers, requests)."""
        # contiguous buffers whatever the inputs' strides (transformers passes transposed views)
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests) -> None:
        for r in requests:
            r.wait()


def _transport(group):
    """The ring of ``group``: the group itself when it is a transport (see :class:`_Ring`), else
    the torch.distributed ring of the process group."""
    return group if all(hasattr(group, a) for a in ("rank", "world", "start", "wait")) else _Ring(group)


def _forward(ring: _Ring, layout, q, k, v, softmax_scale, causal, zigzag):
    acc = torch.promote_types(q.dtype, torch.float32)   # fp32 for the 16-bit kernels' blocks
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = layout.lse_like(q, acc)
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.start(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for qp, kp, c in block_parts(ring.rank, src, causal, zigzag):
            (cu_q, max_q), (cu_k, max_k) = layout.lengths(qp), layout.lengths(kp)
            o_b, l_b = _block_forward(layout.take(q, qp), layout.take(kv[0], kp), layout.take(kv[1], kp), cu_q, cu_k,
                                      max_q, max_k, softmax_scale, c)
            layout.merge(out, lse, qp, o_b, l_b)
        if pending is not None:
            ring.wait(pending[1])
            kv = pending[0]
    # the kernels' convention: +inf for a row that saw no key
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return out.to(q.dtype), lse


def _backward(ring: _Ring, layout, dout, q, k, v, out, lse, softmax_scale, causal, zigzag, deterministic):
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.start(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for qp, kp, c in block_parts(ring.rank, src, causal, zigzag):
            (cu_q, max_q), (cu_k, max_k) = layout.lengths(qp), layout.lengths(kp)
            dq_b, dk_b, dv_b = _block_backward(layout.take(dout, qp), layout.take(q, qp), layout.take(kv[0], kp),
                                               layout.take(kv[1], kp), layout.take(out, qp), layout.take_lse(lse, qp),
                                               cu_q, cu_k, max_q, max_k, softmax_scale, c, deterministic)
            layout.add(dq, qp, dq_b.to(acc))
            layout.add(dkv[0], kp, dk_b.to(acc))
            layout.add(dkv[1], kp, dv_b.to(acc))
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
    def forward(ctx, q, k, v, layout, softmax_scale, causal, zigzag, deterministic, group):
        out, lse = _forward(_transport(group), layout, q, k, v, softmax_scale, causal, zigzag)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, softmax_scale, causal, zigzag, deterministic, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, softmax_scale, causal, zigzag, deterministic, group = ctx.args
        dq, dk, dv = _backward(_transport(group), layout, dout, q, k, v, out, lse, softmax_scale, causal, zigzag,
                               deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def require_initialized() -> None:
    """ArgumentError naming ``group`` unless torch.distributed is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise ArgumentError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")


def _check(q, k, v, dropout_p, softmax_scale, window_size, alibi_slopes, group, zigzag, varlen: bool) -> float:
    rank, layout = (3, "(total, h, d)") if varlen else (4, "(b, s, h, d)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != rank:
            raise ArgumentError(f"{name}: expected a {rank}-D tensor {layout}, got "
                                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    rows = 1 if varlen else 2
    if k.shape[:rows] != q.shape[:rows] or v.shape[:rows + 1] != k.shape[:rows + 1]:
        what = "total" if varlen else "(b, s)"
        raise ArgumentError(f"k, v: expected q's {what} = {tuple(q.shape[:rows])} on every rank (the ring's blocks "
                            f"are equal), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if d % 8 != 0 or k.shape[-1] != d or v.shape[-1] != d:
        raise ArgumentError(f"q, k, v: expected one head dim, a multiple of 8, got {q.shape[-1]}, {k.shape[-1]}, "
                            f"{v.shape[-1]}")
    if zigzag and not varlen and q.shape[1] % 2 != 0:
        raise ArgumentError(f"q: expected an even local length (the zigzag layout's two chunks), got {q.shape[1]}")
    # malformed values are ArgumentErrors as in flash_attn_func; well-formed unsupported ones are
    # NotImplementedError
    if _check_dropout(dropout_p) != 0.0:
        raise NotImplementedError(f"dropout_p: the ring runs without dropout, got {dropout_p!r}")
    left, right = _check_window(window_size)
    if (left >= 0 or right >= 0):
        raise NotImplementedError(f"window_size: the ring runs full or causal attention, got {(left, right)}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: the ring runs without ALiBi")
    return float(_check_softmax_scale(softmax_scale, d))


def _check_cu_seqlens(cu_seqlens, max_seqlen, total: int, zigzag: bool) -> int:
    """The local ``cu_seqlens`` of a varlen ring call: int32 (n + 1,) from 0 to ``total`` (q's
    rows), non-decreasing, every length even with ``zigzag``; ``max_seqlen`` an int >= the longest.
    Reads the values (one host copy). Returns max_seqlen. Raises ArgumentError."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 \
            or cu_seqlens.numel() < 1:
        shown = (f"dtype {cu_seqlens.dtype}, shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor)
                 else type(cu_seqlens).__name__)
        raise ArgumentError(f"cu_seqlens: expected an int32 (n + 1,) tensor, got {shown}")
    c = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(c[:-1], c[1:])]
    if c[0] != 0 or c[-1] != total or any(n < 0 for n in lens):
        raise ArgumentError(f"cu_seqlens: expected non-decreasing offsets from 0 to q's {total} rows, got {c}")
    if zigzag and any(n % 2 for n in lens):
        raise ArgumentError(f"cu_seqlens: expected even local lengths (the zigzag layout's two chunks of every "
                            f"sequence), got lengths {lens}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < max(lens, default=0):
        raise ArgumentError(f"max_seqlen: expected an int >= the longest local length {max(lens, default=0)}, "
                            f"got {max_seqlen!r}")
    return max_seqlen


def _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
               return_attn_probs, group, zigzag, cu_seqlens=None, max_seqlen=None):
    varlen = cu_seqlens is not None
    scale = _check(q, k, v, dropout_p, softmax_scale, window_size, alibi_slopes, group, zigzag, varlen)
    causal, deterministic = _check_flag(causal, "causal"), _check_flag(deterministic, "deterministic")
    if varlen:
        layout = _Varlen(cu_seqlens, _check_cu_seqlens(cu_seqlens, max_seqlen, q.shape[0], zigzag))
    else:
        layout = _Padded(q.shape[1])
    require_initialized()
    group = dist.group.WORLD if group is None else group
    out, lse = _RingAttention.apply(q, k, v, layout, scale, causal, zigzag, deterministic, group)
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


def ring_flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                                window_size=(-1, -1), alibi_slopes: Optional[Tensor] = None,
                                deterministic: bool = False, return_attn_probs: bool = False, group=None):
    """:func:`ring_flash_attn_func` for packed sequences: every sequence of the batch is split in
    order across the ranks (sequence i of global length L_i, a multiple of N: rank r holds its
    positions [r·L_i / N, (r + 1)·L_i / N)), and rank r's parts are packed as q (total, h, d),
    k, v (total, h_k, d) with ``cu_seqlens`` int32 (n + 1,) their local offsets (the global
    cu_seqlens // N) and ``max_seqlen`` the longest local length. The result is rank r's rows of
    flash_attn_varlen_func over the whole sequences.

    Returns out (total, h, d), or (out, softmax_lse (h, total) fp32, None) with
    ``return_attn_probs``. Differentiable in q, k, v. Reads cu_seqlens on the host once per call.
    Raises ArgumentError (shapes, cu_seqlens, max_seqlen, an uninitialised group) and
    NotImplementedError (dropout, window, ALiBi)."""
    return _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=False, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def zigzag_ring_flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                                       dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                       causal: bool = False, window_size=(-1, -1),
                                       alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                       return_attn_probs: bool = False, group=None):
    """:func:`ring_flash_attn_varlen_func` in the zigzag layout: every sequence is cut into 2N equal
    chunks (L_i a multiple of 2N) and rank r holds chunks r and 2N − 1 − r of each, packed in
    sequence order (:func:`ferroattn.distributed.shard_varlen` with ``zigzag=True``). Same
    arguments, returns and errors; every local length must be even."""
    return _ring_call(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                      return_attn_probs, group, zigzag=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


__all__ = ["block_parts", "block_plan", "ring_flash_attn_func", "ring_flash_attn_varlen_func",
           "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_varlen_func"]
