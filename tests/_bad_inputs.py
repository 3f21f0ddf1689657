"""Shared helpers of the bad-input tests (test_validation.py, test_adversarial.py): a tensor
factory per mode ("cpu": real CPU tensors, "fake": FakeTensorMode CUDA tensors, "meta") and the two
valid calls (padded and varlen) that a test perturbs one argument of."""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ferroattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

BF16, I32 = torch.bfloat16, torch.int32


class Env:
    """Tensor factory for one mode ("fake", "meta", "cpu")."""

    def __init__(self, mode: str):
        self.mode = mode
        self.device = {"fake": "cuda:0", "meta": "meta", "cpu": "cpu"}[mode]

    def t(self, *shape, dtype=BF16, device=None, requires_grad=False):
        device = device or self.device
        if device == "cpu":
            x = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        else:
            x = torch.empty(shape, dtype=dtype, device=device)
        return x.requires_grad_(requires_grad)

    def cu(self, values, dtype=I32, device=None):
        return torch.tensor(values, dtype=dtype, device=device or self.device)


@contextlib.contextmanager
def env(mode: str):
    if mode == "fake":
        with FakeTensorMode():
            yield Env(mode)
    else:
        yield Env(mode)


def _split(base: dict, over: dict):
    """(positional arguments, keyword arguments): ``over`` replaces entries of ``base``; its other
    keys (``window_size``, ``softcap``, ``alibi_slopes``, ``s_aux``, ...) become keywords."""
    a = dict(base)
    kw = {n: x for n, x in over.items() if n not in base}
    a.update({n: x for n, x in over.items() if n in base})
    return list(a.values()), kw


def padded(e: Env, causal=True, **over):
    """The valid padded call (b 2, s_q 5, s_k 7, h 6, h_k 2, d 32) with ``over`` applied: q, k, v
    replace the tensors, any other key is passed to flash_attn_func as a keyword."""
    args, kw = _split(dict(q=e.t(2, 5, 6, 32), k=e.t(2, 7, 2, 32), v=e.t(2, 7, 2, 32)), over)
    return lambda: flash_attn_func(*args, causal=causal, **kw)


def varlen(e: Env, **over):
    """The valid varlen call (2 sequences, h 6, h_k 2, d 32) with ``over`` applied as in :func:`padded`."""
    args, kw = _split(dict(q=e.t(9, 6, 32), k=e.t(11, 2, 32), v=e.t(11, 2, 32), cu_seqlens_q=e.cu([0, 4, 9]),
                           cu_seqlens_k=e.cu([0, 5, 11]), max_seqlen_q=5, max_seqlen_k=6), over)
    kw.setdefault("causal", True)
    return lambda: flash_attn_varlen_func(*args, **kw)
