"""Exception classes raised by ferroattn.

Every error derives from :class:`FerroattnError`, itself a ``RuntimeError``, so code written
for flash_attn (which raises ``RuntimeError`` from its C++ checks) keeps working. Argument
errors additionally derive from the built-in class torch would use (``ValueError`` for a bad
shape or value, ``TypeError`` for a bad dtype), so ``except ValueError`` works too.

The Rust core (src/error.rs) raises these classes by name through src/python/errors.rs.
"""
from __future__ import annotations

__all__ = [
    "FerroattnError",
    "ArgumentError",
    "DTypeError",
    "DeviceError",
    "CudaError",
    "NoDeviceError",
    "UnsupportedGpuError",
    "NvrtcNotFoundError",
    "HeadersNotFoundError",
    "CompileError",
]


class FerroattnError(RuntimeError):
    """Base class of every ferroattn error (a ``RuntimeError``, as flash_attn raises)."""


class ArgumentError(FerroattnError, ValueError):
    """An argument has a bad shape, stride, length or value. The message names the argument,
    the expected and the actual value."""


class DTypeError(FerroattnError, TypeError):
    """An argument has an unsupported dtype (e.g. fp32 where fp16/bf16 is required) or dtypes mix."""


class DeviceError(FerroattnError, ValueError):
    """A tensor is on the wrong device (CPU, or another GPU than ``q``)."""


class CudaError(FerroattnError):
    """A CUDA driver call failed; the message carries the driver's error name and text."""


class NoDeviceError(FerroattnError):
    """No CUDA driver (libcuda) or no GPU was found."""


class UnsupportedGpuError(FerroattnError):
    """The GPU is older than sm_80 (Ampere), which every ferroattn kernel needs."""


class NvrtcNotFoundError(FerroattnError):
    """The NVRTC library (libnvrtc.so.13) could not be loaded; ``pip install nvidia-cuda-nvrtc==13.0.88``."""


class HeadersNotFoundError(FerroattnError):
    """The CUDA headers the kernels include (cuda_fp16.h, cuda_bf16.h) were not found."""


class CompileError(FerroattnError):
    """NVRTC failed to compile a kernel; the message holds the whole compiler log."""
