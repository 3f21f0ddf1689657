"""ferroattn.profiler: where the GPU time of a model goes, how close each kernel is to the
hardware's limits, and where the knee is as batch and sequence length grow (issue 5).

Importing this package needs neither torch, a GPU nor matplotlib (they are imported on use).

Modules:

- :mod:`.knee`      :func:`detect_knee` on a {(batch, seqlen): ms} grid -> :class:`Knee`
                    (largest growth of the marginal cost per unit of work, from monotone
                    smoothing + a two-segment fit with a noise test; definition there);
- :mod:`.ceilings`  :class:`Ceilings` (TFLOP/s + GB/s with what was timed, device, date) and
                    :func:`measure_ceilings` (times a bf16 and an fp16 matmul and a device copy with
                    :mod:`ferroattn._measure`, caches them once per device/driver/torch/CUDA
                    as JSON in the kernel cache dir; :func:`cached_ceilings` reads the cache);
- :mod:`.heatmap`   :func:`plot_sweep_heatmap` (matplotlib: latency ms / tokens/s per (batch, seqlen),
                    annotated cells, "n/a" for unmeasured ones, the knee outlined);
- :mod:`.roofline`  :func:`arithmetic_intensity`, :func:`attainable_tflops`, :func:`ridge_point`,
                    :func:`utilisation` -> :class:`Utilisation` (carries its ceilings),
                    :func:`plot_roofline` (matplotlib, log-log, both ceilings, one point per kernel);
- :mod:`.events`    record types :class:`ModuleRecord` (one module call) and :class:`KernelRecord`
                    (one kernel launch), :class:`Records` (one profile window) and the Chrome trace
                    (Trace Event Format JSON) export;
- :mod:`.table`     :func:`key_averages` by "module" / "kernel" / "op" -> :class:`KeyAverages`
                    with ``.table(sort_by=..., row_limit=...)`` in torch.profiler's layout;
- :mod:`.hooks`     :func:`attach` -> :class:`Attachment`: forward wrappers (default) or torch
                    forward pre/post hooks on the model, its top-level components (embeddings,
                    final norm, rotary, lm_head), decoder layers and their attention/MLP children
                    (rule: :mod:`.targets` :func:`find_targets`), GPU timestamps
                    (:mod:`.clocks`: native marks from Rust, or events) + record_function (while a
                    torch profiler collects) + NVTX (while an NVTX tool is attached), resolved
                    after the forward;
                    :class:`WallClockEvent` (host-clock events for a model on the CPU);
- :mod:`.cost`      the profiler's cost budget (no more than torch.profiler's own cost on the same
                    forward, measured paired in one run; <= 5 % on GPU-bound forwards) and
                    :func:`cost_verdict` of a paired measurement against it;
- :mod:`.launches`  the adapter over the Rust launch recorder (``_native.profiler_*``):
                    :class:`Recorder`, drained records -> :class:`KernelRecord` (module = innermost
                    module record holding the kernel's start), nesting of profiles;
- :mod:`.torch_import` other libraries' kernels from a simultaneous torch.profiler run;
- :mod:`.profile`   :class:`profile` context manager (``step``, torch.profiler schedules,
                    ``on_trace_ready``, ``key_averages``, ``export_chrome_trace``,
                    ``import_torch_profiler``); module and kernel records share one time base;
- :mod:`.models`    :func:`build_model` (config name or config.json -> seeded random-weight model);
- :mod:`.sweep`     :func:`sweep` -> :class:`SweepResult` of :class:`SweepPoint` (latency,
                    tokens/s, peak memory, one profiled forward per point; knee; heatmap; table);
- :mod:`.overhead`  :func:`launch_overhead` -> :class:`LaunchOverhead` (eager vs CUDA graph);
                    :func:`model_forward` (the capturable form of a transformers forward);
- :mod:`.cli`       ``python -m ferroattn profile`` (validation, sweep, tables, trace, heatmap).

Measured on an H200 (tests/test_gpu_profiler.py, scripts/profiler_overhead.py; figures in
bench/results/profiler_*.json): module records of a Llama-3.2-1B-config forward sum to the whole
forward within ~2 %; ``profile()`` adds < 1.5 % to a GPU-bound forward (batch 4 x 2048 tokens);
on a host-bound one (1 x 256, ~15 ms of host time) every hooked module call's host time adds to
the wall time: +26-60 % with torch hooks and torch.cuda.Event pairs, hence forward
wrappers and native marks (estimated ~6-7 µs per hooked call, ~2-3 % at 1 x 256; measured by
scripts/profiler_overhead.py); ceilings within 20 % of the H200's copy bandwidth and cuBLAS rate; our kernels appear by
name in a simultaneous torch.profiler trace. On a machine without a GPU, time a model on the CPU
with ``event_factory=WallClockEvent`` (the tables then show host time in the "GPU" columns).
Kernel records need an extension built with the launch recorder (``_native.profiler_*``); with
an older build ``prof.records.kernels`` stays empty (``Recorder.available`` is False).
"""
from .ceilings import Ceilings, cached_ceilings, config_dtype, default_cache_dir, measure_ceilings
from .clocks import WallClockEvent
from .cost import cost_verdict
from .hooks import Attachment, attach
from .targets import find_targets
from .launches import Recorder, get_recorder, kernel_records, set_recorder
from .models import build_model
from .overhead import LaunchOverhead, launch_overhead, model_forward
from .profile import profile
from .sweep import SweepPoint, SweepResult, sweep
from .events import KernelRecord, ModuleRecord, Records, chrome_trace_events, export_chrome_trace
from .heatmap import plot_sweep_heatmap
from .knee import Knee, LineKnee, detect_knee
from .roofline import (RooflinePoint, Utilisation, arithmetic_intensity, attainable_tflops, plot_roofline,
                       ridge_point, utilisation)
from .table import Average, KeyAverages, key_averages, sort_keys

__all__ = [
    "Attachment", "attach", "find_targets", "profile", "WallClockEvent", "cost_verdict",
    "build_model", "sweep", "SweepResult", "SweepPoint", "launch_overhead", "LaunchOverhead", "model_forward",
    "Recorder", "get_recorder", "set_recorder", "kernel_records", "cached_ceilings", "config_dtype",
    "Average", "Ceilings", "KernelRecord", "KeyAverages", "Knee", "LineKnee", "ModuleRecord", "Records",
    "RooflinePoint", "Utilisation", "arithmetic_intensity", "attainable_tflops", "chrome_trace_events",
    "default_cache_dir", "detect_knee", "export_chrome_trace", "key_averages", "measure_ceilings",
    "plot_roofline", "plot_sweep_heatmap", "ridge_point", "sort_keys", "utilisation",
]
