"""``torch.ops.ferroattn.attn_bwd``: the attention-backward custom op.

The backward of ``torch.ops.ferroattn.attn_fwd`` (whose ``register_autograd`` in
:mod:`ferroattn.ops.attention` calls this op), a separate functional custom op so that
``torch.compile`` traces forward and backward as two opaque ops with fake impls and no graph
break. As for the forward, Python does what only Python can (DESIGN §2): allocate the gradients
and the workspaces with torch, normalise the layouts the kernels cannot read, pick the current
stream; ``ferroattn._native.attn_bwd`` validates and launches the kernels of
``tuning::attention_bwd::bwd_plan``:

- default: preprocess (D = rowsum(dout ∘ out) into ``softmax_d``, zero ``dq_accum``), dK/dV per key
  tile with dQ accumulated by fp32 atomics into ``dq_accum``, then dq = T(scale · dq_accum);
- ``deterministic=True``: no atomics and no ``dq_accum``; dQ in its own kernel; bitwise
  reproducible dq/dk/dv.

Extra memory is O(b·h·s): ``softmax_d`` (fp32, LSE's shape) and ``dq_accum`` (fp32, q's shape),
never an s×s buffer.

Registrations: the real kernel for every device type (a CPU tensor reaches the Rust validation
and gets a clear DeviceError), ``register_fake`` (``_native.attn_bwd_check`` on metadata, then
gradients shaped like q, k, v), and a FLOP formula of 2.5 × the forward's.

CUDA-graph safety: as the forward (current stream, torch allocations, no sync; the cu_seqlens
value check is memoised and skipped while capturing).

Sources: T. Dao, "FlashAttention-2", 2023, §3.2 (backward pass: recompute P from Q, K and the
LSE, D = rowsum(dO ∘ O), dS = P ∘ (dP − D)); flash_attn 2.8 ``flash_attn_interface.py`` (the
backward takes dout only -- the LSE's gradient is ignored --, gradients are ``empty_like`` of the
inputs, ``deterministic``; reference/api-contracts.md §1.2); torch 2.11 ``torch.library`` docs.
Varlen gradients are zero-filled here because the kernels write only rows inside a sequence.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from ._to_native import as_int, launch, reject_forward_ad, tensor_meta, tile_aligned
from .attention import (attn_fwd_flops, check_softmax_scale, check_varlen_values, lse_shape, positive_scale,
                        rank_error, scale_is_zero)
from .variant import AttnVariant

__all__ = ["attn_bwd", "attn_bwd_flops"]


def _check_meta(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                variant: Optional[AttnVariant] = None) -> None:
    """``_native.attn_bwd_check`` on metadata: the Rust validation, no data touched."""
    _native.attn_bwd_check(
        tensor_meta(dout), tensor_meta(q), tensor_meta(k), tensor_meta(v), tensor_meta(out),
        tensor_meta(softmax_lse), tensor_meta(cu_seqlens_q), tensor_meta(cu_seqlens_k),
        as_int(max_seqlen_q), as_int(max_seqlen_k),
        None if variant is None else variant.for_check(),
    )


def _readable(t: Tensor) -> Tensor:
    """A tensor whose last dim the kernels can read: copied when ``stride(-1) != 1`` (e.g. the
    expanded ``ones`` that ``out.sum().backward()`` passes as ``dout``, whose strides are all 0), as
    flash_attn's ``maybe_contiguous`` does. An *empty* such tensor (the ``sum()`` gradient of an
    empty batch or s_q = 0) is replaced by a fresh contiguous one: ``contiguous()`` returns an
    empty tensor unchanged, strides 0 included, which the validation would reject. Works on fake
    tensors (no data pointer read)."""
    if t.dim() == 0 or t.stride(-1) == 1:
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t.contiguous()


def _attn_bwd_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention, ``(dq, dk, dv)`` for ``out = softmax(softmax_scale · q kᵀ [+ mask]) v``.

    Args (flash_attn layout, as ``attn_fwd``; ``d`` a multiple of 8):
        dout: gradient of ``out``, q's shape and dtype, any strides (copied when stride(-1) != 1
            or its rows are not 16-byte aligned).
        q: (b, s_q, h, d) padded or (total_q, h, d) varlen; fp16/bf16, CUDA.
        k, v: (b, s_k, h_k, d) or (total_k, h_k, d); h % h_k == 0 (GQA).
        out: the forward's output for these inputs (q's shape and dtype).
        softmax_lse: the forward's fp32 LSE, (b, h, s_q) padded or (h, total_q) varlen.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: as given to the forward.
        softmax_scale: as given to the forward (any finite value; the forward's mapping of
            s <= 0 is mirrored: s < 0 runs with (−q, −s) and negates dq, s == 0 (in fp32) runs with
            (0, 1) and returns dq = 0, which are the exact gradients).
        deterministic: True -> kernels without atomics, bitwise identical results across runs;
            False -> dQ accumulated with fp32 atomics (faster; last bits may vary). ``causal`` and
            ``deterministic`` are ``bool`` in the op's schema: the dispatcher converts an int
            (e.g. 2 -> True) before this code runs, so such a value cannot be rejected here (the
            flash_attn functions reject it before calling the op).
        window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state: the forward's variant
            (:class:`ferroattn.ops.variant.AttnVariant`). The sinks' own gradient is not formed
            here (the forward's autograd formula adds it: :func:`ferroattn.ops.variant.sink_grad`).

    Returns:
        dq: q's shape and dtype (``empty_like(q)``: q's stride order when q is dense, else
            contiguous). dk, dv: k's / v's shape and dtype; with GQA the sum over each kv head's
            query heads. Varlen: zero-filled first (``zeros_like``), as rows after the last
            sequence are not written by the kernels. Rows that see no key get dq = 0; keys no
            query sees get dk = dv = 0.

    Raises: the ferroattn.errors classes from the Rust validation (DTypeError, DeviceError,
    ArgumentError naming the argument), ArgumentError from the cu_seqlens value check,
    CUDA/NVRTC errors;
    ArgumentError for a softmax_scale not finite in fp32; NotImplementedError when forward-mode AD tracks an input (no jvp formula).

    Forward-mode AD limitation (as for ``attn_fwd``): the check sees the tensors the caller holds;
    ``torch.ops.ferroattn.attn_bwd`` called *directly* inside ``torch.func.jvp`` receives tensors
    already unwrapped by functorch, whose tangents are invisible here, so a jvp through the raw
    op is not detected (its tangent is dropped). The autograd path (``attn_fwd``'s backward)
    checks ``dout`` before calling the op.
    """
    reject_forward_ad("ferroattn::attn_bwd", (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    lse_shape_ = lse_shape(q, cu_seqlens_q)
    if lse_shape_ is None:
        _check_meta(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        raise rank_error(q, cu_seqlens_q)
    check_softmax_scale(softmax_scale)
    varlen = cu_seqlens_q is not None
    alloc = torch.zeros_like if varlen else torch.empty_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    softmax_d = torch.empty(lse_shape_, dtype=torch.float32, device=q.device)
    dq_accum = None if deterministic else torch.empty(q.shape, dtype=torch.float32, device=q.device)
    check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dout, softmax_lse = _readable(dout), softmax_lse.contiguous()
    q_run, scale_run = positive_scale(q, softmax_scale)
    q_run, k_run, v_run = tile_aligned(q_run), tile_aligned(k), tile_aligned(v)
    dout, out = tile_aligned(dout), tile_aligned(out)
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    launch(_native.attn_bwd, q.device,
           (dout, q_run, k_run, v_run, out, softmax_lse, dq, dk, dv, softmax_d, dq_accum, cu_seqlens_q, cu_seqlens_k),
           (max_seqlen_q, max_seqlen_k, scale_run, variant.for_native(), deterministic),
           lambda: _check_meta(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, variant))
    if scale_is_zero(softmax_scale):
        dq.zero_()  # the scores do not depend on q (0 in fp32): its gradient is 0
    elif softmax_scale < 0.0:
        dq.neg_()  # the kernel differentiated with respect to −q
    return dq, dk, dv


attn_bwd = torch.library.custom_op("ferroattn::attn_bwd", mutates_args=())(_attn_bwd_impl)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, deterministic, window_left=-1, window_right=-1, softcap=0.0,
                   alibi_slopes=None, sinks=None, dropout_p=0.0, rng_state=None):
    reject_forward_ad("ferroattn::attn_bwd", (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)))
    # Same validation as the real op, from metadata, on the layouts the real op hands to Rust.
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    _check_meta(_readable(dout), q, k, v, out, softmax_lse.contiguous(), cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, variant)
    if lse_shape(q, cu_seqlens_q) is None:
        raise rank_error(q, cu_seqlens_q)
    check_softmax_scale(softmax_scale)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def attn_bwd_flops(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, *args,
                   out_val=None, **kwargs) -> int:
    """FLOPs of one ``attn_bwd`` call: 2.5 × the forward's (:func:`ferroattn.ops.attention.attn_fwd_flops`)
    -- five matmuls per visible (i, j) pair and head (recomputed S = q kᵀ, dV = Pᵀ dO, dP = dO vᵀ,
    dQ = dS k, dK = dSᵀ q) against the forward's two, FlashAttention-2's convention (§4.1)."""
    return attn_fwd_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                          causal, deterministic, window_left, window_right) \
        * _native.ATTN_BWD_PRODUCTS // _native.ATTN_FWD_PRODUCTS


register_flop_formula(torch.ops.ferroattn.attn_bwd, get_raw=True)(attn_bwd_flops)
