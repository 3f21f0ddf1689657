"""transformers' continuous batching (``generate_batch``) on ``"paged|ferroattn"`` with the real
kernels: every attention call of the run checked against the fp32 reference on the same packed
inputs (the DESIGN §5 rule), every request generating all its tokens; and the same run replayed
from CUDA graphs (``use_cuda_graph=True``) giving the same tokens. The CPU twin with exact
reference kernels is tests/test_transformers_paged.py."""
from __future__ import annotations

import pytest
import torch

import test_gpu_transformers_archs as archs
from _gpu_common import BF16, DEV
from ferroattn.integrations import transformers_paged as fa_paged
from ferroattn.testing import assert_close_to_ref, attention_varlen_ref

pytestmark = pytest.mark.gpu

NEW_TOKENS = 8
PROMPTS = [[3 + (11 * i) % 240 for i in range(n)] for n in (37, 9, 64, 20)]


def _generate_batch(model, **cb):
    transformers = archs._transformers()
    gc = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    cfg = transformers.ContinuousBatchingConfig(**cb) if cb else None
    with torch.no_grad():
        out = model.generate_batch(inputs=PROMPTS, generation_config=gc, continuous_batching_config=cfg)
    return [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


def _packed(x, cu_k, block_table):
    """Paged keys (or values) (num_pages, page_size, h_k, d) read through ``block_table`` as the
    packed (total_k, h_k, d) rows of the sequences of ``cu_k``; ``x`` itself without a table."""
    if block_table is None:
        return x
    ck, page = cu_k.tolist(), x.shape[1]
    rows = [x[block_table[i, :-(-(ck[i + 1] - ck[i]) // page)].long()].reshape(-1, *x.shape[2:])[:ck[i + 1] - ck[i]]
            for i in range(len(ck) - 1)]
    return torch.cat(rows)


@pytest.fixture
def checked_kernel(monkeypatch):
    """The paged function's flash_attn_varlen_func, each call's output compared with
    :func:`attention_varlen_ref` (fp32 and in the inputs' dtype); the failures are collected, not
    raised, because generate_batch's loop runs on its own thread and logs exceptions."""
    real = fa_paged.flash_attn_varlen_func
    seen = {"calls": 0, "paged": 0, "failures": []}

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1),
               softcap=0.0, block_table=None, *, s_aux=None):
        out = real(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, block_table=block_table, s_aux=s_aux)
        seen["paged"] += block_table is not None
        k, v = _packed(k, cu_k, block_table), _packed(v, cu_k, block_table)
        kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, s_aux=s_aux)
        ref = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)[0]
        ref_lp = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **kw)[0]
        seen["calls"] += 1
        try:
            assert_close_to_ref(out, ref, ref_lp)
        except AssertionError as e:
            seen["failures"].append(f"cu_q {cu_q.tolist()} cu_k {cu_k.tolist()} window {window_size}: {e}")
        return out

    monkeypatch.setattr(fa_paged, "flash_attn_varlen_func", varlen)
    return seen


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss", "opt"])
@pytest.mark.parametrize("block_size", [256, 16])
def test_generate_batch_calls_match_the_reference(checked_kernel, name, block_size):
    archs.require(name)
    model = archs.build(name, "ferroattn", BF16, device=DEV)
    tokens = _generate_batch(model, block_size=block_size)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * len(PROMPTS), tokens
    # a prefill of the four prompts, then a decode step per token (each over all the layers);
    # the decode steps of full-attention layers run on the cache's pages (block tables)
    assert checked_kernel["calls"] >= NEW_TOKENS * model.config.num_hidden_layers
    assert (checked_kernel["paged"] > 0) == archs.ARCHS[name].full_layers
    assert not checked_kernel["failures"], checked_kernel["failures"][:3]


def test_generate_batch_replays_from_cuda_graphs():
    model = archs.build("llama", "ferroattn", BF16, device=DEV)
    eager = _generate_batch(model, use_cuda_graph=False)
    graphs = _generate_batch(model, use_cuda_graph=True)
    assert [len(t) for t in eager] == [NEW_TOKENS] * len(PROMPTS), eager
    assert graphs == eager
