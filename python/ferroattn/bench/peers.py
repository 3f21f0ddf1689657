"""The peers ferroattn is measured against: torch's scaled_dot_product_attention restricted to
one backend with ``torch.nn.attention.sdpa_kernel``, and (for the attention variants)
FlexAttention (``torch.nn.attention.flex_attention`` under ``torch.compile``).

Layouts differ: ferroattn (flash_attn contract) takes (b, s, h, d); SDPA and FlexAttention take
(b, h, s, d). The benchmark gives each its natural contiguous layout. SDPA's ``is_causal=True`` is
TOP-LEFT aligned while flash_attn's causal is bottom-right; for s_q == s_k (the whole grid) they
are identical.

Variants (:mod:`.variants`; always causal, flash_attn semantics as in :mod:`ferroattn.testing`):

- FlexAttention: a ``mask_mod`` (causal, or causal + sliding window) turned into a block mask by
  ``create_block_mask`` (so fully masked tiles are skipped), a ``score_mod`` for softcap
  (``c·tanh(s/c)``) and ALiBi (``s − slope[h]·|i − j + s_k − s_q|``); sinks from the returned
  log-sum-exp: ``out · sigmoid(lse − s_aux[h])`` (the sink joins the softmax denominator only),
  inside the same compiled function. No dropout (``score_mod`` acts before the softmax). The
  functions are compiled once per process (``torch.compile(fullgraph=True, dynamic=False)``:
  static shapes, FlexAttention's fastest form; :data:`FLEX_COMPILE`); every (variant, shape) is a
  recompile, so :func:`flex_settings` raises dynamo's recompile limit (8) while the bench runs
  (past it a fullgraph compile fails with FailOnRecompileLimitHit).
- SDPA: the window as a bool ``attn_mask``, ALiBi as an additive (1, h, s_q, s_k) ``attn_mask``
  holding the bias and -inf where masked (capped at :data:`SDPA_MASK_CAP_BYTES`), dropout as
  ``dropout_p``; softcap and sinks cannot be expressed (null with the reason).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ContextManager, Iterator

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
    return attempt(fn, lambda: only(name))


def attempt(fn: Callable[[], Any], context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
            ) -> tuple[Any, str | None]:
    """Run ``fn`` once inside ``context()``: (output, None) or (None, the reason it cannot run,
    with the first lines of up to three warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with context():
                return fn(), None
        except Exception as e:  # RuntimeError "No available kernel", OOM, cuDNN errors, compile errors
            why = "; ".join(str(w.message).splitlines()[0] for w in caught[:3] if str(w.message).strip())
            return None, error_text(e) + (f" ({why})" if why else "")


def error_text(e: BaseException) -> str:
    """``Type: first line`` of an exception, plus dynamo's "Developer debug context" line when it
    has one (the exception raised inside a compiled region, e.g. FlexAttention refusing)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    ctx = next((x for x in lines if x.startswith("Developer debug context:")), None)
    return f"{type(e).__name__}: {lines[0] if lines else ''}" + (f" ({ctx})" if ctx else "")


# ---- attention variants -----------------------------------------------------------------

#: How FlexAttention is compiled (keyword arguments of ``torch.compile``).
FLEX_COMPILE: dict[str, Any] = {"fullgraph": True, "dynamic": False}
#: dynamo's recompile limit while the variant bench runs (:func:`flex_settings`).
FLEX_RECOMPILE_LIMIT = 64
#: Largest dense SDPA ``attn_mask`` the bench builds (an ALiBi bias is (1, h, s, s) in q's dtype:
#: 64 GiB at h 32, s 32k); above it SDPA is null with the size as the reason.
SDPA_MASK_CAP_BYTES = 16 * 2**30

FLEX_NO_DROPOUT = ("FlexAttention has no dropout: score_mod / mask_mod act on the scores before the softmax, "
                   "dropout on the probabilities after it")
SDPA_NO_SOFTCAP = "SDPA cannot express softcap: attn_mask is only added to the scores, nothing can cap them"
SDPA_NO_SINKS = ("SDPA cannot express attention sinks: it has no extra per-head logit in the softmax "
                 "denominator")

_FLEX: dict[tuple, tuple[Callable, Callable]] = {}


@contextlib.contextmanager
def flex_settings() -> Iterator[None]:
    """Inside the block dynamo allows :data:`FLEX_RECOMPILE_LIMIT` compiled versions per function
    (FlexAttention compiles once per variant and shape)."""
    import torch._dynamo
    cfg = torch._dynamo.config
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    with cfg.patch(**{key: max(getattr(cfg, key), FLEX_RECOMPILE_LIMIT)}):
        yield


def flex_functions() -> tuple[Callable, Callable]:
    """(attend, attend_with_sinks), compiled with :data:`FLEX_COMPILE` once per process:
    ``attend(q, k, v, score_mod, block_mask)`` and
    ``attend_with_sinks(q, k, v, score_mod, block_mask, s_aux)``."""
    key = tuple(sorted((k, repr(v)) for k, v in FLEX_COMPILE.items()))
    if key not in _FLEX:
        import torch
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        def attend(q, k, v, score_mod, block_mask):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

        def attend_with_sinks(q, k, v, score_mod, block_mask, s_aux):
            out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      return_aux=AuxRequest(lse=True))
            keep = torch.sigmoid(aux.lse - s_aux.float()[None, :, None])     # Z / (Z + exp(sink))
            return (out.float() * keep.unsqueeze(-1)).to(out.dtype)

        _FLEX[key] = (torch.compile(attend, **FLEX_COMPILE), torch.compile(attend_with_sinks, **FLEX_COMPILE))
    return _FLEX[key]


def flex_variant(window_size: tuple[int, int], softcap: float, alibi_slopes: Any, dropout_p: float, s_aux: Any,
                 s_q: int, s_k: int, device: Any) -> tuple[Callable | None, str | None]:
    """FlexAttention for one causal variant (module docstring): (``fn(q, k, v)`` on (b, h, s, d),
    None) or (None, why it cannot be expressed). ``window_size``: (left, right) as flash_attn's,
    causal (right is 0), left < 0 = no window; ``alibi_slopes`` / ``s_aux``: (h,) fp32 tensors or
    None. Builds the block mask (outside any timed region); compiles on the first call."""
    if dropout_p:
        return None, FLEX_NO_DROPOUT
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    attend, attend_with_sinks = flex_functions()
    off = s_k - s_q
    window_left = int(window_size[0])
    if window_left >= 0:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + off) & (kv_idx >= q_idx + off - window_left)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + off
    block_mask = create_block_mask(mask_mod, None, None, s_q, s_k, device=device)
    cap = float(softcap)
    slopes = alibi_slopes
    score_mod = None
    if cap or slopes is not None:
        def score_mod(score, b, h, q_idx, kv_idx):       # flash_attn order: softcap, then the bias
            if cap:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score - slopes[h] * (q_idx + off - kv_idx).abs()
            return score
    if s_aux is not None:
        return (lambda q, k, v: attend_with_sinks(q, k, v, score_mod, block_mask, s_aux)), None
    return (lambda q, k, v: attend(q, k, v, score_mod, block_mask)), None


def sdpa_variant(window_size: tuple[int, int], softcap: float, alibi_slopes: Any, dropout_p: float, s_aux: Any,
                 s_q: int, s_k: int, dtype: Any, device: Any,
                 mask_cap_bytes: int | None = None) -> tuple[Callable | None, str | None]:
    """SDPA for one causal variant (module docstring): (``fn(q, k, v)`` on (b, h, s, d), None) or
    (None, why it cannot be expressed). The masks follow :func:`ferroattn.testing.visible_mask`
    (flash_attn's window rules) and are built here, outside any timed region."""
    if softcap:
        return None, SDPA_NO_SOFTCAP
    if s_aux is not None:
        return None, SDPA_NO_SINKS
    import torch
    import torch.nn.functional as F
    from ferroattn.testing import visible_mask
    cap = SDPA_MASK_CAP_BYTES if mask_cap_bytes is None else mask_cap_bytes
    mask = None
    if alibi_slopes is not None:
        h = alibi_slopes.shape[-1]
        nbytes = h * s_q * s_k * torch.empty((), dtype=dtype).element_size()
        if nbytes > cap:
            return None, (f"the ALiBi attn_mask (1, {h}, {s_q}, {s_k}) {str(dtype).replace('torch.', '')} would be "
                          f"{nbytes / 2**30:.0f} GiB, over the bench's {cap / 2**30:.0f} GiB cap")
        vis = visible_mask(s_q, s_k, True, window_size, device=device)
        dist = (torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
                - torch.arange(s_k, device=device)[None, :]).abs().float()
        mask = torch.empty(1, h, s_q, s_k, dtype=dtype, device=device)
        for i in range(h):                                    # one head at a time: no fp32 (h, s, s)
            mask[0, i] = (-alibi_slopes[i].float() * dist).masked_fill(~vis, float("-inf"))
        del vis, dist
    elif tuple(window_size) != (-1, -1):
        if s_q * s_k > cap:
            return None, f"the window attn_mask ({s_q}, {s_k}) bool would be over the bench's {cap / 2**30:.0f} GiB cap"
        mask = visible_mask(s_q, s_k, True, window_size, device=device)
    p = float(dropout_p)
    if mask is None:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)), None
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)), None
