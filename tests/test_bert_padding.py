"""ferroattn.bert_padding on CPU: the flash_attn contract (5-tuple), round trip, gradients."""
from __future__ import annotations

import pytest
import torch

from ferroattn.bert_padding import pad_input, unpad_input


def _mask():
    # right padding, left padding, middle hole, full, empty
    return torch.tensor([[1, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1],
                         [1, 0, 1, 1, 0],
                         [1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0]], dtype=torch.bool)


def test_unpad_contract():
    torch.manual_seed(0)
    mask = _mask()
    x = torch.randn(5, 5, 3, 4)
    x_unpad, indices, cu, max_len, seqused = unpad_input(x, mask)
    assert x_unpad.shape == (14, 3, 4)
    assert indices.dtype == torch.int64 and indices.tolist() == torch.nonzero(mask.flatten()).flatten().tolist()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 6, 9, 14, 14]
    assert max_len == 5 and isinstance(max_len, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [3, 3, 3, 5, 0]
    # tokens in order, batch-major
    expected = torch.cat([x[b][mask[b]] for b in range(5)])
    assert torch.equal(x_unpad, expected)


def test_round_trip_zeroes_padding():
    torch.manual_seed(1)
    mask = _mask()
    x = torch.randn(5, 5, 7)
    x_unpad, indices, *_ = unpad_input(x, mask)
    back = pad_input(x_unpad, indices, 5, 5)
    assert back.shape == x.shape
    assert torch.equal(back[mask], x[mask])
    assert torch.all(back[~mask] == 0)


def test_unused_mask():
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0]], dtype=torch.bool)
    x = torch.randn(1, 4, 2)
    x_unpad, indices, cu, max_len, seqused = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2] and cu.tolist() == [0, 3] and max_len == 3
    assert seqused.tolist() == [2]


def test_int_mask_and_gradients():
    mask = _mask().to(torch.int64)
    x = torch.randn(5, 5, 3, requires_grad=True)
    x_unpad, indices, *_ = unpad_input(x, mask)
    y = pad_input(x_unpad * 2, indices, 5, 5)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * mask[..., None].to(x.dtype).expand_as(x))


def test_index_first_axis_and_inverse_are_differentiable():
    torch.manual_seed(2)
    from ferroattn.bert_padding import index_first_axis, index_put_first_axis

    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 5])
    g = index_first_axis(x, idx)
    assert torch.equal(g, x[idx]) and g.data_ptr() != x.data_ptr()
    back = index_put_first_axis(g, idx, 6)
    assert back.shape == x.shape and torch.equal(back[idx], x[idx]) and torch.all(back[[1, 2, 3]] == 0)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(index_first_axis(t, idx) * 3, idx, 6), (x,))
    (back * torch.arange(6.0, dtype=torch.float64)[:, None, None]).sum().backward()
    expected = torch.zeros(6, 2, 3, dtype=torch.float64)
    expected[idx] = torch.tensor([4.0, 0.0, 5.0], dtype=torch.float64)[:, None, None]
    assert torch.equal(x.grad, expected)


def test_unpad_input_masks_are_checked_and_read_as_nonzero():
    from ferroattn.bert_padding import unpad_input
    from ferroattn.errors import ArgumentError
    x = torch.arange(8.0).view(2, 4, 1)
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    want = unpad_input(x, m.bool())
    for mask in (m * 2, m.float() * 0.5):
        got = unpad_input(x, mask)
        assert torch.equal(got[0], want[0]) and got[2].tolist() == [0, 2, 5] and got[3] == 3
    # an unused_mask overlapping attention_mask counts each token once
    got = unpad_input(x, m, unused_mask=m)
    assert got[2].tolist() == [0, 2, 5] and got[4].tolist() == [2, 3]
    with pytest.raises(ArgumentError, match=r"^attention_mask: expected shape \(batch, seqlen\) = \(2, 4\), got \(2, 3\)"):
        unpad_input(x, m[:, :3])
    with pytest.raises(ArgumentError, match="^unused_mask: expected shape"):
        unpad_input(x, m, unused_mask=torch.tensor([0, 0, 1, 0]))
    with pytest.raises(ArgumentError, match="^attention_mask: expected a .* tensor, got list"):
        unpad_input(x, [[1, 1, 0, 0], [1, 1, 1, 0]])
