"""Kernels of other libraries (torch, cuBLAS, ...) from a ``torch.profiler.profile`` run at the
same time as a ferroattn profile, as :class:`~.events.KernelRecord` s.

Source: the finished profiler's ``events()`` (``torch.autograd.profiler_util.FunctionEvent``
objects). torch attaches each CUDA kernel to the CPU op that launched it (``event.kernels``: name,
device, duration in µs); the op's ``cpu_parent`` chain leads up through the
``record_function`` ranges that :mod:`.hooks` opens, named by qualified module name.

Per kernel launched by a CPU op (our kernels, whose names contain ``"ferroattn::"``, are skipped:
the Rust launch records already describe them):

- name: the kernel's name as torch reports it; config "" ; op: the launching op's name when it is
  an ``aten::`` op, else the nearest ``aten::`` ancestor's, else ``"torch"``;
- module: the innermost enclosing range (``cpu_parent`` walk) whose name is in ``module_names``;
- gpu_ms: the kernel's device duration / 1000; grid/block (1, 1, 1) and registers, smem_bytes,
  occupancy None (torch's events do not carry them); nbytes 0; flops: the op's ``flops`` when torch
  counted them (``with_flops=True`` in torch.profiler) and the op launched exactly one kernel, else 0;
- start_us: the matching device event's start (the n-th launch of a kernel name <-> the n-th
  device event of that name), moved into our time base by the median offset between our own
  kernels as torch saw them and our launch records (``ours``); without that anchor, relative to
  the first device event of the torch trace (0 when no device event matches).
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Optional, Sequence

from ..errors import ArgumentError
from .events import KernelRecord

OURS = "ferroattn::"


def _is_cpu(e: Any) -> bool:
    dt = getattr(e, "device_type", None)
    return getattr(dt, "name", str(dt)).upper().endswith("CPU")


def _events(tp: Any) -> list:
    ev = getattr(tp, "events", None)
    if not callable(ev):
        raise ArgumentError(f"tp: expected a finished torch.profiler.profile (with .events()), "
                            f"got {type(tp).__name__}")
    # a torch profiler that is still running (or never ran) has no results yet: its events()
    # would be an empty list, silently
    inner = getattr(tp, "profiler", tp)
    if inner is not None and getattr(inner, "kineto_results", False) is None:
        raise ArgumentError(f"tp: expected a finished torch.profiler.profile, got one that is still running or "
                            f"never ran ({type(tp).__name__} without results; leave its with-block first)")
    try:
        out = ev()
    except (AssertionError, RuntimeError) as e:
        raise ArgumentError(f"tp: expected a finished torch.profiler.profile (leave its with-block "
                            f"first), events() failed: {e}") from None
    if out is None:
        raise ArgumentError("tp: expected a finished torch.profiler.profile, its events() returned None")
    return list(out)


def _start(e: Any) -> float:
    tr = getattr(e, "time_range", None)
    return float(tr.start) if tr is not None else 0.0


def _op_of(e: Any) -> str:
    x = e
    while x is not None:
        if str(getattr(x, "name", "")).startswith("aten::"):
            return str(x.name)
        x = getattr(x, "cpu_parent", None)
    return "torch"


def _module_of(e: Any, module_names: set) -> Optional[str]:
    x = e
    while x is not None:
        if getattr(x, "name", None) in module_names:
            return str(x.name)
        x = getattr(x, "cpu_parent", None)
    return None


def kernels_from_torch(tp: Any, module_names: Iterable[str] = (), ours: Sequence[KernelRecord] = (),
                       with_flops: bool = True, step: int = 0) -> list:
    """:class:`KernelRecord` s of the non-ferroattn kernels in ``tp`` (rules: module docstring).

    tp: a finished ``torch.profiler.profile`` (or any object whose ``events()`` returns
    FunctionEvent-like objects: name, device_type, time_range.start, kernels, cpu_parent, flops);
    module_names: the names of our module ranges; ours: our kernel records of the same window
    (anchor the time base); step: written into the records. Raises ArgumentError for a ``tp`` that is
    not a finished profiler."""
    names = set(module_names)
    events = _events(tp)
    cpu_ops = sorted((e for e in events if _is_cpu(e) and getattr(e, "kernels", None)), key=_start)
    device = sorted((e for e in events if not _is_cpu(e)), key=_start)
    by_name: dict = {}
    for d in device:
        by_name.setdefault(str(d.name), []).append(d)
    seen: dict = {}
    launches = []          # (cpu op, kernel, device event or None)
    for op in cpu_ops:
        for k in op.kernels:
            kname = str(k.name)
            i = seen.get(kname, 0)
            seen[kname] = i + 1
            devs = by_name.get(kname, [])
            launches.append((op, k, devs[i] if i < len(devs) else None))

    # time base: our kernels as torch saw them vs our launch records (same order per name)
    offsets = []
    for rec_name in {r.name for r in ours}:
        mine = sorted((r for r in ours if r.name == rec_name), key=lambda r: r.start_us)
        theirs = [d for d in device if OURS in str(d.name) and rec_name in str(d.name)]
        offsets += [r.start_us - _start(d) for r, d in zip(mine, theirs)]
    if offsets:
        offset = statistics.median(offsets)
    else:
        offset = -_start(device[0]) if device else 0.0

    out = []
    for op, k, dev in launches:
        if OURS in str(k.name):
            continue
        fl = getattr(op, "flops", None)
        flops = float(fl) if (with_flops and fl and len(op.kernels) == 1) else 0.0
        start = max(0.0, _start(dev) + offset) if dev is not None else 0.0
        out.append(KernelRecord(
            name=str(k.name), config="", op=_op_of(op), grid=(1, 1, 1), block=(1, 1, 1), registers=None,
            smem_bytes=None, occupancy=None, flops=max(0.0, flops), nbytes=0.0,
            gpu_ms=max(0.0, float(k.duration) / 1e3), start_us=start, module=_module_of(op, names),
            stream=0, device=int(getattr(k, "device", 0) or 0), step=int(step)))
    return out
