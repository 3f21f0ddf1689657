"""One GEMM or attention problem, run a few times, for Nsight Compute (GPU machine only).

    ncu --clock-control none --kernel-name regex:gemm_wmma --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/ncu_problem.py gemm --backend wmma
    ncu --clock-control none --kernel-name regex:"attn_bwd_sm90|bprop" --launch-skip 1 --launch-count 2 \
        --set full python scripts/ncu_problem.py attention --seqlen 8192 --head-dim 128

``gemm``: ``ferroattn.matmul(a, b, backend=...)`` on (m, k) x (k, n) random operands ``--calls``
times (the first call JIT-compiles the kernel), then ``torch.matmul`` (cuBLAS) as many times.
``attention``: ``ferroattn.flash_attn_func`` forward and backward on (b, s, h, d) random q, k, v
``--calls`` times, then torch SDPA's cuDNN backend as many times (``--no-peer`` leaves it out).
One ncu run can so profile ours and the peer's kernels (``--kernel-name`` picks which). Exit 2 for
bad arguments, 3 without CUDA.
"""
from __future__ import annotations

import argparse
import sys


def run_gemm(args, torch, dt, g) -> str:
    import ferroattn
    a = torch.randn(args.m, args.k, device="cuda", dtype=dt, generator=g)
    b = torch.randn(args.k, args.n, device="cuda", dtype=dt, generator=g)
    for _ in range(args.calls):
        ferroattn.matmul(a, b, backend=args.backend)
    for _ in range(args.calls):
        torch.matmul(a, b)
    return f"ferroattn.matmul(backend={args.backend}) and torch.matmul at {args.m}x{args.n}x{args.k}"


def run_attention(args, torch, dt, g) -> str:
    import ferroattn
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dt, generator=g)
    for _ in range(args.calls):
        ferroattn.flash_attn_func(q, k, v, causal=args.causal).backward(dout)
    if not args.no_peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(args.calls):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal).backward(
                    dout.transpose(1, 2))
    return (f"flash_attn_func forward + backward{'' if args.no_peer else ' and SDPA cuDNN'} at b {args.batch} "
            f"s {args.seqlen} h {args.heads} d {args.head_dim} {'causal' if args.causal else 'full'}")


def main(argv=None) -> int:
    common = argparse.ArgumentParser(add_help=False)   # the options of both problems
    common.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    common.add_argument("--calls", type=int, default=2, help="calls of each (>= 1)")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="problem", required=True)
    gm = sub.add_parser("gemm", parents=[common], help="a dense GEMM: ours and cuBLAS")
    gm.add_argument("--backend", default="wmma", help="ferroattn.matmul backend: wmma, sm90 or auto")
    for name in ("m", "n", "k"):
        gm.add_argument(f"--{name}", type=int, default=8192)
    at = sub.add_parser("attention", parents=[common], help="attention forward + backward: ours and SDPA cuDNN")
    for name, default in (("batch", 2), ("seqlen", 8192), ("heads", 16), ("head-dim", 128)):
        at.add_argument(f"--{name}", type=int, default=default)
    at.add_argument("--causal", action="store_true")
    at.add_argument("--no-peer", action="store_true", help="leave SDPA's cuDNN backend out")
    args = ap.parse_args(argv)
    sizes = (args.m, args.n, args.k) if args.problem == "gemm" else (args.batch, args.seqlen, args.heads, args.head_dim)
    if min(*sizes, args.calls) < 1:
        print("every size and --calls must be >= 1", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: ncu_problem.py needs the GPU machine", file=sys.stderr)
        return 3
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    what = (run_gemm if args.problem == "gemm" else run_attention)(args, torch, dt, g)
    torch.cuda.synchronize()
    print(f"ran {args.calls} x {what} {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
