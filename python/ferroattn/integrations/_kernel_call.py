"""How the transformers attention functions (:mod:`.transformers`, :mod:`.transformers_paged`)
call a flash_attn function: only with the options its signature declares (transformers' rule),
and the output cropped back to a value head dim the kernel did not run at."""
from __future__ import annotations

import inspect

from torch import Tensor

__all__ = ["accepts", "call_kernel", "crop_to", "same"]


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


def same(out: Tensor) -> Tensor:
    return out


def crop_to(v_head_dim: int):
    """The output cropped to the value head dim (MLA's padded v)."""
    return lambda out: out[..., :v_head_dim]


def call_kernel(fn, *args, **fa_kwargs) -> Tensor:
    """``fn(*args, **fa_kwargs)``; ``s_aux`` only goes to a function that declares it (otherwise
    NotImplementedError, never a silent drop of the sinks)."""
    if "s_aux" in fa_kwargs and not accepts(fn, "s_aux"):
        raise NotImplementedError("ferroattn: s_aux (attention sinks) is not implemented yet")
    return fn(*args, **fa_kwargs)
