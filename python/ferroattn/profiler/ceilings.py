"""Measured hardware ceilings, cached once per device.

:func:`measure_ceilings` times the ceilings with :mod:`ferroattn._measure`: a random-normal
``torch.matmul`` of 8192^3 in bf16 AND in fp16 (cuBLAS; -> TFLOP/s each) and a 1 GiB
device-to-device ``copy_`` counting bytes read + written (-> GB/s), each the median of
CUDA-event/``do_bench`` timings, and stores the result as JSON in
``<cache dir>/profiler_ceilings.json``, keyed by device name, driver version, torch version and
CUDA version. The cache dir is the kernel cache's: ``$FERROATTN_CACHE_DIR``, else
``~/.cache/ferroattn``. :func:`cached_ceilings` reads the cache without measuring.

Every utilisation figure carries the :class:`Ceilings` it was computed against
(:meth:`Ceilings.label` says what was measured, on which device, when). A kernel is compared with
the compute ceiling of its own dtype (:meth:`Ceilings.for_dtype`, dtype read from its config's
template arguments by :func:`config_dtype`); ``peak_tflops`` is the bf16 one.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..errors import ArgumentError, FerroattnError, NoDeviceError
from ._util import atomic_write, integer, real

CACHE_FILE = "profiler_ceilings.json"
CACHE_VERSION = 2   # 2: bf16 and fp16 matmul ceilings

#: dtype names :meth:`Ceilings.for_dtype` accepts -> canonical torch dtype name
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "__nv_bfloat16": "bfloat16",
                 "float16": "float16", "fp16": "float16", "half": "float16", "__half": "float16"}


def config_dtype(config: str) -> Optional[str]:
    """The dtype ("bfloat16"/"float16") a kernel configuration name expression names as a template
    argument (e.g. ``ferroattn::attn_fwd_sm80<64, 128, 64, 4, 2, true, __nv_bfloat16>``), or None."""
    if not isinstance(config, str) or "<" not in config:
        return None
    args = [a.strip() for a in config[config.index("<") + 1:config.rindex(">") if ">" in config else None].split(",")]
    found = {DTYPE_ALIASES[a] for a in args if a in DTYPE_ALIASES}
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class Ceilings:
    """The roofline's two ceilings.

    peak_tflops: compute ceiling, TFLOP/s (1e12 FLOP/s; the bf16 matmul's when measured);
    bandwidth_gbps: memory ceiling, GB/s (1e9 byte/s); compute_source / memory_source: what was
    timed to get them; device: the GPU's name; measured_at: ISO-8601 UTC time of the measurement
    ("" when given by hand); by_dtype: per-dtype compute ceilings, a tuple of
    ``(dtype, tflops, source)`` (dtype "bfloat16"/"float16"; empty when given by hand).
    """

    peak_tflops: float
    bandwidth_gbps: float
    compute_source: str = "given"
    memory_source: str = "given"
    device: str = "unknown"
    measured_at: str = ""
    by_dtype: tuple = ()

    def __post_init__(self):
        for name in ("peak_tflops", "bandwidth_gbps"):
            object.__setattr__(self, name, real(name, getattr(self, name), 0, strict=True))
        items = []
        if isinstance(self.by_dtype, (str, bytes)) or not isinstance(self.by_dtype, (tuple, list)):
            raise ArgumentError(f"by_dtype: expected a tuple of (dtype, tflops, source) triples, got {self.by_dtype!r}")
        for e in self.by_dtype:
            try:
                dt, tf, src = e
            except (TypeError, ValueError):
                raise ArgumentError(f"by_dtype: expected (dtype, tflops, source) triples, got {e!r}") from None
            if not isinstance(dt, str) or dt not in DTYPE_ALIASES:
                raise ArgumentError(f"by_dtype: expected dtypes among {sorted(set(DTYPE_ALIASES.values()))}, got {dt!r}")
            items.append((DTYPE_ALIASES[dt], real(f"by_dtype ({dt} TFLOP/s)", tf, 0, strict=True), str(src)))
        object.__setattr__(self, "by_dtype", tuple(items))

    def for_dtype(self, dtype: Optional[str]) -> "Ceilings":
        """These ceilings with the compute ceiling (``peak_tflops``, ``compute_source``) of
        ``dtype`` ("bfloat16"/"bf16"/"__nv_bfloat16", "float16"/"fp16"/"__half"); unchanged when
        ``dtype`` is None or has no measured ceiling."""
        dt = DTYPE_ALIASES.get(dtype) if isinstance(dtype, str) else None
        for d, tf, src in self.by_dtype:
            if d == dt:
                return replace(self, peak_tflops=tf, compute_source=src)
        return self

    def label(self) -> str:
        """One line naming the ceilings and their sources, e.g. for a table footer or a plot."""
        when = f", {self.measured_at}" if self.measured_at else ""
        others = [f"{d} {tf:.1f} TFLOP/s" for d, tf, src in self.by_dtype if src != self.compute_source]
        extra = f" (per dtype: {', '.join(others)}; kernels use their dtype's)" if others else ""
        return (f"ceilings ({self.device}{when}): compute {self.peak_tflops:.1f} TFLOP/s "
                f"[{self.compute_source}]{extra}; memory {self.bandwidth_gbps:.0f} GB/s [{self.memory_source}]")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["by_dtype"] = [list(e) for e in self.by_dtype]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Ceilings":
        """The ceilings of a :meth:`to_dict` dict (the cache file's form). ArgumentError naming a
        missing or malformed field."""
        if not isinstance(d, Mapping):
            raise ArgumentError(f"d: expected a mapping of the ceilings' fields, got {type(d).__name__}")
        for key in ("peak_tflops", "bandwidth_gbps", "compute_source", "memory_source", "device"):
            if key not in d:
                raise ArgumentError(f"{key}: expected in the ceilings dict, got keys {sorted(d)}")
        return cls(d["peak_tflops"], d["bandwidth_gbps"], str(d["compute_source"]),
                   str(d["memory_source"]), str(d["device"]), str(d.get("measured_at", "")),
                   tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in d.get("by_dtype", ())))


def default_cache_dir() -> Path:
    """``$FERROATTN_CACHE_DIR``, else ``~/.cache/ferroattn`` (the rule of the Rust kernel cache)."""
    env = os.environ.get("FERROATTN_CACHE_DIR")
    if env:
        return Path(env)
    home = os.environ.get("HOME")
    if home:
        return Path(home) / ".cache" / "ferroattn"
    return Path(tempfile.gettempdir()) / "ferroattn-cache"


def device_key(device: int = 0) -> dict:
    """What the cache is keyed by: {device, driver, torch, cuda} of CUDA device ``device``
    (needs torch with CUDA). Raises NoDeviceError without a CUDA GPU, ArgumentError for an index
    beyond the GPUs present."""
    import torch
    device = integer("device", device, 0)
    if not torch.cuda.is_available():
        raise NoDeviceError(f"device: CUDA device {device} needs a CUDA GPU (torch.cuda.is_available() is False)")
    n = torch.cuda.device_count()
    if device >= n:
        raise ArgumentError(f"device: expected a CUDA device index in [0, {n - 1}], got {device}")

    from .._measure import driver_version
    return {"device": torch.cuda.get_device_name(device), "driver": str(driver_version()),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}


def _key_string(key: Mapping[str, Any]) -> str:
    return "|".join(f"{k}={key[k]}" for k in sorted(key))


def _from_measurement(m: Mapping[str, Any], device: str) -> Ceilings:
    """Ceilings from ``{"matmul_bf16": {tflops, what}, "matmul_fp16": {...} (optional),
    "copy_d2d": {gbps, what}}``; FerroattnError when bf16 matmul or copy is missing."""
    mm, cp = m.get("matmul_bf16"), m.get("copy_d2d")
    if not mm or not cp:
        reasons = "; ".join(str(m.get(k)) for k in ("matmul_bf16_error", "matmul_fp16_error", "copy_d2d_error")
                            if m.get(k))
        raise FerroattnError(f"measure_ceilings: the measurement failed ({reasons or 'no result'}); nothing cached")
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    by = [("bfloat16", float(mm["tflops"]), str(mm.get("what", "matmul bf16")))]
    f16 = m.get("matmul_fp16")
    if f16:
        by.append(("float16", float(f16["tflops"]), str(f16.get("what", "matmul fp16"))))
    return Ceilings(float(mm["tflops"]), float(cp["gbps"]), str(mm.get("what", "matmul")),
                    str(cp.get("what", "copy")), device, now, tuple(by))


def _measure_default(device: int) -> dict:
    """bf16 matmul + copy (:func:`ferroattn._measure.measure`) and an fp16 matmul, on ``device``."""
    import torch

    from .. import _measure
    with torch.cuda.device(device):
        out = dict(_measure.measure())
        try:
            out["matmul_fp16"] = _measure.matmul_tflops(dtype="float16")
        except Exception as e:
            out["matmul_fp16"] = None
            out["matmul_fp16_error"] = f"{type(e).__name__}: {e}"
    return out


def _read_cache(path: Path) -> dict:
    """The cache's entries, {} when absent or unreadable (a corrupt file is re-measured and replaced)."""
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict):
            return data["entries"]
    except (OSError, ValueError):
        pass
    return {}


def _write_cache(path: Path, entries: dict) -> None:
    """Atomic write: temp file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1,
                                           sort_keys=True))


def measure_ceilings(device: int = 0, *, refresh: bool = False, cache_dir: Optional[os.PathLike] = None,
                     measure: Optional[Callable[[], Mapping[str, Any]]] = None,
                     key: Optional[Mapping[str, Any]] = None) -> Ceilings:
    """The measured :class:`Ceilings` of CUDA device ``device``, from the cache when present.

    refresh: measure again and replace the cached entry; cache_dir: where the JSON cache lives
    (default :func:`default_cache_dir`); measure: a callable returning ``{"matmul_bf16":
    {"tflops", "what"}, "matmul_fp16": {"tflops", "what"}, "copy_d2d": {"gbps", "what"}}``
    (default: :func:`ferroattn._measure.measure` plus an fp16 matmul; injected by tests;
    a missing fp16 entry leaves that dtype out); key: the cache key (default :func:`device_key`).

    Raises :class:`ferroattn.errors.FerroattnError` when the measurement fails (nothing is cached
    then), :class:`ferroattn.errors.NoDeviceError` without a CUDA GPU (default ``key``) and
    :class:`ferroattn.errors.ArgumentError` for a bad ``device``.
    """
    device = integer("device", device, 0)
    if key is None:
        key = device_key(device)
    if measure is None:
        def measure():
            return _measure_default(device)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_FILE
    ks = _key_string(key)
    entries = _read_cache(path)
    if not refresh and ks in entries:
        try:
            return Ceilings.from_dict(entries[ks]["ceilings"])
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: measure again
    ceil = _from_measurement(measure(), str(key.get("device", "unknown")))
    entries = _read_cache(path)  # another process may have written meanwhile
    entries[ks] = {"key": dict(key), "ceilings": ceil.to_dict()}
    _write_cache(path, entries)
    return ceil


def cached_ceilings(device: int = 0, *, cache_dir: Optional[os.PathLike] = None,
                    key: Optional[Mapping[str, Any]] = None) -> Optional[Ceilings]:
    """The cached :class:`Ceilings` of CUDA device ``device`` (what :func:`measure_ceilings` stored),
    or None when there is none (also without a CUDA GPU, when ``key`` is not given); never measures.
    key: as :func:`measure_ceilings` (default :func:`device_key`). ArgumentError for a bad ``device``."""
    device = integer("device", device, 0)
    if key is None:
        try:
            key = device_key(device)
        except NoDeviceError:
            return None
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_FILE
    entry = _read_cache(path).get(_key_string(key))
    try:
        return Ceilings.from_dict(entry["ceilings"]) if entry else None
    except (KeyError, TypeError, ValueError):
        return None
