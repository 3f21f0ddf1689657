"""The compressed 2:4 matrix (:class:`Sparse24Tensor`), :func:`compress` and :func:`decompress`
(the format: :mod:`ferroattn.sparse24`)."""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .. import _env  # noqa: F401  (configures the extension before first use)
from .. import _native
from ..errors import ArgumentError, DeviceError, DTypeError
from ..ops import sparse24 as _ops  # registers torch.ops.ferroattn.sparse24_linear / sparse24_decompress

__all__ = ["Sparse24Tensor", "compress", "decompress"]

#: the dtypes of the 2:4 kernels
HALF = (torch.float16, torch.bfloat16)


def check_bool(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` is a bool (``prune="no"`` must not mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def layout(m: int, k: int) -> dict:
    """``_native.sparse24layout(m, k)``: the padded ``values_shape`` and ``meta_shape`` of an
    (m, k) 2:4 matrix."""
    return _native.sparse24_layout(int(m), int(k))


_ARCHS: dict[int, str] = {}


def device_arch(device: torch.device) -> Optional[str]:
    """"sm_XY" of a CUDA device (cached per index); None for other devices or without a usable GPU
    (e.g. fake CUDA tensors on a machine without one)."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    arch = _ARCHS.get(idx)
    if arch is None:
        try:
            major, minor = torch.cuda.get_device_capability(idx)
        except (RuntimeError, AssertionError):
            return None
        arch = _ARCHS[idx] = f"sm_{major}{minor}"
    return arch


class Sparse24Tensor:
    """A 2:4 sparse matrix of logical shape ``shape = (m, k)`` in compressed form.

    Attributes:
        values: (m_pad, k_pad // 2) of ``dtype`` (fp16 or bf16): the kept elements of each group
            of 4, in column order; zero padding (``_native.sparse24layout(m, k)``).
        meta: int16 of ``sparse24layout(m, k)["meta_shape"]``: the kept elements' column indices
            in the kernels' layout.
        shape: ``(m, k)``; dtype: ``values.dtype``; device: ``values.device``.

    Build one with :func:`compress`; the constructor only checks that the parts fit together
    (shapes from the layout, dtypes, one device) and raises ArgumentError / DTypeError /
    DeviceError naming the part (TypeError naming ``shape`` when it is not a sequence of two
    integers). The dense matrix used by the dense path of :func:`matmul` is decompressed once and
    cached (:meth:`dense`; costs m·k elements of memory; drop it with :meth:`drop_dense_cache`).
    The cache is keyed on values' and meta's identity, storage address (``data_ptr``: a
    ``t.data = other`` / ``set_`` swap is seen) and torch's version counter (every in-place write
    through autograd-visible tensors, e.g. ``copy_`` and ``load_state_dict``, is seen). Writes that
    bypass the version counter cannot be seen without reading the values: for inference tensors
    (made under ``torch.inference_mode``: no version counter) nothing is cached, so each dense call
    decompresses again; after writing through ``t.data`` (``values.data.copy_(...)``: ``.data``
    has its own version counter) call :meth:`drop_dense_cache`."""

    def __init__(self, values: Tensor, meta: Tensor, shape: Sequence[int], dtype: Optional[torch.dtype] = None):
        if not isinstance(values, Tensor) or not isinstance(meta, Tensor):
            raise TypeError(f"values, meta: expected torch.Tensor, got {type(values).__name__}, "
                            f"{type(meta).__name__}")
        try:
            bools = any(isinstance(s, bool) for s in shape)
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise TypeError(f"shape: expected a sequence of two ints (m, k), got {type(shape).__name__} "
                            f"{shape!r}") from None
        if len(shape) != 2 or min(shape) < 1 or bools:
            raise ArgumentError(f"shape: expected (m, k) with integers m, k >= 1, got {shape}")
        if dtype is None:
            dtype = values.dtype
        elif dtype not in HALF:
            raise DTypeError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")
        elif values.dtype != dtype:
            raise DTypeError(f"values: expected dtype {dtype} (the dtype argument), got {values.dtype}")
        _ops.check_compressed(values, meta, *shape)
        if meta.device != values.device:
            raise DeviceError(f"meta: expected values' device {values.device}, got {meta.device}")
        self.values, self.meta, self.shape, self.dtype = values, meta, shape, dtype
        #: "sm_90" etc. of values' CUDA device (None elsewhere): read here, eagerly, so the dispatch
        #: of matmul needs no device query (nothing for torch.compile to trace)
        self.arch: Optional[str] = device_arch(values.device)
        self._dense: Optional[Tensor] = None
        self._dense_key: Any = None

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dense(self) -> Tensor:
        """The decompressed (m, k) matrix, cached (see the class docstring). Not cached while
        torch.compile traces (the result is then a traced value, not a tensor to keep)."""
        if torch.compiler.is_compiling():
            return torch.ops.ferroattn.sparse24_decompress(self.values, self.meta, *self.shape)
        if self.values.is_inference() or self.meta.is_inference():   # no version counter: never cached
            self._dense = self._dense_key = None
            with torch.no_grad():
                return decompress(self)
        v, m = self.values, self.meta      # not inference tensors: both have a version counter
        key = (id(v), v.data_ptr(), v._version, id(m), m.data_ptr(), m._version)
        if self._dense is None or self._dense_key != key:
            with torch.no_grad():
                self._dense = decompress(self)
            self._dense_key = key
        return self._dense

    def drop_dense_cache(self) -> None:
        self._dense, self._dense_key = None, None

    def to(self, device) -> "Sparse24Tensor":
        """A copy on ``device`` (the same object when already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return Sparse24Tensor(self.values.to(device), self.meta.to(device), self.shape, self.dtype)

    def __repr__(self) -> str:
        return (f"Sparse24Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, "
                f"values={tuple(self.values.shape)}, meta={tuple(self.meta.shape)})")



def compress(w: Tensor, prune: bool = False) -> Sparse24Tensor:
    """The compressed form of a 2:4 matrix ``w`` (m, k).

    Args:
        w: (m, k) float16 or bfloat16; CUDA (the GPU compress kernel runs on the current stream),
            CPU (the Rust host reference), or meta (shapes only, nothing checked). Any strides (a
            copy is made when the last dim is not contiguous). m, k >= 1.
        prune: False: ``w`` must already be 2:4, else ValueError. True: every group keeps its 2
            largest magnitudes (:func:`prune`'s rule).
    Returns: :class:`Sparse24Tensor` with values/meta padded to the kernels' tiles
        (``_native.sparse24layout(m, k)``), on w's device.
    Raises:
        ValueError (ArgumentError) when ``prune`` is False and groups hold more than 2 non-zeros:
        the message says how many of how many groups (reading that count synchronises a CUDA
        stream once); TypeError / DTypeError / ArgumentError naming ``w`` for a non-tensor, a
        dtype other than fp16/bf16, a rank other than 2 or an empty dimension; TypeError naming
        ``prune`` when it is not a bool.
    """
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    check_bool("prune", prune)
    if w.dtype not in HALF:
        raise DTypeError(f"w: expected float16 or bfloat16, got {w.dtype}")
    if w.dim() != 2 or min(w.shape) < 1:
        raise ArgumentError(f"w: expected a 2-D (m, k) matrix with m, k >= 1, got shape {tuple(w.shape)}")
    m, k = (int(s) for s in w.shape)
    lay = layout(m, k)
    w = w.detach()
    if w.stride(-1) != 1:
        w = w.contiguous()
    values = torch.empty(tuple(lay["values_shape"]), dtype=w.dtype, device=w.device)
    meta = torch.empty(tuple(lay["meta_shape"]), dtype=torch.int16, device=w.device)
    if w.device.type != "meta":
        with torch.no_grad():
            bad = _ops.run_compress(w, values, meta, bool(prune))
        if not prune:
            n_bad = int(bad.item())   # a sync on CUDA; skipped with prune=True
            if n_bad:
                groups = m * ((k + 3) // 4)
                raise ArgumentError(
                    f"w: expected a 2:4 sparse matrix (at most 2 non-zeros in every aligned group of 4 along k), "
                    f"got {n_bad} of {groups} groups with more than 2 non-zeros; pass prune=True to keep the 2 "
                    f"largest magnitudes of each group")
    return Sparse24Tensor(values, meta, (m, k), w.dtype)


def decompress(t: Sparse24Tensor) -> Tensor:
    """The dense (m, k) matrix of ``t`` (t's dtype and device, contiguous): the GPU kernel for
    CUDA, the Rust host reference for CPU. Bitwise the matrix given to :func:`compress` when that
    matrix was 2:4 (``decompress(compress(w, prune=True)) == prune(w)`` bitwise).
    Raises TypeError when ``t`` is not a :class:`Sparse24Tensor`."""
    if not isinstance(t, Sparse24Tensor):
        raise TypeError(f"t: expected a Sparse24Tensor (from ferroattn.sparse24.compress), got {type(t).__name__}")
    return _ops.sparse24_decompress(t.values, t.meta, *t.shape)


