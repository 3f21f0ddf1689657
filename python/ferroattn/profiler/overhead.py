"""``launch_overhead``: the cost of launching the same GPU work eagerly vs replaying it from a CUDA
graph (``torch.cuda.CUDAGraph``), i.e. what host-side launch latency adds to a small workload.

Procedure: ``warmup`` eager calls of ``fn`` on a side stream (as torch requires before capture;
this also JIT-compiles our kernels), one capture of ``fn`` into a graph on that stream, one
untimed replay, then ``repeats`` rounds, each timing one eager call and one replay with a pair of
CUDA events on the current stream (interleaved, so clock and thermal drift hit both alike). The
eager time runs from the first launch to the end of the last kernel, so it includes the GPU idle
gaps the host's launch latency leaves; the replay launches everything at once.

A whole transformers model: ``launch_overhead(model_forward(model, input_ids))``. A plain
``lambda: model(input_ids=ids)`` cannot be captured: its forward synchronises with the host, which
capture forbids. Where the syncs of a Llama forward (transformers 5.17, attn "ferroattn",
attention_mask None, no cache) come from, read from the code:

- ours: ``ferroattn.integrations.transformers._is_packed`` (batch 1 only) asks whether
  ``position_ids`` restarts inside the row (packed sequences) — one ``bool(tensor)`` per
  position_ids tensor, remembered per tensor (so once per forward, since LlamaModel makes a new
  ``position_ids`` every forward when none is passed); during capture it would be the
  ``aten::_local_scalar_dense`` that fails;
- transformers: ``masking_utils.find_packed_sequence_indices`` does the same check with
  ``(...).all()`` in an ``if``, but skips it while a CUDA stream captures (``is_tracing``);
  ``flash_attention_mask`` checks ``attention_mask.all()`` only when a mask is passed.

:func:`model_forward` therefore passes one pinned ``position_ids`` tensor (``arange``) with every
call: the warm-up calls answer ``_is_packed`` for it once, and the captured call finds the answer
remembered (no sync); it passes no attention mask and no cache. With a padded batch (a mask) the
forward stays uncapturable (unpadding needs the lengths on the host).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .._measure import event_ms
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


def model_forward(model: Any, input_ids: Any, **kwargs: Any) -> Callable[[], Any]:
    """A zero-argument callable running ``model(input_ids=input_ids, position_ids=P,
    use_cache=False, **kwargs)`` under ``torch.inference_mode()`` and returning its output, where
    ``P`` = ``arange(seqlen)`` expanded to ``input_ids``'s batch is made once here and passed with
    every call (why: module docstring) — the capturable form of a transformers causal-LM forward
    for :func:`launch_overhead`.

    input_ids: (batch, seqlen) integer tensor on the model's device; kwargs: more forward
    arguments (an ``attention_mask`` makes the forward uncapturable). Raises ArgumentError naming
    ``model`` (not callable), ``input_ids`` (not a 2-D integer tensor) or ``kwargs`` (one of
    ``input_ids``, ``position_ids``, ``use_cache`` again)."""
    import torch  # noqa: PLC0415
    if not callable(model):
        raise ArgumentError(f"model: expected a callable torch.nn.Module, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.is_complex():
        shown = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
                 else type(input_ids).__name__)
        raise ArgumentError(f"input_ids: expected a 2-D (batch, seqlen) integer tensor, got {shown}")
    clash = sorted({"input_ids", "position_ids", "use_cache"} & set(kwargs))
    if clash:
        raise ArgumentError(f"kwargs: {', '.join(clash)} are set by model_forward, got them again")
    with torch.inference_mode():
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand(
            input_ids.shape[0], -1)

    def forward():
        with torch.inference_mode():
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
    forward.position_ids = position_ids
    return forward


def launch_overhead(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3) -> LaunchOverhead:
    """Time ``fn`` (a zero-argument callable doing GPU work on the current stream, capturable in a
    CUDA graph: no host synchronisation, no new allocations that depend on data; a transformers
    model: :func:`model_forward`) eagerly and as a CUDA graph replay (procedure: module
    docstring). repeats >= 1, warmup >= 1.

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
