"""Process environment for the Rust extension, prepared once at ``import ferroattn``.

Two jobs, both best effort (this module never makes the import fail):

1. CUDA headers. The kernels ``#include <cuda_fp16.h>``/``<cuda_bf16.h>``/``<mma.h>``. NVRTC has
   no default search path, so the Rust side is told where the pip wheels put them:
   ``site-packages/nvidia/cu13/include`` (wheels ``nvidia-cuda-runtime`` and ``nvidia-cuda-crt``).
   ``$CUDA_HOME/include`` goes first when it exists. The Rust side itself also tries
   ``$CUDA_HOME/include`` and ``/usr/local/cuda/include`` before these (``_native._configure``).
2. NVRTC. ``libnvrtc.so.13`` from the ``nvidia-cuda-nvrtc`` wheel has RUNPATH ``$ORIGIN`` but
   still fails to find ``libnvrtc-builtins.so.13.0`` at compile time unless the builtins are
   already loaded. ``import torch`` (a CUDA build) loads both; without torch we preload
   ``libnvrtc-builtins.so.13.0`` and then ``libnvrtc.so.13`` with ``RTLD_GLOBAL`` so the Rust
   side's ``dlopen("libnvrtc.so.13")`` resolves to them by soname
   (reference/toolchain.md §2 "Loading the libraries"). When they are missing nothing happens
   here; the Rust side raises :class:`ferroattn.errors.NvrtcNotFoundError` on first use.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import List, Optional

#: Set by :func:`configure`: the include directories handed to ``_native._configure``.
include_dirs: List[str] = []
#: Set by :func:`configure`: the NVRTC library preloaded here, or None (already loaded / absent).
preloaded_nvrtc: Optional[str] = None
#: Set by :func:`configure` when ``ferroattn._native`` could not be imported (e.g. not built).
native_import_error: Optional[BaseException] = None

_NVRTC_SONAME = "libnvrtc.so.13"
_NVRTC_BUILTINS = "libnvrtc-builtins.so.13.0"


def _nvidia_roots() -> List[str]:
    """Directories of the ``nvidia`` namespace package (one per site-packages that has it)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [str(p) for p in spec.submodule_search_locations]


def find_include_dirs() -> List[str]:
    """CUDA include directories to give NVRTC: ``$CUDA_HOME/include`` (if it exists), then every
    ``site-packages/nvidia/cu13/include`` that holds ``cuda_fp16.h``."""
    dirs: List[str] = []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "include", "cuda_fp16.h")):
        dirs.append(os.path.join(cuda_home, "include"))
    for root in _nvidia_roots():
        inc = os.path.join(root, "cu13", "include")
        if os.path.isfile(os.path.join(inc, "cuda_fp16.h")) and inc not in dirs:
            dirs.append(inc)
    return dirs


def _nvrtc_already_loaded() -> bool:
    """True when some libnvrtc.so.13 is already in the process (e.g. loaded by ``import torch``)."""
    try:
        ctypes.CDLL(_NVRTC_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def preload_nvrtc() -> Optional[str]:
    """Load the wheel's NVRTC builtins, then NVRTC, with RTLD_GLOBAL. Returns the path of the
    NVRTC library loaded, or None when NVRTC was already loaded or no wheel copy was found.
    Never raises."""
    if _nvrtc_already_loaded():
        return None
    for root in _nvidia_roots():
        lib = os.path.join(root, "cu13", "lib")
        builtins = os.path.join(lib, _NVRTC_BUILTINS)
        nvrtc = os.path.join(lib, _NVRTC_SONAME)
        if not (os.path.isfile(builtins) and os.path.isfile(nvrtc)):
            continue
        try:
            ctypes.CDLL(builtins, mode=os.RTLD_GLOBAL)
            ctypes.CDLL(nvrtc, mode=os.RTLD_GLOBAL)
            return nvrtc
        except OSError:
            continue
    return None


def configure() -> None:
    """Run both jobs once. Never raises (an unbuilt extension is remembered in
    :data:`native_import_error` and re-raised by whatever needs the extension)."""
    global include_dirs, preloaded_nvrtc, native_import_error
    try:
        preloaded_nvrtc = preload_nvrtc()
    except Exception:  # pragma: no cover - defensive: loading must never break the import
        preloaded_nvrtc = None
    include_dirs = find_include_dirs()
    try:
        from . import _native
    except ImportError as e:
        native_import_error = e
        return
    try:
        _native._configure(include_dirs)
    except Exception:  # pragma: no cover - the Rust side reports problems on first real use
        pass


configure()
