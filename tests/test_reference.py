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
