"""The flash_attn 2.x functions, same names, positional order, defaults and return values.

Swap ``from flash_attn import flash_attn_func`` for ``from ferroattn import flash_attn_func``.
Layout is flash_attn's: sequence before heads, ``q`` (b, s_q, h, d), ``k``/``v`` (b, s_k, h_k, d);
varlen packs batch and sequence: (total, h, d) with int32 ``cu_seqlens`` (b + 1,).

Argument normalisation, exactly as flash_attn 2.8 does it (flash_attn_interface.py / flash_api.cpp):
- ``softmax_scale=None`` -> ``d ** -0.5`` on the original (unpadded) head dim;
- a head dim that is not a multiple of 8 is zero-padded to one (q, k and v by the amount q needs)
  and the output is sliced back; zero columns change neither the scores nor the output;
- a tensor whose last dim is not contiguous (``stride(-1) != 1``) is copied; any other view (slices
  of packed qkv, transposed layouts) is passed as is, and ``out`` keeps q's stride order;
- ``causal`` is turned off when ``seqlen_q == 1`` (``max_seqlen_q == 1`` in varlen): it is a no-op;
- ``window_size``: a side >= ``seqlen_k`` (``max_seqlen_k`` in varlen), or any negative side,
  becomes -1 (unbounded); ``causal`` forces right = 0; ``(left < 0, right == 0)`` means causal
  (:meth:`ferroattn.ops.variant.AttnVariant.from_flash_attn`).

Variants (flash_attn 2.8 semantics; one value, :class:`ferroattn.ops.variant.AttnVariant`): local
window, ``softcap > 0`` (score = softcap · tanh(score / softcap)), ``alibi_slopes`` (fp32 (h,) or
(b, h): score −= slope · |i + s_k − s_q − j|), and, beyond flash_attn 2, attention sinks through the
keyword-only ``s_aux`` (one logit per query head, (h,), that joins every row's softmax and carries
no value; differentiable: its gradient is returned when it requires grad; transformers passes
GPT-OSS's sinks under this name).

Training: every function except ``flash_attn_with_kvcache`` (and a paged ``block_table`` call) is differentiable. Gradients flow to
q, k and v (or to the packed ``qkv`` / ``kv`` through the views taken of it) and come back in the
inputs' shapes and dtypes; the head-dim padding is differentiable (``F.pad`` + slice). The backward
is the custom op ``ferroattn::attn_bwd`` (:mod:`ferroattn.ops.attention_bwd`), called from the
autograd formula of ``ferroattn::attn_fwd``; only q, k, v, out and the fp32 LSE are saved
(O(b·h·s) extra memory). ``deterministic=True`` makes the backward bitwise reproducible (no
atomics; a bit slower); the forward is always deterministic. As in flash_attn, the gradient of the
returned ``softmax_lse`` is ignored (it is treated as a constant). Reverse mode only: forward-mode
AD (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad`` dual inputs) raises
NotImplementedError naming the input; a second derivative (``create_graph=True`` then a grad of
the gradients) raises torch's RuntimeError (no formula); ``torch.func.grad`` / ``vjp`` / ``jacrev``
raise FerroattnError (a RuntimeError) naming ferroattn and the input.

Paged KV (``block_table``) runs forward only, as in flash_attn: dropout raises NotImplementedError,
and inputs that require grad are accepted but the backward raises NotImplementedError naming
``block_table`` (under torch.compile the forward already raises); ``flash_attn_with_kvcache`` is
inference only.

Errors: bad dtypes/devices/shapes raise the classes of :mod:`ferroattn.errors` (subclasses of
``RuntimeError``, like flash_attn's checks), naming the argument, expected and actual value.
Checked here, before any normalisation (so messages show the values the user passed):
- ``q``/``k``/``v`` are tensors (DTypeError) of the layout's rank with equal head dims <= 256
  (ArgumentError; before the head dim is padded);
- packed ``qkv`` / ``kv``: a tensor of the layout's rank whose packed dim is exactly 3 / 2
  (ArgumentError naming ``qkv`` / ``kv`` with its shape);
- ``softmax_scale`` is None or a real number (not a bool) finite in fp32 (a symbolic float under
  torch.compile is not read); ``causal`` and ``deterministic`` bools (also numpy bool, the ints
  0/1, None = False); ``dropout_p`` and ``softcap`` real numbers (not bools), ``dropout_p`` in
  [0, 1), ``softcap`` finite and >= 0; ``return_attn_probs`` anything with a truth value (as
  flash_attn); ``window_size`` a pair of ints; ``alibi_slopes`` and ``s_aux`` None or tensors (their
  dtype, device and shape are checked by the op's validation); varlen ``max_seqlen_q/k`` ints >= 0
  (``operator.index``; not bools or tensors).
  A one-element tensor whose value cannot be read (meta) is an ArgumentError, not torch's error.
The custom op's Rust validation checks everything else (dtypes, devices, strides, shapes); when
the head dim is padded or a last dim copied, it runs first on the caller's tensors (metadata
only), so a bad input fails before any copy and the message shows the caller's shapes.

Sources: T. Dao, "FlashAttention-2", 2023, §3.1 (forward algorithm, LSE output), §3.2 (backward);
flash_attn 2.8 public API (reference/api-contracts.md §1).
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native
from .errors import ArgumentError, DTypeError, FerroattnError
from .ops.attention import check_fwd_meta as _check_fwd_meta
from .ops.attention import _F32_OVERFLOW  # the one fp32-finiteness bound (check_softmax_scale)
from .ops.attention import check_softmax_scale as _check_scale_value
from .ops.attention import run_attn_fwd as _attn_fwd_op
from .ops.attention import run_attn_fwd_dmask as _attn_fwd_dmask_op
from .ops import _eager
from .ops import kvcache as _kvcache
from .ops.variant import AttnVariant

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

_Out = Union[Tensor, Tuple[Tensor, Tensor, Tensor]]


def _not_implemented(what: str) -> NotImplementedError:
    return NotImplementedError(f"ferroattn: {what} is not implemented yet")


def _maybe_contiguous(x: Tensor) -> Tensor:
    """flash_attn's rule: copy only when the last dim is not contiguous. (Views whose rows are not
    16-byte aligned are copied inside the op, where the data pointer is known.)"""
    return x.contiguous() if x.stride(-1) != 1 else x


# ---------------------------------------------------------------------------------------------
# argument checks (run before anything touches the arguments)
# ---------------------------------------------------------------------------------------------


def _check_strided(x: Tensor, name: str) -> None:
    """A dense (strided) tensor: a nested or sparse one is an ArgumentError naming ``name``
    (torch's own errors for their sizes and strides name no argument)."""
    if x.is_nested or x.layout != torch.strided:
        kind = "a nested tensor" if x.is_nested else f"layout {x.layout}"
        raise ArgumentError(f"{name}: expected a dense tensor (torch.strided layout), got {kind}")


def _check_tensors(q, k, v, varlen: bool, paged: bool = False) -> int:
    """q, k, v must be tensors of the layout's rank whose head dims are equal and <= 256; checked
    here on the user's (unpadded) values, before the head dim is padded to a multiple of 8
    (``paged``: k, v are the pages (num_pages, page_size, heads_k, head_dim)).
    Returns the head dim. Raises DTypeError (not a tensor) or ArgumentError (rank, head dim)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        _check_strided(x, name)
    rank = 3 if varlen else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        want = 4 if paged and name != "q" else rank
        if x.dim() != want:
            layout = ("(num_pages, page_size, heads_k, head_dim) with block_table" if want == 4 and paged
                      else "(total, heads, head_dim) in varlen mode" if varlen else "(batch, seqlen, heads, head_dim)")
            raise ArgumentError(f"{name}: expected rank {want} {layout}, got rank {x.dim()} "
                                f"(shape {tuple(x.shape)})")
    head_dim = q.shape[-1]
    if head_dim > 256:
        raise ArgumentError(f"q: expected head dim <= 256, got head dim {head_dim}")
    for name, x in (("k", k), ("v", v)):
        if x.shape[-1] != head_dim:
            raise ArgumentError(f"{name}: expected head dim {head_dim} (q's head dim), got head dim {x.shape[-1]}")
    return head_dim  # 0 is rejected by the op's validation ("a multiple of 8 in 8..=256")


def _as_float(value, name: str) -> float:
    """A real number (int, float, numpy scalar, one-element tensor whose value can be read) as a
    Python float. Bools, complex numbers (numpy's would drop the imaginary part with only a
    warning), strings, sequences, tensors of other sizes and tensors whose value cannot be read
    (meta tensors, fake tensors without a value) raise ArgumentError naming ``name``; so does a
    value too large for a float (OverflowError)."""
    # Types that cannot be a real number are rejected before float() is tried: torch.compile's
    # Dynamo cannot trace the TypeError of float([0.1]) (nor `raise ... from None`).
    if (isinstance(value, (bool, np.bool_, str, bytes, complex, np.complexfloating))
            or (isinstance(value, Tensor)
                and (value.numel() != 1 or value.dtype == torch.bool or value.is_complex()))
            or (not isinstance(value, (int, float, np.number, Tensor)) and not hasattr(type(value), "__float__"))):
        raise ArgumentError(f"{name}: expected a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):  # RuntimeError: .item() on meta
        raise ArgumentError(f"{name}: expected a real number, got {value!r}") from None


def _check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``None`` -> ``head_dim ** -0.5`` (unpadded head dim); else a real number that is finite in
    fp32 (the kernels compute in fp32: 1e300 would be inf there). Raises ArgumentError.

    A symbolic scale (``torch.SymFloat``: torch.compile makes a float attribute symbolic from its
    second distinct value on) is passed through unread, as the op's check does
    (:func:`ferroattn.ops.attention.check_softmax_scale`, the one finiteness rule): reading it
    (``float``, ``math.isfinite``) would be a graph break under ``fullgraph=True``."""
    if softmax_scale is None:
        # head dim 0 is rejected by the op's validation; any scale gets it there
        return head_dim ** (-0.5) if head_dim > 0 else 1.0
    if type(softmax_scale) is float and abs(softmax_scale) < _F32_OVERFLOW:   # the common case, decided at once
        return softmax_scale
    if isinstance(softmax_scale, torch.SymFloat):
        return softmax_scale
    scale = _as_float(softmax_scale, "softmax_scale")
    _check_scale_value(scale, shown=softmax_scale)
    return scale


def _as_int(value) -> Optional[int]:
    """``operator.index(value)``, or None where it would raise. Ints, numpy ints and the common
    non-integers (floats, strings) are told apart by type first, so torch.compile's Dynamo, which
    cannot trace the TypeError of ``operator.index(1.5)``, reaches the ArgumentError the caller
    raises. Bools are the caller's to exclude."""
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, np.bool_):   # numpy 2 gives np.bool_ no __index__ (callers exclude bools)
        return int(value)
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
    elif not hasattr(type(value), "__index__"):   # floats, strings, lists, None, ...
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: the value of a meta tensor
        return None


def _check_flag(flag, name: str) -> bool:
    """A flag (``causal``, ``deterministic``) as a bool: a bool, numpy bool, the ints 0 / 1 (or a
    one-element tensor holding one of these), or None (False). Anything else (e.g. the string
    ``"False"``) raises ArgumentError naming ``name`` rather than being truth-tested."""
    if flag is None or flag is False:
        return False
    if flag is True:
        return True
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    value = _as_int(flag)
    if value not in (0, 1):
        raise ArgumentError(f"{name}: expected a bool, got {flag!r}")
    return bool(value)


def _check_return_flag(flag, name: str) -> bool:
    """``return_attn_probs`` as flash_attn reads it: its truth value (``if return_attn_probs``).
    A value with no truth value (a tensor of several elements, a meta tensor) raises
    ArgumentError naming ``name`` instead of torch's RuntimeError."""
    if flag is False or flag is True:
        return flag
    try:
        return bool(flag)
    except (TypeError, ValueError, RuntimeError):
        raise ArgumentError(f"{name}: expected a bool, got {flag!r}") from None


#: The softcaps the kernels take (float32: the cap, 1/cap and scale/cap stay normal numbers).
_SOFTCAP_MIN, _SOFTCAP_MAX = 2.0**-60, 2.0**60


def _check_softcap(softcap) -> float:
    """``softcap`` as a float: 0 (no softcapping; None counts as 0) or a real number in
    [2**-60, 2**60] (the kernels work in float32 with the cap, its inverse and scale / cap).
    ArgumentError otherwise (a string, a bool, nan, inf, a negative value -- flash_attn would
    silently run without softcapping --, 1e300, 1e-50, or a tensor whose value cannot be read)."""
    if softcap is None or (type(softcap) is float and softcap == 0.0):
        return 0.0
    value = _as_float(softcap, "softcap")
    if not (value == 0.0 or _SOFTCAP_MIN <= value <= _SOFTCAP_MAX):  # also false for nan
        raise ArgumentError(f"softcap: expected 0 (no softcapping) or a number in [2**-60, 2**60] (the kernels "
                            f"divide by it in float32), got {softcap!r}")
    return value


def _check_optional_tensor(t, name: str) -> None:
    """``alibi_slopes`` / ``s_aux``: None or a tensor (DTypeError otherwise); the op validates its
    dtype, device and shape."""
    if t is not None and not isinstance(t, Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")


def _check_causal(causal) -> bool:
    """``causal`` as a bool (:func:`_check_flag`)."""
    return _check_flag(causal, "causal")


def _check_dropout(dropout_p) -> float:
    """``dropout_p`` as a float: a real number in [0, 1) (None counts as 0); ArgumentError
    otherwise."""
    if dropout_p is None or (type(dropout_p) is float and dropout_p == 0.0):
        return 0.0
    p = _as_float(dropout_p, "dropout_p")  # a bool is rejected as not a real number
    if not 0.0 <= p < 1.0:  # also false for nan
        raise ArgumentError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
    return p


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width over which ``S_dmask`` (``return_attn_probs=True`` with dropout)
    shares one scale, for flash_attn's test helpers (``normalize_flash_attn_S``): ferroattn's
    S_dmask is ``exp(s − m)`` with m the whole row's max, i.e. one block as wide as any sequence."""
    return 1 << 30


def _check_max_seqlen(value, name: str) -> int:
    """A varlen ``max_seqlen_q/k`` as a Python int (``operator.index``: ints and numpy ints, not
    bools, tensors, floats or strings; flash_attn's contract is a Python int) in [0, 2**63); the
    op's validation checks the int32 range. Negative values are rejected here for both arguments,
    also for an empty batch. Raises ArgumentError naming ``name``."""
    if isinstance(value, (bool, np.bool_, Tensor)):
        raise ArgumentError(f"{name}: expected an int, got {value!r}")
    n = _as_int(value)
    if n is None:
        raise ArgumentError(f"{name}: expected an int, got {value!r}")
    if not 0 <= n < 2**63:
        raise ArgumentError(f"{name}: expected an int in [0, {2**31 - 1}], got {n}")
    return n


def _check_window(window_size) -> Tuple[int, int]:
    """``window_size`` as ``(left, right)``: a sequence (tuple, list) of two ints (``operator.index``:
    no floats, nan, inf or bools; flash_attn indexes it as ``window_size[0]``, ``[1]``), or a 1-D
    integer tensor / numpy array of two (flash_attn's own tests pass ``torch.randint(0, s, (2,))``;
    a CUDA tensor is read on the host). Raises ArgumentError."""
    def bad():   # built only when raised: torch.compile cannot trace repr() of a tensor
        shown = (f"a {type(window_size).__name__} of shape {tuple(window_size.shape)} and dtype {window_size.dtype}"
                 if isinstance(window_size, (Tensor, np.ndarray)) else repr(window_size))
        return ArgumentError(f"window_size: expected a pair of ints (left, right), got {shown}")
    if type(window_size) is tuple and len(window_size) == 2:   # the common case, decided at once
        left, right = window_size
        if type(left) is int and type(right) is int:
            return left, right
    if isinstance(window_size, (Tensor, np.ndarray)):
        integral = (not window_size.dtype.is_floating_point and not window_size.dtype.is_complex
                    and window_size.dtype != torch.bool) if isinstance(window_size, Tensor) \
            else np.issubdtype(window_size.dtype, np.integer)
        if not integral or tuple(window_size.shape) != (2,):
            raise bad()
        try:
            window_size = window_size.tolist()
        except (NotImplementedError, RuntimeError):  # a meta or fake tensor holds no values
            raise bad() from None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, (bool, np.bool_)) or (isinstance(w, Tensor) and w.dtype == torch.bool)
                   for w in window_size)):
        raise bad()
    left, right = (_as_int(w) for w in window_size)
    if left is None or right is None:
        raise bad()
    return left, right


def _unpack(packed, name: str, n: int, dim: int, layout: str) -> Tuple[Tensor, ...]:
    """The ``n`` views ``packed.select(dim, i)`` of a packed ``qkv`` (n = 3) / ``kv`` (n = 2) of
    layout ``layout``: it must be a tensor (DTypeError) of rank ``dim + 3`` whose dim ``dim`` has
    size exactly ``n`` (ArgumentError naming ``name`` with its own shape)."""
    if not isinstance(packed, Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor, got {type(packed).__name__}")
    _check_strided(packed, name)
    if packed.dim() != dim + 3 or packed.shape[dim] != n:
        raise ArgumentError(f"{name}: expected shape {layout} (rank {dim + 3}, dim {dim} of size {n}), "
                            f"got shape {tuple(packed.shape)}")
    return tuple(packed.select(dim, i) for i in range(n))


def _reject_functorch_reverse(q: Tensor, k: Tensor, v: Tensor) -> None:
    """torch.func.grad / vjp / jacrev cannot differentiate the op (torch 2.11's custom-op autograd
    wrapper has no ``setup_context`` for functorch): raise FerroattnError (a RuntimeError) naming
    ferroattn and the way out, instead of torch's generic message. Only when a functorch grad
    transform is active and tracks one of q, k, v; vmap and forward-mode AD are left alone (the
    latter is rejected by the op with its own NotImplementedError)."""
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return
    ft = torch._C._functorch
    if not any(i.key() == ft.TransformType.Grad for i in ft.get_interpreter_stack()):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        if ft.is_gradtrackingtensor(x):
            raise FerroattnError(
                f"{name}: ferroattn's flash_attn functions do not support torch.func.grad / vjp / jacrev "
                f"(torch's custom-op autograd.Function has no setup_context for functorch transforms); "
                f"use reverse mode through autograd (.backward() / torch.autograd.grad), got a tensor "
                f"tracked by a torch.func grad transform")


_PAGED_BACKWARD = "the backward through block_table (paged KV; run it under torch.no_grad())"


def _check_paged(block_table: Optional[Tensor], dropout_p: float, q: Tensor, k: Tensor, v: Tensor) -> None:
    """A paged varlen call (``block_table``) is a forward of the kv-cache path: no dropout, and no
    backward (flash_attn 2 has none through a block table either). Tensors that require grad are
    accepted in eager mode, as flash_attn accepts them: the output then carries a gradient function
    that raises NotImplementedError when the backward runs (:class:`_PagedForward`). Under
    torch.compile, which traces the backward with the forward, they are rejected here."""
    if block_table is None:
        return
    _check_optional_tensor(block_table, "block_table")
    if dropout_p > 0.0:
        raise _not_implemented("dropout_p > 0 with block_table (paged KV)")
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise _not_implemented(_PAGED_BACKWARD)


class _PagedForward(torch.autograd.Function):
    """The paged varlen forward seen by autograd when an input requires grad: ``forward`` runs the
    kv-cache path (``run``: a function of no arguments returning ``(out, softmax_lse)``), and
    ``backward`` raises NotImplementedError naming ``block_table``, so a forward that is never
    differentiated works (as in flash_attn 2) and a backward fails loudly instead of returning
    gradients that ignore the block table."""

    @staticmethod
    def forward(ctx, run, *inputs):
        out, softmax_lse = run()
        ctx.mark_non_differentiable(softmax_lse)
        return out, softmax_lse

    @staticmethod
    def backward(ctx, *grads):
        raise _not_implemented(_PAGED_BACKWARD)


def _decode_shaped(q: Tensor, k: Tensor, v: Tensor, max_seqlen_q: int, max_seqlen_k: int, variant: AttnVariant,
                   return_attn_probs: bool) -> bool:
    """Whether a (non-paged, padded) call runs on the kv-cache kernel: decode-shaped sizes
    (``tuning::attention_kvcache::use_kvcache_path``: few query rows per kv head, many keys), no
    dropout, no returned softmax, and nothing to differentiate (the kv-cache op has no backward)."""
    if return_attn_probs and variant.dropout_p > 0.0:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (variant.sinks is not None and variant.sinks.requires_grad)):
        return False
    if torch.compiler.is_compiling():   # traced calls keep one graph for every length (the forward op)
        return False
    if q.dim() != 4 or max(int(max_seqlen_q), int(max_seqlen_k)) > 2**31 - 1:
        return False   # padded calls only (varlen keeps its value checks); huge lengths: the op's errors
    group = max(q.shape[-2] // max(k.shape[-2], 1), 1)
    return _native.attn_use_kvcache_path(int(max_seqlen_q), group, int(max_seqlen_k), variant.dropout_p > 0.0)


def _attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
               cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
               dropout_p: float, softmax_scale: Optional[float], causal: bool,
               window_size: Sequence[int], softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool, return_attn_probs: bool, block_table: Optional[Tensor] = None,
               s_aux: Optional[Tensor] = None) -> _Out:
    """Shared body of every function: check the arguments, normalise as flash_attn, call the
    custom op (whose Rust validation checks dtypes, devices, strides and the remaining shapes).
    Every step on q/k/v (the padding, the copy of a non-contiguous last dim, the slice of the
    output) is an autograd-visible torch op, so gradients reach the caller's tensors."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    head_dim = _check_tensors(q, k, v, varlen, block_table is not None)
    _reject_functorch_reverse(q, k, v)
    dropout_p = _check_dropout(dropout_p)
    _check_paged(block_table, dropout_p, q, k, v)
    softcap = _check_softcap(softcap)
    _check_optional_tensor(alibi_slopes, "alibi_slopes")
    _check_optional_tensor(s_aux, "s_aux")
    softmax_scale = _check_softmax_scale(softmax_scale, head_dim)
    causal = _check_causal(causal)
    deterministic = _check_flag(deterministic, "deterministic")
    return_attn_probs = _check_return_flag(return_attn_probs, "return_attn_probs")
    window_size = _check_window(window_size)
    if varlen:
        max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    else:  # padded: the lengths come from the shapes (b, s, h, d)
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    variant = AttnVariant.from_flash_attn(causal, window_size, softcap, alibi_slopes, s_aux, max_seqlen_q,
                                          max_seqlen_k, dropout_p, q.device)
    pad = (8 - head_dim % 8) % 8
    strided = q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
    if ((pad or strided) and q.device.type != "cpu"
            and not torch.compiler.is_compiling() and block_table is None):
        # A copy is coming: run the op's validation first, on the caller's tensors (no copy of a
        # bad input; messages show the caller's shapes). Without a copy the op validates the
        # caller's tensors itself; under torch.compile the op's fake impl validates at trace
        # time; a CPU q is left to the op (which rejects it: DeviceError; CPU emulations of the
        # native module in tests/ run there).
        _check_fwd_meta(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dim + pad, variant)
    if pad:  # the padded copies are contiguous
        q, k, v = (F.pad(x, [0, pad]) for x in (q, k, v))
    elif strided:
        q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    if block_table is not None or _decode_shaped(q, k, v, max_seqlen_q, max_seqlen_k, variant, return_attn_probs):
        # paged KV, or few queries against many keys without autograd: the kv-cache path (key
        # lengths from cu_seqlens_k in varlen; the split-KV kernel with packed GQA rows)
        def run():
            return _kvcache.run_attn_fwd_kvcache(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, None, 0, None,
                                                 None, block_table, softmax_scale, variant)
        inputs = (q, k, v) if variant.sinks is None else (q, k, v, variant.sinks)
        if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
            out, softmax_lse = _PagedForward.apply(run, *inputs)   # paged: the backward raises
        else:
            out, softmax_lse = run()
    else:
        out, softmax_lse = _attn_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale, variant, deterministic)
    if pad:
        out = out[..., :head_dim]
    if return_attn_probs:
        # flash_attn returns an empty S_dmask unless dropout_p > 0
        if variant.dropout_p > 0.0:
            s_dmask = _attn_fwd_dmask_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, variant)
        else:
            s_dmask = torch.empty(0, dtype=q.dtype, device=q.device)
        return out, softmax_lse, s_dmask
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None):
    """Attention over padded batches, flash_attn 2.x ``flash_attn_func``.

    Args:
        q: (b, s_q, h, d), fp16 or bf16, CUDA; d <= 256 (any value, padded to a multiple of 8).
        k, v: (b, s_k, h_k, d), q's dtype and device; h % h_k == 0 (GQA/MQA: query head i reads
            kv head i // (h / h_k)).
        dropout_p: a probability in [0, 1) (ArgumentError outside it or nan): attention dropout
            after the softmax (each P_ij kept with probability 1 − p, scaled by 1/(1 − p); the
            kernels compare random bytes, as FlashAttention-2 does, so the drop probability is p
            rounded to a multiple of 1/256); pass 0.0 at eval time, as with flash_attn. The mask
            comes from Philox4x32-7 (as in FlashAttention-2) under a key drawn with
            torch's CUDA generator (``torch.manual_seed`` reproduces it; CUDA graphs redraw it per
            replay) and is regenerated exactly in the backward.
        softmax_scale: scale of q kᵀ before the softmax, a real number finite in fp32 (nan, inf,
            1e300: ArgumentError); None -> d ** -0.5 (unpadded d).
        causal: bool (numpy bool, 0/1 accepted): bottom-right aligned causal mask (row i sees
            keys j <= i + s_k - s_q); rows that see no key (s_q > s_k) give output 0. Turned off
            when s_q == 1.
        window_size: (left, right), a pair of ints: row i sees keys
            [i + s_k − s_q − left, i + s_k − s_q + right]; -1 (or any negative side, or a side
            >= s_k) = unbounded; combined with causal (right = 0). Key tiles wholly outside the
            window are skipped: the cost follows the visible pairs.
        softcap: a finite number >= 0; > 0 caps the scores: softcap · tanh(score / softcap),
            with the exact backward.
        alibi_slopes: None, or fp32 (h,) or (b, h) on q's device: score −= slope · |i + s_k − s_q − j|
            (causal or not).
        s_aux: keyword-only, None or a float tensor (h,) on q's device: attention-sink logits
            (one per query head, joining every row's softmax with no value; computed in fp32;
            gets a gradient when it requires grad). Not a flash_attn 2 argument.
        deterministic: bool (as causal): True makes the backward bitwise reproducible (no
            atomics); False (default) lets dQ accumulate with fp32 atomics. No effect on the
            forward, which is always deterministic.
        return_attn_probs: also return ``softmax_lse`` and ``S_dmask``: empty (0,) unless
            dropout_p > 0, then (b, h, round128(s_q), round128(s_k)) in q's dtype holding
            exp(s_ij − max_j s_ij) (the softmax up to a per-row scale), negative where dropout
            dropped (i, j) (testing only; :func:`_get_block_size_n` describes the scale).

    Returns:
        out (b, s_q, h, d) in q's dtype, with q's stride order; or, with ``return_attn_probs``,
        ``(out, softmax_lse, S_dmask)``: softmax_lse fp32 (b, h, s_q) natural-log logsumexp of the
        scaled scores (+inf for rows that see no key), S_dmask as above.

    Autograd: differentiable with respect to q, k and v; their gradients have the inputs'
    shapes and dtypes (with GQA, dk/dv sum over each kv head's query heads; rows that see no key
    get dq = 0). The gradient of ``softmax_lse`` is ignored, as in flash_attn.

    Raises: DTypeError (dtypes; q/k/v, alibi_slopes, s_aux not tensors), DeviceError, ArgumentError
    (shapes, head dims, the scalar arguments above, alibi_slopes / s_aux dtype or shape)
    (ferroattn.errors, all RuntimeError). The backward raises the same classes (from the
    validation of ``ferroattn::attn_bwd``) only for inputs the forward already rejects.
    """
    return _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, s_aux)


def _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, s_aux) -> _Out:
    """The padded functions' body: the common plain / causal eager call in one native call
    (src/ops/attention/fast.rs: it takes a call only when :func:`_attention` would launch the
    same kernel unchanged; None otherwise), else :func:`_attention`, whose checks and errors are
    every call's."""
    if _eager.ENABLED and not torch.compiler.is_compiling():
        out = _native.attn_fwd_fast(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                    deterministic, return_attn_probs, s_aux)
        if out is not None:
            return out
    return _attention(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs, s_aux=s_aux)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, s_aux=None):
    """:func:`flash_attn_func` with packed ``qkv`` (b, s, 3, h, d) (no GQA). q, k, v are the views
    ``qkv[:, :, 0]``, ``qkv[:, :, 1]``, ``qkv[:, :, 2]`` (no copy). Returns as flash_attn_func;
    the gradient reaches ``qkv`` through the views ((b, s, 3, h, d), qkv's dtype)."""
    q, k, v = _unpack(qkv, "qkv", 3, 2, "(batch, seqlen, 3, heads, head_dim)")
    return _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, s_aux=None):
    """:func:`flash_attn_func` with packed ``kv`` (b, s_k, 2, h_k, d); q (b, s_q, h, d).
    Returns as flash_attn_func; gradients reach q and ``kv`` (through its views)."""
    k, v = _unpack(kv, "kv", 2, 2, "(batch, seqlen_k, 2, heads_k, head_dim)")
    return _padded(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, s_aux=None):
    """Attention over variable-length sequences packed along dim 0, flash_attn 2.x
    ``flash_attn_varlen_func``.

    Args:
        q: (total_q, h, d); k, v: (total_k, h_k, d); fp16/bf16, CUDA, as in flash_attn_func.
        cu_seqlens_q, cu_seqlens_k: int32 (b + 1,), contiguous, on q's device: prefix sums of
            the sequence lengths (start at 0, non-decreasing, last value <= total). Sequence i is
            rows cu_seqlens[i]:cu_seqlens[i+1]; q and k lengths may differ per sequence and may be
            0 (an empty k sequence gives output 0 for its rows).
        max_seqlen_q, max_seqlen_k: ints (Python or numpy; ArgumentError otherwise), the longest
            q / k sequence (>= every length).
        causal: bottom-right aligned per sequence; turned off when max_seqlen_q == 1.
        block_table: None, or int32 (b, max_pages) with contiguous rows: k and v are then a paged
            cache (num_pages, page_size, h_k, d) of any page size >= 1, sequence i's key j in page
            ``block_table[i, j // page_size]``, row ``j % page_size`` (forward only: dropout raises
            NotImplementedError; with inputs that require grad the output's backward raises it).
            Other arguments (deterministic included) as flash_attn_func.

    Returns:
        out (total_q, h, d); with ``return_attn_probs``, ``(out, softmax_lse, S_dmask)`` with
        softmax_lse fp32 (h, total_q).

    Autograd: as flash_attn_func; dq (total_q, h, d), dk and dv (total_k, h_k, d). Rows outside
    every sequence (after ``cu_seqlens[-1]``) get gradient 0.

    Raises: as flash_attn_func; ArgumentError for cu_seqlens values that do not start at 0,
    decrease, exceed the rows, or a sequence longer than max_seqlen (value checks run on real tensors outside CUDA-graph
    capture only; see ferroattn.ops.attention.check_cu_seqlens_values).
    """
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs, block_table, s_aux=s_aux)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None):
    """:func:`flash_attn_varlen_func` with packed ``qkv`` (total, 3, h, d) and one ``cu_seqlens``
    (b + 1,) int32 / ``max_seqlen`` for q and k. Returns as flash_attn_varlen_func; the gradient
    reaches ``qkv`` through the views ``qkv[:, 0]``, ``qkv[:, 1]``, ``qkv[:, 2]``."""
    q, k, v = _unpack(qkv, "qkv", 3, 1, "(total, 3, heads, head_dim)")
    return _attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, s_aux=s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, s_aux=None):
    """:func:`flash_attn_varlen_func` with packed ``kv`` (total_k, 2, h_k, d); q (total_q, h, d).
    Returns as flash_attn_varlen_func; gradients reach q and ``kv`` (through its views)."""
    k, v = _unpack(kv, "kv", 2, 1, "(total_k, 2, heads_k, head_dim)")
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, s_aux=s_aux)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash_attn 2.x ``flash_attn_with_kvcache``: attention of a few new query tokens over a key/value
    cache, optionally appending new keys/values to the cache in place first (inference only: no
    backward, no dropout; as in flash_attn).

    Args:
        q: (b, s_q, h, d), fp16/bf16, CUDA; d <= 256 (padded to a multiple of 8 as flash_attn does).
        k_cache, v_cache: (b_cache, s_cache, h_k, d), or with ``block_table`` the paged cache
            (num_pages, page_size, h_k, d) with ANY page size >= 1 (flash_attn 2 needs multiples of
            256); q's dtype; ``stride(-1) == 1`` (AssertionError otherwise: they are updated in
            place, never copied).
        k, v: None or (b, s_new, h_k, d): written into the cache at positions
            ``cache_seqlens[b] .. + s_new`` (k rotated when rotary_cos/sin are given) before the
            attention, which then sees them. Need ``cache_seqlens``.
        rotary_cos, rotary_sin: None or (seqlen_ro, rotary_dim / 2) in q's dtype, contiguous;
            rotary_dim a multiple of 16 <= d; seqlen_ro >= the cache's capacity. Only with k/v: k is
            rotated at positions ``cache_seqlens + t``, q at ``cache_seqlens + i`` when causal or
            local, else every q token at ``cache_seqlens`` (RoFormer, Su et al. 2021).
        rotary_interleaved: True pairs dims (0, 1), (2, 3), … (GPT-J); False pairs (j, j + rd / 2)
            (GPT-NeoX).
        cache_seqlens: None (the whole cache), an int (every sequence), or int32 (b,) on q's device:
            the cache lengths before the append. Values past the cache are clamped on the device:
            nothing outside k_cache / v_cache is read or written.
        cache_batch_idx: None or int32 (b,): the cache row of each batch entry (not with paging).
        cache_leftpad: None or int32 (b,): the first valid key row of each cache row (not with
            paging); positions (causal, window, ALiBi) count from it.
        block_table: None or int32 (b, max_pages) with contiguous rows: the pages of each sequence.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`,
            bottom-right aligned on each sequence's length (cache_seqlens + s_new − leftpad).
        num_splits: 0 (heuristic), or 1..128 blocks per sequence over the keys.
        return_softmax_lse: also return softmax_lse fp32 (b, h, s_q).

    Returns: out (b, s_q, h, d) in q's dtype, or ``(out, softmax_lse)``.

    Raises: AssertionError (a cache whose last dim is not contiguous, as flash_attn); the
    ferroattn.errors classes naming the argument for bad dtypes, shapes, devices; ArgumentError
    when ``cache_seqlens`` (an int) + s_new passes the cache, or, with a paged cache and a real
    int32 ``cache_seqlens`` outside CUDA-graph capture and torch.compile, when its maximum + s_new
    passes ``block_table``'s capacity (a device-to-host read, as flash_attn 2.8 does; once per
    version of the tensor: :func:`ferroattn.ops.kvcache.check_paged_capacity`).
    """
    if _eager.ENABLED and not torch.compiler.is_compiling():
        # the common call (a contiguous-row cache, an optional append, the plain or causal
        # variant) in one native call (src/ops/attention/fast.rs `fast_kvcache`): None otherwise,
        # and every check and error below stays this function's
        res = _native.attn_kvcache_fast(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                        window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                        return_softmax_lse)
        if res is not None:
            return res
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, Tensor):
            raise DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        _check_strided(x, name)
        if name != "q" and x.dim() != 4:   # before its stride(-1) is asserted (q's rank: below)
            raise ArgumentError(f"{name}: expected rank 4 (batch_cache, seqlen_cache, heads_k, head_dim) or "
                                f"(num_pages, page_size, heads_k, head_dim), got rank {x.dim()} (shape {tuple(x.shape)})")
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    for name, x in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                    ("block_table", block_table), ("alibi_slopes", alibi_slopes)):
        _check_optional_tensor(x, name)
    if q.dim() != 4:
        raise ArgumentError(f"q: expected rank 4 (batch, seqlen_q, heads, head_dim), got rank {q.dim()} "
                            f"(shape {tuple(q.shape)})")
    for name, x in (("k", k), ("v", v)):
        if x is not None and (x.dim() != 4 or x.shape[0] != q.shape[0]):
            raise ArgumentError(f"{name}: expected shape ({q.shape[0]}, seqlen_new, heads_k, head_dim) (q's batch), got "
                                f"shape {tuple(x.shape)}")
    if (k is None) != (v is None):
        raise ArgumentError(f"{'v' if k is not None else 'k'}: expected a tensor (given together with "
                            f"{'k' if k is not None else 'v'}), got None")
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ArgumentError("rotary_cos: expected None without new k / v to append (rotary applies to the "
                                "appended keys and q), got a tensor")
        if rotary_cos is None or rotary_sin is None:
            raise ArgumentError("rotary_sin: expected rotary_cos and rotary_sin together, got only one of the two")
    head_dim = q.shape[-1]
    if rotary_cos is not None and rotary_cos.dim() == 2 and 2 * rotary_cos.shape[1] > head_dim:
        raise ArgumentError(f"rotary_cos: expected rotary_dim = 2 x dim 1 <= the head dim {head_dim}, got "
                            f"{2 * rotary_cos.shape[1]}")
    if head_dim > 256:
        raise ArgumentError(f"q: expected head dim <= 256, got head dim {head_dim}")
    softmax_scale = _check_softmax_scale(softmax_scale, head_dim)
    causal = _check_causal(causal)
    window_size = _check_window(window_size)
    softcap = _check_softcap(softcap)
    rotary_interleaved = _check_flag(rotary_interleaved, "rotary_interleaved")
    return_softmax_lse = _check_return_flag(return_softmax_lse, "return_softmax_lse")
    splits = _as_int(num_splits) if not isinstance(num_splits, (bool, np.bool_)) else None
    if splits is None or not 0 <= splits <= _native.ATTN_KVCACHE_MAX_SPLITS:
        raise ArgumentError(f"num_splits: expected an int in [0, {_native.ATTN_KVCACHE_MAX_SPLITS}] (0 = heuristic), "
                            f"got {num_splits!r}")
    capacity = _kvcache.cache_capacity(k_cache, block_table)
    s_new = 0 if k is None else k.shape[1]
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        n = int(cache_seqlens)
        if s_new > capacity:
            raise ArgumentError(f"k: expected at most {capacity} new tokens (the cache's capacity), got {s_new}")
        if not 0 <= n or n + s_new > capacity:
            raise ArgumentError(f"cache_seqlens: expected an int in [0, {capacity - s_new}] (the cache holds {capacity} "
                                f"keys, {s_new} are appended), got {n}")
        cache_seqlens = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None and not isinstance(cache_seqlens, Tensor):
        raise DTypeError(f"cache_seqlens: expected an int, an int32 tensor or None, got {type(cache_seqlens).__name__}")
    if k is not None and cache_seqlens is None:
        raise ArgumentError("cache_seqlens: expected an int or an int32 (batch,) tensor when k and v are appended, "
                            "got None")
    if block_table is not None and cache_seqlens is not None:
        _kvcache.check_paged_capacity(cache_seqlens, s_new, capacity)
    variant = AttnVariant.from_flash_attn(causal, window_size, softcap, alibi_slopes, None, q.shape[1], capacity)
    q_per_token = variant.causal or variant.window_left >= 0 or variant.window_right >= 0
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and x.shape[-1] != head_dim:   # before padding: the user's sizes
            raise ArgumentError(f"{name}: expected head dim {head_dim} (q's head dim), got head dim {x.shape[-1]}")
    pad = (8 - head_dim % 8) % 8
    q = F.pad(q, [0, pad]) if pad else _maybe_contiguous(q)
    kc, vc = (F.pad(k_cache, [0, pad]), F.pad(v_cache, [0, pad])) if pad else (k_cache, v_cache)
    if k is not None:
        kn, vn = (F.pad(k, [0, pad]), F.pad(v, [0, pad])) if pad else (_maybe_contiguous(k), _maybe_contiguous(v))
        q_rot = _kvcache.run_kv_append(kc, vc, kn, vn, q if rotary_cos is not None else None, rotary_cos, rotary_sin,
                                       cache_seqlens, cache_batch_idx, block_table, rotary_interleaved, q_per_token)
        if rotary_cos is not None:
            q = q_rot
    out, softmax_lse = _kvcache.run_attn_fwd_kvcache(q, kc, vc, None, None, 0, cache_seqlens, s_new, cache_leftpad,
                                                     cache_batch_idx, block_table, softmax_scale, variant, splits)
    if pad:
        out = out[..., :head_dim]
        if k is not None:   # the padded copies took the append: write it back (flash_attn does the same)
            k_cache.copy_(kc[..., :head_dim])
            v_cache.copy_(vc[..., :head_dim])
    return (out, softmax_lse) if return_softmax_lse else out
