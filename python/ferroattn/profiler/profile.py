"""``ferroattn.profiler.profile``: the context manager, shaped like ``torch.profiler.profile``.

::

    with ferroattn.profiler.profile(model, schedule=torch.profiler.schedule(wait=1, warmup=1, active=2),
                                    on_trace_ready=lambda p: p.export_chrome_trace("t.json")) as prof:
        for batch in data:
            model(batch)
            prof.step()
    print(prof.key_averages(group_by="module").table(sort_by="gpu_time_total", row_limit=10))

Schedule (torch.profiler's cycle): ``schedule(step) -> torch.profiler.ProfilerAction`` is asked at
``__enter__`` (step 0) and after every ``step()``. Module calls are recorded during WARMUP, RECORD
and RECORD_AND_SAVE steps; those of WARMUP are discarded (the hooks' own first-use cost stays out
of the window, as torch's warmup). When the action leaves RECORD_AND_SAVE (at ``step()``) or when
the block exits normally during RECORD / RECORD_AND_SAVE (an exception: nothing saved), the window's calls are resolved (one host
synchronisation, outside any forward) into ``prof.records`` and ``on_trace_ready(prof)`` is called
(at ``step()`` after the next step's bookkeeping, so an exception it raises propagates from
``step()`` but loses nothing: the next window records as usual).
``schedule=None``: every step records and the whole block is one window, resolved at exit.
``key_averages``/``export_chrome_trace`` use the latest resolved window (as torch.profiler).
In a long window, finished calls are resolved at a ``step()`` only once ``harvest_forwards``
forwards' worth of calls are unresolved (class attribute; see there).

Kernel records: while the block runs, the Rust launch recorder (``_native.profiler_enable``, via
:mod:`.launches`) is on; it stays on while any profile is open, and when the last one exits (in
whatever order they exit) it is set back to what it was before the first (left on when it was on).
At each window start a reference event is recorded; at save the launches are drained against it
(``profiler_drain(reference_event)``) into ``prof.records.kernels`` (:class:`KernelRecord`, see
:func:`.launches.kernel_records`): module and kernel ``start_us`` share that reference (µs from
the window start), and a kernel's ``module`` is the innermost module record whose GPU interval
holds its start. Launches of WARMUP steps and of NONE steps are drained and discarded.
``with_flops=False``: kernel ``flops`` are 0 (the FLOP columns then read 0 / "--").
``record_shapes`` keeps module input shapes (``ModuleRecord.input_shapes``, trace args).
``prof.records.total_gpu_ms``: the summed GPU time of the outermost module records (the model's
forward(s)), or without a model the GPU time from the window's reference event to its end.
``prof.records.ceilings``: ``ceilings=`` when given, else the cached :func:`.ceilings.measure_ceilings`
result for the device when the cache has one (never measured implicitly; set
``prof.records.ceilings = measure_ceilings()`` to measure), else None.

Other libraries' kernels: ``prof.import_torch_profiler(tp)`` with a finished
``torch.profiler.profile`` that ran at the same time adds them (:mod:`.torch_import`).

torch.profiler: this class never starts or stops torch's profiler; run ``torch.profiler.profile``
around or inside it and the module ``record_function`` ranges appear in torch's trace.

Module timestamps: :func:`.hooks.attach` with its defaults (forward wrappers, native marks on a
GPU; ``mode="torch"`` / ``native=`` / ``event_factory=`` pass through ``hook_options`` and the
keyword arguments). The window's reference event is a ``torch.cuda.Event`` (or one of
``event_factory``); marks and launch records are resolved against its handle. Marks of calls that
are not saved (warmup steps, an exception, a window left open) are released at once.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

from ..errors import ArgumentError, FerroattnError
from . import launches
from .ceilings import Ceilings
from ._util import flag
from .events import Records

_RECORDING = ("RECORD", "RECORD_AND_SAVE")


def _action_name(action: Any) -> str:
    """``torch.profiler.ProfilerAction`` member -> its name (NONE, WARMUP, RECORD, RECORD_AND_SAVE)."""
    name = getattr(action, "name", None)
    if name not in ("NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE"):
        raise ArgumentError(f"schedule: expected a callable step -> torch.profiler.ProfilerAction, it returned "
                            f"{action!r}")
    return name


class profile:
    """Profile ``model``'s forward: root, top-level components, decoder layers, attention and MLP
    modules (see :mod:`.hooks`), and the launches of our kernels (:mod:`.launches`).

    model: a ``torch.nn.Module`` or None (no module records); record_shapes, with_flops: see the
    module docstring; schedule: None or ``torch.profiler.schedule(...)``-like callable;
    on_trace_ready: None or a callable taking this object; event_factory: None (CUDA events) or
    a zero-argument event factory (:mod:`.hooks`); ceilings: a :class:`Ceilings` for the
    utilisation columns, or None (the cached ones for the device, if any); recorder: the
    :class:`.launches.Recorder` to use (None: the process' one; tests pass a fake);
    hook_options: extra keyword arguments of :func:`.hooks.attach` (e.g. ``include_root``,
    ``layer_lists``, ``top_level``). Raises ArgumentError naming a bad argument, NoDeviceError at
    ``__enter__`` when CUDA events are needed and there is no GPU.
    """

    #: A long window (schedule None, or RECORD steps) resolves the calls the GPU has finished at a
    #: ``step()`` once it holds ``harvest_forwards`` forwards' worth of unresolved calls (x the hooked
    #: modules; 0 or 1: at every step), and their events go back to the pool. Settable per instance.
    #: Default 1 (every step): harvesting every 4th step instead measured -0.35 points at 1 x 256
    #: (profile +8.08 % [7.27, 8.50] vs +8.43 % [7.69, 8.95], 269 paired rounds, 2026-11-30 05:44), inside
    #: the noise, and the calls it keeps alive longer brought 17 gen-0 collections into 538 timed
    #: forwards (0 with every step).
    harvest_forwards = 1

    def __init__(self, model: Any = None, record_shapes: bool = True, with_flops: bool = True,
                 schedule: Optional[Callable[[int], Any]] = None,
                 on_trace_ready: Optional[Callable[["profile"], Any]] = None, *,
                 event_factory: Optional[Callable[[], Any]] = None, ceilings: Optional[Ceilings] = None,
                 recorder: Optional[launches.Recorder] = None, **hook_options: Any):
        if schedule is not None and not callable(schedule):
            raise ArgumentError(f"schedule: expected None or a callable step -> ProfilerAction, got {schedule!r}")
        if on_trace_ready is not None and not callable(on_trace_ready):
            raise ArgumentError(f"on_trace_ready: expected None or a callable, got {on_trace_ready!r}")
        if ceilings is not None and not isinstance(ceilings, Ceilings):
            raise ArgumentError(f"ceilings: expected a ferroattn.profiler.Ceilings or None, got {type(ceilings).__name__}")
        if recorder is not None and not isinstance(recorder, launches.Recorder):
            raise ArgumentError(f"recorder: expected a ferroattn.profiler.launches.Recorder or None, "
                                f"got {type(recorder).__name__}")
        if event_factory is not None and not callable(event_factory):
            raise ArgumentError(f"event_factory: expected None or a callable returning an event, got {event_factory!r}")
        from .hooks import attach  # noqa: PLC0415
        known = set(inspect.signature(attach).parameters) - {"model", "event_factory", "record_shapes"}
        unknown = sorted(set(hook_options) - known)
        if unknown:
            raise ArgumentError(f"{unknown[0]}: unexpected keyword argument of profile (the hook options are "
                                f"{', '.join(sorted(known))})")
        self.model = model
        self.record_shapes = flag("record_shapes", record_shapes)
        self.with_flops = flag("with_flops", with_flops)
        self.schedule = schedule
        self.on_trace_ready = on_trace_ready
        self.event_factory = event_factory
        self.ceilings = ceilings
        self.recorder = recorder
        self.hook_options = hook_options
        self.step_num = 0
        self.current_action = "RECORD"
        self.records = Records()
        self.windows = 0          # resolved windows so far
        self.module_names: tuple = ()   # names of the hooked modules (record_function range names)
        self._att = None
        self._harvested: list = []   # module records resolved at earlier steps of the current window
        self._active = False
        self._factory = None
        self._sub = None
        self._rec = None

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "profile":
        if self._active:
            raise FerroattnError("profile: already entered (a profile object is used by one with-block at a time)")
        if self.model is not None:
            from .hooks import attach  # noqa: PLC0415
            self._att = attach(self.model, event_factory=self.event_factory, record_shapes=self.record_shapes,
                               **self.hook_options)
            self._factory = self._att.event_factory
            self.module_names = tuple(n for n, _ in self._att.targets)
        else:
            self._factory = self.event_factory if self.event_factory is not None else _cuda_factory_or_none()
        self._rec = self.recorder if self.recorder is not None else launches.get_recorder()
        try:
            self._sub = launches.subscribe(self._rec)   # recording on while any profile is open
        except BaseException:
            self._detach()
            raise
        self._active = True
        self.step_num = 0
        try:
            self.current_action = self._ask(0)
            self._apply()
        except BaseException:
            self._finish(clean=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.current_action in _RECORDING and exc_type is None:
                self._save()
                self._ready()
        finally:
            self._finish(clean=exc_type is None)

    def step(self) -> None:
        """End the current step: ask the schedule for the next action; save a finished window,
        discard a warmup step's records."""
        if not self._active:
            raise FerroattnError("profile.step(): called outside the with-block")
        prev = self.current_action
        self.step_num += 1
        self.current_action = self._ask(self.step_num)
        saved = prev == "RECORD_AND_SAVE" or (prev == "RECORD" and self.current_action not in _RECORDING)
        if saved:
            self._save()
        elif prev == "WARMUP":
            self._discard()
        elif prev == "RECORD" and self._att is not None and \
                len(self._att.calls) >= max(1, self.harvest_forwards * len(self._att.targets)):
            # the window goes on and holds harvest_forwards forwards' worth of calls: resolve the
            # calls the GPU has finished (no wait), reuse their events
            ref = self._sub.ref
            self._harvested.extend(self._att.harvest(None if isinstance(ref, _NoReference) else ref))
        self._apply()   # the next window starts before on_trace_ready: an exception there loses nothing
        if saved:
            self._ready()

    # -- internals -----------------------------------------------------------------------
    def _ask(self, step: int) -> str:
        return "RECORD" if self.schedule is None else _action_name(self.schedule(step))

    def _apply(self) -> None:
        if self._att is not None:
            self._att.enabled = self.current_action != "NONE"
            self._att.step = self.step_num
        if self.current_action != "NONE" and self._sub.ref is None:
            self._start_window()

    def _start_window(self) -> None:
        """Drop what was recorded before, then record the window's reference event."""
        launches.collect(self._sub, self._rec)   # earlier launches go to the other open profiles
        self._sub.pending.clear()
        self._harvested = []
        if self._att is not None:
            self._att.discard()
        if self._factory is not None:
            from .clocks import checked_event  # noqa: PLC0415
            ref = checked_event(self._factory)
            ref.record()
            self._sub.ref = ref
        else:
            self._sub.ref = _NoReference()

    def _discard(self) -> None:
        """A warmup step ended: drain and drop its module calls and launches."""
        self._harvested = []
        if self._att is not None:
            self._att.discard()
        launches.collect(self._sub, self._rec)
        self._sub.pending.clear()
        self._sub.ref = None

    def _save(self) -> None:
        ref = self._sub.ref
        timed_ref = None if isinstance(ref, _NoReference) else ref
        modules = self._att.resolve(reference=timed_ref) if self._att is not None else []
        if self._harvested:   # resolved at earlier steps of this window: back into call order
            modules = sorted(self._harvested + modules, key=lambda r: (r.step, r.start_us, r.depth))
            self._harvested = []
        launches.collect(self._sub, self._rec)
        raw, self._sub.pending = self._sub.pending, []
        kernels = launches.kernel_records(raw, modules, with_flops=self.with_flops, step=self.step_num)
        if modules:
            top = min(r.depth for r in modules)
            total = sum(r.gpu_ms for r in modules if r.depth == top)
        elif timed_ref is not None and self._factory is not None:
            end = self._factory()
            end.record()
            sync = getattr(end, "synchronize", None)
            if sync is not None:
                sync()
            total = max(0.0, float(timed_ref.elapsed_time(end)))
        else:
            total = None
        ceil = self.ceilings if self.ceilings is not None else _cached_ceilings(modules, kernels)
        self.records = Records(modules=modules, kernels=kernels, ceilings=ceil, total_gpu_ms=total)
        self._sub.ref = None
        self.windows += 1

    def _ready(self) -> None:
        """A window was saved: ``on_trace_ready(self)`` (what it raises propagates)."""
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def _detach(self) -> None:
        if self._att is not None:
            att, self._att = self._att, None
            att.remove()
            try:
                att.discard()   # calls never saved (an exception, a window left open): free their marks
            except Exception:
                pass

    def _finish(self, clean: bool) -> None:
        self._active = False
        self._detach()
        sub, self._sub = self._sub, None
        if sub is not None:
            try:   # the last open profile restores the recorder's state from before the first
                launches.unsubscribe(sub)
            except Exception:
                if clean:
                    raise

    # -- results (latest window) ---------------------------------------------------------
    def key_averages(self, group_by: str = "module"):
        """Aggregate the latest window by "module", "kernel" or "op" (:func:`.table.key_averages`);
        ``.table(sort_by=..., row_limit=...)`` prints it."""
        return self.records.key_averages(group_by=group_by)

    def export_chrome_trace(self, path: os.PathLike) -> None:
        """Write the latest window as a Chrome trace JSON file (:func:`.events.export_chrome_trace`)."""
        self.records.export_chrome_trace(path)

    def import_torch_profiler(self, tp: Any) -> list:
        """Add the kernels of other libraries from ``tp``, a finished ``torch.profiler.profile``
        that ran at the same time as the latest window, to ``self.records.kernels`` (rules:
        :mod:`.torch_import`: op = the launching aten op or "torch", module = the innermost of our
        module ranges around the launching op, gpu_ms from the kernel's device time; our own
        kernels, named "ferroattn::...", are skipped). Returns the added records. Raises
        ArgumentError when ``tp`` is not a finished torch profiler."""
        from .torch_import import kernels_from_torch  # noqa: PLC0415
        names = set(self.module_names) | {r.name for r in self.records.modules}
        added = kernels_from_torch(tp, names, ours=self.records.kernels, with_flops=self.with_flops,
                                   step=self.step_num)
        self.records.kernels = list(self.records.kernels) + added
        return added


class _NoReference:
    """Marks a recording window without a timing reference (no event factory: CPU, no model)."""

    def elapsed_time(self, other: Any) -> float:
        raise FerroattnError("no reference event")


def _cuda_factory_or_none():
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


def _cached_ceilings(modules, kernels) -> Optional[Ceilings]:
    """The cached ceilings of the records' device (never measured here), or None."""
    try:
        import torch  # noqa: PLC0415
        if not torch.cuda.is_available():
            return None
        from .ceilings import cached_ceilings  # noqa: PLC0415
        devs = [r.device for r in kernels] or [r.device for r in modules] or [torch.cuda.current_device()]
        return cached_ceilings(devs[0])
    except Exception:
        return None
