"""ferroattn: FlashAttention-class attention kernels owned by Rust, JIT-compiled with NVRTC.

Drop-in for flash_attn 2.x (same function names, positional order, defaults and return values):

    from ferroattn import flash_attn_func          # instead of: from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)    # q: (b, s_q, h, d) fp16/bf16 on CUDA

or, in transformers, ``ferroattn.integrations.transformers.register()`` then
``attn_implementation="ferroattn"``.

Importing this package needs neither torch nor a GPU: the torch-dependent names
(the ``flash_attn_*`` functions, :mod:`ferroattn.bert_padding`, :mod:`ferroattn.testing`) are
imported on first access.
"""
import importlib as _importlib

from . import _env  # noqa: F401  (CUDA include dirs + NVRTC preload; never raises)
from .errors import *  # noqa: F401,F403  (the exception classes; listed in errors.__all__)
from .errors import __all__ as _error_names


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("ferroattn")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


__version__ = _version()

# name -> module that defines it (imported lazily: these need torch)
_LAZY_ATTRS = {
    "flash_attn_func": "flash_attn_interface",
    "flash_attn_qkvpacked_func": "flash_attn_interface",
    "flash_attn_kvpacked_func": "flash_attn_interface",
    "flash_attn_varlen_func": "flash_attn_interface",
    "flash_attn_varlen_qkvpacked_func": "flash_attn_interface",
    "flash_attn_varlen_kvpacked_func": "flash_attn_interface",
    "flash_attn_with_kvcache": "flash_attn_interface",
    "matmul": "gemm",
}
_LAZY_MODULES = ("bert_padding", "testing", "flash_attn_interface", "ops", "integrations", "gemm", "nn", "sparse24")

__all__ = [
    "__version__",
    *_LAZY_ATTRS,
    "bert_padding",
    "nn",
    "sparse24",
    *_error_names,
]


def __getattr__(name: str):
    if name in _LAZY_ATTRS:
        module = _importlib.import_module(f".{_LAZY_ATTRS[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        module = _importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> "list[str]":
    return sorted(set(__all__) | set(_LAZY_MODULES) | {"errors"})
