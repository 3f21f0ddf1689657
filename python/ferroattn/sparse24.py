"""2:4 structured sparsity: prune, compress, decompress, sparse matmul, the SparseLinear layer and
model conversion.

A matrix ``w`` (m, k) is *2:4 sparse* when every aligned group of 4 consecutive elements along k
(columns ``4g .. 4g+3`` of a row; a last partial group counts as padded with zeros) holds at most
2 non-zeros (the NVIDIA Ampere/Hopper sparse tensor-core format, PTX ISA ``mma.sp`` / ``wgmma.sp``).
Such a matrix is stored as ``values`` (the kept elements, half the columns) and ``meta`` (int16,
2-bit column indices in the layout the kernels read; ``src/ops/sparse24/host.rs`` documents it).

    w2 = sparse24.prune(w)                       # dense, 2:4
    ws = sparse24.compress(w2)                   # Sparse24Tensor (values, meta, shape, dtype)
    assert torch.equal(sparse24.decompress(ws), w2)
    y = sparse24.matmul(x, ws, bias, activation="silu")   # == F.silu(F.linear(x, w2, bias))
    report = sparse24.sparsify(model, text=passage, tokenizer=tok)   # MLPs -> SparseLinear

**Pruning rule** (shared with the kernels: ``_native.sparse24_compress(prune=True)`` and the Rust
host reference keep the same elements): in every group keep the 2 elements of largest magnitude;
ties go to the lower column index. Magnitudes are compared as the IEEE bit patterns with the sign
cleared (``bits & 0x7fff`` for fp16/bf16), which is ``|x|`` order for numbers and ranks ``+-inf``
above every finite value, and every NaN (equal among themselves) above inf: a NaN or inf weight is
*kept*, never silently dropped, so a broken weight stays visible in the output. ``-0.0`` and
``+0.0`` have equal magnitude (src/ops/sparse24/host.rs states the same rule for the kernels).
Dropped elements become ``+0.0``. A *non-zero* (for the 2:4 check) is any value ``!= 0``, NaN
included.

**Dispatch** (:func:`matmul` with ``backend="auto"``): CPU tensors always use the dense path
(``F.linear`` on the decompressed weight, cached on the :class:`Sparse24Tensor`). On CUDA the
measured table :data:`DISPATCH_TABLE` (filled from ``python -m ferroattn bench sparse24``, which
prints the lines to paste) decides per (arch, dtype, nearest measured weight shape, nearest
measured row count): the sparse kernel when it measured at least :data:`SPARSE_MIN_SPEEDUP` times
as fast as dense cuBLAS, else dense. With no measurement for the arch/dtype, the sparse kernel runs.
"""
from __future__ import annotations

import json
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _env  # noqa: F401  (configures the extension before first use)
from . import _native
from .errors import ArgumentError, DeviceError, DTypeError
from .ops import sparse24 as _ops  # registers torch.ops.ferroattn.sparse24_linear / sparse24_decompress

__all__ = ["Sparse24Tensor", "prune", "compress", "decompress", "matmul", "sparsify", "SparsifyReport",
           "is_sparse24", "choose_backend", "set_dispatch_table", "load_dispatch_table", "DISPATCH_TABLE",
           "SPARSE_MIN_SPEEDUP", "ACTIVATIONS", "BACKENDS", "default_filter", "perplexity"]

_HALF = (torch.float16, torch.bfloat16)
#: public activation names -> the native ones (kernels/common/activation.cuh); "gelu" is erf GELU
ACTIVATIONS = {None: "none", "none": "none", "relu": "relu", "gelu": "gelu_erf", "gelu_erf": "gelu_erf",
               "gelu_tanh": "gelu_tanh", "silu": "silu"}
#: matmul backends: "auto" (dispatch table), "dense" (F.linear on the decompressed weight),
#: "sparse" (the 2:4 kernel, native auto), "mma_sp" (sm_80+), "wgmma_sp" (sm_90a)
BACKENDS = ("auto", "dense", "sparse", "mma_sp", "wgmma_sp")


# ---------------------------------------------------------------------------------------------
# the compressed tensor
# ---------------------------------------------------------------------------------------------
def _known_activation(activation: Any) -> bool:
    """Whether ``activation`` is a key of :data:`ACTIVATIONS` (False for unhashable values such as
    a list, instead of a raw TypeError)."""
    return (activation is None or isinstance(activation, str)) and activation in ACTIVATIONS


def _check_bool(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` is a bool (``prune="no"`` must not mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def _layout(m: int, k: int) -> dict:
    return _native.sparse24_layout(int(m), int(k))


_ARCHS: dict[int, str] = {}


def _device_arch(device: torch.device) -> Optional[str]:
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
            of 4, in column order; zero padding (``_native.sparse24_layout(m, k)``).
        meta: int16 of ``sparse24_layout(m, k)["meta_shape"]``: the kept elements' column indices
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
        elif dtype not in _HALF:
            raise DTypeError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")
        elif values.dtype != dtype:
            raise DTypeError(f"values: expected dtype {dtype} (the dtype argument), got {values.dtype}")
        _ops.check_compressed(values, meta, *shape)
        if meta.device != values.device:
            raise DeviceError(f"meta: expected values' device {values.device}, got {meta.device}")
        self.values, self.meta, self.shape, self.dtype = values, meta, shape, dtype
        #: "sm_90" etc. of values' CUDA device (None elsewhere): read here, eagerly, so the dispatch
        #: of matmul needs no device query (nothing for torch.compile to trace)
        self.arch: Optional[str] = _device_arch(values.device)
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


# ---------------------------------------------------------------------------------------------
# prune
# ---------------------------------------------------------------------------------------------
_KEY = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
        torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}


def _magnitude_key(g: Tensor) -> Tensor:
    """Sign-cleared bit patterns as integers: |x| order, inf above finite, every NaN (any sign or
    payload) equal to each other and above inf."""
    int_dtype, mask = _KEY[g.dtype]
    bits = g.view(int_dtype)
    if int_dtype == torch.int16:
        bits = bits.to(torch.int32)
    return torch.where(torch.isnan(g), mask, bits & mask)


def _keep_mask(groups: Tensor) -> Tensor:
    """groups (..., 4) -> bool (..., 4): the 2 largest magnitudes, ties to the lower index."""
    key = _magnitude_key(groups)
    rank = torch.zeros(groups.shape, dtype=torch.int8, device=groups.device)
    for j in range(4):
        kj = key[..., j:j + 1]
        beats = kj > key                                   # element j outranks element i
        beats[..., j + 1:] |= kj == key[..., j + 1:]       # ties: the lower index (j < i) wins
        rank += beats
    return rank < 2


def prune(w: Tensor) -> Tensor:
    """Magnitude 2:4 pruning: a new tensor like ``w`` where every aligned group of 4 along the last
    dim keeps its 2 largest magnitudes (ties: the lower index; NaN/inf kept, see the module
    docstring) and the other 2 elements are ``+0.0``. A last partial group (k % 4 != 0) is ranked
    as if padded with zeros. Same rule as ``compress(w, prune=True)`` (kernels and host reference).

    Args:
        w: (..., k) floating tensor (fp16, bf16, fp32 or fp64) on any device, any strides.
    Returns: a contiguous tensor of w's shape, dtype and device (not sharing memory with w).
    Raises: TypeError for a non-tensor, DTypeError for another dtype, ArgumentError for a 0-d w.
    """
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _KEY:
        raise DTypeError(f"w: expected a float16, bfloat16, float32 or float64 tensor, got {w.dtype}")
    if w.dim() == 0:
        raise ArgumentError("w: expected a tensor of rank >= 1 (groups of 4 along the last dim), got a 0-d tensor")
    w = w.detach()
    k = w.shape[-1]
    if k == 0 or w.numel() == 0:
        return w.clone(memory_format=torch.contiguous_format)
    pad = -k % 4
    g = F.pad(w, (0, pad)) if pad else w.contiguous()
    g = g.reshape(-1, (k + pad) // 4, 4)
    out = torch.empty_like(g)
    step = max(1, (1 << 22) // g.shape[1])        # about 16M elements per chunk (bounded temporaries)
    for r in range(0, g.shape[0], step):
        chunk = g[r:r + step]
        out[r:r + step] = torch.where(_keep_mask(chunk), chunk, torch.zeros((), dtype=w.dtype, device=w.device))
    out = out.reshape(*w.shape[:-1], k + pad)
    return out[..., :k].contiguous() if pad else out


def is_sparse24(w: Tensor) -> bool:
    """True when every aligned group of 4 along the last dim of ``w`` has at most 2 non-zeros
    (NaN counts as non-zero). Reads the values (a sync for CUDA tensors).

    Args: w: (..., k) tensor of rank >= 1, any dtype and device. An empty ``w`` (k = 0 or no rows)
    has no group and is 2:4 (True).
    Raises: TypeError for a non-tensor, ArgumentError for a 0-d tensor."""
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() == 0:
        raise ArgumentError("w: expected a tensor of rank >= 1 (groups of 4 along the last dim), got a 0-d tensor")
    if w.numel() == 0:
        return True
    return _bad_groups(w) == 0


def _bad_groups(w: Tensor) -> int:
    k = w.shape[-1]
    pad = -k % 4
    g = F.pad(w.detach(), (0, pad)) if pad else w.detach()
    nz = (g.reshape(-1, (k + pad) // 4, 4) != 0).sum(-1)
    return int((nz > 2).sum())


# ---------------------------------------------------------------------------------------------
# compress / decompress
# ---------------------------------------------------------------------------------------------
def compress(w: Tensor, prune: bool = False) -> Sparse24Tensor:
    """The compressed form of a 2:4 matrix ``w`` (m, k).

    Args:
        w: (m, k) float16 or bfloat16; CUDA (the GPU compress kernel runs on the current stream),
            CPU (the Rust host reference), or meta (shapes only, nothing checked). Any strides (a
            copy is made when the last dim is not contiguous). m, k >= 1.
        prune: False: ``w`` must already be 2:4, else ValueError. True: every group keeps its 2
            largest magnitudes (:func:`prune`'s rule).
    Returns: :class:`Sparse24Tensor` with values/meta padded to the kernels' tiles
        (``_native.sparse24_layout(m, k)``), on w's device.
    Raises:
        ValueError (ArgumentError) when ``prune`` is False and groups hold more than 2 non-zeros:
        the message says how many of how many groups (reading that count synchronises a CUDA
        stream once); TypeError / DTypeError / ArgumentError naming ``w`` for a non-tensor, a
        dtype other than fp16/bf16, a rank other than 2 or an empty dimension; TypeError naming
        ``prune`` when it is not a bool.
    """
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    _check_bool("prune", prune)
    if w.dtype not in _HALF:
        raise DTypeError(f"w: expected float16 or bfloat16, got {w.dtype}")
    if w.dim() != 2 or min(w.shape) < 1:
        raise ArgumentError(f"w: expected a 2-D (m, k) matrix with m, k >= 1, got shape {tuple(w.shape)}")
    m, k = (int(s) for s in w.shape)
    lay = _layout(m, k)
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


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
#: arch ("sm_90") -> dtype ("bfloat16"/"float16") -> {(n, k): ((rows, speedup over dense), ...)}
#: from ``python -m ferroattn bench sparse24`` (it prints this literal from its measurements).
#: Measured on an H200 (sm_90) on 2026-11-30 (bench/results/sparse24_nvidia-h200_20261130T085021.json, bf16 and
#: fp16, 5 paired rounds per point) for the kernel the native "auto" ran then: wgmma_sp from 256 rows (its
#: per-kernel column), mma_sp below. The entries at
#: 16 / 128 / 256 / 512 / 1024 rows of the four LLM weight shapes (bf16; fp16 from 256 rows) re-measured by GPU time
#: only (paired rounds, L2 flushed; raw JSON
#: bench/results/sparse24_splitk_20261130T1105/call1_split_{bf16,fp16}_20261130T1105.json)
#: for the new native auto: wgmma_sp with split-k (src/tuning/sparse24.rs wgmma_split_plan) from 46 rows
#: (src/ops/sparse24/mod.rs WGMMA_MIN_ROWS), mma_sp below; the 64 / 96 / 128-row entries (both dtypes) from
#: bench/results/sparse24_splitk_20261130T1105/call2_kernels_{bf16,fp16}.json (wgmma_sp column). Rows 46 and up
#: find their nearest entry at >= 64 rows (wgmma_sp-measured), rows <= 45 at <= 32 (mma_sp-measured): keep the
#: native WGMMA_MIN_ROWS on that boundary so each entry describes the kernel that runs. The
#: entries whose native schedule became the 128-row wgmma_sp tile (src/tuning/sparse24.rs wgmma_schedule) re-measured
#: by GPU time (paired rounds, L2 flushed; scripts/sparse24_schedule_timing.py, raw JSON
#: bench/results/sparse24_schedules_20261130T1333/call2_sweep_20261130T1341.json): 1024^3; 256 / 512
#: rows x 4096 x 4096; 128 rows x 11008 x 4096 and 14336 x 4096; 512 rows x 4096 x 11008.
DISPATCH_TABLE: dict[str, dict[str, dict[tuple[int, int], tuple[tuple[int, float], ...]]]] = {
    'sm_90': {
        'bfloat16': {
            (1024, 1024): ((1024, 0.954),),
            (2048, 2048): ((2048, 1.2875),),
            (4096, 4096): ((16, 1.1472), (32, 0.8355), (64, 0.8095), (96, 0.9549), (128, 0.7407), (256, 1.193), (512, 1.306), (1024, 1.372), (2048, 1.4436), (4096, 1.4506), (4096, 1.4529), (8192, 1.4535), (16384, 1.4779),),
            (8192, 8192): ((8192, 1.493),),
            (16384, 16384): ((16384, 1.4981),),
            (11008, 4096): ((16, 1.436), (32, 1.3187), (64, 1.0585), (96, 1.0223), (128, 1.294), (256, 1.0822), (512, 1.0712), (1024, 1.3593), (2048, 1.399), (4096, 1.4821), (8192, 1.4483), (16384, 1.5246),),
            (4096, 11008): ((16, 1.0143), (32, 0.695), (64, 1.1873), (96, 1.1471), (128, 1.117), (256, 1.1275), (512, 1.367), (1024, 1.4659), (2048, 1.4835), (4096, 1.5375), (8192, 1.4696), (16384, 1.526),),
            (14336, 4096): ((16, 1.3894), (32, 1.1905), (64, 1.0995), (96, 1.051), (128, 1.437), (256, 1.2789), (512, 1.5237), (1024, 1.3243), (2048, 1.4845), (4096, 1.4377), (8192, 1.4435), (16384, 1.498),),
        },
        'float16': {
            (1024, 1024): ((1024, 0.942),),
            (2048, 2048): ((2048, 1.2985),),
            (4096, 4096): ((16, 1.1487), (32, 0.8271), (64, 0.8216), (96, 0.9739), (128, 0.7443), (256, 1.155), (512, 1.335), (1024, 1.3579), (2048, 1.4199), (4096, 1.4483), (4096, 1.4484), (8192, 1.4666), (16384, 1.4859),),
            (8192, 8192): ((8192, 1.5178),),
            (16384, 16384): ((16384, 1.4548),),
            (11008, 4096): ((16, 1.4245), (32, 1.3093), (64, 1.0501), (96, 1.0355), (128, 1.287), (256, 1.0735), (512, 1.081), (1024, 1.343), (2048, 1.3777), (4096, 1.4933), (8192, 1.4515), (16384, 1.4625),),
            (4096, 11008): ((16, 1.0095), (32, 0.7077), (64, 1.163), (96, 1.17), (128, 1.1173), (256, 1.0427), (512, 1.365), (1024, 1.4532), (2048, 1.4933), (4096, 1.5419), (8192, 1.5063), (16384, 1.5),),
            (14336, 4096): ((16, 1.3305), (32, 1.1853), (64, 1.0878), (96, 1.0561), (128, 1.443), (256, 1.354), (512, 1.5267), (1024, 1.3067), (2048, 1.506), (4096, 1.4578), (8192, 1.4351), (16384, 1.461),),
        },
    },
}
#: the sparse kernel is chosen where it measured at least this much faster than dense. A margin of 1.1 suited one
#: timing per entry on a power-capped GPU drifting by a few per cent); the entries are now paired per-round
#: ratios (drift cancels, rounds agree within ~1-2 %), so 3 % above parity: a noisy win of 1.03 is at worst a
#: ~0.98x loss against dense (never near the 0.95x floor), while 1.1 kept dense where cuSPARSELt beats dense
#: and our sparse kernel beats cuSPARSELt (256 / 512 x 11008 x 4096: sparse 1.07-1.08x dense, 1.02-1.06x peer)
SPARSE_MIN_SPEEDUP = 1.03


_DECISIONS: dict[tuple, str] = {}     # memo of _decide (a plain dict: torch.compile traces it)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _decide(arch: str, dtype: str, n: int, k: int, rows: int) -> str:
    key = (arch, dtype, n, k, rows)
    got = _DECISIONS.get(key)
    if got is None:
        got = _DECISIONS[key] = _decide_uncached(arch, dtype, n, k, rows)
        if len(_DECISIONS) > 65536:
            _DECISIONS.clear()
    return got


def _decide_uncached(arch: str, dtype: str, n: int, k: int, rows: int) -> str:
    # plain loops (no min(key=...)): torch.compile traces this when matmul runs inside a graph
    shapes = DISPATCH_TABLE.get(arch, {}).get(dtype)
    if not shapes:
        return "sparse"
    best, best_d = None, None
    for nk in sorted(shapes):                       # nearest measured shape in log space; ties: smaller
        d = abs(math.log(n / nk[0])) + abs(math.log(k / nk[1]))
        if best_d is None or d < best_d:
            best, best_d = nk, d
    lr = math.log(max(rows, 1))
    speedup, best_r = None, None
    for r, s in sorted(shapes[best]):               # nearest measured row count in log space; ties: fewer
        d = abs(math.log(max(r, 1)) - lr)
        if best_r is None or d < best_r:
            speedup, best_r = s, d
    if speedup is None:
        return "sparse"
    return "sparse" if speedup >= SPARSE_MIN_SPEEDUP else "dense"


def choose_backend(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                   arch: Optional[str] = None) -> str:
    """"dense" or "sparse" for a call of ``rows`` rows against an (n, k) 2:4 weight (the rule of
    the module docstring). CPU and other non-CUDA devices: "dense". ``arch`` ("sm_90"): the
    device's, when the caller knows it (default: asked from torch).

    Raises:
        ArgumentError: n or k < 1, or rows < 0."""
    for name, v, low in (("rows", rows, 0), ("n", n, 1), ("k", k, 1)):
        if int(v) < low:
            raise ArgumentError(f"{name}: expected an integer >= {low}, got {v}")
    if device.type != "cuda":
        return "dense"
    arch = arch or _device_arch(device)
    if arch is None:
        return "sparse"
    name = _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")
    return _decide(arch, name, int(n), int(k), int(rows))


def set_dispatch_table(table: Mapping) -> None:
    """Replace :data:`DISPATCH_TABLE` (same nesting; keys of the shape dict may be "n,k" strings
    or (n, k) tuples) and clear the decision cache.

    Raises:
        ArgumentError: a malformed table: wrong nesting, n or k < 1, rows < 0, or a speedup that is
            not a finite number > 0 (the table is left unchanged)."""
    new: dict = {}
    try:
        for arch, by_dtype in table.items():
            for dt, shapes in by_dtype.items():
                for nk, pts in shapes.items():
                    n, k = (int(v) for v in (nk.split(",") if isinstance(nk, str) else nk))
                    if n < 1 or k < 1:
                        raise ValueError(f"shape {nk!r}: n and k must be >= 1")
                    entry = tuple((int(r), float(s)) for r, s in pts)
                    for r, sp in entry:
                        if r < 0 or not math.isfinite(sp) or sp <= 0:
                            raise ValueError(f"shape {nk!r}: ({r}, {sp}) needs rows >= 0 and a finite speedup > 0")
                    new.setdefault(str(arch), {}).setdefault(str(dt), {})[(n, k)] = entry
    except (AttributeError, TypeError, ValueError) as e:
        raise ArgumentError(f"table: expected {{arch: {{dtype: {{(n, k): [(rows, speedup), ...]}}}}}}, got an "
                            f"entry that does not fit ({type(e).__name__}: {e})") from None
    DISPATCH_TABLE.clear()
    DISPATCH_TABLE.update(new)
    _DECISIONS.clear()


def load_dispatch_table(path: str | os.PathLike) -> None:
    """:func:`set_dispatch_table` from a ``bench sparse24`` JSON file (its "dispatch_table")."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    set_dispatch_table(data.get("dispatch_table", data))


# ---------------------------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------------------------
def _same(o: Tensor) -> Tensor:
    return o


def _rows_view(x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(x2, unflatten): x2 a (rows, k) tensor with stride(-1) == 1 holding x's rows, and a function
    mapping the (rows, n) result back to x's leading shape. x2 is a view when x's last dim is
    unit-stride and its leading dims, ordered by stride, collapse to one row stride (contiguous,
    transposed batch/sequence dims, row slices with a step); otherwise a copy. A 2-D x with
    unit-stride rows is returned itself (and unflatten is the identity): no view to make."""
    if x.dim() == 2 and x.stride(-1) == 1:     # the common cases first, with the fewest torch calls
        return x, _same
    k = x.shape[-1]
    if x.is_contiguous():
        lead = tuple(x.shape[:-1])
        return x.view(-1, k), lambda o: o.view(*lead, o.shape[-1])
    lead = tuple(x.shape[:-1])
    if x.stride(-1) != 1:
        x2 = x.reshape(-1, k).contiguous()
        return x2, lambda o: o.reshape(*lead, o.shape[-1])
    if x.dim() <= 2:
        return x.reshape(-1, k), lambda o: o.reshape(*lead, o.shape[-1])
    # order the leading dims by stride (largest first), ignoring size-1 dims
    order = sorted(range(len(lead)), key=lambda i: -x.stride(i))
    xp = x.permute(*order, x.dim() - 1)
    try:
        x2 = xp.view(-1, k)
    except RuntimeError:
        x2 = xp.reshape(-1, k).contiguous()
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    shape_p = tuple(lead[i] for i in order)

    def unflatten(o: Tensor) -> Tensor:
        return o.view(*shape_p, o.shape[-1]).permute(*inv, len(lead))
    return x2, unflatten


def _dense_activation(y: Tensor, activation: str) -> Tensor:
    if activation == "none":
        return y
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu_erf":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return F.silu(y)


def matmul(x: Tensor, w_sparse: Sparse24Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           *, backend: str = "auto") -> Tensor:
    """``act(x @ w.T + bias)`` with ``w`` (n, k) the 2:4 matrix of ``w_sparse``:
    ``torch.nn.functional.linear`` semantics (plus a fused activation).

    Args:
        x: (..., k) float16/bfloat16 of w's dtype, on w's device; any leading shape (including
            none: a (k,) x gives (n,)) and any strides. Leading dims are flattened to rows without
            a copy when they can be (see :func:`_rows_view`); a copy is made only when the last
            dim is not unit-stride or the leading dims cannot share one row stride.
        w_sparse: :class:`Sparse24Tensor` (n, k) from :func:`compress`.
        bias: None or (n,) of x's dtype or float32 (the kernel adds it to the fp32 accumulator;
            the dense path adds it in x's dtype, as F.linear does).
        activation: None, "relu", "gelu" (erf form; also "gelu_erf"), "gelu_tanh" or "silu".
        backend: "auto" (the dispatch rule of the module docstring), "dense" (F.linear on the
            cached decompressed weight), "sparse" (the 2:4 kernel, best for the device),
            "mma_sp" (sm_80+) or "wgmma_sp" (sm_90a).
    Returns: (..., n) of x's dtype. Gradients flow to x and bias; the sparse weight is frozen
        (see :mod:`ferroattn.ops.sparse24`).
    Raises: TypeError for a w_sparse that is not a Sparse24Tensor; DTypeError / DeviceError /
        ArgumentError naming x, bias, activation or backend; the kernel's validation errors.
    """
    if not isinstance(w_sparse, Sparse24Tensor):
        raise TypeError(f"w_sparse: expected a Sparse24Tensor (from ferroattn.sparse24.compress), "
                        f"got {type(w_sparse).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not _known_activation(activation):
        raise ArgumentError(f"activation: expected None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got {activation!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ArgumentError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    act = ACTIVATIONS[activation]
    n, k = w_sparse.shape
    if x.dtype != w_sparse.dtype:
        raise DTypeError(f"x: expected the weight's dtype {w_sparse.dtype}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ArgumentError(f"x: expected a last dim of {k} (the weight's in_features), got shape {tuple(x.shape)}")
    if x.device != w_sparse.device:
        raise DeviceError(f"x: expected the weight's device {w_sparse.device}, got {x.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ArgumentError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype not in (x.dtype, torch.float32):
            raise DTypeError(f"bias: expected {x.dtype} or torch.float32, got {bias.dtype}")
        if bias.device != x.device:
            raise DeviceError(f"bias: expected x's device {x.device}, got {bias.device}")
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    if rows == 0:   # empty (..., n), connected to x and bias like F.linear's (zero gradients)
        y = x.sum(-1, keepdim=True).expand(*lead, n).clone()
        if bias is not None:
            y = y + bias.to(x.dtype)
        return _dense_activation(y, act)
    if backend == "auto":
        backend = choose_backend(rows, n, k, x.dtype, x.device, w_sparse.arch)
    if backend == "dense":
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        y = F.linear(x, w_sparse.dense(), bias)
        return y if act == "none" else _dense_activation(y, act)
    x2, unflatten = _rows_view(x)
    # _ops.linear: the op, or in a plain eager call its implementation directly (same code, less
    # host time; ferroattn.ops._eager)
    out = _ops.linear(x2, w_sparse.values, w_sparse.meta, bias, n, k, act,
                      "auto" if backend == "sparse" else backend)
    return unflatten(out)


# ---------------------------------------------------------------------------------------------
# SparseLinear (public as ferroattn.nn.SparseLinear)
# ---------------------------------------------------------------------------------------------
# ``SparseLinear``: an ``nn.Linear`` whose weight is a frozen 2:4 sparse matrix (re-exported as
# ``ferroattn.nn.SparseLinear``).
#
# State dict: ``values`` (m_pad, k_pad // 2) and ``meta`` (int16) buffers (the compressed weight of
# :func:`ferroattn.sparse24.compress`, shapes from ``_native.sparse24_layout(out_features,
# in_features)``), ``bias`` (a Parameter, as in ``nn.Linear``, when the layer has one) and
# ``_extra_state``: the int64 tensor ``(out_features, in_features)`` (the padded buffers do not tell
# the logical shape: a 24x40 and a 24x44 weight have the same buffers; loading one into the other
# raises ArgumentError instead of silently reading padding as weights). The
# forward is :func:`ferroattn.sparse24.matmul` (its dispatch rule picks the sparse kernel or dense);
# gradients flow to the input and the bias, never to the weight (frozen: a dense update would break
# the 2:4 pattern).
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
        if not _known_activation(activation):
            raise ArgumentError(
                f"activation: expected None, 'relu', 'gelu', 'gelu_tanh' or 'silu', got {activation!r}")
        if int(in_features) < 1 or int(out_features) < 1:
            raise ArgumentError(f"in_features, out_features: expected >= 1, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.activation = activation
        lay = _layout(self.out_features, self.in_features)
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
        _check_bool("prune", prune)
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
            if (isinstance(t, Tensor) and isinstance(out, Tensor) and t.dtype in _HALF
                    and out.is_floating_point() and out.dtype not in _HALF):
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


# ---------------------------------------------------------------------------------------------
# model conversion
# ---------------------------------------------------------------------------------------------
def default_filter(name: str, module: torch.nn.Module) -> bool:
    """The MLP projections of a Llama-family model: ``nn.Linear`` children of a module named
    ``mlp`` (``model.layers.N.mlp.{gate,up,down}_proj`` in Llama, Mistral, Qwen2, Gemma)."""
    parts = name.split(".")
    return isinstance(module, torch.nn.Linear) and len(parts) >= 2 and parts[-2] == "mlp"


@dataclass
class SparsifyReport:
    """What :func:`sparsify` did. ``parameters``: weight elements of the converted layers;
    ``pruned``: non-zero weights set to zero by pruning; perplexities (exp of the mean next-token
    cross entropy over ``tokens`` tokens) and whether every logit was finite, before and after,
    when text was given (else None)."""
    layers: list = field(default_factory=list)
    parameters: int = 0
    pruned: int = 0
    tokens: Optional[int] = None
    perplexity_before: Optional[float] = None
    perplexity_after: Optional[float] = None
    logits_finite_before: Optional[bool] = None
    logits_finite_after: Optional[bool] = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def perplexity_ratio(self) -> Optional[float]:
        """perplexity_after / perplexity_before (None without text)."""
        if self.perplexity_before is None or self.perplexity_after is None:
            return None
        return self.perplexity_after / self.perplexity_before

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(n_layers=self.n_layers, perplexity_ratio=self.perplexity_ratio)
        return d

    def __str__(self) -> str:
        s = (f"sparsify: {self.n_layers} layers -> SparseLinear, {self.parameters:,} weights, "
             f"{self.pruned:,} pruned ({100.0 * self.pruned / max(self.parameters, 1):.1f}%)")
        if self.perplexity_before is not None:
            s += (f"; perplexity {self.perplexity_before:.4g} -> {self.perplexity_after:.4g} "
                  f"(x{self.perplexity_ratio:.4g}) on {self.tokens} tokens; logits finite: "
                  f"{self.logits_finite_before} -> {self.logits_finite_after}")
        return s


def _token_ids(text: str, tokenizer: Any, vocab_size: Optional[int], max_tokens: int) -> list[int]:
    if tokenizer is None:
        ids = list(text.encode("utf-8"))
        if vocab_size is not None and vocab_size < 256:
            raise ArgumentError(f"tokenizer: expected a tokenizer for a model with a vocabulary of {vocab_size} "
                                f"(< 256: UTF-8 bytes do not fit), got None")
    else:
        enc = tokenizer(text)
        ids = enc["input_ids"] if isinstance(enc, Mapping) or hasattr(enc, "keys") else enc
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        ids = list(ids)
        if ids and isinstance(ids[0], (list, tuple)):
            ids = list(ids[0])
    if len(ids) < 2:
        raise ArgumentError(f"text: expected at least 2 tokens, got {len(ids)}")
    return ids[:max_tokens]


def perplexity(model: torch.nn.Module, input_ids: Tensor) -> tuple[float, bool]:
    """(exp(mean next-token cross entropy), all logits finite) of a causal LM on ``input_ids``
    (1, T) int64 on the model's device; logits read in fp32. No gradients."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        finite = bool(torch.isfinite(logits).all())
        nll = F.cross_entropy(logits[0, :-1].float(), input_ids[0, 1:])
    return float(torch.exp(nll)), finite


def sparsify(model: torch.nn.Module, filter: Optional[Callable[[str, torch.nn.Module], bool]] = None, *,
             text: Optional[str] = None, tokenizer: Any = None, prune: bool = True,
             max_tokens: int = 1024) -> SparsifyReport:
    """Convert chosen ``nn.Linear`` layers of ``model`` to 2:4 :class:`~ferroattn.nn.SparseLinear`
    in place (weights pruned by magnitude, :func:`prune`'s rule, then compressed on the weights'
    device), and report what changed.

    Args:
        model: any module; its chosen layers need fp16/bf16 weights.
        filter: ``filter(qualified_name, module) -> bool`` picks the layers (only ``nn.Linear``
            ones are converted); default :func:`default_filter` (a Llama-family model's MLP
            projections).
        text, tokenizer: when text is given, the perplexity of a causal LM (``model(input_ids=)
            .logits``) on it is measured before and after; tokenizer: a transformers tokenizer or
            any callable returning ids (``tokenizer(text)["input_ids"]`` or a list); None: UTF-8
            bytes as ids (vocabulary >= 256).
        prune: a bool (TypeError otherwise). False: the weights must already be 2:4 (else
            ValueError naming the layer).
        max_tokens: at most this many tokens of text are scored.
    Returns: :class:`SparsifyReport`.
    Raises: ArgumentError when the filter matches no nn.Linear or the text has < 2 tokens;
        DTypeError (naming the layer) for weights that are not fp16/bf16; compress's errors.
    """

    _check_bool("prune", prune)   # before anything is converted
    pick = filter or default_filter
    chosen = [(name, mod) for name, mod in model.named_modules()
              if name and isinstance(mod, torch.nn.Linear) and not isinstance(mod, SparseLinear) and pick(name, mod)]
    if not chosen:
        raise ArgumentError("filter: expected to match at least one nn.Linear layer of the model, matched none")
    for name, mod in chosen:
        if mod.weight.dtype not in _HALF:
            raise DTypeError(f"{name}: expected a float16 or bfloat16 weight, got {mod.weight.dtype} "
                             f"(convert the model with .to(torch.bfloat16) first)")
    report = SparsifyReport()
    ids = None
    if text is not None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        dev = next(model.parameters()).device
        ids = torch.tensor([_token_ids(text, tokenizer, vocab, max_tokens)], dtype=torch.long, device=dev)
        report.tokens = ids.shape[1]
        report.perplexity_before, report.logits_finite_before = perplexity(model, ids)
    for name, mod in chosen:
        try:
            sl = SparseLinear.from_dense(mod, prune=prune)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        with torch.no_grad():
            nnz_before = int(torch.count_nonzero(mod.weight))
            nnz_after = int(torch.count_nonzero(decompress(sl.weight)))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, sl)
        report.layers.append(name)
        report.parameters += mod.weight.numel()
        report.pruned += nnz_before - nnz_after
    if ids is not None:
        report.perplexity_after, report.logits_finite_after = perplexity(model, ids)
    return report
