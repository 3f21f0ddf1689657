"""Handing torch tensors to the Rust extension: what every op of :mod:`ferroattn.ops` does the
same way before and around a ``ferroattn._native`` call.

- :func:`tensor_meta`: a tensor (real, fake or meta) as the ``TensorMeta`` tuple of ``_native.pyi``,
  for the metadata-only validations (``attn_fwd_check``, ``attn_bwd_check``) run by fake impls;
- :func:`tile_aligned`: a tensor the kernels can read in place (16-byte rows), else a copy;
- :func:`reject_forward_ad`: NotImplementedError when forward-mode AD tracks an input (neither op has
  a jvp formula, and torch would otherwise drop the tangent silently);
- :func:`launch`: detach the tensors (DLPack refuses tensors that require grad), switch to the
  tensor's CUDA device only when it is not the current one (torch exports CUDA tensors of the
  current device only), and call the native launcher with ``torch.cuda.current_stream(device)``
  (the capture stream while a CUDA graph is being captured); a ``BufferError`` from the export is
  first turned into the precise error of the Rust validation when there is one;
- :func:`workspace`: the split-k / stream-K workspace of a GEMM or 2:4 call (src/ops/workspace.rs):
  the call's native planner gives its size, torch allocates it (DESIGN §1: the caller allocates, so
  CUDA-graph capture and torch's memory accounting keep working).

Sources: torch 2.11 DLPack export rules and stream semantics (reference/api-contracts.md §2.2,
§2.3); DESIGN §2 (Python allocates, Rust validates and launches).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwad
from torch import Tensor

__all__ = ["as_int", "tensor_meta", "tile_aligned", "launch", "allocate_workspace", "reject_forward_ad"]

# DLPack device types used in TensorMeta (DLPack spec: kDLCPU = 1, kDLCUDA = 2).
_DL_CPU, _DL_CUDA = 1, 2


def as_int(v) -> int:
    """A Python int for a size or stride. A symbolic size (torch.SymInt under dynamic shapes) is
    read through its example value (hint), which adds no guard to the compiled graph."""
    if isinstance(v, int):
        return v
    node = getattr(v, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint)
    return int(v)


def tensor_meta(t: Optional[Tensor]):
    """``TensorMeta`` of ``_native.pyi`` for a tensor (real, fake or meta), or None for None:
    ``(shape, strides_in_elements, dtype_name, (dl_device_type, device_index))``.

    Device: CUDA -> (2, index), CPU -> (1, 0). A *meta* tensor is described as CUDA device 0:
    meta tensors exist for shape propagation (e.g. models built on the meta device), so they are
    validated as the CUDA tensors they stand for. Any other device type is described as CPU, so
    the Rust side rejects it as "not a CUDA tensor"."""
    if t is None:
        return None
    dev = t.device
    if dev.type == "cuda":
        device = (_DL_CUDA, dev.index if dev.index is not None else 0)
    elif dev.type == "meta":
        device = (_DL_CUDA, 0)
    else:
        device = (_DL_CPU, 0)
    shape = tuple(as_int(s) for s in t.shape)
    strides = tuple(as_int(s) for s in t.stride())
    dtype = str(t.dtype).removeprefix("torch.")
    return (shape, strides, dtype, device)


def reject_forward_ad(op: str, tensors) -> None:
    """Raise NotImplementedError when forward-mode AD (``torch.func.jvp`` / ``jacfwd``,
    ``torch.autograd.forward_ad`` dual tensors) tracks one of ``tensors`` ((name, tensor) pairs).

    Neither attention op has a forward-mode (jvp) formula, and torch's ``custom_op`` autograd
    wrapper does not raise for dual tensors that do not also require grad: it runs the op and
    *drops the tangent* (a silent zero / missing derivative). Costs one read of a module global
    when no dual level is active. Where the tangent cannot be inspected (a vmap inside a jvp),
    forward AD is rejected conservatively.

    Limitation: the check sees the tensors the caller holds; ``torch.ops.ferroattn.attn_fwd``
    called *directly* inside ``torch.func.jvp`` receives tensors already unwrapped by functorch,
    whose tangents are invisible here (the flash_attn functions check before the op)."""
    if _fwad._current_level < 0:
        return
    for name, t in tensors:
        if t is None:
            continue
        try:
            tangent = _fwad.unpack_dual(t).tangent
        except RuntimeError:  # e.g. a vmap-batched tensor inside a jvp: cannot tell, refuse
            tangent = t
        if tangent is not None:
            raise NotImplementedError(
                f"{name}: expected a tensor without a forward-mode AD tangent ({op} has no jvp formula; "
                f"use reverse mode: .backward() / torch.autograd.grad), got a dual tensor "
                f"(torch.func.jvp / jacfwd / torch.autograd.forward_ad)")


def tile_aligned(t: Tensor) -> Tensor:
    """``t``, or a contiguous copy when the kernels cannot read it in place: they move rows in
    16-byte copies, so the data pointer and every used stride (dims of size > 1, last dim
    excepted) must be multiples of 16 bytes; e.g. ``qkv[..., 1:65]`` is copied. Tensors whose
    last dim is not contiguous are returned as they are (the Rust validation names the error)."""
    if t.is_contiguous() and t.dim() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0:
        return t  # the common case, decided first and without a walk over the strides
    if t.dim() == 0 or t.numel() == 0 or t.stride(-1) != 1:
        return t  # empty: nothing is read; stride(-1) != 1: the Rust validation names the error
    elem = t.element_size()
    if t.data_ptr() % 16 == 0 and all(
            (st * elem) % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)  # a copy even when t is contiguous


def launch(native_fn: Callable[..., None], device: torch.device, tensors: Sequence[Optional[Tensor]],
           scalars: Sequence, on_buffer_error: Callable[[], None]):
    """``native_fn(*detached tensors, *scalars, stream)`` on ``device``'s current stream; returns
    what ``native_fn`` returns.

    Args:
        native_fn: a ``ferroattn._native`` launcher whose last parameter is the raw stream.
        device: the device of the call (q's); for CUDA the call runs with that device current
            (switched only when it is not) and ``stream`` is the raw handle of
            ``torch.cuda.current_stream(device)`` (0 = legacy default stream); for any other
            device ``stream`` is 0 and the Rust validation rejects the tensors.
        tensors: the tensor arguments in the launcher's order (None allowed); those that
            require grad are detached here.
        scalars: the arguments between the tensors and ``stream``.
        on_buffer_error: called when torch refuses a DLPack export (a tensor on another CUDA
            device than ``device``): it should raise the Rust validation's precise error (e.g.
            DeviceError naming the argument); if it returns, the BufferError propagates.
    """
    # DLPack refuses tensors that require grad; detaching the others would only cost host time
    args = [t.detach() if t is not None and t.requires_grad else t for t in tensors]
    try:
        if device.type == "cuda":
            # torch exports CUDA tensors of the current device only: switch only when needed
            current = torch.cuda.current_device()
            index = current if device.index is None else device.index
            with torch.cuda.device(index) if index != current else contextlib.nullcontext():
                # the raw handle of torch.cuda.current_stream(index) without building a Stream
                # object (the capture stream while a CUDA graph is being captured)
                return native_fn(*args, *scalars, torch._C._cuda_getCurrentRawStream(index))
        return native_fn(*args, *scalars, 0)
    except BufferError:
        on_buffer_error()
        raise


def allocate_workspace(nbytes: int, device: int) -> Tensor:
    """The split-k / stream-K workspace a GEMM or 2:4 launch asks for once its plan knows the bytes
    (``_native.gemm`` / ``_native.sparse24_matmul`` take this function as their ``workspace``
    argument and call it, in the same native call; src/ops/workspace.rs holds the size rule): a
    ``torch.uint8`` tensor of ``nbytes`` on CUDA device ``device`` from torch's caching allocator
    on the current stream, the stream the launch runs on -- freed when the launch returns and reused
    in stream order; under CUDA-graph capture a block of the graph's private pool, the same memory
    on every replay."""
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))

