"""pytest configuration: the ``gpu`` marker (tests skipped unless a CUDA GPU is usable), the
``knob`` fixture and shared helpers for fake/meta tensors."""
from __future__ import annotations

import contextlib

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run through scripts/gpu_check.sh)")
    config.addinivalue_line("markers", "slow: long-running")


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def knob():
    """``knob(name, value)`` sets tuning knob ``name`` (text form, ``""`` for the default) for the
    rest of the test; every knob it set is restored after the test. Raises ArgumentError naming the
    knob for an unknown name or a malformed value."""
    from ferroattn.knobs import override

    with contextlib.ExitStack() as stack:
        yield lambda name, value: stack.enter_context(override(**{name: value}))
