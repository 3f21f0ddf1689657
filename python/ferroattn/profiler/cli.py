"""``python -m ferroattn profile``: a batch x sequence-length sweep of a model (issue 5).

``--model`` is a config name of :data:`ferroattn.demo.LLM_CONFIGS` (``llama-3.2-1b``, ``tiny``) or
an existing path: a directory holding ``config.json`` or a ``config.json`` file (the model is built
by :func:`~.models.build_model`: bf16, seeded random weights, on the GPU).
``--batch`` / ``--seq``: comma-separated distinct positive ints (:func:`parse_axis`; at most
:data:`MAX_TOKENS`, also for the largest batch x seqlen; exit 2 on error);
``--attn``: ``ferroattn`` or ``sdpa``; ``--trace``/``--plot``: output files (not directories) whose
directory must exist; ``--plot``'s suffix names a format matplotlib saves (``.png``, ``.svg``, ...).

What it does (:func:`run_sweep`): :func:`~.sweep.sweep` over the grid with a progress bar (stderr),
then prints the latency/throughput table, the knee, and for the knee point (else the largest
point that ran) the per-module table (``key_averages(group_by="module").table(
sort_by="gpu_time_total", row_limit=15)``) and the kernel table of its profiled forward;
``--trace`` writes that forward as a Chrome trace, ``--plot`` the latency/throughput heatmap.

Exit codes (as the other commands): 0 every point ran; 1 failure (a point other than out of
memory failed, every point failed, or an output could not be written); 2 bad arguments; 3 cannot
run (no CUDA GPU, or transformers missing). Out-of-memory points are reported "n/a" and do not
fail the run as long as one point ran.
"""
from __future__ import annotations

import argparse
import os
import sys

ATTN_CHOICES = ("ferroattn", "sdpa")
PROG = "ferroattn profile"


#: largest batch, sequence length and batch * seqlen accepted (token counts must fit an int32)
MAX_TOKENS = 2**31 - 1


def parse_axis(text: str, name: str) -> list:
    """``--batch`` / ``--seq`` text -> distinct positive ints in the given order. Raises ValueError
    naming ``name`` for an empty item ("1,,2"), a non-integer, a value <= 0 or > MAX_TOKENS, or a
    repeated value. (The argparse type of ``--batch``/``--seq``.)"""
    items = [x.strip() for x in str(text).split(",")]
    try:
        vals = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated positive integers without empty items, "
                         f"got {text!r}") from None
    return check_axis(name, vals)


def check_axis(name: str, vals: list) -> list:
    """``vals`` when they are distinct ints in [1, MAX_TOKENS]; else ArgumentError (a ValueError)
    naming ``name``."""
    from ferroattn.errors import ArgumentError  # noqa: PLC0415
    from .knee import _check_axis_values  # noqa: PLC0415
    vals = _check_axis_values(name, vals)
    if max(vals) > MAX_TOKENS:
        raise ArgumentError(f"{name}: expected values <= {MAX_TOKENS}, got {max(vals)}")
    return vals


def validate(args: argparse.Namespace) -> str | None:
    """The first argument error as a message naming the option, or None. Checks the model name /
    config.json (readable JSON with a model_type; without importing torch), the axes (distinct,
    in [1, MAX_TOKENS], largest batch x largest seqlen <= MAX_TOKENS), ``--attn``, and the outputs
    (``--trace``: a file path in an existing directory; ``--plot``: the same with an image suffix
    matplotlib saves)."""
    from ferroattn.errors import ArgumentError  # noqa: PLC0415
    from ._util import figure_path, output_path  # noqa: PLC0415
    from .models import read_config  # noqa: PLC0415
    try:
        read_config(args.model)
    except ArgumentError as e:
        return f"--model: {str(e).removeprefix('model: ')}"
    for opt, vals in (("--batch", args.batch), ("--seq", args.seq)):
        try:
            check_axis(opt, list(vals))
        except ValueError as e:
            return str(e)
    if max(args.batch) * max(args.seq) > MAX_TOKENS:
        return (f"--batch/--seq: expected batch x seqlen <= {MAX_TOKENS} tokens, got {max(args.batch)} x "
                f"{max(args.seq)} = {max(args.batch) * max(args.seq)}")
    if args.attn not in ATTN_CHOICES:
        return f"--attn: expected one of {ATTN_CHOICES}, got {args.attn!r}"
    for opt, path, check in (("--trace", args.trace, output_path), ("--plot", args.plot, figure_path)):
        if path is None:
            continue
        try:
            path = check(opt, path)
        except ArgumentError as e:
            return str(e)
        except ImportError:
            return f"{opt}: writing a plot needs matplotlib (pip install 'ferroattn[bench]')"
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"{opt}: directory {parent!r} does not exist (for {path!r})"
    return None


def _cuda_available() -> bool:
    """torch.cuda.is_available(); False when torch is missing. (A function so tests can patch it.)"""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_sweep(args: argparse.Namespace, *, device: str = "cuda", repeats: int = 10, warmup: int = 3,
              out=None) -> int:
    """Build the model, sweep, print the report, write --trace/--plot; returns the exit code
    (module docstring). ``device``/``repeats``/``warmup``/``out`` (a text stream, default stdout)
    let tests run it on the CPU."""
    from .models import build_model  # noqa: PLC0415
    from .sweep import OOM, sweep  # noqa: PLC0415
    out = sys.stdout if out is None else out
    from ferroattn.errors import ArgumentError  # noqa: PLC0415
    try:
        model = build_model(args.model, attn=args.attn, device=device)
    except ImportError as e:
        print(f"{PROG}: cannot run: {e}", file=sys.stderr)
        return 3
    except ArgumentError as e:   # e.g. a config.json transformers cannot build
        print(f"{PROG}: --{e}" if str(e).startswith("model: ") else f"{PROG}: {e}", file=sys.stderr)
        return 2
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{PROG}: {args.model} ({type(model).__name__}, {n_params / 1e6:.1f}M parameters, bf16, "
          f"attn={args.attn}) on {device}; batches {args.batch}, seqlens {args.seq}", file=out, flush=True)
    res = sweep(model, args.batch, args.seq, repeats=repeats, warmup=warmup, profile_layers=True, progress=True)
    print(res.table(), file=out)
    pt = res.profiled_point()
    rc = 0
    if pt is not None:
        rec = res.points[pt].records
        which = "the knee" if res.knee is not None and res.knee.config == pt else "the largest point that ran"
        print(f"profile of batch={pt[0]}, seqlen={pt[1]} ({which}):", file=out)
        print(rec.key_averages(group_by="module").table(sort_by="gpu_time_total", row_limit=15), file=out)
        print(rec.key_averages(group_by="kernel").table(sort_by="gpu_time_total", row_limit=15), file=out)
        try:
            if args.trace:
                rec.export_chrome_trace(args.trace)
                print(f"chrome trace (batch={pt[0]}, seqlen={pt[1]}): {args.trace}", file=out)
            if args.plot:
                res.plot_heatmap(args.plot)
                print(f"heatmap: {args.plot}", file=out)
        except (OSError, ArgumentError) as e:
            print(f"{PROG}: cannot write an output: {e}", file=sys.stderr)
            rc = 1
    errors = res.errors
    for (b, s), err in errors.items():
        print(f"{PROG}: batch={b}, seqlen={s}: {err}", file=sys.stderr)
    if pt is None:
        print(f"{PROG}: no point of the sweep ran", file=sys.stderr)
        return 1
    if any(e != OOM for e in errors.values()):
        return 1
    return rc


def main_from_args(args: argparse.Namespace) -> int:
    """Validate (exit 2), check for a GPU (exit 3), then run the sweep."""
    err = validate(args)
    if err is not None:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    if not _cuda_available():
        print(f"{PROG}: cannot run: no CUDA GPU found (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    return run_sweep(args)
