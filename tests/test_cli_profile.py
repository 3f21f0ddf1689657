"""`python -m ferroattn profile` on CPU: argument errors (exit 2), the no-GPU refusal (exit 3), and
the sweep report itself run on the CPU (tiny Llama, sdpa) with its exit codes."""
from __future__ import annotations

import re

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
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    for model in ("tiny", str(tmp_path), str(tmp_path / "config.json")):
        assert cli.main(["profile", "--model", model, "--batch", "1,2", "--seq", "128"]) == 3
        assert "cannot run: no CUDA GPU found" in capsys.readouterr().err


def test_with_a_gpu_main_runs_the_sweep(monkeypatch):
    monkeypatch.setattr(pcli, "_cuda_available", lambda: True)
    seen = []
    monkeypatch.setattr(pcli, "run_sweep", lambda args: seen.append((args.model, args.batch, args.attn)) or 0)
    assert cli.main(["profile", "--model", "tiny", "--batch", "1,2", "--attn", "sdpa"]) == 0
    assert seen == [("tiny", [1, 2], "sdpa")]


def _args(tmp_path, model="tiny", batch=(1, 2), seq=(8, 16, 32)):
    return cli.build_parser().parse_args(["profile", "--model", model, "--batch", ",".join(map(str, batch)),
                                          "--seq", ",".join(map(str, seq)), "--attn", "sdpa",
                                          "--trace", str(tmp_path / "t.json"), "--plot", str(tmp_path / "p.png")])


def test_run_sweep_on_the_cpu_prints_tables_and_writes_trace_and_plot(tmp_path, capsys):
    pytest.importorskip("transformers")
    import json
    import io
    out = io.StringIO()
    rc = pcli.run_sweep(_args(tmp_path), device="cpu", repeats=1, warmup=0, out=out)
    text, err = out.getvalue(), capsys.readouterr().err
    assert rc == 0, err
    assert "profile sweep" in err                                   # progress bar
    assert "latency ms" in text and "tokens/s" in text and "knee" in text
    assert "profile of batch=" in text and "model.layers.0.self_attn" in text and "% of total" in text
    assert "Config" in text                                        # the kernel table (empty on the CPU)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert any(e["ph"] == "X" and e["name"] == "lm_head" for e in doc["traceEvents"])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


class _Toy:
    """build_model stand-in: a module failing with OOM above 32 tokens and a ValueError at (1, 16)."""

    def __init__(self, bad):
        self.bad = bad

    def __call__(self, model, attn, device):
        import torch

        bad = self.bad

        class Toy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(2, 2)
                self.config = type("C", (), {"vocab_size": 10})()

            def forward(self, ids):
                b, s = ids.shape
                if b * s > 32:
                    raise torch.OutOfMemoryError("CUDA out of memory")
                if (b, s) == bad:
                    raise ValueError("bad")
                return self.lin(torch.ones(b, s, 2))
        return Toy()


@pytest.mark.parametrize("bad, rc", [(None, 0), ((1, 16), 1)])
def test_exit_code_oom_points_ok_other_failures_1(monkeypatch, tmp_path, capsys, bad, rc):
    import io
    from ferroattn.profiler import models
    monkeypatch.setattr(models, "build_model", _Toy(bad))
    assert pcli.run_sweep(_args(tmp_path), device="cpu", repeats=1, warmup=0, out=io.StringIO()) == rc
    err = capsys.readouterr().err
    assert "batch=2, seqlen=32: out of memory" in err
    assert ("ValueError: bad" in err) == (bad is not None)


def test_exit_1_when_no_point_ran(monkeypatch, tmp_path, capsys):
    import io
    from ferroattn.profiler import models
    monkeypatch.setattr(models, "build_model", _Toy(None))
    args = _args(tmp_path, batch=(4,), seq=(16, 32))
    assert pcli.run_sweep(args, device="cpu", repeats=1, warmup=0, out=io.StringIO()) == 1
    assert "no point of the sweep ran" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_defaults_parse():
    a = cli.build_parser().parse_args(["profile", "--model", "tiny"])
    assert (a.batch, a.seq, a.attn, a.trace, a.plot) == ([1, 4, 16], [512, 2048, 8192], "ferroattn", None, None)


# ---- review fixes -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, opt, match", [
    (["--batch", "65536", "--seq", "65536"], "--batch/--seq", "batch x seqlen <= 2147483647"),
    (["--plot", "{tmp}/p.notafmt"], "--plot", r"suffix \.notafmt"),
    (["--plot", "{tmp}/p"], "--plot", "no suffix"),
    (["--plot", "{tmp}"], "--plot", "is a directory"),
    (["--trace", "{tmp}"], "--trace", "is a directory"),
    (["--trace", ""], "--trace", "non-empty"),
])
def test_more_bad_arguments_exit_2_up_front(monkeypatch, tmp_path, capsys, argv, opt, match):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(pcli, "run_sweep", lambda args: pytest.fail("validation let it through"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["profile", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{pcli.PROG}: {opt}: " in err and re.search(match, err), err
    assert list(tmp_path.iterdir()) == []


def test_model_files_that_are_not_configs_exit_2(tmp_path, capsys):
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert cli.main(["profile", "--model", str(tmp_path / "passwd")]) == 2
    assert "--model: expected a config.json, cannot read" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert cli.main(["profile", "--model", str(tmp_path)]) == 2
    assert "--model: " in capsys.readouterr().err


def test_unknown_model_type_exits_2_with_a_short_message(tmp_path, capsys):
    pytest.importorskip("transformers")
    import io
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch"}')
    args = _args(tmp_path, model=str(tmp_path))
    assert pcli.validate(args) is None            # valid JSON with a model_type: transformers decides
    assert pcli.run_sweep(args, device="cpu", repeats=1, warmup=0, out=io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{pcli.PROG}: --model: transformers cannot build a config of model_type 'no-such-arch'")
    assert "\n" not in err and len(err) < 400


def test_axes_sharing_a_value_give_a_report_not_a_traceback(monkeypatch, tmp_path, capsys):
    import io
    from ferroattn.profiler import models
    monkeypatch.setattr(models, "build_model", _Toy(None))
    out = io.StringIO()
    assert pcli.run_sweep(_args(tmp_path, batch=(1, 2), seq=(2, 5)), device="cpu", repeats=1, warmup=0,
                          out=out) == 0
    assert "knee: not enough points" in out.getvalue() and (tmp_path / "p.png").exists()


@pytest.mark.parametrize("text", ["1,,2", "1,", ",1", " , "])
def test_parse_axis_rejects_empty_items(text):
    with pytest.raises(ValueError, match="^--batch: expected comma-separated positive integers without empty"):
        pcli.parse_axis(text, "--batch")
    assert pcli.parse_axis(" 4, 1 ,2", "--batch") == [4, 1, 2]
    with pytest.raises(ValueError, match="^--seq: expected distinct values"):
        pcli.parse_axis("8,8", "--seq")


@pytest.mark.parametrize("opt, bad, match", [
    ("--batch", "1,,2", "without empty items"), ("--batch", "2,", "without empty items"),
    ("--batch", "1,1", "distinct"), ("--seq", "8,16,8", "distinct"),
    ("--seq", "99999999999999999999", "<= 2147483647"), ("--batch", "2147483648", "<= 2147483647"),
])
def test_axis_list_errors_exit_2_naming_the_option(capsys, opt, bad, match):
    """--batch/--seq are parsed by profiler.cli.parse_axis as the argparse type: exit 2 at parsing."""
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--model", "tiny", opt, bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {opt}: {opt}: " in err and re.search(match, err), err
