"""Launch records of our kernels: the adapter over the Rust recorder and the conversion of its
records into :class:`~.events.KernelRecord` s.

Source: ``ferroattn._native.profiler_enable / profiler_enabled / profiler_stats /
profiler_drain(reference_event)`` (contract in ``python/ferroattn/_native.pyi``, section
"profiler: launch records"). Every access goes through :class:`Recorder`, so tests substitute a
fake (:func:`set_recorder`) and an extension built without the recorder simply yields no kernel
records (``Recorder.available`` is False).

Nesting: the recorder is process-wide and ``profiler_drain`` hands each record out once. Every
open :class:`Subscription` (one per active ``profile`` window) receives a copy of every record
drained by any of them (:func:`collect`), with ``start_ms`` re-expressed against its own reference
event (``start_ms + own_ref.elapsed_time(drainer_ref)``), so nested or overlapping profiles each
see the launches of their own windows.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from ..errors import ArgumentError
from .events import KernelRecord, ModuleRecord


class Recorder:
    """Adapter over the four ``_native`` recorder functions. ``native``: the extension module (or
    any object with the same functions); None: import ``ferroattn._native`` lazily. A module
    without the functions (an older build) gives ``available == False``: ``enabled()`` is False,
    ``enable`` does nothing and ``drain`` returns []."""

    FUNCS = ("profiler_enable", "profiler_enabled", "profiler_stats", "profiler_drain")

    def __init__(self, native: Any = None):
        self._native = native
        self._before_profiles: Optional[bool] = None   # enabled() before its first open subscription

    def _mod(self) -> Any:
        if self._native is None:
            try:
                from .. import _native  # noqa: PLC0415
            except Exception:  # no extension at all: nothing recorded
                _native = False
            self._native = _native
        return self._native

    @property
    def available(self) -> bool:
        m = self._mod()
        return bool(m) and all(callable(getattr(m, f, None)) for f in self.FUNCS)

    def enable(self, on: bool) -> None:
        """``profiler_enable(on)``; TypeError naming ``enabled`` when ``on`` is not a bool."""
        if not isinstance(on, bool):
            raise TypeError(f"enabled: expected a bool, got {type(on).__name__} {on!r}")
        if self.available:
            self._mod().profiler_enable(on)

    def enabled(self) -> bool:
        return bool(self._mod().profiler_enabled()) if self.available else False

    def stats(self) -> dict:
        """``profiler_stats()`` ({enabled, pending, skipped_capture, dropped}); {} when unavailable."""
        return dict(self._mod().profiler_stats()) if self.available else {}

    def drain(self, reference_event: Optional[int] = None) -> list:
        """``profiler_drain(reference_event)`` (dicts of the contract); [] when unavailable."""
        if not self.available:
            return []
        return list(self._mod().profiler_drain(reference_event))


_RECORDER: Optional[Recorder] = None


def get_recorder() -> Recorder:
    """The process' :class:`Recorder` (over ``ferroattn._native`` unless :func:`set_recorder` changed it)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = Recorder()
    return _RECORDER


def set_recorder(recorder: Optional[Recorder]) -> Optional[Recorder]:
    """Replace the process' recorder (tests); None restores the default. Returns the previous one."""
    global _RECORDER
    if recorder is not None and not isinstance(recorder, Recorder):
        raise ArgumentError(f"recorder: expected a ferroattn.profiler.launches.Recorder or None, "
                            f"got {type(recorder).__name__}")
    prev, _RECORDER = _RECORDER, recorder
    return prev


def event_handle(event: Any) -> Optional[int]:
    """The raw CUevent of a ``torch.cuda.Event`` (its ``cuda_event``), None for other objects or an
    event not created yet (handle 0)."""
    h = getattr(event, "cuda_event", None)
    return int(h) if isinstance(h, int) and not isinstance(h, bool) and h != 0 else None


class Subscription:
    """One consumer of drained records (a profile window). ``ref``: its reference event (has
    ``elapsed_time``), None while it is not recording (records drained then are not kept);
    ``pending``: the raw record dicts received so far, ``start_ms`` relative to ``ref``;
    ``recorder``: the :class:`Recorder` it keeps recording (None: none)."""

    def __init__(self, recorder: Optional[Recorder] = None):
        self.ref: Any = None
        self.pending: list = []
        self.recorder = recorder


_SUBS: list = []


def subscribe(recorder: Optional[Recorder] = None) -> Subscription:
    """Open a subscription. With ``recorder``: it records while any subscription of it is open;
    the first one notes whether it was on (restored by :func:`unsubscribe` of the last one, in
    whatever order the subscriptions close) and turns it on."""
    s = Subscription(recorder)
    if recorder is not None:
        if not any(x.recorder is recorder for x in _SUBS):
            before = recorder.enabled()
            recorder.enable(True)
            recorder._before_profiles = before
        else:
            recorder.enable(True)
    _SUBS.append(s)
    return s


def unsubscribe(sub: Subscription) -> None:
    """Close ``sub``. When it was the last open subscription of its recorder, the recorder goes
    back to its state before the first one; when that was off, the records nobody drained are
    dropped. Raises what the recorder raises (the subscription is closed anyway)."""
    if sub in _SUBS:
        _SUBS.remove(sub)
    rec = sub.recorder
    sub.recorder = None
    if rec is None or any(x.recorder is rec for x in _SUBS):
        return
    before, rec._before_profiles = rec._before_profiles, None
    if not before:
        rec.enable(False)
        rec.drain(None)   # nobody will drain them: drop what the profiles left


def collect(caller: Optional[Subscription] = None, recorder: Optional[Recorder] = None) -> None:
    """Drain the recorder once (against ``caller.ref``, or another recording subscription's when
    the caller is not recording) and hand every record to every subscription that is recording,
    re-basing ``start_ms`` onto each one's reference event (None when the two references cannot
    be compared). Records nobody is recording are dropped. Raises what ``profiler_drain`` raises
    (CudaError)."""
    rec = recorder if recorder is not None else get_recorder()
    if not rec.available:
        return
    # drain against the caller's reference, else any recording subscription's (so the others
    # can re-base), else none (nobody is recording: the records are dropped)
    ref_sub = caller if caller is not None and caller.ref is not None else \
        next((s for s in _SUBS if s.ref is not None), None)
    ref = ref_sub.ref if ref_sub is not None else None
    raw = rec.drain(event_handle(ref))
    if not raw:
        return
    for sub in list(_SUBS):
        if sub.ref is None:
            continue
        if sub is ref_sub:
            sub.pending.extend(raw)
            continue
        offset = None
        if ref is not None:
            try:
                offset = float(sub.ref.elapsed_time(ref))
            except Exception:  # another device, or an event not recorded
                offset = None
        for d in raw:
            d2 = dict(d)
            s = d.get("start_ms")
            d2["start_ms"] = None if (s is None or offset is None) else float(s) + offset
            sub.pending.append(d2)


# ---- records -> KernelRecord -------------------------------------------------------------

def innermost_module(start_us: float, modules: Sequence[ModuleRecord]) -> Optional[ModuleRecord]:
    """The innermost module record (largest depth; then latest start) whose GPU interval
    ``[start_us, start_us + gpu_ms * 1000]`` holds ``start_us`` (µs), or None."""
    best = None
    for m in modules:
        if m.start_us <= start_us <= m.start_us + m.gpu_ms * 1e3:
            if best is None or (m.depth, m.start_us) >= (best.depth, best.start_us):
                best = m
    return best


def _dim3(d: dict, key: str) -> tuple:
    v = d.get(key)
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (1, 1, 1)


def _num(v: Any, default: float = 0.0) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) and f >= 0 else default


def kernel_records(raw: Iterable[dict], modules: Sequence[ModuleRecord] = (), *, with_flops: bool = True,
                   step: int = 0) -> list:
    """:class:`KernelRecord` s from ``profiler_drain`` dicts (contract keys; see the module docstring).

    name = ``kernel`` (short name); config; op; grid/block; registers; smem_bytes =
    ``dynamic_smem_bytes + static_smem_bytes``; occupancy; flops (0 when ``with_flops`` is False),
    nbytes = ``bytes``; gpu_ms; start_us = ``start_ms * 1000`` (µs from the window's reference
    event, the modules' time base; 0 when the driver gave none, clamped at 0); module =
    the name of :func:`innermost_module` of the start (None without a start); stream; device;
    step = that module call's step (else ``step``)."""
    out = []
    for d in raw:
        s = d.get("start_ms")
        start_us = None if s is None else max(0.0, float(s) * 1e3)
        dyn, sta = d.get("dynamic_smem_bytes"), d.get("static_smem_bytes")
        smem = None if dyn is None and sta is None else int(dyn or 0) + int(sta or 0)
        occ = d.get("occupancy")
        occ = None if occ is None else min(1.0, max(0.0, float(occ)))
        regs = d.get("registers")
        mod = None if start_us is None else innermost_module(start_us, modules)
        out.append(KernelRecord(
            name=str(d.get("kernel") or d.get("op") or "kernel"), config=str(d.get("config", "")),
            op=str(d.get("op", "")), grid=_dim3(d, "grid"), block=_dim3(d, "block"),
            registers=None if regs is None else int(regs), smem_bytes=smem, occupancy=occ,
            flops=_num(d.get("flops")) if with_flops else 0.0, nbytes=_num(d.get("bytes")),
            gpu_ms=_num(d.get("gpu_ms")), start_us=0.0 if start_us is None else start_us,
            module=None if mod is None else mod.name,
            stream=int(d.get("stream") or 0), device=int(d.get("device") or 0),
            step=int(step) if mod is None else mod.step))
    return out
