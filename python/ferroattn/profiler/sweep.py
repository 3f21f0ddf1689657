"""``sweep``: forward latency, throughput and peak memory of a model over a batch x sequence-length
grid, one profiled forward per point, and the knee (:func:`~.knee.detect_knee`).

Per point (batch ``b``, sequence length ``s``), in order of increasing ``b * s``:

1. input: ``(b, s)`` int64 token ids, uniform in ``[0, vocab_size)``, from a ``torch.Generator``
   seeded with ``seed`` (the same ids for the same point on every run), on the model's device;
2. ``warmup`` forwards, then ``repeats`` timed forwards under ``torch.inference_mode``; each is
   timed with a pair of CUDA events on the current stream (host ``time.perf_counter`` for a model
   on the CPU); ``latency_ms`` = the median; ``tokens_per_s = b * s / (latency_ms / 1000)``;
3. ``peak_mem_bytes`` = ``torch.cuda.max_memory_allocated`` during 2. minus the memory allocated
   before it (the forward's own working memory: activations, logits); None on the CPU;
4. with ``profile_layers``: one more forward inside :class:`~.profile.profile` (module and kernel
   records of that forward: ``SweepPoint.records``).

A transformers model (``transformers.PreTrainedModel``) is called as
``model(input_ids=ids, use_cache=False)`` (a prefill without KV cache; logits for every position,
as ``model(ids)`` gives them); any other module as ``model(ids)``. An out-of-memory error at a
point (``torch.OutOfMemoryError``, or an error whose text says "out of memory") gives
``SweepPoint(error="out of memory")``, empties the CUDA cache and the sweep goes on; another
exception gives ``error = "<type>: <message>"`` and the sweep goes on too (``SweepResult.errors``).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .._measure import event_ms
from ..errors import ArgumentError, FerroattnError
from .events import Records
from ._util import flag, integer
from .knee import Knee, _check_axis_values, detect_knee, fmt_growth

OOM = "out of memory"
METRICS = ("latency_ms", "tokens_per_s", "peak_mem_bytes")


@dataclass
class SweepPoint:
    """One (batch, seqlen) point. latency_ms: median forward time, ms; tokens_per_s: tokens per
    second; peak_mem_bytes: peak extra device memory of the forward, bytes (None on the CPU);
    error: None, "out of memory" or "<type>: <message>" (the other fields are then None);
    records: the profiled forward's :class:`~.events.Records` (None without ``profile_layers``)."""

    latency_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mem_bytes: Optional[int] = None
    error: Optional[str] = None
    records: Optional[Records] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency_ms is not None

    def to_dict(self) -> dict:
        d = {"latency_ms": self.latency_ms, "tokens_per_s": self.tokens_per_s,
             "peak_mem_bytes": self.peak_mem_bytes, "error": self.error}
        if self.records is not None:
            d["modules_gpu_ms"] = self.records.total_gpu_ms
            d["n_module_records"] = len(self.records.modules)
            d["n_kernel_records"] = len(self.records.kernels)
        return d


@dataclass
class SweepResult:
    """What :func:`sweep` measured. points: ``{(batch, seqlen): SweepPoint}`` (every grid point,
    failed ones included); knee: :func:`detect_knee` of the latency grid (tokens as work), None
    when no line of the grid has 3 measured points or the analysis failed; batches, seqlens: the
    axes (ascending); info: model class, device, dtype, attention implementation, repeats, warmup,
    seed; knee_error: why the knee analysis failed ("<type>: <message>"; the points are kept), or None."""

    points: dict
    knee: Optional[Knee]
    batches: tuple = ()
    seqlens: tuple = ()
    info: dict = field(default_factory=dict)
    knee_error: Optional[str] = None

    def grid(self, metric: str = "latency_ms") -> dict:
        """``{(batch, seqlen): value or None}`` of ``metric`` ("latency_ms", "tokens_per_s",
        "peak_mem_bytes"); None where the point failed. Raises ArgumentError for another metric."""
        if metric not in METRICS:
            raise ArgumentError(f"metric: expected one of {METRICS}, got {metric!r}")
        return {k: (getattr(p, metric) if p.ok else None) for k, p in self.points.items()}

    @property
    def errors(self) -> dict:
        """``{(batch, seqlen): error}`` of the failed points."""
        return {k: p.error for k, p in self.points.items() if p.error is not None}

    def profiled_point(self) -> Optional[tuple]:
        """The (batch, seqlen) whose records are the most informative: the knee when it was
        measured and profiled, else the largest (by tokens) profiled point; None when none."""
        have = [k for k, p in self.points.items() if p.ok and p.records is not None]
        if not have:
            return None
        if self.knee is not None and self.knee.config in have:
            return self.knee.config
        return max(have, key=lambda k: (k[0] * k[1], k[0]))

    def plot_heatmap(self, path: Any = None, metric: Any = ("latency_ms", "tokens_per_s"), title: Optional[str] = None):
        """Latency / throughput heatmap with the knee outlined
        (:func:`~.heatmap.plot_sweep_heatmap`); returns the matplotlib Figure, saved to ``path``
        when given. Raises FerroattnError when no point was measured."""
        from .heatmap import plot_sweep_heatmap  # noqa: PLC0415
        lat = self.grid("latency_ms")
        if not any(v is not None for v in lat.values()):
            raise FerroattnError(f"plot_heatmap: no point of the sweep was measured (errors: {self.errors})")
        return plot_sweep_heatmap(lat, metric=metric, knee=self.knee if self.knee is not None else False,
                                  title=title, path=path)

    def table(self) -> str:
        """A text table, one row per point: batch, seqlen, tokens, latency (ms), tokens/s, peak
        memory (MiB) or the error; then the knee line."""
        header = ["batch", "seqlen", "tokens", "latency ms", "tokens/s", "peak MiB", "note"]
        rows = []
        for (b, s) in sorted(self.points, key=lambda k: (k[0], k[1])):
            p = self.points[(b, s)]
            if p.ok:
                mem = "--" if p.peak_mem_bytes is None else f"{p.peak_mem_bytes / 2**20:.0f}"
                note = "knee" if self.knee is not None and self.knee.config == (b, s) else ""
                rows.append([str(b), str(s), str(b * s), f"{p.latency_ms:.3f}", f"{p.tokens_per_s:.4g}", mem, note])
            else:
                rows.append([str(b), str(s), str(b * s), "n/a", "n/a", "n/a", str(p.error)])
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        rule = "  ".join("-" * w for w in widths)

        def line(cells):
            return "  ".join(c.ljust(w) if i == len(cells) - 1 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        out = [rule, line(header), rule] + [line(r) for r in rows] + [rule]
        out.append(knee_line(self.knee, self.knee_error))
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict:
        """JSON-ready: axes, info, per point its numbers (``"b,s"`` keys), the knee."""
        k = self.knee
        return {"batches": list(self.batches), "seqlens": list(self.seqlens), "info": dict(self.info),
                "points": {f"{b},{s}": p.to_dict() for (b, s), p in sorted(self.points.items())},
                "knee": None if k is None else {"config": None if k.config is None else list(k.config),
                                                "axis": k.axis, "growth": k.growth, "min_growth": k.min_growth},
                "knee_error": self.knee_error}


def knee_line(knee: Optional[Knee], error: Optional[str] = None) -> str:
    """One line describing ``knee`` (or why the analysis failed: ``error``)."""
    if error is not None:
        return f"knee: not computed, the analysis failed ({error})"
    if knee is None:
        return "knee: not enough points (a line of the grid needs 3 measured points)"
    if not knee.found:
        g = "" if knee.growth is None else (f" (no change of slope that clearly exceeds the noise; largest "
                                            f"marginal-cost growth {fmt_growth(knee.growth)}, threshold "
                                            f"{fmt_growth(knee.min_growth)})")
        return f"knee: none{g}"
    return (f"knee: batch={knee.config[0]}, seqlen={knee.config[1]} (along {knee.axis}; marginal cost per token "
            f"grows {fmt_growth(knee.growth)} after it)")


def _axis(name: str, values: Any) -> tuple:
    return tuple(sorted(_check_axis_values(name, values)))


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory error (torch's, or any error saying "out of memory")."""
    import torch  # noqa: PLC0415
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom_type) or "out of memory" in str(e).lower()


def _is_hf(model: Any) -> bool:
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def forward_fn(model: Any, ids: Any) -> Callable[[], Any]:
    """The zero-argument forward :func:`sweep` times (calling convention: module docstring)."""
    if _is_hf(model):
        return lambda: model(input_ids=ids, use_cache=False)
    return lambda: model(ids)


def _model_device(model: Any):
    import torch  # noqa: PLC0415
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _time(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    times = []
    for _ in range(repeats):
        if cuda:
            times.append(event_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure_point(model: Any, b: int, s: int, vocab: int, repeats: int, warmup: int, profile_layers: bool,
                   seed: int, device: Any, profile_options: dict) -> SweepPoint:
    import torch  # noqa: PLC0415
    cuda = device.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=gen, dtype=torch.int64).to(device)
    fn = forward_fn(model, ids)
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for _ in range(warmup):
            fn()
        ms = _time(fn, repeats, cuda)
        peak = int(torch.cuda.max_memory_allocated(device) - base) if cuda else None
        records = None
        if profile_layers:
            from .clocks import WallClockEvent  # noqa: PLC0415
            from .profile import profile  # noqa: PLC0415
            opts = dict(profile_options)
            if not cuda:
                opts.setdefault("event_factory", WallClockEvent)
            with profile(model, **opts) as prof:
                fn()
            records = prof.records
    tps = b * s / (ms * 1e-3) if ms > 0 else None
    return SweepPoint(ms, tps, peak, None, records)


def sweep(model: Any, batches: Sequence[int], seqlens: Sequence[int], *, repeats: int = 10, warmup: int = 3,
          profile_layers: bool = True, progress: bool = True, vocab_size: Optional[int] = None, seed: int = 0,
          profile_options: Optional[dict] = None) -> SweepResult:
    """Measure ``model`` at every (batch, seqlen) of ``batches`` x ``seqlens`` (procedure: module
    docstring) and return a :class:`SweepResult`.

    model: a ``torch.nn.Module`` taking ``(b, s)`` int64 token ids (e.g. :func:`~.models.build_model`),
    or a config name / config.json path (built with :func:`~.models.build_model` defaults);
    batches, seqlens: distinct positive ints; repeats (>= 1), warmup (>= 0): timed and untimed
    forwards per point; profile_layers: one profiled forward per point (``SweepPoint.records``);
    progress: a tqdm progress bar on stderr (left out when tqdm is not installed); vocab_size:
    token ids are drawn below it (default ``model.config.vocab_size``); seed: the token ids' seed
    (an int in [0, 2**63));
    profile_options: extra keyword arguments of :class:`~.profile.profile` (e.g. ``ceilings``).

    Raises ArgumentError naming a bad argument (e.g. no ``vocab_size`` and no ``model.config``).
    Errors at a point are recorded in its ``error`` (see the module docstring), not raised; so is
    an error of the knee analysis (``SweepResult.knee_error``; the measured points are kept).
    """
    if isinstance(model, str):
        from .models import build_model  # noqa: PLC0415
        model = build_model(model)
    import torch  # noqa: PLC0415
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module or a config name/path, got {type(model).__name__}")
    bs, ss = _axis("batches", batches), _axis("seqlens", seqlens)
    repeats, warmup = integer("repeats", repeats, 1), integer("warmup", warmup, 0)
    seed = integer("seed", seed, 0, 2**63 - 1)   # torch.Generator.manual_seed's range
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab_size is None:
            raise ArgumentError("vocab_size: expected an int >= 1 (the model has no config.vocab_size), got None")
    vocab_size = integer("vocab_size", vocab_size, 1)
    if profile_options is not None and not isinstance(profile_options, dict):
        raise ArgumentError(f"profile_options: expected a dict or None, got {type(profile_options).__name__}")
    profile_layers, progress = flag("profile_layers", profile_layers), flag("progress", progress)
    if profile_options:
        from .profile import profile as _profile  # noqa: PLC0415
        _profile(model, **profile_options)   # its argument checks, up front (nothing is attached yet)
    device = _model_device(model)
    cfg = getattr(model, "config", None)
    info = {"model": type(model).__name__, "device": str(device),
            "dtype": str(next(iter(model.parameters()), torch.empty(0)).dtype).replace("torch.", ""),
            "attn": getattr(cfg, "_attn_implementation", None), "repeats": repeats, "warmup": warmup,
            "seed": seed, "vocab_size": vocab_size}
    order = sorted(((b, s) for b in bs for s in ss), key=lambda k: (k[0] * k[1], k[0]))
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm  # noqa: PLC0415
            bar = tqdm(total=len(order), desc="profile sweep", unit="point")
        except ImportError:
            bar = None
    points: dict = {}
    try:
        for b, s in order:
            if bar is not None:
                bar.set_postfix_str(f"batch={b} seqlen={s}")
            try:
                points[(b, s)] = _measure_point(model, b, s, vocab_size, repeats, warmup, profile_layers, seed,
                                                device, profile_options or {})
            except Exception as e:  # noqa: BLE001 — recorded per point, the sweep goes on
                points[(b, s)] = SweepPoint(error=OOM if is_oom(e) else f"{type(e).__name__}: {e}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    knee, knee_error = _knee({k: p.latency_ms for k, p in points.items() if p.ok})
    return SweepResult({k: points[k] for k in sorted(points)}, knee, bs, ss, info, knee_error)


def _knee(lat: dict) -> tuple:
    """(knee or None, error or None) of the measured latencies: an analysis error is recorded,
    never raised, so the measured points are kept."""
    if not lat:
        return None, None
    try:
        k = detect_knee(lat)
    except Exception as e:  # noqa: BLE001 — the sweep's measurements must survive the analysis
        return None, f"{type(e).__name__}: {e}"
    return (k if k.growth is not None else None), None
