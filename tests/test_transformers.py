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


def test_sliding_window_and_softcap_raise_when_they_matter():
    class M(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 6, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="window_size"):
        fa_hf.ferroattn_attention_forward(M(), q, q, q, None, sliding_window=4)
    with pytest.raises(NotImplementedError, match="softcap"):
        fa_hf.ferroattn_attention_forward(M(), q, q, q, None, softcap=50.0)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fa_hf.ferroattn_attention_forward(M(), q, q, q, None, dropout=0.1)


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
