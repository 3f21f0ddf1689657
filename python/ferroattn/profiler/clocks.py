"""Where the profiler's timestamps (marks) come from: the clocks an :class:`~ferroattn.profiler.hooks.Attachment`
takes a mark from at the start and end of each hooked call, and turns pairs of marks into times.

- :class:`NativeClock`: native marks (``_native.profiler_mark*``: a pooled CUDA event recorded by the
  Rust core on the raw current stream; tokens are int ids);
- :class:`EventClock`: events of an event factory (``torch.cuda.Event(enable_timing=True)``, or
  :class:`WallClockEvent` for a model on the CPU, or a test fake).

Which clock :func:`~ferroattn.profiler.attach` uses: native marks when ``event_factory`` is None, CUDA is available
and the extension has the ``profiler_mark*`` functions (``native=`` passes another object with
them, e.g. a test fake); else events of ``event_factory``: a zero-argument callable returning an
object with ``record()``, ``elapsed_time(other) -> ms`` and optionally ``synchronize()`` and
``query()``; the fallback is ``torch.cuda.Event(enable_timing=True)`` (recorded on the current
stream). Tests pass a fake; :class:`WallClockEvent` times a model running on the CPU (host wall
clock). ``Attachment.event_factory`` is always an event factory (the profile window's reference
event is made with it, and native marks are resolved against that event).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..errors import ArgumentError, NoDeviceError

__all__ = ["EventClock", "NativeClock", "WallClockEvent", "MARK_FUNCS", "native_marks_available", "checked_event",
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
        if not isinstance(other, WallClockEvent):
            raise ArgumentError(f"other: expected a WallClockEvent, got {type(other).__name__}")
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
