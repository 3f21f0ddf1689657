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
        meta_kw = {name: meta(x) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
        flash_attn_varlen_func(meta(q).as_strided(q.shape, q.stride()), meta(k), meta(v), meta(cu_q), meta(cu_k),
                               max_q, max_k, s_aux=None if s_aux is None else meta(s_aux), **meta_kw)
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
    """Each prompt alone through plain ``generate``, greedy, without an end-of-sequence token (as
    generate_batch runs here)."""
    gc = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist() for p in PROMPTS]


def _assert_same_tokens(ref, got, want):
    """``got == want`` (per request), except where the two first differ at a near tie of the
    reference: there the reference's logits (teacher-forced on its own tokens) of the two tokens
    must be within fp32 noise of each other (a batched and a single run add in other orders, and
    another CPU's kernels may too); what follows a tie is not compared."""
    for prompt, g, w in zip(PROMPTS, got, want):
        t = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if t is None:
            assert len(g) == len(w)
            continue
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + w[:t]])).logits[0, -1]
        gap = (logits[w[t]] - logits[g[t]]).abs().item()
        assert gap <= 1e-4 * max(1.0, logits.abs().max().item()), \
            f"request {prompt[:3]}...: token {t} is {g[t]}, the reference's {w[t]} (logit gap {gap:.3e}): {g} vs {w}"


_SMALL = dict(vocab_size=archs.V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, sliding_window=archs.WINDOW)
#: Models beyond test_gpu_transformers_archs.ARCHS: (model class, config class, config kwargs).
#: EXAONE-4's full-attention layers keep a sliding_window attribute and pass sliding_window=None.
EXTRA = {"exaone4": ("Exaone4ForCausalLM", "Exaone4Config", dict(_SMALL, layer_types=archs._SLIDE_FULL[::-1]))}


def _build(name, impl, state=None):
    """fp32 CPU model ``name`` (ARCHS or EXTRA) under ``impl``, weights at std 0.2 (peaked logits:
    a wrong option changes tokens) unless ``state`` is given."""
    if name in EXTRA:
        fa_hf.register()
        model_cls, config_cls, kw = EXTRA[name]
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**kw, initializer_range=0.2, attn_implementation=impl)
        model = getattr(transformers, model_cls)(config)
        if state is not None:
            model.load_state_dict(state)
        return model.eval()
    wide = dict(init_std=0.2) if name == "opt" else dict(initializer_range=0.2)
    return archs.build(name, impl, torch.float32, state, device="cpu", **wide)


_REF = {"exaone4": "sdpa"}
#: (window of the sliding layers or None, has full-attention layers)
_LAYERS = {"exaone4": (archs.WINDOW - 1, True)}


@pytest.mark.parametrize("name", archs.DECODERS + sorted(EXTRA))
def test_generate_batch_equals_each_prompt_alone_on_the_reference(paged_kernels, name):
    arch = archs.ARCHS.get(name)
    ours = _build(name, "ferroattn")
    ref = _build(name, _REF[name] if arch is None else arch.ref, ours.state_dict())
    got = _generate_batch(ours)
    assert ours.config._attn_implementation == "ferroattn"   # continuous batching switched back
    _assert_same_tokens(ref, got, _generate_alone(ref))

    calls = [c for c in paged_kernels if c["kind"] == "varlen"]
    # the prefill step packs the three prompts (in the scheduler's order); decode steps run one
    # query per request
    cu = calls[0]["cu_q"]
    assert sorted(b - a for a, b in zip(cu, cu[1:])) == sorted(map(len, PROMPTS))
    assert any(c["max_q"] == 1 and len(c["cu_q"]) == len(PROMPTS) + 1 for c in calls)
    assert {c["causal"] for c in calls} == {True}
    window, full = _LAYERS[name] if arch is None else (arch.window, arch.full_layers)
    assert {tuple(c["window_size"]) for c in calls} == ({(window, 0)} if window is not None else set()) | \
        ({(-1, -1)} if full else set())
    needs = () if arch is None else arch.needs
    assert {c["softcap"] for c in calls} == ({1.0} if "softcap" in needs else {0.0})
    assert all((c["s_aux"] is not None) == ("sinks" in needs) for c in calls)
    # the keys the kernel reads: the cache's pages through a block table on the decode steps of
    # full-attention layers (one table row per request, enough pages for its keys), else the keys
    # the cache gathered for that layer
    paged = [c for c in calls if c["block_table"] is not None]
    assert all(c["shapes"][1][0] == c["cu_k"][-1] for c in calls if c["block_table"] is None)
    for c in paged:
        page = c["shapes"][1][1]
        assert c["max_q"] == 1 and tuple(c["window_size"]) == (-1, -1)
        assert len(c["block_table"]) == len(c["cu_k"]) - 1
        assert all(len(row) * page >= b - a for row, a, b in zip(c["block_table"], c["cu_k"], c["cu_k"][1:]))
    # every decode step of a full-attention layer runs on the pages; sliding layers and prefill gather
    assert bool(paged) == full
    assert not any(c["block_table"] is not None and c["max_q"] > 1 for c in calls)
    if name in ("granite", "opt"):   # the scale the model passes (OPT's q_proj scales: 1.0)
        assert {c["softmax_scale"] for c in calls} == {0.1 if name == "granite" else 1.0}


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen2"])
@pytest.mark.parametrize("block_size,max_batch_tokens", [(4, None), (4, 16), (5, None)])
def test_block_tables_over_many_pages_give_each_prompt_alones_tokens(paged_kernels, name, block_size, max_batch_tokens):
    """Small pages (every request spans several, the last one partial; 5 is not a power of two)
    and, with a 16-token budget, chunked prefill: the decode steps' block tables read off
    read_index give each request the tokens of the reference generating it alone."""
    arch = archs.ARCHS[name]
    ours = _build(name, "ferroattn")
    ref = _build(name, arch.ref, ours.state_dict())
    gc = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(block_size=block_size, max_batch_tokens=max_batch_tokens)
    with torch.no_grad():
        out = ours.generate_batch(inputs=PROMPTS, generation_config=gc, continuous_batching_config=cb,
                                  progress_bar=False)
    got = [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    assert [len(t) for t in got] == [NEW_TOKENS] * len(PROMPTS), got
    _assert_same_tokens(ref, got, _generate_alone(ref))
    paged = [c for c in paged_kernels if c["kind"] == "varlen" and c["block_table"] is not None]
    assert paged and max(len(row) for c in paged for row in c["block_table"]) >= -(-max(map(len, PROMPTS)) // block_size)
    assert {c["shapes"][1][1] for c in paged} == {block_size}


@pytest.mark.parametrize("name,option", [("mistral", "window"), ("gemma2", "softcap"), ("gpt_oss", "sinks")])
def test_the_options_matter(paged_kernels, name, option):
    """The fake kernel ignoring the option changes the tokens: the option reaching the kernel is
    what makes the batch equal the reference (the test above cannot pass without it)."""
    ours = archs.build(name, "ferroattn", torch.float32, device="cpu")
    want = _generate_batch(ours)
    paged_kernels.drop.add(option)
    assert _generate_batch(ours) != want


class _GatherCache:
    """A cache whose layer 0 is in a full-attention group and whose update returns the new keys."""
    sliding_windows = {0: 1}

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        return key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)


def test_the_keys_offsets_follow_the_caches_group_and_the_window_the_model_passes(paged_kernels):
    """A layer the cache groups as full attention that passes a window (Mistral with a
    full-attention layer_types entry): the offsets of the keys the cache gathered
    ("full_attention") with the window the attention asks for."""
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    full, sliding = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32)
    fa_paged.ferroattn_paged_attention_forward(
        _Layer(), q, k, k, None, cache=_GatherCache(), read_index=[], write_index=[], sliding_window=3,
        cu_seq_lens_q=full, cu_seq_lens_k={"full_attention": full, "sliding_attention": sliding}, max_seqlen_q=3,
        max_seqlen_k={"full_attention": 3, "sliding_attention": 4})
    call = paged_kernels[-1]
    assert call["cu_k"] == [0, 2, 5] and call["max_k"] == 3 and call["window_size"] == (2, 0)


class _Layer(torch.nn.Module):
    layer_idx, scaling = 0, None


def test_errors_name_the_argument():
    q = torch.zeros(1, 4, 3, 8)
    k = torch.zeros(1, 2, 3, 8)
    cache = type("Cache", (), {"sliding_windows": {0: 1}})()
    cu = torch.tensor([0, 3], dtype=torch.int32)
    ok = dict(cache=cache, read_index=[], write_index=[], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_seqlen_q=3,
              max_seqlen_k=3)
    f = fa_paged.ferroattn_paged_attention_forward
    for change, match in [
        (dict(cu_seq_lens_q=None), "^cu_seq_lens_q: expected a 1-D int32/int64 tensor of offsets, got NoneType"),
        (dict(cu_seq_lens_k=[0, 3]), "^cu_seq_lens_k: expected a 1-D int32/int64 tensor of offsets, got list"),
        (dict(cu_seq_lens_q=cu.float()), "^cu_seq_lens_q: .* got torch.float32 \\(2,\\)"),
        (dict(max_seqlen_q=None), "^max_seqlen_q: expected an int, got NoneType"),
        (dict(max_seqlen_k=3.0), "^max_seqlen_k: expected an int, got float"),
        (dict(cu_seq_lens_k={"sliding_attention": cu}, max_seqlen_k={"sliding_attention": 3}),
         "^cu_seq_lens_k: expected an entry for the layer's 'full_attention', got keys \\['sliding_attention'\\]"),
        (dict(sliding_window=True), "^sliding_window: expected None or an int >= 1, got True"),
        (dict(sliding_window=-1), "^sliding_window: expected None or an int >= 1, got -1"),
    ]:
        with pytest.raises(ArgumentError, match=match):
            f(_Layer(), q, k, k, None, **dict(ok, **change))
    with pytest.raises(ArgumentError, match="^query: expected a packed \\(1, heads, tokens, head_dim\\) tensor, "
                                            "got \\(4, 3, 8\\)"):
        f(_Layer(), q[0], k, k, None, **ok)
    with pytest.raises(ArgumentError, match="^module: expected an attention layer with an int layer_idx, got None"):
        f(torch.nn.Module(), q, k, k, None, **ok)
    with pytest.raises(ArgumentError, match="^cache: 'paged\\|ferroattn' runs the packed inputs"):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None)
    with pytest.raises(ArgumentError, match="^read_index: 'paged\\|ferroattn' needs"):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None, cache=object(), write_index=[])
    with pytest.raises(NotImplementedError, match="^block_table: "):
        fa_paged.ferroattn_paged_attention_forward(_Layer(), q, k, k, None, cache=object(), read_index=[],
                                                   write_index=[], block_table=torch.zeros(1, 1, 1))


def _one_group_cache(allocator, head_dim=16, block_size=4, blocks=3, heads_k=2):
    from types import SimpleNamespace
    return SimpleNamespace(layer_index_to_group_indices={0: (0, 0)}, sliding_windows={0: 1}, block_size=block_size,
                           key_cache=[torch.zeros(blocks * block_size, heads_k, head_dim)],
                           value_cache=[torch.zeros(blocks * block_size, heads_k, head_dim)],
                           group_cache_managers=[allocator])


def test_pages_declines_what_a_block_table_would_read_wrong_or_copy_whole():
    """The block-table path takes a full-attention group of transformers' allocator (whole blocks
    in order) and nothing else: another allocator's slots, a head dim the kernels take only
    zero-padded (the pad would copy the whole cache), a query count out of range (the gathered
    path's validation names it) or no kv heads leave the layer to the gathered path, with
    nothing written."""
    from transformers.generation.continuous_batching.cache_manager import FullAttentionCacheAllocator

    full = FullAttentionCacheAllocator(0, 4, allow_block_sharing=False)
    read, write, cu_k = [torch.arange(6)], [torch.tensor([5])], torch.tensor([0, 6], dtype=torch.int32)

    def pages(cache, d=16, max_q=1, heads=4, heads_k=2):
        key = torch.randn(1, heads_k, 1, d)
        return fa_paged._pages(cache, 0, key, key, read, write, cu_k, max_q, 6, heads)

    cache = _one_group_cache(full)
    got = pages(cache)
    assert got is not None and got[2].tolist() == [[0, 1]]
    assert cache.key_cache[0][5].abs().sum() > 0                  # the new key in its slot
    for cache, kw in [(_one_group_cache(object()), {}), (_one_group_cache(full, head_dim=12), dict(d=12)),
                      (_one_group_cache(full), dict(max_q=-1)), (_one_group_cache(full), dict(max_q=2**63)),
                      (_one_group_cache(full, heads_k=0), dict(heads_k=0))]:
        assert pages(cache, **kw) is None, kw
        assert cache.key_cache[0].abs().sum() == 0, kw            # nothing written
