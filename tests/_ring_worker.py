"""One rank of the CPU ring tests (tests/test_distributed_ring.py): gloo, float64, the block
kernels replaced by exact references (ferroattn.testing has none for a block with a given LSE),
so the ring's scheduling, communication and merging are checked exactly."""
from __future__ import annotations

import os
import sys

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


def _padded_forward(q, k, v, scale, causal):
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.shape[2]))
    return out.to(q.dtype), torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def _sequences(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]


def ref_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """The block kernels' forward (padded, or varlen: each sequence alone, LSE (h, total))."""
    if cu_q is None:
        return _padded_forward(q, k, v, scale, causal)
    outs, lses = [], []
    for sq, sk in _sequences(cu_q, cu_k):
        o, l = _padded_forward(q[sq][None], k[sk][None], v[sk][None], scale, causal)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def ref_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic):
    if cu_q is None:
        return _padded_backward(dout, q, k, v, out, lse, scale, causal)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk in _sequences(cu_q, cu_k):
        g = _padded_backward(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], out[sq][None], lse[:, sq][None],
                             scale, causal)
        dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _padded_backward(dout, q, k, v, out, lse, scale, causal):
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


def main(rank: int, world: int, case: dict, out_dir: str) -> None:
    """The spawned process: :func:`run`, then an exit that skips the interpreter's finalization.

    Once the rank's results are saved and its process group is destroyed, nothing is left to
    check; what could still go wrong is gloo's threads meeting the interpreter's teardown (an
    occasional ``terminate called without an active exception``, SIGABRT), which says nothing of
    the ring. An exception in :func:`run` still ends the process with a non-zero exit code."""
    run(rank, world, case, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(rank: int, world: int, case: dict, out_dir: str) -> None:
    # a file store in the test's own folder: no TCP port to pick, so none to race for
    store = os.path.join(out_dir, "gloo-store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        import ferroattn.distributed.ring as ring

        ring._block_forward, ring._block_backward = ref_block_forward, ref_block_backward
        runner = (_run_llama3 if "llama3" in case else _run_hf if "hf" in case
                  else _run_varlen if "cu_seqlens" in case else _run_padded)
        runner(rank, world, case, out_dir)
        dist.barrier()   # every rank done with its collectives before any tears its group down
    finally:
        dist.destroy_process_group()


def _run_padded(rank, world, case, out_dir):
    from ferroattn.distributed import ring_flash_attn_func, zigzag_ring_flash_attn_func, zigzag_shard

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


def varlen_inputs(case):
    """The whole packed q, k, v, dout of a varlen case (float64), global cu_seqlens int32."""
    g = torch.Generator().manual_seed(case["seed"])
    total, (h, hk, d) = case["cu_seqlens"][-1], case["heads"]
    q, k, v, dout = (torch.randn(total, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    return q, k, v, dout, torch.tensor(case["cu_seqlens"], dtype=torch.int32)


def _run_varlen(rank, world, case, out_dir):
    from ferroattn.distributed import ring_flash_attn_varlen_func, shard_varlen, zigzag_ring_flash_attn_varlen_func

    q, k, v, dout, cu = varlen_inputs(case)
    part = lambda x: shard_varlen(x, cu, rank, world, zigzag=case["zigzag"])  # noqa: E731
    local_cu = (cu // world).to(torch.int32)
    max_local = int((local_cu[1:] - local_cu[:-1]).max())
    fn = zigzag_ring_flash_attn_varlen_func if case["zigzag"] else ring_flash_attn_varlen_func
    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    out, lse, _ = fn(ql, kl, vl, local_cu, max_local, causal=case["causal"], return_attn_probs=True)
    grads = torch.autograd.grad(out, (ql, kl, vl), part(dout))
    torch.save({"out": out.detach(), "lse": lse, "grads": [x.detach() for x in grads]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _run_llama3(rank, world, case, out_dir):
    from ferroattn.distributed import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    q, k, v, dout, cu = varlen_inputs(case)
    per = cu[-1].item() // world
    part = lambda x: x[rank * per:(rank + 1) * per].clone()  # noqa: E731
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, case["causal"], rank, world)
    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    out, lse, _ = llama3_flash_attn_varlen_func(ql, kl, vl, cu_q, cu_k, max_q, max_k, case["llama3"], k_slice,
                                                causal=case["causal"], return_attn_probs=True)
    grads = torch.autograd.grad(out, (ql, kl, vl), part(dout))
    torch.save({"out": out.detach(), "lse": lse, "grads": [x.detach() for x in grads]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def tiny_llama(attn_implementation: str):
    """A 2-layer Llama (GQA 4/2, head dim 8) in float64, the same weights on every call."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return model.to(torch.float64)


def hf_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, s = case["hf"]
    ids = torch.randint(0, 64, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)   # shifted on the whole sequence
    return ids, torch.arange(s).expand(b, s), labels


def _run_hf(rank, world, case, out_dir):
    import ferroattn.integrations.transformers as fa_hf
    from ferroattn.distributed import context_parallel, shard_sequence

    fa_hf.register()
    model = tiny_llama("ferroattn")
    ids, pos, labels = shard_sequence(*hf_inputs(case), zigzag=case["zigzag"])
    n = (labels != -100).sum()
    dist.all_reduce(n)   # the whole batch's label count: each rank's loss is its share of the mean
    with context_parallel(zigzag=case["zigzag"]):
        out = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels, num_items_in_batch=n)
        out.loss.backward()
    grads = {k: p.grad.detach() for k, p in model.named_parameters() if p.grad is not None}
    for gr in grads.values():
        dist.all_reduce(gr)
    torch.save({"logits": out.logits.detach(), "loss": out.loss.detach(), "n": n, "grads": grads},
               os.path.join(out_dir, f"rank{rank}.pt"))
