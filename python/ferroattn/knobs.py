"""Tuning knobs for A/B runs and tests (src/tuning/knobs.rs; the table is in docs/DEVELOPING.md):
``override`` sets some for a block and restores them after. Each knob is read from its
``FERROATTN_*`` environment variable once; changing ``os.environ`` later has no effect."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def override(**values: str) -> Iterator[None]:
    """Set tuning knobs ``name=value`` (each value in its variable's text form, ``""`` for the
    default) inside the block and restore the previous values after, also when the block raises.

    Raises ArgumentError (a ValueError) naming the knob for an unknown name or a malformed value
    (the knobs set before it are restored), or naming the environment variable when one is malformed.
    """
    from . import _native

    before = _native.tuning_knobs()
    done = []
    try:
        for name, value in values.items():
            _native.set_tuning_knob(name, str(value))
            done.append(name)
        yield
    finally:
        for name in done:
            _native.set_tuning_knob(name, before[name])
