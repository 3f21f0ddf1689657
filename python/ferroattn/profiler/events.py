"""Profiler records (one per call) and their Chrome-trace export.

A record is one timed call; :mod:`.table` aggregates them. Sources:

- :class:`ModuleRecord`: forward pre/post hooks (:mod:`.hooks`) that record a CUDA event pair per
  module call (resolved after the forward, no sync inside it): ``gpu_ms`` =
  ``start.elapsed_time(end)``, ``start_us`` = elapsed time from the profile window's reference event.
- :class:`KernelRecord`: our launches, from the Rust launch records (``_native.profiler_drain``:
  kernel name, config name expression, grid, block, registers and shared memory, theoretical
  occupancy, FLOPs and bytes from the op's formula, CUDA-event time; :mod:`.launches`), and other
  libraries' kernels from a torch.profiler run (:mod:`.torch_import`; no launch attributes).

:class:`Records` holds both lists for one profile window and is what ``profile`` exposes:
``key_averages(group_by=...)`` and ``export_chrome_trace(path)``.

Chrome trace: the Trace Event Format (Google, "Trace Event Format" document, the JSON object
form ``{"traceEvents": [...]}``), "X" (complete) events with ``ts`` and ``dur`` in microseconds,
``pid``/``tid`` ints, ``cat``, ``args``; "M" metadata events name the process and threads. It loads
in chrome://tracing and Perfetto.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import ArgumentError
from ._util import atomic_write, integer, output_path, real
from .ceilings import Ceilings, config_dtype
from .roofline import RooflinePoint, Utilisation, utilisation


def _time(name: str, v) -> float:
    return real(name, v, 0)


def _dim3(name: str, v) -> tuple:
    t = tuple(v) if isinstance(v, (tuple, list)) else None
    if t is None or len(t) != 3:
        raise ArgumentError(f"{name}: expected 3 positive ints (x, y, z), got {v!r}")
    return tuple(integer(name, x, 1, where=f" at index {i} of {v!r}") for i, x in enumerate(t))


def _str(name: str, v, allow_empty: bool = True) -> str:
    if not isinstance(v, str) or not (allow_empty or v):
        raise ArgumentError(f"{name}: expected a {'' if allow_empty else 'non-empty '}str, got {v!r}")
    return v


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)   # frozen dataclass: store the normalised value


@dataclass(frozen=True)
class ModuleRecord:
    """One call of one ``torch.nn.Module``.

    name: qualified module name (``model.layers.3.self_attn``); kind: its class name
    (``LlamaAttention``); gpu_ms: GPU time of the call, ms (CUDA events around the forward);
    start_us: start relative to the profile window's reference event, µs; depth: nesting depth (0 = outermost
    profiled module); step: ``prof.step()`` count at the call; device: CUDA device index;
    input_shapes: shapes of the tensor positional arguments (None for non-tensors), or None when
    shapes were not recorded.
    """

    name: str
    kind: str
    gpu_ms: float
    start_us: float = 0.0
    depth: int = 0
    step: int = 0
    device: int = 0
    input_shapes: Optional[tuple] = None

    def __post_init__(self):
        _str("name", self.name, allow_empty=False)
        _str("kind", self.kind)
        for f in ("gpu_ms", "start_us"):
            _set(self, f, _time(f, getattr(self, f)))
        for f in ("depth", "step", "device"):
            _set(self, f, integer(f, getattr(self, f), 0))
        if self.input_shapes is not None and not isinstance(self.input_shapes, tuple):
            raise ArgumentError(f"input_shapes: expected a tuple or None, got {type(self.input_shapes).__name__}")
        for i, sh in enumerate(self.input_shapes or ()):
            # what the trace writes as JSON: None (not a tensor) or a shape of ints
            if sh is not None and (not isinstance(sh, tuple) or not all(isinstance(n, int) for n in sh)):
                raise ArgumentError(f"input_shapes[{i}]: expected None or a shape (a tuple of ints), got {sh!r}")


@dataclass(frozen=True)
class KernelRecord:
    """One kernel launch: one of ours (from the Rust launch records, :mod:`.launches`) or another
    library's (from a simultaneous torch.profiler run, :mod:`.torch_import`: config "", grid/block
    (1, 1, 1), registers/smem_bytes/occupancy None, nbytes 0).

    name: kernel name (ours: the short name, e.g. ``attn_fwd_sm80``; others: as torch.profiler
    shows it); config: the configuration's name expression (e.g.
    ``ferroattn::attn_fwd_sm80<128, 128, 64, 4, 2, true, __nv_bfloat16>``); op: the op it ran for
    (``ferroattn::attn_fwd``, ``aten::mm``, ``torch``); grid, block: launch dimensions (x, y, z); registers: per
    thread; smem_bytes: dynamic + static shared memory per block; occupancy: theoretical, as a
    fraction in [0, 1] (active warps / max warps per SM); flops, nbytes: work of the launch (the
    op's FLOP formula; bytes read + written in global memory); gpu_ms: GPU time, ms; start_us:
    start relative to the profile window's reference event, µs; module: the innermost profiled module it ran
    in, or None; stream: the CUDA stream handle; device: CUDA device index; step: as ModuleRecord.
    registers/smem_bytes/occupancy may be None when the driver did not report them.
    """

    name: str
    config: str
    op: str
    grid: tuple
    block: tuple
    registers: Optional[int]
    smem_bytes: Optional[int]
    occupancy: Optional[float]
    flops: float
    nbytes: float
    gpu_ms: float
    start_us: float = 0.0
    module: Optional[str] = None
    stream: int = 0
    device: int = 0
    step: int = 0

    def __post_init__(self):
        _str("name", self.name, allow_empty=False)
        _str("config", self.config)
        _str("op", self.op)
        if self.module is not None:
            _str("module", self.module)
        _set(self, "grid", _dim3("grid", self.grid))
        _set(self, "block", _dim3("block", self.block))
        for f in ("flops", "nbytes", "gpu_ms", "start_us"):
            _set(self, f, _time(f, getattr(self, f)))
        for f in ("registers", "smem_bytes"):
            if getattr(self, f) is not None:
                _set(self, f, integer(f, getattr(self, f), 0))
        for f in ("stream", "device", "step"):
            _set(self, f, integer(f, getattr(self, f), 0))
        if self.occupancy is not None:
            occ = real("occupancy", self.occupancy, 0)
            if occ > 1.0:
                raise ArgumentError(f"occupancy: expected a fraction in [0, 1] or None, got {self.occupancy!r}")
            _set(self, "occupancy", occ)

    @property
    def tflops(self) -> Optional[float]:
        """Achieved TFLOP/s (None when gpu_ms is 0)."""
        return self.flops / (self.gpu_ms * 1e-3) / 1e12 if self.gpu_ms > 0 else None

    @property
    def gbps(self) -> Optional[float]:
        """Achieved GB/s (None when gpu_ms is 0)."""
        return self.nbytes / (self.gpu_ms * 1e-3) / 1e9 if self.gpu_ms > 0 else None

    @property
    def dtype(self) -> Optional[str]:
        """The dtype named by ``config`` ("bfloat16"/"float16"), or None (:func:`.ceilings.config_dtype`)."""
        return config_dtype(self.config)

    def utilisation(self, ceilings: Ceilings) -> Optional[Utilisation]:
        """Roofline utilisation against ``ceilings`` with the compute ceiling of this kernel's dtype
        (:meth:`Ceilings.for_dtype`; the result's ``ceilings`` say which); None when gpu_ms or
        nbytes is 0."""
        if not isinstance(ceilings, Ceilings):
            raise ArgumentError(f"ceilings: expected a ferroattn.profiler.Ceilings, got {type(ceilings).__name__}")
        if self.gpu_ms <= 0 or self.nbytes <= 0:
            return None
        return utilisation(self.flops, self.nbytes, self.gpu_ms, ceilings.for_dtype(self.dtype))

    def roofline_point(self) -> RooflinePoint:
        return RooflinePoint.from_measurement(self.name, self.flops, self.nbytes, self.gpu_ms)


def _clean(v: Any) -> Any:
    """JSON-safe value: tuples -> lists, NaN/inf -> None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (tuple, list)):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    return v


def _us(name: str, r) -> float:
    """``r.gpu_ms`` in µs; ArgumentError when that overflows to inf (JSON has no inf)."""
    dur = r.gpu_ms * 1e3
    if not math.isfinite(dur):
        raise ArgumentError(f"{name}: expected a gpu_ms whose duration in µs is finite, got {r.gpu_ms!r} "
                            f"(record {r.name!r})")
    return dur


MODULE_TID = 1
KERNEL_TID = 2


def _check_records(modules, kernels, ceilings) -> None:
    for name, recs, cls in (("modules", modules, ModuleRecord), ("kernels", kernels, KernelRecord)):
        if isinstance(recs, (str, bytes, dict)) or not isinstance(recs, (list, tuple)):
            raise ArgumentError(f"{name}: expected a list of {cls.__name__}, got {type(recs).__name__}")
        for i, r in enumerate(recs):
            if not isinstance(r, cls):
                raise ArgumentError(f"{name}[{i}]: expected a {cls.__name__}, got {type(r).__name__}")
    if ceilings is not None and not isinstance(ceilings, Ceilings):
        raise ArgumentError(f"ceilings: expected None or a ferroattn.profiler.Ceilings, got {type(ceilings).__name__}")


def chrome_trace_events(modules: Sequence[ModuleRecord] = (), kernels: Sequence[KernelRecord] = (),
                        ceilings: Optional[Ceilings] = None) -> list:
    """The trace events (list of dicts) for the records: one "X" event per record
    (modules: cat "ferroattn_module", tid 1; kernels: cat "ferroattn_kernel", tid 2; pid = device),
    plus "M" process/thread names. ``ts``/``dur`` in µs. ArgumentError when ``modules`` /
    ``kernels`` are not sequences of ModuleRecord / KernelRecord or ``ceilings`` is not None or a
    Ceilings."""
    _check_records(modules, kernels, ceilings)
    events: list = []
    devices = sorted({r.device for r in modules} | {r.device for r in kernels})
    for d in devices:
        events.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0,
                       "args": {"name": f"ferroattn GPU {d}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": MODULE_TID,
                       "args": {"name": "modules (GPU time)"}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": KERNEL_TID,
                       "args": {"name": "ferroattn kernels"}})
    for r in modules:
        events.append({"name": r.name, "cat": "ferroattn_module", "ph": "X", "ts": r.start_us,
                       "dur": _us("modules", r), "pid": r.device, "tid": MODULE_TID,
                       "args": {"kind": r.kind, "depth": r.depth, "step": r.step,
                                **({"input_shapes": r.input_shapes} if r.input_shapes is not None else {})}})
    for r in kernels:
        args = {"config": r.config, "op": r.op, "grid": r.grid, "block": r.block, "registers per thread":
                r.registers, "shared memory": r.smem_bytes,
                "theoretical occupancy %": None if r.occupancy is None else 100.0 * r.occupancy,
                "flops": r.flops, "bytes": r.nbytes, "TFLOP/s": r.tflops, "GB/s": r.gbps,
                "module": r.module, "stream": r.stream, "step": r.step}
        u = r.utilisation(ceilings) if ceilings is not None else None
        if u is not None:
            args["% of roofline"] = u.pct_of_roofline
            args["ceilings"] = u.ceilings.label()
        events.append({"name": r.name, "cat": "ferroattn_kernel", "ph": "X", "ts": r.start_us,
                       "dur": _us("kernels", r), "pid": r.device, "tid": KERNEL_TID, "args": args})
    return [_clean(e) for e in events]


def export_chrome_trace(path: os.PathLike, modules: Sequence[ModuleRecord] = (),
                        kernels: Sequence[KernelRecord] = (), ceilings: Optional[Ceilings] = None) -> None:
    """Write the records as a Chrome trace JSON file at ``path`` (see :func:`chrome_trace_events`),
    atomically (temp file in the same directory, then ``os.replace``: a failure leaves a previous
    file intact). Raises ArgumentError naming ``path`` (empty, a directory) or a record field that
    cannot be written; OSError when the file cannot be written."""
    path = output_path("path", path)
    doc = {"traceEvents": chrome_trace_events(modules, kernels, ceilings), "displayTimeUnit": "ms",
           "otherData": {"producer": "ferroattn.profiler",
                         "ceilings": ceilings.label() if ceilings is not None else None}}
    text = json.dumps(doc, allow_nan=False)
    atomic_write(path, lambda f: f.write(text))


@dataclass
class Records:
    """Everything one profile window recorded: ``modules`` and ``kernels`` (one record per call,
    start_us on one time base), the ceilings utilisation figures use (None: no % of ceiling
    columns) and ``total_gpu_ms``, the GPU time of the profiled window in ms (the denominator of
    "% of total"; ``profile`` sets the summed outermost module records, or without a model the
    window's reference-to-end time; None: computed by :func:`.table.key_averages`; else a finite
    number >= 0, ArgumentError otherwise)."""

    modules: list = field(default_factory=list)
    kernels: list = field(default_factory=list)
    ceilings: Optional[Ceilings] = None
    total_gpu_ms: Optional[float] = None

    def __post_init__(self):
        _check_records(self.modules, self.kernels, self.ceilings)
        if self.total_gpu_ms is not None:
            self.total_gpu_ms = real("total_gpu_ms", self.total_gpu_ms, 0.0)

    def key_averages(self, group_by: str = "module"):
        """Aggregate by ``group_by`` ("module", "kernel" or "op"); see :func:`.table.key_averages`."""
        from .table import key_averages
        return key_averages(self, group_by=group_by)

    def export_chrome_trace(self, path: os.PathLike) -> None:
        """Write a Chrome trace JSON file (see :func:`export_chrome_trace`)."""
        export_chrome_trace(path, self.modules, self.kernels, self.ceilings)
