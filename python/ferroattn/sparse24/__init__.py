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

Modules (every public name is importable from here): :mod:`.tensor` (:class:`Sparse24Tensor`,
:func:`compress`, :func:`decompress`), :mod:`.pruning` (:func:`prune`, :func:`is_sparse24`),
:mod:`.dispatch` (the table and :func:`choose_backend`), :mod:`.product` (:func:`matmul`),
:mod:`.linear` (:class:`SparseLinear`, also ``ferroattn.nn.SparseLinear``) and :mod:`.convert`
(:func:`sparsify`, :class:`SparsifyReport`, :func:`perplexity`: model conversion to SparseLinear).
Each imports only the ones listed before it.
"""
from __future__ import annotations

from ..ops.activation import PUBLIC as ACTIVATIONS
from .convert import SparsifyReport, default_filter, perplexity, sparsify
from .dispatch import DISPATCH_TABLE, SPARSE_MIN_SPEEDUP, choose_backend, load_dispatch_table, set_dispatch_table
from .linear import SparseLinear
from .product import BACKENDS, matmul
from .pruning import is_sparse24, prune
from .tensor import Sparse24Tensor, compress, decompress

__all__ = ["Sparse24Tensor", "prune", "compress", "decompress", "matmul", "sparsify", "SparsifyReport",
           "is_sparse24", "choose_backend", "set_dispatch_table", "load_dispatch_table", "DISPATCH_TABLE",
           "SPARSE_MIN_SPEEDUP", "ACTIVATIONS", "BACKENDS", "default_filter", "perplexity", "SparseLinear"]
