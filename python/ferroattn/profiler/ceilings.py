"""Measured hardware ceilings, cached once per device.

:func:`measure_ceilings` times the two ceilings with :func:`ferroattn.bench.ceilings.measure`
(a random-normal bf16 ``torch.matmul`` of 8192^3 -> TFLOP/s, and a 1 GiB device-to-device
``copy_`` counting bytes read + written -> GB/s, both the median of CUDA-event/``do_bench`` timings)
and stores the result as JSON in ``<cache dir>/profiler_ceilings.json``, keyed by device name,
driver version, torch version and CUDA version. The cache dir is the kernel cache's:
``$FERROATTN_CACHE_DIR``, else ``~/.cache/ferroattn``.

Every utilisation figure carries the :class:`Ceilings` it was computed against
(:meth:`Ceilings.label` says what was measured, on which device, when).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..errors import ArgumentError, FerroattnError

CACHE_FILE = "profiler_ceilings.json"
CACHE_VERSION = 1


@dataclass(frozen=True)
class Ceilings:
    """The roofline's two ceilings.

    peak_tflops: compute ceiling, TFLOP/s (1e12 FLOP/s); bandwidth_gbps: memory ceiling, GB/s
    (1e9 byte/s); compute_source / memory_source: what was timed to get them; device: the GPU's
    name; measured_at: ISO-8601 UTC time of the measurement ("" when given by hand).
    """

    peak_tflops: float
    bandwidth_gbps: float
    compute_source: str = "given"
    memory_source: str = "given"
    device: str = "unknown"
    measured_at: str = ""

    def __post_init__(self):
        for name in ("peak_tflops", "bandwidth_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArgumentError(f"{name}: expected a finite number > 0, got {v!r}")

    def label(self) -> str:
        """One line naming both ceilings and their sources, e.g. for a table footer or a plot."""
        when = f", {self.measured_at}" if self.measured_at else ""
        return (f"ceilings ({self.device}{when}): compute {self.peak_tflops:.1f} TFLOP/s "
                f"[{self.compute_source}]; memory {self.bandwidth_gbps:.0f} GB/s [{self.memory_source}]")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Ceilings":
        return cls(float(d["peak_tflops"]), float(d["bandwidth_gbps"]), str(d["compute_source"]),
                   str(d["memory_source"]), str(d["device"]), str(d.get("measured_at", "")))


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
    (needs torch with CUDA)."""
    import torch

    from ..bench.report import driver_version
    return {"device": torch.cuda.get_device_name(device), "driver": str(driver_version()),
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}


def _key_string(key: Mapping[str, Any]) -> str:
    return "|".join(f"{k}={key[k]}" for k in sorted(key))


def _from_measurement(m: Mapping[str, Any], device: str) -> Ceilings:
    mm, cp = m.get("matmul_bf16"), m.get("copy_d2d")
    if not mm or not cp:
        reasons = "; ".join(str(m.get(k)) for k in ("matmul_bf16_error", "copy_d2d_error") if m.get(k))
        raise FerroattnError(f"measure_ceilings: the measurement failed ({reasons or 'no result'}); nothing cached")
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    return Ceilings(float(mm["tflops"]), float(cp["gbps"]), str(mm.get("what", "matmul")),
                    str(cp.get("what", "copy")), device, now)


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
    fd, tmp = tempfile.mkstemp(prefix=".ceilings.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def measure_ceilings(device: int = 0, *, refresh: bool = False, cache_dir: Optional[os.PathLike] = None,
                     measure: Optional[Callable[[], Mapping[str, Any]]] = None,
                     key: Optional[Mapping[str, Any]] = None) -> Ceilings:
    """The measured :class:`Ceilings` of CUDA device ``device``, from the cache when present.

    refresh: measure again and replace the cached entry; cache_dir: where the JSON cache lives
    (default :func:`default_cache_dir`); measure: a callable returning the dict of
    :func:`ferroattn.bench.ceilings.measure` (``{"matmul_bf16": {"tflops", "what"}, "copy_d2d":
    {"gbps", "what"}}``; injected by tests); key: the cache key (default :func:`device_key`).

    Raises :class:`ferroattn.errors.FerroattnError` when the measurement fails (nothing is cached
    then) and :class:`ferroattn.errors.ArgumentError` for a bad ``device``.
    """
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ArgumentError(f"device: expected a CUDA device index >= 0, got {device!r}")
    if key is None:
        key = device_key(device)
    if measure is None:
        import torch

        from ..bench import ceilings as _bench_ceilings

        def measure():
            with torch.cuda.device(device):
                return _bench_ceilings.measure()
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
