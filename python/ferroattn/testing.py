"""Reference attention in plain torch, with flash_attn's semantics, for tests.

Layout is flash_attn's (sequence before heads). Semantics (reference/api-contracts.md §1.2), in
the order they apply to the scores of query row i and key column j:
- scores s = scale · q_i · k_j (scale = ``softmax_scale``, None -> d ** -0.5);
- softcap c > 0: s = c · tanh(s / c) (i.e. c · tanh(q·k · scale / c));
- ALiBi: s -= slope · |i + s_k - s_q - j| (slope per head, or per batch entry and head);
- visibility: bottom-right causal: row i sees key j when j <= i + s_k - s_q;
  window_size (left, right): row i sees keys in [i + s_k - s_q - left, i + s_k - s_q + right],
  normalised as flash_attn does: sides >= s_k become -1 (unbounded), causal forces right = 0,
  then a side left at -1 while the other is set becomes s_k (in varlen mode flash_attn uses
  ``max_seqlen_k`` for the s_k of this normalisation, and each sequence's own s_q/s_k for the
  diagonal; see :func:`attention_varlen_ref`);
- sinks (``s_aux``, one learnable logit per query head, finite): the softmax of a row runs over
  [s_row..., s_aux[h]]; the sink column carries no value and is dropped from the probabilities,
  so it only joins the denominator (and the LSE). The sink is not scaled, softcapped or biased;
- dropout (``dropout_mask``, True = kept, and ``dropout_p``): applied after the softmax
  normalisation, out = (P · mask / (1 - p)) · V; the LSE is unaffected (flash_attn's reference);
- GQA: query head i reads kv head i // (h / h_k) (contiguous groups, like repeat_interleave);
- a row that sees no key: output 0, LSE +inf (with sinks: output 0, LSE = s_aux[h]).

The references are differentiable (plain torch ops; rows that see no key have finite, zero
gradients), so ``torch.autograd.grad`` through them gives reference gradients for the backward,
including the gradient of ``s_aux`` (:func:`attention_grads_ref`).

``upcast=True`` computes in ``reference_dtype`` (fp32 by default, fp64 possible): the reference.
``upcast=False`` computes the same formula in the input dtype (fp16/bf16): the low-precision
baseline ``ref_lp``. The pass rule (DESIGN §5, flash-attention's own) is
``max|out - ref| <= 2 · max|ref_lp - ref| + 1e-5`` (:func:`assert_close_to_ref`).

Sources: T. Dao, "FlashAttention-2", 2023 (semantics of the outputs out and LSE);
flash_attn 2.8 API (masking conventions, the window normalisation of flash_api.cpp, dropout as in
its tests' reference); O. Press et al., "Train Short, Test Long" (ALiBi), 2022; G. Xiao et al.,
"Efficient Streaming Language Models with Attention Sinks", 2024 (sinks as a softmax column).
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .errors import ArgumentError

__all__ = ["visible_mask", "attention_ref", "attention_varlen_ref", "max_abs_diff", "assert_close_to_ref",
           "random_cu_seqlens", "attention_grads_ref", "normalise_window", "rotary_ref", "paged_to_contiguous",
           "kvcache_ref"]


def _check_length(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ArgumentError(f"{name}: expected an int >= 0, got {type(v).__name__} {v!r}")
    return int(v)


def _check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    return bool(causal)


def _check_window(window_size) -> Tuple[int, int]:
    if (isinstance(window_size, (str, bytes)) or not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise ArgumentError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def normalise_window(window_size: Sequence[int], seqlen_k: int, causal: bool = False) -> Tuple[int, int]:
    """flash_attn's normalisation of ``window_size`` (flash_api.cpp): a side >= ``seqlen_k``
    becomes -1, ``causal`` forces right = 0, then a side at -1 while the other is >= 0 becomes
    ``seqlen_k``. Returns ``(left, right)``; (-1, -1) means no window (full or, with right = 0
    and left = -1 before the last step, causal). ArgumentError for a window that is not a pair of
    ints, a negative or non-int ``seqlen_k``, a causal that is not a bool."""
    left, right = _check_window(window_size)
    seqlen_k, causal = _check_length("seqlen_k", seqlen_k), _check_causal(causal)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                 window_size: Sequence[int] = (-1, -1), device=None, *,
                 window_seqlen_k: Optional[int] = None) -> Tensor:
    """bool (seqlen_q, seqlen_k): True where query row i may attend key j (flash_attn rules above,
    including its window normalisation).

    Args:
        seqlen_q, seqlen_k: the sequence's lengths (they place the bottom-right diagonal).
        causal, window_size: flash_attn semantics (module docstring).
        window_seqlen_k: the s_k that :func:`normalise_window` uses (None -> ``seqlen_k``; in
            varlen mode flash_attn normalises with ``max_seqlen_k``).
    """
    seqlen_q, seqlen_k = _check_length("seqlen_q", seqlen_q), _check_length("seqlen_k", seqlen_k)
    left, right = normalise_window(window_size, seqlen_k if window_seqlen_k is None else window_seqlen_k, causal)
    row = torch.arange(seqlen_q, device=device)[:, None]
    col = torch.arange(seqlen_k, device=device)[None, :]
    diag = row + seqlen_k - seqlen_q
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= col <= diag + right
    if left >= 0:
        visible &= col >= diag - left
    return visible


def _check_dropout_args(dropout_p: float, dropout_mask: Optional[Tensor]) -> float:
    """The dropout arguments must come together: ``dropout_mask`` with 0 < dropout_p < 1, or
    neither (dropout_p = 0). Returns the scale 1 / (1 - p) (1 without dropout)."""
    p = float(dropout_p)
    if dropout_mask is None:
        if p != 0.0:
            raise ValueError(f"dropout_p={p} needs a dropout_mask (the kept positions); the reference does not draw one")
        return 1.0
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout_mask needs dropout_p in (0, 1) (its 1 / (1 - p) scaling), got {dropout_p!r}")
    if dropout_mask.dtype != torch.bool:
        raise ValueError(f"dropout_mask: expected a bool tensor (True = kept), got {dropout_mask.dtype}")
    return 1.0 / (1.0 - p)


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, upcast: bool = True,
                  reference_dtype: torch.dtype = torch.float32, *, s_aux: Optional[Tensor] = None,
                  dropout_p: float = 0.0, dropout_mask: Optional[Tensor] = None,
                  window_seqlen_k: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Reference attention over padded batches.

    Args:
        q: (b, s_q, h, d), any float dtype, any device.
        k: (b, s_k, h_k, d), h % h_k == 0, q's device.
        v: (b, s_k, h_k, d_v).
        causal: bool; bottom-right aligned.
        softmax_scale: float or None (-> d ** -0.5).
        window_size: (left, right) ints, -1 = unbounded (flash_attn's normalisation).
        softcap: float; > 0 caps the scaled scores at ±softcap (c · tanh(s / c)); 0 = off.
        alibi_slopes: None, or a float tensor (h,) (one slope per head) or (b, h) (per batch entry
            and head); fp32 in flash_attn's API.
        upcast: True -> compute in ``reference_dtype``; False -> in q's dtype (baseline ref_lp).
        reference_dtype: torch.float32 or torch.float64.
        s_aux: None, or a float tensor (h,): one sink logit per query head (any float dtype; cast
            to the compute dtype), finite. Differentiable when it requires grad.
        dropout_p: float in (0, 1) with ``dropout_mask`` (the kept values are scaled by
            1 / (1 - p)); 0.0 without one.
        dropout_mask: None, or bool (b, h, S_q, S_k) with S_q >= s_q and S_k >= s_k (True = kept;
            entries [:, :, :s_q, :s_k] are used, so a mask of flash_attn's S_dmask shape
            (b, h, round128(s_q), round128(s_k)) can be passed whole), on q's device.
        window_seqlen_k: the s_k of the window normalisation (None -> s_k; the varlen reference
            passes max_seqlen_k).

    Returns:
        out: (b, s_q, h, d_v) in ``reference_dtype`` (upcast) or q's dtype; 0 for rows that see no key.
        lse: fp32 (b, h, s_q), natural-log logsumexp of the scaled (softcapped, biased, masked)
            scores and the sink (when ``s_aux`` is given); +inf for rows that see no key without
            sinks (``s_aux[h]`` with sinks). Dropout does not change it.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ArgumentError(f"{name}: expected a (batch, seqlen, heads, head_dim) tensor, got "
                                f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ArgumentError(f"k: expected q's batch {b} and head dim {d}, got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ArgumentError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if h_k == 0 or h % h_k != 0:
        raise ArgumentError(f"k: expected h_k dividing h = {h}, got h_k = {h_k}")
    _check_causal(causal)
    drop_scale = _check_dropout_args(dropout_p, dropout_mask)
    if softmax_scale is not None and not (isinstance(softmax_scale, numbers.Real) and math.isfinite(softmax_scale)):
        raise ArgumentError(f"softmax_scale: expected None or a finite real number, got {softmax_scale!r}")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    cdt = reference_dtype if upcast else q.dtype
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    if h_k != h:
        kc = kc.repeat_interleave(h // h_k, dim=2)
        vc = vc.repeat_interleave(h // h_k, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc)
    if softcap > 0:
        scores = softcap * torch.tanh(scores * scale / softcap)
    else:
        scores = scores * scale
    if alibi_slopes is not None:
        if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
            raise ValueError(f"alibi_slopes: expected shape ({h},) or ({b}, {h}), got {tuple(alibi_slopes.shape)}")
        slopes = alibi_slopes.to(cdt).reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
        rows = torch.arange(s_q, device=q.device)[:, None]
        cols = torch.arange(s_k, device=q.device)[None, :]
        dist = (rows + s_k - s_q - cols).abs().to(cdt)
        scores = scores - slopes * dist
    visible = visible_mask(s_q, s_k, causal, window_size, device=q.device, window_seqlen_k=window_seqlen_k)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty_row = ~visible.any(dim=-1)  # (s_q,)
    lse_dt = torch.float32 if cdt != torch.float64 else cdt
    if s_aux is not None:
        if tuple(s_aux.shape) != (h,):
            raise ValueError(f"s_aux: expected shape ({h},) (one sink logit per query head), got {tuple(s_aux.shape)}")
        sink = s_aux.to(cdt).reshape(1, h, 1, 1).expand(b, h, s_q, 1)
        full = torch.cat([scores, sink], dim=-1)
        lse = torch.logsumexp(full.to(lse_dt), dim=-1).to(torch.float32)
        # the sink column is finite, so every row (also one that sees no key) has a finite softmax
        probs = torch.softmax(full, dim=-1)[..., :s_k]
    else:
        lse = torch.logsumexp(scores.to(lse_dt), dim=-1)
        lse = lse.masked_fill(empty_row, float("inf")).to(torch.float32)
        # A row that sees no key: softmax of a row of -inf is NaN, and so would be its gradient. Take
        # the softmax of a finite placeholder row and zero it instead: output 0, every gradient finite (0).
        probs = torch.softmax(scores.masked_fill(empty_row[:, None], 0.0), dim=-1).masked_fill(empty_row[:, None], 0.0)
    if dropout_mask is not None:
        if (dropout_mask.dim() != 4 or dropout_mask.shape[0] != b or dropout_mask.shape[1] != h
                or dropout_mask.shape[2] < s_q or dropout_mask.shape[3] < s_k):
            raise ValueError(f"dropout_mask: expected shape ({b}, {h}, >= {s_q}, >= {s_k}), "
                             f"got {tuple(dropout_mask.shape)}")
        keep = dropout_mask[:, :, :s_q, :s_k].to(q.device)
        probs = probs.masked_fill(~keep, 0.0) * drop_scale
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         causal: bool = False, softmax_scale: Optional[float] = None,
                         window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Optional[Tensor] = None, upcast: bool = True,
                         reference_dtype: torch.dtype = torch.float32, *, s_aux: Optional[Tensor] = None,
                         dropout_p: float = 0.0, dropout_mask: Optional[Tensor] = None,
                         max_seqlen_k: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Reference attention over packed variable-length sequences (one :func:`attention_ref` per
    sequence; causal/window/ALiBi are aligned bottom-right per sequence, with the sequence's own
    s_q and s_k).

    Args:
        q: (total_q, h, d); k: (total_k, h_k, d); v: (total_k, h_k, d_v).
        cu_seqlens_q, cu_seqlens_k: int (b + 1,) prefix sums; sequence i is rows
            cu[i]:cu[i+1] (may be empty).
        alibi_slopes: None, (h,) or (b, h) float (entry i of a (b, h) tensor for sequence i).
        s_aux: None or (h,) float: one sink logit per query head, shared by every sequence.
        dropout_p, dropout_mask: as :func:`attention_ref`; the mask is bool (b, h, S_q, S_k) with
            S_q >= max s_q and S_k >= max s_k, sequence i using ``dropout_mask[i, :, :s_q_i, :s_k_i]``
            (flash_attn's varlen S_dmask: (b, h, round128(max_seqlen_q), round128(max_seqlen_k))).
        max_seqlen_k: the ``max_seqlen_k`` of the call; flash_attn normalises ``window_size`` with
            it, not with each sequence's s_k (a side >= max_seqlen_k becomes -1, a side left at -1
            while the other is set becomes max_seqlen_k). None -> the largest k length in
            ``cu_seqlens_k`` (what callers usually pass).
        Other arguments as :func:`attention_ref`.

    Returns:
        out: (total_q, h, d_v) (rows outside every sequence are 0); lse: fp32 (h, total_q)
        (+inf for rows that see no key or lie outside every sequence; with sinks, s_aux[h] for
        rows of a sequence that see no key, +inf outside every sequence).
    """
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if max_seqlen_k is None:
        max_seqlen_k = max((ck[i + 1] - ck[i] for i in range(len(ck) - 1)), default=0)
    _check_dropout_args(dropout_p, dropout_mask)
    total_q, h = q.shape[0], q.shape[1]
    dtype = (reference_dtype if upcast else q.dtype)
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    cursor = 0
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        mask = None if dropout_mask is None else dropout_mask[i:i + 1]
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
                             window_size, softcap, slopes, upcast, reference_dtype, s_aux=s_aux,
                             dropout_p=dropout_p, dropout_mask=mask, window_seqlen_k=max_seqlen_k)
        if q0 > cursor:  # rows between sequences (not part of any): 0 / +inf
            outs.append(torch.zeros(q0 - cursor, h, v.shape[-1], dtype=dtype, device=q.device))
            lses.append(torch.full((h, q0 - cursor), float("inf"), dtype=torch.float32, device=q.device))
        outs.append(o[0].to(dtype))
        lses.append(l[0])
        cursor = q1
    if total_q > cursor:
        outs.append(torch.zeros(total_q - cursor, h, v.shape[-1], dtype=dtype, device=q.device))
        lses.append(torch.full((h, total_q - cursor), float("inf"), dtype=torch.float32, device=q.device))
    # concatenated, not written into a preallocated buffer: autograd sees every sequence's output
    out = torch.cat(outs, dim=0) if outs else torch.zeros(0, h, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(h, 0, dtype=torch.float32, device=q.device)
    return out, lse


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b| in fp64; positions where both are equal (including equal infinities) count 0;
    NaN anywhere in ``a`` or ``b`` gives NaN. ArgumentError for shapes that differ (no broadcast)
    or a complex tensor (its imaginary part would be dropped)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise ArgumentError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if tuple(a.shape) != tuple(b.shape):
        raise ArgumentError(f"b: expected a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.is_complex():
            raise ArgumentError(f"{name}: expected a real tensor, got {t.dtype}")
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a64.numel() == 0:
        return 0.0
    diff = (a64 - b64).abs()
    diff = torch.where(a64 == b64, torch.zeros_like(diff), diff)
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("nan")
    return float(diff.max())


def assert_close_to_ref(out: Tensor, ref: Tensor, ref_lp: Tensor, factor: float = 2.0,
                        atol: float = 1e-5, name: str = "out") -> Tuple[float, float]:
    """The pass rule for low-precision kernels (DESIGN §5):
    ``max|out - ref| <= factor · max|ref_lp - ref| + atol`` (factor 2 forward, 3 for gradients).

    Args: out: the kernel's result; ref: :func:`attention_ref` with upcast=True; ref_lp: the same
    with upcast=False; all of one shape. Returns (error, bound). Raises AssertionError (with both
    numbers) when the rule fails or ``out`` holds NaN."""
    if out.shape != ref.shape or ref_lp.shape != ref.shape:
        raise AssertionError(f"{name}: shapes differ: out {tuple(out.shape)}, ref {tuple(ref.shape)}, "
                             f"ref_lp {tuple(ref_lp.shape)}")
    err = max_abs_diff(out, ref)
    bound = factor * max_abs_diff(ref_lp, ref) + atol
    if not err <= bound:  # also catches NaN
        raise AssertionError(f"{name}: max|out - ref| = {err:.3e} > {factor} * max|ref_lp - ref| + {atol} = {bound:.3e}")
    return err, bound


def random_cu_seqlens(lengths: List[int], device=None) -> Tensor:
    """int32 (len(lengths) + 1,) prefix sums of ``lengths`` (ints >= 0: ArgumentError otherwise)
    starting at 0."""
    cu = [0]
    for i, n in enumerate(lengths):
        cu.append(cu[-1] + _check_length(f"lengths[{i}]", n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def attention_grads_ref(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool = False,
                        softmax_scale: Optional[float] = None, cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None, upcast: bool = True,
                        reference_dtype: torch.dtype = torch.float32, *,
                        window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[Tensor] = None, s_aux: Optional[Tensor] = None,
                        dropout_p: float = 0.0, dropout_mask: Optional[Tensor] = None,
                        max_seqlen_k: Optional[int] = None) -> Tuple[Tensor, ...]:
    """Reference gradients ``(dq, dk, dv)`` (and ``ds_aux`` with sinks) of attention for the output
    gradient ``dout``, by autograd through :func:`attention_ref` (padded; ``cu_seqlens_q is None``)
    or :func:`attention_varlen_ref` (varlen).

    Args: q, k, v, causal, softmax_scale, cu_seqlens_q/k, upcast, reference_dtype, window_size,
    softcap, alibi_slopes (not differentiated), s_aux, dropout_p, dropout_mask and (varlen)
    max_seqlen_k as the forward references (q/k/v/s_aux may have any strides; they are detached
    first); dout: the output's shape ((b, s_q, h, d_v) or (total_q, h, d_v)), any float dtype
    (cast to the compute dtype).

    Returns: ``(dq, dk, dv)`` with q's / k's / v's shapes, in ``reference_dtype`` (upcast) or the
    input dtype (upcast=False: the low-precision baseline of the pass rule, factor 3 for
    gradients); with ``s_aux`` given, ``(dq, dk, dv, ds_aux)``, ds_aux (h,) in the same dtype:
    ds_aux[h] = -sum over rows of head h of exp(s_aux[h] - lse_row) · sum_d(dout · out) (also with
    dropout). Rows that see no key get dq = 0; GQA dk/dv are summed over each group (autograd
    through repeat_interleave)."""
    cdt = reference_dtype if upcast else q.dtype
    q_, k_, v_ = (x.detach().to(cdt).requires_grad_(True) for x in (q, k, v))
    s_ = None if s_aux is None else s_aux.detach().to(cdt).requires_grad_(True)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, upcast=upcast, reference_dtype=reference_dtype, s_aux=s_,
              dropout_p=dropout_p, dropout_mask=dropout_mask)
    if cu_seqlens_q is None:
        out, _ = attention_ref(q_, k_, v_, **kw)
    else:
        out, _ = attention_varlen_ref(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_k=max_seqlen_k, **kw)
    inputs = (q_, k_, v_) if s_ is None else (q_, k_, v_, s_)
    grads = torch.autograd.grad(out, inputs, dout.to(out.dtype), allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(grads, inputs))


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding (Su et al., "RoFormer", 2021) of ``x`` (b, s, h, d) at ``positions``
    (b, s) int: the first rotary_dim = 2 · cos.shape[1] dims are rotated by the angles of row
    ``positions[b, s]`` of cos / sin (seqlen_ro, rotary_dim / 2); pairs (j, j + rotary_dim / 2)
    (GPT-NeoX) or, ``interleaved``, (2j, 2j + 1) (GPT-J): (x1, x2) -> (x1 cos − x2 sin,
    x2 cos + x1 sin), computed in fp32 and rounded once to x's dtype; the other dims unchanged."""
    rd = cos.shape[1] * 2
    c = cos[positions].float().unsqueeze(2)   # (b, s, 1, rd / 2)
    sn = sin[positions].float().unsqueeze(2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((x1 * c - x2 * sn, x2 * c + x1 * sn), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        y = torch.cat((x1 * c - x2 * sn, x2 * c + x1 * sn), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., rd:]), dim=-1)


def paged_to_contiguous(pages: Tensor, block_table: Tensor) -> Tensor:
    """The contiguous view of a paged cache: (num_pages, page_size, h_k, d) pages and a (b, max_pages)
    int block table -> (b, max_pages · page_size, h_k, d) (a copy)."""
    b, n = block_table.shape
    return pages[block_table.long().flatten()].reshape(b, n * pages.shape[1], *pages.shape[2:])


def kvcache_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                cache_seqlens: Optional[Tensor] = None, cache_batch_idx: Optional[Tensor] = None,
                cache_leftpad: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                softmax_scale: Optional[float] = None, causal: bool = False, window_size: Sequence[int] = (-1, -1),
                softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                upcast: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """flash_attn 2's ``flash_attn_with_kvcache`` in plain torch (arguments as there; cache_seqlens an
    int32 (b,) tensor or None). Returns (out, lse, k_cache_after, v_cache_after): out (b, s_q, h, d)
    in fp32 (``upcast``) or q's dtype, lse fp32 (b, h, s_q), and the updated caches (copies; the
    inputs are not modified), paged caches as pages.

    Semantics: k (rotated at positions cache_seqlens + t) and v are written at rows
    cache_seqlens[b] + t of cache row cache_batch_idx[b] (or b; pages through block_table); q is
    rotated at cache_seqlens + i when causal or local, else at cache_seqlens; sequence b then attends
    to keys [leftpad_b, cache_seqlens[b] + s_new) of its cache row with positions counted from
    leftpad_b (:func:`attention_ref` per sequence, the window normalised with the cache's capacity)."""
    b, s_q, h, d = q.shape
    s_new = 0 if k is None else k.shape[1]
    kc, vc = k_cache.clone(), v_cache.clone()
    cont_k = paged_to_contiguous(kc, block_table) if block_table is not None else kc
    cont_v = paged_to_contiguous(vc, block_table) if block_table is not None else vc
    rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=q.device)
    capacity = cont_k.shape[1]
    lens = cache_seqlens.long() if cache_seqlens is not None else torch.full((b,), capacity, device=q.device)
    left, right = normalise_window(window_size, capacity, causal and not (s_q == 1 and alibi_slopes is None))
    per_token = causal or left >= 0 or right >= 0
    if rotary_cos is not None and k is not None:
        pos_k = lens[:, None] + torch.arange(s_new, device=q.device)[None]
        k = rotary_ref(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
        pos_q = lens[:, None] + (torch.arange(s_q, device=q.device)[None] if per_token else 0)
        q = rotary_ref(q, rotary_cos, rotary_sin, pos_q.expand(b, s_q), rotary_interleaved)
    outs, lses = [], []
    for i in range(b):
        r = int(rows[i])
        n = int(lens[i])
        if k is not None:
            cont_k[r, n:n + s_new] = k[i]
            cont_v[r, n:n + s_new] = v[i]
        lp = int(cache_leftpad[i]) if cache_leftpad is not None else 0
        kk, vv = cont_k[r:r + 1, lp:n + s_new], cont_v[r:r + 1, lp:n + s_new]
        slopes = alibi_slopes[i:i + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = attention_ref(q[i:i + 1], kk, vv, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=slopes, upcast=upcast, window_seqlen_k=capacity)
        outs.append(o)
        lses.append(l)
    if block_table is not None:   # write the contiguous copy back into the pages
        n_pages = block_table.shape[1]
        page = kc.shape[1]
        for i in range(b):
            for j in range(n_pages):
                kc[int(block_table[i, j])] = cont_k[i, j * page:(j + 1) * page]
                vc[int(block_table[i, j])] = cont_v[i, j * page:(j + 1) * page]
    else:
        kc, vc = cont_k, cont_v
    return torch.cat(outs), torch.cat(lses), kc, vc
