"""ferroattn.sparse24 on CPU: the pruning rule (ties, NaN, inf, signed zeros, partial groups),
compress/decompress bitwise round trips through the Rust host reference (and the fake stand-in of
test_sparse24_fakes), the 2:4 check and its error, Sparse24Tensor validation, matmul's CPU
(dense) path and row flattening, the dispatch table."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_sparse24_fakes import any_native, native  # noqa: F401  (fixtures)

import ferroattn._native as _native
from ferroattn import sparse24
from ferroattn.errors import ArgumentError, DeviceError, DTypeError

BF16, FP16 = torch.bfloat16, torch.float16
NAN, INF = float("nan"), float("inf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _reference_prune(w: torch.Tensor) -> torch.Tensor:
    """Brute force on Python floats: per group keep the 2 largest by (NaN, inf, |x|), ties to the
    lower index; a partial group is ranked with zero padding. Kept elements are w's own (bits)."""
    rows = w.reshape(-1, w.shape[-1]).double().tolist()
    keep = []
    for r in rows:
        o = [False] * len(r)
        for s in range(0, len(r), 4):
            grp = r[s:s + 4] + [0.0] * (4 - len(r[s:s + 4]))

            def key(i):
                x = abs(grp[i])
                return (2 if math.isnan(x) else 1 if math.isinf(x) else 0, 0.0 if not math.isfinite(x) else x, -i)
            for i in sorted(range(4), key=key, reverse=True)[:2]:
                if s + i < len(r):
                    o[s + i] = True
        keep.append(o)
    mask = torch.tensor(keep, dtype=torch.bool).reshape(w.shape)
    return torch.where(mask, w, torch.zeros((), dtype=w.dtype))


# ---- prune ----------------------------------------------------------------------------------

@pytest.mark.parametrize("group, kept", [
    ([1.0, 1.0, 1.0, 1.0], [1, 1, 0, 0]),          # all tied: the two lowest indices
    ([0.5, -3.0, 3.0, 1.0], [0, 1, 1, 0]),         # -3 and 3 tie on magnitude, both beat the rest
    ([2.0, 0.0, -2.0, 2.0], [1, 0, 1, 0]),         # three-way tie: indices 0 and 2
    ([0.0, -0.0, 0.0, 0.0], [1, 1, 0, 0]),         # signed zeros have equal magnitude
    ([1.0, NAN, 5.0, INF], [0, 1, 0, 1]),          # NaN above inf above finite: both kept
    ([-INF, 7.0, INF, 1e4], [1, 0, 1, 0]),         # +-inf tie: the lower index first, both kept
    ([NAN, NAN, NAN, 1.0], [1, 1, 0, 0]),
    ([0.0, 0.0, 0.0, -1.0], [1, 0, 0, 1]),         # one non-zero: kept, plus the first zero
])
@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32])
def test_prune_rule(group, kept, dtype):
    w = torch.tensor([group], dtype=dtype)
    p = sparse24.prune(w)
    expect = torch.where(torch.tensor([kept], dtype=torch.bool), w, torch.zeros((), dtype=dtype))
    assert torch.equal(_bits(p), _bits(expect)), (group, p)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6, 7, 13, 64, 1001])
@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32, torch.float64])
def test_prune_matches_brute_force(k, dtype):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(7, k, generator=g).to(dtype)
    # ties, signed zeros and non-finite values sprinkled in
    w[0, ::3] = 2.0
    w[1, 1::2] = -2.0
    w[2, ::5] = -0.0
    w[3, ::7] = NAN
    w[4, 2::6] = INF
    w[5, ::4] = -INF
    p = sparse24.prune(w)
    assert p.shape == w.shape and p.dtype == w.dtype and p.is_contiguous()
    assert torch.equal(_bits(p), _bits(_reference_prune(w)))
    assert sparse24.is_sparse24(p)
    assert torch.equal(_bits(sparse24.prune(p)), _bits(p))      # idempotent


def test_prune_any_rank_strides_and_no_alias():
    w = torch.randn(3, 4, 16, dtype=BF16)
    wt = w.transpose(0, 1)                                       # non-contiguous
    p = sparse24.prune(wt)
    assert torch.equal(_bits(p), _bits(sparse24.prune(wt.contiguous())))
    assert p.data_ptr() != wt.data_ptr()
    before = wt.clone()
    sparse24.prune(wt)
    assert torch.equal(_bits(wt), _bits(before))                 # input untouched
    # chunking over rows gives the same result as one shot (a tall matrix crosses chunk borders)
    tall = torch.randn(70000, 64, dtype=BF16)
    ref = torch.cat([sparse24.prune(tall[i:i + 10000]) for i in range(0, 70000, 10000)])
    assert torch.equal(_bits(sparse24.prune(tall)), _bits(ref))


def test_prune_errors():
    with pytest.raises(TypeError, match="w: expected a torch.Tensor"):
        sparse24.prune([1.0, 2.0])
    with pytest.raises(DTypeError, match="w: expected a float16"):
        sparse24.prune(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="rank >= 1"):
        sparse24.prune(torch.tensor(1.0))
    assert sparse24.prune(torch.empty(0, 8)).shape == (0, 8)


def test_is_sparse24_counts_nan_as_nonzero():
    assert sparse24.is_sparse24(torch.tensor([[1.0, 0.0, 0.0, 2.0]]))
    assert not sparse24.is_sparse24(torch.tensor([[1.0, 0.0, NAN, 2.0]]))
    assert sparse24.is_sparse24(torch.tensor([[0.0, -0.0, 0.0, 0.0, 1.0, 2.0]]))


# ---- compress / decompress ------------------------------------------------------------------

SHAPES = [(1, 1), (1, 4), (3, 5), (17, 127), (64, 64), (65, 130), (100, 1001), (128, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_round_trip_bitwise(native, shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = sparse24.prune(torch.randn(*shape, generator=g).to(dtype))
    t = sparse24.compress(w)
    lay = _native.sparse24_layout(*shape)
    assert tuple(t.values.shape) == tuple(lay["values_shape"]) and t.values.dtype == dtype
    assert tuple(t.meta.shape) == tuple(lay["meta_shape"]) and t.meta.dtype == torch.int16
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    back = sparse24.decompress(t)
    assert back.shape == shape and back.dtype == dtype and back.is_contiguous()
    assert torch.equal(_bits(back), _bits(w))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_compress_prune_equals_prune(native, dtype):
    """The kernels' rule (host reference) == sparse24.prune, including ties, NaN, inf, -0.0."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(33, 103, generator=g).to(dtype)
    w[0, :] = 1.0
    w[1, ::2] = -1.0
    w[2, ::3] = NAN
    w[3, 1::4] = INF
    w[4, ::2] = -INF
    w[5, :] = -0.0
    w[6, ::5] = 0.0
    back = sparse24.decompress(sparse24.compress(w, prune=True))
    assert torch.equal(_bits(back), _bits(sparse24.prune(w)))


def test_round_trip_special_values(native):
    # a 2:4 matrix holding NaN, +-inf and subnormals survives bitwise
    w = torch.tensor([[NAN, 0.0, 0.0, -INF, INF, 0.0, 0.0, 0.0],
                      [0.0, 1e-7, -1e-7, 0.0, 0.0, 0.0, 0.0, 3.0]], dtype=FP16)
    back = sparse24.decompress(sparse24.compress(w))
    assert torch.equal(_bits(back), _bits(w))


def test_round_trip_negative_zero(native):
    """-0.0 is a zero (not counted as a non-zero): where a group has more zero-valued elements than
    free slots, which zero keeps its sign is the kernels' choice; every non-zero keeps its bits and
    every other element comes back as a zero."""
    w = torch.tensor([[-0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.0, -0.0, 1.0, -0.0, 2.0]], dtype=BF16)
    back = sparse24.decompress(sparse24.compress(w))
    nz = w != 0
    assert torch.equal(_bits(back)[nz], _bits(w)[nz])
    assert bool((back[~nz] == 0).all())


def test_compress_rejects_dense_and_counts_groups(native):
    w = torch.ones(3, 10, dtype=BF16)      # 3 rows x (2 full groups of 4 non-zeros + a partial group of 2)
    with pytest.raises(ValueError, match=r"w: expected a 2:4 sparse matrix .* got 6 of 9 groups") as e:
        sparse24.compress(w)
    assert "prune=True" in str(e.value)
    w[1, :4] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="got 5 of 9 groups"):
        sparse24.compress(w)
    t = sparse24.compress(w, prune=True)
    assert sparse24.is_sparse24(sparse24.decompress(t))


def test_compress_argument_errors(any_native):
    with pytest.raises(TypeError, match="w: expected a torch.Tensor"):
        sparse24.compress([[1.0]])
    with pytest.raises(DTypeError, match="w: expected float16 or bfloat16, got torch.float32"):
        sparse24.compress(torch.zeros(4, 4))
    with pytest.raises(ArgumentError, match=r"w: expected a 2-D \(m, k\) matrix .* got shape \(4,\)"):
        sparse24.compress(torch.zeros(4, dtype=BF16))
    with pytest.raises(ArgumentError, match=r"got shape \(0, 4\)"):
        sparse24.compress(torch.zeros(0, 4, dtype=BF16))
    with pytest.raises(TypeError, match="t: expected a Sparse24Tensor"):
        sparse24.decompress(torch.zeros(4, 4, dtype=BF16))


def test_compress_non_contiguous_and_grad(native):
    w = sparse24.prune(torch.randn(16, 24, dtype=BF16)).t().contiguous().t()   # last dim strided
    assert w.stride(-1) != 1
    w.requires_grad_(True)
    t = sparse24.compress(w)
    assert torch.equal(_bits(sparse24.decompress(t)), _bits(w.detach()))
    assert not t.values.requires_grad
    big = sparse24.prune(torch.randn(30, 64, dtype=BF16))
    cols = big[:, 8:48]                                           # row stride 64 != k
    assert torch.equal(_bits(sparse24.decompress(sparse24.compress(cols))), _bits(cols))


def test_compress_meta_device_shapes_only(any_native):
    t = sparse24.compress(torch.empty(300, 1000, dtype=FP16, device="meta"))
    lay = _native.sparse24_layout(300, 1000)
    assert t.values.device.type == "meta" and tuple(t.values.shape) == tuple(lay["values_shape"])
    assert tuple(t.meta.shape) == tuple(lay["meta_shape"])
    assert sparse24.decompress(t).shape == (300, 1000)


def test_sparse24_tensor_validation(any_native):
    t = sparse24.compress(torch.zeros(8, 16, dtype=BF16))
    with pytest.raises(ArgumentError, match=r"values: expected shape"):
        sparse24.Sparse24Tensor(t.values[:-1], t.meta, (8, 16))
    with pytest.raises(ArgumentError, match=r"meta: expected shape"):
        sparse24.Sparse24Tensor(t.values, t.meta[:, :-1], (8, 16))
    with pytest.raises(DTypeError, match="meta: expected dtype torch.int16"):
        sparse24.Sparse24Tensor(t.values, t.meta.to(torch.int32), (8, 16))
    with pytest.raises(DTypeError, match="values: expected dtype"):
        sparse24.Sparse24Tensor(t.values.float(), t.meta, (8, 16))
    with pytest.raises(ArgumentError, match="shape: expected"):
        sparse24.Sparse24Tensor(t.values, t.meta, (8,))
    assert "Sparse24Tensor(shape=(8, 16)" in repr(t)


def test_dense_cache_follows_in_place_writes(native):
    w = sparse24.prune(torch.randn(16, 32, dtype=BF16))
    t = sparse24.compress(w)
    d1 = t.dense()
    assert t.dense() is d1                                        # cached
    t.values.zero_()                                              # bumps the version counter
    d2 = t.dense()
    assert d2 is not d1 and int(torch.count_nonzero(d2)) == 0
    t.drop_dense_cache()
    assert t._dense is None


# ---- matmul (CPU: the dense path) -----------------------------------------------------------

@pytest.mark.parametrize("activation, fn", [(None, lambda y: y), ("relu", F.relu), ("gelu", F.gelu),
                                            ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh")),
                                            ("silu", F.silu)])
def test_matmul_cpu_matches_linear(native, activation, fn):
    torch.manual_seed(1)
    w = sparse24.prune(torch.randn(24, 40, dtype=BF16))
    t = sparse24.compress(w)
    b = torch.randn(24, dtype=BF16)
    for x in (torch.randn(40, dtype=BF16), torch.randn(3, 40, dtype=BF16), torch.randn(2, 5, 40, dtype=BF16)):
        y = sparse24.matmul(x, t, b, activation)
        assert y.shape == (*x.shape[:-1], 24) and y.dtype == BF16
        assert torch.equal(y, fn(F.linear(x, w, b)))
    y32 = sparse24.matmul(x, t, b.float())                       # fp32 bias accepted
    assert y32.dtype == BF16 and torch.allclose(y32.float(), F.linear(x, w, b).float(), atol=0.1, rtol=0.02)


def test_matmul_zero_rows_and_grad(native):
    w = sparse24.prune(torch.randn(8, 12, dtype=BF16))
    t = sparse24.compress(w)
    assert sparse24.matmul(torch.empty(0, 3, 12, dtype=BF16), t).shape == (0, 3, 8)
    x = torch.randn(4, 12, dtype=BF16, requires_grad=True)
    sparse24.matmul(x, t).float().sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 8, dtype=BF16) @ w)


def test_matmul_errors(any_native):
    t = sparse24.compress(torch.zeros(8, 12, dtype=BF16))
    x = torch.randn(2, 12, dtype=BF16)
    with pytest.raises(TypeError, match="w_sparse: expected a Sparse24Tensor"):
        sparse24.matmul(x, torch.zeros(8, 12, dtype=BF16))
    with pytest.raises(DTypeError, match="x: expected the weight's dtype torch.bfloat16, got torch.float16"):
        sparse24.matmul(x.half(), t)
    with pytest.raises(ArgumentError, match=r"x: expected a last dim of 12 .* got shape \(2, 13\)"):
        sparse24.matmul(torch.randn(2, 13, dtype=BF16), t)
    with pytest.raises(ArgumentError, match=r"bias: expected shape \(8,\)"):
        sparse24.matmul(x, t, torch.zeros(9, dtype=BF16))
    with pytest.raises(DTypeError, match="bias: expected torch.bfloat16 or torch.float32"):
        sparse24.matmul(x, t, torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ArgumentError, match="activation: expected None"):
        sparse24.matmul(x, t, activation="tanh")
    with pytest.raises(ArgumentError, match="backend: expected one of"):
        sparse24.matmul(x, t, backend="cusparselt")
    with pytest.raises(DeviceError, match="x: expected the weight's device"):
        sparse24.matmul(x.to("meta"), t)


def test_matmul_sparse_backend_on_cpu_raises_device_error():
    if not hasattr(_native, "sparse24_matmul"):
        pytest.skip("ferroattn._native has no sparse24_matmul yet")
    t = sparse24.compress(torch.zeros(8, 16, dtype=BF16))
    with pytest.raises(DeviceError):
        sparse24.matmul(torch.randn(2, 16, dtype=BF16), t, backend="sparse")


# ---- flattening x to rows -------------------------------------------------------------------

def _check_rows_view(x, expect_view: bool):
    x2, unflatten = sparse24.product.rows_view(x)
    k = x.shape[-1]
    assert x2.dim() == 2 and x2.shape[1] == k and x2.stride(-1) == 1
    assert torch.equal(x2, x.reshape(-1, k)) or x.dim() > 2     # row order may be permuted for > 2-D
    assert (x2.data_ptr() == x.data_ptr() or x.numel() == 0) if expect_view else x2.data_ptr() != x.data_ptr()
    # the rows map back: out[i] = x2[i] summed, reshaped to x's leading shape
    back = unflatten(x2)
    assert back.shape == x.shape and torch.equal(back, x)


def test_rows_view_without_copies():
    base = torch.randn(4, 6, 8)
    _check_rows_view(base, True)                                  # contiguous
    _check_rows_view(base.transpose(0, 1), True)                  # (s, b, k) from (b, s, k)
    _check_rows_view(base[:, ::2], True)                          # row slice with a step
    _check_rows_view(base[1], True)                               # 2-D
    _check_rows_view(base[0, 0], True)                            # 1-D
    _check_rows_view(torch.randn(4, 6, 2, 8).permute(2, 0, 1, 3), True)


def test_rows_view_copies_when_needed():
    base = torch.randn(4, 6, 8)
    _check_rows_view(base[:, :-1], False)                         # leading dims cannot share a stride
    _check_rows_view(base.transpose(1, 2), False)                 # last dim not unit-stride
    _check_rows_view(torch.randn(8, 5).t(), False)


# ---- dispatch -------------------------------------------------------------------------------

@pytest.fixture
def table():
    saved = {a: {d: dict(s) for d, s in v.items()} for a, v in sparse24.DISPATCH_TABLE.items()}
    yield
    sparse24.set_dispatch_table(saved)


def test_dispatch_rule(table):
    sparse24.set_dispatch_table({"sm_90": {"bfloat16": {
        (4096, 4096): [(16, 0.8), (256, 0.97), (4096, 1.4)],
        (14336, 4096): [(16, 1.1), (4096, 1.5)],
    }}})
    d = sparse24.dispatch._decide
    assert d("sm_90", "bfloat16", 4096, 4096, 1) == "dense"        # below the smallest measured rows
    assert d("sm_90", "bfloat16", 4096, 4096, 300) == "dense"      # nearest 256 -> 0.97
    assert d("sm_90", "bfloat16", 4096, 4096, 2000) == "sparse"    # nearest 4096 (log scale)
    assert d("sm_90", "bfloat16", 16384, 4096, 16) == "sparse"     # nearest shape 14336x4096
    assert d("sm_90", "float16", 4096, 4096, 16) == "sparse"       # no measurements: the kernel
    assert d("sm_80", "bfloat16", 4096, 4096, 16) == "sparse"
    assert sparse24.choose_backend(4096, 4096, 4096, BF16, torch.device("cpu")) == "dense"


def test_dispatch_table_from_json(table, tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"dispatch_table": {"sm_90": {"float16": {"4096,11008": [[16, 0.5], [8192, 1.2]]}}}}))
    sparse24.load_dispatch_table(p)
    assert sparse24.DISPATCH_TABLE == {"sm_90": {"float16": {(4096, 11008): ((16, 0.5), (8192, 1.2))}}}
    assert sparse24.dispatch._decide("sm_90", "float16", 4096, 11008, 32) == "dense"
    with pytest.raises(ArgumentError, match="table: expected"):
        sparse24.set_dispatch_table({"sm_90": {"float16": {"4096": [[1, 1.0]]}}})


@pytest.mark.parametrize("bad", [{"0,4096": [[16, 1.2]]}, {"-5,4096": [[16, 1.2]]}, {"4096,4096": [[16, float("nan")]]},
                                 {"4096,4096": [[16, float("inf")]]}, {"4096,4096": [[16, 0.0]]},
                                 {"4096,4096": [[-1, 1.2]]}])
def test_dispatch_table_rejects_entries_that_break_auto(table, bad):
    """A shape key with n or k < 1, a non-finite or non-positive speedup, or negative rows is an
    ArgumentError naming `table`, and the table in use is unchanged (auto keeps working)."""
    before = {a: {d: dict(s) for d, s in v.items()} for a, v in sparse24.DISPATCH_TABLE.items()}
    with pytest.raises(ArgumentError, match="^table: expected"):
        sparse24.set_dispatch_table({"sm_90": {"bfloat16": bad}})
    assert sparse24.DISPATCH_TABLE == before
    assert sparse24.dispatch._decide("sm_90", "bfloat16", 4096, 4096, 64) in ("dense", "sparse")


@pytest.mark.parametrize("rows,n,k,name", [(10, 0, 4096, "n"), (10, 4096, 0, "k"), (-1, 4096, 4096, "rows")])
def test_choose_backend_rejects_bad_sizes(rows, n, k, name):
    with pytest.raises(ArgumentError, match=f"^{name}: expected an integer >= "):
        sparse24.choose_backend(rows, n, k, BF16, torch.device("cuda"), arch="sm_90")


def test_prune_nan_payloads_tie(native):
    """Every NaN (any sign or payload) ranks equal, above inf: ties go to the lower index, in
    prune and in the kernels' rule (host reference)."""
    # fp16 bits: 1.0, NaN with payload 1, negative quiet NaN, quiet NaN | inf, 2.0, -inf, 0
    bits = torch.tensor([[0x3C00, 0x7C01, 0xFE00 - 0x10000, 0x7E00, 0x7C00, 0x4000, 0xFC00 - 0x10000, 0]],
                        dtype=torch.int16)
    w = bits.view(FP16)
    p = sparse24.prune(w)
    expect = bits.clone()
    expect[0, [0, 3, 5, 7]] = 0                   # group 0 keeps the first two NaNs; group 1 keeps +-inf
    assert torch.equal(_bits(p), expect)
    assert torch.equal(_bits(sparse24.decompress(sparse24.compress(w, prune=True))), expect)


# ---- adversarial review (issue 4) ----------------------------------------------------------
def test_sparse24_tensor_dtype_and_shape_errors(native):
    ws = sparse24.compress(torch.randn(16, 32, dtype=FP16), prune=True)
    with pytest.raises(DTypeError, match=r"^values: expected dtype torch\.float16 or torch\.bfloat16, "
                                         r"got torch\.float32$"):
        sparse24.Sparse24Tensor(ws.values.float(), ws.meta, (16, 32))
    with pytest.raises(DTypeError, match=r"^dtype: expected torch\.float16 or torch\.bfloat16, got torch\.float32$"):
        sparse24.Sparse24Tensor(ws.values.float(), ws.meta, (16, 32), torch.float32)
    with pytest.raises(DTypeError, match=r"^values: expected dtype torch\.bfloat16 \(the dtype argument\), "
                                         r"got torch\.float16$"):
        sparse24.Sparse24Tensor(ws.values, ws.meta, (16, 32), BF16)
    for bad in (16, (16.7, 32.2), None):
        with pytest.raises(TypeError, match=r"^shape: expected a sequence of two ints"):
            sparse24.Sparse24Tensor(ws.values, ws.meta, bad)


def test_dense_cache_sees_storage_swaps(native):
    torch.manual_seed(0)
    w1, w2 = (sparse24.prune(torch.randn(8, 16, dtype=BF16)) for _ in range(2))
    ws, other = sparse24.compress(w1), sparse24.compress(w2)
    assert torch.equal(ws.dense(), w1)
    ws.values.data = other.values.clone()     # same Python objects, new storage, no version bump
    ws.meta.data = other.meta.clone()
    assert torch.equal(ws.dense(), w2)
    ws.values.data.copy_(sparse24.compress(w1).values)   # bypasses the version counter: documented
    ws.meta.data.copy_(sparse24.compress(w1).meta)
    ws.drop_dense_cache()
    assert torch.equal(ws.dense(), w1)


def test_dense_cache_not_used_for_inference_tensors(native):
    torch.manual_seed(0)
    x = torch.randn(3, 16, dtype=BF16)
    with torch.inference_mode():
        w = sparse24.prune(torch.randn(8, 16, dtype=BF16))
        ws = sparse24.compress(w)
        assert torch.equal(sparse24.matmul(x, ws, backend="dense"), F.linear(x, w))
        ws.values.zero_()                     # no version counter to see this write
        assert torch.equal(sparse24.matmul(x, ws, backend="dense"), torch.zeros(3, 8, dtype=BF16))


@pytest.mark.parametrize("bad", ["no", "False", None, 1, 0])
def test_compress_prune_must_be_a_bool(native, bad):
    w = sparse24.prune(torch.randn(4, 8, dtype=FP16))
    with pytest.raises(TypeError, match=r"^prune: expected a bool, got "):
        sparse24.compress(w, prune=bad)


def test_is_sparse24_argument_errors_and_empty(native):
    with pytest.raises(ArgumentError, match=r"^w: expected a tensor of rank >= 1"):
        sparse24.is_sparse24(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"^w: expected a torch\.Tensor, got list"):
        sparse24.is_sparse24([1, 2])
    assert sparse24.is_sparse24(torch.empty(3, 0)) and sparse24.is_sparse24(torch.empty(0, 8))
    assert sparse24.is_sparse24(torch.tensor([1.0, 0.0, 2.0, 0.0])) and not sparse24.is_sparse24(torch.ones(4))


def test_matmul_activation_and_backend_of_the_wrong_type(native):
    ws = sparse24.compress(torch.randn(4, 8, dtype=FP16), prune=True)
    x = torch.randn(2, 8, dtype=FP16)
    with pytest.raises(ArgumentError, match=r"^activation: .*\['relu'\]"):
        sparse24.matmul(x, ws, activation=["relu"])
    with pytest.raises(ArgumentError, match=r"^backend: .*\['auto'\]"):
        sparse24.matmul(x, ws, backend=["auto"])
