"""GPU tests of ``attn_implementation="ferroattn"`` across transformers architectures (v5.17):
tiny seeded configs built in code (2 layers, hidden 128, head dim 32, vocab 256, bf16 on CUDA; no
weights from the hub), each run with ferroattn and with the architecture's reference attention
("sdpa", or "eager" where sdpa lacks the feature: Gemma-2's softcap, GPT-OSS's sinks), on a padded
batch of two sequences (37 and 24 real tokens; decoders left-padded, encoders right-padded).

Pass rules (the house rule, reference/api-contracts.md and DESIGN.md §5), with ref32 the same
model in fp32 and ref the reference attention in bf16, over real (non-pad) positions:

- logits: max|ours - ref32| <= 2 · max|ref - ref32| + 1e-3 · max(1, max|ref32|);
- training step (train mode, dropout 0): loss within 3 · |loss_ref - loss_ref32| + 1e-3 of
  ref32's; every parameter gradient finite and max|g - g32| <= 3 · max|g_ref - g32| +
  1e-3 · max|g32| (+ 1e-6);
- greedy ``generate`` (8 new tokens, decoders): the step logits obey the logits rule against
  ref32 teacher-forced on the same tokens, and the tokens equal the reference's, or first differ
  where ref32 ranks the two tokens within that tolerance (a near tie);
- the options reached the kernels: a sliding-window architecture called them with a real
  ``window_size``, Gemma-2 with ``softcap``, GPT-OSS with ``s_aux``;
- attention dropout in train mode (Llama, BERT, p = 0.2): finite gradients, the logits differ
  from the p = 0 logits, the same seed reproduces them.

A kernel feature that the installed ferroattn does not implement yet (local window, softcap,
sinks) skips the tests that need it, with the NotImplementedError's message: a capability probe
calls the flash_attn functions with the combination an architecture needs (e.g. window + sinks,
non-causal window), forward and backward, padded and varlen, once per combination. Any other
error from the probe fails the test. Dropout is implemented (:data:`IMPLEMENTED`): a probe that
finds it missing fails the test instead of skipping it.

Marker ``gpu``: skipped without CUDA; run by scripts/gpu_check.sh (pytest stage), or alone:
``python -m pytest -q -m gpu tests/test_gpu_transformers_archs.py``."""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import pytest
import torch

from _gpu_common import BF16, DEV

pytestmark = pytest.mark.gpu

V = 256                 # vocabulary
LENGTHS = (37, 24)      # real tokens per row; the batch is padded to the longest
NEW_TOKENS = 8
WINDOW = 8              # sliding windows are shorter than both rows

_DIMS = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GQA = dict(_DIMS, num_key_value_heads=2)
_SLIDE_FULL = ["sliding_attention", "full_attention"]
# Where random tiny weights leave an option's effect within bf16 noise, the config makes it
# matter: Gemma-2 softcap 1.0 on weights of std 0.1 (scores of std ~1; at 50 softcapping would be
# a no-op here), BERT / ModernBERT weights of std 0.1 (at 0.02 attention barely moves their
# logits). tests/test_transformers.py checks on the CPU that dropping each option moves the fp32
# logits far beyond the bounds below.


@dataclass(frozen=True)
class Arch:
    """One architecture: transformers model and config class names, config kwargs, the
    reference attention, decoder (left padding, generate) or encoder (right padding), the kernel
    features its attention calls need, the window_size side its sliding layers pass
    (``sliding_window - 1``), and whether it has full-attention layers too."""
    model: str
    config: str
    kwargs: Dict = field(default_factory=dict)
    ref: str = "sdpa"
    decoder: bool = True
    needs: Tuple[str, ...] = ()
    window: Optional[int] = None
    full_layers: bool = True


ARCHS: Dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", _GQA),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", _GQA),
    "qwen2_sliding": Arch("Qwen2ForCausalLM", "Qwen2Config",
                          dict(_GQA, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                          needs=("window",), window=WINDOW - 1),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", dict(_GQA, head_dim=32)),
    "mistral": Arch("MistralForCausalLM", "MistralConfig", dict(_GQA, head_dim=32, sliding_window=WINDOW),
                    needs=("window",), window=WINDOW - 1, full_layers=False),
    # every expert active: routing stays continuous, so bf16 noise cannot flip an expert choice
    "mixtral": Arch("MixtralForCausalLM", "MixtralConfig",
                    dict(_GQA, head_dim=32, num_local_experts=2, num_experts_per_tok=2,
                         experts_implementation="eager")),
    "starcoder2": Arch("Starcoder2ForCausalLM", "Starcoder2Config",
                       dict(_GQA, sliding_window=12, residual_dropout=0.0, embedding_dropout=0.0),
                       needs=("window",), window=11, full_layers=False),
    "phi3": Arch("Phi3ForCausalLM", "Phi3Config", dict(_GQA, sliding_window=16), needs=("window",), window=15,
                 full_layers=False),
    "gemma": Arch("GemmaForCausalLM", "GemmaConfig", dict(_GQA, head_dim=32)),
    "gemma2": Arch("Gemma2ForCausalLM", "Gemma2Config",
                   dict(_GQA, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW, layer_types=_SLIDE_FULL,
                        attn_logit_softcapping=1.0, final_logit_softcapping=30.0, initializer_range=0.1),
                   ref="eager", needs=("window", "softcap"), window=WINDOW - 1),
    "gemma3": Arch("Gemma3ForCausalLM", "Gemma3TextConfig",
                   dict(_GQA, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW, layer_types=_SLIDE_FULL),
                   needs=("window",), window=WINDOW - 1),
    "cohere2": Arch("Cohere2ForCausalLM", "Cohere2Config",
                    dict(_GQA, sliding_window=WINDOW, layer_types=_SLIDE_FULL), needs=("window",),
                    window=WINDOW - 1),
    "gpt_oss": Arch("GptOssForCausalLM", "GptOssConfig",
                    dict(_GQA, intermediate_size=128, head_dim=32, num_local_experts=2, num_experts_per_tok=2,
                         sliding_window=WINDOW, layer_types=_SLIDE_FULL, experts_implementation="eager",
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                    ref="eager", needs=("window", "sinks"), window=WINDOW - 1),
    "olmo2": Arch("Olmo2ForCausalLM", "Olmo2Config", _GQA),
    # attention_multiplier is the softmax scale (not head_dim ** -0.5)
    "granite": Arch("GraniteForCausalLM", "GraniteConfig",
                    dict(_GQA, attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5,
                         logits_scaling=4.0)),
    # rotary on a quarter of the head dim (applied before attention; the kernel sees plain q, k)
    "gpt_neox": Arch("GPTNeoXForCausalLM", "GPTNeoXConfig",
                     dict(_DIMS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.25})),
    "opt": Arch("OPTForCausalLM", "OPTConfig",
                dict(vocab_size=V, hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256, word_embed_proj_dim=128, dropout=0.0, attention_dropout=0.0,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # GPT-2's per-layer scale 1 / (layer_idx + 1) arrives through `scaling`
    "gpt2": Arch("GPT2LMHeadModel", "GPT2Config",
                 dict(vocab_size=V, n_positions=256, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)),
    "bert": Arch("BertForMaskedLM", "BertConfig",
                 dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      pad_token_id=0, initializer_range=0.1),
                 decoder=False),
    # layer 0 global, layer 1 local: bidirectional band |i - j| <= local_attention // 2
    "modernbert": Arch("ModernBertForMaskedLM", "ModernBertConfig",
                       dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, local_attention=2 * WINDOW,
                            global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            cls_token_id=1, sep_token_id=2, initializer_range=0.1),
                       decoder=False, needs=("window",), window=WINDOW),
}
DECODERS = [name for name, a in ARCHS.items() if a.decoder]


def _transformers():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ferroattn.integrations.transformers import register

    register()
    return transformers


def build(name: str, impl: str, dtype: torch.dtype = BF16, state: Optional[dict] = None,
          device: Optional[str] = None, **overrides):
    """The tiny model ``name`` with ``attn_implementation=impl`` in ``dtype`` on ``device``, in eval
    mode: weights seeded (torch.manual_seed(0)) unless ``state`` (a state dict) is given;
    ``overrides`` update the config kwargs; ``device`` None -> DEV."""
    transformers = _transformers()
    arch = ARCHS[name]
    config = getattr(transformers, arch.config)(**dict(arch.kwargs, **overrides), attn_implementation=impl)
    torch.manual_seed(0)
    model = getattr(transformers, arch.model)(config)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device=device or DEV, dtype=dtype).eval()


def models(name: str, dtype: torch.dtype = BF16, device: Optional[str] = None):
    """(ours, ref, ref32): ferroattn in ``dtype``, the reference attention in ``dtype`` and in fp32,
    one set of (``dtype``-valued) weights."""
    arch = ARCHS[name]
    ours = build(name, "ferroattn", dtype, device=device)
    state = ours.state_dict()
    return (ours, build(name, arch.ref, dtype, state, device),
            build(name, arch.ref, torch.float32, state, device))


def batch(name: str, device: Optional[str] = None):
    """(input_ids, attention_mask): two rows of LENGTHS real tokens (ids >= 3), padded with 0 on
    the left (decoders) or the right (encoders), fresh random tokens from a seeded generator."""
    g = torch.Generator().manual_seed(1)
    s = max(LENGTHS)
    ids = torch.randint(3, V, (len(LENGTHS), s), generator=g)
    mask = torch.zeros(len(LENGTHS), s, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        if ARCHS[name].decoder:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device or DEV), mask.to(device or DEV)


def within(ours: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor, factor: float = 2.0):
    """(ok, err, bound) of the rule max|ours - ref32| <= factor · max|ref - ref32| + 1e-3 · max(1, max|ref32|)."""
    ours, ref, ref32 = ours.float(), ref.float(), ref32.float()
    err = (ours - ref32).abs().max().item()
    bound = factor * (ref - ref32).abs().max().item() + 1e-3 * max(1.0, ref32.abs().max().item())
    return err <= bound, err, bound


# ---- capability probes -------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def missing(features: Tuple[str, ...], causal: bool) -> Optional[str]:
    """None when ferroattn's flash_attn_func and flash_attn_varlen_func run the combination of
    ``features`` ("window", "softcap", "sinks", "dropout") with ``causal`` on CUDA: GQA, forward
    and backward, padded and varlen, and a decode-shaped varlen forward (one query per sequence);
    else why not (the NotImplementedError's message, or the absent s_aux parameter). Any other
    error propagates: it is a bug, not a missing feature."""
    import ferroattn

    if "sinks" in features:
        for fn in (ferroattn.flash_attn_func, ferroattn.flash_attn_varlen_func):
            if "s_aux" not in inspect.signature(fn).parameters:
                return f"ferroattn.{fn.__name__} has no s_aux parameter (attention sinks)"
    kwargs = dict(causal=causal)
    if "window" in features:
        kwargs["window_size"] = (3, 3)
    if "softcap" in features:
        kwargs["softcap"] = 1.0
    if "dropout" in features:
        kwargs["dropout_p"] = 0.2
    if "sinks" in features:
        kwargs["s_aux"] = torch.zeros(4, device=DEV, dtype=BF16, requires_grad=True)
    q = torch.randn(1, 16, 4, 32, device=DEV, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(1, 16, 2, 32, device=DEV, dtype=BF16, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=DEV)
    try:
        ferroattn.flash_attn_func(q, k, v, **kwargs).float().sum().backward()
        ferroattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9, **kwargs).float().sum().backward()
        if causal:  # a generate step: one query per sequence, its keys in the cache
            one_each = torch.arange(3, dtype=torch.int32, device=DEV)
            with torch.no_grad():
                ferroattn.flash_attn_varlen_func(q[0, :2], k[0], v[0], one_each, cu, 1, 9,
                                                 **dict(kwargs, dropout_p=0.0))
    except NotImplementedError as e:
        return str(e)
    return None


#: Features ferroattn implements: a probe that reports one of them missing is a failure, not a skip.
IMPLEMENTED = frozenset({"dropout"})


def require(name: str, *extra: str) -> None:
    """Skip unless the kernels support what architecture ``name``'s attention calls need (plus
    ``extra`` features), with the reason; fail when the combination includes a feature of
    :data:`IMPLEMENTED` (e.g. dropout) and the probe still reports something missing."""
    arch = ARCHS[name]
    features = tuple(sorted(set(arch.needs) | set(extra)))
    if features:
        why = missing(features, arch.decoder)
        if why is not None:
            msg = f"{name} needs {', '.join(features)}: {why}"
            if IMPLEMENTED & set(features):
                pytest.fail(f"{msg} (but {', '.join(sorted(IMPLEMENTED & set(features)))} is implemented)")
            pytest.skip(msg)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every flash_attn call the plug-in makes, as its keyword arguments (the real functions run)."""
    from ferroattn.integrations import transformers as fa_hf

    calls = []

    def spy(fn):
        @functools.wraps(fn)  # the same signature: the plug-in inspects it for s_aux
        def wrapper(*args, **kwargs):
            calls.append(kwargs)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fa_hf, "flash_attn_func", spy(fa_hf.flash_attn_func))
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func", spy(fa_hf.flash_attn_varlen_func))
    return calls


def check_options_reached_kernels(name: str, calls) -> None:
    """The architecture's options reached the kernels (``calls``: their keyword arguments): its
    window on its sliding layers and no window elsewhere, softcap iff Gemma-2, s_aux iff GPT-OSS,
    causal iff a decoder."""
    arch = ARCHS[name]
    assert calls, "the ferroattn attention function was never called"
    windows = {tuple(c["window_size"]) for c in calls}
    want = {(arch.window, arch.window)} if arch.window is not None else set()
    if arch.full_layers:
        want.add((-1, -1))
    assert windows == want, (windows, want)
    assert any(c["softcap"] > 0 for c in calls) == ("softcap" in arch.needs)
    assert any(c.get("s_aux") is not None for c in calls) == ("sinks" in arch.needs)
    assert {c["causal"] for c in calls} == {arch.decoder}


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_match_reference(name, kernel_calls):
    require(name)
    ours, ref, ref32 = models(name)
    ids, mask = batch(name)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        check_options_reached_kernels(name, kernel_calls)
        want, want32 = ref(ids, attention_mask=mask).logits, ref32(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.isfinite(got[real]).all()
    ok, err, bound = within(got[real], want[real], want32[real])
    assert ok, f"{name}: max|ours - ref32| = {err:.3e} > {bound:.3e} ({ARCHS[name].ref} bf16 noise x 2)"


def _loss(model, ids, mask, decoder: bool):
    """The model's loss on real tokens only: a decoder predicts token t from position t - 1, so a
    row's first real token (predicted from a pad position, whose output no attention backend
    defines alike) is not a label either."""
    drop = mask == 0
    if decoder:
        drop |= torch.nn.functional.pad(mask[:, :-1], (1, 0)) == 0
    return model(ids, attention_mask=mask, labels=ids.masked_fill(drop, -100)).loss


@pytest.mark.parametrize("name", list(ARCHS))
def test_training_step_gradients_match_reference(name, kernel_calls):
    require(name)
    ids, mask = batch(name)
    losses, grads = [], []
    for model in models(name):
        model.train()
        loss = _loss(model, ids, mask, ARCHS[name].decoder)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    check_options_reached_kernels(name, kernel_calls)
    (l_ours, l_ref, l32), (g_ours, g_ref, g32) = losses, grads
    assert abs(l_ours - l32) <= 3 * abs(l_ref - l32) + 1e-3, (l_ours, l_ref, l32)
    assert g_ours.keys() == g32.keys() and len(g32) > 10
    bad = []
    for n, g in g32.items():
        assert torch.isfinite(g_ours[n]).all(), f"{name}: gradient of {n} is not finite"
        err = (g_ours[n] - g).abs().max().item()
        bound = 3 * (g_ref[n] - g).abs().max().item() + 1e-3 * g.abs().max().item() + 1e-6
        if err > bound:
            bad.append(f"{n}: {err:.3e} > {bound:.3e}")
    assert not bad, f"{name}: {len(bad)} of {len(g32)} gradients over 3x the reference's bf16 error: {bad[:5]}"
    attn = [n for n in g_ours if ".0." in n and any(t in n for t in ("q_proj", "qkv", "Wqkv", "c_attn", "query"))]
    assert attn and all(g_ours[n].abs().max() > 0 for n in attn), attn


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_matches_reference(name):
    require(name)
    ours, ref, ref32 = models(name)
    ids, mask = batch(name)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        g_ours, g_ref = ours.generate(ids, **kw), ref.generate(ids, **kw)
        p = ids.shape[1]
        seq_o, seq_r = g_ours.sequences[:, p:], g_ref.sequences[:, p:]
        assert seq_o.shape == seq_r.shape == (len(LENGTHS), NEW_TOKENS)
        differs = (seq_o != seq_r).any(dim=0).nonzero()
        first = int(differs[0]) if differs.numel() else NEW_TOKENS
        full_mask = torch.cat([mask, torch.ones_like(seq_r)], dim=1)
        # ref32 teacher-forced on the reference's tokens: the same prefix as ours up to `first`
        l32 = ref32(g_ref.sequences, attention_mask=full_mask).logits.float()
    for t in range(min(first + 1, NEW_TOKENS)):
        want32 = l32[:, p - 1 + t]
        ok, err, bound = within(g_ours.logits[t], g_ref.logits[t], want32)
        assert ok, f"{name}: step {t}: max|ours - ref32| = {err:.3e} > {bound:.3e}"
        if t == first:  # the tokens differ here: ref32 must see a near tie between the two
            rows = (seq_o[:, t] != seq_r[:, t]).nonzero().reshape(-1)
            for r in rows.tolist():
                gap = abs(want32[r, seq_r[r, t]].item() - want32[r, seq_o[r, t]].item())
                assert gap <= bound, f"{name}: step {t} row {r}: tokens {int(seq_o[r, t])} vs {int(seq_r[r, t])}, " \
                                     f"ref32 gap {gap:.3e} > {bound:.3e}"


@pytest.mark.parametrize("name,rate", [("llama", dict(attention_dropout=0.2)),
                                       ("bert", dict(attention_probs_dropout_prob=0.2))])
def test_attention_dropout_in_train_mode(name, rate, kernel_calls):
    require(name, "dropout")
    model = build(name, "ferroattn", **rate).train()
    ids, mask = batch(name)
    real = mask.bool()
    logits = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        logits.append(model(ids, attention_mask=mask).logits[real].float())
    assert {c["dropout_p"] for c in kernel_calls} == {0.2}  # the rate in train mode
    assert torch.equal(logits[0], logits[1]), "the same seed gave different dropout masks"
    assert not torch.equal(logits[0], logits[2]), "a different seed gave the same dropout mask"
    n_train = len(kernel_calls)
    with torch.no_grad():
        model.eval()
        plain = model(ids, attention_mask=mask).logits[real].float()
    assert {c["dropout_p"] for c in kernel_calls[n_train:]} == {0.0}
    assert not torch.allclose(logits[0], plain)
    model.train()
    model.zero_grad()
    torch.manual_seed(5)
    _loss(model, ids, mask, ARCHS[name].decoder).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
