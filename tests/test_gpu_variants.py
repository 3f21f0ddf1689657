"""GPU tests of the attention variants (``-m gpu``; skipped without CUDA): local windows
(``window_size``, one-sided, with causal, s_q != s_k both ways), logit softcapping, ALiBi slopes
(h,) and (b, h), attention sinks (``s_aux``), their combinations, and dropout; forward (out and
LSE) and backward (dq, dk, dv and the sinks' gradient) of ``flash_attn_func`` and
``flash_attn_varlen_func`` against ferroattn.testing with the flash-attention pass rule
(``max|ours - ref32| <= 2 · max|ref_same_dtype - ref32| + 1e-5``, factor 3 for gradients), over
head dims 64/96/128/256, fp16 and bf16, GQA/MQA, odd lengths (1, 97, 113), rows that see no key;
every output written (the caching allocator's free blocks are filled with NaN before each call);
``deterministic=True`` bitwise reproducible; CUDA-graph capture and replay; torch.compile
(fullgraph=True) forward and backward.

Capability gates (the only skips besides a missing GPU): tests that pass ``s_aux`` are skipped
while the flash_attn functions have no ``s_aux`` parameter (``inspect.signature``). Dropout is
implemented and has no gate: a NotImplementedError from ``dropout_p > 0`` fails its tests. The
dropout tests read the kept positions from ``S_dmask`` (``return_attn_probs=True``; negative
entries mark dropped positions, flash_attn's convention) and compare against the reference with
that mask, as flash-attention's own tests do.

One flash_attn rule gets its own tests (``test_one_sided_window_*``): a window with one side set
and the other -1 has the unset side replaced by seqlen_k (max_seqlen_k in varlen), which bounds
the rows far above the diagonal when s_q > s_k + 1; the main matrix uses one-sided windows only
where that makes no difference.

Kept to well under a minute on an H200 with a warm kernel cache.
"""
from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ferroattn.testing import (
    assert_close_to_ref,
    attention_grads_ref,
    attention_ref,
    attention_varlen_ref,
    random_cu_seqlens,
    visible_mask,
)

from _gpu_common import BF16, DEV, DTYPES, FP16, assert_lse_close, capture_graph
from _gpu_common import poison_allocator as _poison_allocator

pytestmark = pytest.mark.gpu


# ---- capability gates ---------------------------------------------------------------------
def _has_s_aux() -> bool:
    return all("s_aux" in inspect.signature(f).parameters for f in (flash_attn_func, flash_attn_varlen_func))


def _need_sinks():
    if not _has_s_aux():
        pytest.skip("s_aux not implemented (not in the flash_attn functions' signatures)")


# ---- variants and inputs ------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # None, "h" (one slope per head) or "bh" (per batch entry and head)
    sinks: bool = False
    qscale: float = 1.0  # q is drawn as N(0, qscale²): large enough that softcap bites
    cfgs: Optional[Tuple[int, ...]] = None  # padded configs (indices into CFGS); None: by rotation
    safe_lens: bool = False  # varlen: lengths with s_q <= s_k + 1 (see the module docstring)


VARIANTS = [
    Variant("local_16_0", window=(16, 0)),
    Variant("local_32_8", window=(32, 8)),
    Variant("local_left_only", window=(24, -1), cfgs=(1, 2, 3), safe_lens=True),
    Variant("local_right_only", window=(-1, 5)),
    Variant("local_diagonal", window=(0, 0)),
    Variant("causal_local", causal=True, window=(40, -1)),
    Variant("causal_local_right_forced", causal=True, window=(8, 12)),
    Variant("softcap50", softcap=50.0, qscale=8.0),
    Variant("softcap5_causal", causal=True, softcap=5.0, qscale=4.0),
    Variant("alibi_h", alibi="h"),
    Variant("alibi_h_causal", causal=True, alibi="h"),
    Variant("alibi_bh", alibi="bh"),
    Variant("alibi_bh_causal", causal=True, alibi="bh"),
    Variant("sinks", sinks=True),
    Variant("sinks_causal", causal=True, sinks=True),
    Variant("sinks_local", window=(20, 3), sinks=True),
    Variant("local_softcap_alibi", window=(20, 4), softcap=10.0, alibi="h", qscale=3.0),
    Variant("causal_local_softcap_alibi_bh", causal=True, window=(33, -1), softcap=30.0, alibi="bh", qscale=4.0),
    Variant("local_softcap_alibi_sinks", window=(16, 16), softcap=20.0, alibi="h", sinks=True, qscale=3.0),
]
BY_NAME = {v.name: v for v in VARIANTS}

# padded configs: (head dim, dtype, batch, s_q, s_k, h, h_k). One dtype per head dim (64 and 128
# bf16, 96 and 256 fp16): the variants' code is the score path, which depends on the head dim's
# tiling more than on the dtype, and each (head dim, dtype) pair is another set of kernels to build.
PAIRS = {64: BF16, 96: FP16, 128: BF16, 256: FP16}
CFGS = [
    (64, BF16, 2, 113, 97, 6, 2),
    (128, BF16, 2, 97, 113, 4, 4),
    (96, FP16, 3, 1, 97, 4, 1),
    (256, FP16, 1, 113, 113, 4, 2),
    (64, BF16, 2, 97, 1, 2, 1),
    (128, BF16, 2, 113, 33, 4, 2),
]
# varlen lengths: an empty q sequence, a q row with no key, s_q > s_k, s_q < s_k, s_q = 1
LENS = ([5, 0, 113, 1, 97, 33, 1], [7, 3, 97, 0, 113, 33, 64])
LENS_SAFE = ([5, 0, 97, 1, 33, 1], [7, 3, 113, 0, 33, 64])  # every s_q <= s_k + 1


def _padded_cases():
    cases = []
    for i, var in enumerate(VARIANTS):
        idx = var.cfgs or (i % len(CFGS), (i + 1) % len(CFGS), (i + 3) % len(CFGS))
        for c in idx:
            d, dtype, b, sq, sk, h, hk = CFGS[c]
            cases.append(pytest.param(var, CFGS[c], id=f"{var.name}-d{d}-{str(dtype)[6:]}-{sq}x{sk}-h{h}k{hk}"))
    return cases


def _varlen_cases():
    cases = []
    for i, var in enumerate(VARIANTS):
        d, (h, hk) = (64, 96, 128, 256)[i % 4], ((6, 2), (4, 4), (4, 1))[i % 3]
        dtype = PAIRS[d]
        cases.append(pytest.param(var, d, dtype, h, hk, id=f"{var.name}-d{d}-{str(dtype)[6:]}-h{h}k{hk}"))
    return cases


def _seed(*parts) -> int:
    """A seed fixed by the test's parameters (str hash() changes between processes)."""
    return zlib.crc32(repr(parts).encode())


def _leaf(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype).requires_grad_(True)


def _extras(var: Variant, b: int, h: int):
    """(alibi_slopes, s_aux) for the variant: geometric ALiBi slopes (h,) or uniform [0, 0.3)
    (b, h) (flash-attention's tests), fp32; sink logits fp32 (h,) around typical LSE values,
    requiring grad."""
    slopes = None
    if var.alibi == "h":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=DEV)
    elif var.alibi == "bh":
        slopes = torch.rand(b, h, device=DEV) * 0.3
    s_aux = None
    if var.sinks:
        _need_sinks()
        s_aux = (3.0 + 2.0 * torch.randn(h, device=DEV)).requires_grad_(True)
    return slopes, s_aux


def _call_kwargs(var, slopes, s_aux, deterministic=False):
    kw = dict(causal=var.causal, window_size=var.window, softcap=var.softcap, alibi_slopes=slopes,
              deterministic=deterministic, return_attn_probs=True)
    if s_aux is not None:
        kw["s_aux"] = s_aux
    return kw


def _ref_kwargs(var, slopes, s_aux):
    return dict(causal=var.causal, window_size=var.window, softcap=var.softcap, alibi_slopes=slopes, s_aux=s_aux)


def _check_out_lse(out, lse, ref, ref_lse, ref_lp, q):
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "out has NaN (an element not written?)"
    assert not torch.isnan(lse).any(), "softmax_lse has NaN (an element not written?)"
    assert_close_to_ref(out, ref, ref_lp)
    assert_lse_close(lse.detach(), ref_lse.detach())


def _check_empty_row_lse(lse_rows, s_aux):
    """softmax_lse (b, h, n) or (h, n) of rows that see no key: +inf, or the sink logit of the
    head (to fp32 rounding) with sinks."""
    if s_aux is None:
        assert torch.all(lse_rows == math.inf)
    else:
        sink = s_aux.detach().reshape((1,) * (lse_rows.dim() - 2) + (-1, 1)).expand_as(lse_rows)
        assert torch.allclose(lse_rows, sink, rtol=1e-5, atol=1e-5), (lse_rows, sink)


def _cancellation_floor(q, k, v, dout, scale):
    """(dq, dk) absolute error floors of the fp32 cancellation dS = P o (dP - D) (FlashAttention-2:
    dP = dO vᵀ and D = rowsum(dO o O) are two fp32 sums of the same d products when a row sees one
    key, and dq, dk vanish in exact arithmetic; the references then give exactly 0, so the pass
    rule's bound is its atol alone). Each sum of d terms carries about d · 2^-24 · max|dO| · max|v|
    of rounding; a gradient entry sums n of them with random signs (dq: s_k keys, dk: s_q · h/h_k
    rows), times max|k| or max|q| and the scale: sqrt(n) · 2 · d · 2^-24 · max|dO| max|v| · max|x| ·
    scale. Next to the bf16 bounds of ordinary cases (~1e-2) it is ~1e-3."""
    d = q.shape[-1]
    e = 2 * d * 2.0 ** -24 * dout.abs().max().item() * v.abs().max().item() * scale
    group = q.shape[-2] // k.shape[-2]
    return (math.sqrt(k.shape[-3]) * e * k.abs().max().item(), math.sqrt(q.shape[-3] * group) * e * q.abs().max().item())


def _check_grads(grads, refs, refs_lp, inputs, floors=(0.0, 0.0)):
    """floors: extra absolute tolerance for (dq, dk) (_cancellation_floor)."""
    atols = (1e-5 + floors[0], 1e-5 + floors[1], 1e-5, 1e-5)
    for name, g, r, r_lp, x, atol in zip(("dq", "dk", "dv", "ds_aux"), grads, refs, refs_lp, inputs, atols):
        assert g is not None, f"{name} is None"
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), f"{name} is not finite"
        assert_close_to_ref(g, r, r_lp, factor=3.0, atol=atol, name=name)


def _run_padded(var, q, k, v, slopes, s_aux, deterministic=False, dout=None):
    """Forward (poisoned outputs) and backward (poisoned gradients) of flash_attn_func; returns
    out, lse, grads, dout."""
    b, sq, h, _ = q.shape
    _poison_allocator(q, b * h * sq * 4)
    out, lse, _ = flash_attn_func(q, k, v, 0.0, None, **_call_kwargs(var, slopes, s_aux, deterministic))
    dout = torch.randn_like(out) if dout is None else dout
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    _poison_allocator(q, k, v, k, v, 2 * q.numel() * 4)
    grads = torch.autograd.grad(out, inputs, dout)
    return out, lse, grads, dout


# ---- numerics: padded -----------------------------------------------------------------------
@pytest.mark.parametrize("var,cfg", _padded_cases())
def test_padded_forward_backward(var, cfg):
    d, dtype, b, sq, sk, h, hk = cfg
    torch.manual_seed(_seed(var.name, d, sq, sk))
    q = _leaf(b, sq, h, d, dtype=dtype, scale=var.qscale)
    k, v = _leaf(b, sk, hk, d, dtype=dtype), _leaf(b, sk, hk, d, dtype=dtype)
    slopes, s_aux = _extras(var, b, h)
    out, lse, grads, dout = _run_padded(var, q, k, v, slopes, s_aux)
    rk = _ref_kwargs(var, slopes, s_aux)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    refs = attention_grads_ref(q, k, v, dout, **rk)
    refs_lp = attention_grads_ref(q, k, v, dout, upcast=False, **rk)
    # one key per row (s_k == 1): dq and dk are pure fp32 cancellation
    floors = _cancellation_floor(q, k, v, dout, d ** -0.5) if sk == 1 else (0.0, 0.0)
    _check_grads(grads, refs, refs_lp, inputs, floors)
    seen = visible_mask(sq, sk, var.causal, var.window, device=DEV).any(-1)
    if not seen.all():  # rows that see no key: output 0, dq 0, LSE +inf (the sink with sinks)
        assert torch.all(out[:, ~seen] == 0) and torch.all(grads[0][:, ~seen] == 0)
        _check_empty_row_lse(lse[:, :, ~seen], s_aux)


# ---- numerics: varlen -----------------------------------------------------------------------
@pytest.mark.parametrize("var,d,dtype,h,hk", _varlen_cases())
def test_varlen_forward_backward(var, d, dtype, h, hk):
    torch.manual_seed(_seed(var.name, d))
    lq, lk = LENS_SAFE if var.safe_lens else LENS
    cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
    mq, mk = max(lq), max(lk)
    q = _leaf(sum(lq), h, d, dtype=dtype, scale=var.qscale)
    k, v = _leaf(sum(lk), hk, d, dtype=dtype), _leaf(sum(lk), hk, d, dtype=dtype)
    slopes, s_aux = _extras(var, len(lq), h)
    _poison_allocator(q, h * sum(lq) * 4)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, **_call_kwargs(var, slopes, s_aux))
    rk = _ref_kwargs(var, slopes, s_aux)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, max_seqlen_k=mk, **rk)
    ref_lp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, max_seqlen_k=mk, **rk)
    assert lse.shape == (h, sum(lq))
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)
    dout = torch.randn_like(out)
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    _poison_allocator(q, k, v, k, v, 2 * q.numel() * 4)
    grads = torch.autograd.grad(out, inputs, dout)
    refs = attention_grads_ref(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=mk, **rk)
    refs_lp = attention_grads_ref(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, upcast=False, max_seqlen_k=mk,
                                  **rk)
    _check_grads(grads, refs, refs_lp, inputs)
    # the q row of the sequence with no keys (sequence 3): output 0, dq 0, LSE +inf (or the sink)
    row = sum(lq[:3])
    assert torch.all(out[row] == 0) and torch.all(grads[0][row] == 0)
    _check_empty_row_lse(lse[:, row:row + 1], s_aux)


# ---- flash_attn's one-sided window rule -----------------------------------------------------
@pytest.mark.parametrize("varlen", [False, True])
def test_one_sided_window_when_s_q_exceeds_s_k(varlen):
    """window_size (left, -1): flash_attn sets right = seqlen_k (max_seqlen_k in varlen), so a row
    i of a sequence with s_q > s_k + 1 sees keys j <= i + 2·s_k - s_q (i + s_k - s_q + max_seqlen_k
    in varlen): the first rows of the sequence see fewer keys than an unbounded right side gives."""
    torch.manual_seed(31)
    var = Variant("left_only", window=(5, -1))
    if varlen:
        lq, lk = [113, 7], [33, 70]  # sequence 0: s_q 113 > s_k 33 + 1; max_seqlen_k 70
        cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
        q, k, v = _leaf(sum(lq), 4, 64), _leaf(sum(lk), 2, 64), _leaf(sum(lk), 2, 64)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), window_size=var.window,
                                             return_attn_probs=True)
        ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=var.window, max_seqlen_k=max(lk))
        ref_lp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=var.window, upcast=False, max_seqlen_k=max(lk))
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        refs = attention_grads_ref(q, k, v, dout, False, None, cu_q, cu_k, window_size=var.window, max_seqlen_k=max(lk))
        refs_lp = attention_grads_ref(q, k, v, dout, False, None, cu_q, cu_k, upcast=False, window_size=var.window,
                                      max_seqlen_k=max(lk))
    else:
        q, k, v = _leaf(2, 113, 4, 64), _leaf(2, 33, 2, 64), _leaf(2, 33, 2, 64)
        out, lse, grads, dout = _run_padded(var, q, k, v, None, None)
        ref, ref_lse = attention_ref(q, k, v, window_size=var.window)
        ref_lp, _ = attention_ref(q, k, v, window_size=var.window, upcast=False)
        refs = attention_grads_ref(q, k, v, dout, window_size=var.window)
        refs_lp = attention_grads_ref(q, k, v, dout, window_size=var.window, upcast=False)
        # the rule matters here: rows 0..46 of the reference see no key at all (i + 2·33 - 113 < 0)
        assert not visible_mask(113, 33, window_size=var.window).any(-1)[:47].any()
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)
    _check_grads(grads, refs, refs_lp, (q, k, v))


# ---- rows that see no key, long sequences ---------------------------------------------------
@pytest.mark.parametrize("sinks", [False, True])
def test_window_rows_without_keys(sinks):
    """window (0, 0) with s_q 113 > s_k 17: rows 0..95 see no key (output 0, dq 0, LSE +inf, or
    the sink logit with sinks), rows 96..112 see exactly their diagonal key (out = v_j without
    sinks)."""
    torch.manual_seed(32)
    var = Variant("diag", window=(0, 0), sinks=sinks)
    q, k, v = _leaf(2, 113, 4, 128), _leaf(2, 17, 4, 128), _leaf(2, 17, 4, 128)
    slopes, s_aux = _extras(var, 2, 4)
    out, lse, grads, dout = _run_padded(var, q, k, v, slopes, s_aux)
    assert torch.all(out[:, :96] == 0) and torch.all(grads[0][:, :96] == 0)
    if s_aux is None:
        assert torch.all(lse[:, :, :96] == math.inf)
        assert torch.equal(out[:, 96:], v.detach())  # one key with probability 1
    _check_empty_row_lse(lse[:, :, :96], s_aux)
    rk = _ref_kwargs(var, slopes, s_aux)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    _check_grads(grads, attention_grads_ref(q, k, v, dout, **rk),
                 attention_grads_ref(q, k, v, dout, upcast=False, **rk), inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_sequence_window_softcap_alibi(dtype):
    """s = 1025 with a 256-key causal window: many key blocks skipped on both sides of the band."""
    torch.manual_seed(33)
    var = Variant("long", causal=True, window=(256, -1), softcap=15.0, alibi="h", qscale=2.0)
    q = _leaf(1, 1025, 4, 64, dtype=dtype, scale=2.0)
    k, v = _leaf(1, 1025, 2, 64, dtype=dtype), _leaf(1, 1025, 2, 64, dtype=dtype)
    slopes, s_aux = _extras(var, 1, 4)
    out, lse, grads, dout = _run_padded(var, q, k, v, slopes, s_aux)
    rk = _ref_kwargs(var, slopes, s_aux)
    _check_out_lse(out, lse, *attention_ref(q, k, v, **rk), attention_ref(q, k, v, upcast=False, **rk)[0], q)
    _check_grads(grads, attention_grads_ref(q, k, v, dout, **rk), attention_grads_ref(q, k, v, dout, upcast=False, **rk),
                 (q, k, v))


# ---- determinism ----------------------------------------------------------------------------
@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_backward_with_variants_is_bitwise(varlen):
    torch.manual_seed(34)
    sinks = _has_s_aux()
    var = Variant("det", window=(256, 64), softcap=30.0, alibi="h", sinks=sinks, qscale=2.0)
    if varlen:
        lens = [700, 1, 0, 1300]
        cu = random_cu_seqlens(lens, DEV)
        q, k, v = _leaf(sum(lens), 8, 128, scale=2.0), _leaf(sum(lens), 2, 128), _leaf(sum(lens), 2, 128)
        slopes, s_aux = _extras(var, len(lens), 8)

        def fwd(det):
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), 0.0, None,
                                          **_call_kwargs(var, slopes, s_aux, det))[0]
    else:
        q, k, v = _leaf(2, 1000, 8, 64, scale=2.0), _leaf(2, 1000, 2, 64), _leaf(2, 1000, 2, 64)
        slopes, s_aux = _extras(var, 2, 8)

        def fwd(det):
            return flash_attn_func(q, k, v, 0.0, None, **_call_kwargs(var, slopes, s_aux, det))[0]
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    dout = torch.randn(q.shape, dtype=BF16, device=DEV)

    def run(det):
        return torch.autograd.grad(fwd(det), inputs, dout)

    first, second = run(True), run(True)
    for name, a, b in zip(("dq", "dk", "dv", "ds_aux"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    for name, a, b in zip(("dq", "dk", "dv", "ds_aux"), first, run(False)):  # atomics: equal up to rounding
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(a.float().abs().max().item(), 1e-3), (name, err)


# ---- CUDA graphs, torch.compile -------------------------------------------------------------
@pytest.mark.parametrize("backward", [False, True])
def test_cuda_graph_capture_replay_window_softcap(backward):
    """A window + softcap call (and its deterministic backward) captured in a CUDA graph; replay
    with new inputs equals the eager call bitwise."""
    torch.manual_seed(35)
    q, k, v = _leaf(2, 97, 4, 64, scale=3.0), _leaf(2, 113, 2, 64), _leaf(2, 113, 2, 64)
    dout = torch.randn(2, 97, 4, 64, dtype=BF16, device=DEV)

    def f():
        out = flash_attn_func(q, k, v, window_size=(32, 8), softcap=10.0, deterministic=True)
        if not backward:
            return (out,)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    g, static = capture_graph(f)
    with torch.no_grad():
        for x in (q, k, v, dout):
            x.copy_(torch.randn_like(x) * (3.0 if x is q else 1.0))
    g.replay()
    torch.cuda.synchronize()
    eager = f()
    for name, a, b in zip(("out", "dq", "dk", "dv"), static, eager):
        assert torch.equal(a, b), f"{name}: replay differs from the eager call"
    ref, _ = attention_ref(q, k, v, window_size=(32, 8), softcap=10.0)
    ref_lp, _ = attention_ref(q, k, v, window_size=(32, 8), softcap=10.0, upcast=False)
    assert_close_to_ref(static[0], ref, ref_lp)  # the replay computed the new inputs


@pytest.mark.parametrize("name", ["local_32_8", "softcap5_causal", "alibi_bh_causal", "sinks_local",
                                  "local_softcap_alibi_sinks"])
def test_compile_fullgraph_forward_backward(name):
    torch._dynamo.reset()
    torch.manual_seed(36)
    var = BY_NAME[name]
    q = _leaf(2, 97, 4, 64, scale=var.qscale)
    k, v = _leaf(2, 113, 2, 64), _leaf(2, 113, 2, 64)
    slopes, s_aux = _extras(var, 2, 4)
    w = torch.randn(64, dtype=BF16, device=DEV)

    def loss_fn(q, k, v, slopes, s_aux):
        kw = _call_kwargs(var, slopes, s_aux, deterministic=True)
        kw.pop("return_attn_probs")
        out = flash_attn_func(q * 1.5, k, v, **kw)
        return (out * w).float().square().sum()

    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    compiled = torch.compile(loss_fn, fullgraph=True)  # a graph break would raise
    loss_c = compiled(q, k, v, slopes, s_aux)
    got = torch.autograd.grad(loss_c, inputs)
    loss_e = loss_fn(q, k, v, slopes, s_aux)
    expected = torch.autograd.grad(loss_e, inputs)
    assert torch.allclose(loss_c, loss_e, rtol=1e-2)
    for n, a, b in zip(("dq", "dk", "dv", "ds_aux"), got, expected):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-2 * max(b.float().abs().max().item(), 1e-3), (n, err)


# ---- dropout --------------------------------------------------------------------------------
def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _kept(S_dmask, b, h, sq, sk):
    """The kept positions from S_dmask (b, h, round128(s_q), round128(s_k)): entries >= 0
    (negative entries mark dropped positions, flash_attn's convention)."""
    assert S_dmask.shape == (b, h, _round128(sq), _round128(sk)), tuple(S_dmask.shape)
    return S_dmask >= 0


def _check_dropout_fraction(keep, visible, p):
    """The fraction dropped among visible positions is p within max(0.01, 5 sigma)."""
    kept = keep[..., : visible.shape[-2], : visible.shape[-1]][..., visible]
    n = kept.numel()
    frac = 1.0 - kept.float().mean().item()
    assert abs(frac - p) <= max(0.01, 5 * math.sqrt(p * (1 - p) / n)), (frac, p, n)


DROPOUT_VARIANTS = ["plain", "causal", "local_32_8", "alibi_h_causal", "sinks_causal"]


@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_dropout_padded(name):
    torch.manual_seed(37)
    var = BY_NAME.get(name) or Variant(name, causal=name == "causal")
    p = 0.17
    b, sq, sk, h, hk, d = 2, 113, 97, 4, 2, 64
    q, k, v = _leaf(b, sq, h, d), _leaf(b, sk, hk, d), _leaf(b, sk, hk, d)
    slopes, s_aux = _extras(var, b, h)
    out, lse, S = flash_attn_func(q, k, v, p, None, **_call_kwargs(var, slopes, s_aux))
    assert S.dtype == q.dtype
    keep = _kept(S, b, h, sq, sk)
    _check_dropout_fraction(keep, visible_mask(sq, sk, var.causal, var.window, device=DEV), p)
    rk = dict(_ref_kwargs(var, slopes, s_aux), dropout_p=p, dropout_mask=keep)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    ref_lp, _ = attention_ref(q, k, v, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)  # the LSE does not see dropout
    dout = torch.randn_like(out)
    inputs = (q, k, v) if s_aux is None else (q, k, v, s_aux)
    grads = torch.autograd.grad(out, inputs, dout)
    _check_grads(grads, attention_grads_ref(q, k, v, dout, **rk), attention_grads_ref(q, k, v, dout, upcast=False, **rk),
                 inputs)


def test_dropout_varlen():
    torch.manual_seed(38)
    p = 0.25
    lq, lk = [5, 0, 113, 1, 97], [7, 3, 97, 0, 113]
    cu_q, cu_k = random_cu_seqlens(lq, DEV), random_cu_seqlens(lk, DEV)
    q, k, v = _leaf(sum(lq), 4, 128, dtype=FP16), _leaf(sum(lk), 2, 128, dtype=FP16), _leaf(sum(lk), 2, 128, dtype=FP16)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), p, None, causal=True,
                                         window_size=(48, -1), return_attn_probs=True)
    keep = _kept(S, len(lq), 4, max(lq), max(lk))
    for i in (0, 2, 4):  # the dropped fraction per sequence with enough visible pairs
        _check_dropout_fraction(keep[i:i + 1], visible_mask(lq[i], lk[i], True, (48, -1), device=DEV,
                                                            window_seqlen_k=max(lk)), p)
    rk = dict(causal=True, window_size=(48, -1), dropout_p=p, dropout_mask=keep, max_seqlen_k=max(lk))
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **rk)
    ref_lp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **rk)
    _check_out_lse(out, lse, ref, ref_lse, ref_lp, q)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check_grads(grads, attention_grads_ref(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **rk),
                 attention_grads_ref(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, upcast=False, **rk), (q, k, v))


def test_dropout_follows_the_torch_seed_and_deterministic_backward():
    """The same torch seed gives the same mask (bitwise the same output); another draw gives a
    different one; deterministic=True gradients are bitwise reproducible (the backward draws the
    forward's mask again)."""
    q, k, v = _leaf(2, 97, 4, 64), _leaf(2, 97, 4, 64), _leaf(2, 97, 4, 64)
    dout = torch.randn(2, 97, 4, 64, dtype=BF16, device=DEV)

    def run():
        out = flash_attn_func(q, k, v, 0.3, None, True, window_size=(40, 0), deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.manual_seed(123)
    first = run()
    torch.manual_seed(123)
    second = run()
    third = run()  # the generator moved on
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs for the same seed"
    assert not torch.equal(first[0], third[0]), "two draws gave the same dropout mask"


def test_dropout_with_softcap():
    """flash_attn rejects softcap with dropout (RuntimeError "Softcapping does not support dropout
    for now"); ferroattn supports the combination (the Python layer and the validation accept it:
    tests/test_interface.py), so it must run and be right."""
    torch.manual_seed(39)
    q, k, v = _leaf(1, 65, 2, 64, scale=4.0), _leaf(1, 65, 2, 64), _leaf(1, 65, 2, 64)
    out, lse, S = flash_attn_func(q, k, v, 0.2, None, softcap=5.0, return_attn_probs=True)
    keep = _kept(S, 1, 2, 65, 65)
    rk = dict(softcap=5.0, dropout_p=0.2, dropout_mask=keep)
    ref, ref_lse = attention_ref(q, k, v, **rk)
    _check_out_lse(out, lse, ref, ref_lse, attention_ref(q, k, v, upcast=False, **rk)[0], q)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check_grads(grads, attention_grads_ref(q, k, v, dout, **rk), attention_grads_ref(q, k, v, dout, upcast=False, **rk),
                 (q, k, v))
