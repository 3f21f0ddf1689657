"""Argument checks and file writing shared by the profiler modules (internal).

Numbers: ``numbers.Real`` / ``numbers.Integral`` (so numpy scalars are accepted), never ``bool``.
Every check raises :class:`ferroattn.errors.ArgumentError` naming the argument, the expected and
the actual value.
"""
from __future__ import annotations

import math
import numbers
import os
import tempfile
from typing import Any, Callable, Optional

from ..errors import ArgumentError


def real(name: str, v: Any, lo: Optional[float] = None, *, strict: bool = False, where: str = "") -> float:
    """``v`` as a finite float (``> lo`` when ``strict``, else ``>= lo``; no bound when ``lo`` is None);
    ``where`` ends the error message (e.g. " at seqlen=128")."""
    if lo is None:
        want = "a finite real number"
    else:
        want = f"a finite real number {'>' if strict else '>='} {lo:g}"
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ArgumentError(f"{name}: expected {want}, got {type(v).__name__} {v!r}{where}")
    f = float(v)
    if not math.isfinite(f) or (lo is not None and (f <= lo if strict else f < lo)):
        raise ArgumentError(f"{name}: expected {want}, got {v!r}{where}")
    return f


def flag(name: str, v: Any) -> bool:
    """``v`` as a bool: a bool or numpy bool (a truthy string such as ``"no"`` is an ArgumentError,
    never read as True)."""
    import numpy as np  # noqa: PLC0415
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise ArgumentError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")


def integer(name: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None, *, where: str = "") -> int:
    """``v`` as an int in ``[lo, hi]`` (a bound of None: none); ``where`` ends the error message."""
    rng = "" if lo is None and hi is None else (
        f" >= {lo}" if hi is None else f" <= {hi}" if lo is None else f" in [{lo}, {hi}]")
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ArgumentError(f"{name}: expected an int{rng}, got {type(v).__name__} {v!r}{where}")
    i = int(v)
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        raise ArgumentError(f"{name}: expected an int{rng}, got {i}{where}")
    return i


def output_path(name: str, path: Any) -> str:
    """``path`` (str or os.PathLike) of a file to write: not empty, not a directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"{name}: expected a file path (str or os.PathLike), got {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str) or not p:
        raise ArgumentError(f"{name}: expected a non-empty file path, got {p!r}")
    if os.path.isdir(p):
        raise ArgumentError(f"{name}: expected a file path, got {p!r}, which is a directory")
    return p


def image_formats() -> dict:
    """{suffix: description} of the formats matplotlib can save (ImportError without matplotlib)."""
    from matplotlib.figure import Figure  # noqa: PLC0415
    return dict(Figure().canvas.get_supported_filetypes())


def figure_path(name: str, path: Any) -> str:
    """``path`` of an image to save with matplotlib: :func:`output_path` plus a suffix naming a
    format matplotlib saves (``.png``, ``.svg``, ``.pdf``, ...; case-insensitive). ImportError
    without matplotlib."""
    p = output_path(name, path)
    suffix = os.path.splitext(p)[1][1:].lower()
    formats = image_formats()
    if suffix not in formats:
        got = f"no suffix in {p!r}" if not suffix else f"{p!r} (suffix .{suffix})"
        raise ArgumentError(f"{name}: expected an image file name ending in one of "
                            f"{', '.join('.' + s for s in sorted(formats))}, got {got}")
    return p


def atomic_write(path: Any, write: Callable[[Any], None]) -> None:
    """Write a text file atomically: ``write(f)`` into a temp file in the same directory, then
    ``os.replace``; on any failure the temp file is removed and a previous ``path`` is intact."""
    p = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(p)}.", dir=os.path.dirname(p) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            write(f)
        try:   # mkstemp makes it 0600: keep a replaced file's mode, else the usual 0644
            os.chmod(tmp, os.stat(p).st_mode & 0o777)
        except FileNotFoundError:
            os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
