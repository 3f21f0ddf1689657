"""DLPack on CPU through the Rust extension: import (numpy, torch, a hand-made capsule with a
byte_offset), export (``_native.Buffer``), capsule consumption, and no leaks over 10^5 round trips."""
from __future__ import annotations

import ctypes
import gc
import sys

import numpy as np
import pytest
import torch

from ferroattn import _native

N_ROUND_TRIPS = 100_000


# ---- import -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,name", [(np.float16, "float16"), (np.float32, "float32"), (np.float64, "float64"),
                                        (np.int32, "int32"), (np.int64, "int64"), (np.uint8, "uint8"),
                                        (np.int8, "int8"), (np.bool_, "bool")])
def test_numpy_import(dtype, name):
    a = np.arange(24).astype(dtype).reshape(2, 3, 4)
    info = _native.dlpack_info(a)
    assert info["data_ptr"] == a.ctypes.data
    assert tuple(info["shape"]) == (2, 3, 4)
    assert tuple(info["strides"]) == (12, 4, 1)
    assert info["dtype"] == name
    assert tuple(info["device"]) == (1, 0)


def test_numpy_views_strides_in_elements_and_offset():
    a = np.zeros((6, 8), dtype=np.float32)
    t = a.T
    info = _native.dlpack_info(t)
    assert tuple(info["shape"]) == (8, 6) and tuple(info["strides"]) == (1, 8)
    s = a[2:, 3::2]
    info = _native.dlpack_info(s)
    assert info["data_ptr"] == s.ctypes.data == a.ctypes.data + (2 * 8 + 3) * 4
    assert tuple(info["strides"]) == (8, 2) and tuple(info["shape"]) == (4, 3)
    assert isinstance(info["byte_offset"], int) and info["byte_offset"] >= 0


@pytest.mark.parametrize("dtype,name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
                                        (torch.float32, "float32"), (torch.int32, "int32")])
def test_torch_cpu_import(dtype, name):
    x = torch.arange(60).to(dtype).reshape(3, 4, 5)
    info = _native.dlpack_info(x)
    assert info["data_ptr"] == x.data_ptr() and info["dtype"] == name
    assert tuple(info["shape"]) == (3, 4, 5) and tuple(info["strides"]) == (20, 5, 1)
    assert info["versioned"] is True  # torch 2.11 answers max_version=(1, x) with a versioned capsule
    v = x.transpose(0, 2)[1:]
    info = _native.dlpack_info(v)
    assert info["data_ptr"] == v.data_ptr()
    assert tuple(info["strides"]) == v.stride() and tuple(info["shape"]) == tuple(v.shape)


def test_a_lazily_negated_tensor_is_an_argument_error():
    """torch exports a tensor with the negation bit as its un-negated memory, unflagged: the import
    refuses it (reading it would compute on the wrong sign), and a resolved one imports."""
    from ferroattn.errors import ArgumentError
    x = torch.arange(6.0).reshape(2, 3)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    with pytest.raises(ArgumentError, match=r"^x: expected a tensor without torch's lazy negation bit"):
        _native.dlpack_info(neg)
    assert _native.dlpack_info(neg.resolve_neg())["data_ptr"] != x.data_ptr()
    assert _native.dlpack_info(x)["data_ptr"] == x.data_ptr()     # the next valid call works


def test_a_producer_without_max_version_is_asked_again_without_it():
    """The Array API standard's rule: a `__dlpack__` that raises TypeError for `max_version` (a
    producer older than DLPack 1.0) is called again with no arguments."""
    x = torch.arange(12.0).reshape(3, 4)

    class Old:
        calls = []

        def __dlpack_device__(self):
            return x.__dlpack_device__()

        def __dlpack__(self, stream=None):
            self.calls.append(stream)
            return torch.utils.dlpack.to_dlpack(x)

    info = _native.dlpack_info(Old())
    assert info["data_ptr"] == x.data_ptr() and tuple(info["shape"]) == (3, 4) and info["versioned"] is False
    assert Old.calls == [None]

    class Broken(Old):
        def __dlpack__(self, stream=None, **kw):
            raise TypeError("no export today")

    with pytest.raises(TypeError, match="^x: no export today"):
        _native.dlpack_info(Broken())


# A legacy DLPack capsule made by hand, with byte_offset != 0 (torch and numpy always advance
# `data` and leave byte_offset 0, but the spec allows producers to use it).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


def _capsule_with_offset(arr: np.ndarray, offset_elems: int, shape, deleted: list):
    managed = _DLManagedTensor()
    shape_arr = (ctypes.c_int64 * len(shape))(*shape)
    keep = [arr, shape_arr, managed]

    @_DELETER
    def deleter(_ptr):
        deleted.append(True)

    keep.append(deleter)
    t = managed.dl_tensor
    t.data = arr.ctypes.data
    t.device = _DLDevice(1, 0)
    t.ndim = len(shape)
    t.dtype = _DLDataType(2, 32, 1)  # float32
    t.shape = shape_arr
    t.strides = None  # NULL strides: C-contiguous
    t.byte_offset = offset_elems * 4
    managed.deleter = deleter
    pycapsule_new = ctypes.pythonapi.PyCapsule_New
    pycapsule_new.restype = ctypes.py_object
    pycapsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    cap = pycapsule_new(ctypes.addressof(managed), b"dltensor", None)
    return cap, keep


def _capsule_name(cap) -> bytes:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    return get_name(cap)


def test_capsule_with_byte_offset_and_null_strides():
    arr = np.arange(20, dtype=np.float32)
    deleted = []
    cap, keep = _capsule_with_offset(arr, 5, (3, 4), deleted)
    info = _native.dlpack_info(cap)
    assert info["byte_offset"] == 20
    assert info["data_ptr"] == arr.ctypes.data + 20  # data + byte_offset
    assert tuple(info["shape"]) == (3, 4) and tuple(info["strides"]) == (4, 1)
    assert info["versioned"] is False
    assert _capsule_name(cap) == b"used_dltensor"
    gc.collect()
    assert deleted == [True]  # the consumer called the producer's deleter exactly once
    del keep


# ---- export ------------------------------------------------------------------------------
def test_buffer_consumed_by_numpy_and_torch():
    base = _native.live_buffers()
    buf = _native.Buffer.empty((3, 5), "float32", "cpu")
    assert tuple(buf.shape) == (3, 5) and buf.dtype == "float32"
    assert tuple(buf.__dlpack_device__()) == (1, 0)
    a = np.from_dlpack(buf)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.ctypes.data == buf.data_ptr
    a[:] = 7.0
    t = torch.from_dlpack(buf)
    assert t.data_ptr() == buf.data_ptr and t.dtype == torch.float32
    assert torch.all(t == 7.0)  # same memory
    del buf, a
    gc.collect()
    assert _native.live_buffers() == base + 1  # torch still holds it
    del t
    gc.collect()
    assert _native.live_buffers() == base


@pytest.mark.parametrize("dtype,tdtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                          ("int32", torch.int32), ("uint8", torch.uint8)])
def test_buffer_dtypes(dtype, tdtype):
    t = torch.from_dlpack(_native.Buffer.empty((4, 2), dtype, "cpu"))
    assert t.dtype == tdtype and t.shape == (4, 2) and t.is_contiguous()


def test_consumed_capsule_is_renamed_and_cannot_be_reused():
    buf = _native.Buffer.empty((4,), "float32", "cpu")
    cap = buf.__dlpack__(max_version=(1, 0))
    assert _capsule_name(cap) == b"dltensor_versioned"
    t = torch.from_dlpack(cap)
    assert t.data_ptr() == buf.data_ptr
    assert _capsule_name(cap) == b"used_dltensor_versioned"
    with pytest.raises(Exception):
        torch.from_dlpack(cap)
    with pytest.raises(Exception):
        _native.dlpack_info(cap)
    legacy = buf.__dlpack__()
    assert _capsule_name(legacy) == b"dltensor"
    _native.dlpack_info(legacy)
    assert _capsule_name(legacy) == b"used_dltensor"
    with pytest.raises(Exception):
        _native.dlpack_info(legacy)


def test_unconsumed_capsule_frees_its_buffer():
    gc.collect()
    base = _native.live_buffers()
    buf = _native.Buffer.empty((4,), "float32", "cpu")
    cap = buf.__dlpack__(max_version=(1, 0))
    del buf
    gc.collect()
    del cap  # the capsule destructor must call the deleter
    gc.collect()
    assert _native.live_buffers() == base


def test_no_leak_round_trips():
    gc.collect()
    base = _native.live_buffers()
    for _ in range(N_ROUND_TRIPS):
        t = torch.from_dlpack(_native.Buffer.empty((8,), "float32", "cpu"))
        del t
    gc.collect()
    assert _native.live_buffers() == base
    a = np.zeros(16, dtype=np.float32)
    x = torch.zeros(16)
    refs_a, refs_x = sys.getrefcount(a), sys.getrefcount(x)
    for _ in range(N_ROUND_TRIPS):
        _native.dlpack_info(a)
        _native.dlpack_info(x)
    gc.collect()
    assert sys.getrefcount(a) == refs_a and sys.getrefcount(x) == refs_x
