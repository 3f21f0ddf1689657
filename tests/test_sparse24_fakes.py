"""A stand-in for the 2:4 part of ``ferroattn._native`` (contract: _native.pyi "2:4 structured
sparsity (issue 4)"), so the Python layer (ferroattn.sparse24, ops/sparse24, SparseLinear) can be
tested on CPU with or without the Rust side, plus the ``native`` fixture the other
test_sparse24*.py modules use: "fake" installs this stand-in, "real" uses the built extension's
host reference (skipped when the extension has no sparse24_* functions yet).

The fake uses its own metadata layout (tiles 64 x 64; meta (m_pad, k_pad / 16) int16 holding
4 groups of two 2-bit indices); the Python layer must not depend on the layout, only on
``sparse24_layout``'s shapes. Its selection rule is written independently of
ferroattn.sparse24.prune (a stable sort on (NaN, inf, |x|)), so the prune tests compare two
implementations of the documented rule.
"""
from __future__ import annotations

import pytest
import torch

import ferroattn._native as _native
from ferroattn.errors import ArgumentError, DTypeError

TILE_M, TILE_K = 64, 64
FUNCS = ("sparse24_layout", "sparse24_compress_host", "sparse24_decompress_host", "sparse24_matmul_check")


def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def layout(m: int, k: int) -> dict:
    m_pad, k_pad = _ceil(m, TILE_M), _ceil(k, TILE_K)
    return {"m_pad": m_pad, "k_pad": k_pad, "values_shape": (m_pad, k_pad // 2), "meta_shape": (m_pad, k_pad // 16),
            "tile_m": TILE_M, "tile_k": TILE_K}


def _kept_indices(g: torch.Tensor, prune: bool) -> torch.Tensor:
    """g (rows, groups, 4) -> (rows, groups, 2) ascending kept indices."""
    if prune:
        a = g.double().abs()
        key = torch.where(torch.isnan(a), torch.full_like(a, 3.0), torch.where(torch.isinf(a), torch.full_like(a, 2.0),
                                                                               torch.zeros_like(a)))
        # rank by (class, |x|) descending, ties by index ascending: two stable sorts
        fin = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
        _, o1 = torch.sort(fin, dim=-1, descending=True, stable=True)
        cls1 = torch.gather(key, -1, o1)
        _, o2 = torch.sort(cls1, dim=-1, descending=True, stable=True)
        order = torch.gather(o1, -1, o2)
        top = order[..., :2]
    else:
        nz = (g != 0).to(torch.int64)
        # non-zeros first in index order, then zeros in index order
        _, order = torch.sort(-nz, dim=-1, stable=True)
        top = order[..., :2]
    return torch.sort(top, dim=-1).values


def compress_host(w, values, meta, prune: bool) -> int:
    m, k = w.shape
    if w.dtype not in (torch.float16, torch.bfloat16):
        raise DTypeError(f"w: expected float16 or bfloat16, got {w.dtype}")
    lay = layout(m, k)
    if tuple(values.shape) != lay["values_shape"] or tuple(meta.shape) != lay["meta_shape"]:
        raise ArgumentError("values/meta: wrong shape")
    wp = torch.zeros(lay["m_pad"], lay["k_pad"], dtype=w.dtype)
    wp[:m, :k] = w
    g = wp.view(lay["m_pad"], -1, 4)
    bad = int(((g != 0).sum(-1) > 2).sum())
    idx = _kept_indices(g, prune)
    bits = g.view(torch.int16)                   # moved as bits: NaN payloads and -0.0 survive
    values.view(torch.int16).copy_(torch.gather(bits, -1, idx).reshape(values.shape))
    code = (idx[..., 0] | (idx[..., 1] << 2)).reshape(lay["m_pad"], -1, 4)
    packed = code[..., 0] | (code[..., 1] << 4) | (code[..., 2] << 8) | (code[..., 3] << 12)
    meta.copy_((packed - (packed >= 32768).to(torch.int64) * 65536).to(torch.int16))   # two's complement
    return bad


def decompress_host(values, meta, out) -> None:
    m, k = out.shape
    lay = layout(m, k)
    packed = meta.to(torch.int64) & 0xFFFF
    codes = torch.stack([(packed >> (4 * j)) & 0xF for j in range(4)], dim=-1).reshape(lay["m_pad"], -1)
    idx = torch.stack([codes & 3, (codes >> 2) & 3], dim=-1)
    g = torch.zeros(lay["m_pad"], lay["k_pad"] // 4, 4, dtype=torch.int16)
    g.scatter_(-1, idx, values.view(torch.int16).reshape(lay["m_pad"], -1, 2))
    out.view(torch.int16).copy_(g.reshape(lay["m_pad"], lay["k_pad"])[:m, :k])


def matmul_check(x, values, meta, out, bias, n, k, activation) -> None:
    shape, _, dtype, _ = x
    if len(shape) != 2:
        raise ArgumentError(f"x: expected rank 2, got rank {len(shape)}")
    if shape[1] != k:
        raise ArgumentError(f"x: expected {k} columns, got {shape[1]}")
    if dtype not in ("float16", "bfloat16"):
        raise DTypeError(f"x: expected float16 or bfloat16, got {dtype}")
    lay = layout(n, k)
    if tuple(values[0]) != lay["values_shape"]:
        raise ArgumentError(f"values: expected shape {lay['values_shape']}, got {values[0]}")
    if tuple(meta[0]) != lay["meta_shape"] or meta[2] != "int16":
        raise ArgumentError(f"meta: expected int16 {lay['meta_shape']}, got {meta[2]} {meta[0]}")
    if tuple(out[0]) != (shape[0], n):
        raise ArgumentError(f"out: expected shape {(shape[0], n)}, got {out[0]}")
    if bias is not None and tuple(bias[0]) != (n,):
        raise ArgumentError(f"bias: expected shape ({n},), got {bias[0]}")
    if activation not in ("none", "relu", "gelu_erf", "gelu_tanh", "silu"):
        raise ArgumentError(f"activation: unknown {activation!r}")


FAKE = {"sparse24_layout": layout, "sparse24_compress_host": compress_host,
        "sparse24_decompress_host": decompress_host, "sparse24_matmul_check": matmul_check}


def have_real() -> bool:
    return all(hasattr(_native, f) for f in FUNCS)


def install_fake(monkeypatch) -> None:
    for name, fn in FAKE.items():
        monkeypatch.setattr(_native, name, fn, raising=False)


@pytest.fixture(params=["fake", "real"])
def native(request, monkeypatch):
    """"fake": the stand-in above; "real": the extension's Rust host reference (skipped until built)."""
    if request.param == "fake":
        install_fake(monkeypatch)
    elif not have_real():
        pytest.skip("ferroattn._native has no sparse24_* functions yet (rebuild with maturin develop)")
    return request.param


@pytest.fixture
def any_native(monkeypatch):
    """The real extension when it has the 2:4 functions, else the fake (for tests of the Python
    layer that do not depend on which one runs)."""
    if have_real():
        return "real"
    install_fake(monkeypatch)
    return "fake"


# ---- the fake itself obeys the contract ----------------------------------------------------

def test_fake_round_trip_and_bad_groups():
    torch.manual_seed(0)
    w = torch.randn(5, 13, dtype=torch.bfloat16)
    lay = layout(5, 13)
    v = torch.empty(lay["values_shape"], dtype=w.dtype)
    mt = torch.empty(lay["meta_shape"], dtype=torch.int16)
    bad = compress_host(w, v, mt, False)
    assert bad == 5 * 3    # full groups of random normals: 4 non-zeros; the last group (1 column) is fine
    out = torch.empty_like(w)
    compress_host(w, v, mt, True)
    decompress_host(v, mt, out)
    assert int(((out.float().reshape(5, -1)[:, :12].reshape(5, 3, 4) != 0).sum(-1) > 2).sum()) == 0
    # a 2:4 matrix survives bitwise
    v2, mt2, out2 = torch.empty_like(v), torch.empty_like(mt), torch.empty_like(w)
    assert compress_host(out, v2, mt2, False) == 0
    decompress_host(v2, mt2, out2)
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))
