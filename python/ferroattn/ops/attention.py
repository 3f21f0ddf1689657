"""``torch.ops.ferroattn.attn_fwd``: the attention-forward custom op.

What lives here is what only Python can do (DESIGN §2): allocate the outputs with torch, pick the
current stream, detach, hand everything to ``ferroattn._native.attn_fwd`` (which validates and
launches), plus the torch.library registrations that make the op a first-class citizen:

- the real kernel, registered for *every* device type, so a CPU tensor reaches the Rust
  validation and gets a clear :class:`~ferroattn.errors.DeviceError` (not a dispatcher error);
- ``register_fake``: runs the same Rust validation on metadata (``_native.attn_fwd_check``) and
  returns outputs with exact shapes, dtypes and strides; so ``torch.compile(fullgraph=True)``
  traces it without a graph break and bad inputs fail already at trace time;
- ``register_autograd``: ``setup_context`` saves q, k, v, out and softmax_lse; the backward calls
  the second custom op ``torch.ops.ferroattn.attn_bwd`` (:mod:`ferroattn.ops.attention_bwd`), so
  ``torch.compile`` sees two custom ops and no graph break. The gradient of ``softmax_lse`` is
  ignored (flash_attn does the same: its backward takes only ``dout``);
- a FLOP formula for ``torch.utils.flop_counter.FlopCounterMode``.

CUDA-graph safety: the launch uses ``torch.cuda.current_stream(q.device)`` (the capture stream
while capturing), outputs come from torch's caching allocator, and nothing synchronises. The only
host sync is the optional value check of ``cu_seqlens`` (:func:`check_cu_seqlens_values`), which is
skipped while the stream is being captured.

Sources: FlashAttention-2 (Dao, 2023) §3.1 for the forward pass; flash_attn 2.8
``flash_attn_interface.py`` for the output conventions (``out = empty_like(q)``, fp32 LSE of shape
(b, h, s_q) padded or (h, total_q) varlen); torch 2.11 ``torch.library`` docs.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from .._tensor_memo import TensorMemo
from ..errors import ArgumentError
from ._eager import plain_eager
from ._to_native import as_int as _as_int
from ._to_native import launch as _launch
from ._to_native import reject_forward_ad as _reject_forward_ad
from ._to_native import tensor_meta
from ._to_native import tile_aligned as _tile_aligned
import dataclasses

from .variant import DMASK_GROUP, AttnVariant, sink_grad
from .variant import visible_pairs as visible_pairs

__all__ = ["attn_fwd", "run_attn_fwd", "check_cu_seqlens_values", "check_varlen_values", "tensor_meta",
           "attn_fwd_flops", "causal_pairs", "lse_shape", "rank_error", "positive_scale", "check_softmax_scale",
           "scale_is_zero", "check_fwd_meta", "values_available", "visible_pairs", "AttnVariant", "attn_fwd_dmask", "run_attn_fwd_dmask"]

#: Check the *values* of real cu_seqlens (and of a paged call's cache_seqlens,
#: :func:`ferroattn.ops.kvcache.check_paged_capacity`) before a launch (one tiny device-to-host
#: copy, i.e. a sync, for CUDA tensors, once per tensor version; never done while capturing a CUDA
#: graph nor on fake/meta tensors).
#: Disable with the environment variable ``FERROATTN_CHECK_CU_SEQLENS=0`` or by setting this to
#: False when the host sync matters more than the check.
CHECK_CU_SEQLENS_VALUES: bool = _native.env_switch("FERROATTN_CHECK_CU_SEQLENS", True)


# ---------------------------------------------------------------------------------------------
# metadata for the Rust validation
# ---------------------------------------------------------------------------------------------
def _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                variant: Optional[AttnVariant] = None) -> None:
    """``_native.attn_fwd_check`` on metadata: the Rust validation, no data touched."""
    _native.attn_fwd_check(
        tensor_meta(q), tensor_meta(k), tensor_meta(v),
        tensor_meta(cu_seqlens_q), tensor_meta(cu_seqlens_k),
        _as_int(max_seqlen_q), _as_int(max_seqlen_k),
        None if variant is None else variant.for_check(),
    )


# ---------------------------------------------------------------------------------------------
# data-dependent cu_seqlens checks (Python: they need the values)
# ---------------------------------------------------------------------------------------------
def values_available(t: Optional[Tensor]) -> bool:
    """True when reading ``t``'s values is possible and allowed: a real (not fake, not meta)
    int32, 1-D, contiguous tensor, not on a stream that is being captured into a CUDA graph."""
    if t is None or not CHECK_CU_SEQLENS_VALUES:
        return False
    if isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta":
        return False
    # leave dtype / rank / contiguity errors to the Rust validation (they name the argument)
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.numel() < 1:
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_cu_seqlens_values(cu_seqlens: Optional[Tensor], name: str, rows: int,
                            max_seqlen: int, max_name: str) -> None:
    """Check the values of ``cu_seqlens`` (int32, (batch + 1,)): first value exactly 0 (as
    flash_attn requires; rows before it would be left unwritten), non-decreasing, last value <=
    ``rows`` (the number of rows of the packed tensor, e.g. ``q.shape[0]``), and every sequence
    length <= ``max_seqlen`` (the kernel sizes its grid from ``max_seqlen``; a longer sequence
    would leave rows unwritten).

    These checks need the data, so they run only on real tensors outside CUDA-graph capture (see
    :func:`values_available`); for a CUDA tensor they copy ``batch + 1`` int32 values to the host,
    which synchronises with the current stream. Raises :class:`~ferroattn.errors.ArgumentError`
    naming the argument and the offending value.

    Memoised: a model passes the same tensor to every layer, so a tensor that passed is not read
    again (no host sync) until torch's version counter says it was written (any in-place torch op,
    also through a view or ``out=``; inference tensors have no counter and are checked on every
    call). Limitation: writes that bypass the counter (through ``.data``, a numpy view, a DLPack
    consumer or a custom kernel) are not seen, and the stale values are not re-checked; the kernel
    clamps cu_seqlens values, so such a tensor gives wrong output for the affected rows but never
    an out-of-bounds access."""
    if not values_available(cu_seqlens):
        return
    # A model calls every layer with the same cu_seqlens tensor: check (and sync) once per tensor
    # version, not once per call (inference tensors, which have no version, on every call).
    if _VERIFIED.get(cu_seqlens, extra=(rows, max_seqlen), default=False):
        return
    vals: List[int] = cu_seqlens.tolist()
    if vals[0] != 0:
        raise ArgumentError(f"{name}: expected a first value of 0, got {vals[0]}")
    longest = 0
    for i in range(1, len(vals)):
        n = vals[i] - vals[i - 1]
        if n < 0:
            raise ArgumentError(
                f"{name}: expected non-decreasing values, got {name}[{i}] = {vals[i]} < "
                f"{name}[{i - 1}] = {vals[i - 1]}"
            )
        longest = max(longest, n)
    if vals[-1] > rows:
        raise ArgumentError(
            f"{name}: expected the last value <= {rows} (the number of rows of the packed "
            f"tensor), got {vals[-1]}"
        )
    if longest > max_seqlen:
        raise ArgumentError(
            f"{max_name}: expected >= the longest sequence in {name} ({longest}), got {max_seqlen}"
        )
    _VERIFIED.put(cu_seqlens, True, extra=(rows, max_seqlen))


#: cu_seqlens tensors whose values passed :func:`check_cu_seqlens_values`.
_VERIFIED = TensorMemo(trust_inference=False)


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> Optional[Tuple[int, ...]]:
    """fp32 LSE shape: (b, h, s_q) for padded q (b, s_q, h, d); (h, total_q) for varlen q
    (total_q, h, d). None when q's rank does not fit (the Rust validation names the error)."""
    if cu_seqlens_q is None and q.dim() == 4:
        return (q.shape[0], q.shape[2], q.shape[1])
    if cu_seqlens_q is not None and q.dim() == 3:
        return (q.shape[1], q.shape[0])
    return None


def rank_error(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> ArgumentError:
    """ArgumentError for a q whose rank does not fit the layout (4 padded, 3 varlen)."""
    expected = 3 if cu_seqlens_q is not None else 4
    return ArgumentError(f"q: expected rank {expected}, got rank {q.dim()} (shape {tuple(q.shape)})")


def check_varlen_values(q: Tensor, k: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                        max_seqlen_q: int, max_seqlen_k: int) -> None:
    """:func:`check_cu_seqlens_values` for both cu_seqlens of a varlen call (nothing for padded
    calls; memoised, so the backward of a checked forward costs no host sync)."""
    if cu_seqlens_q is not None:
        check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        if k.dim() == 3:
            check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")


#: The smallest magnitude that rounds to inf in fp32 (fp32 max + half an ulp).
_F32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127
#: The largest magnitude that rounds to 0 in fp32 (half the smallest subnormal; ties go to even, 0).
_F32_UNDERFLOW = 2.0**-150


def check_softmax_scale(softmax_scale, shown=None) -> None:
    """``softmax_scale`` must be finite in fp32 (the kernels take an fp32 scale: nan, ±inf and
    1e300 are rejected here with the caller's value, before the mapping of :func:`positive_scale`
    could change its sign). A symbolic scale (torch.SymFloat under dynamic shapes or a
    torch.compile'd float attribute) is not read. The one finiteness rule of both the op and the
    flash_attn functions (which pass the caller's original value as ``shown``, for the message).
    Raises :class:`~ferroattn.errors.ArgumentError`."""
    if not isinstance(softmax_scale, (int, float)):
        return
    if not abs(softmax_scale) < _F32_OVERFLOW:  # also true for nan
        shown = softmax_scale if shown is None else shown
        raise ArgumentError(f"softmax_scale: expected a real number finite in float32, got {shown!r}")


def _normalised_meta(t: Tensor, head_dim: int):
    """``tensor_meta`` of ``t`` as the flash_attn functions hand it to the op: unchanged when its
    last dim is ``head_dim`` and contiguous; else the contiguous copy with the last dim
    zero-padded to ``head_dim`` (``F.pad`` / ``.contiguous()``), described without making it."""
    meta = tensor_meta(t)
    shape, strides, dtype, device = meta
    if shape[-1] == head_dim and (strides[-1] == 1 or t.dim() == 0):
        return meta
    shape = shape[:-1] + (head_dim,)
    contiguous, n = [], 1
    for size in reversed(shape):
        contiguous.append(n)
        n *= max(size, 1)
    return (shape, tuple(reversed(contiguous)), dtype, device)


def check_fwd_meta(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                   max_seqlen_q: int, max_seqlen_k: int, head_dim: int,
                   variant: Optional[AttnVariant] = None) -> None:
    """The Rust validation of the forward (``_native.attn_fwd_check``, the op's own rules) on the
    caller's q, k, v *before* the flash_attn functions pad the head dim to ``head_dim`` or copy a
    non-contiguous last dim: run on the metadata of the tensors the op will receive
    (:func:`_normalised_meta`), so a bad call fails before any copy (no large allocation first),
    and with the caller's shapes in the message (a normalised shape printed by the validation is
    mapped back to the caller's). Raises the ferroattn.errors classes of the Rust validation."""
    tensors = (q, k, v)
    metas = [_normalised_meta(t, head_dim) for t in tensors]
    try:
        _native.attn_fwd_check(metas[0], metas[1], metas[2], tensor_meta(cu_seqlens_q), tensor_meta(cu_seqlens_k),
                               _as_int(max_seqlen_q), _as_int(max_seqlen_k),
                               None if variant is None else variant.for_check())
    except Exception as e:
        message = str(e)
        renamed = message
        for t, meta in zip(tensors, metas):
            user = tuple(_as_int(s) for s in t.shape)
            if meta[0] != user:
                renamed = renamed.replace(str(meta[0]), str(user))
        if renamed == message:
            raise
        raise type(e)(renamed) from None


def scale_is_zero(softmax_scale: float) -> bool:
    """True when ``softmax_scale`` is 0 in fp32 (|s| <= 2^-150), the precision the kernels use:
    a tiny non-zero scale such as 1e-50 is treated as 0 (every score 0), as the kernels would."""
    return abs(softmax_scale) <= _F32_UNDERFLOW


def positive_scale(q: Tensor, softmax_scale: float) -> Tuple[Tensor, float]:
    """``(q', s')`` with ``s' > 0`` and ``s'·q'kᵀ == softmax_scale·qkᵀ`` exactly, for kernels that
    need a positive scale (they fold it into exp2 after a max over the raw scores):
    ``(q, s)`` for s > 0, ``(−q, −s)`` for s < 0, ``(zeros_like(q), 1.0)`` for s == 0 in fp32
    (:func:`scale_is_zero`: all scores 0; also 0 < |s| <= 2^-150, which fp32 rounds to 0 and the
    backward launcher would reject). Costs one copy of q when s <= 0. The backward maps its
    gradients accordingly (:mod:`ferroattn.ops.attention_bwd`: dq = −dq' for s < 0, dq = 0 for
    s == 0)."""
    if scale_is_zero(softmax_scale):
        return torch.zeros_like(q), 1.0
    if softmax_scale > 0.0:
        return q, softmax_scale
    return -q, -softmax_scale


def _attn_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    deterministic: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention forward, ``softmax(softmax_scale · q kᵀ [+ variant]) v``.

    Args (flash_attn layout; ``d`` must already be a multiple of 8, the flash_attn wrappers pad):
        q: (b, s_q, h, d) padded, or (total_q, h, d) varlen; fp16 or bf16, CUDA, stride(-1) == 1.
        k, v: (b, s_k, h_k, d) or (total_k, h_k, d); q's dtype and device; h % h_k == 0 (GQA:
            query head i reads kv head i // (h / h_k)).
        cu_seqlens_q, cu_seqlens_k: None (padded) or int32 (b + 1,) contiguous prefix sums of the
            sequence lengths (varlen).
        max_seqlen_q, max_seqlen_k: longest sequence (tokens); used by varlen only.
        softmax_scale: multiplies the scores before the softmax (usually d ** -0.5); any finite
            value (<= 0 is mapped exactly by :func:`positive_scale`).
        causal: bottom-right aligned causal mask (row i sees keys j <= i + s_k - s_q).
        deterministic: no effect on the forward (always bitwise reproducible); saved for the
            backward, where True selects the kernels without atomics.
        window_left, window_right, softcap, alibi_slopes, sinks: the rest of the variant
            (:class:`ferroattn.ops.variant.AttnVariant`: local window sides, −1 = unbounded;
            logit softcap, 0 = off; fp32 ALiBi slopes (h,) or (b, h); fp32 sink logits (h,);
            dropout probability and its int64 (2,) Philox key tensor (``variant.draw_rng_state``)).

    Returns:
        out: ``torch.empty_like(q)`` (q's shape, dtype and stride order), fully written.
        softmax_lse: fp32 natural-log logsumexp of the scaled (softcapped, biased) scores per
            row, sinks included, (b, h, s_q) padded or (h, total_q) varlen; +inf for a row that
            sees no key and has no sink (its output is 0).

    Raises: the ferroattn.errors classes from the Rust validation (DTypeError, DeviceError,
    ArgumentError, ...), ArgumentError from :func:`check_cu_seqlens_values`, CUDA/NVRTC errors;
    ArgumentError for a softmax_scale not finite in fp32 (:func:`check_softmax_scale`);
    NotImplementedError when forward-mode AD tracks an input (no jvp formula).
    """
    _reject_forward_ad("ferroattn::attn_fwd", (("q", q), ("k", k), ("v", v)))
    lse_shape_ = lse_shape(q, cu_seqlens_q)
    if lse_shape_ is None:
        _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        raise rank_error(q, cu_seqlens_q)
    check_softmax_scale(softmax_scale)
    out = torch.empty_like(q)
    softmax_lse = torch.empty(lse_shape_, dtype=torch.float32, device=q.device)
    check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    q, softmax_scale = positive_scale(q, softmax_scale)
    q, k, v = _tile_aligned(q), _tile_aligned(k), _tile_aligned(v)
    # A BufferError (a tensor on another GPU) becomes the Rust validation's error (e.g. DeviceError naming k).
    _launch(_native.attn_fwd, q.device, (q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k),
            (max_seqlen_q, max_seqlen_k, softmax_scale, variant.for_native()),
            lambda: _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant))
    return out, softmax_lse


attn_fwd = torch.library.custom_op("ferroattn::attn_fwd", mutates_args=())(_attn_fwd_impl)


def run_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                 cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale: float, variant: AttnVariant, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """``attn_fwd`` as the flash_attn functions call it: through the op (the dispatcher) whenever
    anything may watch or transform the call -- torch.compile tracing, a dispatch mode
    (FlopCounterMode, FakeTensorMode, ...), the profiler (which names the op), functorch
    transforms, or autograd (grad mode on and an input requires grad: the op's autograd
    registration records the backward) -- and otherwise, in a plain eager call on plain CUDA
    tensors, through the op's implementation directly, which skips tens of µs of dispatcher and
    autograd-wrapper overhead per call. Both routes run the same code.

    Forward-mode AD (torch.func.jvp / jacfwd, forward_ad dual tensors) raises NotImplementedError
    naming the tracked input (:func:`ferroattn.ops._to_native.reject_forward_ad`), checked here on
    the caller's tensors, where functorch's tangents are still visible."""
    _reject_forward_ad("ferroattn::attn_fwd", (("q", q), ("k", k), ("v", v)))
    if plain_eager((q, k, v, cu_seqlens_q, cu_seqlens_k, variant.alibi_slopes, variant.sinks, variant.rng_state)):
        return _attn_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, variant.causal, deterministic, *variant.op_args())
    return attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, variant.causal,
                    deterministic, *variant.op_args())


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                   deterministic=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   dropout_p=0.0, rng_state=None):
    _reject_forward_ad("ferroattn::attn_fwd", (("q", q), ("k", k), ("v", v)))
    # Same validation as the real op, from metadata (works for fake and meta tensors).
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant)
    lse_shape_ = lse_shape(q, cu_seqlens_q)
    if lse_shape_ is None:
        raise rank_error(q, cu_seqlens_q)
    check_softmax_scale(softmax_scale)
    out = torch.empty_like(q)
    softmax_lse = q.new_empty(lse_shape_, dtype=torch.float32)
    return out, softmax_lse


# ---------------------------------------------------------------------------------------------
# autograd: attn_fwd -> attn_bwd
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    """Saves what the backward recomputes P from (FlashAttention-2 §3.2): q, k, v, the forward's
    out and softmax_lse (O(b·h·s) extra, no s×s buffer), the cu_seqlens tensors, and the scalars."""
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
     window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state) = inputs
    out, softmax_lse = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, rng_state)
    ctx.dropout_p = dropout_p
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window, ctx.softcap = (window_left, window_right), softcap


def _backward(ctx, grad_out, grad_lse):
    """Gradients of q, k, v through ``torch.ops.ferroattn.attn_bwd`` (a second custom op, traceable
    by torch.compile); None for the non-differentiable arguments. ``grad_lse`` is ignored, as
    flash_attn ignores it: the LSE output is treated as a constant (a loss on softmax_lse alone
    gives zero gradients)."""
    q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, rng_state = ctx.saved_tensors
    # forward-over-reverse (a dual grad_out): attn_bwd has no jvp formula either
    _reject_forward_ad("ferroattn::attn_bwd", (("dout", grad_out),))
    dq, dk, dv = torch.ops.ferroattn.attn_bwd(
        grad_out, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
        ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.window[0], ctx.window[1], ctx.softcap,
        alibi_slopes, sinks, ctx.dropout_p, rng_state)
    need = ctx.needs_input_grad
    dsinks = None
    if sinks is not None and need[14]:
        dsinks = sink_grad(sinks, softmax_lse, out, grad_out, cu_seqlens_q)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            None, None, None, None, None, None, None, None, None, None, None, dsinks, None, None)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# the returned softmax of a dropout call (flash_attn's S_dmask; testing only)
# ---------------------------------------------------------------------------------------------
def _dmask_shape(q: Tensor, k: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int,
                 max_seqlen_k: int) -> Tuple[int, int, int, int]:
    """flash_attn's S_dmask shape: (b, h, round128(s_q), round128(s_k)) (varlen: the max lengths)."""
    varlen = cu_seqlens_q is not None
    b = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    s_q, s_k = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[1], k.shape[1])
    return (b, q.shape[-2], (s_q + 127) // 128 * 128, (s_k + 127) // 128 * 128)


def _attn_fwd_dmask_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                         causal: bool, window_left: int, window_right: int, softcap: float,
                         alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], dropout_p: float,
                         rng_state: Tensor) -> Tensor:
    """flash_attn's ``S_dmask`` of a dropout call with the same arguments (and ``rng_state``) as
    ``attn_fwd``: (b, h, round128(s_q), round128(s_k)) in q's dtype (varlen: the max lengths),
    ``exp(s_ij − m_i)`` with m_i the row's max score (natural log units), negative where the
    mask drops (i, j), 0 outside the sequences and the window. flash_attn's test helpers
    (``normalize_flash_attn_S`` with :func:`ferroattn.flash_attn_interface._get_block_size_n`)
    turn it into the probabilities. Runs the forward kernel once more with the returned-softmax
    kind: the kernel writes exp(s − m_running) and the running max per 16 keys, rescaled here to
    the row max. Testing only: O(b·h·s_q·s_k) memory."""
    # the tensors' validation first: the buffers' sizes come from them
    _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if lse_shape(q, cu_seqlens_q) is None:
        raise rank_error(q, cu_seqlens_q)
    check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    b, h, rows, cols = _dmask_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    s_dmask = torch.zeros((b, h, rows, cols), dtype=q.dtype, device=q.device)
    s_max = torch.full((b, h, rows, cols // DMASK_GROUP), float("-inf"), dtype=torch.float32, device=q.device)
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    variant = dataclasses.replace(variant, s_dmask=s_dmask, s_dmask_max=s_max)
    out = torch.empty_like(q)
    lse = torch.empty(lse_shape(q, cu_seqlens_q), dtype=torch.float32, device=q.device)
    q, softmax_scale = positive_scale(q, softmax_scale)
    q, k, v = _tile_aligned(q), _tile_aligned(k), _tile_aligned(v)
    _launch(_native.attn_fwd, q.device, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k),
            (max_seqlen_q, max_seqlen_k, softmax_scale, variant.for_native()),
            lambda: _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant))
    row_max = s_max.amax(-1, keepdim=True)
    scale = torch.where(torch.isfinite(s_max), torch.exp(s_max - row_max), torch.zeros((), device=q.device))
    scaled = s_dmask.float().view(b, h, rows, cols // DMASK_GROUP, DMASK_GROUP) * scale[..., None]
    return scaled.view(b, h, rows, cols).to(q.dtype)


attn_fwd_dmask = torch.library.custom_op("ferroattn::attn_fwd_dmask", mutates_args=())(_attn_fwd_dmask_impl)


@attn_fwd_dmask.register_fake
def _attn_fwd_dmask_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state):
    # the real op's validation, from metadata, with the buffers the real op allocates
    _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if lse_shape(q, cu_seqlens_q) is None:
        raise rank_error(q, cu_seqlens_q)
    shape = _dmask_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    variant = AttnVariant.from_op_args(causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                                       rng_state)
    variant = dataclasses.replace(variant, s_dmask=q.new_empty(shape),
                                  s_dmask_max=q.new_empty(shape[:3] + (shape[3] // DMASK_GROUP,), dtype=torch.float32))
    _check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant)
    return q.new_empty(shape)


def run_attn_fwd_dmask(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                       max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, variant: AttnVariant) -> Tensor:
    """:func:`attn_fwd_dmask` for the flash_attn functions (inputs detached: S_dmask is not
    differentiated)."""
    det = lambda t: None if t is None else t.detach()  # noqa: E731
    return attn_fwd_dmask(det(q), det(k), det(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, variant.causal, variant.window_left, variant.window_right, variant.softcap,
                          det(variant.alibi_slopes), det(variant.sinks), variant.dropout_p, variant.rng_state)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Number of visible (i, j) pairs under the bottom-right causal mask (row i sees keys
    j <= i + seqlen_k - seqlen_q): :func:`visible_pairs` with ``causal=True``.
    E.g. s_q = 2, s_k = 5 -> 4 + 5 = 9; s_q = 5, s_k = 2 -> 0 + 0 + 0 + 1 + 2 = 3."""
    return visible_pairs(seqlen_q, seqlen_k, True)


def _pairs(seqlen_q, seqlen_k, causal: bool, window=(-1, -1)):
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    return visible_pairs(seqlen_q, seqlen_k, causal, window)


def _seqlens(cu: Tensor) -> Optional[Sequence[int]]:
    if not values_available(cu):
        return None
    vals = cu.tolist()
    return [b - a for a, b in zip(vals[:-1], vals[1:])]


def attn_fwd_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   causal, deterministic=False, window_left=-1, window_right=-1, *args, out_val=None,
                   **kwargs) -> int:
    """FLOPs of one ``attn_fwd`` call: 2 matmuls (q kᵀ and p v) of 2·d FLOPs per visible (i, j)
    pair and head, i.e. ``4 · b · h · s_q · s_k · d`` without a mask; with ``causal`` only the
    visible pairs of the bottom-right mask and the local window count (:func:`visible_pairs`;
    softcap, ALiBi and sinks do not change the count). Varlen sums over the
    sequences when the cu_seqlens values are readable (real tensors), else assumes every
    sequence has the max lengths. ``d`` is the head dim the op sees (padded to a multiple of 8)."""
    h, d = q.shape[-2], q.shape[-1]
    window = (window_left, window_right)
    if cu_seqlens_q is None:
        pairs = q.shape[0] * _pairs(q.shape[1], k.shape[1], causal, window)
    else:
        lens_q, lens_k = _seqlens(cu_seqlens_q), _seqlens(cu_seqlens_k)
        if lens_q is not None and lens_k is not None and len(lens_q) == len(lens_k):
            pairs = sum(_pairs(a, b, causal, window) for a, b in zip(lens_q, lens_k))
        else:
            pairs = (cu_seqlens_q.shape[0] - 1) * _pairs(max_seqlen_q, max_seqlen_k, causal, window)
    return int(_native.attn_flops(_native.ATTN_FWD_PRODUCTS, h * pairs, d))


register_flop_formula(torch.ops.ferroattn.attn_fwd, get_raw=True)(attn_fwd_flops)
