"""``torch.ops.ferroattn.gemm`` and ``torch.ops.ferroattn.gemm_out``: the dense GEMM custom ops.

::

    out = act(alpha · a @ b + beta · c + bias)          (fp32 accumulation and epilogue,
                                                         rounded once to out's dtype)

the cuBLASLt epilogue order (scale, add C, add bias, activate), run by
``ferroattn._native.gemm`` (kernels/gemm/wmma.cuh on sm_80+, kernels/gemm/sm90.cuh on sm_90a).
What lives here is what only Python can do (DESIGN §2): flatten the leading dims of ``a`` into
one batch dim, express broadcasting as batch stride 0, allocate the outputs, pick the current
stream, handle the degenerate sizes the kernels do not take (m, n, k or batch = 0), plus the
torch.library registrations:

- the real implementation for *every* device type, so a CPU tensor reaches the Rust validation
  and gets a clear :class:`~ferroattn.errors.DeviceError`;
- ``register_fake``: the Rust validation on metadata (``_native.gemm_check``), then outputs of the
  exact shapes, dtypes and strides; ``torch.compile(fullgraph=True)`` traces without a graph
  break and bad inputs fail at trace time;
- ``register_autograd`` (``gemm``): ``dpre = act'(pre) · dout`` (torch's own activation
  backwards on the saved pre-activation, the ``aux`` output), then ``da = alpha · dpre @ bᵀ`` and
  ``db = alpha · aᵀ @ dpre`` through this op again with *transposed views* of the saved operands
  (no copies: the kernels read NT/TN layouts by their strides), ``dbias = Σ_rows dpre``,
  ``dc = beta · dpre``;
- FLOP formula ``2 · batch · m · n · k`` for ``torch.utils.flop_counter.FlopCounterMode``.

Shapes (one call): ``a`` (..., m, k) whose leading dims flatten to ``batch_a``; ``b`` (k, n) or
(batch_b, k, n); ``batch_a`` and ``batch_b`` equal or one of them 1 (broadcast, batch stride 0);
``batch = max(batch_a, batch_b)``. ``out``'s leading dims: those of ``torch.matmul`` (a's leading
dims broadcast with (batch_b,)) when that broadcast exists and holds ``batch`` entries, else a's
(e.g. a (2, 3, m, k) with b (6, k, n) gives (2, 3, m, n)); then (m, n).
``c``: (..., m, n) whose leading dims flatten to ``batch`` or 1. Operands without a unit stride in
their last two dims (e.g. ``x[:, ::2]`` of a (k, n) matrix) are copied with ``.contiguous()``;
so are leading dims that cannot be flattened into one batch stride (``reshape`` semantics). Any
alignment is read in place.

Degenerate sizes (never reach a kernel): m, n or batch = 0 give an empty output; k = 0 gives
``act(beta · c + bias)`` (zeros without c and bias, as ``torch.matmul`` gives zeros), computed
with torch in fp32. Their arguments are still validated by the Rust check, on the same
layouts with every 0 size replaced by 1.

CUDA-graph safety: the launch uses ``torch.cuda.current_stream(a.device)`` (the capture stream
while capturing), outputs and the split-k / stream-K workspace come from torch's caching allocator
(the launch asks for the workspace with the bytes of its own plan, in the same native call:
``_to_native.allocate_workspace``; its counters are zeroed on the stream by the launch: a memset
node of a captured graph), nothing synchronises.

Sources: cuBLASLt epilogue order (CUBLASLT_EPILOGUE_BIAS / GELU_AUX: the pre-activation "aux"
output kept for the backward, cuBLASLt docs §"cublasLtEpilogue_t"); matrix calculus of
``Y = A B``: dA = dY Bᵀ, dB = Aᵀ dY (e.g. Goodfellow et al., Deep Learning, §6.5.6); torch 2.11
``torch.library`` docs; activation backwards ``aten::gelu_backward`` / ``aten::silu_backward`` /
``aten::threshold_backward``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from ..errors import ArgumentError, DTypeError
from ._to_native import allocate_workspace, launch, reject_forward_ad, tensor_meta
from .activation import NATIVE, activate, activation_backward, public_activation

__all__ = ["gemm", "gemm_out", "run_gemm", "gemm_into", "plan", "GemmPlan", "gemm_flops", "public_activation",
           "activate", "ACTIVATIONS", "BACKENDS", "OUT_DTYPES", "check_args", "check_scalar", "check_backend",
           "check_out_dtype"]

#: Activation names of ``_native.gemm`` (:data:`ferroattn.ops.activation.NATIVE`).
ACTIVATIONS = NATIVE
#: Backend names accepted by ``_native.gemm`` ("auto": the fastest supported for the problem).
BACKENDS = ("auto", "wmma", "sm90")
#: Output dtypes the kernels write.
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: The smallest magnitude that rounds to inf in fp32 (fp32 max + half an ulp): alpha/beta are
#: handed to the kernels as fp32.
_F32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127


# ---------------------------------------------------------------------------------------------
# argument checks that only Python can make (the Rust validation checks the tensors)
# ---------------------------------------------------------------------------------------------
def check_scalar(name: str, value) -> None:
    """``alpha`` / ``beta`` must be real numbers finite in fp32 (the kernels take fp32): nan, ±inf
    and 1e300 raise :class:`~ferroattn.errors.ArgumentError`. A symbolic value is not read."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, (torch.SymFloat, torch.SymInt)):
            return
        raise ArgumentError(f"{name}: expected a real number (float), got {type(value).__name__} {value!r}")
    if not abs(value) < _F32_OVERFLOW:  # also true for nan
        raise ArgumentError(f"{name}: expected a real number finite in float32, got {value!r}")


def check_backend(backend: str) -> None:
    """``backend`` must be one of :data:`BACKENDS` (ArgumentError otherwise). Whether the chosen
    backend can run a given problem on a given GPU is decided at launch by the Rust dispatcher
    (ArgumentError naming ``backend`` and the reason)."""
    if backend not in BACKENDS:
        raise ArgumentError(f"backend: expected one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")


def check_out_dtype(out_dtype: Optional[torch.dtype]) -> None:
    """``out_dtype`` must be None or one of :data:`OUT_DTYPES` (DTypeError otherwise)."""
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise DTypeError(f"out_dtype: expected torch.float16, torch.bfloat16, torch.float32 or None "
                         f"(a's dtype), got {out_dtype}")


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation: expected one of {', '.join(repr(a) for a in ACTIVATIONS)}, "
                            f"got {activation!r}")


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------
class GemmPlan(NamedTuple):
    """The problem one call describes: ``batch`` products of (m, k) @ (k, n); ``batch_a`` /
    ``batch_b`` are the operands' own batch counts (1 = broadcast); ``out_shape`` the shape of
    the returned tensor."""
    batch: int
    m: int
    n: int
    k: int
    batch_a: int
    batch_b: int
    out_shape: Tuple[int, ...]


def plan(a: Tensor, b: Tensor) -> GemmPlan:
    """:class:`GemmPlan` of ``a @ b`` under this module's broadcasting rules. Raises
    :class:`~ferroattn.errors.ArgumentError` for ranks, inner dims ``k`` (``a.shape[-1] !=
    b.shape[-2]``, naming ``b`` with both k) and batch counts that do not fit. Works on fake and
    meta tensors."""
    if a.dim() < 2:
        raise ArgumentError(f"a: expected rank >= 2 (..., m, k), got rank {a.dim()} (shape {tuple(a.shape)})")
    if b.dim() not in (2, 3):
        raise ArgumentError(f"b: expected rank 2 (k, n) or 3 (batch, k, n), got rank {b.dim()} "
                            f"(shape {tuple(b.shape)})")
    lead = tuple(a.shape[:-2])  # sizes stay symbolic under torch.compile(dynamic=True)
    batch_a = math.prod(lead)
    batch_b = b.shape[0] if b.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    if b.shape[-2] != k:  # on the real shapes, before any 0 size is substituted for validation
        raise ArgumentError(f"b: expected shape (..., k, n) with k = a.shape[-1] = {k} (a's shape "
                            f"{tuple(a.shape)}), got k = {b.shape[-2]} (shape {tuple(b.shape)})")
    if batch_a == batch_b or batch_b == 1:
        batch = batch_a
    elif batch_a == 1:
        batch = batch_b
    else:
        raise ArgumentError(f"b: expected a batch of {batch_a} (a's leading dims {lead} flattened) or 1, "
                            f"got {batch_b} (shape {tuple(b.shape)})")
    out_lead = lead
    if b.dim() == 3:  # torch.matmul's leading dims where they describe the same batch, else a's
        try:
            bc = tuple(torch.broadcast_shapes(lead, (batch_b,)))
        except RuntimeError:
            bc = None
        if bc is not None and math.prod(bc) == batch:
            out_lead = bc
    return GemmPlan(batch, m, n, k, batch_a, batch_b, out_lead + (m, n))


def _unit_stride(t: Tensor) -> Tensor:
    """``t`` when one of its last two dims has stride 1 (or size 1: its stride does not matter),
    else ``t.contiguous()``: the kernels read row- and column-major matrices in place, not fully
    strided ones."""
    r, c = t.shape[-2], t.shape[-1]
    if c == 1 or r == 1 or t.stride(-1) == 1 or t.stride(-2) == 1:
        return t
    return t.contiguous()


def _operands(a: Tensor, b: Tensor, c: Optional[Tensor], bias: Optional[Tensor], beta: float,
              p: GemmPlan) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The (batch, ·, ·) views handed to the kernels: a broadcast operand gets batch stride 0
    (``expand``), never a copy; ``c`` is dropped when ``beta == 0`` (never read, as cuBLAS)."""
    a3 = _batched(_unit_stride(a.reshape(p.batch_a, p.m, p.k)), p.batch)
    b3 = _batched(_unit_stride(b if b.dim() == 3 else b.unsqueeze(0)), p.batch)  # b's k: checked by plan
    c3 = None
    if beta != 0.0:
        if c is None:
            raise ArgumentError(f"c: expected a tensor (..., m, n) when beta != 0 (got beta={beta!r}), got None")
        c3 = _c_view(c, p)
    if bias is not None and bias.dim() == 1 and bias.shape[0] > 1 and bias.stride(0) != 1:
        bias = bias.contiguous()
    return a3, b3, c3, bias


def _batched(t: Tensor, batch) -> Tensor:
    """``t`` (1 or batch, ·, ·) as (batch, ·, ·): an ``expand`` (batch stride 0) when broadcast."""
    return t if t.shape[0] == batch else t.expand(batch, -1, -1)


def _c_batch(c: Tensor, p: GemmPlan) -> int:
    """``c``'s own batch count (its leading dims flattened): ``p.batch`` or 1."""
    if c.dim() < 2 or c.shape[-2] != p.m or c.shape[-1] != p.n:
        raise ArgumentError(f"c: expected shape (..., {p.m}, {p.n}) (out's shape {p.out_shape}), "
                            f"got {tuple(c.shape)}")
    cb = math.prod(c.shape[:-2])
    if cb not in (1, p.batch):
        raise ArgumentError(f"c: expected leading dims that flatten to {p.batch} or 1 (out's shape "
                            f"{p.out_shape}), got shape {tuple(c.shape)}")
    return cb


def _c_view(c: Tensor, p: GemmPlan) -> Tensor:
    c3 = c.reshape(_c_batch(c, p), p.m, p.n)
    if p.n > 1 and p.m > 0 and c3.stride(-1) != 1:
        c3 = c3.contiguous()  # the epilogue reads rows of c
    return _batched(c3, p.batch)


def _substitute_empty(meta):
    """A ``TensorMeta`` with every 0 size replaced by 1 (strides kept): the degenerate problems
    are validated as the smallest non-empty problem of the same layout."""
    if meta is None:
        return None
    shape, strides, dtype, device = meta
    return (tuple(max(s, 1) for s in shape), strides, dtype, device)


def _check_meta(a3, b3, out3, c3, bias, aux3, beta: float, activation: str, empty: bool) -> None:
    """``_native.gemm_check`` on metadata (fake/meta tensors too): the Rust validation."""
    metas = [tensor_meta(t) for t in (a3, b3, out3, c3, bias, aux3)]
    if empty:
        metas = [_substitute_empty(m) for m in metas]
    _native.gemm_check(*metas, float(beta), activation)


def _epilogue_only(out3: Tensor, aux3: Optional[Tensor], c3: Optional[Tensor], bias: Optional[Tensor],
                   beta: float, activation: str) -> None:
    """k == 0: ``a @ b`` is 0, so ``out = act(beta·c + bias)`` (fp32, then rounded once)."""
    pre = torch.zeros(out3.shape, dtype=torch.float32, device=out3.device)
    if c3 is not None:
        pre = pre + beta * c3.float()
    if bias is not None:
        pre = pre + bias.float()
    if aux3 is not None:
        aux3.copy_(pre)
    out3.copy_(activate(pre, activation))


def _usable_out(out: Tensor, p: GemmPlan) -> Optional[Tensor]:
    """``out`` as the (batch, m, n) view the kernels write (stride(-1) == 1, batch stride != 0
    unless batch == 1), or None when no such view exists (then the caller writes a temporary and
    copies)."""
    try:
        out3 = out.view(p.batch, p.m, p.n)
    except RuntimeError:
        return None
    if p.n > 1 and p.m > 0 and out3.stride(-1) != 1:
        return None
    if p.batch > 1 and p.m * p.n > 0 and out3.stride(0) == 0:
        return None
    return out3


# ---------------------------------------------------------------------------------------------
# the launch
# ---------------------------------------------------------------------------------------------
def gemm_into(a: Tensor, b: Tensor, out3: Tensor, c: Optional[Tensor], bias: Optional[Tensor],
              aux3: Optional[Tensor], alpha: float, beta: float, activation: str, backend: str,
              p: Optional[GemmPlan] = None) -> Optional[str]:
    """Compute ``out3 = act(alpha·a@b + beta·c + bias)`` into the (batch, m, n) tensor ``out3``
    (and the pre-activation into ``aux3`` when given). Returns the backend that ran ("wmma",
    "sm90"), or None for a degenerate problem (no kernel). Raises what the Rust validation
    raises, plus the ArgumentErrors of :func:`plan`."""
    p = p or plan(a, b)
    a3, b3, c3, bias = _operands(a, b, c, bias, beta, p)
    if p.batch == 0 or p.m == 0 or p.n == 0 or p.k == 0:
        _check_meta(a3, b3, out3, c3, bias, aux3, beta, activation, empty=True)
        if p.k == 0 and out3.numel():
            _epilogue_only(out3, aux3, c3, bias, beta, activation)
        return None
    tensors = (a3, b3, out3, c3, bias, aux3)
    scalars = (float(alpha), float(beta), activation, backend)

    def check():
        _check_meta(a3, b3, out3, c3, bias, aux3, beta, activation, empty=False)

    # A BufferError (a tensor on another GPU) becomes the Rust validation's error naming it. The
    # split-k / stream-K workspace (if the call's plan has one) is allocated by torch, from the
    # launch itself once it has planned (allocate_workspace).
    return launch(_native.gemm, a.device, tensors, (*scalars, allocate_workspace), check)


def check_args(alpha, beta, activation: str, backend: str, out_dtype=None) -> None:
    """The checks of the non-tensor arguments (:func:`check_scalar`, activation name,
    :func:`check_backend`, :func:`check_out_dtype`)."""
    check_scalar("alpha", alpha)
    check_scalar("beta", beta)
    _check_activation(activation)
    check_backend(backend)
    check_out_dtype(out_dtype)


def _gemm_impl(a: Tensor, b: Tensor, bias: Optional[Tensor], c: Optional[Tensor], alpha: float, beta: float,
               activation: str, out_dtype: Optional[torch.dtype], backend: str,
               with_aux: bool) -> Tuple[Tensor, Tensor]:
    """``out = act(alpha · a @ b + beta · c + bias)``.

    Args:
        a: (..., m, k) fp16 or bf16, CUDA; any strides (see the module docstring).
        b: (k, n) or (batch_b, k, n), a's dtype and device.
        bias: None or (n,), a's dtype or fp32.
        c: None or (..., m, n) of out's dtype, leading dims flattening to batch or 1; read only
            when ``beta != 0`` (then required).
        alpha, beta: finite fp32 scalars.
        activation: "none" | "relu" | "gelu_tanh" | "gelu_erf" | "silu".
        out_dtype: None (a's dtype), torch.float16, torch.bfloat16 or torch.float32.
        backend: "auto" | "wmma" | "sm90".
        with_aux: also return the pre-activation ``alpha·a@b + beta·c + bias`` (for the backward
            of the activation), when ``activation != "none"``.

    Returns:
        out: (out_shape) contiguous, ``out_dtype``.
        aux: the pre-activation (out's shape and dtype, contiguous) when ``with_aux`` and
            ``activation != "none"``, else an empty (0,) tensor of out's dtype.

    Raises: ArgumentError / DTypeError / DeviceError from :func:`plan`, the Python argument checks
    and the Rust validation (naming the argument); ArgumentError naming ``backend`` when an
    explicit backend cannot run the problem; NotImplementedError under forward-mode AD.
    """
    reject_forward_ad("ferroattn::gemm", (("a", a), ("b", b), ("bias", bias), ("c", c)))
    out, aux = run_gemm(a, b, bias, c, alpha, beta, activation, out_dtype, backend, with_aux)
    return out, aux if aux is not None else torch.empty(0, dtype=out.dtype, device=out.device)


def run_gemm(a: Tensor, b: Tensor, bias: Optional[Tensor], c: Optional[Tensor], alpha: float, beta: float,
             activation: str, out_dtype: Optional[torch.dtype], backend: str,
             with_aux: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """The op's computation (arguments as ``torch.ops.ferroattn.gemm``) with ``aux`` None when not
    requested: what :func:`ferroattn.matmul` calls directly in a plain eager call (no dispatcher,
    no autograd, no empty aux allocation)."""
    check_args(alpha, beta, activation, backend, out_dtype)
    p = plan(a, b)
    dt = out_dtype or a.dtype
    out3 = torch.empty((p.batch, p.m, p.n), dtype=dt, device=a.device)
    aux3 = torch.empty_like(out3) if with_aux and activation != "none" else None
    gemm_into(a, b, out3, c, bias, aux3, alpha, beta, activation, backend, p)
    shape = tuple(p.out_shape)
    if tuple(out3.shape) != shape:
        out3 = out3.view(shape)
        aux3 = None if aux3 is None else aux3.view(shape)
    return out3, aux3


gemm = torch.library.custom_op("ferroattn::gemm", mutates_args=())(_gemm_impl)


@gemm.register_fake
def _gemm_fake(a, b, bias, c, alpha, beta, activation, out_dtype, backend, with_aux):
    reject_forward_ad("ferroattn::gemm", (("a", a), ("b", b), ("bias", bias), ("c", c)))
    check_args(alpha, beta, activation, backend, out_dtype)
    p = plan(a, b)
    dt = out_dtype or a.dtype
    out = a.new_empty(p.out_shape, dtype=dt)
    aux = a.new_empty(p.out_shape if with_aux and activation != "none" else (0,), dtype=dt)
    a3, b3, c3, bias = _operands(a, b, c, bias, beta, p)
    empty = p.batch == 0 or p.m == 0 or p.n == 0 or p.k == 0
    _check_meta(a3, b3, out.view(p.batch, p.m, p.n), c3, bias,
                aux.view(p.batch, p.m, p.n) if aux.dim() > 1 else None, beta, activation, empty)
    return out, aux


def _gemm_out_impl(a: Tensor, b: Tensor, out: Tensor, bias: Optional[Tensor], c: Optional[Tensor], alpha: float,
                   beta: float, activation: str, backend: str) -> None:
    """``out[...] = act(alpha · a @ b + beta · c + bias)`` into a preallocated ``out`` (the
    ``out=`` form of :func:`ferroattn.matmul`): arguments as :func:`_gemm_impl`; ``out`` must have
    the result's shape (:func:`plan`) and one of the output dtypes, any strides (written in place
    when it has a (batch, m, n) view with stride(-1) == 1, else through a temporary and
    ``copy_``). ``out`` must not overlap an input (the Rust validation names it)."""
    reject_forward_ad("ferroattn::gemm_out", (("a", a), ("b", b), ("bias", bias), ("c", c)))
    check_args(alpha, beta, activation, backend)
    p = plan(a, b)
    _check_out(out, p)
    out3 = _usable_out(out, p)
    if out3 is not None:
        gemm_into(a, b, out3, c, bias, None, alpha, beta, activation, backend, p)
        return
    tmp = torch.empty((p.batch, p.m, p.n), dtype=out.dtype, device=out.device)
    gemm_into(a, b, tmp, c, bias, None, alpha, beta, activation, backend, p)
    out.copy_(tmp.view(p.out_shape))


def _check_out(out: Tensor, p: GemmPlan) -> None:
    if tuple(out.shape) != tuple(p.out_shape):
        raise ArgumentError(f"out: expected shape {p.out_shape}, got {tuple(out.shape)}")
    if out.dtype not in OUT_DTYPES:
        raise DTypeError(f"out: expected dtype torch.float16, torch.bfloat16 or torch.float32, got {out.dtype}")


gemm_out = torch.library.custom_op("ferroattn::gemm_out", mutates_args=("out",))(_gemm_out_impl)


@gemm_out.register_fake
def _gemm_out_fake(a, b, out, bias, c, alpha, beta, activation, backend):
    reject_forward_ad("ferroattn::gemm_out", (("a", a), ("b", b), ("bias", bias), ("c", c)))
    check_args(alpha, beta, activation, backend)
    p = plan(a, b)
    _check_out(out, p)
    out3 = _usable_out(out, p)
    if out3 is None:
        out3 = out.new_empty((p.batch, p.m, p.n))
    a3, b3, c3, bias = _operands(a, b, c, bias, beta, p)
    _check_meta(a3, b3, out3, c3, bias, None, beta, activation,
                p.batch == 0 or p.m == 0 or p.n == 0 or p.k == 0)
    return None


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    """Saves a and b (for da / db), the pre-activation ``aux`` (for the activation's derivative;
    when the caller did not ask for it, the backward recomputes it with one more GEMM), and the
    metadata of bias and c (their gradients need no values)."""
    a, b, bias, c, alpha, beta, activation, out_dtype, backend, with_aux = inputs
    out, aux = output
    ctx.save_for_backward(a, b, aux if aux.dim() > 1 else None, bias if activation != "none" else None,
                          c if activation != "none" and beta != 0.0 else None)
    ctx.alpha, ctx.beta, ctx.activation, ctx.backend = alpha, beta, activation, backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.c_shape = None if c is None else tuple(c.shape)
    ctx.c_dtype = None if c is None else c.dtype


def _backward(ctx, grad_out, grad_aux):
    """Gradients of a, b, bias and c (None for the scalars and options); see the module docstring.
    ``grad_aux`` (a loss on the pre-activation output) adds to dpre, so aux is a true output."""
    a, b, aux, bias, c = ctx.saved_tensors
    reject_forward_ad("ferroattn::gemm", (("grad_out", grad_out),))
    p = plan(a, b)
    act, alpha, beta = ctx.activation, ctx.alpha, ctx.beta
    need = ctx.needs_input_grad
    g = grad_out.float()
    if act != "none":
        pre = aux
        if pre is None:  # the forward was asked for no aux: recompute the pre-activation
            pre, _ = gemm(a, b, bias, c, alpha, beta, "none", grad_out.dtype, ctx.backend, False)
        dpre = activation_backward(g, pre.float(), act)   # fp32, as g
        if aux is not None and grad_aux is not None and grad_aux.numel():
            dpre = dpre + grad_aux.float()
    else:
        dpre = g
    dpre3 = dpre.reshape(p.batch, p.m, p.n)
    da = db = dbias = dc = None
    if need[0] or need[1]:
        d_lp = dpre3.to(a.dtype)
    if need[0]:
        bt = (b if b.dim() == 3 else b.unsqueeze(0)).transpose(-1, -2)  # (batch_b, n, k) view
        if p.batch_a == p.batch:
            da, _ = gemm(d_lp, bt, None, None, alpha, 0.0, "none", a.dtype, ctx.backend, False)
        else:  # a broadcast over the batch: sum the per-entry products (fp32)
            da, _ = gemm(d_lp, bt, None, None, alpha, 0.0, "none", torch.float32, ctx.backend, False)
            da = da.sum(0).to(a.dtype)
        da = da.reshape(a.shape)
    if need[1]:
        if p.batch_b == p.batch:
            at = a.reshape(p.batch_a, p.m, p.k).transpose(-1, -2)  # (batch_a, k, m) view
            db, _ = gemm(at, d_lp, None, None, alpha, 0.0, "none", b.dtype, ctx.backend, False)
        else:  # b broadcast: one GEMM over all rows, aᵀ (k, batch·m) @ dpre (batch·m, n)
            at = a.reshape(p.batch * p.m, p.k).transpose(0, 1)
            db, _ = gemm(at, d_lp.reshape(p.batch * p.m, p.n), None, None, alpha, 0.0, "none", b.dtype,
                         ctx.backend, False)
        db = db.reshape(b.shape)
    if need[2] and ctx.bias_dtype is not None:
        dbias = dpre.reshape(-1, p.n).sum(0).to(ctx.bias_dtype)
    if need[3] and ctx.c_shape is not None:
        if beta == 0.0:  # c is never read
            dc = torch.zeros(ctx.c_shape, dtype=ctx.c_dtype, device=dpre.device)
        else:
            dc3 = dpre3 * beta
            if math.prod(ctx.c_shape[:-2]) != p.batch:  # c broadcast over the batch
                dc3 = dc3.sum(0)
            dc = dc3.reshape(ctx.c_shape).to(ctx.c_dtype)
    return da, db, dbias, dc, None, None, None, None, None, None


gemm.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def gemm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """FLOPs of one call: ``2 · batch · m · n · k`` (a multiply and an add per term of each
    product; the epilogue is not counted, as torch counts ``addmm``)."""
    p = plan(a, b)
    return 2 * p.batch * p.m * p.n * p.k


register_flop_formula(torch.ops.ferroattn.gemm, get_raw=True)(gemm_flops)
register_flop_formula(torch.ops.ferroattn.gemm_out, get_raw=True)(gemm_flops)


