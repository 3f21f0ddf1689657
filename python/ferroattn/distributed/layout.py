"""The zigzag layout of a sequence over N ranks: the sequence is cut into 2N equal chunks and
rank r holds chunks r and 2N − 1 − r, concatenated. With a causal mask chunk c costs c + 1/2
chunk-pairs of work, so every rank's pair costs 2N (Brandon et al., "Striped Attention", 2023,
and the ring-flash-attention project's zigzag scheme)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ..errors import ArgumentError


def _is_int(v) -> bool:
    """An int, numpy int included (bools excluded)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_world(world_size) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise ArgumentError(f"world_size: expected an int >= 1, got {world_size!r}")


def _check_rank(rank, world_size) -> None:
    _check_world(world_size)
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ArgumentError(f"rank: expected an int in [0, {world_size}), got {rank!r}")


def _check_parts(parts, dim: int, halves: bool) -> list:
    """``parts`` as a list of tensors of one shape (each even along ``dim`` when it holds two
    halves); ArgumentError naming ``parts`` otherwise."""
    if isinstance(parts, Tensor) or not isinstance(parts, (list, tuple)) or not parts:
        raise ArgumentError(f"parts: expected a non-empty list of tensors (one per rank), got {type(parts).__name__}")
    for r, p in enumerate(parts):
        if not isinstance(p, Tensor):
            raise ArgumentError(f"parts[{r}]: expected a Tensor, got {type(p).__name__}")
    shape = tuple(parts[0].shape)
    for r, p in enumerate(parts):
        if tuple(p.shape) != shape:
            raise ArgumentError(f"parts[{r}]: expected the shape of parts[0], {shape}, got {tuple(p.shape)}")
    if not _is_int(dim) or not -len(shape) <= dim < len(shape):
        raise ArgumentError(f"dim: expected an int in [{-len(shape)}, {len(shape)}) for parts of shape {shape}, "
                            f"got {dim!r}")
    if halves and shape[dim] % 2:
        raise ArgumentError(f"parts: expected an even size along dim {dim} (two zigzag chunks per rank), "
                            f"got {shape[dim]}")
    return list(parts)


def _check_dim(x, dim) -> None:
    if not isinstance(x, Tensor):
        raise ArgumentError(f"x: expected a Tensor, got {type(x).__name__}")
    if not _is_int(dim) or not -x.dim() <= dim < x.dim():
        raise ArgumentError(f"dim: expected an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, "
                            f"got {dim!r}")


def _chunks(x: Tensor, world_size: int, dim: int):
    _check_world(world_size)
    _check_dim(x, dim)
    n = x.shape[dim]
    if n % (2 * world_size) != 0:
        raise ArgumentError(f"x: expected dim {dim} to be a multiple of 2 · world_size = {2 * world_size}, got {n}")
    return x.chunk(2 * world_size, dim=dim)


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``x``: chunks rank and 2·world_size − 1 − rank of dim ``dim`` (whose
    size must be a multiple of 2·world_size), concatenated (a new tensor). Raises ArgumentError."""
    _check_rank(rank, world_size)
    rank, world_size = int(rank), int(world_size)
    c = _chunks(x, world_size, dim)
    return torch.cat([c[rank], c[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(parts, dim: int = 1) -> Tensor:
    """The inverse of :func:`zigzag_shard`: ``parts[r]`` is rank r's part (all of one shape); returns
    the whole sequence along ``dim``. Raises ArgumentError (an empty list, parts of different
    shapes or of an odd size along ``dim``)."""
    parts = _check_parts(parts, dim, halves=True)
    n = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    order = [halves[r][0] for r in range(n)] + [halves[n - 1 - i][1] for i in range(n)]
    return torch.cat(order, dim=dim)


def _offsets(cu_seqlens, world_size: int, zigzag: bool):
    _check_world(world_size)
    if isinstance(cu_seqlens, Tensor) and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()):
        raise ArgumentError(f"cu_seqlens: expected a 1-D integer tensor or list of ints, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
    if not isinstance(cu_seqlens, (Tensor, list, tuple)):
        raise ArgumentError(f"cu_seqlens: expected a 1-D integer tensor or list of ints, got {type(cu_seqlens).__name__}")
    c = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    if not all(_is_int(v) for v in c):
        raise ArgumentError(f"cu_seqlens: expected a 1-D integer tensor or list of ints, got {c}")
    unit = 2 * world_size if zigzag else world_size
    lens = [b - a for a, b in zip(c[:-1], c[1:])]
    if not c or c[0] != 0 or any(n < 0 or n % unit for n in lens):
        raise ArgumentError(f"cu_seqlens: expected offsets from 0 whose lengths are multiples of {unit} "
                            f"({'2 · ' if zigzag else ''}world_size), got {c}")
    return c, lens, unit


def shard_varlen(x: Tensor, cu_seqlens, rank: int, world_size: int, zigzag: bool = False, dim: int = 0) -> Tensor:
    """Rank ``rank``'s part of packed sequences ``x`` (offsets ``cu_seqlens`` along ``dim``, the
    global ones): each sequence split in ``world_size`` chunks (rank r takes chunk r) or, with
    ``zigzag``, in 2·world_size chunks (rank r takes chunks r and 2·world_size − 1 − r), packed in
    sequence order; its local offsets are ``cu_seqlens // world_size``. A new tensor. Raises
    ArgumentError (lengths that do not split evenly, a rank outside the world)."""
    _check_rank(rank, world_size)
    rank, world_size = int(rank), int(world_size)
    c, lens, unit = _offsets(cu_seqlens, world_size, zigzag)
    _check_dim(x, dim)
    if not isinstance(zigzag, bool):
        raise ArgumentError(f"zigzag: expected a bool, got {zigzag!r}")
    if c[-1] != x.shape[dim]:
        raise ArgumentError(f"cu_seqlens: expected offsets ending at x's {x.shape[dim]} rows along dim {dim}, "
                            f"got {c[-1]}")
    parts = []
    for a, n in zip(c, lens):
        chunks = x.narrow(dim, a, n).chunk(unit, dim=dim) if n else []
        if not chunks:
            continue
        parts.append(chunks[rank])
        if zigzag:
            parts.append(chunks[unit - 1 - rank])
    return torch.cat(parts, dim=dim) if parts else x.narrow(dim, 0, 0).clone()


def unshard_varlen(parts, cu_seqlens, zigzag: bool = False, dim: int = 0) -> Tensor:
    """The inverse of :func:`shard_varlen`: ``parts[r]`` is rank r's part; ``cu_seqlens`` the
    global offsets. Returns the packed sequences along ``dim``. Raises ArgumentError (an empty
    list, parts of different shapes, a part whose size along ``dim`` is not its share of
    ``cu_seqlens``)."""
    parts = _check_parts(parts, dim, halves=False)
    world = len(parts)
    c, lens, unit = _offsets(cu_seqlens, world, zigzag)
    share = (c[-1] - c[0]) // world
    if parts[0].shape[dim] != share:
        raise ArgumentError(f"parts: expected size {share} along dim {dim} (cu_seqlens[-1] / {world} ranks), "
                            f"got {parts[0].shape[dim]}")
    per = [n // unit for n in lens]                  # chunk length of each sequence
    take = 2 if zigzag else 1
    seqs, pos = [], [0] * world
    for n in per:
        got = []
        for r in range(world):
            got.append(parts[r].narrow(dim, pos[r], take * n))
            pos[r] += take * n
        if zigzag:
            halves = [g.chunk(2, dim=dim) if n else (g, g) for g in got]
            seqs += [halves[r][0] for r in range(world)] + [halves[world - 1 - i][1] for i in range(world)]
        else:
            seqs += got
    return torch.cat(seqs, dim=dim) if seqs else parts[0].narrow(dim, 0, 0).clone()
