"""Module attribution: time decoder layers, their attention and MLP children and the model's
top-level components with GPU timestamps (marks), without any host synchronisation inside the
forward.

Which modules are hooked: :func:`ferroattn.profiler.targets.find_targets` (the root, the
top-level components, the decoder layers and their attention and MLP children).

How a call is bracketed (``mode``):

- ``"wrap"`` (default): the module's ``forward`` is replaced, as an instance attribute, by a
  wrapper (``functools.wraps`` of the original, so signature inspection still works) that marks
  the start, calls the original and marks the end in a ``try/finally`` (so the end is also
  marked when the forward raises). In substance a forward pre + post hook, but
  ``Module.__call__`` stays on torch's fast path (no hook dispatch). An instance-level
  ``forward`` that was already there (e.g. accelerate's hooks, or another attachment's wrapper)
  is chained: the wrapper calls it. :meth:`Attachment.remove` puts back exactly what was there
  (also after an exception); when somebody replaced our wrapper meanwhile, theirs is left in
  place and ours turns into a pass-through, dropped at the next restore that reaches it.
  Difference to hooks: torch forward hooks registered by others on a hooked module run outside
  its interval (they run around ``forward``).
- ``"torch"``: ``register_forward_pre_hook`` + ``register_forward_hook(always_call=True)``.

Why (measured on an H200 with the Llama-3.2-1B config; bench/NOTES.md "Profiler cost"): torch's
hook dispatch with no-op pre/post hooks costs ~28 µs per module call on a host-bound forward
(+10 % at 1 x 256, 2026-11-29); a ``torch.cuda.Event.record()`` 7-15 µs, 4-8 µs of it
``torch.cuda.current_stream()``. The default path therefore avoids torch's hooks (wrap) and
records its timestamps as native marks: ``_native.profiler_mark(stream, device)`` records a pooled
CUDA event (the launch recorder's pool) on the raw current stream
(``torch._C._cuda_getCurrentRawStream``, fetched per mark: a module may switch streams), no
Python event object and no stream object. With the extension's own marks the per-call path runs
as one native call (``_native.ProfilerForward``, the wrapper object itself: it mirrors the Python
wrapper below step for step and records the marks from Rust, with the legacy stream's capture
check once per root call; ``attach(native_wrap=False)`` keeps the Python wrapper). Measured at
1 x 256 (53 hooked calls, 106 marks per forward, 10.9 ms forward; 2026-11-30 05:44,
``profiler_overhead_*_20261130T0544.json``): profile() +8.4 % with the native path vs +9.1 % with the
Python one; the marks alone (native path, no shapes / ranges) +6.8 %, i.e. ~5 µs per cuEventRecord
in situ (1.4-1.6 µs in a tight loop, +3.3 µs right after a kernel launch); with the launch
recorder's 32 events per forward (+1.3 %) the event records are most of profile()'s cost; the
Python wrapper without marks +2.1 % (4.2 µs per call in situ). GPU-bound
forwards (4 x 1024, 4 x 2048) pay ~1-1.5 %.

Per call: a start mark, then a ``torch.autograd.profiler.record_function`` range while a torch
profiler is collecting (it shows in that torch.profiler trace; with none running the range would
be invisible, so it is skipped and costs nothing) and, when CUDA is available and an NVTX tool is
attached (e.g. Nsight Systems: :func:`nvtx_tool_attached`), an NVTX range; without a
tool NVTX calls are no-ops inside NVTX, so they are skipped too; at the end the end mark and both
ranges closed. Marks are kept per call; times
are read only by :meth:`Attachment.resolve` after the forward (one wait, then the marks go back
to the pool: no event creation per call once warm). A mark on a stream that is capturing a CUDA
graph is not recorded (the call gets no record).

A module called several times per forward gives one record per call; nesting depth is the number
of hooked calls open when the call starts (root 0, top-level components and layers 1,
attention/MLP 2 for a plain model).

Timestamps: :mod:`ferroattn.profiler.clocks` (native marks when ``event_factory`` is None, CUDA is
available and the extension has the ``profiler_mark*`` functions; else events of ``event_factory``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from ..errors import ArgumentError
from .clocks import (EventClock, NativeClock, WallClockEvent, checked_event, default_event_factory,
                     native_marks_available)
from .events import ModuleRecord
from .targets import ATTENTION_NAMES, LAYER_LISTS, MLP_NAMES, find_targets

# attach, Attachment and the per-call path live here; the clocks and the target rule are
# re-exported under their earlier import path (ferroattn.profiler.hooks.NativeClock, ...)
__all__ = ["attach", "Attachment", "MODES", "nvtx_tool_attached", "NVTX_INJECTION_VAR", "find_targets",
           "LAYER_LISTS", "ATTENTION_NAMES", "MLP_NAMES", "EventClock", "NativeClock", "WallClockEvent",
           "checked_event", "default_event_factory", "native_marks_available"]

# A hooked call is ONE list, also the entry of the open-call stack (the per-call path allocates as
# few garbage-collected containers as it can: on a host-bound forward, every container per call
# brings Python's full collections closer, and those cost more than the bookkeeping itself):
# [name, kind, depth, step, start mark, end mark (None while open), input shapes (None, the
# torch.Size of a single tensor argument, or a list of torch.Size/None per positional argument),
# module, record_function context or None].
_NAME, _KIND, _DEPTH, _STEP, _START, _END, _SHAPES, _MODULE, _RF = range(9)


def _profiler_probe() -> Callable[[], bool]:
    """A callable telling whether a torch (autograd/kineto) profiler is collecting:
    record_function ranges are only opened then (they are only visible to it, and cost a
    dispatcher call each otherwise)."""
    import torch  # noqa: PLC0415
    running = getattr(torch.autograd, "_profiler_enabled", None)
    return running if running is not None else (lambda: True)


def _plain_shapes(shapes) -> Optional[tuple]:
    """The recorded shapes as plain tuples, one per positional argument (None stays None; a bare
    torch.Size is the shape of a single tensor argument)."""
    if shapes is None:
        return None
    if type(shapes) is not list:   # torch.Size of the only argument
        return (tuple(shapes),)
    return tuple(None if x is None else tuple(x) for x in shapes)


# ---- the attachment --------------------------------------------------------------------------

MODES = ("wrap", "torch")


class Attachment:
    """The hooks on one model (returned by :func:`attach`). ``enabled``: when False the hooks do
    nothing (a schedule's wait steps); ``step``: the step number given to new calls; ``mode``:
    "wrap" or "torch" (module docstring); ``clock``: the :class:`NativeClock` or
    :class:`EventClock` the marks come from; ``event_factory``: an event factory (for reference
    events). Use as a context manager, or call :meth:`remove` (idempotent) to take every hook off.
    Recorded calls stay resolvable after :meth:`remove`; :meth:`resolve` or :meth:`discard` gives
    their marks back to the pool (native marks not resolved or released stay allocated)."""

    def __init__(self, targets: list, event_factory: Callable[[], Any], clock: Any = None, *,
                 record_function: bool = True, nvtx: bool = False, record_shapes: bool = True, device: int = 0,
                 mode: str = "wrap"):
        self.targets = targets
        self.event_factory = event_factory
        self.clock = clock if clock is not None else EventClock(event_factory)
        self.record_function = bool(record_function)
        self.nvtx = bool(nvtx)
        self.record_shapes = bool(record_shapes)
        self.device = device
        self.mode = mode
        self.step = 0
        self.calls: list = []
        self._open: list = []        # the open calls (call lists, innermost last)
        self._handles: list = []     # objects with remove(): torch hook handles or forward restorers
        self._enabled = True
        self._live = False           # enabled and attached: what the per-call path checks
        self._mark = self.clock.mark
        self._native_forward = None   # _native.ProfilerForward when the per-call path runs natively
        self._native_module = None    # the extension module it comes from
        self._rf_probe = _profiler_probe() if self.record_function else None
        import torch  # noqa: PLC0415
        self._tensor = torch.Tensor
        if self.nvtx:
            import torch  # noqa: PLC0415
            self._push, self._pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
        else:
            self._push = self._pop = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on)
        self._live = self._enabled and bool(self._handles)

    # -- per call ------------------------------------------------------------------------
    def _enter(self, name, kind, module, args):
        """Open a call: start mark, ranges; returns the entry :meth:`_exit` closes."""
        stack = self._open
        shapes = None
        if self.record_shapes and args:
            if len(args) == 1:
                a = args[0]
                shapes = a.shape if isinstance(a, self._tensor) else [None]
            else:
                shapes = [a.shape if isinstance(a, self._tensor) else None for a in args]
        call = [name, kind, len(stack), self.step, self._mark(), None, shapes, module, None]
        self.calls.append(call)
        if self._rf_probe is not None and self._rf_probe():
            rf = call[_RF] = _record_function()(name)
            rf.__enter__()
        if self._push is not None:
            self._push(name)
        stack.append(call)
        return call

    def _exit(self, entry) -> None:
        """Close ``entry`` and anything opened above it that was not closed (normally it is the
        top of the stack); nothing when it was closed already (e.g. by :meth:`remove`)."""
        stack = self._open
        if stack and stack[-1] is entry:
            stack.pop()
            self._close(entry)
            return
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is entry:
                while len(stack) > i:
                    self._close(stack.pop())
                return

    def _pre(self, name, module, args):       # torch mode: forward pre hook
        if self._live:
            self._enter(name, type(module).__name__, module, args)
        return None

    def _post(self, module, args, output):    # torch mode: forward hook (always_call)
        # the innermost open call of this module (normally the top of the stack)
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][_MODULE] is module:
                self._exit(self._open[i])
                break
        return None

    def _close(self, call) -> None:
        if call[_END] is None:
            call[_END] = self._mark()
        if self._pop is not None:
            self._pop()
        rf = call[_RF]
        if rf is not None:
            call[_RF] = None
            rf.__exit__(None, None, None)

    # -- lifecycle -----------------------------------------------------------------------
    def remove(self) -> None:
        """Close ranges left open (a forward interrupted), then remove every hook / restore every
        wrapped ``forward``. Idempotent. Recorded calls stay resolvable."""
        self._live = False
        while self._open:
            self._close(self._open.pop())
        handles, self._handles = self._handles, []
        for h in reversed(handles):
            h.remove()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def take(self) -> list:
        """The finished calls so far (removed from the attachment); open calls stay."""
        done = [c for c in self.calls if c[_END] is not None]
        self.calls[:] = [c for c in self.calls if c[_END] is None]   # in place: the wrappers hold this list
        return done

    def discard(self) -> int:
        """Drop the finished calls without timing them (their marks go back to the pool).
        Returns how many were dropped."""
        done = self.take()
        self.clock.release([t for c in done for t in (c[_START], c[_END])])
        return len(done)

    def prewarm(self, n: Optional[int] = None) -> None:
        """Create and record ``n`` timestamps (default: two per hooked module, one forward's
        worth) into the pool now, outside any forward, so the first forward does not pay event
        creation."""
        self.clock.prewarm(2 * len(self.targets) if n is None else int(n))

    def harvest(self, reference: Any) -> list:
        """Resolve, without waiting, the finished calls whose end has already completed on the GPU
        (``event.query()`` / the marks' query; events without ``query`` never count as completed)
        against ``reference`` (as :meth:`resolve`), and return their marks to the pool. Called
        between steps of a long window, so a window of many forwards reuses events instead of
        creating two per module call. Returns the :class:`ModuleRecord` s (call order among
        themselves)."""
        if reference is None:
            return []
        finished = [c for c in self.calls if c[_END] is not None]
        if not finished:
            return []
        flags = self.clock.done([c[_END] for c in finished])
        done = [c for c, ok in zip(finished, flags) if ok]
        if not done:
            return []
        ids = {id(c) for c in done}
        self.calls[:] = [c for c in self.calls if id(c) not in ids]   # in place (see take)
        return self.resolve(done, reference=reference)

    def resolve(self, calls: Optional[list] = None, reference: Any = None) -> list:
        """Times of ``calls`` (default: :meth:`take`) as :class:`ModuleRecord` s, in call order.
        Waits once for the GPU to pass the calls. ``start_us`` is relative to ``reference`` (an
        event of ``event_factory`` recorded before the calls, e.g. a profile window's start; µs),
        else to the first call's start; ``gpu_ms`` = end - start (ms). A call whose marks were
        not recorded (CUDA-graph capture) gives no record."""
        calls = self.take() if calls is None else [c for c in calls if c[_END] is not None]
        if not calls:
            return []
        times = self.clock.resolve([(c[_START], c[_END]) for c in calls], reference)
        out = []
        for c, t in zip(calls, times):
            if t is None:
                continue
            off, ms = t
            out.append(ModuleRecord(c[_NAME], c[_KIND], max(ms, 0.0), max(off * 1e3, 0.0), c[_DEPTH], c[_STEP],
                                    self.device, input_shapes=_plain_shapes(c[_SHAPES])))
        return out

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# ---- wrap mode: instance-level forward wrappers -----------------------------------------------

class _Restore:
    """Undoes one forward wrap (see the module docstring, "wrap")."""

    __slots__ = ("module", "wrapper")

    def __init__(self, module, wrapper):
        self.module, self.wrapper = module, wrapper

    def remove(self) -> None:
        w, self.wrapper = self.wrapper, None
        if w is None:
            return
        w._ferroattn_dead = True
        w._ferroattn_kill[0] = True
        d = self.module.__dict__
        if d.get("forward") is not w:
            return   # somebody wrapped over ours: leave theirs; ours is a pass-through now
        inner, had = w._ferroattn_inner, w._ferroattn_had
        while getattr(inner, "_ferroattn_dead", False):   # skip dead wrappers of earlier attachments
            inner, had = inner._ferroattn_inner, inner._ferroattn_had
        if had:
            d["forward"] = inner
        else:
            d.pop("forward", None)


def _open_record_function(name: str) -> Any:
    """A ``record_function(name)`` range, entered (the native wrapper's range opener)."""
    rf = _record_function()(name)
    rf.__enter__()
    return rf


def _wrap_forward(att: Attachment, name: str, module: Any) -> _Restore:
    d = module.__dict__
    had = "forward" in d
    inner = d["forward"] if had else module.forward
    kind = type(module).__name__
    dead = [False]   # set by _Restore.remove (also mirrored on the function for chain walking)
    if att._native_forward is not None:
        # the same per-call path in one native call (_native.ProfilerForward mirrors the Python
        # wrapper below step for step); native marks straight from Rust when the clock is the
        # extension's own, else att._mark (a Python clock)
        clock = att.clock
        direct = isinstance(clock, NativeClock) and clock.native is att._native_module
        forward = att._native_forward(
            inner=inner, att=att, name=name, kind=kind, module=module, stack=att._open, calls=att.calls, kill=dead,
            close=att._exit, raw_stream=clock.raw_stream if direct else None, device=att.device if direct else 0,
            mark=None if direct else att._mark, probe=att._rf_probe, open_rf=_open_record_function, push=att._push,
            pop=att._pop, tensor=att._tensor, shapes=att.record_shapes)
        functools.update_wrapper(forward, inner)
        forward._ferroattn_inner, forward._ferroattn_had, forward._ferroattn_dead = inner, had, False
        forward._ferroattn_kill = dead
        d["forward"] = forward
        return _Restore(module, forward)
    # The per-call path, inlined (one Python frame besides the marks; what Attachment._enter /
    # _exit / _close do, in that order). Bound once here: the open-call stack and the call log
    # (lists the attachment only ever mutates in place), the range functions, the shapes switch.
    stack, calls = att._open, att.calls
    push, pop, probe, tensor, shapes_on = att._push, att._pop, att._rf_probe, att._tensor, att.record_shapes
    close = att._exit

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not att._live or dead[0]:
            return inner(*args, **kwargs)
        mark = att._mark
        shapes = None
        if shapes_on and args:
            if len(args) == 1:
                a = args[0]
                shapes = a.shape if isinstance(a, tensor) else [None]
            else:
                shapes = [a.shape if isinstance(a, tensor) else None for a in args]
        call = [name, kind, len(stack), att.step, mark(), None, shapes, module, None]
        calls.append(call)
        if probe is not None and probe():
            rf = call[_RF] = _record_function()(name)
            rf.__enter__()
        if push is not None:
            push(name)
        stack.append(call)
        try:
            return inner(*args, **kwargs)
        finally:
            if stack and stack[-1] is call:   # the usual case: close it here
                stack.pop()
                if call[_END] is None:
                    call[_END] = mark()
                if pop is not None:
                    pop()
                rf = call[_RF]
                if rf is not None:
                    call[_RF] = None
                    rf.__exit__(None, None, None)
            else:                             # closed already, or calls above it left open
                close(call)

    forward._ferroattn_inner, forward._ferroattn_had, forward._ferroattn_dead = inner, had, False
    forward._ferroattn_kill = dead
    d["forward"] = forward
    return _Restore(module, forward)


def _native_forward_class() -> Optional[tuple]:
    """(``ferroattn._native``, its ``ProfilerForward``), or None when the extension or the class is
    missing."""
    try:
        from .. import _native as ext  # noqa: PLC0415
    except Exception:
        return None
    cls = getattr(ext, "ProfilerForward", None)
    return None if cls is None else (ext, cls)


def _record_function():
    from torch.autograd.profiler import record_function  # noqa: PLC0415
    return record_function


NVTX_INJECTION_VAR = "NVTX_INJECTION64_PATH"


def nvtx_tool_attached() -> bool:
    """Whether an NVTX tool is attached to this process: the environment variable
    ``NVTX_INJECTION64_PATH`` (the injection library NVTX loads at its first call: how NVTX tools
    attach; Nsight Systems sets it for the processes it launches) is set and non-empty. Without one, every NVTX call is a no-op inside NVTX (NVTX v3 loader: the
    variable first, then a statically linked ``InitializeInjectionNvtx2_fnptr``, which a Python
    process does not have), so ranges pushed then are visible to nobody and only cost the calls
    (two per hooked module call). Read when :func:`attach` runs (NVTX itself reads it once, at
    its first call in the process)."""
    import os  # noqa: PLC0415
    return bool(os.environ.get(NVTX_INJECTION_VAR))


def attach(model: Any, *, event_factory: Optional[Callable[[], Any]] = None, record_function: bool = True,
           nvtx: Optional[bool] = None, record_shapes: bool = True, include_root: bool = True,
           layer_lists: Sequence[str] = LAYER_LISTS, attention_names: Sequence[str] = ATTENTION_NAMES,
           mlp_names: Sequence[str] = MLP_NAMES, top_level: bool = True, mode: str = "wrap",
           native: Any = None, native_wrap: Optional[bool] = None) -> Attachment:
    """Hook ``model`` (rule: module docstring) and return the :class:`Attachment`.

    event_factory: see the module docstring (None: native marks when available, else CUDA
    events; NoDeviceError without a GPU); record_function: open
    ``torch.autograd.profiler.record_function`` ranges (while a torch profiler collects); nvtx:
    push NVTX ranges (None: when CUDA is available and an NVTX tool is attached,
    :func:`nvtx_tool_attached`; True: always, e.g. for a tool that injects itself after
    ``attach``); record_shapes: keep the tensor argument
    shapes; include_root, layer_lists, attention_names, mlp_names, top_level:
    :func:`find_targets`; mode: "wrap" (forward wrappers, default) or "torch" (torch forward
    hooks); native: an object with the ``_native`` mark functions to take timestamps from
    (None: ``ferroattn._native`` when ``event_factory`` is None and CUDA is available);
    native_wrap (wrap mode): run the per-call path as one native call
    (``_native.ProfilerForward``; None: when the timestamps are the extension's own native marks;
    True: also with another clock, whose ``mark`` it then calls; False: the Python wrapper).
    Raises ArgumentError when ``model`` is not a module, no module matches the rule, ``mode`` is
    not one of "wrap"/"torch", ``native`` lacks the mark functions or ``event_factory`` does not return an event (one is
    made and recorded here to check)."""
    import torch  # noqa: PLC0415
    if mode not in MODES:
        raise ArgumentError(f"mode: expected one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    targets = find_targets(model, include_root, layer_lists, attention_names, mlp_names, top_level)
    if not targets:
        raise ArgumentError(f"model: no module to profile in {type(model).__name__} (include_root=False and no "
                            f"ModuleList named one of {tuple(layer_lists)})")
    cuda = torch.cuda.is_available()
    if native is None and event_factory is None and cuda:
        try:
            from .. import _native as ext  # noqa: PLC0415
        except Exception:   # no extension: CUDA events
            ext = None
        if native_marks_available(ext) and hasattr(torch._C, "_cuda_getCurrentRawStream"):
            native = ext
    factory = default_event_factory() if event_factory is None else event_factory
    if not callable(factory):
        raise ArgumentError(f"event_factory: expected a callable returning an event, got {factory!r}")
    device = torch.cuda.current_device() if cuda else 0
    raw = None if cuda else (lambda _d: 0)
    clock = NativeClock(native, device, raw) if native is not None else EventClock(factory)
    att = Attachment(targets, factory, clock, record_function=record_function,
                     nvtx=(cuda and nvtx_tool_attached()) if nvtx is None else bool(nvtx),
                     record_shapes=record_shapes, device=device, mode=mode)
    ext_fwd = _native_forward_class()
    if mode == "wrap" and ext_fwd is not None and native_wrap is not False:
        if native_wrap or (isinstance(clock, NativeClock) and clock.native is ext_fwd[0]):
            att._native_module, att._native_forward = ext_fwd
    elif native_wrap and mode == "wrap":
        raise ArgumentError("native_wrap: True needs ferroattn._native.ProfilerForward (the extension lacks it)")
    if native is not None:
        checked_event(factory).record()   # checks the factory's events (ArgumentError)
        att.prewarm()
    else:   # the prewarmed events check the factory
        att.prewarm(None if event_factory is None else 1)
    try:
        for name, mod in targets:
            if mode == "wrap":
                att._handles.append(_wrap_forward(att, name, mod))
            else:
                att._handles.append(mod.register_forward_pre_hook(
                    lambda m, args, _n=name: att._pre(_n, m, args)))
                att._handles.append(mod.register_forward_hook(att._post, always_call=True))
    except BaseException:
        att.remove()
        raise
    att.enabled = True
    return att
