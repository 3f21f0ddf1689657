"""ferroattn.nn.Linear without a GPU: the torch.nn.Linear drop-in contract (parameters, state
dict both ways, initialisation, repr, isinstance), from_torch sharing the parameters, the forward
through ferroattn.matmul (meta tensors, and CPU tensors with the contract emulation of
test_gemm_emulated.py standing in for the kernel), the torch path for inputs the kernels do not
take, and the lazy SparseLinear re-export."""
from __future__ import annotations

import copy
import importlib
import re

import pytest
import torch
import torch.nn.functional as F

import ferroattn.nn as fnn
import ferroattn.ops.gemm as ops_gemm
from ferroattn import errors

from test_gemm_emulated import ContractNative, rust_check_or_contract

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def contract(monkeypatch):
    rust_check_or_contract(monkeypatch)


def test_is_a_torch_linear_with_the_same_parameters_and_state_dict():
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    torch.manual_seed(0)
    ours = fnn.Linear(16, 8)
    assert isinstance(ours, torch.nn.Linear)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()] == ["weight", "bias"]
    assert ours.weight.shape == (8, 16) and ours.bias.shape == (8,)
    # same initialisation (torch's reset_parameters under the same seed)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    sd = ref.state_dict()
    assert list(ours.state_dict()) == list(sd)
    ours2 = fnn.Linear(16, 8, activation="gelu")
    ours2.load_state_dict(sd)
    assert torch.equal(ours2.weight, ref.weight)
    back = torch.nn.Linear(16, 8)
    back.load_state_dict(ours2.state_dict())
    assert torch.equal(back.bias, ref.bias)


def test_no_bias_and_dtype_device():
    m = fnn.Linear(4, 3, bias=False, dtype=BF16, device="meta")
    assert m.bias is None and m.weight.dtype == BF16 and m.weight.device.type == "meta"
    assert list(m.state_dict()) == ["weight"]


def test_repr_matches_torch_and_shows_the_options():
    assert repr(fnn.Linear(4, 3)) == repr(torch.nn.Linear(4, 3)) == "Linear(in_features=4, out_features=3, bias=True)"
    assert repr(fnn.Linear(4, 3, bias=False, activation="silu", backend="wmma")) == \
        "Linear(in_features=4, out_features=3, bias=False, activation='silu', backend='wmma')"


def test_bad_activation_names_the_argument():
    with pytest.raises(errors.ArgumentError, match=r"^activation: .*'swish'"):
        fnn.Linear(4, 3, activation="swish")


def test_from_torch_shares_parameters():
    lin = torch.nn.Linear(6, 5, dtype=BF16).eval()
    ours = fnn.Linear.from_torch(lin, activation="relu")
    assert ours.weight is lin.weight and ours.bias is lin.bias
    assert not ours.training and ours.activation == "relu"
    assert [p for p in ours.parameters()] == [lin.weight, lin.bias]
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert torch.equal(ours.weight, lin.weight)  # in-place changes show in both
    independent = copy.deepcopy(ours)
    assert independent.weight is not lin.weight and torch.equal(independent.weight, lin.weight)
    no_bias = fnn.Linear.from_torch(torch.nn.Linear(6, 5, bias=False))
    assert no_bias.bias is None
    with pytest.raises(TypeError, match=r"^linear: expected a torch.nn.Linear"):
        fnn.Linear.from_torch(torch.nn.Conv1d(2, 2, 1))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_cpu_fp32_runs_torch_math(activation):
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4)
    ours = fnn.Linear.from_torch(lin, activation=activation)
    x = torch.randn(3, 2, 8)
    y = lin(x)
    ref = {None: y, "relu": torch.relu(y), "gelu": F.gelu(y), "gelu_tanh": F.gelu(y, approximate="tanh"),
           "silu": F.silu(y)}[activation]
    assert torch.allclose(ours(x), ref)


def test_meta_forward_goes_through_the_op():
    ours = fnn.Linear(64, 32, dtype=BF16, device="meta", activation="gelu")
    x = torch.empty(2, 5, 64, dtype=BF16, device="meta")
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        y = ours(x)
    assert y.shape == (2, 5, 32) and y.dtype == BF16
    assert counter.get_flop_counts()["Global"][torch.ops.ferroattn.gemm] == 2 * 10 * 32 * 64


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """Route CPU bf16 inputs to ferroattn.matmul, with the contract emulation as the kernel."""
    fake = ContractNative()
    monkeypatch.setattr(ops_gemm, "_native", fake)
    monkeypatch.setattr(fnn, "_use_kernel", lambda x, w: x.dtype in (torch.float16, torch.bfloat16))
    return fake


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_forward_and_backward_match_torch_linear(kernel_on_cpu, activation):
    torch.manual_seed(2)
    lin = torch.nn.Linear(16, 8, dtype=BF16)
    ours = fnn.Linear.from_torch(lin, activation=activation)
    x = torch.randn(3, 5, 16).to(BF16).requires_grad_()
    y = ours(x)
    call = kernel_on_cpu.calls[0]
    assert call["b"][0] == lin.weight.data_ptr() and call["b"][2][1:] == (1, 16)  # weight.T read in place
    assert call["bias"] and call["activation"] == ("gelu_erf" if activation else "none")
    ref_x = x.detach().float().requires_grad_()
    ref_w, ref_b = lin.weight.detach().float().requires_grad_(), lin.bias.detach().float().requires_grad_()
    ref = F.linear(ref_x, ref_w, ref_b)
    ref = F.gelu(ref) if activation else ref
    dy = torch.randn(3, 5, 8)
    assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    gx, gw, gb = torch.autograd.grad((y.float() * dy).sum(), [x, lin.weight, lin.bias])
    rx, rw, rb = torch.autograd.grad((ref * dy).sum(), [ref_x, ref_w, ref_b])
    for g, r in ((gx, rx), (gw, rw), (gb, rb)):
        assert g.shape == r.shape and (g.float() - r).abs().max() <= 2e-2 * r.abs().max()


def test_sparse_linear_is_reexported_lazily():
    mod = importlib.import_module("ferroattn.nn")
    try:
        importlib.import_module("ferroattn._sparse_linear")
    except ModuleNotFoundError:
        with pytest.raises(AttributeError, match="SparseLinear"):
            mod.SparseLinear
        assert not hasattr(mod, "SparseLinear")
    else:
        from ferroattn._sparse_linear import SparseLinear
        assert mod.SparseLinear is SparseLinear
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mod.Nope


def test_compile_fullgraph_fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with FakeTensorMode():
        mlp = torch.nn.Sequential(fnn.Linear(64, 128, activation="gelu", device="cuda", dtype=BF16),
                                  fnn.Linear(128, 64, device="cuda", dtype=BF16))
        x = torch.empty(2, 5, 64, dtype=BF16, device="cuda")
        out = torch.compile(mlp, fullgraph=True, backend=backend)(x)
    assert out.shape == (2, 5, 64) and len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.ferroattn.gemm.default) == 2


# ---- adversarial review (issue 4) ----------------------------------------------------------
def test_1d_input_gives_out_features_on_every_path():
    torch.manual_seed(0)
    m = fnn.Linear(8, 3)                                        # CPU fp32: the torch path
    x = torch.randn(8)
    assert m(x).shape == (3,) and torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))
    mk = fnn.Linear(8, 3, device="meta", dtype=BF16, activation="silu")   # the kernel path (shapes)
    y = mk(torch.empty(8, device="meta", dtype=BF16))
    assert y.shape == torch.nn.Linear(8, 3, device="meta", dtype=BF16)(torch.empty(8, device="meta",
                                                                                  dtype=BF16)).shape == (3,)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("meta", BF16)])
@pytest.mark.parametrize("x_shape", [(2, 7), (7,), ()])
def test_wrong_last_dim_names_x_and_in_features(device, dtype, x_shape):
    m = fnn.Linear(8, 3, device=device, dtype=dtype)
    x = torch.zeros(x_shape, device=device, dtype=dtype)
    with pytest.raises(errors.ArgumentError,
                       match=rf"^x: expected shape \(\.\.\., in_features\) with in_features = 8, "
                             rf"got shape {re.escape(str(tuple(x_shape)))}$"):
        m(x)


def test_linear_rejects_bad_backend_at_construction():
    """A backend other than auto / wmma / sm90 is an ArgumentError naming it when the module is built
    (as a bad activation is), not silently accepted until a CUDA forward."""
    from ferroattn.errors import ArgumentError
    with pytest.raises(ArgumentError, match="^backend: expected one of 'auto', 'wmma', 'sm90', got 'xx'"):
        fnn.Linear(128, 96, backend="xx")
    with pytest.raises(ArgumentError, match="^backend: "):
        fnn.Linear.from_torch(torch.nn.Linear(8, 4), backend="tensor_cores")
