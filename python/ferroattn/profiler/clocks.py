"""Where the profiler's timestamps (marks) come from: the clocks an :class:`~ferroattn.profiler.hooks.Attachment`
takes a mark from at the start and end of each hooked call, and turns pairs of marks into times.

- :class:`NativeClock`: native marks (``_native.profiler_mark*``: a pooled CUDA event recorded by the
  Rust core on the raw current stream; tokens are int ids);
- :class:`EventClock`: events of an event factory (``torch.cuda.Event(enable_timing=True)``, or
  :class:`WallClockEvent` for a model on the CPU, or a test fake);
- :class:`StampClock`: experimental, a one-thread %globaltimer kernel per mark.

Which clock :func:`~ferroattn.profiler.attach` uses: native marks when ``event_factory`` is None, CUDA is available
and the extension has the ``profiler_mark*`` functions (``native=`` passes another object with
them, e.g. a test fake); else events of ``event_factory``: a zero-argument callable returning an
object with ``record()``, ``elapsed_time(other) -> ms`` and optionally ``synchronize()`` and
``query()``; the fallback is ``torch.cuda.Event(enable_timing=True)`` (recorded on the current
stream). Tests pass a fake; :class:`WallClockEvent` times a model running on the CPU (host wall
clock). ``Attachment.event_factory`` is always an event factory (the profile window's reference
event is made with it, and native marks are resolved against that event). Experimental, off the
default path: ``attach(clock="stamp")`` (:class:`StampClock`) takes each mark as a one-thread
kernel writing %globaltimer into a device slot instead of an event (scripts/profiler_overhead.py
``--stamp-experiment`` measures whether that costs the host less).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..errors import ArgumentError, NoDeviceError

__all__ = ["EventClock", "NativeClock", "StampClock", "WallClockEvent", "MARK_FUNCS", "STAMP_FUNCS",
           "native_marks_available", "native_stamps_available", "stamp_pairs_ms", "checked_event",
           "default_event_factory"]


def _completed(event: Any) -> bool:
    """``event.query()`` (True once the GPU passed it); False for events without ``query``."""
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else False


class EventClock:
    """Timestamps from events of ``factory`` (tokens are the event objects); recorded events come
    back to a pool once resolved or released."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.pool: list = []

    def mark(self) -> Any:
        e = self.pool.pop() if self.pool else self.factory()
        e.record()
        return e

    def prewarm(self, n: int) -> None:
        for _ in range(n):
            e = checked_event(self.factory)
            e.record()
            self.pool.append(e)

    def done(self, tokens: Sequence) -> list:
        return [_completed(t) for t in tokens]

    def release(self, tokens: Sequence) -> None:
        self.pool.extend(tokens)

    def resolve(self, pairs: Sequence, reference: Any = None) -> list:
        """(offset ms from ``reference`` (None: the first start), duration ms) per (start, end)
        pair, after waiting for the last end; the events go back to the pool."""
        if not pairs:
            return []
        sync = getattr(pairs[-1][1], "synchronize", None)
        if sync is not None:
            sync()
        ref = pairs[0][0] if reference is None else reference
        out = [(float(ref.elapsed_time(s)), float(s.elapsed_time(e))) for s, e in pairs]
        self.pool.extend(t for p in pairs for t in p if t is not reference)
        return out


MARK_FUNCS = ("profiler_mark", "profiler_marks_query", "profiler_marks_resolve", "profiler_marks_release")


def native_marks_available(native: Any) -> bool:
    """Whether ``native`` has the four mark functions of ``_native`` (profiler section)."""
    return native is not None and all(callable(getattr(native, f, None)) for f in MARK_FUNCS)


class NativeClock:
    """Timestamps as native marks (``native.profiler_mark(raw stream, device)``; tokens are the
    int ids, 0 = not recorded) on the current stream of ``device`` (``raw_stream(device)`` -> the
    raw CUstream; default ``torch._C._cuda_getCurrentRawStream``)."""

    def __init__(self, native: Any, device: int = 0, raw_stream: Optional[Callable[[int], int]] = None):
        if not native_marks_available(native):
            raise ArgumentError(f"native: expected an object with {', '.join(MARK_FUNCS)}, got {type(native).__name__}")
        if raw_stream is None:
            import torch  # noqa: PLC0415
            raw_stream = torch._C._cuda_getCurrentRawStream
        self.native, self.device, self.raw_stream = native, int(device), raw_stream
        mark_fn, dev = native.profiler_mark, self.device
        self.mark = lambda: mark_fn(raw_stream(dev), dev)   # the per-call path: one frame, one native call

    def prewarm(self, n: int) -> None:
        """Record and release ``n`` marks: the native pool then holds ``n`` events."""
        self.release([self.mark() for _ in range(n)])

    def done(self, tokens: Sequence) -> list:
        ids = [t for t in tokens if t]
        q = iter(self.native.profiler_marks_query(ids)) if ids else iter(())
        return [bool(next(q)) if t else True for t in tokens]

    def release(self, tokens: Sequence) -> None:
        ids = [t for t in tokens if t]
        if ids:
            self.native.profiler_marks_release(ids)

    def resolve(self, pairs: Sequence, reference: Any = None) -> list:
        """As :meth:`EventClock.resolve` (reference: an event with a ``cuda_event`` handle, e.g.
        ``torch.cuda.Event``; None or one without a handle: the first recorded mark); a pair with
        an unrecorded mark (0) or a time the driver refuses gives None."""
        from .launches import event_handle  # noqa: PLC0415
        ids = [t for p in pairs for t in p if t]
        if not ids:
            return [None] * len(pairs)
        ref = event_handle(reference) if reference is not None else None
        times = dict(zip(ids, self.native.profiler_marks_resolve(ids, ref)))
        out = []
        for s, e in pairs:
            ts, te = times.get(s) if s else None, times.get(e) if e else None
            out.append(None if ts is None or te is None else (float(ts), float(te) - float(ts)))
        return out


STAMP_FUNCS = ("profiler_stamp", "profiler_stamps_resolve", "profiler_stamps_release")


def native_stamps_available(native: Any) -> bool:
    """Whether ``native`` has the stamp functions of ``_native`` (profiler section, experimental)."""
    return native is not None and all(callable(getattr(native, f, None)) for f in STAMP_FUNCS)


class StampClock:
    """Experimental timestamps (``attach(clock="stamp")``): stamps, i.e. a one-thread kernel per
    mark writing the GPU's %globaltimer (ns) into a device slot (``native.profiler_stamp(raw
    stream, device)``; tokens are int ids, 0 = not recorded), instead of a timing event per mark.
    Same stream order and capture rule as the native marks; the native per-call path takes them
    straight from Rust (``ProfilerForward(..., stamp=True)``).

    Differences to :class:`NativeClock`: the times are on the device's %globaltimer, which no
    CUDA event shares, so a ``reference`` event cannot be placed on it: offsets are from the first
    start of the pairs resolved together (a profile window's kernel records, timed from its
    reference event, are then not aligned with the module records: the cost is what this clock is
    for, scripts/profiler_overhead.py); resolving waits for the whole device
    (``profiler_stamps_resolve``: cuCtxSynchronize + one copy), and :meth:`done` says True without
    looking (a harvest then waits for the forward it resolves)."""

    def __init__(self, native: Any, device: int = 0, raw_stream: Optional[Callable[[int], int]] = None):
        if not native_stamps_available(native):
            raise ArgumentError(f"native: expected an object with {', '.join(STAMP_FUNCS)}, "
                                f"got {type(native).__name__}")
        if raw_stream is None:
            import torch  # noqa: PLC0415
            raw_stream = torch._C._cuda_getCurrentRawStream
        self.native, self.device, self.raw_stream = native, int(device), raw_stream
        stamp_fn, dev = native.profiler_stamp, self.device
        self.mark = lambda: stamp_fn(raw_stream(dev), dev)

    def prewarm(self, n: int) -> None:
        """One stamp, resolved (waits): compiles or loads the kernel and allocates the slots, so
        the first forward does not pay it (slots need no pool)."""
        if n > 0:
            ids = [t for t in (self.mark(),) if t]
            if ids:
                self.native.profiler_stamps_resolve(ids)

    def done(self, tokens: Sequence) -> list:
        return [True] * len(tokens)

    def release(self, tokens: Sequence) -> None:
        ids = [t for t in tokens if t]
        if ids:
            self.native.profiler_stamps_release(ids)

    def resolve(self, pairs: Sequence, reference: Any = None) -> list:
        """(offset ms from the first recorded start of ``pairs``, duration ms) per (start, end)
        pair (``reference`` is ignored: see the class docstring); a pair with an unrecorded stamp
        (0) gives None."""
        return stamp_pairs_ms(pairs, self.native.profiler_stamps_resolve)


def stamp_pairs_ms(pairs: Sequence, read: Callable[[list], list]) -> list:
    """(offset ms, duration ms) per (start id, end id) pair from the stamps' nanoseconds
    (``read(ids) -> ns`` per id, called once with every recorded id); offsets from the earliest
    recorded start; None for a pair with an id 0. Durations may be negative only if the clock
    ran backwards (callers clamp)."""
    ids = [t for p in pairs for t in p if t]
    if not ids:
        return [None] * len(pairs)
    ns = dict(zip(ids, read(ids)))
    starts = [ns[s] for s, e in pairs if s and e]
    if not starts:
        return [None] * len(pairs)
    ref = min(starts)
    return [None if not (s and e) else ((ns[s] - ref) / 1e6, (ns[e] - ns[s]) / 1e6) for s, e in pairs]


class WallClockEvent:
    """A host wall-clock stand-in for ``torch.cuda.Event`` (``record()`` reads
    ``time.perf_counter``; ``elapsed_time(other)`` = other - self in ms): times modules run on
    the CPU, where there is no device timeline."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = None

    def record(self, stream: Any = None) -> None:
        import time  # noqa: PLC0415
        self.t = time.perf_counter()

    def elapsed_time(self, other: "WallClockEvent") -> float:
        if self.t is None or other.t is None:
            raise ArgumentError("elapsed_time: both events must be recorded first")
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None:
        return None


def checked_event(factory: Callable[[], Any]) -> Any:
    """``factory()``, after checking it is an event (callable ``record`` and ``elapsed_time``);
    ArgumentError naming ``event_factory`` otherwise."""
    e = factory()
    if not (callable(getattr(e, "record", None)) and callable(getattr(e, "elapsed_time", None))):
        raise ArgumentError(f"event_factory: expected a callable returning an event (with record() and "
                            f"elapsed_time()), it returned {type(e).__name__} {e!r}")
    return e


def default_event_factory() -> Callable[[], Any]:
    """``torch.cuda.Event(enable_timing=True)`` factory; NoDeviceError without a CUDA GPU."""
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():
        raise NoDeviceError("event_factory: the default CUDA events need a CUDA GPU "
                            "(torch.cuda.is_available() is False); pass event_factory= to time otherwise")
    return lambda: torch.cuda.Event(enable_timing=True)
