"""``launch_overhead``: the cost of launching the same GPU work eagerly vs replaying it from a CUDA
graph (``torch.cuda.CUDAGraph``), i.e. what host-side launch latency adds to a small workload.

Procedure: ``warmup`` eager calls of ``fn`` on a side stream (as torch requires before capture;
this also JIT-compiles our kernels), one capture of ``fn`` into a graph on that stream, one
untimed replay, then ``repeats`` rounds, each timing one eager call and one replay with a pair of
CUDA events on the current stream (interleaved, so clock and thermal drift hit both alike). The
eager time runs from the first launch to the end of the last kernel, so it includes the GPU idle
gaps the host's launch latency leaves; the replay launches everything at once.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from ..bench.timing import event_ms
from ..errors import ArgumentError, NoDeviceError


@dataclass(frozen=True)
class LaunchOverhead:
    """eager_ms: median time of one eager call of ``fn``, ms; graph_ms: median time of one replay
    of its CUDA graph, ms; overhead_ms = eager_ms - graph_ms (the launch overhead the graph
    removes; may be slightly negative within noise); overhead_pct = 100 * overhead_ms / eager_ms."""

    eager_ms: float
    graph_ms: float
    overhead_ms: float
    overhead_pct: float
    repeats: int = 0

    def __str__(self) -> str:
        return (f"eager {self.eager_ms:.4f} ms, CUDA graph {self.graph_ms:.4f} ms: launch overhead "
                f"{self.overhead_ms:.4f} ms ({self.overhead_pct:.1f}% of eager; median of {self.repeats})")


def launch_overhead(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3) -> LaunchOverhead:
    """Time ``fn`` (a zero-argument callable doing GPU work on the current stream, capturable in a
    CUDA graph: no host synchronisation, no new allocations that depend on data) eagerly and as a
    CUDA graph replay (procedure: module docstring). repeats >= 1, warmup >= 1.

    Returns :class:`LaunchOverhead`. Raises ArgumentError naming a bad argument, NoDeviceError
    without a CUDA GPU, and what torch raises when ``fn`` cannot be captured."""
    if not callable(fn):
        raise ArgumentError(f"fn: expected a zero-argument callable, got {fn!r}")
    for name, v in (("repeats", repeats), ("warmup", warmup)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name}: expected an int >= 1, got {v!r}")
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():
        raise NoDeviceError("launch_overhead: needs a CUDA GPU (torch.cuda.is_available() is False)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()

    eager, replay = [], []
    for _ in range(repeats):
        eager.append(event_ms(fn))
        replay.append(event_ms(graph.replay))
    del graph
    e, g = statistics.median(eager), statistics.median(replay)
    return LaunchOverhead(e, g, e - g, 100.0 * (e - g) / e if e > 0 else 0.0, repeats)
