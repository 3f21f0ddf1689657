"""Context parallelism: attention over a sequence split across the ranks of a torch.distributed
process group (NCCL on GPUs), forward and backward.

- :func:`ring_flash_attn_func`: rank r holds chunk r of the sequence; K/V blocks travel around the
  ring and each rank merges the blocks' outputs through their softmax LSE (fp32).
- :func:`zigzag_ring_flash_attn_func`: rank r holds chunks r and 2N − 1 − r (of 2N), so every rank
  does the same causal work (:func:`zigzag_shard` / :func:`zigzag_unshard` lay a sequence out).
- :func:`ring_flash_attn_varlen_func` / :func:`zigzag_ring_flash_attn_varlen_func`: the same for
  packed sequences (``cu_seqlens``), each sequence split across the ranks
  (:func:`shard_varlen` / :func:`unshard_varlen`).
- :func:`llama3_flash_attn_varlen_func` (with :func:`llama3_flash_attn_prepare_cu_seqlens`): the
  packed batch split in order across the ranks, K/V all-gathered (Llama 3's scheme).
- :func:`context_parallel` / :func:`shard_sequence`: a transformers model with
  ``attn_implementation="ferroattn"`` on a batch sharded along the sequence (:mod:`.context`).

Arguments as the ring-flash-attention project's functions (flash_attn's, plus ``group``)."""
from .context import context_parallel, shard_sequence
from .layout import shard_varlen, unshard_varlen, zigzag_shard, zigzag_unshard
from .llama3 import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
from .merge import merge_attention
from .ring import (ring_flash_attn_func, ring_flash_attn_varlen_func, zigzag_ring_flash_attn_func,
                   zigzag_ring_flash_attn_varlen_func)

__all__ = ["context_parallel", "shard_sequence", "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "merge_attention", "ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard_varlen",
           "unshard_varlen", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_varlen_func", "zigzag_shard",
           "zigzag_unshard"]
