"""SparseLinear (state dict, repr, to_dense, forward, .to) and sparsify on a tiny random Llama
(transformers LlamaConfig, 2 layers) on CPU: exactly the chosen layers are converted, the counts
in the report, perplexity before/after with finite logits, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_sparse24_fakes import native  # noqa: F401  (fixture)

from ferroattn import sparse24
from ferroattn._sparse_linear import SparseLinear
from ferroattn.errors import ArgumentError, DTypeError

BF16 = torch.bfloat16


def _linear(n=24, k=40, bias=True, dtype=BF16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).to(dtype)


def test_from_dense_state_dict_round_trip(native):
    lin = _linear()
    sl = SparseLinear.from_dense(lin)
    sd = sl.state_dict()
    assert set(sd) == {"values", "meta", "bias", "_extra_state"}
    assert sd["_extra_state"].tolist() == [24, 40]
    assert sd["meta"].dtype == torch.int16 and sd["values"].dtype == BF16
    assert torch.equal(sd["bias"], lin.bias.detach())
    fresh = SparseLinear(40, 24, dtype=BF16)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 3, 40, dtype=BF16)
    y_ref = F.linear(x, sparse24.prune(lin.weight.detach()), lin.bias.detach())
    assert torch.equal(fresh(x), y_ref)
    assert torch.equal(sl(x), y_ref)
    # the weight view follows load_state_dict (in place) and buffer replacement
    assert fresh.weight.values is fresh.values
    with pytest.raises(ArgumentError, match=r"state_dict: expected .* \(24, 44\), got \(24, 40\)"):
        SparseLinear(44, 24, dtype=BF16).load_state_dict(sd)      # same padded buffers, other shape
    with pytest.raises(RuntimeError, match=r"size mismatch|\(24, 100\), got \(24, 40\)"):
        SparseLinear(100, 24, dtype=BF16).load_state_dict(sd)


def test_no_bias_prune_false_activation_repr_to_dense(native):
    lin = _linear(bias=False)
    with torch.no_grad():
        lin.weight.copy_(sparse24.prune(lin.weight))
    sl = SparseLinear.from_dense(lin, prune=False, activation="silu")
    assert sl.bias is None and set(sl.state_dict()) == {"values", "meta", "_extra_state"}
    x = torch.randn(5, 40, dtype=BF16)
    assert torch.equal(sl(x), F.silu(lin(x)))
    r = repr(sl)
    assert "in_features=40, out_features=24, bias=False" in r and "sparsity=2:4" in r and "silu" in r
    dense = sl.to_dense()
    assert isinstance(dense, torch.nn.Linear) and torch.equal(dense.weight, lin.weight)
    with pytest.raises(ValueError, match="expected a 2:4 sparse matrix"):
        SparseLinear.from_dense(_linear(seed=3), prune=False)


def test_bias_trains_weight_frozen(native):
    sl = SparseLinear.from_dense(_linear())
    x = torch.randn(4, 40, dtype=BF16, requires_grad=True)
    sl(x).float().sum().backward()
    assert sl.bias.grad is not None and torch.equal(sl.bias.grad, torch.full((24,), 4.0, dtype=BF16))
    assert x.grad is not None and not sl.values.requires_grad
    assert [n for n, _ in sl.named_parameters()] == ["bias"]


def test_constructor_errors(native):
    with pytest.raises(DTypeError, match="dtype: expected torch.float16 or torch.bfloat16"):
        SparseLinear(8, 8, dtype=torch.float32)
    with pytest.raises(ArgumentError, match="activation"):
        SparseLinear(8, 8, activation="tanh")
    with pytest.raises(ArgumentError, match="in_features, out_features"):
        SparseLinear(0, 8)
    with pytest.raises(TypeError, match="linear: expected a torch.nn.Linear"):
        SparseLinear.from_dense(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(DTypeError, match="w: expected float16 or bfloat16"):
        SparseLinear.from_dense(torch.nn.Linear(8, 8))


# ---- sparsify ---------------------------------------------------------------------------------

def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(BF16).eval()


MLP = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]


def test_sparsify_default_converts_exactly_the_mlps(native):
    model = _tiny_llama()
    linears_before = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in MLP}
    text = "The quick brown fox jumps over the lazy dog. " * 8
    rep = sparsify_report = sparse24.sparsify(model, text=text)
    assert rep.layers == MLP and rep.n_layers == 6
    for n, m in model.named_modules():
        if n in MLP:
            assert isinstance(m, SparseLinear)
            assert torch.equal(sparse24.decompress(m.weight), sparse24.prune(weights[n]))
        elif n in linears_before:
            assert type(m) is torch.nn.Linear                     # attention projections, lm_head untouched
    total = sum(w.numel() for w in weights.values())
    nnz = sum(int(torch.count_nonzero(w)) for w in weights.values())
    kept = sum(int(torch.count_nonzero(sparse24.prune(w))) for w in weights.values())
    assert sparsify_report.parameters == total and rep.pruned == nnz - kept > 0
    assert rep.tokens == len(text.encode())
    assert rep.logits_finite_before and rep.logits_finite_after
    assert 1.0 < rep.perplexity_before < 1e6 and 1.0 < rep.perplexity_after < 1e6
    assert rep.perplexity_after != rep.perplexity_before
    assert rep.perplexity_ratio == pytest.approx(rep.perplexity_after / rep.perplexity_before)
    assert "6 layers -> SparseLinear" in str(rep) and rep.as_dict()["n_layers"] == 6
    # the converted model still runs and a second sparsify finds nothing left to convert
    with pytest.raises(ArgumentError, match="filter: expected to match at least one nn.Linear"):
        sparse24.sparsify(model)


def test_sparsify_custom_filter_and_tokenizer(native):
    model = _tiny_llama()
    seen = []

    def tok(text):
        seen.append(text)
        return {"input_ids": [3, 5, 7, 11, 13, 17, 19, 23]}
    rep = sparse24.sparsify(model, lambda name, mod: name.endswith("down_proj"), text="abc", tokenizer=tok)
    assert rep.layers == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert seen == ["abc"] and rep.tokens == 8
    assert isinstance(model.model.layers[0].mlp.up_proj, torch.nn.Linear)
    assert rep.perplexity_before is not None and rep.logits_finite_after


def test_sparsify_errors(native):
    model = _tiny_llama()
    with pytest.raises(ArgumentError, match="filter"):
        sparse24.sparsify(model, lambda n, m: False)
    with pytest.raises(ArgumentError, match="text: expected at least 2 tokens"):
        sparse24.sparsify(model, text="a")
    with pytest.raises(DTypeError, match=r"model.layers.0.mlp.gate_proj: expected a float16 or bfloat16 weight"):
        sparse24.sparsify(model.float())
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: w: expected a 2:4 sparse matrix"):
        sparse24.sparsify(model.to(BF16), prune=False)
    # no text: no perplexity
    rep = sparse24.sparsify(model)
    assert rep.perplexity_before is None and rep.perplexity_ratio is None and rep.n_layers == 6


def test_reexported_by_ferroattn_nn():
    import ferroattn.nn as fnn
    assert fnn.SparseLinear is SparseLinear


def test_compiled_forward_traces_in_one_graph(native):
    """torch.compile(fullgraph=True) of SparseLinear (meta tensors: the dense path) and of the
    kernel path through the layer's weight (the op's fake impl): no graph break."""
    from torch._dynamo.testing import CompileCounterWithBackend
    sl = SparseLinear(64, 48, activation="relu", device="meta", dtype=BF16)
    x = torch.empty(2, 9, 64, dtype=BF16, device="meta")
    cnt = CompileCounterWithBackend("eager")
    y = torch.compile(sl, backend=cnt, fullgraph=True)(x)
    assert y.shape == (2, 9, 48) and cnt.frame_count == 1

    def kernel_path(x):
        return sparse24.matmul(x, sl.weight, sl.bias, "silu", backend="sparse")
    cnt2 = CompileCounterWithBackend("eager")
    assert torch.compile(kernel_path, backend=cnt2, fullgraph=True)(x).shape == (2, 9, 48)
    assert cnt2.frame_count == 1


# ---- adversarial review (issue 4) ----------------------------------------------------------
@pytest.mark.parametrize("convert", [lambda m: m.float(), lambda m: m.double(), lambda m: m.to(torch.float32)])
def test_float_conversion_keeps_the_layer_whole(native, convert):
    lin = _linear(n=4, k=8, dtype=torch.float16)
    sl = SparseLinear.from_dense(lin)
    x = torch.randn(2, 8, dtype=torch.float16)
    y0 = sl(x)
    assert convert(sl) is sl
    assert sl.values.dtype == sl.bias.dtype == torch.float16 and sl.meta.dtype == torch.int16
    assert sl.weight.dtype == torch.float16 and torch.equal(sl(x), y0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, dtype=torch.float16), SparseLinear.from_dense(lin),
                                torch.nn.Linear(4, 4, dtype=torch.float16))
    convert(model)   # the whole model converts; the 2:4 layer stays 16-bit and usable
    assert model[0].weight.dtype == model[2].weight.dtype != torch.float16
    assert model[1].values.dtype == model[1].bias.dtype == torch.float16
    assert torch.equal(model[1](x), y0)
    # 16-bit conversions still apply
    sl.to(BF16)
    assert sl.values.dtype == sl.bias.dtype == sl.weight.dtype == BF16


def test_from_dense_prune_must_be_a_bool(native):
    with pytest.raises(TypeError, match=r"^prune: expected a bool, got str 'no'"):
        SparseLinear.from_dense(_linear(n=4, k=8), prune="no")


def test_activation_list_is_an_argument_error(native):
    with pytest.raises(ArgumentError, match=r"^activation: .*\['relu'\]"):
        SparseLinear(8, 4, activation=["relu"])


def test_sparsify_prune_must_be_a_bool(native):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4).to(BF16))
    with pytest.raises(TypeError, match=r"^prune: expected a bool, got NoneType"):
        sparse24.sparsify(model, lambda name, mod: True, prune=None)
    assert isinstance(model[0], torch.nn.Linear) and not isinstance(model[0], SparseLinear)
