"""transformers' continuous batching on ferroattn: ``"paged|ferroattn"``.

``model.generate_batch(...)`` (and the ``ContinuousBatchingManager`` behind it) switches a model
loaded with ``attn_implementation="ferroattn"`` to ``"paged|ferroattn"``. :func:`register` of
:mod:`ferroattn.integrations.transformers` registers :func:`ferroattn_paged_attention_forward`
under that name, so continuous batching runs on ferroattn's kernels instead of failing with
transformers' "attn_implementation is not supported". One exception, transformers' choice: where
flash-attn 2/3 is importable (or its ``kernels`` hub fallback is), it switches a model of a name
without "flash" to ``"paged|flash_attention_N"`` instead, with a warning; load the model with
``attn_implementation="paged|ferroattn"`` to keep ferroattn there (a plain forward of such a
model then raises the ``cache`` error below: the name is for continuous batching only).

What transformers 5.17 hands a paged attention function whose name has no "flash" in it (its
``is_flash_attention_requested`` rule) -- and so what this function runs:

- q (1, h, total_q, d), the new k / v (1, h_k, total_new, d) of every request of the batch,
  ``cache`` (a ``PagedAttentionCache``), ``read_index`` / ``write_index`` (token slots of the
  cache, one tensor per layer group), ``cu_seq_lens_q``, ``cu_seq_lens_k`` and
  ``max_seqlen_q`` / ``max_seqlen_k`` (a dict per layer type when the model mixes full and
  sliding-window layers);
- Decode steps (few queries per request: ``attn_decode_rows_fit``) of full-attention layers run
  on the cache's pages: the new k / v are written into their slots (``write_index``, as
  ``cache.update`` writes them), a block table is read off ``read_index`` (a full-attention
  group reads a request's blocks whole and in order, transformers' ``FullAttentionCacheAllocator``:
  slot ``read_index[cu_k[r] + p]`` is ``block_table[r][p // block_size] * block_size + p %
  block_size``), and :func:`ferroattn.flash_attn_varlen_func` with ``block_table`` reads K / V
  once from the cache (the kv-cache kernel, any page size). No host synchronisation: the table is
  built by device ops, so CUDA-graph capture works.
- Every other step (prefill chunks, sliding-window groups, whose ring of slots is not a block
  table, a cache of another layout): ``cache.update`` writes the new k / v into their slots and
  gathers every request's keys, past and new, into (total_k, h_k, d);
  :func:`ferroattn.flash_attn_varlen_func` then runs causal attention (bottom-right aligned: a
  request's queries are its last tokens) over the packed requests. This is the path
  transformers' own ``paged|flash_attention_2`` takes when it has no block table.
- No attention mask (transformers builds 4-D masks only for ``paged|eager`` / ``paged|sdpa``),
  and never a block table: transformers enables its decode fast path (``flash_attn_with_kvcache``
  on the cache's pages) only for FlashAttention 2/3 names, so ``block_table`` is always None here.
- CUDA graphs stay off by default: transformers' heuristic turns them on only for names it knows
  need no mask. This path needs none; ``ContinuousBatchingConfig(use_cuda_graph=True)`` turns them
  on (tests/test_gpu_transformers_paged.py replays a run from them).

The options follow transformers' ``paged|flash_attention_2`` (``integrations/flash_paged.py``) --
``window_size = (w - 1, 0)`` for a layer of window ``w``; ``s_aux`` (attention sinks) passed on; a
value head dim below the query's (MLA) zero-padded and cropped. Where that path reads layer
attributes, this one follows what the model passes, as the plain ``"ferroattn"`` path does: the
``scaling`` kwarg (OPT passes 1.0 and keeps ``module.scaling = d ** -0.5``), the
``sliding_window`` kwarg (Mistral's layers have no such attribute; EXAONE-4's full-attention
layers have one and pass None); the per-layer-type dict entry is the one of the cache's group
for the layer (``cache.sliding_windows``), the keys ``cache.update`` gathered. ``softcap``
(Gemma-2's logit softcapping, which that path drops) reaches the kernel.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _native
from ..errors import ArgumentError
from ..flash_attn_interface import flash_attn_varlen_func
from ._kernel_call import call_kernel, value_at_head_dim, variant_kwargs

__all__ = ["PAGED_NAME", "ferroattn_paged_attention_forward"]

#: The name continuous batching switches ``"ferroattn"`` to (transformers prefixes ``paged|``).
PAGED_NAME = "paged|ferroattn"


def _layer_type(cache, layer_idx: int) -> str:
    """The cache's layer group kind of layer ``layer_idx`` (what keys ``cache.update`` gathered for
    it): ``"sliding_attention"`` where the cache keeps a window, else ``"full_attention"``."""
    return "full_attention" if cache.sliding_windows[layer_idx] == 1 else "sliding_attention"


def _for_layer(name: str, value, layer_type: str):
    """A per-layer-type dict's entry for ``layer_type`` (ArgumentError naming ``name`` when it is
    missing), or the value itself."""
    if not isinstance(value, dict):
        return value
    if layer_type not in value:
        raise ArgumentError(f"{name}: expected an entry for the layer's {layer_type!r}, got keys {sorted(value)}")
    return value[layer_type]


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _window(sliding_window) -> Tuple[int, int]:
    """window_size of a causal layer with window ``sliding_window`` (None or 0: none)."""
    if sliding_window is None or (_is_int(sliding_window) and sliding_window == 0):
        return (-1, -1)
    if not _is_int(sliding_window) or sliding_window < 1:
        raise ArgumentError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
    return (sliding_window - 1, 0)


@functools.cache
def _full_attention_allocator() -> type | tuple:
    """transformers' allocator of full-attention groups (whole blocks in order), or () where this
    transformers has none (isinstance of () is False: every layer then takes the gathered path)."""
    try:
        from transformers.generation.continuous_batching.cache_manager import FullAttentionCacheAllocator
    except ImportError:
        return ()
    return FullAttentionCacheAllocator


def _pages(cache, layer_idx: int, key: Tensor, value: Tensor, read_index, write_index, cu_k: Tensor, max_q: int,
           max_k: int, heads: int):
    """The decode path on the cache's pages for this layer: (k_pages, v_pages, block_table), the
    new k / v written into their slots first; None (nothing written) where the layer runs the
    gathered path: a sliding-window group, a step without cache reads, more queries than the
    kv-cache kernel takes (also every step padded for CUDA graphs: its max_seqlen_q is the padded
    query count), a head dim the kernels take only zero-padded, or a cache without the
    full-attention layout this reads (whole blocks in order: `FullAttentionCacheAllocator`)."""
    try:
        group_idx, in_group = cache.layer_index_to_group_indices[layer_idx]
        full = (cache.sliding_windows[layer_idx] == 1
                and isinstance(cache.group_cache_managers[group_idx], _full_attention_allocator()))
        block_size = int(cache.block_size)
        k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
        layer_read, layer_write = read_index[group_idx], write_index[group_idx]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    heads_k = key.shape[1]
    if (not full or layer_read.numel() == 0 or block_size < 1 or heads_k < 1 or heads % heads_k
            or not 0 <= int(max_q) < 2**31 or key.shape[-1] % 8 or value.shape[-1] % 8
            or not _native.attn_decode_rows_fit(int(max_q), heads // heads_k)
            or k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[0] % block_size
            or tuple(k_cache.shape[1:]) != (heads_k, key.shape[-1])
            or tuple(v_cache.shape) != tuple(k_cache.shape[:2]) + (value.shape[-1],)):
        return None
    # the write of cache.update for a full-attention layer
    k_cache.index_copy_(0, layer_write, key.transpose(1, 2).squeeze(0))
    v_cache.index_copy_(0, layer_write, value.transpose(1, 2).squeeze(0))
    # block j of request r starts at read_index[cu_k[r] + j * block_size] (device ops only)
    starts = cu_k[:-1].to(torch.int64)
    lengths = cu_k[1:].to(torch.int64) - starts
    first = torch.arange(max(-(-int(max_k) // block_size), 1), device=cu_k.device, dtype=torch.int64) * block_size
    valid = first[None, :] < lengths[:, None]
    slots = layer_read[torch.where(valid, starts[:, None] + first[None, :], 0)]
    block_table = torch.where(valid, torch.div(slots, block_size, rounding_mode="floor"), 0).to(torch.int32)
    pages = (-1, block_size) + tuple(k_cache.shape[1:])
    return k_cache.view(pages), v_cache.view(pages[:-1] + (v_cache.shape[-1],)), block_table


def _check(query: Tensor, key: Tensor, value: Tensor, cu_q, cu_k, max_q, max_k) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != 1:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ArgumentError(f"{name}: expected a packed (1, heads, tokens, head_dim) tensor, got {got}")
    for name, t in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ArgumentError(f"{name}: expected a 1-D int32/int64 tensor of offsets, got {got}")
    for name, x in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not _is_int(x):
            raise ArgumentError(f"{name}: expected an int, got {type(x).__name__}")


def ferroattn_paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    cache=None,
    cu_seq_lens_q: Optional[Tensor] = None,
    cu_seq_lens_k=None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k=None,
    block_table: Optional[Tensor] = None,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """One attention layer of a continuous-batching step (the ``"paged|ferroattn"`` function).

    Args:
        module: the attention layer: ``layer_idx`` (int), and ``scaling`` when the ``scaling``
            argument is None.
        query: (1, h, total_q, d), the queries of every request of the batch, packed.
        key, value: (1, h_k, total_new, d) and (1, h_k, total_new, d_v), d_v <= d: the batch's
            new keys and values, written into ``cache``.
        attention_mask: ignored (None from transformers for this name).
        cache: transformers' ``PagedAttentionCache``; its ``update`` writes the new k / v at
            ``write_index`` and returns (total_k, h_k, d) gathered at ``read_index``.
        cu_seq_lens_q: (n + 1,) int32/int64, the requests' query offsets; ``cu_seq_lens_k``:
            (n + 1,) int32/int64 key offsets into the gathered keys, or a dict of them per layer
            type, of which the entry of the cache's group for this layer is taken
            (``cache.sliding_windows[layer_idx]``: 1 = ``"full_attention"``).
        max_seqlen_q, max_seqlen_k: the longest request's query / key length (int; for the keys
            also a dict per layer type).
        block_table: must be None (transformers gives none to this name; see the module text).
        scaling: the softmax scale the model passes (OPT passes 1.0: its q_proj scales); None ->
            ``module.scaling``, else d ** -0.5.
        sliding_window: the window size w the model passes for this layer (int >= 1) -> causal
            ``window_size = (w - 1, 0)``; None or 0: none (the plain path's rule: the kwarg, never
            a layer attribute, which full-attention layers of some models carry too).
        softcap: logit softcapping (None -> 0.0, off).
        s_aux: None, or the (h,) attention-sink logits, cast to query's dtype.
        kwargs: ``read_index`` and ``write_index`` (lists of int64 slot tensors, one per layer
            group); anything else is ignored.

    Returns:
        ``(attn_output, None)``, attn_output (total_q, h, d_v) in query's dtype.

    Raises: ArgumentError without ``cache`` (this function only runs continuous batching's
    packed inputs: on a plain forward it would mix the batch's sequences), without
    ``read_index`` / ``write_index``, for a module without an int ``layer_idx``, a query/key/value
    that is not (1, heads, tokens, head_dim), offsets that are not 1-D int tensors, lengths that
    are not ints, a per-layer-type dict without the layer's entry, or a ``sliding_window`` that
    is not None or an int >= 0; NotImplementedError for a ``block_table``; otherwise as
    :func:`ferroattn.flash_attn_varlen_func`.
    """
    if cache is None:
        raise ArgumentError(f"cache: {PAGED_NAME!r} runs the packed inputs and paged cache of continuous batching "
                            "(generate_batch); got no cache -- use attn_implementation='ferroattn' for a plain forward")
    for name in ("read_index", "write_index"):
        if kwargs.get(name) is None:
            raise ArgumentError(f"{name}: {PAGED_NAME!r} needs continuous batching's {name} (one slot tensor per "
                                "layer group), got none")
    if block_table is not None:
        raise NotImplementedError(f"block_table: {PAGED_NAME!r} runs continuous batching's gathered-cache path; "
                                  "transformers' decode fast path on a block table is not wired to ferroattn")
    layer_idx = getattr(module, "layer_idx", None)
    if not _is_int(layer_idx):
        raise ArgumentError(f"module: expected an attention layer with an int layer_idx, got {layer_idx!r}")
    # which keys the cache gathered for this layer: its group's kind, not the attention's window
    # (a full-attention layer may carry a window attribute it does not use)
    layer_type = _layer_type(cache, layer_idx) if isinstance(cu_seq_lens_k, dict) else None
    cu_k = _for_layer("cu_seq_lens_k", cu_seq_lens_k, layer_type)
    max_k = _for_layer("max_seqlen_k", max_seqlen_k, layer_type)
    _check(query, key, value, cu_seq_lens_q, cu_k, max_seqlen_q, max_k)
    window_size = _window(sliding_window)

    value, crop = value_at_head_dim(value, query.shape[-1])
    pages = _pages(cache, layer_idx, key, value, kwargs["read_index"], kwargs["write_index"], cu_k, max_seqlen_q,
                   max_k, query.shape[1])
    paged = {}
    if pages is not None:
        k, v, paged["block_table"] = pages
    else:
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer_idx,
                            read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    q = query.transpose(1, 2).squeeze(0)   # (total_q, h, d) view
    out = call_kernel(flash_attn_varlen_func, q, k, v, cu_seq_lens_q.to(torch.int32), cu_k.to(torch.int32),
                      max_seqlen_q, max_k, softmax_scale=scale, causal=True, window_size=window_size,
                      **paged, **variant_kwargs(softcap, s_aux, query.dtype))
    return crop(out), None
