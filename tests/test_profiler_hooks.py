"""ferroattn.profiler.hooks on CPU: fake events with synthetic timestamps, a decoder-shaped model."""
from __future__ import annotations

import pytest
import torch

from _profiler_fakes import Layer, make
from ferroattn.errors import ArgumentError
from ferroattn.profiler import attach, find_targets


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


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


def test_times_depths_shapes_and_no_sync_inside_forward():
    clock, model, factory = make(3)
    with attach(model, event_factory=factory) as att:
        model(torch.zeros(2, 5))
        assert clock.synced == 0                       # nothing resolved inside the forward
        recs = att.resolve()
    assert clock.synced == 1
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


def test_module_called_twice_gives_two_calls():
    clock, model, factory = make(1)
    with attach(model, event_factory=factory) as att:
        model(torch.zeros(1))
        model.layers[0].self_attn(torch.zeros(1))   # direct call outside the layer: depth 0
        recs = att.resolve()
    calls = [r for r in recs if r.name == "layers.0.self_attn"]
    assert len(calls) == 2 and [c.depth for c in calls] == [2, 0]
    assert all(c.gpu_ms == pytest.approx(2.0) for c in calls)


def test_hooks_removed_after_exit_and_on_exception():
    clock, model, factory = make(2)
    assert _hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with attach(model, event_factory=factory):
            assert _hook_count(model) == 2 * 8
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_module_raising_inside_forward_closes_its_ranges():
    clock, model, factory = make(2)
    model.layers[1].mlp.fail = True
    att = attach(model, event_factory=factory)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.zeros(1))
    assert att._open == []                       # post hooks ran (always_call) and closed everything
    recs = att.resolve()
    names = [r.name for r in recs]
    assert "layers.1.mlp" in names and "Decoder" in names
    model.layers[1].mlp.fail = False
    model(torch.zeros(1))                        # still consistent afterwards
    assert len(att.resolve()) == 8
    att.remove()
    att.remove()                                 # idempotent
    assert _hook_count(model) == 0


def test_record_function_ranges_show_in_torch_profiler():
    clock, model, factory = make(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        with attach(model, event_factory=factory):
            model(torch.zeros(1))
    names = {e.key for e in tp.key_averages()}
    assert {"Decoder", "layers.0", "layers.0.self_attn", "layers.0.mlp"} <= names


def test_disabled_attachment_records_nothing():
    clock, model, factory = make(1)
    with attach(model, event_factory=factory) as att:
        att.enabled = False
        model(torch.zeros(1))
        assert att.resolve() == []


def test_argument_errors():
    clock, model, factory = make(1)
    with pytest.raises(ArgumentError, match="event_factory"):
        attach(model, event_factory=3)
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


def test_llama_depth1_records_cover_the_whole_forward():
    """Every leaf module advances a fake clock by 1 ms: the root's time is the number of leaves
    called; the depth-1 records (top-level components + layers) must account for all of it."""
    from _profiler_fakes import Clock, FakeEvent
    model = _tiny_llama()
    clock = Clock()
    leaves = [m for m in model.modules() if not list(m.children())]

    def tick(*_):   # a post hook registered before attach's: runs before its end event is recorded
        clock.now += 1.0
    handles = [m.register_forward_hook(tick) for m in leaves]
    try:
        with attach(model, event_factory=lambda: FakeEvent(clock)) as att:
            with torch.inference_mode():
                model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
            recs = att.resolve()
    finally:
        for h in handles:
            h.remove()
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
