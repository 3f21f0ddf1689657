"""Data-dependent cu_seqlens checks (ops.attention.check_cu_seqlens_values), on CPU tensors."""
import pytest
import torch

from ferroattn.errors import ArgumentError
from ferroattn.ops import attention as op


def test_decreasing_and_too_long_are_rejected():
    with pytest.raises(ArgumentError, match=r"^cu_seqlens_q: expected non-decreasing"):
        op.check_cu_seqlens_values(torch.tensor([0, 5, 3], dtype=torch.int32), "cu_seqlens_q", 10, 5, "max_seqlen_q")
    with pytest.raises(ArgumentError, match=r"^cu_seqlens_k: expected the last value <= 10"):
        op.check_cu_seqlens_values(torch.tensor([0, 5, 11], dtype=torch.int32), "cu_seqlens_k", 10, 6, "max_seqlen_k")
    with pytest.raises(ArgumentError, match=r"^max_seqlen_q: expected >= the longest sequence"):
        op.check_cu_seqlens_values(torch.tensor([0, 2, 9], dtype=torch.int32), "cu_seqlens_q", 10, 5, "max_seqlen_q")


def test_valid_tensor_is_checked_once_per_version():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    op.check_cu_seqlens_values(cu, "cu_seqlens_q", 7, 4, "max_seqlen_q")
    assert cu in op._VERIFIED
    cu[2] = 2  # in-place write bumps the version: the next call must look at the values again
    with pytest.raises(ArgumentError, match="non-decreasing"):
        op.check_cu_seqlens_values(cu, "cu_seqlens_q", 7, 4, "max_seqlen_q")
    n = len(op._VERIFIED)
    del cu
    assert len(op._VERIFIED) == n - 1  # the entry dies with its tensor


def test_inference_tensors_are_checked_every_call():
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        op.check_cu_seqlens_values(cu, "cu_seqlens_q", 7, 4, "max_seqlen_q")
        assert cu not in op._VERIFIED
        bad = torch.tensor([0, 3, 2], dtype=torch.int32)
        with pytest.raises(ArgumentError, match="non-decreasing"):
            op.check_cu_seqlens_values(bad, "cu_seqlens_q", 7, 4, "max_seqlen_q")


def test_packing_detection_is_remembered_per_position_ids_tensor():
    from ferroattn.integrations import transformers as tf
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    run = torch.arange(5).unsqueeze(0) + 3
    assert tf._is_packed(packed, 1) and not tf._is_packed(run, 1)
    assert packed in tf._PACKED and run in tf._PACKED
    run[0, 4] = 0  # written in place: looked at again
    assert tf._is_packed(run, 1)
    assert not tf._is_packed(packed, 2)  # only a batch of one can be packed
