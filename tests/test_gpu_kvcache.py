"""GPU tests of the kv-cache path: ``flash_attn_with_kvcache`` (append, rotary, paged, batch index,
left pad, splits, variants) and paged ``flash_attn_varlen_func`` against ``ferroattn.testing``'s
references; cache bounds, NaN-filled unused slots, CUDA graphs, torch.compile."""
from __future__ import annotations

import math
import random

import pytest
import torch

from _gpu_common import BF16, DEV, FP16, LSE_ATOL, capture_graph, rand

import ferroattn
from ferroattn import flash_attn_varlen_func, flash_attn_with_kvcache
from ferroattn.errors import ArgumentError
from ferroattn.testing import (assert_close_to_ref, attention_varlen_ref, kvcache_ref, paged_to_contiguous)

pytestmark = pytest.mark.gpu


def _make_cache(b, capacity, h_k, d, dtype, page):
    """(k_cache, v_cache, block_table): contiguous (b, capacity, h_k, d) when page is None, else
    pages of `page` rows in a shuffled pool with 2 spare pages."""
    if page is None:
        return rand(b, capacity, h_k, d, dtype=dtype), rand(b, capacity, h_k, d, dtype=dtype), None
    n = math.ceil(capacity / page)
    pool = b * n + 2
    bt = torch.randperm(pool, device=DEV)[: b * n].to(torch.int32).reshape(b, n)
    return rand(pool, page, h_k, d, dtype=dtype), rand(pool, page, h_k, d, dtype=dtype), bt


def _case(rng):
    page = rng.choice([None, None, 1, 3, 16, 64, 256])
    return dict(
        page=page,
        d=rng.choice([64, 128, 59, 256, 96]),
        heads=rng.choice([(8, 8), (8, 2), (6, 1), (32, 8)]),
        s_q=rng.choice([1, 1, 2, 4, 16, 64]),
        capacity=rng.choice([128, 339, 1024, 4000]),
        new=rng.choice([0, 1, 3]),
        rotary=rng.choice([0.0, 0.5, 1.0]),
        interleaved=rng.choice([True, False]),
        mask=rng.choice(["none", "causal", "local"]),
        alibi=rng.random() < 0.25,
        softcap=rng.choice([0.0, 0.0, 30.0]),
        leftpad=page is None and rng.random() < 0.3,
        batch_idx=page is None and rng.random() < 0.3,
        splits=rng.choice([0, 0, 1, 3]),
        dtype=rng.choice([BF16, FP16]),
    )


CASES = [_case(random.Random(i)) for i in range(48)]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_kvcache_matches_reference(case):
    torch.manual_seed(hash(str(case)) % 2**31)
    c = case
    b = 3
    h, h_k = c["heads"]
    d, dtype, s_q = c["d"], c["dtype"], c["s_q"]
    new = min(c["new"], s_q) if c["new"] else 0
    capacity = max(c["capacity"], s_q + 2)
    b_cache = 5 if c["batch_idx"] else b
    k_cache, v_cache, bt = _make_cache(b_cache, capacity, h_k, d, dtype, c["page"])
    capacity = bt.shape[1] * c["page"] if bt is not None else capacity
    q = rand(b, s_q, h, d, dtype=dtype)
    k = rand(b, new, h_k, d, dtype=dtype) if new else None
    v = rand(b, new, h_k, d, dtype=dtype) if new else None
    lens = torch.randint(0 if new else 1, capacity - max(new, s_q) + 1, (b,), device=DEV, dtype=torch.int32)
    leftpad = (torch.stack([torch.randint(0, max(int(n), 1), (1,), device=DEV)[0] for n in lens]).to(torch.int32)
               if c["leftpad"] else None)
    batch_idx = torch.randperm(b_cache, device=DEV)[:b].to(torch.int32) if c["batch_idx"] else None
    rd = int(c["rotary"] * d) // 16 * 16
    cos = sin = None
    if rd and new:
        angle = torch.rand(capacity, rd // 2, device=DEV) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    causal = c["mask"] == "causal"
    window = (-1, -1)
    if c["mask"] == "local":
        window = (random.Random(s_q).randint(0, capacity), random.Random(d).randint(0, 8))
    alibi = torch.rand(b, h, device=DEV) * 0.3 if c["alibi"] else None
    args = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                block_table=bt, causal=causal, window_size=window, softcap=c["softcap"],
                rotary_interleaved=c["interleaved"], alibi_slopes=alibi)
    ref, ref_lse, kc_ref, vc_ref = kvcache_ref(q, k_cache, v_cache, k, v, **args)
    ref_lp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **args)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=c["splits"], return_softmax_lse=True, **args)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, s_q)
    assert_close_to_ref(out.float(), ref, ref_lp.float(), factor=3.0 if alibi is None else 5.0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= LSE_ATOL * 4 if finite.any() else True
    # the append: k rotated (1 ulp of fp32 ordering allowed), v bit-exact
    assert torch.allclose(kc.float(), kc_ref.float(), rtol=1e-3, atol=1e-3)
    assert torch.equal(vc, vc_ref)


def test_unused_cache_slots_may_hold_nan():
    b, s, h, h_k, d = 2, 700, 8, 2, 128
    q = rand(b, 1, h, d)
    kc, vc = rand(b, s, h_k, d), rand(b, s, h_k, d)
    lens = torch.tensor([100, 513], dtype=torch.int32, device=DEV)
    ref, _, _, _ = kvcache_ref(q, kc, vc, cache_seqlens=lens)
    for i, n in enumerate(lens.tolist()):
        kc[i, n:] = float("nan")
        vc[i, n:] = float("nan")
    for splits in (1, 0, 7):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        assert torch.isfinite(out).all()
        assert (out.float() - ref).abs().max().item() < 2e-2


def test_split_counts_agree():
    b, s, h, h_k, d = 1, 8192, 32, 8, 128
    q, kc, vc = rand(b, 1, h, d), rand(b, s, h_k, d), rand(b, s, h_k, d)
    base = flash_attn_with_kvcache(q, kc, vc, num_splits=1).float()
    for splits in (0, 2, 16, 128):
        out = flash_attn_with_kvcache(q, kc, vc, num_splits=splits).float()
        assert (out - base).abs().max().item() < 1e-2


def test_cache_bounds_are_errors_or_clamped():
    b, s, h, d = 2, 64, 4, 64
    q, kc, vc = rand(b, 1, h, d), rand(b, s, h, d), rand(b, s, h, d)
    k1, v1 = rand(b, 1, h, d), rand(b, 1, h, d)
    with pytest.raises(ArgumentError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=s)
    # paged: a device length past the block table's capacity is an error naming block_table
    pages, pv = rand(4, 16, h, d), rand(4, 16, h, d)
    bt = torch.zeros(b, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pages, pv, cache_seqlens=torch.full((b,), 17, dtype=torch.int32, device=DEV),
                                block_table=bt)
    # contiguous, device lengths past the cache: clamped, nothing outside the cache is written
    guard = torch.zeros(3, s, h, d, dtype=BF16, device=DEV)
    kc2, vc2 = guard[:2].clone(), guard[:2].clone()
    big = torch.tensor([s, 10**9], dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, kc2, vc2, k1, v1, cache_seqlens=big)
    torch.cuda.synchronize()
    assert torch.equal(kc2, torch.zeros_like(kc2))   # every append position was past the cache
    assert torch.isfinite(out).all()
    # indices outside the cache (batch index, page) are clamped / skipped; the next call works
    bad_idx = torch.tensor([0, 99], dtype=torch.int32, device=DEV)
    flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=3, cache_batch_idx=bad_idx)
    bad_bt = torch.tensor([[1], [1000]], dtype=torch.int32, device=DEV)
    flash_attn_with_kvcache(q, pages, pv, k1, v1, cache_seqlens=3, block_table=bad_bt)
    torch.cuda.synchronize()
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10)
    assert torch.isfinite(out).all()


def test_batch_index_past_2_31_elements():
    # cache rows 2**30 elements apart: row 2 starts at element 2**31
    h_k, d, s = 2, 64, 64
    storage = torch.randn(2 * 2**30 + s * h_k * d, dtype=BF16, device=DEV)
    kc = storage.as_strided((3, s, h_k, d), (2**30, h_k * d, d, 1))
    vc = torch.randn_like(kc)
    q, k1, v1 = rand(1, 1, 4, d), rand(1, 1, h_k, d), rand(1, 1, h_k, d)
    idx = torch.tensor([2], dtype=torch.int32, device=DEV)
    lens = torch.tensor([10], dtype=torch.int32, device=DEV)
    ref, _, kc_ref, _ = kvcache_ref(q, kc[2:3].clone(), vc[2:3].clone(), k1, v1, cache_seqlens=lens)
    out = flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=lens, cache_batch_idx=idx)
    assert (out.float() - ref).abs().max().item() < 2e-2
    assert torch.equal(kc[2], kc_ref[0])
    del storage


def test_decode_step_in_a_cuda_graph():
    b, s, h, h_k, d = 4, 1024, 16, 4, 128
    kc, vc = torch.zeros(b, s, h_k, d, dtype=BF16, device=DEV), torch.zeros(b, s, h_k, d, dtype=BF16, device=DEV)
    q, k1, v1 = rand(b, 1, h, d), rand(b, 1, h_k, d), rand(b, 1, h_k, d)
    lens = torch.zeros(b, dtype=torch.int32, device=DEV)
    graph, out = capture_graph(lambda: flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=lens, causal=True))
    kc.zero_()
    vc.zero_()
    for step in range(3):
        lens.fill_(step)
        k1.copy_(torch.randn_like(k1))
        v1.copy_(torch.randn_like(v1))
        kc_before, vc_before = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref, _, kc_ref, _ = kvcache_ref(q, kc_before, vc_before, k1, v1, cache_seqlens=lens, causal=True)
        assert (out.float() - ref).abs().max().item() < 2e-2
        assert torch.equal(kc, kc_ref)


def test_decode_step_compiles_fullgraph():
    b, s, h, h_k, d = 2, 256, 8, 2, 64
    kc, vc = rand(b, s, h_k, d), rand(b, s, h_k, d)
    q, k1, v1 = rand(b, 1, h, d), rand(b, 1, h_k, d), rand(b, 1, h_k, d)
    lens = torch.tensor([5, 100], dtype=torch.int32, device=DEV)
    ref, _, kc_ref, _ = kvcache_ref(q, kc, vc, k1, v1, cache_seqlens=lens, causal=True)

    def step(q, kc, vc, k1, v1, lens):
        return flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=lens, causal=True)

    out = torch.compile(step, fullgraph=True)(q, kc, vc, k1, v1, lens)
    assert (out.float() - ref).abs().max().item() < 2e-2
    assert torch.equal(kc, kc_ref)   # the in-place append is visible after the compiled call


@pytest.mark.parametrize("page", [1, 16, 256, 5])
def test_paged_varlen_matches_reference(page):
    torch.manual_seed(page)
    lens_q, lens_k = [1, 37, 5], [300, 64, 1000]
    h, h_k, d = 8, 2, 128
    b = len(lens_q)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEV)
    k_cache, v_cache, bt = _make_cache(b, max(lens_k), h_k, d, BF16, page)
    kc, vc = paged_to_contiguous(k_cache, bt), paged_to_contiguous(v_cache, bt)
    k_packed = torch.cat([kc[i, :n] for i, n in enumerate(lens_k)])
    v_packed = torch.cat([vc[i, :n] for i, n in enumerate(lens_k)])
    q = rand(sum(lens_q), h, d)
    for causal in (False, True):
        ref, _ = attention_varlen_ref(q, k_packed, v_packed, cu_q, cu_k, causal=causal)
        ref_lp, _ = attention_varlen_ref(q, k_packed, v_packed, cu_q, cu_k, causal=causal, upcast=False)
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                     block_table=bt)
        assert_close_to_ref(out.float(), ref, ref_lp.float(), factor=3.0)
    # a q that requires grad (flash-attention's own paged varlen test): the same forward, and a
    # backward that raises instead of ignoring the block table
    qg = q.detach().clone().requires_grad_()
    out_g = flash_attn_varlen_func(qg, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                   block_table=bt)
    assert out_g.requires_grad and torch.equal(out_g.detach(), out)
    with pytest.raises(NotImplementedError, match="block_table"):
        out_g.sum().backward()
    assert qg.grad is None


@pytest.mark.parametrize("d", [32, 96, 224, 256])
@pytest.mark.parametrize("page", [256, 512])
@pytest.mark.parametrize("s_q,s_k", [(256, 108), (217, 128), (256, 512), (1023, 1024)])
def test_paged_varlen_prefill_head_dims_and_pages(d, page, s_q, s_k):
    # flash-attention's paged varlen test shapes: batch 8, 9 heads, random lengths up to s_q / s_k,
    # pages from a pool three times the keys, every kernel head dim (224 runs on the 256 tile)
    torch.manual_seed(d * 7 + page + s_q)
    b, h = 8, 9
    lens_q = torch.randint(1, s_q + 1, (b,)).tolist()
    lens_k = torch.randint(1, s_k + 1, (b,)).tolist()
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEV)
    n = math.ceil(s_k / page) * 3
    pool = torch.randperm(b * n, device=DEV).to(torch.int32).reshape(b, n)
    k_cache, v_cache = rand(b * n, page, h, d, dtype=FP16), rand(b * n, page, h, d, dtype=FP16)
    kc, vc = paged_to_contiguous(k_cache, pool), paged_to_contiguous(v_cache, pool)
    k_packed = torch.cat([kc[i, :m] for i, m in enumerate(lens_k)])
    v_packed = torch.cat([vc[i, :m] for i, m in enumerate(lens_k)])
    q = rand(sum(lens_q), h, d, dtype=FP16)
    ref, _ = attention_varlen_ref(q, k_packed, v_packed, cu_q, cu_k, causal=True)
    ref_lp, _ = attention_varlen_ref(q, k_packed, v_packed, cu_q, cu_k, causal=True, upcast=False)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                 block_table=pool)
    torch.cuda.synchronize()
    assert_close_to_ref(out.float(), ref, ref_lp.float(), factor=3.0)


def test_kvcache_argument_errors():
    q, kc = rand(2, 1, 4, 64), rand(2, 32, 2, 64)
    with pytest.raises(AssertionError):
        flash_attn_with_kvcache(q, kc.transpose(-1, -2), kc)
    with pytest.raises(ArgumentError, match="num_splits"):
        flash_attn_with_kvcache(q, kc, kc, num_splits=129)
    with pytest.raises(ArgumentError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, kc, rand(2, 1, 2, 64), rand(2, 1, 2, 64))
    with pytest.raises(ArgumentError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ferroattn.errors.DTypeError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.zeros(2, dtype=torch.int64, device=DEV))
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ArgumentError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, kc, kc, block_table=bt, cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEV))
    out = flash_attn_with_kvcache(q, kc, kc, cache_seqlens=4)   # the next valid call works
    assert torch.isfinite(out).all()
