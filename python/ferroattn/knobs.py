"""Tuning knobs for A/B runs and tests (src/tuning/knobs.rs; the table is in docs/DEVELOPING.md):
``override`` sets some for a block and restores them after. Each knob is read from its
``FERROATTN_*`` environment variable once, when the knobs are first read successfully; changing
``os.environ`` later has no effect. A malformed variable fails every read (naming it) until it is
fixed in ``os.environ`` or its knob is set; where two or more are malformed, fix them in
``os.environ`` (setting one knob reads the others' variables).

The knobs are process-wide: while a block runs, every thread's kernel calls see its values.
``override`` blocks are serialised by one re-entrant lock, so blocks in different threads run
one after the other (each restores exactly what it found) and a block may nest inside another of
the same thread."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_LOCK = threading.RLock()


def current() -> dict[str, str]:
    """{knob name: canonical text of its value} of every knob (the environment's until a knob is
    set). Raises ArgumentError (a ValueError) naming the ``FERROATTN_*`` variable when one is
    malformed."""
    from . import _native
    return dict(_native.tuning_knobs())


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Set tuning knobs ``name=value`` (each value in its variable's text form; ``""`` or None for
    the default) inside the block and restore the previous values after, also when the block
    raises. Holds the module's lock for the whole block (see the module docstring).

    Raises ArgumentError (a ValueError) naming the knob for an unknown name or a malformed value
    (the knobs set before it are restored), or naming the environment variable when one is malformed.
    """
    from . import _native

    with _LOCK:
        before = _native.tuning_knobs()
        done = []
        try:
            for name, value in values.items():
                _native.set_tuning_knob(name, "" if value is None else str(value))
                done.append(name)
            yield
        finally:
            for name in reversed(done):
                _native.set_tuning_knob(name, before[name])
