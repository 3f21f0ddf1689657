"""``build_model``: a transformers model to profile, from a config name or a config.json, with
seeded random weights (nothing is downloaded).

- a name of :data:`ferroattn.demo.LLM_CONFIGS` (``"llama-3.2-1b"``: Llama-3.2-1B's published
  config, ~1.24e9 parameters; ``"tiny"``: the same structure, 2 layers of width 128) ->
  ``LlamaForCausalLM`` (:func:`ferroattn.demo.build_llm`);
- a path to a ``config.json`` file, or to a directory holding one -> ``transformers.AutoConfig``
  (the file's ``model_type`` picks the architecture) and
  ``AutoModelForCausalLM.from_config`` (weights from ``torch.manual_seed(seed)``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..errors import ArgumentError, NoDeviceError

ATTN_IMPLS = ("ferroattn", "sdpa", "eager")
DTYPES = ("bfloat16", "float16", "float32")


def _config_path(model: str) -> str:
    if os.path.isdir(model):
        p = os.path.join(model, "config.json")
        if not os.path.isfile(p):
            raise ArgumentError(f"model: expected a directory holding config.json, {model!r} has none")
        return p
    if os.path.isfile(model):
        return model
    from ..demo import LLM_CONFIGS  # noqa: PLC0415
    raise ArgumentError(f"model: expected a config name ({', '.join(sorted(LLM_CONFIGS))}) or an existing "
                        f"config.json / directory path, got {model!r}")


def read_config(model: str) -> Optional[dict]:
    """None when ``model`` is a config name of ``ferroattn.demo.LLM_CONFIGS``; else the JSON object
    of its config.json (``model`` is that file or a directory holding it), which must name a
    ``model_type``. Reads no weights and imports neither torch nor transformers. Raises
    ArgumentError naming ``model`` (unknown name, missing path, not JSON, no ``model_type``)."""
    from ..demo import LLM_CONFIGS  # noqa: PLC0415
    if model in LLM_CONFIGS:
        return None
    path = _config_path(model)
    try:
        with open(path) as f:
            cfg_dict = json.load(f)
    except (OSError, ValueError) as e:
        raise ArgumentError(f"model: expected a config.json, cannot read {path!r} as JSON ({e})") from None
    if not isinstance(cfg_dict, dict) or not cfg_dict.get("model_type"):
        raise ArgumentError(f"model: {path!r} has no \"model_type\" (transformers needs it to pick the architecture)")
    if not isinstance(cfg_dict["model_type"], str):
        raise ArgumentError(f"model: expected a str \"model_type\" in {path!r}, got {cfg_dict['model_type']!r}")
    return cfg_dict


def build_model(model: str, *, attn: str = "ferroattn", dtype: str = "bfloat16", seed: int = 0,
                device: str = "cuda") -> Any:
    """A causal LM in eval mode with seeded random weights (see the module docstring).

    model: a config name of ``ferroattn.demo.LLM_CONFIGS`` or a path to a config.json / a
    directory with one; attn: ``attn_implementation`` ("ferroattn" registers ours with
    transformers first, "sdpa", "eager"); dtype: "bfloat16", "float16" or "float32"; seed: the
    ``torch.manual_seed`` of the weights; device: "cuda", "cuda:N" or "cpu".

    Returns a ``torch.nn.Module`` (e.g. ``LlamaForCausalLM``) on ``device``, in ``dtype``, eval mode.
    Raises ArgumentError naming a bad argument (unknown name, missing path, a file that is not
    JSON, a config.json without ``model_type`` or with one transformers does not know; checked
    before the device), NoDeviceError for a CUDA device when there is no GPU, ImportError without
    transformers.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise ArgumentError(f"model: expected a config name or a path, got {type(model).__name__}")
    model = os.fspath(model)
    if attn not in ATTN_IMPLS:
        raise ArgumentError(f"attn: expected one of {ATTN_IMPLS}, got {attn!r}")
    if dtype not in DTYPES:
        raise ArgumentError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentError(f"seed: expected an int, got {seed!r}")
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ArgumentError(f"device: expected 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    cfg_dict = read_config(model)   # the name/path first: a bad one is reported on any machine
    import torch  # noqa: PLC0415
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NoDeviceError(f"device: {device!r} needs a CUDA GPU (torch.cuda.is_available() is False)")
    from ..demo import build_llm  # noqa: PLC0415
    if attn == "ferroattn":
        from ..integrations.transformers import register  # noqa: PLC0415
        register()
    if cfg_dict is None:
        return build_llm(model, device, dtype, attn, seed)
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    cfg_dict = dict(cfg_dict)
    model_type = cfg_dict.pop("model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
    except ValueError as e:   # e.g. an unknown model_type; transformers' message lists every known type
        first = (str(e).strip().splitlines() or [""])[0]
        if len(first) > 200:   # keep the first sentence
            first = first.split(". ")[0][:200] + " ..."
        raise ArgumentError(f"model: transformers cannot build a config of model_type {model_type!r} "
                            f"from {model!r}: {first}") from None
    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=getattr(torch, dtype))
    return m.to(getattr(torch, dtype)).eval()
