"""The attention variant: one value for everything an attention call computes beyond
``softmax(scale · q kᵀ) v`` -- mask (causal, local window), softcap, ALiBi, attention sinks.

:class:`AttnVariant` is built once from the flash_attn arguments (:meth:`AttnVariant.from_flash_attn`,
flash_attn 2.8's normalisation), travels through the custom ops as their trailing arguments
(:meth:`AttnVariant.op_args` / :meth:`AttnVariant.from_op_args`, the one place they are flattened:
a torch custom op takes no dataclass) and reaches ``ferroattn._native`` whole, read by attribute
on the Rust side (``src/python/variant.rs``), where it is validated and turned into a kernel
specialisation (``src/ops/attention/variant.rs``, ``kernels/attention/variant.cuh``).

Semantics (flash_attn 2.8, reference/api-contracts.md §1.2), with scores s = scale · q·kᵀ and
d = s_k − s_q (per sequence in varlen):

- window ``(left, right)``: row i sees keys j in [i + d − left, i + d + right] (−1 = unbounded);
  ``causal`` forces right = 0;
- ``softcap`` c > 0: s = c · tanh(s / c) (before ALiBi and the mask);
- ``alibi_slopes`` fp32 (h,) or (b, h): s −= slope · |i + d − j|;
- ``sinks`` fp32 (h,): logit σ_h joins every row's softmax, ``p_ij = exp(s_ij) / (Σ_j' exp(s_ij') +
  exp(σ_h))``, and carries no value; the LSE includes it; a row that sees no key gives output 0
  and LSE σ_h. Its gradient is ``−Σ_rows exp(σ_h − lse) · D`` with ``D = rowsum(dout ∘ out)``
  (:func:`sink_grad`). This is the learnable attention sink of GPT-OSS (transformers passes it as
  ``s_aux``).

Sources: flash_attn 2.8 docstrings (window, softcap, ALiBi); O. Press et al., "Train Short, Test
Long", 2022 (ALiBi); G. Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
2023, and OpenAI's gpt-oss model card, 2025 (learnable sinks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _native
from ._to_native import tensor_meta

__all__ = ["AttnVariant", "sink_grad", "visible_pairs", "draw_rng_state", "DMASK_GROUP"]

#: Keys per running-max entry of the returned softmax (``s_dmask_max``; kernels/attention/fwd_sm80.cuh).
DMASK_GROUP = 16


def draw_rng_state(device) -> Tensor:
    """int64 (2,) on ``device``: word 0 a random 64-bit Philox key drawn with torch's generator
    for ``device`` (``torch.randint``: reproducible after ``torch.manual_seed``, redrawn on each
    CUDA-graph replay), word 1 0 (flash_attn's (seed, offset) shape)."""
    seed = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, torch.zeros_like(seed)])


@dataclass(frozen=True)
class AttnVariant:
    """Everything but q/k/v of one attention call.

    Fields:
        causal: bottom-right causal mask (row i sees keys j <= i + s_k − s_q).
        window_left, window_right: local window sides in keys, −1 = unbounded (flash_attn's
            ``window_size``, already normalised: a side >= s_k is −1, ``causal`` forces right 0).
        softcap: logit softcapping c (0.0 = off).
        alibi_slopes: fp32 (h,) or (b, h) CUDA tensor, or None.
        sinks: fp32 (h,) CUDA tensor (the learnable sink logits), or None.
        dropout_p: dropout probability in [0, 1) (0.0 = off), applied to the softmax.
        rng_state: int64 (2,) on q's device when dropout_p > 0: word 0 is the Philox key of the
            dropout mask (drawn from torch's CUDA generator: ``torch.manual_seed`` reproduces a
            run, and a CUDA graph redraws it on every replay); the backward reuses it.
        s_dmask, s_dmask_max: testing only (:func:`ferroattn.ops.attention.attn_fwd_dmask`):
            buffers the forward fills with the softmax and the mask.
    """
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    dropout_p: float = 0.0
    rng_state: Optional[Tensor] = None
    s_dmask: Optional[Tensor] = None
    s_dmask_max: Optional[Tensor] = None

    @classmethod
    def from_flash_attn(cls, causal: bool, window_size: Tuple[int, int], softcap: float,
                        alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], seqlen_q: int,
                        seqlen_k: int, dropout_p: float = 0.0, device=None) -> "AttnVariant":
        """flash_attn 2.8's normalisation of already type-checked arguments: a window side
        >= ``seqlen_k`` (``max_seqlen_k`` in varlen), or negative, becomes −1; the unset side of
        a one-sided window becomes ``seqlen_k``; ``causal`` is dropped when
        ``seqlen_q == 1`` and there is no ALiBi (a no-op then); causal forces right = 0; a window
        of (−1, 0) is the causal mask. ``sinks`` of another float dtype are cast to fp32
        (differentiably). ``dropout_p > 0`` draws the mask's Philox key (:func:`draw_rng_state`)
        on ``device``."""
        left, right = window_size
        if left >= seqlen_k or left < 0:
            left = -1
        if right >= seqlen_k or right < 0:
            right = -1
        if seqlen_q == 1 and alibi_slopes is None:
            causal = False
        if causal:
            right = 0
        if left < 0 and right == 0:
            causal, right = True, -1
        # flash_attn fills the unset side of a one-sided window with seqlen_k (not unbounded):
        # it matters when s_q > s_k (early rows then see fewer keys, or none)
        elif left < 0 and right >= 0:
            left = seqlen_k
        elif left >= 0 and right < 0:
            right = seqlen_k
        if sinks is not None and sinks.dtype != torch.float32 and sinks.is_floating_point():
            sinks = sinks.float()
        dropout_p = float(dropout_p or 0.0)
        if dropout_p == 0.0 and alibi_slopes is None and sinks is None:
            return cls._tensorless(bool(causal), int(left), int(right), float(softcap or 0.0))
        rng_state = draw_rng_state(device) if dropout_p > 0.0 else None
        return cls(bool(causal), int(left), int(right), float(softcap or 0.0), alibi_slopes, sinks, dropout_p,
                   rng_state)

    @classmethod
    def _tensorless(cls, causal: bool, window_left: int, window_right: int, softcap: float) -> "AttnVariant":
        """The variant without tensors (no ALiBi, sinks or dropout) for these fields: one shared
        instance per value (the class is frozen), so a model's calls build none (a frozen
        dataclass costs ~1.5 µs to construct). At most :data:`_TENSORLESS_MAX` are kept."""
        if torch.compiler.is_compiling() or cls is not AttnVariant:   # a traced call builds its own
            return cls(causal, window_left, window_right, softcap)     # (Dynamo guards on a global dict)
        softcap += 0.0   # -0.0 -> 0.0: one key (and one instance) for "off"
        key = (causal, window_left, window_right, softcap)
        v = _TENSORLESS.get(key)
        if v is None:
            if len(_TENSORLESS) >= _TENSORLESS_MAX:
                _TENSORLESS.clear()
            v = _TENSORLESS[key] = cls(causal, window_left, window_right, softcap)
        return v

    # -- through the custom ops -------------------------------------------------------------
    def op_args(self) -> tuple:
        """The ops' trailing arguments after ``deterministic``: (window_left, window_right,
        softcap, alibi_slopes, sinks, dropout_p, rng_state) (``causal`` keeps its own slot)."""
        return (self.window_left, self.window_right, self.softcap, self.alibi_slopes, self.sinks, self.dropout_p,
                self.rng_state)

    @classmethod
    def from_op_args(cls, causal, window_left, window_right, softcap, alibi_slopes, sinks, dropout_p=0.0,
                     rng_state=None) -> "AttnVariant":
        if alibi_slopes is None and sinks is None and dropout_p == 0.0 and rng_state is None:
            return cls._tensorless(bool(causal), int(window_left), int(window_right), float(softcap))
        return cls(bool(causal), int(window_left), int(window_right), float(softcap), alibi_slopes, sinks,
                   float(dropout_p), rng_state)

    # -- to the native module -----------------------------------------------------------------
    def for_native(self) -> "AttnVariant":
        """The variant with its tensors detached (DLPack refuses tensors that require grad); the
        variant itself when none does (no copy on the eager hot path)."""
        grad = [t is not None and t.requires_grad for t in (self.alibi_slopes, self.sinks)]
        if not any(grad):
            return self
        det = lambda t: t.detach() if t is not None and t.requires_grad else t  # noqa: E731
        return dataclasses.replace(self, alibi_slopes=det(self.alibi_slopes), sinks=det(self.sinks))

    def for_check(self) -> "AttnVariant":
        """The variant with its tensors as metadata tuples (``_native.attn_*_check``)."""
        return dataclasses.replace(self, alibi_slopes=tensor_meta(self.alibi_slopes),
                                   sinks=tensor_meta(self.sinks), rng_state=tensor_meta(self.rng_state),
                                   s_dmask=tensor_meta(self.s_dmask), s_dmask_max=tensor_meta(self.s_dmask_max))

    @property
    def is_plain(self) -> bool:
        """No mask and no score modification."""
        return self == AttnVariant()


#: the shared tensorless variants (AttnVariant._tensorless), and how many are kept at most
_TENSORLESS: dict = {}
_TENSORLESS_MAX = 1024


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window_size: Tuple[int, int] = (-1, -1)) -> int:
    """(query, key) pairs of one (batch, head) that ``causal`` / ``window_size`` leave visible
    (flash_attn semantics, bottom-right aligned; ``causal`` forces right = 0). The one count:
    the Rust ``visible_pairs`` the launch records use. E.g. s_q = s_k = 4, causal: 10; window
    (1, 0): 7."""
    left, right = (int(w) for w in window_size)
    return int(_native.attn_visible_pairs(int(seqlen_q), int(seqlen_k), bool(causal), left, right))


def sink_grad(sinks: Tensor, softmax_lse: Tensor, out: Tensor, dout: Tensor,
              cu_seqlens_q: Optional[Tensor]) -> Tensor:
    """Gradient of the sink logits: ``dσ_h = −Σ_{rows of head h} exp(σ_h − lse) · D``, with
    ``D = Σ_d dout · out`` per row (the softmax's derivative for a column that carries no value).

    Shapes: sinks (h,) fp32; softmax_lse (b, h, s_q) padded / (h, total_q) varlen; out, dout
    (b, s_q, h, d) / (total_q, h, d). Varlen rows past ``cu_seqlens_q[-1]`` (outside every
    sequence, never written by the forward) are left out. Returns fp32 (h,). Plain torch ops: no
    host sync, traceable by torch.compile."""
    d = (dout.float() * out.float()).sum(-1)          # (b, s_q, h) or (total_q, h)
    if cu_seqlens_q is None:
        p_sink = torch.exp(sinks[None, :, None] - softmax_lse)          # (b, h, s_q)
        terms = p_sink * d.transpose(1, 2)
        return -terms.sum(dim=(0, 2))
    p_sink = torch.exp(sinks[:, None] - softmax_lse)                     # (h, total_q)
    rows = torch.arange(softmax_lse.shape[1], device=softmax_lse.device)
    inside = rows < cu_seqlens_q[-1]
    terms = torch.where(inside[None, :], p_sink * d.transpose(0, 1), torch.zeros((), device=d.device))
    return -terms.sum(dim=1)
