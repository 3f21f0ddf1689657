"""Packaging: import without GPU / without torch, public names, the CLI."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import ferroattn

FA_NAMES = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_import_without_torch():
    # A meta-path finder that makes `import torch` fail, as on a machine without torch.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ferroattn\n"
        "assert 'torch' not in sys.modules, 'importing ferroattn imported torch'\n"
        "print(ferroattn.__version__, ferroattn.FerroattnError.__mro__[1].__name__)\n"
        "try:\n"
        "    ferroattn.flash_attn_func\n"
        "except ImportError as e:\n"
        "    print('lazy-import-error', e)\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert "RuntimeError" in r.stdout
    assert "lazy-import-error" in r.stdout and "torch blocked" in r.stdout


def test_import_without_gpu_does_not_touch_cuda():
    r = _run("import ferroattn, sys; print('torch' in sys.modules)", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_public_names():
    for name in FA_NAMES:
        assert name in ferroattn.__all__
        assert callable(getattr(ferroattn, name))
    assert "bert_padding" in ferroattn.__all__
    assert callable(ferroattn.bert_padding.unpad_input)
    assert callable(ferroattn.bert_padding.pad_input)
    for err in ("FerroattnError", "ArgumentError", "DTypeError", "DeviceError", "NvrtcNotFoundError"):
        assert getattr(ferroattn, err) is getattr(ferroattn.errors, err)
    assert isinstance(ferroattn.__version__, str) and ferroattn.__version__
    with pytest.raises(AttributeError, match="no_such_name"):
        ferroattn.no_such_name  # noqa: B018


def test_error_hierarchy_is_flash_attn_compatible():
    from ferroattn import errors

    assert issubclass(errors.ArgumentError, RuntimeError) and issubclass(errors.ArgumentError, ValueError)
    assert issubclass(errors.DTypeError, RuntimeError) and issubclass(errors.DTypeError, TypeError)
    assert issubclass(errors.DeviceError, RuntimeError)


def test_env_found_headers_and_configured():
    from ferroattn import _env

    assert _env.native_import_error is None, _env.native_import_error
    # the venv has nvidia-cuda-runtime: its include dir must be found
    assert any(d.endswith(os.path.join("nvidia", "cu13", "include")) for d in _env.include_dirs), _env.include_dirs
    for d in _env.include_dirs:
        assert os.path.isfile(os.path.join(d, "cuda_fp16.h"))


def test_env_preloads_nvrtc_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ferroattn\n"
        "from ferroattn import _env, _native\n"
        "print(_env.preloaded_nvrtc)\n"
        "print(_native.nvrtc_version())\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    preloaded, version = r.stdout.strip().splitlines()[-2:]
    assert preloaded.endswith("libnvrtc.so.13"), preloaded
    assert version.startswith("(13,"), version


def test_cli_info_exits_zero():
    if importlib.util.find_spec("ferroattn.__main__") is None:
        pytest.skip("ferroattn/__main__.py not written yet")
    r = subprocess.run([sys.executable, "-m", "ferroattn", "info"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ferroattn" in r.stdout


def test_attention_variant_names():
    """The variant value and the one pair count are importable where the ops and docs name them,
    and the native module has the entry points the ops call."""
    from ferroattn import _native
    from ferroattn.ops import attention, variant

    for name in ("AttnVariant", "sink_grad", "visible_pairs", "draw_rng_state"):
        assert name in variant.__all__ and callable(getattr(variant, name))
    assert "DMASK_GROUP" in variant.__all__ and variant.DMASK_GROUP == 16
    assert attention.AttnVariant is variant.AttnVariant and attention.visible_pairs is variant.visible_pairs
    for name in ("attn_fwd_dmask", "run_attn_fwd_dmask"):
        assert name in attention.__all__ and callable(getattr(attention, name))
    for name in ("attn_fwd", "attn_fwd_check", "attn_bwd", "attn_bwd_check", "attn_visible_pairs"):
        assert callable(getattr(_native, name)), name
    v = variant.AttnVariant()
    # (window_left, window_right, softcap, alibi_slopes, sinks, dropout_p, rng_state)
    assert v.is_plain and v.op_args() == (-1, -1, 0.0, None, None, 0.0, None)
    assert variant.AttnVariant.from_op_args(True, 3, 0, 2.0, None, None) == variant.AttnVariant(True, 3, 0, 2.0)
    d = variant.AttnVariant.from_op_args(False, -1, -1, 0.0, None, None, 0.25, None)
    assert d.dropout_p == 0.25 and not d.is_plain and d.op_args()[5:] == (0.25, None)
