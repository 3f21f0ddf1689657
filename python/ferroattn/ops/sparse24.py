"""2:4 structured-sparse custom ops: ``torch.ops.ferroattn.sparse24_linear`` and
``torch.ops.ferroattn.sparse24_decompress``, plus the one place the 2:4 ``ferroattn._native``
launchers are called from (compress included).

What lives here is what only Python can do (DESIGN §2): allocate outputs and wgmma_sp's split-k /
stream-K workspace with torch (the launch asks for it with its own plan's bytes, in the same native
call: ``_to_native.allocate_workspace``; a captured CUDA graph replays with the same memory), pick
the current stream, detach, call
``ferroattn._native.sparse24_*`` (which validate and launch), and the torch.library registrations:

- ``sparse24_linear(x, values, meta, bias, n, k, activation, backend)``: ``act(x @ w.T + bias)``
  with ``w`` (n, k) the 2:4 matrix held as ``values``/``meta`` (torch.nn.functional.linear
  semantics; x already flattened to (rows, k) by :func:`ferroattn.sparse24.matmul`).
  ``register_fake`` runs the Rust validation on metadata (``_native.sparse24_matmul_check``) and
  returns ``(rows, n)`` in x's dtype, contiguous. ``register_autograd``: gradients for ``x``
  (``dx = dpre @ w``, ``w`` decompressed by the second op, ``dpre = dout · act'(pre)`` with the
  pre-activation recomputed by one more forward call when there is an activation) and for
  ``bias`` (``dpre`` summed over rows). **The sparse weight is frozen**: a ``values``/``meta``
  that requires grad makes the backward raise NotImplementedError (pruning patterns do not
  survive a dense weight update; train dense, then compress). FLOPs are counted dense:
  ``2 · rows · n · k`` (DESIGN §5, the convention cuSPARSELt benchmarks use too).
- ``sparse24_decompress(values, meta, m, k)``: the dense (m, k) matrix; CUDA tensors run the GPU
  kernel, CPU tensors the Rust host reference (``sparse24_decompress_host``).
- :func:`linear`: what :func:`ferroattn.sparse24.matmul` calls: ``sparse24_linear``, or in a plain
  eager call (:func:`ferroattn.ops._eager.plain_eager`) the op's implementation directly.

Sources: NVIDIA Ampere whitepaper (2020) and PTX ISA ``mma.sp`` for the 2:4 format (at most 2
non-zeros per aligned group of 4 along k); torch 2.11 ``torch.library`` docs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from ..errors import ArgumentError, DTypeError
from ._eager import plain_eager as _plain_eager
from ._to_native import as_int as _as_int
from ._to_native import launch as _launch
from ._to_native import reject_forward_ad as _reject_forward_ad
from ._to_native import tensor_meta
from ._to_native import allocate_workspace as _allocate_workspace
from .activation import NATIVE, activation_backward

__all__ = ["sparse24_linear", "linear", "sparse24_decompress", "run_compress", "run_decompress", "check_compressed",
           "sparse24_linear_flops", "NATIVE_ACTIVATIONS", "KERNEL_BACKENDS"]

#: activation names of the native launcher (:data:`ferroattn.ops.activation.NATIVE`)
NATIVE_ACTIVATIONS = NATIVE
#: backend names of ``_native.sparse24_matmul``
KERNEL_BACKENDS = ("auto", "mma_sp", "wgmma_sp")


def check_compressed(values: Tensor, meta: Tensor, m: int, k: int) -> None:
    """Check that ``values`` / ``meta`` can hold an (m, k) 2:4 matrix (metadata only, no data read): values
    fp16 / bf16 of ``_native.sparse24_layout(m, k)["values_shape"]``, meta int16 of its "meta_shape".

    Raises:
        ArgumentError: m or k < 0, or a shape that does not match the layout.
        DTypeError: values not fp16 / bf16, or meta not int16."""
    if m < 0 or k < 0:
        raise ArgumentError(f"shape: expected (m, k) with m, k >= 0, got {(m, k)}")
    if values.dtype not in (torch.float16, torch.bfloat16):
        raise DTypeError(f"values: expected dtype torch.float16 or torch.bfloat16, got {values.dtype}")
    if meta.dtype != torch.int16:
        raise DTypeError(f"meta: expected dtype torch.int16, got {meta.dtype}")
    lay = _native.sparse24_layout(int(m), int(k))
    if tuple(values.shape) != tuple(lay["values_shape"]):
        raise ArgumentError(f"values: expected shape {tuple(lay['values_shape'])} for a {(m, k)} matrix, "
                            f"got {tuple(values.shape)}")
    if tuple(meta.shape) != tuple(lay["meta_shape"]):
        raise ArgumentError(f"meta: expected shape {tuple(lay['meta_shape'])} for a {(m, k)} matrix, "
                            f"got {tuple(meta.shape)}")


def _check_meta(x, values, meta, out, bias, n, k, activation) -> None:
    """``_native.sparse24_matmul_check`` on metadata: the Rust validation, no data touched."""
    _native.sparse24_matmul_check(tensor_meta(x), tensor_meta(values), tensor_meta(meta), tensor_meta(out),
                                  tensor_meta(bias), _as_int(n), _as_int(k), activation)


# ---------------------------------------------------------------------------------------------
# compress / decompress (not ops: compress has a data-dependent result, bad_groups)
# ---------------------------------------------------------------------------------------------
def run_compress(w: Tensor, values: Tensor, meta: Tensor, prune: bool) -> Optional[Tensor]:
    """Compress ``w`` (m, k) into the preallocated ``values`` / ``meta``.

    CPU: the Rust host reference ``sparse24_compress_host`` (w made contiguous first); returns the
    number of groups with more than 2 non-zeros as a 0-d int64 CPU tensor. CUDA: the GPU kernel
    ``sparse24_compress`` on the current stream; returns the int32 (1,) CUDA tensor it writes
    bad_groups into (not read here: reading it synchronises). Errors: the Rust validation's."""
    if w.device.type == "cuda":
        bad = torch.empty(1, dtype=torch.int32, device=w.device)
        _launch(_native.sparse24_compress, w.device, (w, values, meta, bad), (bool(prune),), lambda: None)
        return bad
    w = w.detach()
    if w.device.type == "cpu" and w.dim() == 2 and w.stride(-1) != 1:
        w = w.contiguous()
    return torch.tensor(int(_native.sparse24_compress_host(w, values, meta, bool(prune))))


def run_decompress(values: Tensor, meta: Tensor, out: Tensor) -> None:
    """Write the dense matrix held by ``values`` / ``meta`` into ``out`` (m, k): the GPU kernel
    for CUDA tensors (current stream), the Rust host reference otherwise."""
    if values.device.type == "cuda":
        _launch(_native.sparse24_decompress, values.device, (values, meta, out), (), lambda: None)
    else:
        _native.sparse24_decompress_host(values.detach(), meta.detach(), out)


@torch.library.custom_op("ferroattn::sparse24_decompress", mutates_args=())
def sparse24_decompress(values: Tensor, meta: Tensor, m: int, k: int) -> Tensor:
    """The dense (m, k) matrix (values' dtype, contiguous) held by ``values`` (m_pad, k_pad / 2)
    and ``meta`` (int16, ``_native.sparse24_layout(m, k)["meta_shape"]``); bitwise the matrix
    that was compressed when it was 2:4. Raises the Rust validation's errors for malformed
    shapes/dtypes (ArgumentError / DTypeError / DeviceError)."""
    out = torch.empty((m, k), dtype=values.dtype, device=values.device)
    run_decompress(values, meta, out)
    return out


@sparse24_decompress.register_fake
def _sparse24_decompress_fake(values, meta, m, k):
    # what the Rust validation of the real call checks, so a traced / compiled call fails where the
    # eager one would (shapes, dtypes, contiguity), not only when it runs
    check_compressed(values, meta, m, k)
    for name, t in (("values", values), ("meta", meta)):
        if not t.is_contiguous():
            raise ArgumentError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    return values.new_empty((m, k))


# ---------------------------------------------------------------------------------------------
# the matmul op
# ---------------------------------------------------------------------------------------------
def _sparse24_linear_impl(x: Tensor, values: Tensor, meta: Tensor, bias: Optional[Tensor], n: int, k: int,
                          activation: str, backend: str) -> Tensor:
    """``act(x @ w.T + bias)``, x (rows, k) fp16/bf16 with stride(-1) == 1, w (n, k) the 2:4 matrix
    in ``values``/``meta``; bias None or (n,) of x's dtype or float32; activation one of
    :data:`NATIVE_ACTIVATIONS`; backend one of :data:`KERNEL_BACKENDS`. Returns (rows, n) of x's
    dtype, contiguous. Raises the Rust validation's errors (ArgumentError naming the argument,
    DTypeError, DeviceError), CUDA/NVRTC errors; NotImplementedError for forward-mode AD."""
    _reject_forward_ad("ferroattn::sparse24_linear", (("x", x), ("bias", bias)))
    rows = x.shape[0] if x.dim() == 2 else 0
    out = x.new_empty((rows, n))   # x's dtype and device; ~1.5 µs cheaper than torch.empty(dtype=, device=)
    if x.dim() != 2:
        _check_meta(x, values, meta, out, bias, n, k, activation)  # names the rank error
    if bias is not None and bias.dim() == 1 and bias.stride(0) != 1:
        bias = bias.contiguous()
    tensors, scalars = (x, values, meta, out, bias), (n, k, activation, backend)

    def check():
        _check_meta(x, values, meta, out, bias, n, k, activation)

    # wgmma_sp's split-k / stream-K workspace (if the call's plan has one), allocated by torch from
    # the launch itself once it has planned (allocate_workspace)
    _launch(_native.sparse24_matmul, x.device, tensors, (*scalars, _allocate_workspace), check)
    return out


sparse24_linear = torch.library.custom_op("ferroattn::sparse24_linear", mutates_args=())(_sparse24_linear_impl)


def linear(x: Tensor, values: Tensor, meta: Tensor, bias: Optional[Tensor], n: int, k: int, activation: str,
           backend: str) -> Tensor:
    """``sparse24_linear`` as :func:`ferroattn.sparse24.matmul` calls it: through the op (the
    dispatcher) whenever anything may watch or transform the call (autograd, torch.compile, a
    torch function/dispatch mode, the profiler, functorch, jit tracing, tensor subclasses), else
    -- a plain eager call on CUDA tensors -- through the op's implementation directly, which skips
    ~20-30 µs of dispatcher and autograd-wrapper host time per call
    (:func:`ferroattn.ops._eager.plain_eager` lists the conditions). Both routes run the same
    code, raise the same errors and return the same tensor."""
    if _plain_eager((x, values, meta, bias)):
        return _sparse24_linear_impl(x, values, meta, bias, n, k, activation, backend)
    return sparse24_linear(x, values, meta, bias, n, k, activation, backend)


@sparse24_linear.register_fake
def _sparse24_linear_fake(x, values, meta, bias, n, k, activation, backend):
    _reject_forward_ad("ferroattn::sparse24_linear", (("x", x), ("bias", bias)))
    out = x.new_empty((x.shape[0] if x.dim() == 2 else 0, n))
    _check_meta(x, values, meta, out, bias, n, k, activation)
    return out


def _setup_context(ctx, inputs, output) -> None:
    x, values, meta, bias, n, k, activation, backend = inputs
    ctx.save_for_backward(x, values, meta, bias)
    ctx.n, ctx.k, ctx.activation, ctx.backend = n, k, activation, backend


def _backward(ctx, dout):
    x, values, meta, bias = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[1] or need[2]:
        raise NotImplementedError(
            "values/meta: the 2:4 weight of ferroattn::sparse24_linear is frozen (no gradient through the "
            "compressed weight: a dense update would break the 2:4 pattern); got values or meta that require "
            "grad. Train the dense nn.Linear and compress afterwards, or call .requires_grad_(False) on them.")
    _reject_forward_ad("ferroattn::sparse24_linear", (("dout", dout),))
    dpre = dout
    if ctx.activation != "none":
        pre = torch.ops.ferroattn.sparse24_linear(x, values, meta, bias, ctx.n, ctx.k, "none", ctx.backend)
        dpre = activation_backward(dout, pre, ctx.activation)
    dx = dbias = None
    if need[0]:
        w = torch.ops.ferroattn.sparse24_decompress(values, meta, ctx.n, ctx.k)
        dx = torch.matmul(dpre, w)
    if bias is not None and need[3]:
        dbias = dpre.sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, None, None, dbias, None, None, None, None


sparse24_linear.register_autograd(_backward, setup_context=_setup_context)


def sparse24_linear_flops(x, values, meta, bias, n, k, activation, backend, *args, out_val=None, **kwargs) -> int:
    """Dense FLOPs of one call: ``2 · rows · n · k`` (the zeros of the 2:4 weight are counted, as
    cuSPARSELt and DESIGN §5 count them, so sparse and dense TFLOP/s compare as speed)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return 2 * rows * n * k


register_flop_formula(torch.ops.ferroattn.sparse24_linear, get_raw=True)(sparse24_linear_flops)
