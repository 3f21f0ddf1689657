"""One attention problem, forward and backward, run a few times, for Nsight Compute (GPU machine only).

    ncu --clock-control none --kernel-name regex:attn_bwd_sm90 --launch-skip 1 --launch-count 1 \
        --set full python scripts/ncu_attention.py --seqlen 8192 --head-dim 128

Runs ``ferroattn.flash_attn_func`` forward and backward on (b, s, h, d) random q, k, v
``--calls`` times (the first call JIT-compiles the kernels), then torch SDPA's cuDNN backend as
many times, so one ncu run can profile ours and the peer's kernels (``--kernel-name`` picks
which). Exit 2 for bad arguments, 3 without CUDA.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--calls", type=int, default=2, help="calls of each (>= 1)")
    ap.add_argument("--no-peer", action="store_true", help="leave SDPA's cuDNN backend out")
    args = ap.parse_args(argv)
    if min(args.batch, args.seqlen, args.heads, args.head_dim, args.calls) < 1:
        print("--batch, --seqlen, --heads, --head-dim and --calls must be >= 1", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: ncu_attention.py needs the GPU machine", file=sys.stderr)
        return 3
    import ferroattn
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dt, generator=g)
    for _ in range(args.calls):
        out = ferroattn.flash_attn_func(q, k, v, causal=args.causal)
        out.backward(dout)
    if not args.no_peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(args.calls):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
                out.backward(dout.transpose(1, 2))
    torch.cuda.synchronize()
    print(f"ran {args.calls} x flash_attn_func forward + backward{'' if args.no_peer else ' and SDPA cuDNN'} "
          f"at b {args.batch} s {args.seqlen} h {args.heads} d {args.head_dim} "
          f"{'causal' if args.causal else 'full'} {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
