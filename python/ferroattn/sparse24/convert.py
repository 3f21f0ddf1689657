"""Model conversion: :func:`sparsify` turns chosen ``nn.Linear`` layers of a model into 2:4
:class:`~ferroattn.sparse24.SparseLinear` layers and reports what changed (:class:`SparsifyReport`,
with the :func:`perplexity` of a causal LM before and after)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ArgumentError, DTypeError
from .linear import SparseLinear
from .tensor import HALF, check_bool, decompress

__all__ = ["sparsify", "SparsifyReport", "perplexity", "default_filter"]


def default_filter(name: str, module: torch.nn.Module) -> bool:
    """The MLP projections of a Llama-family model: ``nn.Linear`` children of a module named
    ``mlp`` (``model.layers.N.mlp.{gate,up,down}_proj`` in Llama, Mistral, Qwen2, Gemma)."""
    parts = name.split(".")
    return isinstance(module, torch.nn.Linear) and len(parts) >= 2 and parts[-2] == "mlp"


@dataclass
class SparsifyReport:
    """What :func:`sparsify` did. ``parameters``: weight elements of the converted layers;
    ``pruned``: non-zero weights set to zero by pruning; perplexities (exp of the mean next-token
    cross entropy over ``tokens`` tokens) and whether every logit was finite, before and after,
    when text was given (else None)."""
    layers: list = field(default_factory=list)
    parameters: int = 0
    pruned: int = 0
    tokens: Optional[int] = None
    perplexity_before: Optional[float] = None
    perplexity_after: Optional[float] = None
    logits_finite_before: Optional[bool] = None
    logits_finite_after: Optional[bool] = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def perplexity_ratio(self) -> Optional[float]:
        """perplexity_after / perplexity_before (None without text)."""
        if self.perplexity_before is None or self.perplexity_after is None:
            return None
        return self.perplexity_after / self.perplexity_before

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(n_layers=self.n_layers, perplexity_ratio=self.perplexity_ratio)
        return d

    def __str__(self) -> str:
        s = (f"sparsify: {self.n_layers} layers -> SparseLinear, {self.parameters:,} weights, "
             f"{self.pruned:,} pruned ({100.0 * self.pruned / max(self.parameters, 1):.1f}%)")
        if self.perplexity_before is not None:
            s += (f"; perplexity {self.perplexity_before:.4g} -> {self.perplexity_after:.4g} "
                  f"(x{self.perplexity_ratio:.4g}) on {self.tokens} tokens; logits finite: "
                  f"{self.logits_finite_before} -> {self.logits_finite_after}")
        return s


def _token_ids(text: str, tokenizer: Any, vocab_size: Optional[int], max_tokens: int) -> list[int]:
    if tokenizer is None:
        ids = list(text.encode("utf-8"))
        if vocab_size is not None and vocab_size < 256:
            raise ArgumentError(f"tokenizer: expected a tokenizer for a model with a vocabulary of {vocab_size} "
                                f"(< 256: UTF-8 bytes do not fit), got None")
    else:
        enc = tokenizer(text)
        ids = enc["input_ids"] if isinstance(enc, Mapping) or hasattr(enc, "keys") else enc
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        ids = list(ids)
        if ids and isinstance(ids[0], (list, tuple)):
            ids = list(ids[0])
    if len(ids) < 2:
        raise ArgumentError(f"text: expected at least 2 tokens, got {len(ids)}")
    return ids[:max_tokens]


def perplexity(model: torch.nn.Module, input_ids: Tensor) -> tuple[float, bool]:
    """(exp(mean next-token cross entropy), all logits finite) of a causal LM on ``input_ids``
    (1, T) int64 on the model's device; logits read in fp32. No gradients."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        finite = bool(torch.isfinite(logits).all())
        nll = F.cross_entropy(logits[0, :-1].float(), input_ids[0, 1:])
    return float(torch.exp(nll)), finite


def sparsify(model: torch.nn.Module, filter: Optional[Callable[[str, torch.nn.Module], bool]] = None, *,
             text: Optional[str] = None, tokenizer: Any = None, prune: bool = True,
             max_tokens: int = 1024) -> SparsifyReport:
    """Convert chosen ``nn.Linear`` layers of ``model`` to 2:4 :class:`~ferroattn.nn.SparseLinear`
    in place (weights pruned by magnitude, :func:`prune`'s rule, then compressed on the weights'
    device), and report what changed.

    Args:
        model: any module; its chosen layers need fp16/bf16 weights.
        filter: ``filter(qualified_name, module) -> bool`` picks the layers (only ``nn.Linear``
            ones are converted); default :func:`default_filter` (a Llama-family model's MLP
            projections).
        text, tokenizer: when text is given, the perplexity of a causal LM (``model(input_ids=)
            .logits``) on it is measured before and after; tokenizer: a transformers tokenizer or
            any callable returning ids (``tokenizer(text)["input_ids"]`` or a list); None: UTF-8
            bytes as ids (vocabulary >= 256).
        prune: a bool (TypeError otherwise). False: the weights must already be 2:4 (else
            ValueError naming the layer).
        max_tokens: at most this many tokens of text are scored.
    Returns: :class:`SparsifyReport`.
    Raises: ArgumentError when the filter matches no nn.Linear or the text has < 2 tokens;
        DTypeError (naming the layer) for weights that are not fp16/bf16; compress's errors.
    """

    check_bool("prune", prune)   # before anything is converted
    pick = filter or default_filter
    chosen = [(name, mod) for name, mod in model.named_modules()
              if name and isinstance(mod, torch.nn.Linear) and not isinstance(mod, SparseLinear) and pick(name, mod)]
    if not chosen:
        raise ArgumentError("filter: expected to match at least one nn.Linear layer of the model, matched none")
    for name, mod in chosen:
        if mod.weight.dtype not in HALF:
            raise DTypeError(f"{name}: expected a float16 or bfloat16 weight, got {mod.weight.dtype} "
                             f"(convert the model with .to(torch.bfloat16) first)")
    report = SparsifyReport()
    ids = None
    if text is not None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        dev = next(model.parameters()).device
        ids = torch.tensor([_token_ids(text, tokenizer, vocab, max_tokens)], dtype=torch.long, device=dev)
        report.tokens = ids.shape[1]
        report.perplexity_before, report.logits_finite_before = perplexity(model, ids)
    for name, mod in chosen:
        try:
            sl = SparseLinear.from_dense(mod, prune=prune)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        with torch.no_grad():
            nnz_before = int(torch.count_nonzero(mod.weight))
            nnz_after = int(torch.count_nonzero(decompress(sl.weight)))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, sl)
        report.layers.append(name)
        report.parameters += mod.weight.numel()
        report.pruned += nnz_before - nnz_after
    if ids is not None:
        report.perplexity_after, report.logits_finite_after = perplexity(model, ids)
    return report
