"""How the transformers attention functions (:mod:`.transformers`, :mod:`.transformers_paged`)
call a flash_attn function: the variant options in transformers' form, only the options the
function's signature declares (transformers' rule), and a smaller value head dim padded for the
kernel and cropped back."""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["accepts", "call_kernel", "value_at_head_dim", "variant_kwargs"]


def accepts(fn, name: str) -> bool:
    """Whether ``fn`` declares a parameter ``name`` (transformers passes a flash_attn option only
    when the function's signature names it); remembered per function."""
    key = (fn, name)
    got = _ACCEPTS.get(key)
    if got is None:
        try:
            got = name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            got = False
        _ACCEPTS[key] = got
    return got


_ACCEPTS = {}


def _same(out: Tensor) -> Tensor:
    return out


def value_at_head_dim(value: Tensor, head_dim: int) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(value, crop): a value head dim below the query's (MLA) zero-padded up to ``head_dim`` on
    the last dim (flash_attn runs one head dim), and the function that crops the output back to
    the value's; the value itself and the identity otherwise."""
    v_head_dim = value.shape[-1]
    if v_head_dim >= head_dim:
        return value, _same
    return torch.nn.functional.pad(value, [0, head_dim - v_head_dim]), lambda out: out[..., :v_head_dim]


def variant_kwargs(softcap: Optional[float], s_aux: Optional[Tensor], dtype: torch.dtype) -> dict:
    """The variant options as transformers passes them to flash_attn: ``softcap`` (None -> 0.0,
    off) and, when given, ``s_aux`` (the attention sinks) in the activations' ``dtype``."""
    kwargs = {"softcap": softcap if softcap is not None else 0.0}
    if s_aux is not None:
        kwargs["s_aux"] = s_aux.to(dtype)
    return kwargs


def call_kernel(fn, *args, **fa_kwargs) -> Tensor:
    """``fn(*args, **fa_kwargs)``; ``s_aux`` only goes to a function that declares it (otherwise
    NotImplementedError, never a silent drop of the sinks)."""
    if "s_aux" in fa_kwargs and not accepts(fn, "s_aux"):
        raise NotImplementedError("ferroattn: s_aux (attention sinks) is not implemented yet")
    return fn(*args, **fa_kwargs)
