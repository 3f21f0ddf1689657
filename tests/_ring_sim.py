"""The ring of ferroattn.distributed in one process: N ranks as N threads on one device, their
point-to-point transfers through in-memory slots instead of torch.distributed, so the ring loops,
the block plan, the LSE merge and (on a GPU) the real kernels run unchanged without a process
group. Used by tests/test_distributed_ring.py (CPU, exact reference kernels) and
tests/test_gpu_ring_sim.py (GPU, the attention kernels)."""
from __future__ import annotations

import queue
import threading

import torch

from ferroattn.distributed import ring as ring_mod
from ferroattn.distributed.ring import _Padded, _RingAttention, _Varlen


class SimRing:
    """One rank's transport (the interface of ferroattn.distributed.ring._Ring): the k-th
    ``start`` of rank r delivers to the k-th ``start`` of rank r + 1, as matched point-to-point
    sends and receives do."""

    def __init__(self, rank: int, world: int, slots: "Slots"):
        self.rank, self.world, self.slots, self.sent = rank, world, slots, 0

    def start(self, tensors):
        copies = [t.detach().clone() for t in tensors]
        if copies and copies[0].is_cuda:
            torch.cuda.current_stream().synchronize()   # the receiver reads them on its own stream
        self.slots.get((self.rank + 1) % self.world, self.sent).put(copies)
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        request = (self, self.sent, recv)
        self.sent += 1
        return recv, [request]

    @staticmethod
    def wait(requests) -> None:
        for ring, k, recv in requests:
            got = ring.slots.get(ring.rank, k).get(timeout=120)
            for r, g in zip(recv, got):
                r.copy_(g)


class Slots:
    """(receiver, message index) -> a one-message queue, made on first use by either side."""

    def __init__(self):
        self.lock, self.queues = threading.Lock(), {}

    def get(self, receiver: int, k: int) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((receiver, k), queue.Queue(maxsize=1))


def run_ranks(world: int, fn):
    """``fn(rank, transport)`` for every rank, each in its own thread; the results in rank order
    (the first error is raised again)."""
    slots = Slots()
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r, SimRing(r, world, slots))
        except BaseException as e:   # noqa: BLE001  (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


def ring_attention(q, k, v, transport, causal: bool, zigzag: bool, cu_seqlens=None, max_seqlen=None,
                   deterministic: bool = False):
    """(out, lse) of one rank's part through the ring's autograd function, as
    ring_flash_attn_func / ring_flash_attn_varlen_func run it (without their process-group
    checks)."""
    layout = _Padded(q.shape[1]) if cu_seqlens is None else _Varlen(cu_seqlens, max_seqlen)
    return _RingAttention.apply(q, k, v, layout, q.shape[-1] ** -0.5, causal, zigzag, deterministic, transport)


def ring_attention_with_grads(q, k, v, dout, transport, causal: bool, zigzag: bool, cu_seqlens=None,
                              max_seqlen=None, deterministic: bool = False):
    """(out, (dq, dk, dv)) of one rank's part: the autograd function's forward and backward
    bodies called directly. On CUDA the autograd engine runs every thread's backward on one
    worker thread per device, so N rank threads blocking on each other's transfers inside
    ``torch.autograd.grad`` would wait forever; calling the bodies keeps each rank on its thread
    (the real ring has one process per rank and never meets this)."""
    layout = _Padded(q.shape[1]) if cu_seqlens is None else _Varlen(cu_seqlens, max_seqlen)
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        out, lse = ring_mod._forward(transport, layout, q, k, v, scale, causal, zigzag)
        grads = ring_mod._backward(transport, layout, dout, q, k, v, out, lse, scale, causal, zigzag, deterministic)
    return out, grads


__all__ = ["SimRing", "Slots", "ring_attention", "ring_attention_with_grads", "ring_mod", "run_ranks"]
