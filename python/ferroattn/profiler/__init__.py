"""ferroattn.profiler: where the GPU time of a model goes, how close each kernel is to the
hardware's limits, and where the knee is as batch and sequence length grow (issue 5).

Importing this package needs neither torch, a GPU nor matplotlib (they are imported on use).

Built (GPU-independent, tested on CPU):

- :mod:`.knee`      :func:`detect_knee` on a {(batch, seqlen): ms} grid -> :class:`Knee`
                    (largest growth of the marginal cost per unit of work; definition there);
- :mod:`.ceilings`  :class:`Ceilings` (TFLOP/s + GB/s with what was timed, device, date) and
                    :func:`measure_ceilings` (times them with :mod:`ferroattn.bench.ceilings`,
                    caches them once per device/driver/torch/CUDA as JSON in the kernel cache dir);
- :mod:`.heatmap`   :func:`plot_sweep_heatmap` (matplotlib: latency ms / tokens/s per (batch, seqlen),
                    annotated cells, "n/a" for unmeasured ones, the knee outlined);
- :mod:`.roofline`  :func:`arithmetic_intensity`, :func:`attainable_tflops`, :func:`ridge_point`,
                    :func:`utilisation` -> :class:`Utilisation` (carries its ceilings),
                    :func:`plot_roofline` (matplotlib, log-log, both ceilings, one point per kernel);
- :mod:`.events`    record types :class:`ModuleRecord` (one module call) and :class:`KernelRecord`
                    (one launch of our kernels), :class:`Records` (one profile) and the Chrome trace
                    (Trace Event Format JSON) export;
- :mod:`.table`     :func:`key_averages` by "module" / "kernel" / "op" -> :class:`KeyAverages`
                    with ``.table(sort_by=..., row_limit=...)`` in torch.profiler's layout.

- :mod:`.hooks`     :func:`attach` -> :class:`Attachment`: forward pre/post hooks on the model, its
                    decoder layers and their attention/MLP children (rule: :func:`find_targets`),
                    event pairs + record_function + NVTX, resolved after the forward;
- :mod:`.profile`   :class:`profile` context manager (``step``, torch.profiler schedules,
                    ``on_trace_ready``, ``key_averages``, ``export_chrome_trace``);
- :mod:`.cli`       ``python -m ferroattn profile`` argument parsing/validation (the sweep itself:
                    GPU part of issue 5).

Plan (items 1-2 are built, on CPU with fake events; GPU validation pending):

1. ``profile(model=None, record_shapes=True, with_flops=True, schedule=None, on_trace_ready=None)``
   context manager with ``step()``, ``key_averages(group_by)`` and ``export_chrome_trace(path)``
   delegating to a :class:`Records`; ``schedule``/``on_trace_ready`` mirror torch.profiler's cycle.
2. Module hooks: forward pre/post hooks on every decoder layer and its attention and MLP children
   record a CUDA event pair per call into a list (no host sync in the forward) plus
   ``torch.profiler.record_function`` and NVTX ranges; resolved at ``__exit__``/``step()`` into
   :class:`ModuleRecord` (gpu_ms = elapsed_time, start_us from the first event, depth from nesting).
3. Kernel records: ``src/profiler.rs`` records at launch (name, config name expression, grid, block,
   registers/smem via cuFuncGetAttribute, theoretical occupancy via
   cuOccupancyMaxActiveBlocksPerMultiprocessor, FLOPs, bytes, event pair) when enabled; Python
   drains it into :class:`KernelRecord` (needs a _native.pyi contract from the lead).
4. CLI ``python -m ferroattn profile`` sweeping batch x seqlen -> heatmap + :func:`detect_knee`.
"""
from .ceilings import Ceilings, default_cache_dir, measure_ceilings
from .hooks import Attachment, attach, find_targets
from .profile import profile
from .events import KernelRecord, ModuleRecord, Records, chrome_trace_events, export_chrome_trace
from .heatmap import plot_sweep_heatmap
from .knee import Knee, LineKnee, detect_knee
from .roofline import (RooflinePoint, Utilisation, arithmetic_intensity, attainable_tflops, plot_roofline,
                       ridge_point, utilisation)
from .table import Average, KeyAverages, key_averages, sort_keys

__all__ = [
    "Attachment", "attach", "find_targets", "profile",
    "Average", "Ceilings", "KernelRecord", "KeyAverages", "Knee", "LineKnee", "ModuleRecord", "Records",
    "RooflinePoint", "Utilisation", "arithmetic_intensity", "attainable_tflops", "chrome_trace_events",
    "default_cache_dir", "detect_knee", "export_chrome_trace", "key_averages", "measure_ceilings",
    "plot_roofline", "plot_sweep_heatmap", "ridge_point", "sort_keys", "utilisation",
]
