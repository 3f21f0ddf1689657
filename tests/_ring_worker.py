"""One rank of the CPU ring tests (tests/test_distributed_ring.py): gloo, float64, the block
kernels replaced by exact references (ferroattn.testing has none for a block with a given LSE),
so the ring's scheduling, communication and merging are checked exactly."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _expand(x, h):
    return x.repeat_interleave(h // x.shape[2], dim=2)


def _scores(q, k, scale, causal):
    s = torch.einsum("bqhd,bkhd->bhqk", q, _expand(k, q.shape[2])) * scale
    if causal:  # bottom-right: row i sees keys j <= i + s_k - s_q
        i = torch.arange(q.shape[1])[:, None]
        j = torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(j > i + k.shape[1] - q.shape[1], float("-inf"))
    return s


def ref_block_forward(q, k, v, scale, causal):
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.shape[2]))
    return out.to(q.dtype), torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def ref_block_backward(dout, q, k, v, out, lse, scale, causal, deterministic):
    h, hk = q.shape[2], k.shape[2]
    p = torch.nan_to_num(torch.exp(_scores(q, k, scale, causal) - lse[..., None]))
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, _expand(v, h))
    dd = (dout * out).sum(-1).transpose(1, 2)  # (b, h, s_q)
    ds = p * (dp - dd[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand(k, h)) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = lambda x: x.view(x.shape[0], x.shape[1], hk, h // hk, x.shape[3]).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def run(rank: int, world: int, port: int, case: dict, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import ferroattn.distributed.ring as ring
        from ferroattn.distributed import ring_flash_attn_func, zigzag_ring_flash_attn_func, zigzag_shard

        ring._block_forward, ring._block_backward = ref_block_forward, ref_block_backward
        g = torch.Generator().manual_seed(case["seed"])
        b, s, h, hk, d = case["shape"]
        q, k, v, dout = (torch.randn(b, s * world, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
        if case["zigzag"]:
            part = lambda x: zigzag_shard(x, rank, world)  # noqa: E731
            fn = zigzag_ring_flash_attn_func
        else:
            part = lambda x: x.chunk(world, dim=1)[rank].clone()  # noqa: E731
            fn = ring_flash_attn_func
        ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
        out, lse, _ = fn(ql, kl, vl, causal=case["causal"], return_attn_probs=True)
        grads = torch.autograd.grad(out, (ql, kl, vl), part(dout))
        torch.save({"out": out.detach(), "lse": lse, "grads": [x.detach() for x in grads]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
