"""`python -m ferroattn profile` on CPU: argument errors (exit 2) and the no-GPU refusal (exit 3)."""
from __future__ import annotations

import pytest

import ferroattn.__main__ as cli
from ferroattn.profiler import cli as pcli


@pytest.mark.parametrize("opt, text", [("--batch", "0"), ("--batch", "1,x"), ("--seq", ""), ("--seq", "-512")])
def test_bad_int_lists_exit_2_naming_the_option(opt, text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--model", "tiny", opt, text])
    assert e.value.code == 2 and opt in capsys.readouterr().err


def test_unknown_attn_and_missing_model_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--model", "tiny", "--attn", "eager"])
    assert e.value.code == 2 and "--attn" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["profile"])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


def test_model_name_or_path_validated(tmp_path, capsys):
    assert cli.main(["profile", "--model", "gpt-17"]) == 2
    assert "--model" in capsys.readouterr().err
    assert cli.main(["profile", "--model", str(tmp_path)]) == 2          # a directory without config.json
    assert "config.json" in capsys.readouterr().err
    assert cli.main(["profile", "--model", "tiny", "--trace", str(tmp_path / "no" / "t.json")]) == 2
    assert "--trace" in capsys.readouterr().err
    assert cli.main(["profile", "--model", "tiny", "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_no_gpu_exits_3(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pcli, "_cuda_available", lambda: False)
    (tmp_path / "config.json").write_text("{}")
    for model in ("tiny", str(tmp_path), str(tmp_path / "config.json")):
        assert cli.main(["profile", "--model", model, "--batch", "1,2", "--seq", "128"]) == 3
        assert "cannot run: no CUDA GPU found" in capsys.readouterr().err


def test_sweep_not_yet_written_says_so(monkeypatch, capsys):
    monkeypatch.setattr(pcli, "_cuda_available", lambda: True)
    assert cli.main(["profile", "--model", "tiny"]) == 1
    assert "lands with the GPU part of issue 5" in capsys.readouterr().err


def test_defaults_parse():
    a = cli.build_parser().parse_args(["profile", "--model", "tiny"])
    assert (a.batch, a.seq, a.attn, a.trace, a.plot) == ([1, 4, 16], [512, 2048, 8192], "ferroattn", None, None)
