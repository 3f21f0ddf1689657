"""Which path :func:`ferroattn.sparse24.matmul` takes with ``backend="auto"``: the measured table
:data:`DISPATCH_TABLE` and the margin :data:`SPARSE_MIN_SPEEDUP` (the rule: :mod:`ferroattn.sparse24`)."""
from __future__ import annotations

import json
import math
import os
from typing import Mapping, Optional

import torch

from ..errors import ArgumentError
from .tensor import device_arch

__all__ = ["DISPATCH_TABLE", "SPARSE_MIN_SPEEDUP", "choose_backend", "set_dispatch_table", "load_dispatch_table"]

#: arch ("sm_90") -> dtype ("bfloat16"/"float16") -> {(n, k): ((rows, speedup over dense), ...)}
#: from ``python -m ferroattn bench sparse24`` (it prints this literal from its measurements).
#: Measured on an H200 (sm_90) on 2026-11-30 (bench/results/sparse24_nvidia-h200_20261130T085021.json, bf16 and
#: fp16, 5 paired rounds per point) for the kernel the native "auto" ran then: wgmma_sp from 256 rows (its
#: per-kernel column), mma_sp below. The entries at
#: 16 / 128 / 256 / 512 / 1024 rows of the four LLM weight shapes (bf16; fp16 from 256 rows) re-measured by GPU time
#: only (paired rounds, L2 flushed; raw JSON
#: bench/results/sparse24_splitk_20261130T1105/call1_split_{bf16,fp16}_20261130T1105.json)
#: for the new native auto: wgmma_sp with split-k (src/tuning/sparse24/schedule.rs wgmma_split_plan) from 46 rows
#: (src/ops/sparse24/mod.rs WGMMA_MIN_ROWS), mma_sp below; the 64 / 96 / 128-row entries (both dtypes) from
#: bench/results/sparse24_splitk_20261130T1105/call2_kernels_{bf16,fp16}.json (wgmma_sp column). Rows 46 and up
#: find their nearest entry at >= 64 rows (wgmma_sp-measured), rows <= 45 at <= 32 (mma_sp-measured): keep the
#: native WGMMA_MIN_ROWS on that boundary so each entry describes the kernel that runs. The
#: entries whose native schedule became the 128-row wgmma_sp tile (src/tuning/sparse24/schedule.rs wgmma_schedule) re-measured
#: by GPU time (paired rounds, L2 flushed; scripts/sparse24_schedule_timing.py, raw JSON
#: bench/results/sparse24_schedules_20261130T1333/call2_sweep_20261130T1341.json): 1024^3; 256 / 512
#: rows x 4096 x 4096; 128 rows x 11008 x 4096 and 14336 x 4096; 512 rows x 4096 x 11008.
DISPATCH_TABLE: dict[str, dict[str, dict[tuple[int, int], tuple[tuple[int, float], ...]]]] = {
    'sm_90': {
        'bfloat16': {
            (1024, 1024): ((1024, 0.954),),
            (2048, 2048): ((2048, 1.2875),),
            (4096, 4096): ((16, 1.1472), (32, 0.8355), (64, 0.8095), (96, 0.9549), (128, 0.7407), (256, 1.193), (512, 1.306), (1024, 1.372), (2048, 1.4436), (4096, 1.4506), (4096, 1.4529), (8192, 1.4535), (16384, 1.4779),),
            (8192, 8192): ((8192, 1.493),),
            (16384, 16384): ((16384, 1.4981),),
            (11008, 4096): ((16, 1.436), (32, 1.3187), (64, 1.0585), (96, 1.0223), (128, 1.294), (256, 1.0822), (512, 1.0712), (1024, 1.3593), (2048, 1.399), (4096, 1.4821), (8192, 1.4483), (16384, 1.5246),),
            (4096, 11008): ((16, 1.0143), (32, 0.695), (64, 1.1873), (96, 1.1471), (128, 1.117), (256, 1.1275), (512, 1.367), (1024, 1.4659), (2048, 1.4835), (4096, 1.5375), (8192, 1.4696), (16384, 1.526),),
            (14336, 4096): ((16, 1.3894), (32, 1.1905), (64, 1.0995), (96, 1.051), (128, 1.437), (256, 1.2789), (512, 1.5237), (1024, 1.3243), (2048, 1.4845), (4096, 1.4377), (8192, 1.4435), (16384, 1.498),),
        },
        'float16': {
            (1024, 1024): ((1024, 0.942),),
            (2048, 2048): ((2048, 1.2985),),
            (4096, 4096): ((16, 1.1487), (32, 0.8271), (64, 0.8216), (96, 0.9739), (128, 0.7443), (256, 1.155), (512, 1.335), (1024, 1.3579), (2048, 1.4199), (4096, 1.4483), (4096, 1.4484), (8192, 1.4666), (16384, 1.4859),),
            (8192, 8192): ((8192, 1.5178),),
            (16384, 16384): ((16384, 1.4548),),
            (11008, 4096): ((16, 1.4245), (32, 1.3093), (64, 1.0501), (96, 1.0355), (128, 1.287), (256, 1.0735), (512, 1.081), (1024, 1.343), (2048, 1.3777), (4096, 1.4933), (8192, 1.4515), (16384, 1.4625),),
            (4096, 11008): ((16, 1.0095), (32, 0.7077), (64, 1.163), (96, 1.17), (128, 1.1173), (256, 1.0427), (512, 1.365), (1024, 1.4532), (2048, 1.4933), (4096, 1.5419), (8192, 1.5063), (16384, 1.5),),
            (14336, 4096): ((16, 1.3305), (32, 1.1853), (64, 1.0878), (96, 1.0561), (128, 1.443), (256, 1.354), (512, 1.5267), (1024, 1.3067), (2048, 1.506), (4096, 1.4578), (8192, 1.4351), (16384, 1.461),),
        },
    },
}
#: the sparse kernel is chosen where it measured at least this much faster than dense. A margin of 1.1 suited one
#: timing per entry on a power-capped GPU drifting by a few per cent); the entries are now paired per-round
#: ratios (drift cancels, rounds agree within ~1-2 %), so 3 % above parity: a noisy win of 1.03 is at worst a
#: ~0.98x loss against dense (never near the 0.95x floor), while 1.1 kept dense where cuSPARSELt beats dense
#: and our sparse kernel beats cuSPARSELt (256 / 512 x 11008 x 4096: sparse 1.07-1.08x dense, 1.02-1.06x peer)
SPARSE_MIN_SPEEDUP = 1.03


_DECISIONS: dict[tuple, str] = {}     # memo of _decide (a plain dict: torch.compile traces it)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _decide(arch: str, dtype: str, n: int, k: int, rows: int) -> str:
    key = (arch, dtype, n, k, rows)
    got = _DECISIONS.get(key)
    if got is None:
        got = _DECISIONS[key] = _decide_uncached(arch, dtype, n, k, rows)
        if len(_DECISIONS) > 65536:
            _DECISIONS.clear()
    return got


def _decide_uncached(arch: str, dtype: str, n: int, k: int, rows: int) -> str:
    # plain loops (no min(key=...)): torch.compile traces this when matmul runs inside a graph
    shapes = DISPATCH_TABLE.get(arch, {}).get(dtype)
    if not shapes:
        return "sparse"
    best, best_d = None, None
    for nk in sorted(shapes):                       # nearest measured shape in log space; ties: smaller
        d = abs(math.log(n / nk[0])) + abs(math.log(k / nk[1]))
        if best_d is None or d < best_d:
            best, best_d = nk, d
    lr = math.log(max(rows, 1))
    speedup, best_r = None, None
    for r, s in sorted(shapes[best]):               # nearest measured row count in log space; ties: fewer
        d = abs(math.log(max(r, 1)) - lr)
        if best_r is None or d < best_r:
            speedup, best_r = s, d
    if speedup is None:
        return "sparse"
    return "sparse" if speedup >= SPARSE_MIN_SPEEDUP else "dense"


def choose_backend(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                   arch: Optional[str] = None) -> str:
    """"dense" or "sparse" for a call of ``rows`` rows against an (n, k) 2:4 weight (the rule of
    the module docstring). CPU and other non-CUDA devices: "dense". ``arch`` ("sm_90"): the
    device's, when the caller knows it (default: asked from torch).

    Raises:
        ArgumentError: n or k < 1, or rows < 0."""
    for name, v, low in (("rows", rows, 0), ("n", n, 1), ("k", k, 1)):
        if int(v) < low:
            raise ArgumentError(f"{name}: expected an integer >= {low}, got {v}")
    if device.type != "cuda":
        return "dense"
    arch = arch or device_arch(device)
    if arch is None:
        return "sparse"
    name = _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")
    return _decide(arch, name, int(n), int(k), int(rows))


def set_dispatch_table(table: Mapping) -> None:
    """Replace :data:`DISPATCH_TABLE` (same nesting; keys of the shape dict may be "n,k" strings
    or (n, k) tuples) and clear the decision cache.

    Raises:
        ArgumentError: a malformed table: wrong nesting, n or k < 1, rows < 0, or a speedup that is
            not a finite number > 0 (the table is left unchanged)."""
    new: dict = {}
    try:
        for arch, by_dtype in table.items():
            for dt, shapes in by_dtype.items():
                for nk, pts in shapes.items():
                    n, k = (int(v) for v in (nk.split(",") if isinstance(nk, str) else nk))
                    if n < 1 or k < 1:
                        raise ValueError(f"shape {nk!r}: n and k must be >= 1")
                    entry = tuple((int(r), float(s)) for r, s in pts)
                    for r, sp in entry:
                        if r < 0 or not math.isfinite(sp) or sp <= 0:
                            raise ValueError(f"shape {nk!r}: ({r}, {sp}) needs rows >= 0 and a finite speedup > 0")
                    new.setdefault(str(arch), {}).setdefault(str(dt), {})[(n, k)] = entry
    except (AttributeError, TypeError, ValueError) as e:
        raise ArgumentError(f"table: expected {{arch: {{dtype: {{(n, k): [(rows, speedup), ...]}}}}}}, got an "
                            f"entry that does not fit ({type(e).__name__}: {e})") from None
    DISPATCH_TABLE.clear()
    DISPATCH_TABLE.update(new)
    _DECISIONS.clear()


def load_dispatch_table(path: str | os.PathLike) -> None:
    """:func:`set_dispatch_table` from a ``bench sparse24`` JSON file (its "dispatch_table")."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    set_dispatch_table(data.get("dispatch_table", data))
