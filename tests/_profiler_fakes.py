"""Shared fakes for the profiler tests: a synthetic clock, fake events and a tiny decoder-shaped
model whose modules advance the clock by known amounts (ms)."""
from __future__ import annotations

import torch


class Clock:
    def __init__(self):
        self.now = 0.0        # ms
        self.synced = 0


class FakeEvent:
    """record() stamps the clock; elapsed_time(other) = other - self in ms (torch.cuda.Event API)."""

    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock.now

    def elapsed_time(self, other):
        assert self.t is not None and other.t is not None, "event not recorded"
        return other.t - self.t

    def synchronize(self):
        self.clock.synced += 1


class Work(torch.nn.Module):
    def __init__(self, clock, ms, fail=False):
        super().__init__()
        self.clock, self.ms, self.fail = clock, ms, fail

    def forward(self, x):
        self.clock.now += self.ms
        if self.fail:
            raise RuntimeError("boom")
        return x


class Layer(torch.nn.Module):
    def __init__(self, clock, attn_ms, mlp_ms):
        super().__init__()
        self.norm = Work(clock, 0.5)
        self.self_attn = Work(clock, attn_ms)
        self.mlp = Work(clock, mlp_ms)

    def forward(self, x):
        return self.mlp(self.self_attn(self.norm(x)))


class Decoder(torch.nn.Module):
    """embed 1 ms, layer i: norm 0.5 + attn (2+i) + mlp 3 ms."""

    def __init__(self, clock, n=3):
        super().__init__()
        self.embed = Work(clock, 1.0)
        self.layers = torch.nn.ModuleList([Layer(clock, 2.0 + i, 3.0) for i in range(n)])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def make(n=3):
    clock = Clock()
    return clock, Decoder(clock, n), (lambda: FakeEvent(clock))
