"""Module attribution: forward pre/post hooks that time decoder layers and their attention and
MLP children with (CUDA) events, without any host synchronisation inside the forward.

Which modules are hooked (:func:`find_targets`), in ``model.named_modules()`` order:

1. the model itself (``include_root=True``; its record is named after its class, e.g.
   ``LlamaForCausalLM``, and is the depth-0 record whose time is the "% of total" denominator);
2. the top-level components (``top_level=True``): every direct child of the model and of each
   module that holds a layer list (below) that is neither a layer list nor an ancestor of one,
   nor a bare ``ModuleList``/``ModuleDict`` container (never called itself). For Llama:
   ``lm_head``, ``model.embed_tokens``, ``model.norm``, ``model.rotary_emb`` (``model`` itself
   holds the layers and is skipped). With them the depth-1 records cover the whole forward and
   sum to about the root's time (what is left: the Python glue between them, e.g. mask building);
3. every element of a ``torch.nn.ModuleList`` whose attribute name is one of ``layer_lists``
   (default ``layers`` (Llama, Mistral, Qwen), ``h`` (GPT-2, Falcon, BLOOM), ``blocks``,
   ``layer`` (BERT's ``encoder.layer``)): the decoder (or encoder) layers;
4. in each such layer, the first direct child found under ``attention_names`` (default
   ``self_attn``, ``attention``, ``attn``) and the first under ``mlp_names`` (default ``mlp``,
   ``feed_forward``, ``ffn``). Only direct children are looked at, so e.g.
   ``attention.self`` (BERT) is timed as ``attention``.

Per call of a hooked module the pre hook records a start event, opens a
``torch.autograd.profiler.record_function`` range while a torch profiler is collecting (it shows
in that torch.profiler trace; with none running the range would be invisible, so it is skipped
and costs nothing) and, when CUDA is available, pushes an NVTX range (Nsight Systems); the post
hook (registered with ``always_call=True``, so it also runs when the forward raises) records the
end event and closes both ranges. Events are kept in a list; elapsed times are read only by
:meth:`Attachment.resolve`, after the forward (it synchronises on the last end event once), and
the resolved events go back to a pool the next calls record with (no event creation per call
once warm).

A module called several times per forward gives one record per call; nesting depth is the number
of hooked calls open when the call starts (root 0, top-level components and layers 1,
attention/MLP 2 for a plain model).

Event factory: a zero-argument callable returning an object with ``record()``,
``elapsed_time(other) -> ms`` and optionally ``synchronize()``; the default is
``torch.cuda.Event(enable_timing=True)`` (recorded on the current stream). Tests pass a fake;
:class:`WallClockEvent` times a model running on the CPU (host wall clock).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..errors import ArgumentError, NoDeviceError
from .events import ModuleRecord

LAYER_LISTS = ("layers", "h", "blocks", "layer")
ATTENTION_NAMES = ("self_attn", "attention", "attn")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def find_targets(model: Any, include_root: bool = True, layer_lists: Sequence[str] = LAYER_LISTS,
                 attention_names: Sequence[str] = ATTENTION_NAMES,
                 mlp_names: Sequence[str] = MLP_NAMES, top_level: bool = True) -> list:
    """The modules :func:`attach` hooks, as ``[(qualified name, module), ...]`` (rule in the
    module docstring): the root first, then the top-level components and layers in
    ``model.named_modules()`` order. Raises ArgumentError when ``model`` is not a ``torch.nn.Module``."""
    import torch  # noqa: PLC0415
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    targets: list = []
    seen: set = set()

    def add(name, mod):
        if id(mod) not in seen:
            seen.add(id(mod))
            targets.append((name, mod))

    if include_root:
        add(type(model).__name__, model)
    lists = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and name and name.rsplit(".", 1)[-1] in layer_lists]
    list_names = [n for n, _ in lists]
    top: dict = {}   # qualified name -> module, for the top-level components
    if top_level:
        holders = {""} | {n.rsplit(".", 1)[0] if "." in n else "" for n in list_names}
        for hname in holders:
            holder = model.get_submodule(hname) if hname else model
            for cname, child in holder.named_children():
                q = f"{hname}.{cname}" if hname else cname
                if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    continue
                if any(ln == q or ln.startswith(q + ".") for ln in list_names):
                    continue   # a layer list, or an ancestor of one
                top[q] = child
    in_lists = {id(layer) for _, m in lists for layer in m}
    for name, mod in model.named_modules():
        if name in top and id(mod) not in in_lists:
            add(name, mod)
            continue
        if not (name in list_names and isinstance(mod, torch.nn.ModuleList)):
            continue
        for i, layer in enumerate(mod):
            lname = f"{name}.{i}"
            add(lname, layer)
            children = dict(layer.named_children())
            for group in (attention_names, mlp_names):
                for attr in group:
                    if attr in children:
                        add(f"{lname}.{attr}", children[attr])
                        break
    return targets


@dataclass
class _Call:
    """One hooked call: events and where it sits (internal)."""

    name: str
    kind: str
    depth: int
    step: int
    start: Any
    end: Any = None
    input_shapes: Optional[tuple] = None


def _completed(event: Any) -> bool:
    """``event.query()`` (True once the GPU passed it); False for events without ``query``."""
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else False


def _torch_profiler_running() -> bool:
    """Whether a torch (autograd/kineto) profiler is collecting: record_function ranges are only
    opened then (they are only visible to it, and cost a dispatcher call each otherwise)."""
    import torch  # noqa: PLC0415
    running = getattr(torch.autograd, "_profiler_enabled", None)
    return True if running is None else bool(running())


def _shapes(args) -> tuple:
    """Shapes of the tensor positional arguments (others: None)."""
    return tuple(tuple(a.shape) if hasattr(a, "shape") and hasattr(a, "dtype") else None for a in args)


@dataclass
class Attachment:
    """The hooks on one model (returned by :func:`attach`). ``enabled``: when False the hooks do
    nothing (a schedule's wait steps); ``step``: the step number stamped on new calls. Use as a
    context manager, or call :meth:`remove` (idempotent) to take every hook off."""

    targets: list
    event_factory: Callable[[], Any]
    record_function: bool = True
    nvtx: bool = False
    record_shapes: bool = True
    device: int = 0
    enabled: bool = True
    step: int = 0
    calls: list = field(default_factory=list)
    _open: list = field(default_factory=list)     # (call, module, record_function ctx or None, nvtx pushed)
    _handles: list = field(default_factory=list)
    _pool: list = field(default_factory=list)     # events of resolved calls, reused (no creation cost per call)

    # -- hooks ---------------------------------------------------------------------------
    def _event(self):
        """A recorded-later event: one from the pool (events of resolved calls) or a new one."""
        return self._pool.pop() if self._pool else self.event_factory()

    def _pre(self, name, module, args):
        if not self.enabled:
            return None
        start = self._event()
        start.record()
        call = _Call(name, type(module).__name__, len(self._open), self.step, start,
                     input_shapes=_shapes(args) if self.record_shapes else None)
        self.calls.append(call)
        rf = None
        if self.record_function and _torch_profiler_running():
            from torch.autograd.profiler import record_function  # noqa: PLC0415
            rf = record_function(name)
            rf.__enter__()
        if self.nvtx:
            import torch  # noqa: PLC0415
            torch.cuda.nvtx.range_push(name)
        self._open.append((call, module, rf, self.nvtx))
        return None

    def _post(self, module, args, output):
        # the innermost open call of this module (normally the top of the stack)
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][1] is module:
                break
        else:
            return None  # opened while disabled, or before attach
        # close anything opened above it (a hooked child whose post hook never ran), then it
        while len(self._open) > i:
            self._close(self._open.pop())
        return None

    def _close(self, entry) -> None:
        call, _module, rf, nvtx = entry
        if call.end is None:
            end = self._event()
            end.record()
            call.end = end
        if nvtx:
            import torch  # noqa: PLC0415
            torch.cuda.nvtx.range_pop()
        if rf is not None:
            rf.__exit__(None, None, None)

    # -- lifecycle -----------------------------------------------------------------------
    def remove(self) -> None:
        """Close ranges left open (a forward interrupted), then remove every hook. Idempotent."""
        while self._open:
            self._close(self._open.pop())
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def take(self) -> list:
        """The finished calls so far (removed from the attachment); open calls stay."""
        done = [c for c in self.calls if c.end is not None]
        self.calls = [c for c in self.calls if c.end is None]
        return done

    def prewarm(self, n: Optional[int] = None) -> None:
        """Create and record ``n`` events (default: two per hooked module, one forward's worth) into
        the pool now, outside any forward, so the first forward does not pay event creation."""
        for _ in range(2 * len(self.targets) if n is None else int(n)):
            e = checked_event(self.event_factory)
            e.record()
            self._pool.append(e)

    def harvest(self, reference: Any) -> list:
        """Resolve, without waiting, the finished calls whose end event has already completed
        (``event.query()``; events without ``query`` never count as completed) against
        ``reference`` (as :meth:`resolve`), and return their events to the pool. Called between
        steps of a long window, so a window of many forwards reuses events instead of creating
        two per module call. Returns the :class:`ModuleRecord` s (call order among themselves)."""
        if reference is None:
            return []
        done = [c for c in self.calls if c.end is not None and _completed(c.end)]
        if not done:
            return []
        ids = {id(c) for c in done}
        self.calls = [c for c in self.calls if id(c) not in ids]
        return self.resolve(done, reference=reference)

    def resolve(self, calls: Optional[list] = None, reference: Any = None) -> list:
        """Elapsed times of ``calls`` (default: :meth:`take`) as :class:`ModuleRecord` s, in call
        order. Synchronises once, on the latest end event. ``start_us`` is relative to
        ``reference`` (an event of the same factory recorded before the calls, e.g. a profile
        window's start; µs), else to the earliest start event among ``calls``; ``gpu_ms`` =
        start.elapsed_time(end) (ms)."""
        calls = self.take() if calls is None else [c for c in calls if c.end is not None]
        if not calls:
            return []
        sync = getattr(calls[-1].end, "synchronize", None)
        if sync is not None:
            sync()
        ref = calls[0].start if reference is None else reference
        out = []
        for c in calls:
            ms = float(c.start.elapsed_time(c.end))
            off = float(ref.elapsed_time(c.start)) * 1e3
            out.append(ModuleRecord(c.name, c.kind, max(ms, 0.0), max(off, 0.0), c.depth, c.step, self.device,
                                    input_shapes=c.input_shapes))
        self._pool.extend(e for c in calls for e in (c.start, c.end) if e is not reference)
        return out

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class WallClockEvent:
    """A host wall-clock stand-in for ``torch.cuda.Event`` (``record()`` reads
    ``time.perf_counter``; ``elapsed_time(other)`` = other - self in ms): times modules run on
    the CPU, where there is no device timeline."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = None

    def record(self, stream: Any = None) -> None:
        import time  # noqa: PLC0415
        self.t = time.perf_counter()

    def elapsed_time(self, other: "WallClockEvent") -> float:
        if self.t is None or other.t is None:
            raise ArgumentError("elapsed_time: both events must be recorded first")
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None:
        return None


def checked_event(factory: Callable[[], Any]) -> Any:
    """``factory()``, after checking it is an event (callable ``record`` and ``elapsed_time``);
    ArgumentError naming ``event_factory`` otherwise."""
    e = factory()
    if not (callable(getattr(e, "record", None)) and callable(getattr(e, "elapsed_time", None))):
        raise ArgumentError(f"event_factory: expected a callable returning an event (with record() and "
                            f"elapsed_time()), it returned {type(e).__name__} {e!r}")
    return e


def default_event_factory() -> Callable[[], Any]:
    """``torch.cuda.Event(enable_timing=True)`` factory; NoDeviceError without a CUDA GPU."""
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():
        raise NoDeviceError("event_factory: the default CUDA events need a CUDA GPU "
                            "(torch.cuda.is_available() is False); pass event_factory= to time otherwise")
    return lambda: torch.cuda.Event(enable_timing=True)


def attach(model: Any, *, event_factory: Optional[Callable[[], Any]] = None, record_function: bool = True,
           nvtx: Optional[bool] = None, record_shapes: bool = True, include_root: bool = True,
           layer_lists: Sequence[str] = LAYER_LISTS, attention_names: Sequence[str] = ATTENTION_NAMES,
           mlp_names: Sequence[str] = MLP_NAMES, top_level: bool = True) -> Attachment:
    """Hook ``model`` (rule: module docstring) and return the :class:`Attachment`.

    event_factory: see the module docstring (None: CUDA events; NoDeviceError without a GPU);
    record_function: open ``torch.autograd.profiler.record_function`` ranges; nvtx: push NVTX
    ranges (None: when CUDA is available); record_shapes: keep the tensor argument shapes;
    include_root, layer_lists, attention_names, mlp_names, top_level: :func:`find_targets`.
    Raises ArgumentError when ``model`` is not a module, no module matches the rule or
    ``event_factory`` does not return an event (one is made and recorded here to check)."""
    import torch  # noqa: PLC0415
    targets = find_targets(model, include_root, layer_lists, attention_names, mlp_names, top_level)
    if not targets:
        raise ArgumentError(f"model: no module to profile in {type(model).__name__} (include_root=False and no "
                            f"ModuleList named one of {tuple(layer_lists)})")
    factory = default_event_factory() if event_factory is None else event_factory
    if not callable(factory):
        raise ArgumentError(f"event_factory: expected a callable returning an event, got {factory!r}")
    cuda = torch.cuda.is_available()
    att = Attachment(targets, factory, bool(record_function), cuda if nvtx is None else bool(nvtx),
                     bool(record_shapes), torch.cuda.current_device() if cuda else 0)
    att.prewarm(None if event_factory is None else 1)   # checks the factory's events (ArgumentError)
    try:
        for name, mod in targets:
            att._handles.append(mod.register_forward_pre_hook(
                lambda m, args, _n=name: att._pre(_n, m, args)))
            att._handles.append(mod.register_forward_hook(att._post, always_call=True))
    except BaseException:
        att.remove()
        raise
    return att
