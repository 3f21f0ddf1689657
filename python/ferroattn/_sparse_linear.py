"""The import path of :class:`ferroattn.nn.SparseLinear` before it moved into
:mod:`ferroattn.sparse24` (beside the tensor functions it is built on, which it used to take as
private names); kept so that ``from ferroattn._sparse_linear import SparseLinear`` and pickles
that name this module still load.
"""
from __future__ import annotations

from .sparse24 import SparseLinear

__all__ = ["SparseLinear"]
