"""``torch.ops.ferroattn.attn_fwd_kvcache`` and ``torch.ops.ferroattn.kv_append``: attention over a
key/value cache (the decode path) and the in-place cache append with rotary embedding.

What lives here is what only Python can do (DESIGN §2): allocate outputs and the split partials'
workspace with torch (so a decode step is captured by a CUDA graph and replays correctly), pick the
current stream, and register the ops with ``torch.library``:

- ``ferroattn::kv_append`` declares that it mutates ``k_cache`` and ``v_cache`` (``mutates_args``),
  so ``torch.compile`` sees the in-place update; it returns q rotated (or an empty tensor when q is
  not rotated);
- ``ferroattn::attn_fwd_kvcache`` is a pure function of the cache; both have fake impls that run
  the Rust validation on metadata (``_native.attn_kvcache_check``), so
  ``torch.compile(fullgraph=True)`` traces a decode step without a graph break.

Layouts and semantics: flash_attn 2's ``flash_attn_with_kvcache`` (reference/api-contracts.md §1.6;
``src/ops/attention/kvcache.rs``). The kernels: ``kernels/attention/fwd_kvcache_sm80.cuh`` (split-KV
forward with all query heads of a kv head in one block, FlashDecoding, Dao et al. 2023),
``split_combine.cuh`` (the LSE merge), ``kv_append.cuh`` (append + rotary, Su et al. 2021).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from .._tensor_memo import TensorMemo
from ..errors import ArgumentError
from .attention import check_softmax_scale, positive_scale, values_available
from ._eager import plain_eager
from ._to_native import launch as _launch
from ._to_native import reject_forward_ad as _reject_forward_ad
from ._to_native import tensor_meta
from ._to_native import tile_aligned as _tile_aligned
from .variant import AttnVariant

__all__ = ["attn_fwd_kvcache", "kv_append", "run_attn_fwd_kvcache", "run_kv_append", "check_kvcache_meta",
           "cache_capacity", "check_paged_capacity"]

_CHECKED = TensorMemo(trust_inference=False)


def check_paged_capacity(cache_seqlens: Tensor, s_new: int, capacity: int) -> None:
    """flash_attn 2.8's guard for paged caches: ``max(cache_seqlens) + s_new`` must fit the block
    table's capacity (ArgumentError naming ``block_table``). It reads the values, which for a CUDA
    tensor is a device-to-host copy (a sync), so it runs only where reading is allowed
    (:func:`ferroattn.ops.attention.values_available`: a real int32 tensor, outside CUDA-graph capture
    and torch.compile, unless ``CHECK_CU_SEQLENS_VALUES`` is off) and once per version of the tensor
    (a model's layers share one ``cache_seqlens``). The kernels clamp every length to the capacity
    whether or not this check runs: nothing outside the cache is read or written."""
    if torch.compiler.is_compiling() or not values_available(cache_seqlens):
        return
    if _CHECKED.get(cache_seqlens, extra=(s_new, capacity), default=False):
        return
    longest = int(cache_seqlens.max().item()) + s_new
    if longest > capacity:
        raise ArgumentError(f"block_table: expected a capacity (max_pages x page_size = {capacity}) of at least "
                            f"max(cache_seqlens) + seqlen_new = {longest}, got {capacity}")
    _CHECKED.put(cache_seqlens, True, extra=(s_new, capacity))


def cache_capacity(k_cache: Tensor, block_table: Optional[Tensor], packed: bool = False) -> int:
    """Keys one sequence can hold: ``s_cache`` (contiguous), ``max_pages * page_size`` (paged), the
    packed rows (varlen keys)."""
    if packed:
        return int(k_cache.shape[0])
    if block_table is not None:
        return int(block_table.shape[-1]) * int(k_cache.shape[1])
    return int(k_cache.shape[1])


def check_kvcache_meta(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add,
                       cache_leftpad, cache_batch_idx, block_table, variant: AttnVariant) -> None:
    """The Rust validation of ``attn_fwd_kvcache`` on metadata (no data touched)."""
    _native.attn_kvcache_check(
        tensor_meta(q), tensor_meta(k_cache), tensor_meta(v_cache), tensor_meta(cu_seqlens_q),
        tensor_meta(cu_seqlens_k), int(max_seqlen_q), tensor_meta(cache_seqlens), int(seqlen_k_add),
        tensor_meta(cache_leftpad), tensor_meta(cache_batch_idx), tensor_meta(block_table), variant.for_check())


def _check_scalars(softmax_scale, num_splits) -> None:
    """The scalar arguments the Rust launch would reject, checked where the fake impl can too:
    softmax_scale finite in fp32 (any sign: <= 0 is mapped exactly by ``positive_scale``),
    num_splits in [0, 128]."""
    check_softmax_scale(softmax_scale)
    if isinstance(num_splits, int) and not 0 <= num_splits <= 128:
        raise ArgumentError(f"num_splits: expected an int in [0, 128] (0 = heuristic), got {num_splits}")


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int) -> Tuple[int, ...]:
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _attn_fwd_kvcache_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, cache_seqlens: Optional[Tensor], seqlen_k_add: int, cache_leftpad: Optional[Tensor],
    cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor], softmax_scale: float, causal: bool,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None, num_splits: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Attention of q over a key/value cache, ``softmax(softmax_scale · q kᵀ [+ variant]) v``.

    Args:
        q: (b, s_q, h, d), or varlen (total_q, h, d) with ``cu_seqlens_q``; fp16/bf16, CUDA, d a
            multiple of 8 (<= 256).
        k_cache, v_cache: (b_cache, s_cache, h_k, d) contiguous rows; (num_pages, page_size, h_k, d)
            with ``block_table`` (b, max_pages) int32 (any page size); or packed varlen keys
            (total_k, h_k, d) with ``cu_seqlens_k`` and no block_table. q's dtype; h % h_k == 0.
        cu_seqlens_q, cu_seqlens_k: None, or int32 (b + 1,) (varlen q; with cu_seqlens_k the key
            lengths are its differences, keys paged or packed).
        max_seqlen_q: varlen: the longest q sequence (the grid's size); else ignored.
        cache_seqlens: None or int32 (b,): keys per sequence before the ``seqlen_k_add`` appended
            ones (None: the whole cache row).
        cache_leftpad: None or int32 (b,): the first key row of each cache row (contiguous only).
        cache_batch_idx: None or int32 (b,): the cache row of each batch entry (contiguous only).
        softmax_scale: > 0; causal / window / softcap / ALiBi / sinks: the variant
            (:class:`ferroattn.ops.variant.AttnVariant`; positions count from the first key after
            the left pad, bottom-right aligned on each sequence's length).
        num_splits: 0 (heuristic) or 1..128 blocks per sequence's keys.

    Returns: out like q (q's dtype), softmax_lse fp32 (b, h, s_q) or (h, total_q), +inf for a row
    that sees no key.

    Raises: the ferroattn.errors classes of the Rust validation, naming the argument.
    Device-side lengths and indices are clamped to the cache: no value reads outside k/v_cache.
    """
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks)
    if q.dim() != (3 if cu_seqlens_q is not None else 4) or (cu_seqlens_q is not None and cu_seqlens_q.dim() != 1):
        check_kvcache_meta(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add,
                           cache_leftpad, cache_batch_idx, block_table, variant)   # names the bad rank
        raise ArgumentError(f"q: expected rank {3 if cu_seqlens_q is not None else 4}, got rank {q.dim()}")
    _check_scalars(softmax_scale, num_splits)
    out = torch.empty_like(q)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q, max_seqlen_q), dtype=torch.float32, device=q.device)
    varlen = cu_seqlens_q is not None
    packed = varlen and block_table is None
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        s_q = min(int(max_seqlen_q), q.shape[0])
    else:
        batch, s_q = q.shape[0], q.shape[1]
    heads, d = q.shape[-2], q.shape[-1]
    o_accum = lse_accum = None
    if q.device.type == "cuda" and q.numel() > 0 and batch > 0:
        splits = _native.attn_kvcache_num_splits(
            q.device.index if q.device.index is not None else torch.cuda.current_device(), batch, s_q, heads,
            k_cache.shape[-2], cache_capacity(k_cache, block_table, packed), d, block_table is not None, int(num_splits))
        if splits > 1:
            o_accum = torch.empty((splits, batch, heads, s_q, d), dtype=torch.float32, device=q.device)
            lse_accum = torch.empty((splits, batch, heads, s_q), dtype=torch.float32, device=q.device)
    q, softmax_scale = positive_scale(q, float(softmax_scale))
    q = _tile_aligned(q)
    _launch(_native.attn_fwd_kvcache, q.device,
            (q, k_cache, v_cache, out, lse, cu_seqlens_q, cu_seqlens_k),
            (int(max_seqlen_q), cache_seqlens, int(seqlen_k_add), cache_leftpad, cache_batch_idx, block_table,
             o_accum, lse_accum, float(softmax_scale), variant.for_native()),
            lambda: check_kvcache_meta(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens,
                                       seqlen_k_add, cache_leftpad, cache_batch_idx, block_table, variant))
    return out, lse


attn_fwd_kvcache = torch.library.custom_op("ferroattn::attn_fwd_kvcache", mutates_args=())(_attn_fwd_kvcache_impl)


@attn_fwd_kvcache.register_fake
def _attn_fwd_kvcache_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add,
                           cache_leftpad, cache_batch_idx, block_table, softmax_scale, causal, window_left=-1,
                           window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None, num_splits=0):
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks)
    check_kvcache_meta(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add,
                       cache_leftpad, cache_batch_idx, block_table, variant)
    _check_scalars(softmax_scale, num_splits)
    return (torch.empty_like(q),
            q.new_empty(_lse_shape(q, cu_seqlens_q, max_seqlen_q), dtype=torch.float32))


def run_attn_fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Optional[Tensor],
                         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, cache_seqlens: Optional[Tensor],
                         seqlen_k_add: int, cache_leftpad: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                         block_table: Optional[Tensor], softmax_scale: float, variant: AttnVariant,
                         num_splits: int = 0) -> Tuple[Tensor, Tensor]:
    """``attn_fwd_kvcache`` through the op whenever anything may watch or transform the call
    (:func:`ferroattn.ops._eager.plain_eager`), else through its implementation directly (the same
    code, without the dispatcher's host time). The kv-cache op has no autograd formula: a tensor
    that requires grad goes through the op, which returns outputs without a gradient."""
    # no jvp formula: a forward-mode tangent would be dropped silently (checked where it is visible)
    _reject_forward_ad("ferroattn::attn_fwd_kvcache", (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    args = (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add, cache_leftpad,
            cache_batch_idx, block_table, softmax_scale, variant.causal, variant.window_left, variant.window_right,
            variant.softcap, variant.alibi_slopes, variant.sinks, num_splits)
    if plain_eager((q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, cache_seqlens, cache_leftpad, cache_batch_idx,
                    block_table, variant.alibi_slopes, variant.sinks)):
        return _attn_fwd_kvcache_impl(*args)
    return attn_fwd_kvcache(*args)


def _kv_append_impl(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, q: Optional[Tensor],
                    rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
                    cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor], rotary_interleaved: bool,
                    q_per_token: bool) -> Tensor:
    """Write k (rotated by ``rotary_cos`` / ``rotary_sin`` when given) and v into the cache at
    positions ``cache_seqlens[b] + t`` (in place), and return q rotated at positions
    ``cache_seqlens[b] + i`` (``q_per_token``) or ``cache_seqlens[b]`` (an empty tensor when q is
    None).

    Args: k, v (b, s_new, h_k, d); the cache and its index tensors as :func:`attn_fwd_kvcache`
    (no leftpad here: positions are absolute); rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2)
    contiguous in q's dtype, rotary_dim a multiple of 16 <= d, seqlen_ro >= the cache's capacity;
    rotary_interleaved: pairs (2j, 2j + 1) (GPT-J) instead of (j, j + rotary_dim / 2) (GPT-NeoX).
    A position past the cache, or a page / cache row index outside the cache, writes nothing.
    """
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format) if q is not None else k.new_empty(0)
    k, v = _tile_aligned(k), _tile_aligned(v)
    if q is not None:
        q = _tile_aligned(q)
    _launch(_native.kv_append, k.device,
            (k_cache, v_cache, k, v, q, q_rot if q is not None else None, rotary_cos, rotary_sin, cache_seqlens,
             cache_batch_idx, block_table),
            (bool(rotary_interleaved), bool(q_per_token)),
            lambda: _check_append_meta(k_cache, v_cache, k, v, q, q_rot if q is not None else None, rotary_cos,
                                       rotary_sin, cache_seqlens, cache_batch_idx, block_table))
    return q_rot


kv_append = torch.library.custom_op("ferroattn::kv_append", mutates_args=("k_cache", "v_cache"))(_kv_append_impl)


def _check_append_meta(k_cache, v_cache, k, v, q, q_rot, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       block_table) -> None:
    """The Rust validation of ``kv_append`` on metadata (no data touched)."""
    _native.kv_append_check(tensor_meta(k_cache), tensor_meta(v_cache), tensor_meta(k), tensor_meta(v), tensor_meta(q),
                            tensor_meta(q_rot), tensor_meta(rotary_cos), tensor_meta(rotary_sin),
                            tensor_meta(cache_seqlens), tensor_meta(cache_batch_idx), tensor_meta(block_table))


@kv_append.register_fake
def _kv_append_fake(k_cache, v_cache, k, v, q, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
                    rotary_interleaved, q_per_token):
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format) if q is not None else k.new_empty(0)
    _check_append_meta(k_cache, v_cache, k, v, q, q_rot if q is not None else None, rotary_cos, rotary_sin,
                       cache_seqlens, cache_batch_idx, block_table)
    return q_rot


def run_kv_append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, q: Optional[Tensor],
                  rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
                  cache_batch_idx: Optional[Tensor], block_table: Optional[Tensor], rotary_interleaved: bool,
                  q_per_token: bool) -> Tensor:
    """``kv_append`` through the op or, in a plain eager call, its implementation (as
    :func:`run_attn_fwd_kvcache`)."""
    _reject_forward_ad("ferroattn::kv_append", (("k", k), ("v", v), ("q", q)))
    args = (k_cache, v_cache, k, v, q, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
            rotary_interleaved, q_per_token)
    if plain_eager((k, v, k_cache, v_cache, q, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table)):
        return _kv_append_impl(*args)
    return kv_append(*args)
