"""Remember a host-side fact about a tensor's *values* (one device->host sync) per tensor.

A model calls every attention layer with the same ``cu_seqlens`` / ``position_ids`` tensor;
facts that need the values (are the cu_seqlens valid? is the batch packed?) are computed once per
tensor instead of once per layer, so a forward pass syncs once rather than once per layer.

An entry is keyed by the tensor's identity and, for ordinary tensors, torch's version counter
(bumped by every in-place write), so a modified tensor is looked at again. Inference tensors
(created under ``torch.inference_mode``) have no version counter: a memo created with
``trust_inference=False`` never remembers them; with ``True`` it remembers them by identity alone
(an in-place write to them inside inference mode goes unnoticed). Entries die with their tensor.
"""
from __future__ import annotations

import weakref
from typing import Any, Hashable, Optional

__all__ = ["TensorMemo"]

class TensorMemo:
    def __init__(self, trust_inference: bool) -> None:
        self._trust_inference = trust_inference
        self._entries: dict = {}  # id(tensor) -> (weakref, version or None, extra key, value)

    def _version(self, t: Any) -> Optional[int]:
        return None if t.is_inference() else t._version

    def get(self, t: Any, extra: Hashable = None, default: Any = None) -> Any:
        """The value remembered for ``t`` (and ``extra``), or ``default``."""
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t:
            return default
        if entry[1] != self._version(t) or entry[2] != extra:
            return default
        return entry[3]

    def put(self, t: Any, value: Any, extra: Hashable = None) -> None:
        """Remember ``value`` for ``t`` (and ``extra``), unless ``t`` cannot be tracked."""
        if t.is_inference() and not self._trust_inference:
            return
        key = id(t)
        ref = weakref.ref(t, lambda _r, key=key, entries=self._entries: entries.pop(key, None))
        self._entries[key] = (ref, self._version(t), extra, value)

    def __contains__(self, t: Any) -> bool:
        """True when something is remembered for ``t`` as it is now (any ``extra``)."""
        entry = self._entries.get(id(t))
        return entry is not None and entry[0]() is t and entry[1] == self._version(t)

    def __len__(self) -> int:
        return len(self._entries)
