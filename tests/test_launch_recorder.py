"""CPU tests of the launch recorder's Python surface (``_native.profiler_*``; the contract in
python/ferroattn/_native.pyi): it works without a driver when nothing was recorded, keeps its
state, and rejects bad arguments with errors naming them. The recording itself: test_gpu_launch_records.py."""
from __future__ import annotations

import pytest

from ferroattn import _native as n
from ferroattn.errors import ArgumentError


@pytest.fixture(autouse=True)
def _off():
    n.profiler_enable(False)
    yield
    n.profiler_enable(False)


def test_stats_shape_and_toggle():
    st = n.profiler_stats()
    assert set(st) == {"enabled", "pending", "skipped_capture", "dropped"}
    assert st["enabled"] is False and not n.profiler_enabled()
    n.profiler_enable(True)
    assert n.profiler_enabled() and n.profiler_stats()["enabled"] is True
    n.profiler_enable(False)
    assert not n.profiler_enabled()


def test_drain_with_nothing_recorded_is_empty():
    assert n.profiler_drain() == []
    assert n.profiler_drain(None) == []
    assert n.profiler_stats()["pending"] == 0


@pytest.mark.parametrize("bad", [1, 0, None, "yes", 1.0])
def test_enable_needs_a_bool(bad):
    with pytest.raises(TypeError, match="enabled"):
        n.profiler_enable(bad)
    assert n.profiler_enabled() is False  # state untouched


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_reference_event_out_of_range(bad):
    with pytest.raises(ArgumentError, match="reference_event"):
        n.profiler_drain(bad)


@pytest.mark.parametrize("bad", ["0", 1.5, object()])
def test_reference_event_must_be_an_int(bad):
    with pytest.raises(TypeError, match="reference_event"):
        n.profiler_drain(bad)
