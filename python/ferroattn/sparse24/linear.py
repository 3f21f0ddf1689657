"""``SparseLinear``: an ``nn.Linear`` whose weight is a frozen 2:4 sparse matrix (public as
``ferroattn.nn.SparseLinear`` and ``ferroattn.sparse24.SparseLinear``).

State dict: ``values`` (m_pad, k_pad // 2) and ``meta`` (int16) buffers (the compressed weight of
:func:`ferroattn.sparse24.compress`, shapes from ``_native.sparse24_layout(out_features,
in_features)``), ``bias`` (a Parameter, as in ``nn.Linear``, when the layer has one) and
``_extra_state``: the int64 tensor ``(out_features, in_features)`` (the padded buffers do not tell
the logical shape: a 24x40 and a 24x44 weight have the same buffers; loading one into the other
raises ArgumentError instead of silently reading padding as weights). The forward is
:func:`ferroattn.sparse24.matmul` (its dispatch rule picks the sparse kernel or dense); gradients
flow to the input and the bias, never to the weight (frozen: a dense update would break the 2:4
pattern).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..errors import ArgumentError, DTypeError
from ..ops.activation import is_public
from .product import matmul
from .tensor import HALF, Sparse24Tensor, check_bool, compress, decompress, layout

__all__ = ["SparseLinear"]


class SparseLinear(torch.nn.Module):
    """``y = act(x @ w.T + bias)`` with ``w`` (out_features, in_features) a 2:4 sparse matrix.

    Args:
        in_features, out_features: k and n of the weight (>= 1).
        bias: whether the layer has a bias (n,).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu" (fused into the kernel).
        device, dtype: of the buffers; dtype float16 or bfloat16 (default: bfloat16).

    Dtype conversions: the layer always stays float16 or bfloat16 (the 2:4 kernels' dtypes).
    ``.half()`` / ``.bfloat16()`` / ``.to(torch.float16 | torch.bfloat16)`` convert ``values`` and
    ``bias``; a conversion to any other floating dtype (``.float()``, ``.double()``,
    ``.to(torch.float32)``, e.g. from ``model.to(torch.float32)`` on a model around it) leaves
    ``values`` and ``bias`` in their 16-bit dtype, the way torch leaves non-floating buffers alone
    (``meta`` is int16 and never converted), so the conversion of the whole model completes and the
    layer stays usable with inputs of its dtype; device moves always apply.

    The dense path caches the decompressed weight (:meth:`Sparse24Tensor.dense`); ``copy_`` /
    ``load_state_dict`` / buffer replacement are seen, a write through ``values.data`` /
    ``meta.data`` is not: call ``layer.weight.drop_dense_cache()`` after one.
    The constructor makes an all-zero weight (as ``load_state_dict`` target); build a useful one
    with :meth:`from_dense`. Input: (..., in_features) of the layer's dtype and device; output
    (..., out_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, activation: Optional[str] = None,
                 device=None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise DTypeError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")
        if not is_public(activation):
            raise ArgumentError(
                f"activation: expected None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got {activation!r}")
        if int(in_features) < 1 or int(out_features) < 1:
            raise ArgumentError(f"in_features, out_features: expected >= 1, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.activation = activation
        lay = layout(self.out_features, self.in_features)
        self.register_buffer("values", torch.zeros(tuple(lay["values_shape"]), dtype=dtype, device=device))
        self.register_buffer("meta", torch.zeros(tuple(lay["meta_shape"]), dtype=torch.int16, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self._sparse: Optional[Sparse24Tensor] = None
        self._refresh()

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, prune: bool = True, *, activation: Optional[str] = None) -> "SparseLinear":
        """A SparseLinear with ``linear``'s weight pruned to 2:4 (magnitude; ``prune=False``:
        it must already be 2:4, else ValueError; ``prune`` not a bool: TypeError) and compressed on
        its device, and a copy of its bias (same requires_grad). ``linear``'s weight must be float16 or bfloat16.
        Raises TypeError when ``linear`` is not an nn.Linear, plus compress's errors."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        check_bool("prune", prune)
        w = linear.weight
        ws = compress(w.detach(), prune=prune)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, activation=activation,
                    device="meta", dtype=w.dtype)
        layer.values, layer.meta = ws.values, ws.meta
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        layer._sparse = ws
        return layer

    def _refresh(self) -> None:
        """Rebuild the Sparse24Tensor view when the buffers were replaced (outside torch.compile, so
        a compiled forward finds it ready)."""
        s = self._sparse
        if s is None or s.values is not self.values or s.meta is not self.meta:
            self._sparse = Sparse24Tensor(self.values, self.meta, (self.out_features, self.in_features),
                                                   self.values.dtype)

    def _apply(self, fn, recurse=True):
        # Keep the 16-bit dtype on conversions to other floating dtypes (see the class docstring):
        # a half-converted layer (fp32 values the Sparse24Tensor rejects) is never left behind.
        def keep_16bit(t):
            out = fn(t)
            if (isinstance(t, Tensor) and isinstance(out, Tensor) and t.dtype in HALF
                    and out.is_floating_point() and out.dtype not in HALF):
                out = out.to(t.dtype)   # exact: fp16/bf16 -> fp32/fp64 -> back is lossless
            return out
        out = super()._apply(keep_16bit, recurse)
        self._refresh()
        return out

    @property
    def weight(self) -> Sparse24Tensor:
        """The compressed weight (a :class:`~ferroattn.Sparse24Tensor` over the buffers;
        rebuilt when ``.to()`` / ``load_state_dict(assign=True)`` replaced them)."""
        if not torch.compiler.is_compiling():   # rebuilt eagerly (_apply, first access), read when traced
            self._refresh()
        return self._sparse

    def get_extra_state(self) -> Tensor:
        return torch.tensor([self.out_features, self.in_features], dtype=torch.int64)

    def set_extra_state(self, state) -> None:
        got = tuple(int(v) for v in torch.as_tensor(state).reshape(-1).tolist())
        if got != (self.out_features, self.in_features):
            raise ArgumentError(f"state_dict: expected a SparseLinear of (out_features, in_features) = "
                                f"{(self.out_features, self.in_features)}, got {got}")

    def forward(self, x: Tensor) -> Tensor:
        return matmul(x, self.weight, self.bias, self.activation)

    def to_dense(self) -> torch.nn.Linear:
        """An ``nn.Linear`` with the decompressed (2:4) weight and a copy of the bias, on this
        layer's device and dtype (the activation, if any, is not part of nn.Linear)."""
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                        dtype=self.values.dtype)
        lin.weight = torch.nn.Parameter(decompress(self.weight))
        if self.bias is not None:
            lin.bias = torch.nn.Parameter(self.bias.detach().clone())
        return lin

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
             f"dtype={self.values.dtype}, sparsity=2:4")
        return s + (f", activation={self.activation!r}" if self.activation else "")
