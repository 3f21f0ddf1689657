"""When a ``ferroattn`` function may call a custom op's implementation directly (the *eager fast
path*) instead of going through ``torch.ops.ferroattn.*``.

A call through a ``torch.library.custom_op`` costs tens of µs of host time before the
implementation runs (the dispatcher, the Python autograd wrapper, ``torch._disable_dynamo``,
alias checks): measured on a 2-core CPU host, 28 µs of the 37 µs of one
``torch.ops.ferroattn.sparse24_linear`` call with the kernel launch stubbed out; on the H200 host
``ferroattn.sparse24.matmul`` cost ~55 µs per call against 14 µs for ``F.linear``
(bench/NOTES.md). For decode-sized problems the kernels take ~10-25 µs,
so the op's dispatch dominated.

The op is only *needed* when something may watch or transform the call; :func:`plain_eager` says
when nothing can, so the implementation (the same code the op runs) is called directly:

- no autograd: grad mode off, or no tensor argument requires grad (else the op's autograd
  registration must record the backward);
- the first tensor is on CUDA, and every tensor argument is a plain ``torch.Tensor`` or
  ``nn.Parameter`` (a subclass -- FakeTensor, DTensor, a ``__torch_dispatch__`` wrapper -- must
  see the op) without a lazy negation or conjugation bit (``torch._neg_view``, ``.conj()``:
  DLPack carries no such bit, the op materialises it);
- not traced: not under ``torch.compile`` (``torch.compiler.is_compiling()``) and not under
  ``torch.jit.trace``;
- no torch function mode (``TorchFunctionMode``, including ``with torch.device(...)`` and
  ``torch.set_default_device``) and no torch dispatch mode (FlopCounterMode, FakeTensorMode,
  ``DebugMode``, ...);
- the autograd profiler is off (it names the op in its trace);
- no functorch transform (vmap, grad, jvp) is active.

Forward-mode AD is not a condition: the implementations reject dual tensors themselves
(:func:`ferroattn.ops._to_native.reject_forward_ad`), on either route.

``flash_attn_func``'s common plain / causal call goes one step further: with the fast path on and
outside torch.compile it is launched from one native call (``_native.attn_fwd_fast``,
src/ops/attention/fast.rs) that applies this same rule natively and declines everything else.

``$FERROATTN_EAGER_FASTPATH=0`` (read once, at import) turns the fast path off, the one-call
forward included: every call goes through the custom op, as before the fast path existed. :data:`ENABLED` is the switch itself
(tests and same-process A/B benchmarks set it; reading an environment variable per call would
cost ~2 µs).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import _native

__all__ = ["ENABLED", "plain_eager"]

#: The fast path's switch: False sends every call through the custom op. Initialised from
#: ``$FERROATTN_EAGER_FASTPATH`` (``0`` / ``off``: off; ``1`` / ``on``, empty or unset: on; any other
#: value is an ArgumentError naming the variable, raised at import: ``_native.env_switch``).
ENABLED: bool = _native.env_switch("FERROATTN_EAGER_FASTPATH", True)

#: device types of the first tensor that may take the fast path (the ops launch CUDA kernels;
#: CPU tests add "cpu" to exercise the selection with the launcher emulated)
_DEVICE_TYPES = ("cuda",)


def plain_eager(tensors: Sequence[Optional[Tensor]]) -> bool:
    """True when calling a custom op's implementation directly on ``tensors`` (the op's tensor
    arguments, None allowed; the first one is not None) does exactly what the op call does (the
    conditions of the module docstring), False when the call must go through the op. The
    conditions past the switch and ``is_compiling`` are read in one native call
    (``_native.eager_plain``, src/python/eager.rs: their one home, which
    ``_native.attn_fwd_fast`` shares)."""
    if not ENABLED or torch.compiler.is_compiling():   # first: torch.compile traces only this
        return False
    return _native.eager_plain(tensors, _DEVICE_TYPES)
