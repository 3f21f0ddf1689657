"""The peers ferroattn is measured against: torch's scaled_dot_product_attention restricted to
one backend with ``torch.nn.attention.sdpa_kernel``.

Layouts differ: ferroattn (flash_attn contract) takes (b, s, h, d); SDPA takes (b, h, s, d).
The benchmark gives each its natural contiguous layout. SDPA's ``is_causal=True`` is TOP-LEFT
aligned while flash_attn's causal is bottom-right; for s_q == s_k (the whole grid) they are
identical.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

PEER_NAMES = ("flash", "cudnn", "efficient")


def backend(name: str) -> Any:
    """The ``torch.nn.attention.SDPBackend`` member for a peer name."""
    from torch.nn.attention import SDPBackend
    table = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if name not in table:
        raise ValueError(f"peer: expected one of {sorted(table)}, got {name!r}")
    return table[name]


@contextlib.contextmanager
def only(name: str) -> Iterator[None]:
    """Restrict SDPA to the backend ``name`` inside the block."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([backend(name)]):
        yield


def sdpa_fn(q: Any, k: Any, v: Any, causal: bool) -> Callable[[], Any]:
    """A no-argument call of SDPA on (b, h, s, d) tensors."""
    import torch.nn.functional as F
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def probe(name: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn`` once under backend ``name``: (output, None) or (None, reason it cannot run).
    torch explains why a backend refused in warnings; they are folded into the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with only(name):
                return fn(), None
        except Exception as e:  # RuntimeError "No available kernel", OOM, cuDNN errors
            why = "; ".join(str(w.message).splitlines()[0] for w in caught[:3])
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return None, reason + (f" ({why})" if why else "")
