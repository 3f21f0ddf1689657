"""transformers plug-in on CPU: registration, and the glue (transpose, unpad/pad, left padding,
decode, packed sequences) checked end to end on a tiny Llama with the kernels replaced by
ferroattn.testing references (the same model on the GPU with the real kernels is in test_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ferroattn  # noqa: E402
from ferroattn import flash_attn_interface as fai  # noqa: E402
from ferroattn.integrations import transformers as fa_hf  # noqa: E402
from ferroattn.testing import attention_ref, attention_varlen_ref  # noqa: E402


def test_register_adds_function_and_mask():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    fa_hf.register()
    fa_hf.register()  # idempotent
    assert "flash" not in fa_hf.NAME
    assert AttentionInterface()["ferroattn"] is fa_hf.ferroattn_attention_forward
    assert AttentionMaskInterface()["ferroattn"] is flash_attention_mask
    assert "ferroattn" in AttentionInterface().valid_keys()


@pytest.fixture
def reference_kernels(monkeypatch):
    """Swap the flash functions used by the plug-in for references; every call is also made with
    the real ferroattn function on meta bf16 copies, so the arguments pass the real validation."""
    calls = []

    def meta(x):
        return x.to("meta", torch.bfloat16) if x.is_floating_point() else x.to("meta")

    def ref_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 deterministic=False):
        calls.append(("padded", tuple(q.shape), causal, deterministic))
        fai.flash_attn_func(meta(q), meta(k), meta(v), dropout_p, softmax_scale, causal, window_size, softcap,
                            None, deterministic)
        return attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)[0].to(q.dtype)

    def ref_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, deterministic=False):
        calls.append(("varlen", tuple(q.shape), causal, cu_q.tolist(), cu_k.tolist(), max_q, max_k, deterministic))
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert isinstance(max_q, int) and isinstance(max_k, int)
        fai.flash_attn_varlen_func(meta(q), meta(k), meta(v), meta(cu_q), meta(cu_k), max_q, max_k, dropout_p,
                                   softmax_scale, causal, window_size, softcap, None, deterministic)
        return attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale)[0].to(q.dtype)

    monkeypatch.setattr(fa_hf, "flash_attn_func", ref_func)
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func", ref_varlen)
    return calls


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM

    fa_hf.register()
    torch.manual_seed(0)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    ours = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation="ferroattn")).eval()
    sdpa = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation="sdpa")).eval()
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def test_tiny_llama_padded_batch_matches_sdpa(reference_kernels):
    ours, sdpa = _models()
    ids = torch.randint(1, 128, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = sdpa(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-4), (a[real] - b[real]).abs().max()
    assert any(c[0] == "varlen" and c[3] == [0, 6, 14, 23] for c in reference_kernels)
    # no padding: mask is None -> padded path
    with torch.no_grad():
        a = ours(ids).logits
        b = sdpa(ids).logits
    assert torch.allclose(a, b, atol=1e-4)
    assert reference_kernels[-1][0] == "padded" and reference_kernels[-1][2] is True


def test_tiny_llama_generate_left_padded_matches_sdpa(reference_kernels):
    ours, sdpa = _models()
    ids = torch.randint(1, 128, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    ids[1, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(ids, **kw)
        b = sdpa.generate(ids, **kw)
    assert torch.equal(a, b)
    # decode steps: q_len == 1 through the varlen path (cu_seqlens_q = arange)
    assert any(c[0] == "varlen" and c[1][0] == 2 and c[3] == [0, 1, 2] for c in reference_kernels)


def test_packed_position_ids_match_separate_sequences(reference_kernels):
    ours, _ = _models()
    torch.manual_seed(3)
    s1, s2 = torch.randint(1, 128, (1, 5)), torch.randint(1, 128, (1, 4))
    packed = torch.cat([s1, s2], dim=1)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        a = ours(packed, position_ids=position_ids, use_cache=False).logits
        r1 = ours(s1, use_cache=False).logits
        r2 = ours(s2, use_cache=False).logits
    assert torch.allclose(a[0, :5], r1[0], atol=1e-4) and torch.allclose(a[0, 5:], r2[0], atol=1e-4)
    assert any(c[0] == "varlen" and c[3] == [0, 5, 9] for c in reference_kernels)


def test_function_contract_shapes_and_unsupported_kwargs(reference_kernels):
    class M(torch.nn.Module):
        is_causal = True

    q = torch.randn(2, 4, 5, 16)  # (b, h, s, d)
    k = torch.randn(2, 2, 5, 16)
    out, weights = fa_hf.ferroattn_attention_forward(M(), q, k, k, None, scaling=0.25)
    assert out.shape == (2, 5, 4, 16) and weights is None
    expected = attention_ref(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True, softmax_scale=0.25)[0]
    assert torch.allclose(out, expected, atol=1e-6)
    out2, _ = fa_hf.ferroattn_attention_forward(M(), q, k, k, None, scaling=0.25, is_causal=False)
    assert reference_kernels[-1][2] is False and not torch.allclose(out2, out)
    with pytest.raises(ferroattn.ArgumentError, match="attention_mask"):
        fa_hf.ferroattn_attention_forward(M(), q, k, k, torch.ones(2, 1, 5, 5, dtype=torch.bool))


# ---- per-model options (sliding window, softcap, sinks, dropout, is_causal) ----------------------
def _variant_ref(q, k, v, causal, scale, window, softcap, s_aux, dropout_p):
    """fp32 attention over (b, s, h, d) with every option the plug-in passes: flash_attn's window
    and bottom-right causal rules (ferroattn.testing.visible_mask), softcap, ALiBi-free, sinks
    (one logit per query head in the softmax denominator), dropout on the probabilities; the
    output in q's dtype, differentiable."""
    from ferroattn.testing import visible_mask

    b, s_q, h, d = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    qf, kf, vf = q.float(), k.float().repeat_interleave(h // h_k, 2), v.float().repeat_interleave(h // h_k, 2)
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf)
    scores = softcap * torch.tanh(scores * scale / softcap) if softcap > 0 else scores * scale
    scores = scores.masked_fill(~visible_mask(s_q, s_k, causal, window, device=q.device), float("-inf"))
    if s_aux is not None:
        scores = torch.cat([scores, s_aux.float().view(1, h, 1, 1).expand(b, h, s_q, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if s_aux is not None:
        probs = probs[..., :-1]
    probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vf).to(q.dtype)


class _Calls(list):
    """The recorded calls; ``drop`` names options the fake kernels then ignore ("window",
    "softcap", "sinks", or "causal": flipped), to show an option matters."""
    def __init__(self):
        super().__init__()
        self.drop = set()

    def effective(self, causal, window_size, softcap, s_aux):
        return (causal != ("causal" in self.drop), (-1, -1) if "window" in self.drop else window_size,
                0.0 if "softcap" in self.drop else softcap, None if "sinks" in self.drop else s_aux)


@pytest.fixture
def variant_kernels(monkeypatch):
    """flash_attn_func / flash_attn_varlen_func replaced by :func:`_variant_ref` (the real
    signatures' names, ``s_aux`` keyword-only last); every call's keyword arguments recorded."""
    calls = _Calls()

    def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None):
        calls.append(dict(kind="padded", dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, deterministic=deterministic, s_aux=s_aux,
                          shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape))))
        causal, window_size, softcap, s_aux = calls.effective(causal, window_size, softcap, s_aux)
        return _variant_ref(q, k, v, causal, softmax_scale, window_size, softcap, s_aux, dropout_p)

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
               return_attn_probs=False, block_table=None, *, s_aux=None):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        calls.append(dict(kind="varlen", dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, deterministic=deterministic, s_aux=s_aux,
                          shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape)), cu_q=cu_seqlens_q.tolist(),
                          cu_k=cu_seqlens_k.tolist(), max_q=max_seqlen_q, max_k=max_seqlen_k,
                          block_table=None if block_table is None else block_table.tolist()))
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        causal, window_size, softcap, s_aux = calls.effective(causal, window_size, softcap, s_aux)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

        def keys(x, i):
            """Sequence i's keys (or values): rows ck[i]:ck[i + 1] of x, or with block_table its
            pages (num_pages, page_size, h_k, d) in the table's order, cut to its length."""
            if block_table is None:
                return x[ck[i]:ck[i + 1]]
            n, page = ck[i + 1] - ck[i], x.shape[1]
            return x[block_table[i, :-(-n // page)].long()].reshape(-1, *x.shape[2:])[:n]

        parts = []
        for i in range(len(cq) - 1):
            parts.append(_variant_ref(q[None, cq[i]:cq[i + 1]], keys(k, i)[None], keys(v, i)[None],
                                      causal, softmax_scale, window_size, softcap, s_aux, dropout_p)[0])
        return torch.cat(parts) if parts else out

    monkeypatch.setattr(fa_hf, "flash_attn_func", func)
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func", varlen)
    return calls


class _Causal(torch.nn.Module):
    is_causal = True


class _Bidirectional(torch.nn.Module):
    is_causal = False


def _qkv(b=2, h=4, h_k=2, s_q=6, s_k=6, d=16, d_v=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, s_q, d, generator=g, dtype=dtype)
    k = torch.randn(b, h_k, s_k, d, generator=g, dtype=dtype)
    v = torch.randn(b, h_k, s_k, d_v or d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("sliding_window,s_q,s_k,masked,window", [
    (None, 6, 6, False, (-1, -1)),
    (4, 6, 6, False, (3, 3)),       # s_k > w: (w - 1, w - 1)
    (5, 6, 6, True, (4, 4)),
    (6, 6, 6, False, (-1, -1)),     # s_k == w: no window (transformers' strict >)
    (8, 6, 6, True, (-1, -1)),
    (4, 1, 6, True, (3, 3)),        # decode: k/v with the past tokens decide
    (6, 1, 6, False, (-1, -1)),
    (4, 2, 5, True, (3, 3)),        # chunked prefill with a cache, left padding
])
def test_sliding_window_rule(variant_kernels, sliding_window, s_q, s_k, masked, window):
    q, k, v = _qkv(s_q=s_q, s_k=s_k)
    mask = None
    if masked:
        mask = torch.ones(2, s_k, dtype=torch.long)
        mask[1, :1] = 0
    out, _ = fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, mask, sliding_window=sliding_window)
    call = variant_kernels[-1]
    assert call["kind"] == ("varlen" if masked else "padded")
    assert tuple(call["window_size"]) == window and call["causal"] is True
    assert out.shape == (2, s_q, 4, 16)


def test_sliding_window_matches_transformers_masks(variant_kernels):
    """The (w - 1, w - 1) window means what transformers' own masks mean: causal -> the query and
    the w - 1 keys before it (sliding_window_overlay); non-causal -> |i - j| <= w - 1."""
    from transformers.masking_utils import sliding_window_bidirectional_overlay, sliding_window_overlay

    q, k, v = _qkv(b=1, h=2, h_k=2, s_q=9, s_k=9)
    w = 4
    idx = torch.arange(9)
    i, j = idx[:, None], idx[None, :]
    for module, allowed in ((_Causal(), (j <= i) & sliding_window_overlay(w)(0, 0, i, j)),
                            (_Bidirectional(), sliding_window_bidirectional_overlay(w - 1)(0, 0, i, j))):
        out, _ = fa_hf.ferroattn_attention_forward(module, q, k, v, None, sliding_window=w)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * 16 ** -0.5
        want = torch.einsum("bhqk,bhkd->bqhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_softcap_s_aux_dropout_is_causal_reach_the_kernels(variant_kernels, masked):
    q, k, v = _qkv()
    mask = torch.ones(2, 6, dtype=torch.long) if masked else None
    if masked:
        mask[0, :2] = 0
    sinks = torch.randn(4, requires_grad=True)
    fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, mask, softcap=None, dropout=0.0)
    first = variant_kernels[-1]
    assert first["softcap"] == 0.0 and first["s_aux"] is None and first["dropout_p"] == 0.0
    fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, mask, softcap=50.0, s_aux=sinks, dropout=0.25,
                                      scaling=0.3, is_causal=False)
    call = variant_kernels[-1]
    assert call["kind"] == ("varlen" if masked else "padded")
    assert call["softcap"] == 50.0 and call["dropout_p"] == 0.25 and call["softmax_scale"] == 0.3
    assert call["s_aux"] is sinks  # unchanged: its gradient reaches the parameter
    assert call["causal"] is False  # the is_causal kwarg wins over module.is_causal
    fa_hf.ferroattn_attention_forward(_Bidirectional(), q, k, v, mask, is_causal=True)
    assert variant_kernels[-1]["causal"] is True
    fa_hf.ferroattn_attention_forward(_Bidirectional(), q, k, v, mask)
    assert variant_kernels[-1]["causal"] is False


def test_s_aux_gradient_reaches_the_sinks(variant_kernels):
    q, k, v = _qkv()
    sinks = torch.zeros(4, requires_grad=True)
    out, _ = fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, None, s_aux=sinks)
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().min() > 0


def test_s_aux_without_kernel_support_raises_not_implemented(monkeypatch):
    """A flash_attn function that does not declare s_aux gets NotImplementedError, never a
    silently dropped sink."""
    def old_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False):
        raise AssertionError("must not be called")

    monkeypatch.setattr(fa_hf, "flash_attn_func", old_func)
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="s_aux"):
        fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, None, s_aux=torch.zeros(4))


def test_smaller_value_head_dim_is_padded_and_cropped(variant_kernels):
    """MLA-style v head dim < q's: v is zero-padded to q's head dim for the kernel and the output
    cropped back (transformers' rule)."""
    q, k, v = _qkv(d=16, d_v=8)
    out, _ = fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, None)
    assert variant_kernels[-1]["shapes"][2][-1] == 16 and out.shape == (2, 6, 4, 8)
    want = _variant_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, None, (-1, -1), 0.0, None, 0.0)
    assert torch.allclose(out, want, atol=1e-6)


def test_chunked_attention_layer_beyond_one_chunk_raises(variant_kernels):
    from types import SimpleNamespace

    class Chunked(torch.nn.Module):
        is_causal = True
        config = SimpleNamespace(attention_chunk_size=4, layer_types=["full_attention", "chunked_attention"])

        def __init__(self, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx

    q, k, v = _qkv(s_q=6, s_k=6)
    fa_hf.ferroattn_attention_forward(Chunked(0), q, k, v, None)  # the full-attention layer
    fa_hf.ferroattn_attention_forward(Chunked(1), q[:, :, :4], k[:, :, :4], v[:, :, :4], None)  # one chunk
    with pytest.raises(NotImplementedError, match="chunked attention"):
        fa_hf.ferroattn_attention_forward(Chunked(1), q, k, v, None)


def test_output_attentions_warns_once(variant_kernels, caplog):
    fa_hf._WARNED.discard("output_attentions")
    q, k, v = _qkv()
    with caplog.at_level("WARNING", logger=fa_hf.__name__):
        fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, None, output_attentions=True)
        fa_hf.ferroattn_attention_forward(_Causal(), q, k, v, None, output_attentions=True)
    assert sum("output_attentions" in r.message for r in caplog.records) == 1


# ---- every architecture of the GPU file, in fp32 on the CPU with the reference kernels -----------
@pytest.mark.parametrize("name", sorted(__import__("test_gpu_transformers_archs").ARCHS))
def test_architecture_matches_reference_attention(variant_kernels, name):
    """The GPU file's tiny configs build, the options each architecture passes reach the kernels
    (the GPU file's check), and with exact kernels (fp32) the logits on real positions equal the
    architecture's reference attention (sdpa, or eager) on the same padded batch: the window,
    softcap, sinks and causal mapping means what transformers' masks and eager code mean."""
    import test_gpu_transformers_archs as archs

    ours, _, ref32 = archs.models(name, torch.float32, device="cpu")
    ids, mask = archs.batch(name, device="cpu")
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        archs.check_options_reached_kernels(name, variant_kernels)
        want = ref32(ids, attention_mask=mask).logits
    real = mask.bool()
    assert {c["kind"] for c in variant_kernels} == {"varlen"}
    err = (got[real] - want[real]).abs().max().item()
    assert err <= 1e-4 * max(1.0, want[real].abs().max().item()), err


def test_dropout_rate_follows_train_mode(variant_kernels):
    import test_gpu_transformers_archs as archs

    model = archs.build("llama", "ferroattn", torch.float32, device="cpu", attention_dropout=0.25)
    ids, mask = archs.batch("llama", device="cpu")
    with torch.no_grad():
        model(ids, attention_mask=mask)
        assert {c["dropout_p"] for c in variant_kernels} == {0.0}
        model.train()
        model(ids, attention_mask=mask)
    assert variant_kernels[-1]["dropout_p"] == 0.25


def test_modernbert_deterministic_flag_reaches_the_kernels(variant_kernels):
    import test_gpu_transformers_archs as archs

    model = archs.build("modernbert", "ferroattn", torch.float32, device="cpu", deterministic_flash_attn=True)
    ids, mask = archs.batch("modernbert", device="cpu")
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert {c["deterministic"] for c in variant_kernels} == {True}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [True, False])
def test_tiny_llama_training_step_gradients_match_sdpa(reference_kernels, padded):
    """The training path (mask -> unpad -> varlen -> pad, or the plain padded call) is differentiable
    end to end: with reference kernels, every parameter gradient equals sdpa's (fp32, CPU)."""
    ours, sdpa = _models()
    ours.train()
    sdpa.train()
    torch.manual_seed(4)
    ids = torch.randint(1, 128, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[2, 7:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    for model in (ours, sdpa):
        model.zero_grad()
        model(ids, attention_mask=mask if padded else None, labels=labels).loss.backward()
    g_ours, g_sdpa = _grads(ours), _grads(sdpa)
    assert g_ours.keys() == g_sdpa.keys() and len(g_ours) == len(list(ours.parameters()))
    for name, g in g_sdpa.items():
        scale = max(g.abs().max().item(), 1e-6)
        assert (g_ours[name] - g).abs().max().item() <= 1e-4 * scale, name
    # the attention projections received gradient through the attention function
    assert g_ours["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0
    kinds = {c[0] for c in reference_kernels}
    assert kinds == ({"varlen"} if padded else {"padded"})


def test_deterministic_kwarg_and_environment(reference_kernels, monkeypatch):
    class M(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 5, 16)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    fa_hf.ferroattn_attention_forward(M(), q, q, q, None)
    assert reference_kernels[-1][3] is False
    fa_hf.ferroattn_attention_forward(M(), q, q, q, None, deterministic=True)
    assert reference_kernels[-1][3] is True
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    fa_hf.ferroattn_attention_forward(M(), q, q, q, None)
    assert reference_kernels[-1][3] is True
    fa_hf.ferroattn_attention_forward(M(), q, q, q, None, deterministic=False)  # the kwarg wins
    assert reference_kernels[-1][3] is False
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[0, 0] = 0
    fa_hf.ferroattn_attention_forward(M(), q, q, q, mask)
    assert reference_kernels[-1][0] == "varlen" and reference_kernels[-1][7] is True
    with torch.no_grad():   # no backward can follow: the environment variable selects nothing
        fa_hf.ferroattn_attention_forward(M(), q, q, q, None)
        assert reference_kernels[-1][3] is False
        fa_hf.ferroattn_attention_forward(M(), q, q, q, None, deterministic=True)   # the kwarg still passes
        assert reference_kernels[-1][3] is True


_ARCHS = __import__("test_gpu_transformers_archs").ARCHS


@pytest.mark.parametrize("name,option", [(n, o) for n, a in sorted(_ARCHS.items())
                                         for o in a.needs + (() if a.decoder else ("causal",))])
def test_gpu_file_options_matter_beyond_bf16_noise(variant_kernels, name, option):
    """The GPU file's logits test is not vacuous: at its sizes, kernels that ignored the option
    (or flipped causal for an encoder) would move the fp32 logits by more than 3x that test's
    bound (2 x the reference's bf16 error, measured here with CPU bf16, + 1e-3 x max|logit|)."""
    import test_gpu_transformers_archs as archs

    ref = archs.build(name, archs.ARCHS[name].ref, torch.bfloat16, device="cpu")
    state = {k: v.float() for k, v in ref.state_dict().items()}
    ours = archs.build(name, "ferroattn", torch.float32, state, device="cpu")
    ref32 = archs.build(name, archs.ARCHS[name].ref, torch.float32, state, device="cpu")
    ids, mask = archs.batch(name, device="cpu")
    real = mask.bool()
    with torch.no_grad():
        want32 = ref32(ids, attention_mask=mask).logits[real]
        noise = (ref(ids, attention_mask=mask).logits[real].float() - want32).abs().max().item()
        variant_kernels.drop.add(option)
        moved = (ours(ids, attention_mask=mask).logits[real] - want32).abs().max().item()
    bound = 2 * noise + 1e-3 * max(1.0, want32.abs().max().item())
    assert moved > 3 * bound, f"{name} without {option}: logits move {moved:.3e}, bound {bound:.3e}"
