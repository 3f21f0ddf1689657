"""HuggingFace transformers plug-in: ``attn_implementation="ferroattn"``.

    import ferroattn.integrations.transformers as fa_hf
    fa_hf.register()                                   # once, before building the model
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="ferroattn")

:func:`register` adds, under the name ``"ferroattn"`` (never a name containing "flash": transformers
routes those to its own FlashAttention loader), both

- the attention function :func:`ferroattn_attention_forward` to ``AttentionInterface``, and
- ``transformers.masking_utils.flash_attention_mask`` to ``AttentionMaskInterface``, so the function
  receives a 2-D (b, s_k) padding mask (True/1 = real token), or None when nothing is padded
  (without a mask function the mask would always be None and padding silently ignored).

and, under ``"paged|ferroattn"`` (the name continuous batching switches to), the paged function of
:mod:`ferroattn.integrations.transformers_paged`.

The function follows transformers' own FlashAttention-2 integration (reference/api-contracts.md
§3.2-§3.4): (b, h, s, d) in, transposed for free to flash_attn's (b, s, h, d); GQA through the
kv heads directly (no repeat); a padding mask unpads q/k/v, runs :func:`flash_attn_varlen_func`
and pads the output back; packed sequences (``cu_seq_lens_q/k`` + ``max_length_q/k`` kwargs, or
``position_ids`` restarting inside a batch of 1) run varlen without a mask; otherwise
:func:`flash_attn_func`. Returns ``(attn_output (b, s_q, h, d), None)``.

Per-model options reach the kernels exactly as transformers' ``_flash_attention_forward`` (v5.17)
passes them to flash_attn:

- ``is_causal`` kwarg, else ``module.is_causal`` -> ``causal`` (encoders such as BERT and
  ModernBERT are non-causal);
- ``scaling`` -> ``softmax_scale`` (Granite's ``attention_multiplier``, Gemma's
  ``query_pre_attn_scalar``, GPT-2's per-layer scaling all arrive here);
- ``sliding_window=w`` -> ``window_size=(w - 1, w - 1)``, only when the key length (k/v's padded
  length, past tokens included) exceeds ``w``; with ``causal`` flash_attn makes the right side 0,
  so a query sees itself and the ``w - 1`` keys before it (Mistral, Qwen2/3, Starcoder2, Phi-3,
  Gemma-2/3, Cohere2, GPT-OSS); non-causal it is the symmetric band ``|i - j| <= w - 1``
  (ModernBERT passes ``local_attention // 2 + 1``);
- ``softcap`` (Gemma-2's ``attn_logit_softcapping``; None -> 0.0, off);
- ``s_aux`` (attention sinks, GPT-OSS's ``sinks``: one logit per query head in the softmax
  denominator) -> ``s_aux=``, in the activations' dtype as transformers casts it (a no-op in a
  bf16 model; the gradient flows back to the parameter); a flash_attn function without an
  ``s_aux`` parameter raises NotImplementedError rather than drop the sinks;
- ``dropout`` (the model passes its attention dropout in train mode, 0.0 in eval) -> ``dropout_p``;
- ``deterministic`` (ModernBERT's ``deterministic_flash_attn``) as below;
- a value head dim smaller than the query's (MLA) is zero-padded up to it and the output cropped.

Inside :func:`ferroattn.distributed.context_parallel` (a batch sharded along the sequence over a
process group) every call runs the ring of :mod:`ferroattn.distributed` instead.

A Llama-4 chunked-attention layer whose keys span more than one chunk raises NotImplementedError
(transformers refuses it for flash attention too). No architecture passes ALiBi slopes to an
attention function in transformers 5.17 (Bloom, MPT and Falcon add ALiBi in their own eager
code), so there is no ALiBi kwarg to map.

Training: every step (transpose, dtype cast, unpadding gather, the flash_attn call, ``pad_input``)
is differentiable, so ``loss.backward()`` through a model using ``"ferroattn"`` reaches q, k, v and
the projections; padded positions get zero gradient. ``deterministic`` follows transformers'
FlashAttention rule: the ``deterministic`` kwarg when given, else the environment variable
``FLASH_ATTENTION_DETERMINISTIC=1``.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import distributed as _dist
from ..bert_padding import pad_input, unpad_indices
from ..distributed import context as _context
from .._tensor_memo import TensorMemo
from ..errors import ArgumentError
from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ._kernel_call import call_kernel, value_at_head_dim, variant_kwargs

__all__ = ["NAME", "register", "ferroattn_attention_forward"]

#: The attn_implementation name (contains no "flash" on purpose).
NAME = "ferroattn"

_log = logging.getLogger(__name__)
_WARNED = set()


def _target_dtype(query: Tensor, module: torch.nn.Module) -> Optional[torch.dtype]:
    """fp32 activations (e.g. layer norms kept in fp32, PEFT) are cast to the autocast dtype if
    autocast is on, else to the config's dtype for a quantized model, else to the dtype of the
    module's first half-precision Linear weight (transformers' rule); None when no cast is needed."""
    if query.dtype != torch.float32:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):  # quantized weights: the config's dtype
        dtype = getattr(config, "dtype", None)
        return dtype if dtype in (torch.float16, torch.bfloat16) else None
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in (torch.float16, torch.bfloat16):
            return layer.weight.dtype
    return None


def _is_packed(position_ids: Optional[Tensor], batch_size: int) -> bool:
    """True when a batch of one holds several sequences: position_ids is not one run
    ``min, min + 1, ...``. Needs the values (a host sync, as transformers' own check does); the
    answer is remembered per position_ids tensor, which every layer of a forward pass shares, so
    a forward pass syncs once, not once per layer."""
    if position_ids is None or batch_size != 1:
        return False
    packed = _PACKED.get(position_ids)
    if packed is None:
        ids = position_ids.reshape(-1)
        run = torch.arange(ids.shape[0], device=ids.device) + ids.min()
        packed = bool((run != ids).any())
        _PACKED.put(position_ids, packed)
    return packed


#: position_ids tensor -> packed? (inference tensors by identity: they are not written in place
#: between the layers of one forward pass).
_PACKED = TensorMemo(trust_inference=True)
#: packed position_ids tensor -> (cu_seqlens, max_seqlen).
_PACKED_CU = TensorMemo(trust_inference=True)
#: attention_mask tensor -> (indices, cu_seqlens, max_seqlen) of its keys ("k") or of its last
#: q_len columns (("q", q_len)): every layer of a forward pass unpads with the same mask, so the
#: host sync of unpadding happens once per forward pass, not once per layer.
_UNPAD = TensorMemo(trust_inference=True)


def _unpad_plan(attention_mask: Tensor, mask: Tensor, which) -> Tuple[Tensor, Tensor, int]:
    """(indices, cu_seqlens, max_seqlen) of ``mask`` (a bool view of ``attention_mask``),
    remembered per ``attention_mask`` tensor and ``which``."""
    plan = _UNPAD.get(attention_mask, extra=which)
    if plan is None:
        plan = unpad_indices(mask)[:3]
        _UNPAD.put(attention_mask, plan, extra=which)
    return plan


def _cu_seqlens_from_position_ids(position_ids: Tensor) -> Tuple[Tensor, int]:
    """Sequence boundaries of packed ``position_ids`` (1, s): a sequence starts at index 0 and
    wherever ``position_ids[i] != position_ids[i - 1] + 1`` (so a row may open with the tail of a
    document, e.g. [5, 6, 7, 0, 1, 2] -> [0, 3, 6]). Returns the int32 (n + 1,) cu_seqlens
    (starts, then the total length) and the longest sequence (Python int; one host sync)."""
    ids = position_ids.reshape(-1)
    is_start = torch.ones_like(ids, dtype=torch.bool)
    is_start[1:] = ids[1:] != ids[:-1] + 1
    starts = is_start.nonzero().reshape(-1).to(torch.int32)
    total = torch.tensor([ids.shape[0]], dtype=torch.int32, device=ids.device)
    cu = torch.cat([starts, total])
    return cu, int((cu[1:] - cu[:-1]).max().item())


def _deterministic(flag) -> bool:
    """transformers' rule (modeling_flash_attention_utils, v5.17): the ``deterministic`` kwarg when
    it is not None, else ``FLASH_ATTENTION_DETERMINISTIC == "1"`` (read on every call that can
    have a backward: with grad mode off the flag selects nothing, and the read, ~2 µs, is
    skipped)."""
    if flag is not None:
        return flag
    if not torch.is_grad_enabled():
        return False
    return os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _log.warning(message)


#: module -> its config's attention_chunk_size (read once per module: transformers sets it at
#: construction and reads it there too).
_CHUNK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_UNSEEN = object()


def _check_chunked(module: torch.nn.Module, kv_len: int) -> None:
    """A chunked-attention layer (Llama-4: ``config.layer_types[layer_idx] == "chunked_attention"``)
    whose keys span more than ``config.attention_chunk_size`` needs a block-diagonal causal mask
    that neither the 2-D padding mask nor a window can express: NotImplementedError, as
    transformers refuses it for flash attention, rather than silently attending across chunks."""
    try:
        chunk = _CHUNK.get(module, _UNSEEN)
    except TypeError:   # a module object that takes no weak reference: read every time
        chunk = _UNSEEN
    if chunk is _UNSEEN:   # a config attribute read costs ~2-5 µs: once per module
        chunk = getattr(getattr(module, "config", None), "attention_chunk_size", None)
        try:
            _CHUNK[module] = chunk
        except TypeError:
            pass
    if not chunk or kv_len <= chunk:   # the common case, decided first
        return
    types = getattr(module.config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] == "chunked_attention":
        raise NotImplementedError(
            f"ferroattn: chunked attention (attention_chunk_size={chunk}) over {kv_len} keys is not "
            f"implemented; use attn_implementation='sdpa' for this model")


def _check_mask(mask: Tensor, batch: int, kv_len: int) -> None:
    """A 2-D (batch, s_k) padding mask must match q's batch size and have at most ``kv_len``
    columns (k/v longer than the mask are sliced to it, the static-cache rule). Checked before
    unpad_input, whose gather with out-of-range indices is a device-side assert on CUDA."""
    if mask.dim() != 2:
        raise ArgumentError(
            f"attention_mask: expected a 2-D (batch, s_k) padding mask (register the mask function "
            f"with ferroattn.integrations.transformers.register()), got shape {tuple(mask.shape)}"
        )
    if mask.shape[0] != batch:
        raise ArgumentError(
            f"attention_mask: expected batch size {batch} (query's batch size), got shape {tuple(mask.shape)}"
        )
    if mask.shape[1] > kv_len:
        raise ArgumentError(
            f"attention_mask: expected at most {kv_len} columns (the key length s_k), got shape "
            f"{tuple(mask.shape)}"
        )


def ferroattn_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers attention function (AttentionInterface contract, transformers 5.x).

    Args:
        module: the attention layer (reads ``is_causal``; ``config`` for the fp32 cast rule).
        query: (b, h, s_q, d); key: (b, h_k, s_k, d); value: (b, h_k, s_k, d_v), d_v <= d
            (GQA: not repeated), fp16/bf16 CUDA (fp32 is cast as transformers' FA2 integration
            does). d_v < d (MLA) is zero-padded to d and the output cropped back to d_v.
        attention_mask: None (no padding) or bool/int (b, s_k) padding mask from
            ``flash_attention_mask`` (1 = real token). Left padding is assumed when
            1 < s_q < s_k, as transformers does. k/v longer than the mask (a static cache) are
            sliced to its length. ArgumentError for a mask that is not 2-D (register the mask
            function with :func:`register`), whose batch size is not q's, or that is longer
            than s_k.
        dropout: attention dropout probability -> ``dropout_p`` (the models pass 0.0 in eval).
        scaling: softmax scale (None -> d ** -0.5).
        sliding_window: window size w; when s_k > w it becomes window_size (w - 1, w - 1)
            (causal: the query and the w - 1 keys before it; non-causal: |i - j| <= w - 1);
            None, or s_k <= w: no window.
        softcap: logit softcapping (None -> 0.0, off).
        is_causal: overrides ``module.is_causal`` when not None.
        s_aux: None, or the (h,) attention-sink logits (one per query head) -> ``s_aux=``, cast
            to query's dtype (transformers' rule).
        kwargs: ``position_ids`` (b, s), ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/
            ``max_length_k`` (packed input), ``deterministic`` (bool or None: backward without
            atomics; None -> the environment variable ``FLASH_ATTENTION_DETERMINISTIC=1``),
            ``output_attentions`` (warned about once: no weights are returned); anything else is
            ignored.

    Returns:
        ``(attn_output, None)``: attn_output (b, s_q, h, d_v) in the compute dtype.

    Raises: ArgumentError (zero-sized query, bad attention_mask); NotImplementedError for an
    option the installed kernels do not support yet; otherwise as
    :func:`ferroattn.flash_attn_func` / :func:`ferroattn.flash_attn_varlen_func`.
    """
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "ferroattn does not return attention weights "
                   "(output_attentions=True); use attn_implementation='eager' to get them.")
    if query.numel() == 0:   # some dimension is 0
        raise ArgumentError(f"query: expected no zero dimension, got shape {tuple(query.shape)}")
    batch, q_len = query.shape[0], query.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (b, s, h, d) views
    v, crop = value_at_head_dim(v, q.shape[-1])
    target = _target_dtype(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)

    _check_chunked(module, k.shape[1])
    causal = bool(module.is_causal if is_causal is None else is_causal)
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    fa_kwargs = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                     deterministic=_deterministic(kwargs.get("deterministic")),
                     **variant_kwargs(softcap, s_aux, query.dtype))

    cp = _context.active()
    if cp is not None:   # inside ferroattn.distributed.context_parallel: the ring over its group
        return crop(_context_parallel(cp, q, k, v, attention_mask, fa_kwargs)), None

    if attention_mask is not None:
        _check_mask(attention_mask, batch, k.shape[1])
        mask = attention_mask.bool()
        if k.shape[1] > mask.shape[-1]:  # static cache: k/v longer than the tokens seen
            k, v = k[:, : mask.shape[-1]], v[:, : mask.shape[-1]]
        kv_len = k.shape[1]
        indices_k, cu_k, max_k = _unpad_plan(attention_mask, mask, "k")
        k_unpad = k.reshape(-1, *k.shape[2:])[indices_k]
        v_unpad = v.reshape(-1, *v.shape[2:])[indices_k]
        if q_len == kv_len:
            indices_q, cu_q, max_q = indices_k, cu_k, max_k
        elif q_len == 1:
            cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
            indices_q, max_q = cu_q[:-1].long(), 1
        else:  # left padding: the last q_len mask columns belong to the queries
            indices_q, cu_q, max_q = _unpad_plan(attention_mask, mask[:, -q_len:], ("q", q_len))
        q_unpad = q.reshape(-1, *q.shape[2:])[indices_q]
        out_unpad = call_kernel(flash_attn_varlen_func, q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k,
                                **fa_kwargs)
        out = pad_input(out_unpad, indices_q, batch, q_len)
        return crop(out), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    have_varlen_kwargs = cu_q is not None and cu_k is not None and max_q is not None and max_k is not None
    position_ids = kwargs.get("position_ids")
    if have_varlen_kwargs or _is_packed(position_ids, batch):
        if not have_varlen_kwargs:
            cu_q, max_q = _PACKED_CU.get(position_ids) or (None, None)
            if cu_q is None:
                cu_q, max_q = _cu_seqlens_from_position_ids(position_ids)
                _PACKED_CU.put(position_ids, (cu_q, max_q))
            cu_k, max_k = cu_q, max_q
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        out = call_kernel(flash_attn_varlen_func, q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                          v.reshape(-1, *v.shape[2:]), cu_q, cu_k, int(max_q), int(max_k), **fa_kwargs)
        return crop(out.view(batch, q_len, *out.shape[1:])), None

    return crop(call_kernel(flash_attn_func, q, k, v, **fa_kwargs)), None


def _context_parallel(cp, q: Tensor, k: Tensor, v: Tensor, attention_mask: Optional[Tensor], fa_kwargs: dict) -> Tensor:
    """One attention call of a sequence-sharded batch (:mod:`ferroattn.distributed.context`): the
    zigzag or plain ring over ``cp.group`` on this rank's (b, s/N, h, d) shard. Only what the ring
    runs: an unpadded batch, no softcap or sinks (dropout and windows are refused by the ring)."""
    if attention_mask is not None:
        raise NotImplementedError("attention_mask: context parallelism runs unpadded batches (pack the sequences "
                                  "or drop the padding), got a padding mask")
    if fa_kwargs["softcap"]:
        raise NotImplementedError(f"softcap: context parallelism runs without softcapping, got {fa_kwargs['softcap']}")
    if "s_aux" in fa_kwargs:
        raise NotImplementedError("s_aux: context parallelism runs without attention sinks")
    fn = _dist.zigzag_ring_flash_attn_func if cp.zigzag else _dist.ring_flash_attn_func
    return fn(q, k, v, fa_kwargs["dropout_p"], fa_kwargs["softmax_scale"], fa_kwargs["causal"],
              fa_kwargs["window_size"], None, fa_kwargs["deterministic"], group=cp.group)


def register() -> None:
    """Register ``"ferroattn"`` with transformers' AttentionInterface (the function above) and
    AttentionMaskInterface (``masking_utils.flash_attention_mask``), and ``"paged|ferroattn"``,
    the name continuous batching (``generate_batch``) switches to, with AttentionInterface
    (:func:`ferroattn.integrations.transformers_paged.ferroattn_paged_attention_forward`; no mask
    function: that path takes none). Idempotent; call before the model is built. Raises
    ImportError when transformers is not installed."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    from .transformers_paged import PAGED_NAME, ferroattn_paged_attention_forward

    AttentionInterface.register(NAME, ferroattn_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    AttentionInterface.register(PAGED_NAME, ferroattn_paged_attention_forward)
