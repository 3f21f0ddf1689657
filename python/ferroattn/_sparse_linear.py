"""An earlier import path of :class:`ferroattn.nn.SparseLinear` (now defined in
:mod:`ferroattn.sparse24.linear`), kept so that ``from ferroattn._sparse_linear import
SparseLinear`` and pickles that name this module still load.
"""
from __future__ import annotations

from .sparse24.linear import SparseLinear

__all__ = ["SparseLinear"]
