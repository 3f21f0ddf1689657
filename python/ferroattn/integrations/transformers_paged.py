"""transformers' continuous batching on ferroattn: ``"paged|ferroattn"``.

``model.generate_batch(...)`` (and the ``ContinuousBatchingManager`` behind it) switches a model
loaded with ``attn_implementation="ferroattn"`` to ``"paged|ferroattn"``. :func:`register` of
:mod:`ferroattn.integrations.transformers` registers :func:`ferroattn_paged_attention_forward`
under that name, so continuous batching runs on ferroattn's kernels instead of failing with
transformers' "attn_implementation is not supported".

What transformers 5.17 hands a paged attention function whose name has no "flash" in it (its
``is_flash_attention_requested`` rule) -- and so what this function runs:

- q (1, h, total_q, d), the new k / v (1, h_k, total_new, d) of every request of the batch,
  ``cache`` (a ``PagedAttentionCache``), ``read_index`` / ``write_index`` (token slots of the
  cache, one tensor per layer group), ``cu_seq_lens_q``, ``cu_seq_lens_k`` and
  ``max_seqlen_q`` / ``max_seqlen_k`` (a dict per layer type when the model mixes full and
  sliding-window layers);
- ``cache.update`` writes the new k / v into their slots and gathers every request's keys,
  past and new, into (total_k, h_k, d); :func:`ferroattn.flash_attn_varlen_func` then runs
  causal attention (bottom-right aligned: a request's queries are its last tokens) over the
  packed requests. This is the path transformers' own ``paged|flash_attention_2`` takes when it
  has no block table.
- No attention mask (transformers builds 4-D masks only for ``paged|eager`` / ``paged|sdpa``),
  and never a block table: transformers enables its decode fast path (``flash_attn_with_kvcache``
  on the cache's pages) only for FlashAttention 2/3 names, so ``block_table`` is always None here.
- CUDA graphs stay off by default: transformers' heuristic turns them on only for names it knows
  need no mask. This path needs none; ``ContinuousBatchingConfig(use_cuda_graph=True)`` turns them
  on (tests/test_gpu_transformers_paged.py replays a run from them).

The options follow transformers' ``paged|flash_attention_2`` (``integrations/flash_paged.py``):
``module.scaling`` -> ``softmax_scale``; a window size ``w`` -> ``window_size = (w - 1, 0)`` and
the ``"sliding_attention"`` entries of the per-layer-type dicts; ``s_aux`` (attention sinks)
passed on; a value head dim below the query's (MLA) zero-padded and cropped. Beyond it: ``w`` is
the model's ``sliding_window`` kwarg when it passes one (Mistral's layers have no
``sliding_window`` attribute, which is all transformers' flash paged path reads, so its prefill
there runs without the window), else ``module.sliding_window``; and ``softcap`` (Gemma-2's logit
softcapping, which transformers' flash paged path drops) reaches the kernel.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..errors import ArgumentError
from ..flash_attn_interface import flash_attn_varlen_func
from .transformers import _call, _crop_to, _same

__all__ = ["PAGED_NAME", "ferroattn_paged_attention_forward"]

#: The name continuous batching switches ``"ferroattn"`` to (transformers prefixes ``paged|``).
PAGED_NAME = "paged|ferroattn"


def _for_layer(value, layer_type: str):
    """A per-layer-type dict's entry for ``layer_type``, or the value itself."""
    return value[layer_type] if isinstance(value, dict) else value


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
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """One attention layer of a continuous-batching step (the ``"paged|ferroattn"`` function).

    Args:
        module: the attention layer: ``layer_idx``, ``scaling`` (softmax scale), and
            ``sliding_window`` (window size w; absent, None or False: full attention) when the
            ``sliding_window`` argument is None.
        query: (1, h, total_q, d), the queries of every request of the batch, packed.
        key, value: (1, h_k, total_new, d) and (1, h_k, total_new, d_v), d_v <= d: the batch's
            new keys and values, written into ``cache``.
        attention_mask: ignored (None from transformers for this name).
        cache: transformers' ``PagedAttentionCache``; its ``update`` writes the new k / v at
            ``write_index`` and returns (total_k, h_k, d) gathered at ``read_index``.
        cu_seq_lens_q: (n + 1,) int, the requests' query offsets; ``cu_seq_lens_k``: (n + 1,) int
            key offsets into the gathered keys, or a dict of them per layer type.
        max_seqlen_q, max_seqlen_k: the longest request's query / key length (int, or a dict per
            layer type for the keys).
        block_table: must be None (transformers gives none to this name; see the module text).
        sliding_window: the layer's window size w (the model's kwarg), or None.
        softcap: logit softcapping (None -> 0.0, off).
        s_aux: None, or the (h,) attention-sink logits, cast to query's dtype.
        kwargs: ``read_index`` and ``write_index`` (lists of int64 slot tensors, one per layer
            group); anything else is ignored.

    Returns:
        ``(attn_output, None)``, attn_output (total_q, h, d_v) in query's dtype.

    Raises: ArgumentError without ``cache`` (this function only runs continuous batching's
    packed inputs: on a plain forward it would mix the batch's sequences) or without
    ``read_index`` / ``write_index``; NotImplementedError for a ``block_table``; otherwise as
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
    # the model's kwarg (Mistral passes it and has no such attribute), else the layer's attribute
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    window_size, layer_type = ((window - 1, 0), "sliding_attention") if window else ((-1, -1), "full_attention")
    cu_k, max_k = _for_layer(cu_seq_lens_k, layer_type), _for_layer(max_seqlen_k, layer_type)

    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim < head_dim:   # MLA: one head dim for the kernel; pad v, crop the output
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])
    k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                        read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    fa_kwargs = dict(softmax_scale=getattr(module, "scaling", None), causal=True, window_size=window_size,
                     softcap=softcap if softcap is not None else 0.0)
    if s_aux is not None:
        fa_kwargs["s_aux"] = s_aux.to(query.dtype)
    q = query.transpose(1, 2).squeeze(0)   # (total_q, h, d) view
    out = _call(flash_attn_varlen_func, q, k, v, cu_seq_lens_q.to(torch.int32), cu_k.to(torch.int32),
                int(max_seqlen_q), int(max_k), **fa_kwargs)
    crop = _crop_to(v_head_dim) if v_head_dim < head_dim else _same
    return crop(out), None
