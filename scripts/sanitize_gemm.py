#!/usr/bin/env python3
"""A few small GEMM and 2:4-sparse calls for compute-sanitizer (memcheck, racecheck) on the GPU machine.

Run as ``compute-sanitizer --tool memcheck python scripts/sanitize_gemm.py`` (with
``FERROATTN_LINEINFO=1`` so reports carry source lines). The cases call the Rust entry points of
``ferroattn._native`` directly (the contract in ``python/ferroattn/_native.pyi``; the split-k / stream-K
workspace from their planners, ``gemm_workspace`` / ``sparse24_matmul_workspace``), so the kernels
see exactly the tensors named here: tails in m, n and k (1, 3, 17, 127), all four operand layouts
(row/column-major by strides), a batch with a broadcast operand, every epilogue (bias, alpha/beta
with C, activations, the pre-activation aux output), fp32 output, every backend this GPU supports;
then 2:4 compress/decompress and the sparse matmul for a few row counts (1, 7, 37) and a k that is
not a multiple of the tile, and wgmma .sp at 256..1023 rows split over k-chunks (forced chunk counts
through the ``sparse24_splitk`` tuning knob) and unsplit. Sizes are tiny: the sanitizer slows kernels down by orders of magnitude.

Each case also checks its result against a torch fp32 reference (relative Frobenius error <= 1e-2,
the issue's rule) and that every output element was written (outputs are pre-filled with NaN).
Prints one line per case and ``sanitize_gemm: N/M cases passed``; exit 1 if any case failed, 0 otherwise (sanitizer findings are reported
through the sanitizer's own exit code). ``--list`` prints the cases without running them.
"""
from __future__ import annotations

import argparse
import sys
import traceback

# (name, batch, m, n, k, a_col_major, b_col_major, dtype, out_dtype, bias, beta, activation)
GEMM_CASES = [
    ("nn-tail-fp16", 1, 17, 3, 127, False, False, "float16", "float16", False, 0.0, "none"),
    ("nt-bias-relu-bf16", 1, 127, 17, 33, False, True, "bfloat16", "bfloat16", True, 0.0, "relu"),
    ("tn-c-gelu-fp32out", 1, 3, 127, 17, True, False, "float16", "float32", True, 0.5, "gelu_tanh"),
    ("tt-silu-k1", 1, 65, 33, 1, True, True, "bfloat16", "bfloat16", False, 0.0, "silu"),
    ("batch3-bcast-b-erf", 3, 40, 24, 72, False, False, "bfloat16", "bfloat16", True, 0.0, "gelu_erf"),
    ("square-256", 1, 256, 256, 256, False, False, "float16", "float16", False, 0.0, "none"),
    ("tn-aligned-tails-aux", 1, 136, 264, 72, True, False, "bfloat16", "bfloat16", True, 0.25, "silu"),
]
# (name, rows, n, k, dtype, bias, activation, backend, split-k: the sparse24_splitk knob)
SPARSE_CASES = [
    ("sp-rows1", 1, 64, 128, "float16", False, "none", "auto", "auto"),
    ("sp-rows7-bias-relu", 7, 96, 160, "bfloat16", True, "relu", "auto", "auto"),
    ("sp-rows37-ktail", 37, 40, 72, "float16", True, "silu", "auto", "auto"),
    # wgmma .sp (sm_90a only; refused elsewhere) at 256..1023 rows, split over k-chunks into the fp32
    # workspace + reduce: uneven chunks, k not a multiple of 128, n % 4 != 0
    ("sp-wgmma-rows300-split2-erf", 300, 512, 1000, "bfloat16", True, "gelu_erf", "wgmma_sp", "2"),
    ("sp-wgmma-rows777-split7-ktail", 777, 264, 2112, "float16", False, "silu", "wgmma_sp", "7"),
    ("sp-wgmma-rows512-auto-n1030", 512, 1030, 4160, "bfloat16", True, "gelu_tanh", "wgmma_sp", "auto"),
    ("sp-wgmma-rows640-unsplit", 640, 256, 1024, "float16", True, "none", "wgmma_sp", "off"),
]

ACT = {
    "none": lambda x: x,
    "relu": lambda x: x.clamp_min(0),
    "gelu_tanh": lambda x: __import__("torch").nn.functional.gelu(x, approximate="tanh"),
    "gelu_erf": lambda x: __import__("torch").nn.functional.gelu(x),
    "silu": lambda x: __import__("torch").nn.functional.silu(x),
}


def _operand(batch: int, rows: int, cols: int, col_major: bool, dtype, broadcast: bool = False):
    """A (batch, rows, cols) tensor, row- or column-major by strides; batch stride 0 if broadcast."""
    import torch
    if col_major:
        t = torch.randn(1 if broadcast else batch, cols, rows, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        t = torch.randn(1 if broadcast else batch, rows, cols, device="cuda", dtype=dtype)
    return t.expand(batch, rows, cols) if broadcast else t


def _check(out, ref, name: str) -> str:
    import torch
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: output has non-finite values (unwritten or wrong)")
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if not err <= 1e-2:
        raise AssertionError(f"{name}: relative error {err:.3e} > 1e-2")
    return f"rel err {err:.2e}"


def _workspace(nbytes: int):
    """The split-k / stream-K workspace a native planner asked for, as the op layer allocates it."""
    import torch
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None


def run_gemm(case, backend: str) -> str:
    import torch
    from ferroattn import _native
    name, batch, m, n, k, a_cm, b_cm, dt, odt, with_bias, beta, act = case
    dtype, out_dtype = getattr(torch, dt), getattr(torch, odt)
    a = _operand(batch, m, k, a_cm, dtype)
    b = _operand(batch, k, n, b_cm, dtype, broadcast=batch > 1)
    bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
    c = torch.randn(batch, m, n, device="cuda", dtype=out_dtype) if beta else None
    out = torch.full((batch, m, n), float("nan"), device="cuda", dtype=out_dtype)
    aux = torch.full_like(out, float("nan")) if act != "none" else None
    alpha = 0.75
    stream = torch.cuda.current_stream().cuda_stream
    args = (a.detach(), b.detach(), out, c, bias, aux, alpha, beta, act, backend)
    ran = _native.gemm(*args, _workspace(_native.gemm_workspace(*args)), stream)
    torch.cuda.synchronize()
    pre = alpha * (a.float() @ b.float())
    if c is not None:
        pre = pre + beta * c.float()
    if bias is not None:
        pre = pre + bias.float()
    msg = _check(out, ACT[act](pre), name)
    if aux is not None:
        _check(aux, pre, name + " aux")
    return f"{ran}: {msg}"


def run_sparse(case) -> str:
    import torch
    from ferroattn import _native
    name, rows, n, k, dt, with_bias, act, backend, split = case
    _native.set_tuning_knob("sparse24_splitk", split)
    dtype = getattr(torch, dt)
    lay = _native.sparse24_layout(n, k)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    values = torch.empty(lay["values_shape"], device="cuda", dtype=dtype)
    meta = torch.empty(lay["meta_shape"], device="cuda", dtype=torch.int16)
    bad = torch.empty(1, device="cuda", dtype=torch.int32)
    stream = torch.cuda.current_stream().cuda_stream
    _native.sparse24_compress(w, values, meta, bad, True, stream)
    dense = torch.full((n, k), float("nan"), device="cuda", dtype=dtype)
    _native.sparse24_decompress(values, meta, dense, stream)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    args = (x, values, meta, out, bias, n, k, act, backend)
    ran = _native.sparse24_matmul(*args, _workspace(_native.sparse24_matmul_workspace(*args)), stream)
    torch.cuda.synchronize()
    if not torch.isfinite(dense).all():
        raise AssertionError(f"{name}: decompress left unwritten elements")
    groups = dense.float().reshape(n, -1, 4)
    if int((groups != 0).sum(-1).max()) > 2:
        raise AssertionError(f"{name}: decompressed matrix is not 2:4")
    ref = x.float() @ dense.float().T
    if bias is not None:
        ref = ref + bias.float()
    return f"{ran}: {_check(out, ACT[act](ref), name)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if args.list:
        for case in GEMM_CASES:
            print("gemm", case[0])
        for case in SPARSE_CASES:
            print("sparse24", case[0])
        return 0
    import torch
    from ferroattn import _native
    from ferroattn.errors import ArgumentError
    torch.manual_seed(0)
    backends = _native.gemm_backends(torch.cuda.current_device())
    failed = 0
    jobs = [(f"gemm[{be}] {c[0]}", run_gemm, (c, be)) for be in backends for c in GEMM_CASES]
    hopper = torch.cuda.get_device_capability() == (9, 0)   # wgmma .sp runs on sm_90 only
    jobs += [(f"sparse24 {c[0]}", run_sparse, (c,)) for c in SPARSE_CASES if hopper or c[7] != "wgmma_sp"]
    skipped = 0
    for label, fn, fargs in jobs:
        try:
            print(f"PASS {label}: {fn(*fargs)}", flush=True)
        except ArgumentError as e:
            if "does not support this problem" not in str(e):
                failed += 1
                print(f"FAIL {label}:\n{traceback.format_exc()}", flush=True)
            else:  # an explicit backend refusing a problem outside its fast path (the contract)
                skipped += 1
                print(f"SKIP {label}: {e}", flush=True)
        except Exception:  # noqa: BLE001  (report every case, then fail)
            failed += 1
            print(f"FAIL {label}:\n{traceback.format_exc()}", flush=True)
    ran = len(jobs) - skipped
    print(f"sanitize_gemm: {ran - failed}/{ran} cases passed ({skipped} refused by an explicit backend)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
