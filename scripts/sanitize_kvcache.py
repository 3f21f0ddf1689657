"""Small kv-cache attention calls for compute-sanitizer (memcheck / racecheck): the split-KV forward,
its combine and the cache append with rotary (kernels/attention/fwd_kvcache_sm80.cuh,
split_combine.cuh, kv_append.cuh) on contiguous, paged (page sizes 1, 3, 16) and indexed caches,
with splits, left pads and device-side lengths and indices past the cache (which the kernels clamp
or skip). Each case also checks the output against ``ferroattn.testing.kvcache_ref``.

    compute-sanitizer --tool memcheck python scripts/sanitize_kvcache.py
    python scripts/sanitize_kvcache.py --list
"""
from __future__ import annotations

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sanitize_attention", os.path.join(_here, "sanitize_attention.py"))
_sa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sa)

# (name, b, s_q, capacity, h, h_k, d, page, new tokens, rotary, leftpad, batch_idx, splits, causal)
CASES = [
    ("paged1-tail", 3, 1, 37, 2, 2, 64, 1, 1, False, False, False, 2, False),
    ("contig-append-rotary", 2, 1, 300, 8, 2, 128, None, 1, True, False, False, 0, True),
    ("contig-append-splits", 2, 1, 300, 8, 2, 128, None, 1, False, False, False, 3, True),   # the one-call path
    ("contig-leftpad-batchidx", 2, 4, 200, 4, 4, 64, None, 2, False, True, True, 3, False),
    ("paged3-splits", 2, 1, 333, 8, 1, 128, 3, 1, True, False, False, 5, True),
    ("paged16-gqa-d256", 1, 2, 160, 6, 3, 256, 16, 2, False, False, False, 0, True),
]


def run_case_kvcache(case) -> str:
    import math
    import torch
    from ferroattn import flash_attn_with_kvcache, testing
    name, b, s_q, cap, h, hk, d, page, new, rotary, leftpad, bidx, splits, causal = case
    dev, dt = "cuda", torch.bfloat16
    b_cache = b + 2 if bidx else b
    if page is None:
        kc, vc = (torch.randn(b_cache, cap, hk, d, device=dev, dtype=dt) for _ in range(2))
        bt = None
    else:
        n = math.ceil(cap / page)
        kc = torch.randn(b * n + 1, page, hk, d, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        bt = torch.randperm(b * n + 1, device=dev)[: b * n].to(torch.int32).reshape(b, n)
        cap = n * page
    q = torch.randn(b, s_q, h, d, device=dev, dtype=dt)
    k1, v1 = (torch.randn(b, new, hk, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.randint(1, cap - max(new, s_q), (b,), device=dev, dtype=torch.int32)
    lp = (lens // 2).to(torch.int32) if leftpad else None
    idx = torch.randperm(b_cache, device=dev)[:b].to(torch.int32) if bidx else None
    cos = sin = None
    if rotary:
        ang = torch.rand(cap, d // 4, device=dev) * 6.28
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, cache_leftpad=lp, cache_batch_idx=idx,
              block_table=bt, causal=causal)
    ref, _, _, _ = testing.kvcache_ref(q, kc, vc, k1, v1, **kw)
    ref_lp, _, _, _ = testing.kvcache_ref(q, kc, vc, k1, v1, upcast=False, **kw)
    out = flash_attn_with_kvcache(q, kc, vc, k1, v1, num_splits=splits, **kw)
    torch.cuda.synchronize()
    err, bound = testing.assert_close_to_ref(out.float(), ref, ref_lp.float(), factor=3.0, name=name)
    # device-side values past the cache: clamped or skipped, never out of bounds (through the ops:
    # flash_attn_with_kvcache itself rejects such lengths of a paged cache on the host)
    big = torch.full((b,), 2**30, device=dev, dtype=torch.int32)
    torch.ops.ferroattn.kv_append(kc, vc, k1, v1, None, None, None, big, idx, bt, True, False)
    torch.ops.ferroattn.attn_fwd_kvcache(q, kc, vc, None, None, 0, big, new, None, idx, bt, d ** -0.5, causal,
                                         num_splits=splits)
    torch.cuda.synchronize()
    return f"err {err:.2e} <= {bound:.2e}"


def cases():
    return [(c[0], run_case_kvcache, c) for c in CASES]


def main(argv=None) -> int:
    return _sa.run_cases("sanitize_kvcache", "small kv-cache attention calls for compute-sanitizer", cases(), argv)


if __name__ == "__main__":
    sys.exit(main())
