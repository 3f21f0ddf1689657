"""Context parallelism on the CPU (no GPU needed): the LSE merge against the full softmax, the
zigzag and varlen layouts, the ring's block plan (each (query, key) pair of the sequence in
exactly one block with the right mask), and on gloo over 2 and 3 processes -- the block kernels
replaced by exact references (tests/_ring_worker.py) -- the padded and varlen rings (plain and
zigzag) and the all-gather (llama3) scheme against full attention in float64, forward and
backward, and a transformers Llama trained with context parallelism against one process; plus
argument errors. None of this has run with the real kernels on GPUs yet."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from ferroattn.distributed import (llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func,
                                   merge_attention, ring_flash_attn_varlen_func, shard_varlen, unshard_varlen,
                                   zigzag_ring_flash_attn_varlen_func, zigzag_shard, zigzag_unshard)
from ferroattn.distributed.ring import block_plan, ring_flash_attn_func
from ferroattn.errors import ArgumentError

import _ring_worker


def test_merge_of_key_blocks_equals_the_full_softmax():
    torch.manual_seed(0)
    b, s, h, d, n = 2, 5, 3, 4, 11
    scores = torch.randn(b, h, s, n, dtype=torch.float64) * 4
    scores[0, 0, 0, :6] = float("-inf")  # a row whose first block is empty
    v = torch.randn(b, n, h, d, dtype=torch.float64)
    full_lse = torch.logsumexp(scores, -1)
    full = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v)
    out = torch.zeros(b, s, h, d, dtype=torch.float32)
    lse = torch.full((b, h, s), float("-inf"))
    for lo, hi in ((0, 6), (6, 7), (7, 11)):
        blk = scores[..., lo:hi]
        blse = torch.logsumexp(blk, -1)
        bout = torch.einsum("bhqk,bkhd->bqhd", torch.nan_to_num(torch.exp(blk - blse[..., None])), v[:, lo:hi])
        blse = torch.where(torch.isneginf(blse), torch.full_like(blse, float("inf")), blse)  # kernel convention
        out, lse = merge_attention(out, lse, bout, blse.float())
    torch.testing.assert_close(out.double(), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-6, atol=1e-6)


def test_merge_keeps_rows_without_keys_empty():
    out, lse = merge_attention(torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("-inf")),
                               torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("inf")))
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_layout(world):
    x = torch.arange(2 * world * 3).view(1, -1)
    parts = [zigzag_shard(x, r, world) for r in range(world)]
    for r, p in enumerate(parts):
        assert p.tolist()[0] == list(range(3 * r, 3 * r + 3)) + list(range(3 * (2 * world - 1 - r), 3 * (2 * world - r)))
    assert torch.equal(zigzag_unshard(parts), x)
    with pytest.raises(ArgumentError, match="multiple of 2 · world_size"):
        zigzag_shard(torch.zeros(1, 5), 0, world)


def test_layout_argument_errors():
    x = torch.arange(8).view(1, 8)
    for rank, world in [(0.0, 2), (True, 2), (0, 2.0), (0, True), (-1, 2), (2, 2)]:
        name = "^rank" if isinstance(world, int) and not isinstance(world, bool) else "^world_size"
        with pytest.raises(ArgumentError, match=name):
            zigzag_shard(x, rank, world)
        with pytest.raises(ArgumentError, match=name):
            shard_varlen(x[0], [0, 8], rank, world)
    a, b = zigzag_shard(x, 0, 2), zigzag_shard(x, 1, 2)
    with pytest.raises(ArgumentError, match=r"^parts\[1\]: expected the shape of parts\[0\], \(1, 4\), got \(1, 2\)"):
        zigzag_unshard([a, b[:, :2]])
    with pytest.raises(ArgumentError, match="^parts: expected a non-empty list"):
        zigzag_unshard([])
    with pytest.raises(ArgumentError, match="^parts: expected a non-empty list"):
        zigzag_unshard(a)
    with pytest.raises(ArgumentError, match=r"^parts\[0\]: expected a Tensor, got list"):
        zigzag_unshard([[1, 2], b])
    with pytest.raises(ArgumentError, match="^parts: expected an even size along dim 1"):
        zigzag_unshard([a[:, :3], b[:, :3]])
    with pytest.raises(ArgumentError, match="^dim: expected an int in"):
        zigzag_unshard([a, b], dim=2)
    with pytest.raises(ArgumentError, match="^x: expected a Tensor, got list"):
        zigzag_shard([1, 2], 0, 1)
    for dim in (5, "1", 1.0):
        with pytest.raises(ArgumentError, match="^dim: expected an int"):
            zigzag_shard(x, 0, 2, dim=dim)
    with pytest.raises(ArgumentError, match="^dim: expected an int"):
        zigzag_unshard([a, b], dim="1")
    import numpy as np
    assert torch.equal(zigzag_shard(x, np.int64(1), np.int64(2)), b)
    p = [shard_varlen(x[0], [0, 8], r, 2) for r in range(2)]
    assert torch.equal(unshard_varlen(p, [0, 8]), x[0])
    with pytest.raises(ArgumentError, match=r"^parts: expected size 4 along dim 0 \(cu_seqlens\[-1\] / 2 ranks\), got 3"):
        unshard_varlen([t[:3] for t in p], [0, 8])
    with pytest.raises(ArgumentError, match=r"^parts\[1\]: expected the shape"):
        unshard_varlen([p[0], p[1][:3]], [0, 8])


def _positions(rank, world, s, zigzag):
    if not zigzag:
        return list(range(rank * s, (rank + 1) * s))
    c = s // 2
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_plan_covers_each_visible_pair_once(world, causal, zigzag):
    """Over every rank and ring step, the plan's blocks (with their bottom-right causal mask)
    cover each (query, key) pair of the whole sequence that full attention sees exactly once,
    and no other pair."""
    s = 4
    seen = {}
    for rank in range(world):
        for src in range(world):
            qpos, kpos = _positions(rank, world, s, zigzag), _positions(src, world, s, zigzag)
            for qs, ks, c in block_plan(rank, src, s, causal, zigzag):
                rows, keys = qpos[qs], kpos[ks]
                for i, qi in enumerate(rows):
                    for j, kj in enumerate(keys):
                        if not c or j <= i + len(keys) - len(rows):
                            seen[(qi, kj)] = seen.get((qi, kj), 0) + 1
    n = world * s
    want = {(i, j) for i in range(n) for j in range(n) if not causal or j <= i}
    assert set(seen) == want and all(c == 1 for c in seen.values())


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _full_attention(q, k, v, dout, causal, cu=None):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = _ring_worker.ref_block_forward(q, k, v, cu, cu, 0, 0, q.shape[-1] ** -0.5, causal)
    return out.detach(), lse, torch.autograd.grad(out, (q, k, v), dout)


def _spawn_ring(tmp_path, world, case):
    """Run ``case`` on ``world`` gloo ranks (tests/_ring_worker.py); each rank's saved results."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_ring_worker.main, args=(r, world, case, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,zigzag,causal", [(2, False, True), (2, True, True), (3, False, False),
                                                 (3, True, True), (2, False, False)])
def test_ring_equals_full_attention_forward_and_backward(tmp_path, world, zigzag, causal):
    case = {"seed": 7, "shape": (2, 4, 4, 2, 8), "zigzag": zigzag, "causal": causal}  # (b, local s, h, h_k, d)
    res = _spawn_ring(tmp_path, world, case)
    g = torch.Generator().manual_seed(case["seed"])
    b, s, h, hk, d = case["shape"]
    q, k, v, dout = (torch.randn(b, s * world, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    out, lse, grads = _full_attention(q, k, v, dout, causal)
    if zigzag:
        join = zigzag_unshard
        join_lse = lambda parts: zigzag_unshard(parts, dim=2)  # noqa: E731
    else:
        join = lambda parts: torch.cat(parts, dim=1)  # noqa: E731
        join_lse = lambda parts: torch.cat(parts, dim=2)  # noqa: E731
    torch.testing.assert_close(join([r["out"] for r in res]), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(join_lse([r["lse"] for r in res]), lse, rtol=1e-10, atol=1e-10)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(join([r["grads"][i] for r in res]), grads[i], rtol=1e-9, atol=1e-9, msg=name)


def test_ring_argument_errors():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ArgumentError, match="^q: expected a 4-D tensor"):
        ring_flash_attn_func(q[0], q, q)
    with pytest.raises(ArgumentError, match="multiple of 8"):
        ring_flash_attn_func(q[..., :6], q[..., :6], q[..., :6])
    with pytest.raises(ArgumentError, match=r"^k, v: expected q's \(b, s\)"):
        ring_flash_attn_func(q, q[:, :2], q[:, :2])
    with pytest.raises(NotImplementedError, match="^dropout_p"):
        ring_flash_attn_func(q, q, q, 0.1)
    with pytest.raises(NotImplementedError, match="^window_size"):
        ring_flash_attn_func(q, q, q, window_size=(4, 0))
    # malformed values name the argument (as flash_attn_func does), before the group check
    for kw, name in ((dict(window_size=5), "window_size"), (dict(window_size=None), "window_size"),
                     (dict(softmax_scale="x"), "softmax_scale"), (dict(dropout_p="x"), "dropout_p"),
                     (dict(causal="no"), "causal")):
        with pytest.raises(ArgumentError, match=f"^{name}"):
            ring_flash_attn_func(q, q, q, **kw)
    with pytest.raises(ArgumentError, match="^group: torch.distributed is not initialized"):
        ring_flash_attn_func(q, q, q)


def test_llama3_prepare_cu_seqlens_argument_errors():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for args, name in (((cu.float(), True, 0, 2), "cu_seqlens"), ((cu, "no", 0, 2), "causal"),
                       ((cu, True, 0.5, 2), "rank"), ((cu, True, 0, 2.0), "world_size"), ((cu, True, "0", 2), "rank"),
                       ((cu, True, 0, None), "world_size"), ((cu, True, 2, 2), "rank")):
        with pytest.raises(ArgumentError, match=f"^{name}"):
            llama3_flash_attn_prepare_cu_seqlens(*args)


@pytest.mark.parametrize("world,zigzag,causal", [(2, False, True), (2, True, True), (3, True, True),
                                                 (3, False, False), (2, True, False)])
def test_varlen_ring_equals_full_varlen_attention(tmp_path, world, zigzag, causal):
    # three sequences of different lengths (multiples of 2 · world), h 4 over h_k 2, d 8
    unit = 2 * world
    lens = [unit, 3 * unit, 2 * unit]
    cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
    case = {"seed": 11, "cu_seqlens": cu, "heads": (4, 2, 8), "zigzag": zigzag, "causal": causal}
    res = _spawn_ring(tmp_path, world, case)
    q, k, v, dout, cu_t = _ring_worker.varlen_inputs(case)
    out, lse, grads = _full_attention(q, k, v, dout, causal, cu_t)
    join = lambda parts, dim=0: unshard_varlen(parts, cu_t, zigzag=zigzag, dim=dim)  # noqa: E731
    torch.testing.assert_close(join([r["out"] for r in res]), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(join([r["lse"] for r in res], dim=1), lse, rtol=1e-10, atol=1e-10)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(join([r["grads"][i] for r in res]), grads[i], rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_varlen_layout_round_trip(world, zigzag):
    unit = 2 * world if zigzag else world
    cu = [0, unit, unit, 4 * unit, 6 * unit]   # an empty sequence included
    x = torch.arange(cu[-1] * 2).view(cu[-1], 2)
    parts = [shard_varlen(x, cu, r, world, zigzag=zigzag) for r in range(world)]
    assert all(p.shape[0] == cu[-1] // world for p in parts)
    assert torch.equal(unshard_varlen(parts, cu, zigzag=zigzag), x)
    # the last rank's rows of sequence 2 (rows cu[2]..cu[3]): its chunk, then (zigzag) chunk 2·world − 1 − r
    r, n = world - 1, (cu[3] - cu[2]) // unit
    mine = list(range(cu[2] + r * n, cu[2] + (r + 1) * n))
    if zigzag:
        mine += list(range(cu[2] + (unit - 1 - r) * n, cu[2] + (unit - r) * n))
    start = cu[2] // world
    assert (parts[r][start:start + len(mine), 0] // 2).tolist() == mine
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected offsets from 0 whose lengths are multiples"):
        shard_varlen(x, [1, 1 + unit], 0, world, zigzag=zigzag)
    with pytest.raises(ArgumentError, match="^rank"):
        shard_varlen(x, cu, world, world, zigzag=zigzag)


def test_varlen_ring_argument_errors():
    q = torch.zeros(8, 2, 8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ArgumentError, match="^q: expected a 3-D tensor"):
        ring_flash_attn_varlen_func(q[None], q, q, cu, 4)
    with pytest.raises(ArgumentError, match=r"^k, v: expected q's total"):
        ring_flash_attn_varlen_func(q, q[:4], q[:4], cu, 4)
    with pytest.raises(NotImplementedError, match="^window_size"):
        zigzag_ring_flash_attn_varlen_func(q, q, q, cu, 4, window_size=(2, 0))
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected an int32"):
        ring_flash_attn_varlen_func(q, q, q, cu.long(), 4)
    with pytest.raises(ArgumentError, match=r"^cu_seqlens: expected non-decreasing offsets from 0 to q's 8 rows"):
        ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 6], dtype=torch.int32), 4)
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected even local lengths"):
        zigzag_ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 3, 8], dtype=torch.int32), 5)
    with pytest.raises(ArgumentError, match="^max_seqlen: expected an int >= the longest local length 4"):
        ring_flash_attn_varlen_func(q, q, q, cu, 3)
    with pytest.raises(ArgumentError, match="^group: torch.distributed is not initialized"):
        ring_flash_attn_varlen_func(q, q, q, cu, 4)


def test_llama3_prepare_cu_seqlens():
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)   # T 12 over 3 ranks: rows 0-3, 4-7, 8-11
    # rank 1 holds rows 4..7, all of sequence 1 (rows 3..9): causal keys 3..7, else 3..9
    cu_q, cu_k, mq, mk, ks = llama3_flash_attn_prepare_cu_seqlens(cu, True, 1, 3)
    assert cu_q.tolist() == [0, 4] and cu_k.tolist() == [0, 5] and (mq, mk) == (4, 5) and ks == slice(3, 8)
    cu_q, cu_k, mq, mk, ks = llama3_flash_attn_prepare_cu_seqlens(cu, False, 1, 3)
    assert cu_k.tolist() == [0, 7] and mk == 7 and ks == slice(3, 10)
    # rank 2: rows 8..11 = the tail of sequence 1 (8, 9) and sequence 2 (10, 11)
    cu_q, cu_k, mq, mk, ks = llama3_flash_attn_prepare_cu_seqlens(cu, True, 2, 3)
    assert cu_q.tolist() == [0, 2, 4] and cu_k.tolist() == [0, 7, 9] and (mq, mk) == (2, 7) and ks == slice(3, 12)
    assert cu_q.dtype == torch.int32
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected non-decreasing offsets from 0 to a positive total"):
        llama3_flash_attn_prepare_cu_seqlens(torch.tensor([0, 5], dtype=torch.int32), True, 0, 2)
    with pytest.raises(ArgumentError, match="^rank"):
        llama3_flash_attn_prepare_cu_seqlens(cu, True, 3, 3)


@pytest.mark.parametrize("world,causal,stride", [(2, True, 1), (3, True, 2), (2, False, 2), (3, False, 1)])
def test_llama3_all_gather_equals_full_varlen_attention(tmp_path, world, causal, stride):
    # sequences that cross the ranks' row boundaries (T = 12 · world)
    t = 12 * world
    cu = [0, 5, 5 + 7 * world, t - 2, t]
    case = {"seed": 5, "cu_seqlens": cu, "heads": (4, 2, 8), "causal": causal, "llama3": stride}
    res = _spawn_ring(tmp_path, world, case)
    q, k, v, dout, cu_t = _ring_worker.varlen_inputs(case)
    out, lse, grads = _full_attention(q, k, v, dout, causal, cu_t)
    torch.testing.assert_close(torch.cat([r["out"] for r in res]), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["lse"] for r in res], dim=1), lse, rtol=1e-10, atol=1e-10)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in res]), grads[i], rtol=1e-9, atol=1e-9,
                                   msg=name)


def test_llama3_argument_errors():
    q, k = torch.zeros(8, 4, 8), torch.zeros(8, 2, 8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ArgumentError, match="^heads_k_stride: expected a divisor of k's 2 heads"):
        llama3_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, 3, slice(0, 8))
    with pytest.raises(ArgumentError, match="^q: expected a multiple of k's 3 heads"):
        llama3_flash_attn_varlen_func(q, q[:, :3], q[:, :3], cu, cu, 8, 8, 1, slice(0, 8))
    with pytest.raises(NotImplementedError, match="^dropout_p"):
        llama3_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, 1, slice(0, 8), 0.1)
    with pytest.raises(ArgumentError, match="^group: torch.distributed is not initialized"):
        llama3_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, 1, slice(0, 8))


@pytest.mark.parametrize("world,zigzag", [(2, True), (3, False)])
def test_transformers_llama_with_context_parallelism_equals_one_process(tmp_path, world, zigzag):
    """A Llama model with attn_implementation="ferroattn" on a batch sharded along the sequence
    (shard_sequence, global position ids, labels shifted before sharding, the batch's label count
    as num_items_in_batch) inside context_parallel(): the logits are the shards of the one-process
    (eager attention) logits, and the summed losses and gradients equal the one-process ones."""
    pytest.importorskip("transformers")
    case = {"seed": 3, "hf": (2, 12 * world), "zigzag": zigzag}
    res = _spawn_ring(tmp_path, world, case)
    model = _ring_worker.tiny_llama("sdpa")   # float64 throughout (eager runs its softmax in float32)
    ids, pos, labels = _ring_worker.hf_inputs(case)
    n = (labels != -100).sum()
    out = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels, num_items_in_batch=n)
    out.loss.backward()
    if zigzag:
        logits = zigzag_unshard([r["logits"] for r in res])
    else:
        logits = torch.cat([r["logits"] for r in res], dim=1)
    torch.testing.assert_close(logits, out.logits.detach(), rtol=1e-9, atol=1e-9)
    assert int(res[0]["n"]) == int(n)
    # transformers' causal-LM loss runs in float32 (it upcasts the logits with .float())
    torch.testing.assert_close(sum(r["loss"] for r in res), out.loss.detach(), rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(res[0]["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_context_parallel_errors():
    from ferroattn.distributed import context_parallel, shard_sequence
    from ferroattn.distributed.context import active
    import torch.distributed as dist
    from ferroattn.integrations.transformers import ferroattn_attention_forward

    with pytest.raises(ArgumentError, match="^group: torch.distributed is not initialized"):
        with context_parallel():
            pass
    with pytest.raises(ArgumentError, match="^group: torch.distributed is not initialized"):
        shard_sequence(torch.zeros(1, 4))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ArgumentError, match="multiple of 2 · world_size = 2"):
            shard_sequence(torch.zeros(1, 3))
        with pytest.raises(ArgumentError, match=r"^tensors\[1\]: expected a Tensor or None, got list"):
            shard_sequence(torch.zeros(1, 4), [1, 2])
        ids, none = shard_sequence(torch.arange(4)[None], None)
        assert none is None and ids.tolist() == [[0, 1, 2, 3]]
        module = torch.nn.Module()
        module.is_causal = True
        q = torch.zeros(1, 2, 4, 8)
        with context_parallel() as cp:
            assert active() is cp and cp.zigzag
            with pytest.raises(NotImplementedError, match="^attention_mask: context parallelism runs unpadded"):
                ferroattn_attention_forward(module, q, q, q, torch.ones(1, 4, dtype=torch.bool))
            with pytest.raises(NotImplementedError, match="^softcap"):
                ferroattn_attention_forward(module, q, q, q, None, softcap=30.0)
            with pytest.raises(NotImplementedError, match="^window_size"):
                ferroattn_attention_forward(module, q, q, q, None, sliding_window=2)
        assert active() is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("world,zigzag,causal", [(2, True, True), (4, True, True), (3, False, True), (4, False, False)])
def test_ring_simulated_in_one_process(monkeypatch, world, zigzag, causal, varlen):
    """The ring's loops with a threaded one-process transport (tests/_ring_sim.py) and exact block
    kernels equal full attention: the same code the GPU test runs with the real kernels."""
    import _ring_sim

    monkeypatch.setattr(_ring_sim.ring_mod, "_block_forward", _ring_worker.ref_block_forward)
    monkeypatch.setattr(_ring_sim.ring_mod, "_block_backward", _ring_worker.ref_block_backward)
    g = torch.Generator().manual_seed(world)
    unit = 2 * world
    if varlen:
        cu = torch.tensor([0, unit, 4 * unit, 5 * unit], dtype=torch.int32)
        shape = lambda n: (int(cu[-1]), n, 8)  # noqa: E731
        part = lambda x, r: shard_varlen(x, cu, r, world, zigzag=zigzag)  # noqa: E731
        join = lambda parts, dim=0: unshard_varlen(parts, cu, zigzag=zigzag, dim=dim)  # noqa: E731
        local_cu = (cu // world).to(torch.int32)
        extra = dict(cu_seqlens=local_cu, max_seqlen=int((local_cu[1:] - local_cu[:-1]).max()))
    else:
        cu, extra = None, {}
        shape = lambda n: (2, 3 * unit, n, 8)  # noqa: E731
        if zigzag:
            part = lambda x, r: zigzag_shard(x, r, world)  # noqa: E731
            join = lambda parts, dim=1: zigzag_unshard(parts, dim=dim)  # noqa: E731
        else:
            part = lambda x, r: x.chunk(world, dim=1)[r].clone()  # noqa: E731
            join = lambda parts, dim=1: torch.cat(parts, dim=dim)  # noqa: E731
    q, k, v, dout = (torch.randn(*shape(n), generator=g, dtype=torch.float64) for n in (4, 2, 2, 4))

    def rank_fn(r, transport):
        ql, kl, vl = (part(x, r).requires_grad_() for x in (q, k, v))
        out, lse = _ring_sim.ring_attention(ql, kl, vl, transport, causal, zigzag, **extra)
        grads = torch.autograd.grad(out, (ql, kl, vl), part(dout, r))
        # the GPU test's form (the bodies without autograd) gives the same on the same transport
        out2, grads2 = _ring_sim.ring_attention_with_grads(ql.detach(), kl.detach(), vl.detach(), part(dout, r),
                                                           transport, causal, zigzag, **extra)
        return out.detach(), lse, grads, out2, grads2

    res = _ring_sim.run_ranks(world, rank_fn)
    for r in res:
        assert torch.equal(r[3], r[0])
        assert all(torch.equal(a, b) for a, b in zip(r[4], r[2]))
    ref_out, ref_lse, ref_grads = _full_attention(q, k, v, dout, causal, cu)
    torch.testing.assert_close(join([r[0] for r in res]), ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(join([r[1] for r in res], dim=1 if varlen else 2), ref_lse, rtol=1e-10, atol=1e-10)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(join([r[2][i] for r in res]), ref_grads[i], rtol=1e-9, atol=1e-9, msg=name)


def test_merge_and_shard_argument_errors():
    out, lse = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 4)
    with pytest.raises(ArgumentError, match=r"^block_lse: expected \(b, h, s\) = \(1, 2, 4\), got \(1, 2, 1\)"):
        merge_attention(out, lse, out, lse[..., :1])
    with pytest.raises(ArgumentError, match="^block_out: expected out's shape"):
        merge_attention(out, lse, out[..., :1], lse)
    with pytest.raises(ArgumentError, match="^out: expected float32 or float64"):
        merge_attention(out.bfloat16(), lse.bfloat16(), out, lse)
    with pytest.raises(ArgumentError, match=r"^out: expected \(b, s, h, d\)"):
        merge_attention(out[0], lse, out, lse)
    with pytest.raises(ArgumentError, match="^lse: expected a Tensor"):
        merge_attention(out, 0.0, out, lse)
    merged, new = merge_attention(out, lse, out, lse)        # the next valid call works
    assert merged.shape == out.shape and new.shape == lse.shape
    y = torch.arange(12.0).view(12, 1)
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected offsets ending at x's 12 rows"):
        shard_varlen(y, [0, 4], 0, 2)
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected a 1-D integer tensor or list of ints"):
        shard_varlen(y, [0, 4.0, 12], 0, 2)
    with pytest.raises(ArgumentError, match="^cu_seqlens: expected a 1-D integer tensor"):
        shard_varlen(y, torch.tensor([0.0, 12.0]), 0, 2)
    with pytest.raises(ArgumentError, match="^zigzag: expected a bool"):
        shard_varlen(y, [0, 12], 0, 2, zigzag="no")
    with pytest.raises(ArgumentError, match="^dim: expected an int"):
        shard_varlen(y, [0, 12], 0, 2, dim=3)
    assert shard_varlen(y, [0, 12], 1, 2).shape == (6, 1)
