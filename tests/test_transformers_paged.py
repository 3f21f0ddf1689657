"""transformers' continuous batching (``generate_batch``) on ``"paged|ferroattn"``, on the CPU:
the kernels replaced by the exact references of test_transformers.py (``variant_kernels``), the
tokens of every request equal to the architecture's reference attention generating each prompt
alone, and the options (window per layer type, softcap, sinks, scale) reaching the kernel; plus
registration and argument errors."""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import test_gpu_transformers_archs as archs  # noqa: E402
from test_transformers import variant_kernels  # noqa: E402,F401  (the fixture)

from ferroattn import flash_attn_varlen_func  # noqa: E402
from ferroattn.errors import ArgumentError  # noqa: E402
from ferroattn.integrations import transformers as fa_hf  # noqa: E402
from ferroattn.integrations import transformers_paged as fa_paged  # noqa: E402

NEW_TOKENS = 6
# three requests of different lengths, two longer than the architectures' sliding windows
PROMPTS = [[3 + (7 * i) % 200 for i in range(n)] for n in (13, 5, 21)]


@pytest.fixture
def paged_kernels(variant_kernels, monkeypatch):  # noqa: F811
    """variant_kernels as the paged function's flash_attn_varlen_func; every call is also made with
    the real ferroattn function on meta bf16 copies, so the arguments (the strided q view among
    them) pass the real validation."""
    fake = fa_hf.flash_attn_varlen_func

    def meta(x):
        return x.to("meta", torch.bfloat16) if x.is_floating_point() else x.to("meta")

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, s_aux=None, **kw):
        flash_attn_varlen_func(meta(q).as_strided(q.shape, q.stride()), meta(k), meta(v), meta(cu_q), meta(cu_k),
                               max_q, max_k, s_aux=None if s_aux is None else meta(s_aux), **kw)
        return fake(q, k, v, cu_q, cu_k, max_q, max_k, s_aux=s_aux, **kw)

    monkeypatch.setattr(fa_paged, "flash_attn_varlen_func", varlen)
    return variant_kernels


def test_register_adds_the_paged_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    fa_hf.register()
    assert fa_paged.PAGED_NAME == "paged|" + fa_hf.NAME
    assert AttentionInterface()[fa_paged.PAGED_NAME] is fa_paged.ferroattn_paged_attention_forward
    # no mask function: transformers then builds no mask for the packed batch
    assert fa_paged.PAGED_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def _generate_batch(model):
    gc = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate_batch(inputs=PROMPTS, generation_config=gc, progress_bar=False)
    tokens = [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    # a request whose step raised comes back empty (generate_batch logs the error and goes on)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS), tokens
    return tokens


def _generate_alone(model):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding", "mistral", "gemma2", "gpt_oss", "granite"])
def test_generate_batch_equals_each_prompt_alone_on_the_reference(paged_kernels, name):
    arch = archs.ARCHS[name]
    ours = archs.build(name, "ferroattn", torch.float32, device="cpu")
    ref = archs.build(name, arch.ref, torch.float32, ours.state_dict(), device="cpu")
    got = _generate_batch(ours)
    assert ours.config._attn_implementation == "ferroattn"   # continuous batching switched back
    assert got == _generate_alone(ref)

    calls = [c for c in paged_kernels if c["kind"] == "varlen"]
    # the prefill step packs the three prompts (in the scheduler's order); decode steps run one
    # query per request
    cu = calls[0]["cu_q"]
    assert sorted(b - a for a, b in zip(cu, cu[1:])) == sorted(map(len, PROMPTS))
    assert any(c["max_q"] == 1 and len(c["cu_q"]) == len(PROMPTS) + 1 for c in calls)
    assert {c["causal"] for c in calls} == {True}
    windows = {tuple(c["window_size"]) for c in calls}
    want = set()
    if arch.window is not None:
        want.add((arch.window, 0))
    if arch.full_layers:
        want.add((-1, -1))
    assert windows == want
    assert {c["softcap"] for c in calls} == ({1.0} if "softcap" in arch.needs else {0.0})
    assert all((c["s_aux"] is not None) == ("sinks" in arch.needs) for c in calls)
    if name == "granite":
        assert {c["softmax_scale"] for c in calls} == {0.1}


@pytest.mark.parametrize("name,option", [("mistral", "window"), ("gemma2", "softcap"), ("gpt_oss", "sinks")])
def test_the_options_matter(paged_kernels, name, option):
    """The fake kernel ignoring the option changes the tokens: the option reaching the kernel is
    what makes the batch equal the reference (the test above cannot pass without it)."""
    ours = archs.build(name, "ferroattn", torch.float32, device="cpu")
    want = _generate_batch(ours)
    paged_kernels.drop.add(option)
    assert _generate_batch(ours) != want


class _Layer(torch.nn.Module):
    layer_idx, scaling = 0, None


def test_errors_name_the_argument():
    q = torch.zeros(1, 4, 3, 8)
    k = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ArgumentError, match="^cache: 'paged\\|ferroattn' runs the packed inputs"):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None)
    with pytest.raises(ArgumentError, match="^read_index: 'paged\\|ferroattn' needs"):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None, cache=object(), write_index=[])
    with pytest.raises(NotImplementedError, match="^block_table: "):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None, cache=object(), read_index=[],
                                                   write_index=[], block_table=torch.zeros(1, 1, 1))
