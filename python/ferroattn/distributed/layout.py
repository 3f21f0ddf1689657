"""The zigzag layout of a sequence over N ranks: the sequence is cut into 2N equal chunks and
rank r holds chunks r and 2N − 1 − r, concatenated. With a causal mask chunk c costs c + 1/2
chunk-pairs of work, so every rank's pair costs 2N (Brandon et al., "Striped Attention", 2023,
and the ring-flash-attention project's zigzag scheme)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ArgumentError


def _chunks(x: Tensor, world_size: int, dim: int):
    if world_size < 1:
        raise ArgumentError(f"world_size: expected >= 1, got {world_size}")
    n = x.shape[dim]
    if n % (2 * world_size) != 0:
        raise ArgumentError(f"x: expected dim {dim} to be a multiple of 2 · world_size = {2 * world_size}, got {n}")
    return x.chunk(2 * world_size, dim=dim)


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``x``: chunks rank and 2·world_size − 1 − rank of dim ``dim`` (whose
    size must be a multiple of 2·world_size), concatenated (a new tensor). Raises ArgumentError."""
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank: expected in [0, {world_size}), got {rank}")
    c = _chunks(x, world_size, dim)
    return torch.cat([c[rank], c[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(parts, dim: int = 1) -> Tensor:
    """The inverse of :func:`zigzag_shard`: ``parts[r]`` is rank r's part (all of one shape); returns
    the whole sequence along ``dim``."""
    n = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    order = [halves[r][0] for r in range(n)] + [halves[n - 1 - i][1] for i in range(n)]
    return torch.cat(order, dim=dim)
