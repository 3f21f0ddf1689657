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
synchronisation, outside any forward) into ``prof.records`` and ``on_trace_ready(prof)`` is called.
``schedule=None``: every step records and the whole block is one window, resolved at exit.
``key_averages``/``export_chrome_trace`` use the latest resolved window (as torch.profiler).

Kernel records: ``prof.records.kernels`` stays empty for now; the Rust launch records of our
kernels (src/profiler.rs, a _native contract) fill it in the next part of issue 5.
``record_shapes`` keeps module input shapes (``ModuleRecord.input_shapes``, trace args);
``with_flops`` is kept as ``prof.with_flops`` for the kernel records (no effect yet).

torch.profiler: this class never starts or stops torch's profiler; run ``torch.profiler.profile``
around or inside it and the module ``record_function`` ranges appear in torch's trace.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..errors import ArgumentError, FerroattnError
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
    """Profile ``model``'s decoder layers, attention and MLP modules (see :mod:`.hooks`).

    model: a ``torch.nn.Module`` or None (no module records); record_shapes, with_flops: see the
    module docstring; schedule: None or ``torch.profiler.schedule(...)``-like callable;
    on_trace_ready: None or a callable taking this object; event_factory: None (CUDA events) or
    a zero-argument event factory (:mod:`.hooks`); hook_options: extra keyword arguments of
    :func:`.hooks.attach` (e.g. ``include_root``, ``layer_lists``). Raises ArgumentError naming a
    bad argument, NoDeviceError at ``__enter__`` when CUDA events are needed and there is no GPU.
    """

    def __init__(self, model: Any = None, record_shapes: bool = True, with_flops: bool = True,
                 schedule: Optional[Callable[[int], Any]] = None,
                 on_trace_ready: Optional[Callable[["profile"], Any]] = None, *,
                 event_factory: Optional[Callable[[], Any]] = None, **hook_options: Any):
        if schedule is not None and not callable(schedule):
            raise ArgumentError(f"schedule: expected None or a callable step -> ProfilerAction, got {schedule!r}")
        if on_trace_ready is not None and not callable(on_trace_ready):
            raise ArgumentError(f"on_trace_ready: expected None or a callable, got {on_trace_ready!r}")
        self.model = model
        self.record_shapes = bool(record_shapes)
        self.with_flops = bool(with_flops)
        self.schedule = schedule
        self.on_trace_ready = on_trace_ready
        self.event_factory = event_factory
        self.hook_options = hook_options
        self.step_num = 0
        self.current_action = "RECORD"
        self.records = Records()
        self.windows = 0          # resolved windows so far
        self._att = None
        self._active = False

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "profile":
        if self._active:
            raise FerroattnError("profile: already entered (a profile object is used by one with-block at a time)")
        if self.model is not None:
            from .hooks import attach  # noqa: PLC0415
            self._att = attach(self.model, event_factory=self.event_factory, record_shapes=self.record_shapes,
                               **self.hook_options)
        self._active = True
        self.step_num = 0
        self.current_action = self._ask(0)
        self._apply()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.current_action in _RECORDING and exc_type is None:
                self._save()
        finally:
            self._active = False
            if self._att is not None:
                self._att.remove()
                self._att = None

    def step(self) -> None:
        """End the current step: ask the schedule for the next action; save a finished window."""
        if not self._active:
            raise FerroattnError("profile.step(): called outside the with-block")
        prev = self.current_action
        self.step_num += 1
        self.current_action = self._ask(self.step_num)
        if prev == "RECORD_AND_SAVE" or (prev == "RECORD" and self.current_action not in _RECORDING):
            self._save()
        elif prev == "WARMUP" and self._att is not None:
            self._att.take()   # discard warmup calls
        self._apply()

    # -- internals -----------------------------------------------------------------------
    def _ask(self, step: int) -> str:
        return "RECORD" if self.schedule is None else _action_name(self.schedule(step))

    def _apply(self) -> None:
        if self._att is not None:
            self._att.enabled = self.current_action != "NONE"
            self._att.step = self.step_num

    def _save(self) -> None:
        modules = self._att.resolve() if self._att is not None else []
        self.records = Records(modules=modules, kernels=[])
        self.windows += 1
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    # -- results (latest window) ---------------------------------------------------------
    def key_averages(self, group_by: str = "module"):
        """Aggregate the latest window by "module", "kernel" or "op" (:func:`.table.key_averages`);
        ``.table(sort_by=..., row_limit=...)`` prints it."""
        return self.records.key_averages(group_by=group_by)

    def export_chrome_trace(self, path: os.PathLike) -> None:
        """Write the latest window as a Chrome trace JSON file (:func:`.events.export_chrome_trace`)."""
        self.records.export_chrome_trace(path)
