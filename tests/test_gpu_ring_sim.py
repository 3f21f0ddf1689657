"""GPU test of context parallelism on one GPU: the ring of ferroattn.distributed simulated in one
process (tests/_ring_sim.py: N ranks as threads, in-memory transfers instead of NCCL), running the
real attention kernels on each block and the fp32 LSE merge (the ring's forward and backward
bodies, called per rank thread), against the reference attention of
the whole sequence (ferroattn.testing) with the pass rule of DESIGN §5 -- padded and varlen, plain
and zigzag, causal and not, forward and backward (GQA 8/2, d 128, bf16).

Marker ``gpu``: skipped without CUDA; run by scripts/gpu_check.sh (pytest stage)."""
from __future__ import annotations

import pytest
import torch

from _gpu_common import BF16, DEV, rand
from ferroattn.distributed import shard_varlen, unshard_varlen, zigzag_shard, zigzag_unshard
from ferroattn.testing import (assert_close_to_ref, attention_grads_ref, attention_ref, attention_varlen_ref,
                               random_cu_seqlens)

import _ring_sim

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("world,zigzag,causal", [(2, True, True), (4, True, True), (4, False, True), (2, False, False)])
def test_simulated_ring_matches_whole_sequence_attention(world, zigzag, causal, varlen):
    torch.manual_seed(world * 10 + varlen)
    h, hk, d = 8, 2, 128
    unit = 2 * world * 16
    if varlen:
        cu = random_cu_seqlens([unit, 3 * unit, 2 * unit], device=DEV)
        full = lambda n: rand(int(cu[-1]), n, d)  # noqa: E731
        part = lambda x, r: shard_varlen(x, cu, r, world, zigzag=zigzag)  # noqa: E731
        join = lambda parts: unshard_varlen(parts, cu, zigzag=zigzag)  # noqa: E731
        local_cu = (cu // world).to(torch.int32)
        extra = dict(cu_seqlens=local_cu, max_seqlen=int((local_cu[1:] - local_cu[:-1]).max()))
    else:
        cu, extra = None, {}
        full = lambda n: rand(2, 4 * unit, n, d)  # noqa: E731
        if zigzag:
            part, join = (lambda x, r: zigzag_shard(x, r, world)), zigzag_unshard
        else:
            part = lambda x, r: x.chunk(world, dim=1)[r].contiguous()  # noqa: E731
            join = lambda parts: torch.cat(parts, dim=1)  # noqa: E731
    q, k, v, dout = full(h), full(hk), full(hk), full(h)

    def rank_fn(r, transport):
        ql, kl, vl = (part(x, r) for x in (q, k, v))
        # the forward and backward bodies, not autograd (whose CUDA backward runs every rank
        # thread's on one worker thread: see ring_attention_with_grads)
        out, grads = _ring_sim.ring_attention_with_grads(ql, kl, vl, part(dout, r), transport, causal, zigzag,
                                                         **extra)
        torch.cuda.synchronize()
        return out, grads

    res = _ring_sim.run_ranks(world, rank_fn)
    out = join([r[0] for r in res])
    if varlen:
        ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
        ref_lp, _ = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
    else:
        ref, _ = attention_ref(q, k, v, causal=causal)
        ref_lp, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert out.dtype == BF16
    assert_close_to_ref(out.float(), ref, ref_lp.float())
    g_ref = attention_grads_ref(q, k, v, dout, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
    g_lp = attention_grads_ref(q, k, v, dout, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, upcast=False)
    for i, name in enumerate(("dq", "dk", "dv")):
        got = join([r[1][i] for r in res])
        assert_close_to_ref(got.float(), g_ref[i].float(), g_lp[i].float(), factor=3.0, name=name)
