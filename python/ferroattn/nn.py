"""``torch.nn`` drop-ins backed by ferroattn kernels.

- :class:`Linear`: ``torch.nn.Linear`` (a subclass: same parameters, state dict, initialisation
  and repr) whose forward is one :func:`ferroattn.matmul` with the bias and an optional
  activation fused into the epilogue.
- ``SparseLinear``: the 2:4 structured-sparse linear layer (defined in
  :mod:`ferroattn.sparse24.linear`, re-exported here on first access).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .errors import ArgumentError
from .gemm import matmul
from .ops.activation import activate, public_activation
from .ops.gemm import BACKENDS

__all__ = ["Linear", "SparseLinear"]

#: Input dtypes the GEMM kernels take.
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class Linear(torch.nn.Linear):
    """``y = act(x @ weight.T + bias)``: a drop-in for ``torch.nn.Linear`` (plus an optional fused
    activation).

    Same constructor arguments, parameters (``weight`` (out_features, in_features), ``bias``
    (out_features,) or None), ``reset_parameters`` (torch's Kaiming-uniform initialisation), state
    dict keys and repr as ``torch.nn.Linear`` (it is a subclass: ``isinstance(m, torch.nn.Linear)``
    holds and state dicts load both ways); ``activation`` and ``backend`` appear in the repr only
    when not the defaults.

    Forward: ``ferroattn.matmul(x, weight.T, bias=bias, activation=activation)`` -- ``weight.T`` is
    a view (the kernel reads the (in, out) operand column-major in place, no copy) -- for
    ``x`` (..., in_features) on CUDA (or meta) in fp16/bf16 with the weight in x's dtype. Any
    other input (CPU, fp32, ...) runs the same math with torch (``F.linear`` + the activation), so
    the module behaves like ``torch.nn.Linear`` before it is moved to the GPU and cast. Under
    ``torch.autocast("cuda")`` the input, weight and bias are cast to the autocast dtype first (as
    autocast does for ``F.linear``) and the kernel runs.

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``.
        activation: None, "relu", "gelu" (erf), "gelu_tanh" or "silu" (ArgumentError otherwise).
        backend: "auto", "wmma" or "sm90" (see :func:`ferroattn.matmul`; ArgumentError otherwise).

    Shapes: x (..., in_features) -> (..., out_features), x's dtype; a 1-D x (in_features,) gives
    (out_features,) as torch.nn.Linear. ArgumentError naming ``x`` and ``in_features`` (expected and
    actual) for a 0-d x or a last dim other than in_features, on every path (kernel and torch).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: Optional[str] = None, backend: str = "auto") -> None:
        public_activation(activation)  # ArgumentError naming `activation` before any allocation
        if backend not in BACKENDS:
            raise ArgumentError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.backend = backend

    @classmethod
    def from_torch(cls, linear: torch.nn.Linear, activation: Optional[str] = None, backend: str = "auto") -> "Linear":
        """A :class:`Linear` that **shares** ``linear``'s parameters: ``new.weight is linear.weight``
        and ``new.bias is linear.bias`` (no copy, no extra memory; an optimizer holding the old
        module's parameters trains the new one; in-place changes show in both). For an
        independent module, ``copy.deepcopy`` the result. The training flag is copied.

        Raises TypeError when ``linear`` is not a ``torch.nn.Linear``."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        public_activation(activation)
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  dtype=linear.weight.dtype, activation=activation, backend=backend)
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        if x.dim() == 0 or x.shape[-1] != weight.shape[-1]:   # on every path, before any operand is built
            raise ArgumentError(f"x: expected shape (..., in_features) with in_features = {weight.shape[-1]}, "
                                f"got shape {tuple(x.shape)}")
        if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            if dt in _KERNEL_DTYPES:
                x, weight = x.to(dt), weight.to(dt)
                bias = None if bias is None else bias.to(dt)
        if _use_kernel(x, weight):
            if x.dim() == 1:   # (in,) -> (out,), as torch.nn.Linear (matmul takes (..., m, k))
                return matmul(x.unsqueeze(0), weight.T, bias=bias, activation=self.activation,
                              backend=self.backend).squeeze(0)
            return matmul(x, weight.T, bias=bias, activation=self.activation, backend=self.backend)
        y = torch.nn.functional.linear(x, weight, bias)
        return activate(y, public_activation(self.activation))

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.activation is not None:
            s += f", activation={self.activation!r}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s


def _use_kernel(x: Tensor, weight: Tensor) -> bool:
    """Whether :meth:`Linear.forward` runs ferroattn's kernel: x on CUDA (or meta: shape
    propagation) in fp16/bf16 with the weight in x's dtype; else torch."""
    return x.device.type in ("cuda", "meta") and x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype


def __getattr__(name: str):
    if name == "SparseLinear":
        from .sparse24.linear import SparseLinear  # noqa: PLC0415  (on first access: imports the 2:4 ops)
        globals()["SparseLinear"] = SparseLinear
        return SparseLinear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
