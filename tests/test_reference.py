"""Sanity of ferroattn.testing (the references the GPU tests trust), on CPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ferroattn.testing import (
    assert_close_to_ref,
    attention_ref,
    attention_varlen_ref,
    max_abs_diff,
    random_cu_seqlens,
    visible_mask,
)

F64 = torch.float64
# SDPA warns that its lower-right bias gives NaN rows when s_q > s_k; those rows are not compared
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias")


def _sdpa(q, k, v, causal, scale=None):
    """SDPA in fp64 with the bottom-right mask; inputs in flash_attn layout."""
    qt, kt, vt = (x.transpose(1, 2).to(F64) for x in (q, k, v))
    mask = causal_lower_right(q.shape[1], k.shape[1]) if causal else None
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def test_visible_mask_examples():
    assert visible_mask(2, 5, causal=True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible_mask(5, 2, causal=True).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # window (1, 0): row i sees its diagonal key and the one before
    assert visible_mask(3, 3, window_size=(1, 0)).int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    # sides >= seqlen_k are unbounded
    assert visible_mask(3, 4, window_size=(4, 9)).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 7), (7, 3), (8, 8), (1, 5)])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2), (8, 1)])
def test_ref_matches_sdpa_bottom_right(causal, sq, sk, h, hk):
    torch.manual_seed(sq * 100 + sk)
    q, k, v = torch.randn(2, sq, h, 24, dtype=F64), torch.randn(2, sk, hk, 24, dtype=F64), torch.randn(2, sk, hk, 24, dtype=F64)
    out, lse = attention_ref(q, k, v, causal=causal, reference_dtype=F64)
    expected = _sdpa(q, k, v, causal)
    seen = visible_mask(sq, sk, causal).any(-1)  # SDPA's fully masked rows are garbage (§2.4)
    assert torch.allclose(out[:, seen], expected[:, seen], atol=1e-12)
    assert torch.all(out[:, ~seen] == 0)
    assert torch.all(lse[:, :, ~seen] == math.inf)
    assert lse.dtype == torch.float32 and lse.shape == (2, h, sq)


def test_lse_definition():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 8, dtype=F64), torch.randn(1, 6, 2, 8, dtype=F64), torch.randn(1, 6, 2, 8, dtype=F64)
    _, lse = attention_ref(q, k, v, softmax_scale=0.3, reference_dtype=F64)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    assert torch.allclose(lse.to(F64), torch.logsumexp(scores, -1), atol=1e-5)


def test_gqa_mapping_is_contiguous_groups():
    torch.manual_seed(0)
    q = torch.randn(1, 3, 6, 8, dtype=F64)
    k, v = torch.randn(1, 5, 2, 8, dtype=F64), torch.randn(1, 5, 2, 8, dtype=F64)
    out, _ = attention_ref(q, k, v, reference_dtype=F64)
    for head in range(6):
        kv = head // 3
        o, _ = attention_ref(q[:, :, head:head + 1], k[:, :, kv:kv + 1], v[:, :, kv:kv + 1], reference_dtype=F64)
        assert torch.allclose(out[:, :, head], o[:, :, 0])


def test_softcap_and_alibi_change_result():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    base, _ = attention_ref(q * 10, k, v)
    capped, _ = attention_ref(q * 10, k, v, softcap=1.0)
    alibi, _ = attention_ref(q, k, v, alibi_slopes=torch.tensor([0.5, 1.0]))
    assert max_abs_diff(base, capped) > 1e-3
    assert max_abs_diff(attention_ref(q, k, v)[0], alibi) > 1e-3


def test_varlen_ref_matches_padded_per_sequence():
    torch.manual_seed(0)
    lq, lk = [3, 0, 5, 1], [4, 2, 0, 6]  # empty q sequence, empty k sequence (rows -> 0, +inf)
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    q, k, v = torch.randn(9, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (9, 4, 16) and lse.shape == (4, 9)
    for i in range(4):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True)
        assert torch.equal(out[q0:q1], o[0]) and torch.equal(lse[:, q0:q1], l[0])
    # sequence 2 has 5 queries and no key: output 0, LSE +inf; sequence 3 (row 8) sees 6 keys
    assert torch.all(out[3:8] == 0) and torch.all(lse[:, 3:8] == math.inf)
    assert torch.all(out[8] != 0) and torch.all(torch.isfinite(lse[:, 8]))


def test_low_precision_baseline_and_pass_rule():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert ref.dtype == torch.float32 and ref_lp.dtype == torch.bfloat16
    base = max_abs_diff(ref_lp, ref)
    assert 0 < base < 0.05
    # the reference rounded to bf16 passes; a perturbed output or NaN fails
    err, bound = assert_close_to_ref(ref.to(torch.bfloat16), ref, ref_lp)
    assert err <= bound
    bad = ref.clone()
    bad[0, 0, 0, 0] += 10 * base + 1
    with pytest.raises(AssertionError):
        assert_close_to_ref(bad, ref, ref_lp)
    nan = ref.clone()
    nan[1, 2, 3, 4] = float("nan")
    with pytest.raises(AssertionError):
        assert_close_to_ref(nan, ref, ref_lp)


def test_max_abs_diff_treats_equal_infinities_as_equal():
    a = torch.tensor([math.inf, 1.0])
    assert max_abs_diff(a, torch.tensor([math.inf, 1.5])) == 0.5
    assert max_abs_diff(a, torch.tensor([-math.inf, 1.0])) == math.inf


# ---- variants (window, softcap, ALiBi, sinks, dropout) against brute-force loops ---------------
def _norm_window(left, right, seqlen_k, causal):
    """flash_api.cpp's order, written out again: sides >= seqlen_k -> -1, causal -> right 0, then
    a lone side makes the other seqlen_k."""
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if causal:
        right = 0
    if left < 0 <= right:
        left = seqlen_k
    if right < 0 <= left:
        right = seqlen_k
    return left, right


def _brute(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, sink=None, p=0.0, keep=None,
           scale=None, window_seqlen_k=None):
    """One (batch entry, head, row) at a time, fp64 torch scalars (differentiable): returns
    out (b, s_q, h, d_v) and lse (b, h, s_q) (fp64)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    left, right = _norm_window(*window, sk if window_seqlen_k is None else window_seqlen_k, causal)
    out_rows, lse_rows = [], []
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            slope = None if slopes is None else (slopes[bi, hi] if slopes.dim() == 2 else slopes[hi])
            for i in range(sq):
                diag = i + sk - sq
                logits, vals, keeps = [], [], []
                for j in range(sk):
                    if right >= 0 and j > diag + right:
                        continue
                    if left >= 0 and j < diag - left:
                        continue
                    s = scale * torch.dot(q[bi, i, hi], k[bi, j, kv])
                    if softcap > 0:
                        s = softcap * torch.tanh(s / softcap)
                    if slope is not None:
                        s = s - slope * abs(diag - j)
                    logits.append(s)
                    vals.append(v[bi, j, kv])
                    keeps.append(True if keep is None else bool(keep[bi, hi, i, j]))
                if sink is not None:
                    logits.append(sink[hi])
                if not logits:
                    out_rows.append(torch.zeros(v.shape[-1], dtype=F64))
                    lse_rows.append(torch.tensor(math.inf, dtype=F64))
                    continue
                ls = torch.stack(logits)
                lse = torch.logsumexp(ls, 0)
                probs = torch.exp(ls - lse)
                o = torch.zeros(v.shape[-1], dtype=F64)
                for pj, vj, kj in zip(probs, vals, keeps):  # the sink (last, if any) has no value
                    if kj:
                        o = o + pj * vj / (1.0 - p)
                out_rows.append(o)
                lse_rows.append(lse)
    out = torch.stack(out_rows).reshape(b, h, sq, -1).transpose(1, 2)
    return out, torch.stack(lse_rows).reshape(b, h, sq)


def _inputs(b, sq, sk, h, hk, d=8, seed=0, qscale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, dtype=F64, generator=g) * qscale
    k = torch.randn(b, sk, hk, d, dtype=F64, generator=g)
    v = torch.randn(b, sk, hk, d, dtype=F64, generator=g)
    return q, k, v, g


# (causal, window, softcap, alibi ("h" / "bh" / None), sinks, dropout_p, s_q, s_k, h, h_k)
VARIANT_CASES = [
    (False, (2, 1), 0.0, None, False, 0.0, 5, 7, 2, 2),
    (False, (0, 0), 0.0, None, False, 0.0, 7, 4, 2, 1),      # diagonal only; rows before it see nothing
    (False, (3, -1), 0.0, None, False, 0.0, 9, 3, 2, 2),     # left only: right becomes s_k (flash_attn)
    (False, (-1, 1), 0.0, None, False, 0.0, 4, 6, 2, 2),     # right only
    (True, (2, 5), 0.0, None, False, 0.0, 6, 6, 2, 2),       # causal forces right = 0
    (True, (9, -1), 0.0, None, False, 0.0, 3, 5, 2, 2),      # left >= s_k: plain causal
    (False, (-1, -1), 2.0, None, False, 0.0, 4, 5, 2, 2),
    (True, (-1, -1), 0.5, None, False, 0.0, 6, 4, 2, 1),
    (False, (-1, -1), 0.0, "h", False, 0.0, 5, 6, 2, 2),
    (True, (-1, -1), 0.0, "bh", False, 0.0, 6, 5, 4, 2),
    (False, (-1, -1), 0.0, None, True, 0.0, 3, 5, 2, 2),
    (True, (-1, -1), 0.0, None, True, 0.0, 6, 3, 2, 1),      # sinks with rows that see no key
    (False, (-1, -1), 0.0, None, False, 0.3, 4, 6, 2, 2),
    (True, (1, -1), 1.5, "h", True, 0.25, 5, 5, 2, 2),       # everything at once
    (False, (2, 2), 3.0, "bh", True, 0.0, 7, 5, 4, 2),
    (True, (-1, -1), 0.0, "h", True, 0.5, 1, 4, 2, 2),
]


def _variant_args(case, b, g, seqlen_q, seqlen_k):
    causal, window, softcap, alibi, sinks, p, _, _, h, _ = case
    slopes = None
    if alibi == "h":
        slopes = torch.rand(h, dtype=F64, generator=g) * 0.7
    elif alibi == "bh":
        slopes = torch.rand(b, h, dtype=F64, generator=g) * 0.7
    sink = torch.randn(h, dtype=F64, generator=g) * 2 if sinks else None
    keep = None
    if p > 0:  # flash_attn's S_dmask shape: (b, h, round128(s_q), round128(s_k))
        keep = torch.rand(b, h, 128, 128, generator=g) >= p
    return dict(causal=causal, window=window, softcap=softcap, slopes=slopes, sink=sink, p=p, keep=keep)


def _ref_kwargs(a):
    return dict(causal=a["causal"], window_size=a["window"], softcap=a["softcap"], alibi_slopes=a["slopes"],
                s_aux=a["sink"], dropout_p=a["p"], dropout_mask=a["keep"], reference_dtype=F64)


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_variants_match_brute_force(case):
    sq, sk, h, hk = case[6:]
    q, k, v, g = _inputs(2, sq, sk, h, hk, seed=sq * 31 + sk, qscale=2.0)
    a = _variant_args(case, 2, g, sq, sk)
    out, lse = attention_ref(q, k, v, **_ref_kwargs(a))
    exp_out, exp_lse = _brute(q, k, v, a["causal"], a["window"], a["softcap"], a["slopes"], a["sink"], a["p"], a["keep"])
    assert out.shape == (2, sq, h, 8) and lse.shape == (2, h, sq) and lse.dtype == torch.float32
    assert torch.allclose(out, exp_out, atol=1e-12, rtol=0)
    assert max_abs_diff(lse, exp_lse.float()) <= 1e-5


def test_sinks_lse_includes_the_sink_and_rows_without_keys():
    q, k, v, g = _inputs(2, 7, 3, 2, 2, seed=5)
    sink = torch.tensor([0.7, -1.3], dtype=F64)
    out0, lse0 = attention_ref(q, k, v, causal=True, reference_dtype=F64)
    out, lse = attention_ref(q, k, v, causal=True, s_aux=sink, reference_dtype=F64)
    seen = visible_mask(7, 3, causal=True).any(-1)  # rows 0..3 see no key
    assert not seen[:4].any() and seen[4:].all()
    assert torch.all(out[:, ~seen] == 0) and torch.all(lse0[:, :, ~seen] == math.inf)
    assert torch.allclose(lse[:, :, ~seen], sink.float()[None, :, None].expand(2, 2, 4))
    expected = torch.logaddexp(lse0[:, :, seen].to(F64), sink[None, :, None])
    assert torch.allclose(lse[:, :, seen].to(F64), expected, atol=1e-6)
    # the sink only adds to the denominator: out = out0 · exp(lse0 - lse)
    w = torch.exp(lse0.to(F64) - lse.to(F64))[:, :, seen].transpose(1, 2)[..., None]
    assert torch.allclose(out[:, seen], out0[:, seen] * w, atol=1e-6)
    # a very negative sink changes nothing
    out_neg, lse_neg = attention_ref(q, k, v, causal=True, s_aux=torch.full((2,), -1e4, dtype=F64), reference_dtype=F64)
    assert torch.allclose(out_neg, out0, atol=1e-12) and torch.allclose(lse_neg[:, :, seen], lse0[:, :, seen])


def test_dropout_scales_kept_values_and_leaves_lse():
    q, k, v, g = _inputs(2, 5, 6, 2, 2, seed=6)
    out0, lse0 = attention_ref(q, k, v, reference_dtype=F64)
    all_kept = torch.ones(2, 2, 128, 128, dtype=torch.bool)
    out, lse = attention_ref(q, k, v, dropout_p=0.2, dropout_mask=all_kept, reference_dtype=F64)
    assert torch.allclose(out, out0 / 0.8, atol=1e-12) and torch.equal(lse, lse0)
    # dropping key j for every row removes v_j's share (without renormalising)
    keep = torch.ones(2, 2, 5, 6, dtype=torch.bool)
    keep[:, :, :, 2] = False
    out2, lse2 = attention_ref(q, k, v, dropout_p=0.5, dropout_mask=keep, reference_dtype=F64)
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5, -1)
    expected = out0 - torch.einsum("bhq,bhd->bqhd", probs[..., 2], v[:, 2])
    assert torch.allclose(out2, expected / 0.5, atol=1e-12) and torch.equal(lse2, lse0)


def test_dropout_arguments_are_checked():
    q, k, v, _ = _inputs(1, 3, 4, 2, 2)
    keep = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs a dropout_mask"):
        attention_ref(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p in"):
        attention_ref(q, k, v, dropout_mask=keep)
    with pytest.raises(ValueError, match="bool"):
        attention_ref(q, k, v, dropout_p=0.1, dropout_mask=keep.float())
    with pytest.raises(ValueError, match="dropout_mask: expected shape"):
        attention_ref(q, k, v, dropout_p=0.1, dropout_mask=keep[:, :, :2])
    with pytest.raises(ValueError, match="s_aux"):
        attention_ref(q, k, v, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention_ref(q, k, v, alibi_slopes=torch.zeros(2, 3))


def test_normalise_window_follows_flash_attn():
    from ferroattn.testing import normalise_window

    assert normalise_window((-1, -1), 10) == (-1, -1)
    assert normalise_window((-1, -1), 10, causal=True) == (10, 0)
    assert normalise_window((3, -1), 10) == (3, 10)
    assert normalise_window((-1, 2), 10) == (10, 2)
    assert normalise_window((10, 12), 10) == (-1, -1)
    assert normalise_window((4, 7), 10, causal=True) == (4, 0)
    # one-sided windows when s_q > 2·s_k: the right bound s_k is a real bound for the first rows
    assert visible_mask(6, 2, window_size=(1, -1)).int().tolist() == [[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]]


def test_varlen_window_is_normalised_with_max_seqlen_k():
    # sequence 0: s_q 6, s_k 2; with max_seqlen_k 5, window (1, -1) has right = 5, not 2
    lq, lk = [6, 3], [2, 5]
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    assert visible_mask(6, 2, window_size=(1, -1), window_seqlen_k=5).all()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 8, dtype=F64, generator=g) for n in (9, 7, 7))
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=(1, -1), reference_dtype=F64)
    for i in range(2):
        q0, q1, k0, k1 = sum(lq[:i]), sum(lq[:i + 1]), sum(lk[:i]), sum(lk[:i + 1])
        o, l = _brute(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], window=(1, -1), window_seqlen_k=5)
        assert torch.allclose(out[q0:q1], o[0], atol=1e-12) and max_abs_diff(lse[:, q0:q1], l[0].float()) <= 1e-5
    # with max_seqlen_k = 2 (not what a caller would pass here) the first rows of sequence 0 see nothing
    out2, lse2 = attention_varlen_ref(q, k, v, cu_q, cu_k, window_size=(1, -1), reference_dtype=F64, max_seqlen_k=2)
    assert torch.all(out2[:2] == 0) and torch.all(lse2[:, :2] == math.inf)


@pytest.mark.parametrize("case", [VARIANT_CASES[i] for i in (0, 9, 11, 13, 14, 15)],
                         ids=lambda c: "-".join(str(x) for x in c))
def test_varlen_variants_match_brute_force(case):
    causal, window, softcap, alibi, sinks, p, _, _, h, hk = case
    lq, lk = [4, 0, 7, 1, 5], [6, 3, 2, 4, 0]  # an empty q sequence; a sequence with no key
    cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lq), h, 8, dtype=F64, generator=g)
    k, v = (torch.randn(sum(lk), hk, 8, dtype=F64, generator=g) for _ in range(2))
    a = _variant_args(case, len(lq), g, max(lq), max(lk))
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **_ref_kwargs(a))
    for i in range(len(lq)):
        q0, q1, k0, k1 = sum(lq[:i]), sum(lq[:i + 1]), sum(lk[:i]), sum(lk[:i + 1])
        if q1 == q0:
            continue
        slopes = a["slopes"][i:i + 1] if a["slopes"] is not None and a["slopes"].dim() == 2 else a["slopes"]
        keep = None if a["keep"] is None else a["keep"][i:i + 1]
        o, l = _brute(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, window, softcap, slopes, a["sink"], p, keep,
                      window_seqlen_k=max(lk))
        assert torch.allclose(out[q0:q1], o[0], atol=1e-12)
        assert max_abs_diff(lse[:, q0:q1], l[0].float()) <= 1e-5


# ---- gradients with variants ------------------------------------------------------------------
@pytest.mark.parametrize("case", [VARIANT_CASES[i] for i in (1, 2, 7, 9, 11, 13, 14)],
                         ids=lambda c: "-".join(str(x) for x in c))
def test_grads_match_brute_force_autograd(case):
    from ferroattn.testing import attention_grads_ref

    sq, sk, h, hk = case[6:]
    q, k, v, g = _inputs(2, sq, sk, h, hk, seed=sq + 7 * sk, qscale=1.5)
    a = _variant_args(case, 2, g, sq, sk)
    dout = torch.randn(2, sq, h, 8, dtype=F64, generator=g)
    got = attention_grads_ref(q, k, v, dout, **_ref_kwargs(a))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if a["sink"] is not None:
        leaves.append(a["sink"].clone().requires_grad_(True))
    out, _ = _brute(*leaves[:3], a["causal"], a["window"], a["softcap"], a["slopes"],
                    leaves[3] if a["sink"] is not None else None, a["p"], a["keep"])
    expected = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    assert len(got) == len(leaves)
    for name, gr, ex, x in zip(["dq", "dk", "dv", "ds_aux"], got, expected, leaves):
        ex = torch.zeros_like(x) if ex is None else ex
        assert gr.shape == x.shape and gr.dtype == F64, name
        assert torch.allclose(gr, ex, atol=1e-10, rtol=0), name


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("varlen", [False, True])
def test_ds_aux_closed_form_and_finite_differences(p, varlen):
    from ferroattn.testing import attention_grads_ref

    g = torch.Generator().manual_seed(21)
    h, hk = 4, 2
    sink = torch.randn(h, dtype=F64, generator=g)
    if varlen:
        lq, lk = [3, 6, 2], [5, 2, 0]  # causal: sequence 1's first rows and sequence 2 see no key
        cu_q, cu_k = random_cu_seqlens(lq), random_cu_seqlens(lk)
        q = torch.randn(sum(lq), h, 8, dtype=F64, generator=g)
        k, v = (torch.randn(sum(lk), hk, 8, dtype=F64, generator=g) for _ in range(2))
        keep = torch.rand(3, h, 128, 128, generator=g) >= p if p else None

        def fwd(s):
            return attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, window_size=(2, -1), softcap=4.0, s_aux=s,
                                        dropout_p=p, dropout_mask=keep, reference_dtype=F64)
    else:
        cu_q = cu_k = None
        q, k, v, _ = _inputs(2, 7, 4, h, hk, seed=22)
        keep = torch.rand(2, h, 7, 4, generator=g) >= p if p else None

        def fwd(s):
            return attention_ref(q, k, v, causal=True, alibi_slopes=torch.full((h,), 0.3, dtype=F64), s_aux=s,
                                 dropout_p=p, dropout_mask=keep, reference_dtype=F64)
    out, lse = fwd(sink)
    dout = torch.randn(out.shape, dtype=F64, generator=g)
    if varlen:
        grads = attention_grads_ref(q, k, v, dout, True, None, cu_q, cu_k, window_size=(2, -1), softcap=4.0,
                                    s_aux=sink, dropout_p=p, dropout_mask=keep, reference_dtype=F64)
    else:
        grads = attention_grads_ref(q, k, v, dout, True, alibi_slopes=torch.full((h,), 0.3, dtype=F64), s_aux=sink,
                                    dropout_p=p, dropout_mask=keep, reference_dtype=F64)
    ds = grads[3]
    # closed form: ds_h = -sum_rows exp(sink_h - lse_row) · D_row, D_row = sum_d dout · out
    D = (dout * out).sum(-1)  # (b, s_q, h) or (total_q, h)
    lse64 = lse.to(F64)
    if varlen:
        closed = -(torch.exp(sink[:, None] - lse64) * D.transpose(0, 1)).sum(1)
    else:
        closed = -(torch.exp(sink[None, :, None] - lse64) * D.transpose(1, 2)).sum((0, 2))
    # (lse is fp32, so the closed form is as exact as fp32 allows)
    assert torch.allclose(ds, closed, atol=1e-5, rtol=1e-5)
    # central differences of L(s) = sum(dout · out(s)), fp64
    eps = 1e-6
    for hi in range(h):
        e = torch.zeros(h, dtype=F64)
        e[hi] = eps
        fd = ((dout * fwd(sink + e)[0]).sum() - (dout * fwd(sink - e)[0]).sum()) / (2 * eps)
        assert abs(float(fd) - float(ds[hi])) <= 1e-6 * max(1.0, abs(float(fd)))


def test_s_aux_gradcheck():
    q, k, v, g = _inputs(1, 4, 5, 2, 1, seed=9)
    sink = torch.randn(2, dtype=F64, generator=g, requires_grad=True)
    qq = q.clone().requires_grad_(True)

    def f(qq, sink):
        return attention_ref(qq, k, v, window_size=(1, 1), softcap=3.0, s_aux=sink, reference_dtype=F64)[0]

    assert torch.autograd.gradcheck(f, (qq, sink))


def test_max_abs_diff_refuses_what_it_cannot_compare():
    from ferroattn.errors import ArgumentError
    with pytest.raises(ArgumentError, match=r"^b: expected a's shape \(0,\), got \(3,\)"):
        max_abs_diff(torch.zeros(0), torch.ones(3))
    with pytest.raises(ArgumentError, match="^b: expected a's shape"):
        max_abs_diff(torch.zeros(3), torch.zeros(1) + 5)
    with pytest.raises(ArgumentError, match="^a: expected a real tensor"):
        max_abs_diff(torch.tensor([1j]), torch.tensor([0j]))
    assert max_abs_diff(torch.zeros(3), torch.ones(3)) == 1.0


def test_reference_argument_errors():
    from ferroattn.errors import ArgumentError
    from ferroattn.testing import normalise_window, random_cu_seqlens, visible_mask
    q, k2 = torch.zeros(1, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    with pytest.raises(ArgumentError, match="^k: expected q's batch 1"):
        attention_ref(q, k2, k2)
    with pytest.raises(ArgumentError, match="^causal: expected a bool, got str"):
        attention_ref(q, q, q, causal="no")
    with pytest.raises(ArgumentError, match="^softmax_scale: expected None or a finite real number"):
        attention_ref(q, q, q, softmax_scale=float("nan"))
    with pytest.raises(ArgumentError, match="^window_size: expected a pair of ints"):
        normalise_window((1, 2, 3), 10)
    with pytest.raises(ArgumentError, match="^seqlen_q: expected an int >= 0"):
        visible_mask(-1, 4)
    with pytest.raises(ArgumentError, match=r"^lengths\[1\]: expected an int >= 0"):
        random_cu_seqlens([3, -5])
    assert random_cu_seqlens([3, 5]).tolist() == [0, 3, 8]
