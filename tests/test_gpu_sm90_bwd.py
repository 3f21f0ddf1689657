"""GPU tests of the Hopper attention backward (kernels/attention/bwd_sm90.cuh; ``-m gpu``, skipped
without CUDA or off sm_90): with the backward family knob forced to ``sm90``
(``_native.set_tuning_knob("attn_bwd_family", "sm90")``), the gradients of ``flash_attn_func`` are
checked against ferroattn.testing's autograd reference with the flash-attention pass rule (factor 3
over the same-dtype reference's error) over head dims 32..128 (the 64 and 128 kernels and the
rounded-up ones), fp16/bf16, causal and not, s_q != s_k both ways (rows and keys that see nothing),
lengths 1 / 97 / 113 / 1025 (query and key tails), GQA and MQA, the variants the Hopper plan takes
(softcap, ALiBi (h,) and (b, h), sinks, dropout with the mask read back from S_dmask, causal or
not, the local window); every gradient written (NaN-poisoned allocator); the launch record names
the sm90 kernel; calls it declines (varlen without its knob, head dim > 128) run the sm80 plan; the
two families agree; the deterministic plan (the sm90 kernel without dQ, then the dQ kernel) is
bitwise reproducible and bitwise equal to its parts elsewhere; CUDA-graph capture and replay.
"""
from __future__ import annotations

import pytest
import torch

import ferroattn._native as native
from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ferroattn.testing import assert_close_to_ref, attention_grads_ref

from _gpu_common import SM90_SHAPES, sm90_knob_forced, BF16, DEV, FP16, capture_graph, launch_records, poison_allocator

pytestmark = pytest.mark.gpu

SM90 = "attn_bwd_sm90"


@pytest.fixture(autouse=True)
def _sm90_forced():
    with sm90_knob_forced("attn_bwd_family"):
        yield


def _leaf(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV, dtype=dtype) * scale).requires_grad_(True)


def _grads(q, k, v, dout, **kw):
    """(out, grads, kernel names of the backward) of flash_attn_func; gradients NaN-poisoned first."""
    out = flash_attn_func(q, k, v, **kw)
    poison_allocator(q, k, v, 2 * q.numel() * 4)
    grads, records = launch_records(lambda: torch.autograd.grad(out, (q, k, v), dout))
    return out, grads, [r["kernel"] for r in records]


def _check(q, k, v, expect_sm90=True, **kw):
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device=DEV, dtype=q.dtype)
    _, grads, kernels = _grads(q, k, v, dout, **kw)
    assert any(SM90 in n for n in kernels) == expect_sm90, kernels
    ref_kw = {key: val for key, val in kw.items() if key != "deterministic"}
    refs = attention_grads_ref(q, k, v, dout, **ref_kw)
    refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **ref_kw)
    for name, g, r, r_lp, x in zip(("dq", "dk", "dv"), grads, refs, refs_lp, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert torch.isfinite(g).all(), f"{name} is not finite"
        assert_close_to_ref(g, r, r_lp, factor=3.0, atol=1e-5, name=name)
    return grads


SHAPES = SM90_SHAPES


@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_reference(d, causal, dtype, shape):
    b, sq, sk, h, hk = shape
    torch.manual_seed(d * 1000 + sq + 7 * sk)
    q, k, v = _leaf(b, sq, h, d, dtype=dtype), _leaf(b, sk, hk, d, dtype=dtype), _leaf(b, sk, hk, d, dtype=dtype)
    _check(q, k, v, causal=causal)


def _variant_kwargs(variant, b, h):
    if variant == "softcap":
        return dict(causal=True, softcap=30.0), ()
    if variant == "softcap_plain":
        return dict(softcap=5.0), ()
    if variant == "alibi_h":
        return dict(causal=True, alibi_slopes=torch.rand(h, device=DEV) * 0.3), ()
    if variant == "alibi_bh":
        return dict(alibi_slopes=torch.rand(b, h, device=DEV) * 0.3), ()
    if variant == "sinks":
        return dict(causal=True), (torch.randn(h, device=DEV).requires_grad_(True),)
    if variant == "window":
        return dict(window_size=(37, 5)), ()
    if variant == "window_causal":
        return dict(window_size=(100, 0), causal=True), ()
    if variant == "softcap_window":
        return dict(window_size=(64, 3), softcap=30.0), ()
    raise AssertionError(variant)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "variant", ["softcap", "softcap_plain", "alibi_h", "alibi_bh", "sinks", "window", "window_causal", "softcap_window"]
)
def test_variants_match_reference(d, variant):
    b, sq, sk, h, hk = 2, 301, 257, 4, 2
    torch.manual_seed(d + len(variant))
    q, k, v = _leaf(b, sq, h, d, scale=2.0), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    kw, extra = _variant_kwargs(variant, b, h)
    if extra:
        # sinks: flash_attn_func takes them as s_aux (GPT-OSS); the gradient is checked too
        kw["s_aux"] = extra[0]
        dout = torch.randn_like(q)
        out = flash_attn_func(q, k, v, **kw)
        grads, records = launch_records(lambda: torch.autograd.grad(out, (q, k, v, extra[0]), dout))
        assert any(SM90 in r["kernel"] for r in records)
        ref_kw = dict(kw)
        refs = attention_grads_ref(q, k, v, dout, **ref_kw)
        refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **ref_kw)
        for name, g, r, r_lp in zip(("dq", "dk", "dv", "ds_aux"), grads, refs, refs_lp):
            assert torch.isfinite(g).all(), name
            assert_close_to_ref(g, r, r_lp, factor=3.0, atol=1e-5, name=name)
        return
    _check(q, k, v, expect_sm90=True, **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_with_its_mask(d, causal):
    b, sq, sk, h, hk = 2, 193, 257, 4, 2
    torch.manual_seed(5 + d)
    q, k, v = _leaf(b, sq, h, d), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    out, _, s_dmask = flash_attn_func(q, k, v, 0.17, causal=causal, return_attn_probs=True)
    mask = s_dmask[..., :sq, :sk] >= 0
    dout = torch.randn_like(out)
    grads, records = launch_records(lambda: torch.autograd.grad(out, (q, k, v), dout))
    assert any(SM90 in r["kernel"] for r in records)
    kw = dict(causal=causal, dropout_p=0.17, dropout_mask=mask)
    refs = attention_grads_ref(q, k, v, dout, **kw)
    refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **kw)
    for name, g, r, r_lp in zip(("dq", "dk", "dv"), grads, refs, refs_lp):
        assert torch.isfinite(g).all(), name
        assert_close_to_ref(g, r, r_lp, factor=3.0, atol=1e-5, name=name)


def test_families_agree_and_declined_calls_run_sm80():
    torch.manual_seed(3)
    q, k, v = _leaf(2, 333, 8, 128), _leaf(2, 333, 2, 128), _leaf(2, 333, 2, 128)
    dout = torch.randn_like(q)
    _, g90, kern90 = _grads(q, k, v, dout, causal=True)
    native.set_tuning_knob("attn_bwd_family", "sm80")
    _, g80, kern80 = _grads(q, k, v, dout, causal=True)
    native.set_tuning_knob("attn_bwd_family", "sm90")
    assert any(SM90 in n for n in kern90) and not any(SM90 in n for n in kern80)
    for a, b_ in zip(g90, g80):
        # two fp32 accumulation orders of the same products: within a few bf16 ulps
        assert (a.float() - b_.float()).abs().max() <= 2e-2 * (1 + b_.float().abs().max())
    # declined: head dim > 128, varlen (without its knob)
    q2, k2, v2 = _leaf(1, 100, 2, 192), _leaf(1, 100, 2, 192), _leaf(1, 100, 2, 192)
    _check(q2, k2, v2, expect_sm90=False)
    cu = torch.tensor([0, 50, 130], device=DEV, dtype=torch.int32)
    qv, kv, vv = _leaf(130, 4, 64), _leaf(130, 2, 64), _leaf(130, 2, 64)
    out = flash_attn_varlen_func(qv, kv, vv, cu, cu, 80, 80, causal=True)
    _, records = launch_records(lambda: torch.autograd.grad(out, (qv, kv, vv), torch.randn_like(out)))
    assert not any(SM90 in r["kernel"] for r in records)


def test_cuda_graph_replays_the_backward():
    torch.manual_seed(11)
    q, k, v = _leaf(1, 512, 4, 128), _leaf(1, 512, 4, 128), _leaf(1, 512, 4, 128)
    dout = torch.randn_like(q)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    eager = step()
    graph, outs = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for a, b_ in zip(outs, eager):
        assert torch.equal(a, b_) or (a.float() - b_.float()).abs().max() <= 1e-2 * (1 + b_.float().abs().max())


def _problem(d, seed, sq=301):
    """(q, k, v, dout) of the knob tests: b 2, s_k 389, GQA 4/2, bf16 (a query and a key tail)."""
    b, sk, h, hk = 2, 389, 4, 2
    torch.manual_seed(seed)
    q, k, v = _leaf(b, sq, h, d), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    return q, k, v, torch.randn(b, sq, h, d, device=DEV, dtype=BF16)


def _seeded_grads(q, k, v, dout, **kw):
    """(grads, launch records) of flash_attn_func's backward, torch's generator seeded first (the
    same dropout mask in every call)."""
    torch.manual_seed(9)
    out = flash_attn_func(q, k, v, **kw)
    return launch_records(lambda: torch.autograd.grad(out, (q, k, v), dout))


def _assert_same_gradients(g0, g1, dq_exact=False):
    """dK and dV bitwise equal; dQ too (``dq_exact``) or within the fp32 reduction-order noise of
    the atomic dQ (1 % of its largest value)."""
    assert torch.equal(g0[1], g1[1]), "dk"
    assert torch.equal(g0[2], g1[2]), "dv"
    assert torch.isfinite(g1[0]).all(), "dq"
    if dq_exact:
        assert torch.equal(g0[0], g1[0]), "dq"
    else:
        assert (g0[0].float() - g1[0].float()).abs().max() <= 1e-2 * (1 + g0[0].float().abs().max()), "dq"


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0)),
                                dict(causal=True, dropout_p=0.17), dict(softcap=5.0)],
                         ids=lambda kw: ",".join(kw) or "full")
def test_overlapped_product_order_gives_the_default_dk_dv_bits(d, kw):
    """The knob attn_sm90_bwd_dq_overlap changes when dQ is issued and reduced, not what any product
    adds: dK and dV are bitwise the default order's, dQ (fp32 reductions from many key tiles, in
    an order the default does not fix either) within reduction-order noise, and both match the
    reference."""
    from ferroattn.knobs import override

    q, k, v, dout = _problem(d, d + len(kw))
    g0, r0 = _seeded_grads(q, k, v, dout, **kw)
    with override(attn_sm90_bwd_dq_overlap="1"):
        poison_allocator(q, k, v, 2 * q.numel() * 4)
        g1, r1 = _seeded_grads(q, k, v, dout, **kw)
        if "dropout_p" not in kw:
            _check(q, k, v, **kw)   # against the reference, under the knob
    c0 = [r["config"] for r in r0 if r["kernel"] == SM90]
    c1 = [r["config"] for r in r1 if r["kernel"] == SM90]
    assert c0 and c1 and all(c.endswith(", true>") for c in c1) and not any(c.endswith(", true>") for c in c0), (c0, c1)
    _assert_same_gradients(g0, g1)


CONVERT = "attn_bwd_convert_dq"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0)),
                                dict(causal=True, dropout_p=0.17), dict(softcap=5.0)],
                         ids=lambda kw: ",".join(kw) or "full")
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_tiled_dq_accum_gives_the_row_layouts_dk_dv_bits(d, kw, overlap):
    """The knob attn_sm90_bwd_dq_tiled keeps dq_accum in accumulator-ordered tiles (one bulk
    reduction per warpgroup and query tile) where s_q is a multiple of 64 and the head dim is 64
    or 128: the sm90 kernel and the conversion both take their tiled form (config ending in
    ``, true>``); dK and dV are bitwise the row layout's, dQ within reduction-order noise of it
    and within the reference's rule. A call it cannot take (s_q = 301) keeps the row layout."""
    from ferroattn.knobs import override

    q, k, v, dout = _problem(d, d + len(kw), sq=320)
    with override(attn_sm90_bwd_dq_overlap=overlap):
        g0, r0 = _seeded_grads(q, k, v, dout, **kw)
        with override(attn_sm90_bwd_dq_tiled="1"):
            poison_allocator(q, k, v, 2 * q.numel() * 4)
            g1, r1 = _seeded_grads(q, k, v, dout, **kw)
            if "dropout_p" not in kw:
                _check(q, k, v, **kw)   # against the reference, under the knob
            q2 = q[:, :301].detach().clone().requires_grad_(True)
            _, r2 = _seeded_grads(q2, k, v, dout[:, :301], **kw)
    configs = lambda rs, name: [r["config"] for r in rs if r["kernel"] == name]
    assert all(c.endswith(", true>") for c in configs(r1, SM90) + configs(r1, CONVERT)), r1
    assert configs(r1, SM90) and configs(r1, CONVERT)
    assert not any(c.endswith(", true>") for c in configs(r0, CONVERT) + configs(r2, CONVERT)), (r0, r2)
    assert not any(c.endswith(", true, true>") for c in configs(r0, SM90) + configs(r2, SM90)), (r0, r2)
    _assert_same_gradients(g0, g1)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0))],
                         ids=lambda kw: ",".join(kw) or "full")
@pytest.mark.parametrize("deterministic", [False, True])
def test_mask_warps_give_the_consumers_dropout_bits(d, kw, deterministic):
    """The knob attn_sm90_bwd_mask_warps moves the dropout keep bits' Philox calls from the
    consumer threads to the producer warpgroup's idle warps (the sm90 kernel's config then ends in
    ``, true>``): the same mask, so dK and dV are bitwise the default's, dQ too on the
    deterministic plan (within reduction-order noise on the atomic one), with a query tail and
    several query heads per kv head (the warps step through every slot's head and tile)."""
    from ferroattn.knobs import override

    q, k, v, dout = _problem(d, d + len(kw))
    kw = dict(kw, dropout_p=0.17, deterministic=deterministic)
    g0, r0 = _seeded_grads(q, k, v, dout, **kw)
    with override(attn_sm90_bwd_mask_warps="1"):
        poison_allocator(q, k, v, 2 * q.numel() * 4)
        g1, r1 = _seeded_grads(q, k, v, dout, **kw)
    c0 = [r["config"] for r in r0 if r["kernel"] == SM90]
    c1 = [r["config"] for r in r1 if r["kernel"] == SM90]
    assert c0 and c1 and all(c.endswith(", true>") for c in c1) and not any(c.endswith(", true>") for c in c0), (c0, c1)
    _assert_same_gradients(g0, g1, dq_exact=deterministic)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0)), dict(softcap=5.0)],
                         ids=lambda kw: ",".join(kw) or "full")
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_varlen_backward_runs_on_the_hopper_kernel_under_its_knob(d, kw, overlap):
    """With attn_sm90_bwd_varlen on, flash_attn_varlen_func's backward runs the sm90 kernel (in both
    product orders): empty, one-row, tile-edge and multi-tile sequences, s_q != s_k both ways;
    gradients against the varlen reference's autograd (factor-3 rule)."""
    from ferroattn.knobs import override
    from ferroattn.testing import attention_varlen_ref, random_cu_seqlens

    lq = [0, 1, 63, 64, 65, 300, 128, 257]
    lk = [3, 1, 127, 128, 129, 250, 64, 400]
    cu_q, cu_k = random_cu_seqlens(lq, device=DEV), random_cu_seqlens(lk, device=DEV)
    torch.manual_seed(d + len(kw))
    h, hk = 4, 2
    q, k, v = _leaf(sum(lq), h, d), _leaf(sum(lk), hk, d), _leaf(sum(lk), hk, d)
    dout = torch.randn(sum(lq), h, d, device=DEV, dtype=BF16)
    with override(attn_sm90_bwd_varlen="1", attn_sm90_bwd_dq_overlap=overlap):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **kw)
        poison_allocator(q, k, v, 2 * q.numel() * 4)
        grads, records = launch_records(lambda: torch.autograd.grad(out, (q, k, v), dout))
    assert any(r["kernel"] == SM90 for r in records), [r["kernel"] for r in records]
    refs, refs_lp = [], []
    for upcast, dst in ((True, refs), (False, refs_lp)):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        o, _ = attention_varlen_ref(*leaves, cu_q, cu_k, max_seqlen_k=max(lk), upcast=upcast, **kw)
        dst.extend(torch.autograd.grad(o, leaves, dout.to(o.dtype)))
    for name, g, r, r_lp in zip(("dq", "dk", "dv"), grads, refs, refs_lp):
        assert torch.isfinite(g).all(), name
        assert_close_to_ref(g, r, r_lp, factor=3.0, atol=1e-5, name=name)


DQ_KERNEL = "attn_bwd_dq_sm80"


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(100, 0)),
                                dict(causal=True, dropout_p=0.17), dict(softcap=5.0),
                                dict(causal=True, alibi_slopes="h")],
                         ids=lambda kw: ",".join(kw) or "full")
def test_deterministic_plan_is_bitwise_reproducible_and_equal_to_its_parts(d, kw):
    """deterministic=True under the sm90 family: the sm90 kernel without dQ (its config ends in
    ``, false>``) and the dQ kernel, no dq_accum. Two runs give the same bits; dK and dV are the
    atomic sm90 kernel's bits (the same products in the same order), dQ the sm80 deterministic
    plan's bits (the same dQ kernel over the same inputs); all match the reference."""
    from ferroattn.knobs import override

    b, sq, sk, h, hk = 2, 301, 389, 4, 2
    torch.manual_seed(d + 3 * len(kw))
    q, k, v = _leaf(b, sq, h, d), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    dout = torch.randn(b, sq, h, d, device=DEV, dtype=BF16)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.rand(h, device=DEV) * 0.3

    def grads(deterministic):
        torch.manual_seed(9)   # the same dropout mask in every run
        out = flash_attn_func(q, k, v, deterministic=deterministic, **kw)
        poison_allocator(q, k, v, 2 * q.numel() * 4)
        return launch_records(lambda: torch.autograd.grad(out, (q, k, v), dout))

    g_det, r_det = grads(True)
    g_again, _ = grads(True)
    g_atomic, _ = grads(False)
    with override(attn_bwd_family="sm80"):
        g_sm80, r_sm80 = grads(True)
    names = [r["kernel"] for r in r_det]
    configs = [r["config"] for r in r_det if r["kernel"] == SM90]
    assert configs and all(c.endswith(", false>") for c in configs), configs
    assert DQ_KERNEL in names and not any("convert_dq" in n for n in names), names
    assert SM90 not in [r["kernel"] for r in r_sm80]
    for name, a, b_ in zip(("dq", "dk", "dv"), g_det, g_again):
        assert torch.equal(a, b_), f"{name} differs between two deterministic runs"
    assert torch.equal(g_det[1], g_atomic[1]), "dk: not the atomic sm90 kernel's bits"
    assert torch.equal(g_det[2], g_atomic[2]), "dv: not the atomic sm90 kernel's bits"
    assert torch.equal(g_det[0], g_sm80[0]), "dq: not the sm80 deterministic plan's bits"
    if "dropout_p" not in kw:
        _check(q, k, v, deterministic=True, **kw)
