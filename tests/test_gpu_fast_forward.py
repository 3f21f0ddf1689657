"""flash_attn_func's one-call eager forward (``_native.attn_fwd_fast``, src/ops/attention/fast.rs)
on the GPU: it is taken for the common plain / causal call, dense and decode-shaped, and gives
bitwise the output of the Python path (the same kernel with the same parameters: the fast path
switched off sends the call through the custom op); it declines what the Python path must do
(autograd, a pad, a copy, a variant); a decode step captured in a CUDA graph replays correctly."""
from __future__ import annotations

import pytest
import torch

import ferroattn
from ferroattn import _native
from ferroattn.ops import _eager

from _gpu_common import BF16, DEV, DTYPES, capture_graph, rand

pytestmark = pytest.mark.gpu

PLAIN = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             deterministic=False, return_attn_probs=False, s_aux=None)


def _fast(q, k, v, **kw):
    return _native.attn_fwd_fast(q, k, v, *{**PLAIN, **kw}.values())


def _fast_path_off(fn, *args, **kw):
    """``fn(*args, **kw)`` with the eager fast path off: the Python path, through the custom ops."""
    old = _eager.ENABLED
    _eager.ENABLED = False
    try:
        return fn(*args, **kw)
    finally:
        _eager.ENABLED = old


def _python_path(q, k, v, **kw):
    return _fast_path_off(ferroattn.flash_attn_func, q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, s_q, s_k, h, h_k, d", [
    (2, 128, 128, 16, 16, 64),      # dense
    (1, 333, 1000, 8, 2, 128),      # dense, GQA, s_q != s_k
    (3, 1, 4096, 32, 8, 128),       # decode: one token against a long cache (kv-cache kernel, splits)
    (2, 4, 2048, 16, 4, 64),        # speculative decode
    (1, 1, 16, 4, 4, 256),          # s_q == 1, short: the forward kernel, causal dropped
])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_is_taken_and_equals_the_python_path(dtype, b, s_q, s_k, h, h_k, d, causal):
    q, k, v = rand(b, s_q, h, d, dtype=dtype), rand(b, s_k, h_k, d, dtype=dtype), rand(b, s_k, h_k, d, dtype=dtype)
    fast = _fast(q, k, v, causal=causal)
    assert fast is not None, "the common call must take the one-call forward"
    assert fast.shape == q.shape and fast.dtype == dtype and fast.stride() == q.stride()
    ref = _python_path(q, k, v, causal=causal)
    torch.testing.assert_close(fast, ref, rtol=0, atol=0)
    for scale in (0.3, 2.0):
        torch.testing.assert_close(_fast(q, k, v, causal=causal, softmax_scale=scale),
                                   _python_path(q, k, v, causal=causal, softmax_scale=scale), rtol=0, atol=0)
    # flash_attn_func itself routes it there
    torch.testing.assert_close(ferroattn.flash_attn_func(q, k, v, causal=causal), ref, rtol=0, atol=0)


def test_packed_functions_take_the_fast_path_too():
    qkv, kv, q = rand(2, 256, 3, 8, 64), rand(2, 512, 2, 4, 64), rand(2, 256, 8, 64)
    for causal in (False, True):
        torch.testing.assert_close(ferroattn.flash_attn_qkvpacked_func(qkv, causal=causal),
                                   _fast_path_off(ferroattn.flash_attn_qkvpacked_func, qkv, causal=causal),
                                   rtol=0, atol=0)
        torch.testing.assert_close(ferroattn.flash_attn_kvpacked_func(q, kv, causal=causal),
                                   _fast_path_off(ferroattn.flash_attn_kvpacked_func, q, kv, causal=causal),
                                   rtol=0, atol=0)
    assert _fast(*qkv.unbind(2)) is not None                             # the views are taken as they are


def test_fast_path_declines_what_the_python_path_must_handle():
    q = rand(1, 64, 4, 64)
    assert _fast(q.requires_grad_(), q, q) is None                      # autograd records the backward
    with torch.no_grad():
        assert _fast(q, q, q) is None                                   # DLPack refuses it: the Python path detaches
        assert _fast(q.detach(), q.detach(), q.detach()) is not None
        torch.testing.assert_close(ferroattn.flash_attn_func(q, q, q), _python_path(q, q, q), rtol=0, atol=0)
    q = rand(1, 64, 4, 60)
    assert _fast(q, q, q) is None                                       # the pad to 64
    x = rand(1, 64, 4, 68)[..., :64]
    assert _fast(x, x, x) is None                                       # rows 136 B apart: the copy
    x = rand(1, 64, 4, 72)[..., :64]                                    # rows 144 B apart: read in place
    torch.testing.assert_close(_fast(x, x, x), _python_path(x, x, x), rtol=0, atol=0)
    q = rand(1, 64, 4, 64)
    for kw in (dict(softcap=5.0), dict(window_size=(8, 0)), dict(dropout_p=0.1), dict(softmax_scale=-1.0),
               dict(alibi_slopes=torch.zeros(4, device=DEV)), dict(return_attn_probs=True)):
        assert _fast(q, q, q, **kw) is None, kw
    assert _fast(torch._neg_view(q), q, q) is None                       # the lazy negation: the op resolves it


def test_decode_step_with_splits_replays_in_a_cuda_graph():
    q, k, v = rand(4, 1, 32, 128), rand(4, 8192, 8, 128), rand(4, 8192, 8, 128)
    ref = _python_path(q, k, v, causal=True)
    graph, out = capture_graph(lambda: ferroattn.flash_attn_func(q, k, v, causal=True))
    q.copy_(rand(4, 1, 32, 128))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _python_path(q, k, v, causal=True), rtol=0, atol=0)
    assert not torch.equal(out, ref)


@pytest.mark.parametrize("s_q, s_k", [(128, 128), (1, 8192)])    # dense (lse) / decode with splits (+ partials)
def test_the_scratch_goes_back_to_torchs_pool(s_q, s_k):
    q, k, v = rand(2, s_q, 32, 128), rand(2, s_k, 8, 128), rand(2, s_k, 8, 128)
    assert _fast(q, k, v) is not None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        _fast(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before                     # every scratch block handed back


def test_a_rejected_call_leaves_the_next_one_working():
    q = rand(1, 64, 4, 64, dtype=BF16)
    k16 = rand(1, 64, 4, 64, dtype=torch.float16)
    with pytest.raises(ferroattn.errors.FerroattnError):
        ferroattn.flash_attn_func(q, k16, k16)                         # declined, the Python path names k
    assert _fast(q, q, q) is not None
    torch.testing.assert_close(ferroattn.flash_attn_func(q, q, q), _python_path(q, q, q), rtol=0, atol=0)


# ---- flash_attn_with_kvcache's one-call path (_native.attn_kvcache_fast) --------------------------

KV_PLAIN = dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)


def _kv_fast(q, kc, vc, **kw):
    return _native.attn_kvcache_fast(q, kc, vc, *{**KV_PLAIN, **kw}.values())


def _kv_python_path(q, kc, vc, **kw):
    return _fast_path_off(ferroattn.flash_attn_with_kvcache, q, kc, vc, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, s_q, s_new, cap, h, h_k, d", [
    (1, 1, 0, 1024, 32, 8, 128),     # decode over the whole cache
    (4, 1, 1, 8192, 32, 8, 128),     # decode with a one-token append (split-KV)
    (2, 4, 4, 2048, 16, 4, 64),      # speculative decode with an append
    (3, 16, 16, 300, 8, 8, 256),     # a prefill chunk
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_kvcache_fast_path_is_taken_and_equals_the_python_path(dtype, b, s_q, s_new, cap, h, h_k, d, causal,
                                                                num_splits):
    q = rand(b, s_q, h, d, dtype=dtype)
    kc, vc = rand(b, cap, h_k, d, dtype=dtype), rand(b, cap, h_k, d, dtype=dtype)
    kw = dict(causal=causal, num_splits=num_splits, return_softmax_lse=True)
    if s_new:
        seqlens = torch.randint(0, cap - s_new + 1, (b,), dtype=torch.int32, device=DEV)
        kw.update(k=rand(b, s_new, h_k, d, dtype=dtype), v=rand(b, s_new, h_k, d, dtype=dtype), cache_seqlens=seqlens)
    kc2, vc2 = kc.clone(), vc.clone()
    res = _kv_fast(q, kc, vc, **kw)
    assert res is not None, "the common kv-cache call must take the one-call path"
    ref = _kv_python_path(q, kc2, vc2, **kw)
    torch.testing.assert_close(res[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(res[1], ref[1], rtol=0, atol=0)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)                  # the same append, in place
    # softmax_lse not returned: it and the split partials live in the scratch block (the same
    # append again writes the same rows, so the cache and the output are unchanged)
    out = ferroattn.flash_attn_with_kvcache(q, kc, vc, **{**kw, "return_softmax_lse": False})
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, res[0], rtol=0, atol=0)


def test_kvcache_fast_path_declines_pages_rotary_and_int_lengths():
    q, kc = rand(2, 1, 8, 64), rand(2, 512, 8, 64)
    kn = rand(2, 1, 8, 64)
    seqlens = torch.full((2,), 10, dtype=torch.int32, device=DEV)
    assert _kv_fast(q, kc, kc, k=kn, v=kn, cache_seqlens=5) is None
    cos = torch.ones(512, 32, dtype=BF16, device=DEV)
    assert _kv_fast(q, kc, kc, k=kn, v=kn, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=cos) is None
    assert _kv_fast(q, kc, kc, cache_seqlens=seqlens.long()) is None
    assert _kv_fast(q, kc, kc, cache_batch_idx=torch.arange(2, dtype=torch.int32, device=DEV)) is None


def test_kvcache_decode_step_with_append_replays_in_a_cuda_graph():
    q, kc, vc = rand(2, 1, 32, 128), rand(2, 4096, 8, 128), rand(2, 4096, 8, 128)
    kn, vn = rand(2, 1, 8, 128), rand(2, 1, 8, 128)
    seqlens = torch.tensor([100, 3000], dtype=torch.int32, device=DEV)
    graph, out = capture_graph(lambda: ferroattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                                                         causal=True))
    kc2, vc2 = kc.clone(), vc.clone()     # with the appends of the warm-up and capture calls
    seqlens += 1
    graph.replay()
    torch.cuda.synchronize()
    ref = _kv_python_path(q, kc2, vc2, k=kn, v=vn, cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
