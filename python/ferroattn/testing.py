"""Reference attention in plain torch, with flash_attn's semantics, for tests.

Layout is flash_attn's (sequence before heads). Semantics (reference/api-contracts.md §1.2):
- bottom-right causal: query row i sees key j when j <= i + s_k - s_q;
- window_size (left, right): row i sees keys in [i + s_k - s_q - left, i + s_k - s_q + right],
  -1 = unbounded, sides >= s_k become -1, causal forces right = 0 (flash_attn's normalisation);
- softcap > 0: score = softcap · tanh(score · scale / softcap); ALiBi: score -= slope·|i + s_k - s_q - j|;
- GQA: query head i reads kv head i // (h / h_k) (contiguous groups, like repeat_interleave);
- a row that sees no key: output 0, LSE +inf.

The references are differentiable (plain torch ops; rows that see no key have finite, zero
gradients), so ``torch.autograd.grad`` through them gives reference gradients for the backward.

``upcast=True`` computes in ``reference_dtype`` (fp32 by default, fp64 possible): the reference.
``upcast=False`` computes the same formula in the input dtype (fp16/bf16): the low-precision
baseline ``ref_lp``. The pass rule (DESIGN §5, flash-attention's own) is
``max|out - ref| <= 2 · max|ref_lp - ref| + 1e-5`` (:func:`assert_close_to_ref`).

Sources: T. Dao, "FlashAttention-2", 2023 (semantics of the outputs out and LSE);
flash_attn 2.8 API (masking conventions).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["visible_mask", "attention_ref", "attention_varlen_ref", "max_abs_diff", "assert_close_to_ref",
           "random_cu_seqlens", "attention_grads_ref"]


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                 window_size: Sequence[int] = (-1, -1), device=None) -> Tensor:
    """bool (seqlen_q, seqlen_k): True where query row i may attend key j (flash_attn rules above,
    including its window normalisation)."""
    left, right = (int(w) for w in window_size)
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
    row = torch.arange(seqlen_q, device=device)[:, None]
    col = torch.arange(seqlen_k, device=device)[None, :]
    diag = row + seqlen_k - seqlen_q
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= col <= diag + right
    if left >= 0:
        visible &= col >= diag - left
    return visible


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, upcast: bool = True,
                  reference_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """Reference attention over padded batches.

    Args:
        q: (b, s_q, h, d), any float dtype, any device.
        k: (b, s_k, h_k, d), h % h_k == 0.
        v: (b, s_k, h_k, d_v).
        causal, window_size, softcap: flash_attn semantics (module docstring).
        softmax_scale: None -> d ** -0.5.
        alibi_slopes: None, (h,) or (b, h) fp32.
        upcast: True -> compute in ``reference_dtype``; False -> in q's dtype (baseline ref_lp).
        reference_dtype: torch.float32 or torch.float64.

    Returns:
        out: (b, s_q, h, d_v) in ``reference_dtype`` (upcast) or q's dtype; 0 for rows that see no key.
        lse: fp32 (b, h, s_q), natural-log logsumexp of the scaled (masked, softcapped) scores;
            +inf for rows that see no key.
    """
    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    if h % h_k != 0:
        raise ValueError(f"k: expected h_k dividing h = {h}, got h_k = {h_k}")
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
        slopes = alibi_slopes.to(cdt).reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
        rows = torch.arange(s_q, device=q.device)[:, None]
        cols = torch.arange(s_k, device=q.device)[None, :]
        dist = (rows + s_k - s_q - cols).abs().to(cdt)
        scores = scores - slopes * dist
    visible = visible_mask(s_q, s_k, causal, window_size, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty_row = ~visible.any(dim=-1)  # (s_q,)
    lse = torch.logsumexp(scores.to(torch.float32 if cdt != torch.float64 else cdt), dim=-1)
    lse = lse.masked_fill(empty_row, float("inf")).to(torch.float32)
    # A row that sees no key: softmax of a row of -inf is NaN, and so would be its gradient. Take the
    # softmax of a finite placeholder row and zero it instead: output 0, every gradient finite (0).
    probs = torch.softmax(scores.masked_fill(empty_row[:, None], 0.0), dim=-1).masked_fill(empty_row[:, None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         causal: bool = False, softmax_scale: Optional[float] = None,
                         window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                         alibi_slopes: Optional[Tensor] = None, upcast: bool = True,
                         reference_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """Reference attention over packed variable-length sequences (one :func:`attention_ref` per
    sequence; causal/window are aligned bottom-right per sequence).

    Args:
        q: (total_q, h, d); k: (total_k, h_k, d); v: (total_k, h_k, d_v).
        cu_seqlens_q, cu_seqlens_k: int (b + 1,) prefix sums; sequence i is rows
            cu[i]:cu[i+1] (may be empty).
        alibi_slopes: None, (h,) or (b, h). Other arguments as :func:`attention_ref`.

    Returns:
        out: (total_q, h, d_v) (rows outside every sequence are 0); lse: fp32 (h, total_q)
        (+inf for rows that see no key or lie outside every sequence).
    """
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    total_q, h = q.shape[0], q.shape[1]
    dtype = (reference_dtype if upcast else q.dtype)
    out = torch.zeros(total_q, h, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((h, total_q), float("inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
                             window_size, softcap, slopes, upcast, reference_dtype)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b| in fp64; positions where both are equal (including equal infinities) count 0;
    NaN anywhere in ``a`` or ``b`` gives NaN."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
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
    """int32 (len(lengths) + 1,) prefix sums of ``lengths`` starting at 0."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def attention_grads_ref(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool = False,
                        softmax_scale: Optional[float] = None, cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None, upcast: bool = True,
                        reference_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference gradients ``(dq, dk, dv)`` of attention for the output gradient ``dout``, by
    autograd through :func:`attention_ref` (padded; ``cu_seqlens_q is None``) or
    :func:`attention_varlen_ref` (varlen).

    Args: q, k, v, causal, softmax_scale, cu_seqlens_q/k, upcast, reference_dtype as the forward
    references (any strides; they are detached first); dout: the output's shape, any float dtype
    (cast to the compute dtype).

    Returns: dq, dk, dv with q's / k's / v's shapes, in ``reference_dtype`` (upcast) or the input
    dtype (upcast=False: the low-precision baseline of the pass rule, factor 3 for gradients).
    Rows that see no key get dq = 0; GQA dk/dv are summed over each group (autograd through
    repeat_interleave)."""
    cdt = reference_dtype if upcast else q.dtype
    q_, k_, v_ = (x.detach().to(cdt).requires_grad_(True) for x in (q, k, v))
    if cu_seqlens_q is None:
        out, _ = attention_ref(q_, k_, v_, causal=causal, softmax_scale=softmax_scale, upcast=upcast,
                               reference_dtype=reference_dtype)
    else:
        out, _ = attention_varlen_ref(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                      softmax_scale=softmax_scale, upcast=upcast, reference_dtype=reference_dtype)
    dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), dout.to(out.dtype), allow_unused=True)
    zeros = torch.zeros_like
    return (dq if dq is not None else zeros(q_), dk if dk is not None else zeros(k_),
            dv if dv is not None else zeros(v_))
