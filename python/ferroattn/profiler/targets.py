"""Which modules :func:`ferroattn.profiler.attach` times: :func:`find_targets`.

The modules, in ``model.named_modules()`` order:

1. the model itself (``include_root=True``; its record is named after its class, e.g.
   ``LlamaForCausalLM``, and is the depth-0 record whose time is the "% of total" denominator);
2. the top-level components (``top_level=True``): every direct child of the model and of each
   module that holds a layer list (below) that is neither a layer list nor an ancestor of one,
   nor a bare ``ModuleList``/``ModuleDict`` container (never called itself). For Llama:
   ``lm_head``, ``model.embed_tokens``, ``model.norm``, ``model.rotary_emb`` (``model`` itself
   holds the layers and is skipped). With them the depth-1 records cover the whole forward and
   sum to about the root's time (what is left: the Python glue between them, e.g. mask building);
3. every element of a ``torch.nn.ModuleList`` whose attribute name is one of ``layer_lists``
   (default ``layers`` (Llama, Mistral, Qwen), ``h`` (GPT-2, Falcon, BLOOM), ``blocks``,
   ``layer`` (BERT's ``encoder.layer``)): the decoder (or encoder) layers;
4. in each such layer, the first direct child found under ``attention_names`` (default
   ``self_attn``, ``attention``, ``attn``) and the first under ``mlp_names`` (default ``mlp``,
   ``feed_forward``, ``ffn``). Only direct children are looked at, so e.g.
   ``attention.self`` (BERT) is timed as ``attention``.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import ArgumentError

__all__ = ["find_targets", "LAYER_LISTS", "ATTENTION_NAMES", "MLP_NAMES"]

LAYER_LISTS = ("layers", "h", "blocks", "layer")
ATTENTION_NAMES = ("self_attn", "attention", "attn")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def find_targets(model: Any, include_root: bool = True, layer_lists: Sequence[str] = LAYER_LISTS,
                 attention_names: Sequence[str] = ATTENTION_NAMES,
                 mlp_names: Sequence[str] = MLP_NAMES, top_level: bool = True) -> list:
    """The modules :func:`attach` hooks, as ``[(qualified name, module), ...]`` (rule in the
    module docstring): the root first, then the top-level components and layers in
    ``model.named_modules()`` order. Raises ArgumentError when ``model`` is not a ``torch.nn.Module``
    or a name list is not a list, tuple or set of str (a bare str included)."""
    import torch  # noqa: PLC0415
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for arg, names in (("layer_lists", layer_lists), ("attention_names", attention_names), ("mlp_names", mlp_names)):
        # a str is a sequence of characters: "layers" would match a list named "l"
        if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple, set, frozenset)) \
                or not all(isinstance(n, str) for n in names):
            raise ArgumentError(f"{arg}: expected a list, tuple or set of attribute names, got {names!r}")
    targets: list = []
    seen: set = set()

    def add(name, mod):
        if id(mod) not in seen:
            seen.add(id(mod))
            targets.append((name, mod))

    if include_root:
        add(type(model).__name__, model)
    lists = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and name and name.rsplit(".", 1)[-1] in layer_lists]
    list_names = [n for n, _ in lists]
    top: dict = {}   # qualified name -> module, for the top-level components
    if top_level:
        holders = {""} | {n.rsplit(".", 1)[0] if "." in n else "" for n in list_names}
        for hname in holders:
            holder = model.get_submodule(hname) if hname else model
            for cname, child in holder.named_children():
                q = f"{hname}.{cname}" if hname else cname
                if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    continue
                if any(ln == q or ln.startswith(q + ".") for ln in list_names):
                    continue   # a layer list, or an ancestor of one
                top[q] = child
    in_lists = {id(layer) for _, m in lists for layer in m}
    for name, mod in model.named_modules():
        if name in top and id(mod) not in in_lists:
            add(name, mod)
            continue
        if not (name in list_names and isinstance(mod, torch.nn.ModuleList)):
            continue
        for i, layer in enumerate(mod):
            lname = f"{name}.{i}"
            add(lname, layer)
            children = dict(layer.named_children())
            for group in (attention_names, mlp_names):
                for attr in group:
                    if attr in children:
                        add(f"{lname}.{attr}", children[attr])
                        break
    return targets
