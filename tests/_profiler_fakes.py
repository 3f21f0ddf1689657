"""Shared fakes for the profiler tests: a synthetic clock, fake events, a fake Rust launch
recorder (the ``_native.profiler_*`` contract) and a tiny decoder-shaped model whose modules
advance the clock by known amounts (ms) and can "launch" kernels through the fake recorder."""
from __future__ import annotations

import torch


class Clock:
    def __init__(self):
        self.now = 0.0        # ms
        self.synced = 0
        self.events = {}      # cuda_event handle -> FakeEvent


class FakeEvent:
    """record() reads the clock; elapsed_time(other) = other - self in ms (torch.cuda.Event API);
    ``cuda_event``: a unique nonzero int handle (the fake recorder resolves it)."""

    _next = 1

    def __init__(self, clock):
        self.clock, self.t = clock, None
        self.cuda_event = FakeEvent._next
        FakeEvent._next += 1
        clock.events[self.cuda_event] = self

    def record(self):
        self.t = self.clock.now

    def elapsed_time(self, other):
        assert self.t is not None and other.t is not None, "event not recorded"
        return other.t - self.t

    def synchronize(self):
        self.clock.synced += 1


class FakeNative:
    """The ``_native.profiler_*`` functions over a Clock. ``launch(kernel, ms, **fields)``
    stands for one of our launches: it records (when enabled) a contract dict whose start is the
    clock and advances the clock by ``ms``. ``profiler_drain(ref)`` resolves ``start_ms`` against
    the FakeEvent with handle ``ref`` (None without one). Marks: ``profiler_mark`` reads the
    clock (0 while ``capturing``); ``done`` is what ``profiler_marks_query`` answers; resolve /
    release follow the contract (unknown or repeated ids: ArgumentError naming ``marks``)."""

    def __init__(self, clock, enabled=False):
        self.clock, self.on, self.kept, self.seq, self.drains = clock, enabled, [], 0, 0
        self.enable_calls = []
        self.marks, self.next_mark, self.capturing, self.done, self.resolves = {}, 0, False, True, 0
        self.mark_streams = []

    def profiler_mark(self, stream, device):
        self.mark_streams.append((stream, device))
        if self.capturing:
            return 0
        self.next_mark += 1
        self.marks[self.next_mark] = self.clock.now
        return self.next_mark

    def _check(self, marks):
        from ferroattn.errors import ArgumentError
        if len(set(marks)) != len(marks) or any(m not in self.marks for m in marks):
            raise ArgumentError(f"marks: expected unresolved mark ids, got {list(marks)}")

    def profiler_marks_query(self, marks):
        self._check(marks)
        return [self.done] * len(marks)

    def profiler_marks_resolve(self, marks, reference_event=None):
        self._check(marks)
        self.resolves += 1
        if not marks:
            return []
        ref = self.clock.events[reference_event].t if reference_event else self.marks[marks[0]]
        return [self.marks.pop(m) - ref for m in marks]

    def profiler_marks_release(self, marks):
        return sum(1 for m in marks if self.marks.pop(m, None) is not None)

    def profiler_enable(self, enabled):
        self.enable_calls.append(bool(enabled))
        self.on = bool(enabled)

    def profiler_enabled(self):
        return self.on

    def profiler_stats(self):
        return {"enabled": self.on, "pending": len(self.kept), "skipped_capture": 0, "dropped": 0}

    def profiler_drain(self, reference_event=None):
        self.drains += 1
        ref = self.clock.events.get(reference_event) if reference_event is not None else None
        out = []
        for d in self.kept:
            d = dict(d)
            t = d.pop("_t")
            d["start_ms"] = None if ref is None or ref.t is None else t - ref.t
            out.append(d)
        self.kept = []
        return out

    def launch(self, kernel="attn_fwd_sm80", ms=1.0, **fields):
        if self.on:
            d = {"seq": self.seq, "op": "ferroattn::attn_fwd", "kernel": kernel,
                 "config": "ferroattn::attn_fwd_sm80<64, 128, 64, 4, 2, true, __nv_bfloat16>", "arch": "sm_90a",
                 "device": 0, "stream": 7, "grid": (8, 4, 1), "block": (128, 1, 1), "dynamic_smem_bytes": 40960,
                 "static_smem_bytes": 16, "registers": 168, "max_active_blocks_per_sm": 1, "occupancy": 0.0625,
                 "flops": 2e9 * ms, "bytes": 1e6 * ms, "exact": True, "gpu_ms": ms, "_t": self.clock.now}
            d.update(fields)
            self.kept.append(d)
        self.seq += 1
        self.clock.now += ms


class Work(torch.nn.Module):
    """Advances the clock by ``ms``; with ``native`` the time is one launch of ``kernel`` instead."""

    def __init__(self, clock, ms, fail=False, native=None, kernel="attn_fwd_sm80"):
        super().__init__()
        self.clock, self.ms, self.fail, self.native, self.kernel = clock, ms, fail, native, kernel

    def forward(self, x):
        if self.native is not None:
            self.native.launch(self.kernel, self.ms)
        else:
            self.clock.now += self.ms
        if self.fail:
            raise RuntimeError("boom")
        return x


class Layer(torch.nn.Module):
    def __init__(self, clock, attn_ms, mlp_ms, native=None):
        super().__init__()
        self.norm = Work(clock, 0.5)
        self.self_attn = Work(clock, attn_ms, native=native)
        self.mlp = Work(clock, mlp_ms)

    def forward(self, x):
        return self.mlp(self.self_attn(self.norm(x)))


class Decoder(torch.nn.Module):
    """embed 1 ms, layer i: norm 0.5 + attn (2+i) + mlp 3 ms."""

    def __init__(self, clock, n=3, native=None):
        super().__init__()
        self.embed = Work(clock, 1.0)
        self.layers = torch.nn.ModuleList([Layer(clock, 2.0 + i, 3.0, native) for i in range(n)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def make(n=3):
    clock = Clock()
    return clock, Decoder(clock, n), (lambda: FakeEvent(clock))


def make_launching(n=3, enabled=False):
    """(clock, model, event factory, fake native, Recorder over it): the attention modules' time
    is one fake launch each (kernel attn_fwd_sm80, 2+i ms in layer i)."""
    from ferroattn.profiler.launches import Recorder
    clock = Clock()
    native = FakeNative(clock, enabled)
    return clock, Decoder(clock, n, native), (lambda: FakeEvent(clock)), native, Recorder(native)


class Kernel:
    """torch's FunctionEvent.kernels entry: name, device, duration (µs)."""

    def __init__(self, name, duration, device=0):
        self.name, self.duration, self.device = name, duration, device


class Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class FEvent:
    """FunctionEvent-like: name, device_type (torch.autograd.DeviceType), time_range (µs),
    kernels, cpu_parent, flops."""

    def __init__(self, name, start, end, parent=None, kernels=(), flops=None, cuda=False):
        from torch.autograd import DeviceType
        self.name, self.time_range, self.cpu_parent = name, Range(start, end), parent
        self.kernels, self.flops = list(kernels), flops
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU


class FakeTorchProfiler:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events
