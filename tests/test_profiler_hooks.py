"""ferroattn.profiler.hooks on CPU: fake events / fake native marks with synthetic timestamps, a
decoder-shaped model; both modes ("wrap": forward wrappers, "torch": torch forward hooks)."""
from __future__ import annotations

import inspect

import pytest
import torch

from _profiler_fakes import FakeNative, Layer, make
from ferroattn.errors import ArgumentError
from ferroattn.profiler import attach, find_targets


def _hook_count(model):
    """torch hooks plus instance-level forward wrappers on the model's modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__)
               for m in model.modules())


def _native_forward_built() -> bool:
    try:
        from ferroattn import _native
    except Exception:
        return False
    return hasattr(_native, "ProfilerForward")


#: whether the extension has the native per-call path (_native.ProfilerForward): "nwrap" variants
NWRAP = _native_forward_built()
#: hook modes: "wrap" (the Python wrapper), "torch" (torch hooks), "nwrap" (wrap mode, native wrapper)
MODES = ["wrap", "torch"] + (["nwrap"] if NWRAP else [])
#: wrap-mode wrappers: the Python one, the native one
WRAPS = ["wrap"] + (["nwrap"] if NWRAP else [])


def _mk(mode):
    """attach keyword arguments of a hook mode of MODES."""
    return {"mode": "torch"} if mode == "torch" else {"mode": "wrap", "native_wrap": mode == "nwrap"}


#: (mode, timestamps): torch events (fake) or native marks (fake _native)
VARIANTS = [(m, source) for source in ("events", "native") for m in MODES]


def _setup(n, variant):
    """(clock, model, attach kwargs, waits()) for a variant; waits() counts host waits (event
    synchronize or native resolve calls)."""
    mode, source = variant
    clock, model, factory = make(n)
    kw = {"event_factory": factory, **_mk(mode)}
    native = None
    if source == "native":
        native = FakeNative(clock)
        kw["native"] = native
    return clock, model, kw, (lambda: clock.synced + (native.resolves if native else 0)), native


def test_targets_follow_the_rule():
    _, model, _ = make(2)
    names = [n for n, _ in find_targets(model)]
    assert names == ["Decoder", "embed", "layers.0", "layers.0.self_attn", "layers.0.mlp",
                     "layers.1", "layers.1.self_attn", "layers.1.mlp"]
    assert "layers.0.norm" not in names and "layers" not in names
    assert [n for n, _ in find_targets(model, include_root=False)][:2] == ["embed", "layers.0"]
    assert "embed" not in [n for n, _ in find_targets(model, top_level=False)]
    with pytest.raises(ArgumentError, match="model"):
        find_targets(object())
    for arg in ("layer_lists", "attention_names", "mlp_names"):
        for bad in ("layers", None, [1]):
            with pytest.raises(ArgumentError, match=f"^{arg}: expected a list, tuple or set of attribute names"):
                find_targets(model, **{arg: bad})
    assert [n for n, _ in find_targets(model, layer_lists=("layers",))] == names


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_times_depths_shapes_and_no_sync_inside_forward(variant):
    clock, model, kw, waits, native = _setup(3, variant)
    with attach(model, **kw) as att:
        model(torch.zeros(2, 5))
        assert waits() == 0                            # nothing resolved inside the forward
        recs = att.resolve()
    assert waits() == 1
    if native is not None:
        assert native.marks == {}, "resolved marks are forgotten (events back to the pool)"
    by = {r.name: r for r in recs}
    assert by["Decoder"].gpu_ms == pytest.approx(1 + 3 * 3.5 + 2 + 3 + 4)
    assert by["Decoder"].depth == 0 and by["layers.1"].depth == 1 and by["layers.1.self_attn"].depth == 2
    assert by["layers.2"].gpu_ms == pytest.approx(0.5 + 4.0 + 3.0)
    assert by["layers.2.self_attn"].gpu_ms == pytest.approx(4.0)
    assert by["layers.0.mlp"].gpu_ms == pytest.approx(3.0)
    assert by["layers.0"].start_us == pytest.approx(1000.0)          # after the 1 ms embedding
    assert by["layers.0.self_attn"].start_us == pytest.approx(1500.0)
    assert by["layers.0"].input_shapes == ((2, 5),)
    assert by["layers.0"].kind == "Layer"


def test_percentages_through_key_averages():
    from ferroattn.profiler import Records
    clock, model, factory = make(3)
    with attach(model, event_factory=factory) as att:
        model(torch.zeros(1))
        ka = Records(att.resolve()).key_averages("module")
    total = 1 + 3 * 3.5 + 2 + 3 + 4
    row = {r.key: r for r in ka}["layers.2"]
    assert ka.total_gpu_ms == pytest.approx(total)
    assert row.pct_of_total == pytest.approx(100 * 7.5 / total)
    assert ka.top(1)[0].key == "Decoder" and ka.top(2)[1].key == "layers.2"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_module_called_twice_gives_two_calls(variant):
    clock, model, kw, _, _ = _setup(1, variant)
    with attach(model, **kw) as att:
        model(torch.zeros(1))
        model.layers[0].self_attn(torch.zeros(1))   # direct call outside the layer: depth 0
        recs = att.resolve()
    calls = [r for r in recs if r.name == "layers.0.self_attn"]
    assert len(calls) == 2 and [c.depth for c in calls] == [2, 0]
    assert all(c.gpu_ms == pytest.approx(2.0) for c in calls)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_hooks_removed_after_exit_and_on_exception(variant):
    clock, model, kw, _, _ = _setup(2, variant)
    assert _hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with attach(model, **kw):
            assert _hook_count(model) == (2 if variant[0] == "torch" else 1) * 8
            if variant[0] != "torch":
                assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_module_raising_inside_forward_closes_its_ranges(variant):
    clock, model, kw, _, _ = _setup(2, variant)
    model.layers[1].mlp.fail = True
    att = attach(model, **kw)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.zeros(1))
    assert att._open == []                       # post hooks (always_call) / finally closed everything
    recs = att.resolve()
    names = [r.name for r in recs]
    assert "layers.1.mlp" in names and "Decoder" in names
    model.layers[1].mlp.fail = False
    model(torch.zeros(1))                        # still consistent afterwards
    assert len(att.resolve()) == 8
    att.remove()
    att.remove()                                 # idempotent
    assert _hook_count(model) == 0


@pytest.mark.parametrize("mode", MODES)
def test_record_function_ranges_show_in_torch_profiler(mode):
    clock, model, factory = make(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        with attach(model, event_factory=factory, **_mk(mode)):
            model(torch.zeros(1))
    names = {e.key for e in tp.key_averages()}
    assert {"Decoder", "layers.0", "layers.0.self_attn", "layers.0.mlp"} <= names


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_disabled_attachment_records_nothing(variant):
    clock, model, kw, _, native = _setup(1, variant)
    with attach(model, **kw) as att:
        att.enabled = False
        model(torch.zeros(1))
        assert att.resolve() == []
        if native is not None:
            assert native.marks == {}, "prewarm marks released, none recorded while disabled"
        att.enabled = True
        model(torch.zeros(1))
        assert len(att.resolve()) == len(att.targets)


def test_argument_errors():
    clock, model, factory = make(1)
    with pytest.raises(ArgumentError, match="event_factory"):
        attach(model, event_factory=3)
    with pytest.raises(ArgumentError, match="mode"):
        attach(model, event_factory=factory, mode="hooks")
    with pytest.raises(ArgumentError, match="native"):
        attach(model, event_factory=factory, native=object())
    with pytest.raises(ArgumentError, match="model"):
        attach(torch.nn.Linear(2, 2), event_factory=factory, include_root=False)
    assert _hook_count(model) == 0
    if not torch.cuda.is_available():
        from ferroattn.errors import NoDeviceError
        with pytest.raises(NoDeviceError, match="event_factory"):
            attach(model)
    assert isinstance(Layer(clock, 1, 1), torch.nn.Module)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    from ferroattn.demo import TINY
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


def test_llama_top_level_components_are_hooked():
    model = _tiny_llama()
    names = [n for n, _ in find_targets(model)]
    assert names == ["LlamaForCausalLM", "model.embed_tokens",
                     "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp",
                     "model.layers.1", "model.layers.1.self_attn", "model.layers.1.mlp",
                     "model.norm", "model.rotary_emb", "lm_head"]
    assert "model" not in names and "model.layers" not in names      # ancestors of / the layer list
    assert [n for n, _ in find_targets(model, top_level=False)][1] == "model.layers.0"


@pytest.mark.parametrize("mode", MODES)
def test_llama_depth1_records_cover_the_whole_forward(mode):
    """Every leaf module advances a fake clock by 1 ms: the root's time is the number of leaves
    called; the depth-1 records (top-level components + layers) must account for all of it.
    torch mode: the tick is a post hook registered before attach's (it runs before the end mark);
    wrap mode: the tick is an instance-level forward wrapper already on the leaf (as accelerate
    installs), which ours must chain (so the tick runs inside the interval) and restore."""
    from _profiler_fakes import Clock, FakeEvent
    model = _tiny_llama()
    clock = Clock()
    leaves = [m for m in model.modules() if not list(m.children())]

    def tick(*_):
        clock.now += 1.0
    handles, originals = [], {}
    for m in leaves:
        if mode == "torch":
            handles.append(m.register_forward_hook(tick))
        else:
            def ticking(*a, _f=m.forward, **k):
                out = _f(*a, **k)
                tick()
                return out
            m.forward = ticking
            originals[m] = ticking
    try:
        with attach(model, event_factory=lambda: FakeEvent(clock), **_mk(mode)) as att:
            with torch.inference_mode():
                model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
            recs = att.resolve()
        assert all(m.__dict__["forward"] is f for m, f in originals.items()), "instance forwards restored"
    finally:
        for h in handles:
            h.remove()
        for m in originals:
            del m.forward
    root = [r for r in recs if r.depth == 0]
    depth1 = {r.name: r.gpu_ms for r in recs if r.depth == 1}
    assert len(root) == 1 and root[0].gpu_ms == clock.now > 0
    assert sum(depth1.values()) == pytest.approx(root[0].gpu_ms)
    assert set(depth1) == {"model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                           "model.rotary_emb", "lm_head"}
    assert depth1["lm_head"] == 1.0 and depth1["model.embed_tokens"] == 1.0


def _counting(factory):
    """(event factory that keeps every event it makes, that list)"""
    made = []

    def counting():
        e = factory()
        made.append(e)
        return e
    return counting, made


def test_resolved_events_are_reused_and_times_stay_right():
    clock, model, factory = make(3)
    counting, made = _counting(factory)
    with attach(model, event_factory=counting) as att:
        model(torch.zeros(1))
        first = att.resolve()
        n_first = len(made)
        assert n_first == 2 * len(first)           # one start + one end event per call
        model(torch.zeros(1))
        second = att.resolve()
    assert len(made) == n_first                    # the second forward recorded with pooled events only
    assert [r.name for r in second] == [r.name for r in first]
    assert [r.gpu_ms for r in second] == pytest.approx([r.gpu_ms for r in first])


def test_record_function_ranges_only_while_a_torch_profiler_collects(monkeypatch):
    import torch.autograd.profiler as ap

    opened = []
    real = ap.record_function

    class Spy(real):
        def __enter__(self):
            opened.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(ap, "record_function", Spy)
    clock, model, factory = make(2)
    with attach(model, event_factory=factory, nvtx=False) as att:
        model(torch.zeros(1))                        # no torch profiler running: no ranges
        assert opened == []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            model(torch.zeros(1))
        att.resolve()
    assert "layers.1.self_attn" in opened and "Decoder" in opened


def test_prewarm_fills_the_pool_with_recorded_events():
    clock, model, factory = make(2)
    counting, made = _counting(factory)
    with attach(model, event_factory=counting) as att:
        assert len(made) == 1                          # attach checks one event of the factory
        att.prewarm()
        n = len(made)
        assert n == 1 + 2 * len(att.targets) and all(e.t is not None for e in made)
        model(torch.zeros(1))
        assert len(made) == n                          # the forward used only pre-created events
        recs = att.resolve()
    assert len(recs) == len(att.targets) and all(r.gpu_ms >= 0 for r in recs)


# ---- wrap mode: forward wrappers --------------------------------------------------------------

@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_keeps_the_signature_and_restores_the_class_forward(nw):
    clock, model, factory = make(1)
    layer = model.layers[0]
    before = inspect.signature(layer.forward)
    with attach(model, event_factory=factory, **_mk(nw)):
        assert "forward" in layer.__dict__
        assert inspect.signature(layer.forward) == before
        assert layer.forward.__wrapped__ == Layer.forward.__get__(layer)
        assert layer.forward.__name__ == "forward"
    assert "forward" not in layer.__dict__ and layer.forward.__func__ is Layer.forward


@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_chains_and_restores_an_existing_instance_forward(nw):
    """An instance-level forward already there (accelerate's hooks do this) is called by our
    wrapper and put back afterwards, also when the forward raised."""
    clock, model, factory = make(1)
    mlp = model.layers[0].mlp
    seen = []

    def theirs(x, _orig=mlp.forward):
        seen.append("theirs")
        return _orig(x)
    mlp.forward = theirs
    with pytest.raises(RuntimeError, match="boom"):
        with attach(model, event_factory=factory, **_mk(nw)) as att:
            model(torch.zeros(1))
            recs = att.resolve()
            raise RuntimeError("boom")
    assert seen == ["theirs"] and mlp.__dict__["forward"] is theirs
    assert {r.name: r.gpu_ms for r in recs}["layers.0.mlp"] == pytest.approx(3.0)


@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_leaves_a_wrapper_installed_over_ours_and_turns_pass_through(nw):
    clock, model, factory = make(1)
    attn = model.layers[0].self_attn
    att = attach(model, event_factory=factory, **_mk(nw))
    ours = attn.__dict__["forward"]

    def later(x, _inner=ours):
        return _inner(x)
    attn.forward = later                   # installed after us: must survive our removal
    att.remove()
    assert attn.__dict__["forward"] is later
    model(torch.zeros(1))                  # ours is a pass-through now: nothing recorded
    assert att.calls == []
    del attn.forward


@pytest.mark.parametrize("order", ["inner_first", "outer_first"])
@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_nested_attachments_leave_the_model_clean_in_any_order(order, nw):
    clock, model, factory = make(2)
    a = attach(model, event_factory=factory, **_mk(nw))
    b = attach(model, event_factory=factory, **_mk(nw))
    model(torch.zeros(1))
    ra, rb = a.resolve(), b.resolve()
    assert [r.name for r in ra] == [r.name for r in rb] and len(ra) == len(a.targets)
    assert [r.gpu_ms for r in ra] == pytest.approx([r.gpu_ms for r in rb])
    for x in ((a, b) if order == "inner_first" else (b, a)):
        x.remove()
    assert _hook_count(model) == 0


@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_bypasses_torch_hook_dispatch(nw):
    """With wrap mode the hooked modules carry no torch hooks, so Module.__call__ keeps its fast
    path (no _call_impl hook handling)."""
    clock, model, factory = make(2)
    with attach(model, event_factory=factory, **_mk(nw)) as att:
        assert all(not m._forward_hooks and not m._forward_pre_hooks for _, m in att.targets)
        assert all(m.__dict__.get("forward") is not None for _, m in att.targets)


# ---- native marks --------------------------------------------------------------------------------

def test_native_marks_are_relative_to_the_reference_event_and_pooled():
    from _profiler_fakes import FakeEvent
    clock, model, factory = make(2)
    native = FakeNative(clock)
    with attach(model, event_factory=factory, native=native) as att:
        assert native.marks == {} and native.next_mark == 2 * len(att.targets), "prewarm: recorded and released"
        clock.now = 10.0
        ref = FakeEvent(clock)
        ref.record()
        clock.now = 12.0
        model(torch.zeros(1))
        assert len(native.marks) == 2 * len(att.targets)
        assert {s for s, _ in native.mark_streams} == {0}, "the current raw stream (0 without CUDA)"
        recs = att.resolve(reference=ref)
    assert native.marks == {}
    by = {r.name: r for r in recs}
    assert by["Decoder"].start_us == pytest.approx(2000.0)
    assert by["layers.0"].start_us == pytest.approx(3000.0)
    assert by["layers.1.self_attn"].gpu_ms == pytest.approx(3.0)


def test_native_marks_not_recorded_under_capture_give_no_record():
    clock, model, factory = make(1)
    native = FakeNative(clock)
    with attach(model, event_factory=factory, native=native) as att:
        native.capturing = True
        model(torch.zeros(1))
        native.capturing = False
        assert att.resolve() == [] and native.marks == {}
        model(torch.zeros(1))
        assert len(att.resolve()) == len(att.targets)


def test_native_harvest_waits_for_nothing_and_discard_releases():
    from _profiler_fakes import FakeEvent
    clock, model, factory = make(1)
    native = FakeNative(clock)
    ref = FakeEvent(clock)
    ref.record()
    with attach(model, event_factory=factory, native=native) as att:
        model(torch.zeros(1))
        native.done = False                       # the GPU has not passed the marks yet
        assert att.harvest(ref) == [] and native.resolves == 0
        native.done = True
        assert len(att.harvest(ref)) == len(att.targets) and native.marks == {}
        model(torch.zeros(1))
        assert att.discard() == len(att.targets)
        assert native.marks == {} and att.calls == []


# ---- NVTX only under a tool; the inlined wrapper path -------------------------------------------

def test_nvtx_tool_detection_follows_the_injection_variable(monkeypatch):
    from ferroattn.profiler.hooks import NVTX_INJECTION_VAR, nvtx_tool_attached
    assert NVTX_INJECTION_VAR == "NVTX_INJECTION64_PATH"
    monkeypatch.delenv(NVTX_INJECTION_VAR, raising=False)
    assert nvtx_tool_attached() is False
    monkeypatch.setenv(NVTX_INJECTION_VAR, "")
    assert nvtx_tool_attached() is False, "an empty path loads nothing"
    monkeypatch.setenv(NVTX_INJECTION_VAR, "/opt/nsight/libToolsInjection64.so")
    assert nvtx_tool_attached() is True


@pytest.mark.parametrize("mode", MODES)
def test_nvtx_ranges_pushed_and_popped_per_call_when_on(mode, monkeypatch):
    pushed, popped = [], []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: popped.append(1))
    clock, model, factory = make(2)
    with attach(model, event_factory=factory, nvtx=True, **_mk(mode)) as att:
        model(torch.zeros(1))
        att.resolve()
    assert pushed == [n for n, _ in att.targets] and len(popped) == len(pushed)
    pushed.clear()
    with attach(model, event_factory=factory, **_mk(mode)) as att:   # nvtx=None: no CUDA here -> off
        model(torch.zeros(1))
        att.resolve()
    assert pushed == [] and att.nvtx is (torch.cuda.is_available() and bool(__import__("os").environ.get(
        "NVTX_INJECTION64_PATH")))


@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_path_records_in_order_and_survives_take_between_forwards(nw):
    """The inlined wrapper appends to the attachment's call log in place: take()/harvest() between
    forwards must not detach the log from the wrappers."""
    clock, model, factory = make(2)
    native = FakeNative(clock)
    with attach(model, event_factory=factory, native=native, **_mk(nw)) as att:
        for _ in range(3):
            model(torch.zeros(1, 3))
            recs = att.resolve()                 # take() inside
            assert [r.name for r in recs] == [n for n, _ in att.targets]
            assert [r.depth for r in recs] == [0, 1, 1, 2, 2, 1, 2, 2]
            assert recs[2].input_shapes == ((1, 3),)
        assert att.calls == [] and native.marks == {}


@pytest.mark.parametrize("nw", WRAPS)
def test_wrap_closes_calls_a_raising_child_left_open(nw):
    """A call whose entry is no longer the top of the open-call stack (something above it left
    open) closes everything above it too (the slow path of the inlined wrapper)."""
    clock, model, factory = make(1)
    with attach(model, event_factory=factory, **_mk(nw)) as att:
        inner = model.layers[0].self_attn.__dict__["forward"]
        dangling = [["x", "X", 9, 0, att._mark(), None, None, None, None]]

        def leaves_one_open(*a, **k):
            att._open.append(dangling[0])      # an entry opened and never closed by its owner
            return inner(*a, **k)
        model.layers[0].self_attn.__dict__["forward"] = leaves_one_open
        try:
            model(torch.zeros(1))
        finally:
            model.layers[0].self_attn.__dict__["forward"] = inner
        assert att._open == [] and dangling[0][5] is not None, "closed by the layer's exit"
        recs = att.resolve()
    assert len(recs) == len(att.targets)


# ---- the native per-call path (_native.ProfilerForward) -----------------------------------------

@pytest.mark.skipif(not NWRAP, reason="the extension lacks ProfilerForward")
def test_native_wrapper_gives_the_python_wrappers_records_and_is_collectable():
    import gc
    import weakref
    recs = {}
    for nw in ("wrap", "nwrap"):
        clock, model, factory = make(2)
        native = FakeNative(clock)
        with attach(model, event_factory=factory, native=native, **_mk(nw)) as att:
            assert (att._native_forward is not None) is (nw == "nwrap")
            assert type(model.layers[0].__dict__["forward"]).__name__ == ("ProfilerForward" if nw == "nwrap"
                                                                          else "function")
            att.step = 3
            model(torch.zeros(2, 3))
            recs[nw] = [(r.name, r.kind, r.depth, r.step, r.gpu_ms, r.start_us, r.input_shapes) for r in att.resolve()]
            assert native.mark_streams and native.marks == {}
    assert recs["wrap"] == recs["nwrap"] and len(recs["wrap"]) == 8
    # a model left attached (never removed) is still garbage once unreferenced: the wrapper takes part
    # in cyclic GC (module -> wrapper -> module)
    clock, model, factory = make(1)
    attach(model, event_factory=factory, native_wrap=True)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not NWRAP, reason="the extension lacks ProfilerForward")
def test_native_wrapper_rejects_unknown_and_mistyped_fields():
    clock, model, factory = make(1)
    with attach(model, event_factory=factory, native_wrap=True) as att:
        fields = dict(inner=lambda *a: None, att=att, name="m", kind="M", module=model, stack=[], calls=[],
                      kill=[False], close=att._exit, raw_stream=None, device=0, mark=att._mark, probe=None,
                      open_rf=lambda *a: None, push=None, pop=None, tensor=torch.Tensor, shapes=False)
        cls = type(model.layers[0].__dict__["forward"])
        assert cls(**fields) is not None
        with pytest.raises(TypeError, match='unexpected field "extra"'):
            cls(**fields, extra=1)
        with pytest.raises(KeyError, match="inner"):
            cls(**{k: v for k, v in fields.items() if k != "inner"})
        for name, bad in [("inner", 3), ("close", "x"), ("open_rf", None), ("mark", 1.5), ("push", 0)]:
            with pytest.raises(TypeError, match=f"{name}: expected a callable"):
                cls(**{**fields, name: bad})
        with pytest.raises(TypeError, match="raw_stream: expected a callable"):
            cls(**{**fields, "mark": None})          # native marks read raw_stream
        with pytest.raises(TypeError, match="tensor: expected a type"):
            cls(**{**fields, "tensor": torch.zeros(1)})
        with pytest.raises(TypeError, match="stack"):
            cls(**{**fields, "stack": ()})


@pytest.mark.skipif(not NWRAP, reason="the extension lacks ProfilerForward")
def test_native_wrapper_survives_a_collection_while_it_is_allocated():
    """A gen-0 collection on every allocation: the GC then traverses each ProfilerForward while
    its instance dict is being made, before it holds its fields (it must report nothing then)."""
    import gc
    clock, model, factory = make(2)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(3):
            with attach(model, event_factory=factory, native_wrap=True) as att:
                model(torch.zeros(2, 3))
                assert len(att.resolve()) == 8
    finally:
        gc.set_threshold(*old)
    gc.collect()


@pytest.mark.parametrize("nw", WRAPS)
def test_a_model_copied_while_attached_shares_the_wrapper(nw):
    """copy.deepcopy of an attached model works with either wrapper (a Python function is atomic
    to deepcopy; the native wrapper copies as itself)."""
    import copy
    clock, model, factory = make(1)
    with attach(model, event_factory=factory, **_mk(nw)):
        twin = copy.deepcopy(model)
        assert twin.layers[0].__dict__["forward"] is model.layers[0].__dict__["forward"]
        assert copy.copy(model.layers[0].__dict__["forward"]) is model.layers[0].__dict__["forward"]


@pytest.mark.skipif(not NWRAP, reason="the extension lacks ProfilerForward")
def test_native_wrapper_passes_arguments_results_and_errors_through():
    class M(torch.nn.Module):
        def forward(self, x, *rest, scale=1.0, **kw):
            if kw.get("fail"):
                raise KeyError("fail")
            return x * scale, rest, kw

    clock, _, factory = make(1)
    m = M()
    with attach(m, event_factory=factory, native_wrap=True) as att:
        y, rest, kw = m(torch.ones(2), 5, None, scale=2.0, extra="e")
        assert torch.equal(y, torch.full((2,), 2.0)) and rest == (5, None) and kw == {"extra": "e"}
        with pytest.raises(KeyError, match="fail"):
            m(torch.ones(1), fail=True)
        assert att._open == []
        recs = att.resolve()
        assert [r.input_shapes for r in recs] == [((2,), None, None), ((1,),)]
        att.enabled = False
        m(torch.ones(1))
        assert att.calls == []
    assert "forward" not in m.__dict__


def test_native_wrap_true_without_the_class_is_an_argument_error(monkeypatch):
    from ferroattn.profiler import hooks
    monkeypatch.setattr(hooks, "_native_forward_class", lambda: None)
    clock, model, factory = make(1)
    with pytest.raises(ArgumentError, match="native_wrap"):
        attach(model, event_factory=factory, native_wrap=True)
    with attach(model, event_factory=factory) as att:      # auto: the Python wrapper
        assert att._native_forward is None
