"""The fused activations of the GEMM and 2:4 kernels: their names, the public spellings, and the
same functions in torch (forward and backward), for every path that does not run the kernel's
epilogue (the dense and empty paths, the torch fallbacks, the autograd backward).

Names (``kernels/common/activation.cuh``, codes 0..4 in this order; the ``_native`` launchers
take the names): ``"none"`` f(x) = x; ``"relu"`` max(x, 0); ``"gelu_tanh"`` the tanh form of GELU
(Hendrycks & Gimpel 2016, torch ``approximate="tanh"``); ``"gelu_erf"`` the exact (erf) GELU
(torch's default); ``"silu"`` x·sigmoid(x). Public functions (``ferroattn.matmul``,
``ferroattn.nn.Linear``, ``ferroattn.sparse24.matmul``, ``SparseLinear``) also accept None (no
activation) and ``"gelu"`` (the erf form, as ``torch.nn.functional.gelu``): :data:`PUBLIC`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..errors import ArgumentError

__all__ = ["NATIVE", "PUBLIC", "is_public", "public_activation", "activate", "activation_backward"]

#: the kernels' activation names, in the order of their codes (kernels/common/activation.cuh)
NATIVE = ("none", "relu", "gelu_tanh", "gelu_erf", "silu")
#: public name -> native name (None and "gelu" are the public aliases of "none" and "gelu_erf")
PUBLIC = {None: "none", "none": "none", "relu": "relu", "gelu": "gelu_erf", "gelu_erf": "gelu_erf",
          "gelu_tanh": "gelu_tanh", "silu": "silu"}


def is_public(activation: Any) -> bool:
    """Whether ``activation`` is a key of :data:`PUBLIC` (False, not a TypeError, for unhashable
    values such as a list)."""
    return (activation is None or isinstance(activation, str)) and activation in PUBLIC


def public_activation(activation: Optional[str]) -> str:
    """The native name of a public one (:data:`PUBLIC`): None / "none" -> "none", "gelu" and
    "gelu_erf" -> "gelu_erf", "gelu_tanh", "relu", "silu" as they are.

    Raises:
        ArgumentError: naming ``activation``, for anything else."""
    if not is_public(activation):
        raise ArgumentError(f"activation: expected None, 'relu', 'gelu' (erf), 'gelu_tanh' or 'silu', "
                            f"got {activation!r}")
    return PUBLIC[activation]


def activate(x: Tensor, activation: str) -> Tensor:
    """``f(x)`` for a native name (:data:`NATIVE`), with torch's own functions (any shape and
    floating dtype; returns a new tensor of x's shape and dtype, or x itself for "none").

    Raises:
        ArgumentError: ``activation`` not a native name."""
    if activation == "none":
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu_erf":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    raise ArgumentError(f"activation: expected one of {NATIVE}, got {activation!r}")


def activation_backward(grad: Tensor, pre: Tensor, activation: str) -> Tensor:
    """``grad · f'(pre)`` for a native name, with torch's own backward kernels (so gradients match
    a dense ``F.linear`` + activation; relu'(0) = 0 as in torch). ``grad`` and ``pre`` have one
    shape; the result has ``grad``'s shape and the dtype torch's backward gives (callers that
    want fp32 pass fp32 tensors). "none" returns ``grad`` itself.

    Raises:
        ArgumentError: ``activation`` not a native name."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, pre, 0)
    if activation == "gelu_erf":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="none")
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    raise ArgumentError(f"activation: expected one of {NATIVE}, got {activation!r}")
