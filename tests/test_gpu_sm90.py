"""GPU tests of the Hopper attention forward (kernels/attention/fwd_sm90.cuh; ``-m gpu``, skipped
without CUDA or off sm_90): with the family knob forced to ``sm90`` (``_native.set_tuning_knob``),
``flash_attn_func`` forwards are checked against ferroattn.testing with the flash-attention pass
rule (out within 2 · the same-dtype reference's error; LSE within LSE_ATOL) over head dims 32..256
(the 64/128/256 kernels and the rounded-up ones in between), fp16/bf16, causal and not,
s_q != s_k both ways (rows that see no key: O = 0, LSE = +inf), lengths 1 / 97 / 113 / 1025,
GQA and MQA, every variant (local window, softcap, ALiBi (h,) and (b, h), sinks, dropout with the
mask read back from S_dmask), non-contiguous q/k/v; every output written (NaN-poisoned
allocator); the launch record names the sm90 kernel; the knob set to ``sm80`` sends the same call to
the sm80 kernel and both agree; CUDA-graph capture and replay; torch.compile(fullgraph=True); a
rejected call leaves the next valid one working.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import ferroattn._native as native
from ferroattn.flash_attn_interface import flash_attn_func
from ferroattn.testing import assert_close_to_ref, attention_ref

from _gpu_common import SM90_SHAPES, sm90_knob_forced, BF16, DEV, FP16, assert_lse_close, capture_graph, launch_records, poison_allocator

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm90_forced():
    with sm90_knob_forced("attn_fwd_family"):
        yield


def _kernels_of(f):
    """Run f() with the launch recorder on; returns (f's result, the kernel names launched)."""
    out, records = launch_records(f)
    return out, [r["kernel"] for r in records]


def _inputs(b, s_q, s_k, h, h_k, d, dtype, scale=1.0):
    q = torch.randn(b, s_q, h, d, device=DEV, dtype=dtype) * scale
    k = torch.randn(b, s_k, h_k, d, device=DEV, dtype=dtype) * scale
    v = torch.randn(b, s_k, h_k, d, device=DEV, dtype=dtype)
    return q, k, v


def _check(q, k, v, **kw):
    poison_allocator(q, q.shape[0] * q.shape[2] * q.shape[1] * 4)
    (out, lse, _), kernels = _kernels_of(lambda: flash_attn_func(q, k, v, return_attn_probs=True, **kw))
    assert any("attn_fwd_sm90" in n for n in kernels), kernels
    ref, ref_lse = attention_ref(q, k, v, **kw)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse, ref_lse)
    return out, lse


SHAPES = SM90_SHAPES


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(d, causal, shape):
    b, s_q, s_k, h, h_k = shape
    dtype = BF16 if (d + s_q) % 2 else FP16
    q, k, v = _inputs(b, s_q, s_k, h, h_k, d, dtype)
    out, lse = _check(q, k, v, causal=causal)
    if causal and s_q > s_k:
        empty = s_q - s_k   # rows 0 .. s_q - s_k - 1 see no key
        assert torch.all(out[:, :empty] == 0)
        assert torch.all(torch.isinf(lse[:, :, :empty]) & (lse[:, :, :empty] > 0))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("variant", ["window", "window_two_sided", "softcap", "softcap_window", "alibi_h",
                                     "alibi_bh", "sinks"])
def test_variants_match_reference(d, variant):
    b, s_q, s_k, h, h_k = 2, 333, 517, 4, 2
    q, k, v = _inputs(b, s_q, s_k, h, h_k, d, BF16)
    kw = {}
    if variant == "window":
        kw = dict(causal=True, window_size=(100, 0))
    elif variant == "window_two_sided":
        kw = dict(window_size=(64, 48))
    elif variant == "softcap":
        kw = dict(causal=True, softcap=30.0)
        q, k, v = _inputs(b, s_q, s_k, h, h_k, d, BF16, scale=3.0)
    elif variant == "softcap_window":
        kw = dict(causal=True, softcap=20.0, window_size=(128, 0))
    elif variant == "alibi_h":
        kw = dict(causal=True, alibi_slopes=torch.rand(h, device=DEV, dtype=torch.float32) * 0.3)
    elif variant == "alibi_bh":
        kw = dict(alibi_slopes=torch.rand(b, h, device=DEV, dtype=torch.float32) * 0.3)
    elif variant == "sinks":
        if "s_aux" not in inspect.signature(flash_attn_func).parameters:
            pytest.skip("s_aux not in flash_attn_func's signature")
        kw = dict(causal=True, window_size=(64, 0), s_aux=torch.randn(h, device=DEV, dtype=torch.float32))
    _check(q, k, v, **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_with_its_mask(d, causal):
    b, s_q, s_k, h, h_k = 2, 200, 300, 4, 2
    q, k, v = _inputs(b, s_q, s_k, h, h_k, d, FP16)
    torch.manual_seed(7)
    (out, lse, s_dmask), kernels = _kernels_of(
        lambda: flash_attn_func(q, k, v, dropout_p=0.17, causal=causal, return_attn_probs=True))
    assert any("attn_fwd_sm90" in n for n in kernels), kernels
    keep = (s_dmask >= 0)[:, :, :s_q, :s_k]
    ref, ref_lse = attention_ref(q, k, v, causal=causal, dropout_p=0.17, dropout_mask=keep)
    ref_lp, _ = attention_ref(q, k, v, causal=causal, dropout_p=0.17, dropout_mask=keep, upcast=False)
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse, ref_lse)
    # the same seed gives the same mask on the sm80 family (one Philox rule for every kernel)
    native.set_tuning_knob("attn_fwd_family", "sm80")
    torch.manual_seed(7)
    (out80, _, s_dmask80), kernels80 = _kernels_of(
        lambda: flash_attn_func(q, k, v, dropout_p=0.17, causal=causal, return_attn_probs=True))
    assert not any("attn_fwd_sm90" in n for n in kernels80), kernels80
    assert torch.equal(s_dmask80 >= 0, s_dmask >= 0)
    assert_close_to_ref(out80, ref, ref_lp)


def test_non_contiguous_inputs_and_both_families_agree():
    base = torch.randn(2, 300, 6, 2, 128, device=DEV, dtype=BF16)
    q, k, v = base[:, :, :4, 0], base[:, :, 4:5, 0], base[:, :, 5:6, 1]   # strided heads / rows
    out90, lse90 = _check(q, k, v, causal=True)
    native.set_tuning_knob("attn_fwd_family", "sm80")
    (out80, lse80, _), kernels = _kernels_of(lambda: flash_attn_func(q, k, v, causal=True, return_attn_probs=True))
    assert not any("attn_fwd_sm90" in n for n in kernels)
    assert (out90.float() - out80.float()).abs().max() < 2e-2
    assert (lse90 - lse80).abs().max() < 1e-3


def test_varlen_and_huge_batch_fall_back_to_sm80():
    from ferroattn.flash_attn_interface import flash_attn_varlen_func

    q = torch.randn(300, 4, 64, device=DEV, dtype=BF16)
    cu = torch.tensor([0, 100, 300], device=DEV, dtype=torch.int32)
    _, kernels = _kernels_of(lambda: flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, 200, 200, causal=True))
    assert kernels and not any("attn_fwd_sm90" in n for n in kernels), kernels


def test_cuda_graph_replays_and_compile():
    q, k, v = _inputs(2, 512, 512, 4, 2, 128, BF16)
    graph, static = capture_graph(lambda: flash_attn_func(q, k, v, causal=True))
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_close_to_ref(static, ref, ref_lp)
    compiled = torch.compile(lambda a, b_, c: flash_attn_func(a, b_, c, causal=True), fullgraph=True)
    assert_close_to_ref(compiled(q, k, v), ref, ref_lp)


def test_rejected_call_leaves_the_next_one_working():
    q, k, v = _inputs(1, 128, 128, 2, 2, 64, BF16)
    with pytest.raises((ValueError, RuntimeError)):
        flash_attn_func(q, k[..., :32], v, causal=True)
    _check(q, k, v, causal=True)


def test_knob_rejects_malformed_values():
    with pytest.raises(ValueError, match="attn_fwd_family|value"):
        native.set_tuning_knob("attn_fwd_family", "hopper")
    with pytest.raises(ValueError, match="name"):
        native.set_tuning_knob("no_such_knob", "sm80")
    assert native.tuning_knobs()["attn_fwd_family"] == "sm90"


#: the pipeline forms an A/B run measures against the default (the form rule's choice; tuning
#: knobs, docs/DEVELOPING.md): they change when the K/V ring's slots are loaded and freed, never
#: the arithmetic
FWD_FORMS = [{"attn_sm90_fwd_kv_release": "together", "attn_sm90_fwd_persistent": "0"},
             {"attn_sm90_fwd_kv_release": "separate", "attn_sm90_fwd_persistent": "0"},
             {"attn_sm90_fwd_stages": "3", "attn_sm90_fwd_persistent": "0"},
             {"attn_sm90_fwd_kv_release": "separate", "attn_sm90_fwd_stages": "3", "attn_sm90_fwd_persistent": "0"},
             {"attn_sm90_fwd_kv_release": "separate", "attn_sm90_fwd_persistent": "1"},
             {"attn_sm90_fwd_kv_release": "together", "attn_sm90_fwd_persistent": "1"},
             {"attn_sm90_fwd_persistent": "1"}]


@pytest.mark.parametrize("form", FWD_FORMS, ids=lambda f: "+".join(f"{k[14:]}={v}" for k, v in f.items()))
@pytest.mark.parametrize("d, shape, kw", [
    (64, (2, 333, 517, 4, 2), dict(causal=True)),
    (128, (2, 333, 517, 4, 2), dict()),
    (128, (1, 700, 100, 4, 1), dict(causal=True)),            # rows that see no key, one key tile
    (128, (2, 1025, 1025, 2, 2), dict(causal=True, window_size=(200, 0))),
    (128, (2, 200, 300, 4, 2), dict(dropout_p=0.17, causal=True)),
    (256, (2, 333, 517, 4, 2), dict(causal=True, softcap=20.0)),
    (96, (1, 64, 2000, 8, 2), dict()),                         # many key tiles through a short ring
    (64, (37, 300, 300, 6, 3), dict(causal=True)),            # (persistent) 666 tiles: several rounds, a partial last
    (256, (5, 129, 257, 3, 1), dict(dropout_p=0.1)),         # (persistent) O staged in the Q tile
], ids=lambda x: str(x) if not isinstance(x, dict) else ",".join(x))
def test_pipeline_forms_give_the_default_forms_bits(form, d, shape, kw):
    from ferroattn.knobs import override

    b, s_q, s_k, h, h_k = shape
    q, k, v = _inputs(b, s_q, s_k, h, h_k, d, BF16)

    def run():
        torch.manual_seed(3)
        return flash_attn_func(q, k, v, return_attn_probs=True, **kw)

    (out, lse, _), recs = launch_records(run)
    with override(**form):
        poison_allocator(q, q.numel() * 4)
        (out2, lse2, _), recs2 = launch_records(run)
    default = [r["config"] for r in recs if r["kernel"] == "attn_fwd_sm90"]
    cand = [r["config"] for r in recs2 if r["kernel"] == "attn_fwd_sm90"]
    assert default and cand, (default, cand)
    if form.get("attn_sm90_fwd_kv_release") == "separate":
        assert all(c.endswith(", true>") for c in cand), cand
    if form.get("attn_sm90_fwd_kv_release") == "together" and form.get("attn_sm90_fwd_persistent") == "0":
        assert all(c.endswith("16>") for c in cand), cand     # no form argument rendered
    if form.get("attn_sm90_fwd_stages") == "3" and d in (96, 128):   # 3 slots fit at d 128 (2 by default)
        assert all(c.startswith("ferroattn::attn_fwd_sm90<128, 128, 3,") for c in cand), cand
    if form.get("attn_sm90_fwd_persistent") == "1":
        assert all(c.endswith(", true>") and c.count("true") >= 1 for c in cand), cand
        grids = [r["grid"] for r in recs2 if r["kernel"] == "attn_fwd_sm90"]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert all(g[1] == g[2] == 1 and g[0] <= sms for g in grids), grids
    assert torch.equal(out, out2), (out.float() - out2.float()).abs().max()
    assert torch.equal(lse, lse2)


@pytest.mark.parametrize("d, s_k, kw, tail", [
    (64, 4096, dict(), "16>"),                          # long unmasked keys at d 64: together, not persistent
    (64, 512, dict(), ", true, true>"),                 # short keys: persistent, separate
    (64, 4096, dict(causal=True), ", true, true>"),     # masked: persistent
    (128, 4096, dict(), "16, true>"),                   # d >= 128: separate; long unmasked: not persistent
    (128, 4096, dict(window_size=(256, 0)), ", true, true>"),
    (256, 512, dict(), "16, true>"),                    # d 256: persistent only when masked
    (256, 512, dict(causal=True), ", true, true>"),
])
def test_the_dispatcher_takes_the_form_rules_form(d, s_k, kw, tail):
    """With the knobs at auto the sm90 forward runs the form FwdPolicy::form's measured rule names
    (src/tuning/attention_sm90.rs), and it matches the reference."""
    q, k, v = _inputs(1, 128, s_k, 2, 2, d, BF16)
    out, recs = launch_records(lambda: flash_attn_func(q, k, v, **kw))
    configs = [r["config"] for r in recs if r["kernel"] == "attn_fwd_sm90"]
    assert configs and all(c.endswith(tail) for c in configs), configs
    ref = attention_ref(q, k, v, **kw)[0]
    assert_close_to_ref(out, ref, attention_ref(q, k, v, upcast=False, **kw)[0])


@pytest.mark.parametrize("form", [{"attn_sm90_fwd_varlen": "1"},
                                  {"attn_sm90_fwd_varlen": "1", "attn_sm90_fwd_persistent": "1",
                                   "attn_sm90_fwd_kv_release": "separate"}], ids=["varlen", "varlen+persistent"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0)),
                                dict(causal=True, softcap=20.0)], ids=lambda kw: ",".join(kw) or "full")
def test_varlen_runs_on_the_hopper_kernel_under_its_knob(form, d, kw):
    """With attn_sm90_fwd_varlen on, flash_attn_varlen_func runs the sm90 kernel: empty, one-row,
    tile-edge and multi-tile sequences, s_q != s_k both ways, every row of the packed output
    written exactly (a partial tile must not overwrite the next sequence's rows)."""
    from ferroattn.flash_attn_interface import flash_attn_varlen_func
    from ferroattn.knobs import override
    from ferroattn.testing import attention_varlen_ref, random_cu_seqlens

    lq = [0, 1, 127, 128, 129, 300, 64, 513]
    lk = [3, 1, 127, 200, 129, 250, 64, 600]
    cu_q, cu_k = random_cu_seqlens(lq, device=DEV), random_cu_seqlens(lk, device=DEV)
    h, h_k = 4, 2
    q = torch.randn(sum(lq), h, d, device=DEV, dtype=BF16)
    k = torch.randn(sum(lk), h_k, d, device=DEV, dtype=BF16)
    v = torch.randn(sum(lk), h_k, d, device=DEV, dtype=BF16)

    def run():
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True, **kw)

    with override(**form):
        poison_allocator(q, q.shape[0] * h * 4)
        (out, lse, _), kernels = _kernels_of(run)
    assert "attn_fwd_sm90" in kernels, kernels
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max(lk), **kw)
    ref_lp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max(lk), upcast=False, **kw)
    assert torch.isfinite(out).all()
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse, ref_lse)
    # the default keeps varlen on the sm80 kernel
    _, kernels80 = _kernels_of(run)
    assert "attn_fwd_sm90" not in kernels80, kernels80


@pytest.mark.parametrize("d", [136, 160, 192])
@pytest.mark.parametrize("variant", ["causal", "full", "window", "softcap", "alibi", "sinks", "dropout", "persistent"])
def test_dedicated_d192_kernel_under_its_knob(d, variant):
    """attn_sm90_fwd_d192 runs head dims 129..192 on the 192 kernel: against the reference for the
    variants (dropout with its mask read back), s_q != s_k, GQA; the launch names the 192 kernel."""
    from ferroattn.knobs import override

    b, s_q, s_k, h, h_k = 2, 333, 517, 4, 2
    q, k, v = _inputs(b, s_q, s_k, h, h_k, d, BF16)
    kw = {"causal": dict(causal=True), "full": dict(), "window": dict(causal=True, window_size=(100, 0)),
          "softcap": dict(causal=True, softcap=20.0),
          "alibi": dict(causal=True, alibi_slopes=torch.rand(h, device=DEV, dtype=torch.float32) * 0.3),
          "sinks": dict(causal=True, s_aux=torch.randn(h, device=DEV, dtype=torch.float32)),
          "dropout": dict(causal=True, dropout_p=0.17), "persistent": dict(causal=True)}[variant]
    knobs = {"attn_sm90_fwd_d192": "1"}
    if variant == "persistent":
        knobs.update(attn_sm90_fwd_persistent="1", attn_sm90_fwd_kv_release="separate")
    if variant == "sinks" and "s_aux" not in inspect.signature(flash_attn_func).parameters:
        pytest.skip("s_aux not in flash_attn_func's signature")
    with override(**knobs):
        poison_allocator(q, q.numel() * 4)
        torch.manual_seed(5)
        (out, lse, s_dmask), recs = launch_records(lambda: flash_attn_func(q, k, v, return_attn_probs=True, **kw))
    configs = [r["config"] for r in recs if r["kernel"] == "attn_fwd_sm90"]
    assert configs and all(c.startswith("ferroattn::attn_fwd_sm90<192,") for c in configs), configs
    if variant == "dropout":
        kw = dict(kw, dropout_mask=(s_dmask >= 0)[:, :, :s_q, :s_k])
    ref, ref_lse = attention_ref(q, k, v, **kw)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse, ref_lse)
