"""``python -m ferroattn profile``: a batch x sequence-length sweep of a model (issue 5).

``--model`` is a config name of :data:`ferroattn.demo.LLM_CONFIGS` (``llama-3.2-1b``, ``tiny``) or
an existing path: a directory holding ``config.json`` or a ``config.json`` file.
``--batch`` / ``--seq``: comma-separated positive ints (parsed by the CLI, exit 2 on error);
``--attn``: ``ferroattn`` or ``sdpa``; ``--trace``/``--plot``: output files whose directory must exist.

Exit codes (as the other commands): 2 bad arguments, 3 cannot run (no CUDA GPU), 1 failure.
The sweep itself (per point: forward time, per-layer profile, heatmap, :func:`.knee.detect_knee`)
is not written yet: on a GPU it raises NotImplementedError ("lands with the GPU part of issue 5").
"""
from __future__ import annotations

import argparse
import os
import sys

ATTN_CHOICES = ("ferroattn", "sdpa")
PROG = "ferroattn profile"


def validate(args: argparse.Namespace) -> str | None:
    """The first argument error as a message naming the option, or None."""
    from ferroattn.demo import LLM_CONFIGS  # noqa: PLC0415  (no torch import at module level)
    m = args.model
    if m not in LLM_CONFIGS:
        if not os.path.exists(m):
            return (f"--model: expected a config name ({', '.join(sorted(LLM_CONFIGS))}) or an existing path, "
                    f"got {m!r}")
        if os.path.isdir(m) and not os.path.isfile(os.path.join(m, "config.json")):
            return f"--model: directory {m!r} has no config.json"
    if args.attn not in ATTN_CHOICES:
        return f"--attn: expected one of {ATTN_CHOICES}, got {args.attn!r}"
    for opt, path in (("--trace", args.trace), ("--plot", args.plot)):
        if path is not None:
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


def run_sweep(args: argparse.Namespace) -> int:
    """The GPU sweep (not written yet)."""
    raise NotImplementedError("the batch x seq sweep (timings, per-layer profile, heatmap, knee) lands with the "
                              "GPU part of issue 5")


def main_from_args(args: argparse.Namespace) -> int:
    """Validate (exit 2), check for a GPU (exit 3), then run the sweep."""
    err = validate(args)
    if err is not None:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    if not _cuda_available():
        print(f"{PROG}: cannot run: no CUDA GPU found (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    try:
        return run_sweep(args)
    except NotImplementedError as e:
        print(f"{PROG}: not implemented yet: {e}", file=sys.stderr)
        return 1
