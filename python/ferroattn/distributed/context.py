"""Context parallelism for transformers models: inside :func:`context_parallel`, every attention
call of a model built with ``attn_implementation="ferroattn"`` runs as a ring over a process
group (:func:`ferroattn.distributed.zigzag_ring_flash_attn_func`, or the plain ring), so a model
whose batch is sharded along the sequence (:func:`shard_sequence`) computes exact attention over
the whole sequence. Position ids stay global: shard them like the tokens, and rotary embeddings
see each token's true position.

    import ferroattn.integrations.transformers as fa_hf
    from ferroattn.distributed import context_parallel, shard_sequence
    fa_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ferroattn")
    ids, pos, labels = shard_sequence(input_ids, position_ids, shifted_labels)  # (b, S/N) each
    n = (labels != -100).sum(); torch.distributed.all_reduce(n)                  # the batch's labels
    with context_parallel():
        loss = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels,
                     num_items_in_batch=n).loss
    loss.backward()          # then all-reduce (sum) the gradients over the group

The labels must be shifted on the whole sequence before sharding (``labels[:, 1:]``, then -100
at the end) and passed as ``shift_labels`` (transformers' causal-LM loss then does not shift
again); with the whole batch's label count as ``num_items_in_batch`` each rank's loss is its
share of the batch mean, so the losses and the gradients sum over the group to the one-process
ones. Calls that need more than the ring runs (a padding mask, a sliding window, softcap,
dropout, sinks) raise NotImplementedError inside the block."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch import Tensor

from ..errors import ArgumentError
from .layout import zigzag_shard
from .ring import require_initialized


@dataclass(frozen=True)
class ContextParallel:
    """The active setting: the process group (None = the world) and the layout."""
    group: object = None
    zigzag: bool = True


_ACTIVE: Optional[ContextParallel] = None


def active() -> Optional[ContextParallel]:
    """The setting of the innermost :func:`context_parallel` block, or None outside one."""
    return _ACTIVE


@contextlib.contextmanager
def context_parallel(group=None, zigzag: bool = True):
    """Run the attention of ``attn_implementation="ferroattn"`` models as a ring over ``group``
    (a torch.distributed process group, default the world) within the block: zigzag layout
    (:func:`shard_sequence` with ``zigzag=True``, balanced causal work) or, with
    ``zigzag=False``, rank r holding the r-th contiguous part. Raises ArgumentError when
    torch.distributed is not initialized."""
    global _ACTIVE
    require_initialized()
    before, _ACTIVE = _ACTIVE, ContextParallel(group, bool(zigzag))
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = before


def shard_sequence(*tensors: Optional[Tensor], group=None, zigzag: bool = True, dim: int = 1):
    """This rank's shard of each tensor along the sequence dim ``dim`` (its length a multiple of
    2N for ``zigzag``, N otherwise): zigzag chunks r and 2N − 1 − r (:func:`zigzag_shard`), or the
    r-th of N contiguous parts. None stays None. Returns one tensor for one argument, else a tuple.
    Raises ArgumentError (lengths that do not split evenly, an uninitialised group)."""
    require_initialized()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            out.append(None)
        elif not isinstance(t, Tensor):
            raise ArgumentError(f"tensors[{i}]: expected a Tensor or None, got {type(t).__name__}")
        elif zigzag:
            out.append(zigzag_shard(t, rank, world, dim=dim))
        else:
            n = t.shape[dim]
            if n % world != 0:
                raise ArgumentError(f"x: expected dim {dim} to be a multiple of world_size = {world}, got {n}")
            out.append(t.chunk(world, dim=dim)[rank].clone())
    return out[0] if len(out) == 1 else tuple(out)


__all__ = ["ContextParallel", "active", "context_parallel", "shard_sequence"]
