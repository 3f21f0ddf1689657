"""ferroattn.profiler sweep / build_model / launch_overhead on CPU (a tiny Llama on the CPU for
real, host wall-clock timing; fake modules for out-of-memory and other failures)."""
from __future__ import annotations

import json

import pytest
import torch

from ferroattn.errors import ArgumentError, FerroattnError, NoDeviceError
from ferroattn.profiler import LaunchOverhead, SweepPoint, SweepResult, build_model, launch_overhead, sweep

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", attn="sdpa", dtype="float32", device="cpu")


class Toy(torch.nn.Module):
    """Fails with an out-of-memory error above ``oom_tokens`` tokens and with a ValueError at ``bad``."""

    def __init__(self, oom_tokens=10**9, bad=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.oom_tokens, self.bad, self.calls = oom_tokens, bad, 0

    def forward(self, ids):
        self.calls += 1
        b, s = ids.shape
        if b * s > self.oom_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        if (b, s) == self.bad:
            raise ValueError("bad shape")
        x = self.lin(torch.ones(b, s, 4))
        return self.layers[0](x)


def test_sweep_of_a_tiny_llama_on_the_cpu(tiny, tmp_path, capsys):
    res = sweep(tiny, [2, 1], [8, 16, 32], repeats=2, warmup=1, progress=True)
    assert "profile sweep" in capsys.readouterr().err                 # the tqdm bar
    assert isinstance(res, SweepResult) and (res.batches, res.seqlens) == ((1, 2), (8, 16, 32))
    assert sorted(res.points) == [(b, s) for b in (1, 2) for s in (8, 16, 32)]
    for (b, s), p in res.points.items():
        assert isinstance(p, SweepPoint) and p.ok and p.error is None and p.latency_ms > 0
        assert p.tokens_per_s == pytest.approx(b * s / (p.latency_ms / 1e3))
        assert p.peak_mem_bytes is None                               # CPU: no device memory figure
        names = {r.name for r in p.records.modules}
        assert {"LlamaForCausalLM", "model.layers.1.self_attn", "lm_head"} <= names
        assert p.records.kernels == []                                # CPU: no launches recorded
    assert res.knee is not None and res.knee.growth is not None       # lines of 3 points
    g = res.grid("tokens_per_s")
    assert g[(2, 32)] == res.points[(2, 32)].tokens_per_s
    with pytest.raises(ArgumentError, match="metric"):
        res.grid("flops")
    text = res.table()
    assert "latency ms" in text and "knee" in text and len(text.splitlines()) == 3 + 6 + 2   # rules+header, rows, rule+knee
    d = json.loads(json.dumps(res.to_dict()))
    assert set(d["points"]) == {f"{b},{s}" for b in (1, 2) for s in (8, 16, 32)}
    assert d["info"]["model"] == "LlamaForCausalLM" and d["info"]["repeats"] == 2
    fig = res.plot_heatmap(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 0 and len(fig.axes) >= 2
    assert res.profiled_point() in res.points


def test_out_of_memory_and_other_errors_are_recorded_and_the_sweep_goes_on(capsys):
    toy = Toy(oom_tokens=64, bad=(1, 16))
    res = sweep(toy, [1, 2, 4], [16, 32], repeats=1, warmup=0, progress=False, vocab_size=10, profile_layers=False)
    assert capsys.readouterr().err == ""                             # progress=False: no bar
    assert res.points[(4, 32)].error == "out of memory" and res.points[(4, 32)].latency_ms is None
    assert res.points[(1, 16)].error == "ValueError: bad shape"
    assert res.points[(2, 32)].ok and res.points[(1, 32)].ok and res.points[(2, 16)].ok
    assert res.errors == {(1, 16): "ValueError: bad shape", (4, 32): "out of memory"}
    assert res.grid()[(4, 32)] is None and "n/a" in res.table() and "out of memory" in res.table()
    assert res.points[(2, 16)].records is None
    assert res.profiled_point() is None                             # nothing profiled


def test_knee_none_when_no_line_has_three_points():
    res = sweep(Toy(), [1, 2], [16, 32], repeats=1, warmup=0, progress=False, vocab_size=10)
    assert res.knee is None and "not enough points" in res.table()
    assert res.profiled_point() == (2, 32)                          # the largest point that ran


def test_all_failed_sweep_cannot_plot():
    res = sweep(Toy(oom_tokens=0), [1], [8, 16], repeats=1, warmup=0, progress=False, vocab_size=10)
    assert res.knee is None and set(res.errors.values()) == {"out of memory"}
    with pytest.raises(FerroattnError, match="no point"):
        res.plot_heatmap()


def test_token_ids_are_seeded():
    seen = []

    class Spy(Toy):
        def forward(self, ids):
            seen.append(ids.clone())
            return super().forward(ids)
    sweep(Spy(), [2], [8], repeats=1, warmup=0, progress=False, vocab_size=50, seed=3, profile_layers=False)
    sweep(Spy(), [2], [8], repeats=1, warmup=0, progress=False, vocab_size=50, seed=3, profile_layers=False)
    assert torch.equal(seen[0], seen[-1]) and seen[0].shape == (2, 8) and int(seen[0].max()) < 50


@pytest.mark.parametrize("kw, name", [
    (dict(batches=[]), "batches"), (dict(batches=[1, 1]), "batches"), (dict(seqlens=[0]), "seqlens"),
    (dict(seqlens=[8.0]), "seqlens"), (dict(repeats=0), "repeats"), (dict(warmup=-1), "warmup"),
    (dict(vocab_size=None), "vocab_size"), (dict(vocab_size=0), "vocab_size"), (dict(seed="x"), "seed"),
    (dict(profile_layers="no"), "profile_layers"), (dict(progress=1), "progress"),
    (dict(profile_options={"bogus": 1}), "bogus"), (dict(profile_options={"record_shapes": "x"}), "record_shapes"),
])
def test_sweep_argument_errors(kw, name):
    args = dict(batches=[1], seqlens=[8], repeats=1, warmup=0, progress=False, vocab_size=10)
    args.update(kw)
    with pytest.raises(ArgumentError, match=f"^{name}:"):
        sweep(Toy(), args.pop("batches"), args.pop("seqlens"), **args)
    with pytest.raises(ArgumentError, match="^model:"):
        sweep(3, [1], [8])


# ---- build_model -----------------------------------------------------------------------------

def test_build_model_from_a_config_json(tmp_path):
    from ferroattn.demo import TINY
    cfg = {**TINY, "model_type": "llama", "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = build_model(str(tmp_path), attn="sdpa", dtype="float32", device="cpu", seed=1)
    b = build_model(str(tmp_path / "config.json"), attn="sdpa", dtype="float32", device="cpu", seed=1)
    c = build_model(str(tmp_path), attn="sdpa", dtype="float32", device="cpu", seed=2)
    assert type(a).__name__ == "LlamaForCausalLM" and len(a.model.layers) == 1 and not a.training
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config._attn_implementation == "sdpa"
    t = build_model("tiny", attn="sdpa", dtype="bfloat16", device="cpu")
    assert next(t.parameters()).dtype == torch.bfloat16 and len(t.model.layers) == 2


def test_build_model_argument_errors(tmp_path):
    with pytest.raises(ArgumentError, match="^model:.*config name"):
        build_model("gpt-17", device="cpu")
    with pytest.raises(ArgumentError, match="^model:.*config.json"):
        build_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ArgumentError, match="model_type"):
        build_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ArgumentError, match="JSON"):
        build_model(str(tmp_path), device="cpu")
    with pytest.raises(ArgumentError, match="^attn:"):
        build_model("tiny", attn="flash", device="cpu")
    with pytest.raises(ArgumentError, match="^dtype:"):
        build_model("tiny", dtype="int8", device="cpu")
    with pytest.raises(ArgumentError, match="^device:"):
        build_model("tiny", device="tpu")
    with pytest.raises(ArgumentError, match="^model:"):
        build_model(3)
    if not torch.cuda.is_available():
        with pytest.raises(NoDeviceError, match="device"):
            build_model("tiny")


# ---- launch_overhead -------------------------------------------------------------------------

def test_launch_overhead_arguments_and_no_gpu():
    with pytest.raises(ArgumentError, match="^fn:"):
        launch_overhead(3)
    with pytest.raises(ArgumentError, match="^repeats:"):
        launch_overhead(lambda: None, repeats=0)
    with pytest.raises(ArgumentError, match="^warmup:"):
        launch_overhead(lambda: None, warmup=True)
    if not torch.cuda.is_available():
        with pytest.raises(NoDeviceError):
            launch_overhead(lambda: None)
    lo = LaunchOverhead(2.0, 0.5, 1.5, 75.0, 20)
    assert "75.0% of eager" in str(lo)


# ---- review fixes -----------------------------------------------------------------------------

def test_batches_and_seqlens_sharing_a_value_keep_the_sweep_and_find_the_knee():
    res = sweep(Toy(), [1, 2, 8], [2, 8, 32], repeats=1, warmup=0, progress=False, vocab_size=10,
                profile_layers=False)
    assert len(res.points) == 9 and all(p.ok for p in res.points.values())
    assert res.knee is not None and res.knee.growth is not None and res.knee_error is None


def test_a_failing_knee_analysis_keeps_the_measured_points(monkeypatch, tmp_path):
    import sys
    sweep_mod = sys.modules["ferroattn.profiler.sweep"]   # the package's "sweep" is the function

    def broken(lat):
        raise ZeroDivisionError("analysis bug")
    monkeypatch.setattr(sweep_mod, "detect_knee", broken)
    res = sweep(Toy(), [1, 2], [8, 16, 32], repeats=1, warmup=0, progress=False, vocab_size=10,
                profile_layers=False)
    assert len(res.points) == 6 and all(p.ok for p in res.points.values())
    assert res.knee is None and res.knee_error == "ZeroDivisionError: analysis bug"
    assert "knee: not computed, the analysis failed (ZeroDivisionError: analysis bug)" in res.table()
    assert res.to_dict()["knee_error"] == "ZeroDivisionError: analysis bug"
    pytest.importorskip("matplotlib")
    res.plot_heatmap(tmp_path / "h.png")                              # still plottable, without a knee


@pytest.mark.parametrize("seed", [2**70, 2**63, -1, True, 1.0])
def test_seed_range_checked_up_front(seed):
    toy = Toy()
    with pytest.raises(ArgumentError, match=r"^seed: expected an int in \[0, 9223372036854775807\]"):
        sweep(toy, [1], [8], repeats=1, warmup=0, progress=False, vocab_size=10, seed=seed)
    assert toy.calls == 0
    np = pytest.importorskip("numpy")
    res = sweep(toy, [np.int64(1)], [8], repeats=1, warmup=0, progress=False, vocab_size=np.int32(10),
                seed=np.int64(2**63 - 1), profile_layers=False)
    assert list(res.points) == [(1, 8)] and type(res.batches[0]) is int


def test_plot_heatmap_to_a_directory_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    res = sweep(Toy(), [1], [8, 16], repeats=1, warmup=0, progress=False, vocab_size=10, profile_layers=False)
    with pytest.raises(ArgumentError, match="^path: .*is a directory"):
        res.plot_heatmap(tmp_path)
    with pytest.raises(ArgumentError, match="^path: .*no suffix"):
        res.plot_heatmap(tmp_path / "h")
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / (tmp_path.name + ".png")).exists()


def test_build_model_checks_the_name_before_the_device(tmp_path):
    for bad in ("nope", ""):
        with pytest.raises(ArgumentError, match="^model: expected a config name"):
            build_model(bad)                                          # default device "cuda", any machine
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ArgumentError, match="^model: expected a config.json, cannot read .* as JSON"):
        build_model(str(tmp_path / "passwd"))


def test_build_model_unknown_model_type_is_an_argument_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch", "hidden_size": 8}))
    with pytest.raises(ArgumentError, match="^model: transformers cannot build a config of model_type "
                                            "'no-such-arch'") as ei:
        build_model(str(tmp_path), device="cpu")
    assert "\n" not in str(ei.value) and len(str(ei.value)) < 400     # not transformers' list of every type
    (tmp_path / "config.json").write_text(json.dumps({"model_type": 5}))
    with pytest.raises(ArgumentError, match="^model: expected a str \"model_type\""):
        build_model(str(tmp_path), device="cpu")


# ---- model_forward: the capturable form of a transformers forward ---------------------------------

class _HostSyncs:
    """Counts reads of tensor values on the host (bool(t), t.item(), t.tolist(), int(t),
    float(t)): on CUDA each is a host sync (aten::_local_scalar_dense / a copy), what fails inside
    CUDA-graph capture. (A TorchDispatchMode does not see them under inference_mode.)"""

    METHODS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.n, self._mp, self.active = 0, monkeypatch, False

    def __enter__(self):
        self.active = True
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                self.n += self.active
                return _real(t, *a, **k)
            self._mp.setattr(torch.Tensor, name, counted)   # undone by monkeypatch at the test's end
        return self

    def __exit__(self, *exc):
        self.active = False


def _ferroattn_llama_on_cpu(monkeypatch):
    """The tiny Llama with attn "ferroattn" on the CPU: our integration's code path, with the
    kernel call (flash_attn_func) replaced by SDPA (our kernels need a GPU)."""
    import ferroattn.integrations.transformers as fa_hf
    monkeypatch.setattr(fa_hf, "flash_attn_func", lambda q, k, v, causal=True, softmax_scale=None, **_: (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1),
            v.transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1), is_causal=causal,
            scale=softmax_scale).transpose(1, 2)))
    return build_model("tiny", attn="ferroattn", dtype="float32", device="cpu")


def _capturing(monkeypatch, on):
    """Make transformers see a capturing CUDA stream (as during torch.cuda.graph capture)."""
    import transformers.utils.import_utils as iu
    monkeypatch.setattr(iu, "is_cuda_stream_capturing", lambda: on)


@pytest.mark.parametrize("batch", [1, 2])
def test_model_forward_has_no_host_sync_after_warmup_and_a_plain_forward_has(monkeypatch, batch):
    pytest.importorskip("transformers")
    from ferroattn.profiler import model_forward
    model = _ferroattn_llama_on_cpu(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(0))
    fwd = model_forward(model, ids)
    fwd()                                                  # warm-up (eager): may sync, remembers the answers
    _capturing(monkeypatch, True)
    with _HostSyncs(monkeypatch) as pinned:
        out = fwd()
    assert pinned.n == 0, "the captured call would sync"
    with _HostSyncs(monkeypatch) as plain, torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False)        # a new position_ids each call: our packed check syncs
    assert plain.n == (1 if batch == 1 else 0)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert fwd.position_ids.shape == (batch, 16) and fwd.position_ids[0].tolist() == list(range(16))


def test_model_forward_arguments():
    from ferroattn.profiler import model_forward
    with pytest.raises(ArgumentError, match="^model:"):
        model_forward(3, torch.zeros(1, 4, dtype=torch.long))
    for bad in (torch.zeros(4, dtype=torch.long), torch.zeros(1, 4), [[1, 2]]):
        with pytest.raises(ArgumentError, match="^input_ids:"):
            model_forward(torch.nn.Identity(), bad)
    with pytest.raises(ArgumentError, match="^kwargs: position_ids"):
        model_forward(torch.nn.Identity(), torch.zeros(1, 4, dtype=torch.long), position_ids=None)
