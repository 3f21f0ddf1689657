"""One dense GEMM problem, run a few times, for Nsight Compute (GPU machine only).

    ncu --clock-control none --kernel-name regex:gemm_wmma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python scripts/ncu_gemm.py --backend wmma

Runs ``ferroattn.matmul(a, b, backend=...)`` on (m, k) x (k, n) random operands ``--calls`` times
(the first call JIT-compiles the kernel), then ``torch.matmul`` (cuBLAS) as many times, so one
ncu run can profile both (``--kernel-name`` picks which). Exit 2 for bad arguments, 3
without CUDA.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="wmma", help="ferroattn.matmul backend: wmma, sm90 or auto")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--calls", type=int, default=3, help="calls of each (>= 1)")
    args = ap.parse_args(argv)
    if min(args.m, args.n, args.k, args.calls) < 1:
        print("--m, --n, --k and --calls must be >= 1", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: ncu_gemm.py needs the GPU machine", file=sys.stderr)
        return 3
    import ferroattn
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", dtype=dt, generator=g)
    b = torch.randn(args.k, args.n, device="cuda", dtype=dt, generator=g)
    for _ in range(args.calls):
        ferroattn.matmul(a, b, backend=args.backend)
    for _ in range(args.calls):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    print(f"ran {args.calls} x ferroattn.matmul(backend={args.backend}) and torch.matmul at "
          f"{args.m}x{args.n}x{args.k} {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
