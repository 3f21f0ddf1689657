"""CPU tests of the command line (python/ferroattn/__main__.py): argument errors, `info` and
`precompile` against a fake ferroattn._native that follows _native.pyi, and the demo/bench
refusals on a machine without a GPU."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

import ferroattn.__main__ as cli
from ferroattn.errors import CompileError


def _kernel(arch, config="attn_fwd_sm80<64, 128, 64, 4, 2, false, __nv_bfloat16>", spills=(0, 0), cached=False):
    return {"kernel": "ferroattn::attn_fwd_sm80", "config": config, "arch": arch, "registers": 168,
            "spill_stores": spills[0], "spill_loads": spills[1], "stack_bytes": 0, "static_smem_bytes": 0,
            "dynamic_smem_bytes": 49152, "cubin_bytes": 70000, "compile_seconds": 1.25, "from_cache": cached}


class FakeNative:
    """The parts of ferroattn._native that the CLI uses, per _native.pyi."""

    __version__ = "0.1.0"

    def __init__(self, gpu=False, fail_arch=None, spill_arch=None):
        self.gpu, self.fail_arch, self.spill_arch = gpu, fail_arch, spill_arch
        self.precompile_calls = []

    def nvrtc_version(self):
        return (13, 0)

    def header_dir(self):
        return "/site/nvidia/cu13/include"

    def cache_dir(self):
        return pathlib.Path("/root/.cache/ferroattn")  # the real extension returns a Path

    def cuda_available(self):
        return self.gpu

    def device_info(self, ordinal=0):
        if not self.gpu:
            raise RuntimeError("NoDeviceError")
        return {"name": "NVIDIA H200", "sm": (9, 0), "arch": "sm_90a", "sm_count": 132,
                "total_memory_bytes": 150_000_000_000, "driver_version": "580.159.04"}

    def precompile_archs(self):
        return ["sm_80", "sm_86", "sm_90a"]

    def precompile(self, archs, check_spills=False):
        self.precompile_calls.append((list(archs), check_spills))
        out = []
        for a in archs:
            if a == self.fail_arch:
                raise CompileError(f"nvrtc: error in attn_fwd_sm80 for {a}")
            out.append(_kernel(a, spills=(64, 72) if a == self.spill_arch else (0, 0)))
            out.append(_kernel(a, config="attn_fwd_sm80<128, 128, 64, 4, 2, true, __half>", cached=True))
        return out

    def jit_stats(self):
        return {"compiles": 4, "compile_seconds": 5.0, "disk_hits": 2, "disk_load_seconds": 0.01,
                "memory_hits": 0, "corrupt_rebuilt": 0}


@pytest.fixture
def fake(monkeypatch):
    def install(**kw):
        nat = FakeNative(**kw)
        monkeypatch.setattr(cli, "_load_native", lambda: nat)
        return nat
    return install


# ---- argument errors --------------------------------------------------------------------

def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    assert "info" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["sm_8x", "90a", "sm_", ","])
def test_bad_arch_is_a_usage_error_naming_the_option(arch, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["precompile", "--arch", arch])
    assert e.value.code == 2
    assert "--arch" in capsys.readouterr().err


def test_parse_archs():
    assert cli.parse_archs("sm_80,sm_90a") == ["sm_80", "sm_90a"]
    assert cli.parse_archs(" sm_86 ") == ["sm_86"]
    with pytest.raises(ValueError, match="sm_9x"):
        cli.parse_archs("sm_80,sm_9x")
    with pytest.raises(ValueError, match="sm_80aa"):
        cli.parse_archs("sm_80aa")


@pytest.mark.parametrize("argv", [["demo", "--repeats", "0"], ["bench", "attention", "--rep-ms", "nan"],
                                  ["bench", "attention", "--time-budget-s", "-1"],
                                  ["bench", "attention", "--backward", "--rep-ms", "-5"]])
def test_bad_timing_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "expected a positive" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "2048,x", "0", "-5,10"])
def test_bad_seqlens_are_usage_errors(text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--seqlens", text])
    assert e.value.code == 2
    assert "--seqlens" in capsys.readouterr().err


def test_demo_unknown_llm_config_exits_2(capsys):
    assert cli.main(["demo", "--llm-config", "gpt-17"]) == 2
    assert "gpt-17" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["bench", "attention", "--dtypes", "fp8"], "--dtypes"),
    (["bench", "attention", "--head-dims", "96"], "--head-dims"),
    (["bench", "attention", "--seqlens", "1000"], "--seqlens"),
    (["bench", "attention", "--peers", "flash,xformers"], "--peers"),
])
def test_bench_argument_errors_before_any_gpu_work(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bench_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert e.value.code == 2


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "ferroattn", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for cmd in ("info", "precompile", "demo", "bench"):
        assert cmd in r.stdout


# ---- info -------------------------------------------------------------------------------

def test_info_without_gpu_exits_0_with_a_clear_line(fake, capsys):
    fake(gpu=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA driver/GPU found" in out
    assert "13.0" in out and "/site/nvidia/cu13/include" in out and "/root/.cache/ferroattn" in out


def test_info_with_gpu_prints_name_sm_sms_memory(fake, capsys):
    fake(gpu=True)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "sm 9.0" in out and "sm_90a" in out and "132 SMs" in out
    assert "139.7 GiB" in out and "580.159.04" in out


def test_info_json(fake, capsys):
    fake(gpu=True)
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpu"]["sm_count"] == 132 and info["nvrtc_version"] == "13.0" and info["gpu_error"] is None


def test_info_without_the_extension_exits_1_with_the_reason(monkeypatch, capsys):
    def boom():
        raise cli._NativeImportError("cannot import ferroattn._native (ImportError: nope)")
    monkeypatch.setattr(cli, "_load_native", boom)
    assert cli.main(["info"]) == 1
    assert "cannot import ferroattn._native" in capsys.readouterr().err


def test_info_does_not_import_torch():
    code = ("import sys, ferroattn.__main__ as c\n"
            "try:\n    c.main(['info'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "NOTORCH", r.stdout + r.stderr


# ---- precompile -------------------------------------------------------------------------

def test_precompile_default_archs_without_gpu(fake, capsys):
    nat = fake(gpu=False)
    assert cli.main(["precompile"]) == 0
    assert [c[0] for c in nat.precompile_calls] == [["sm_80", "sm_90a"]]   # one call: parallel across archs
    out = capsys.readouterr().out
    for col in ("config", "arch", "regs", "spills", "smem", "compile s", "cached"):
        assert col in out
    assert "4 kernels for sm_80,sm_90a: 2 from cache (the disk cache" in out and "5.00 s compiling" in out and "s wall" in out
    assert "jit_stats:" in out


def test_precompile_unknown_arch_exits_2_before_compiling(fake, capsys):
    nat = fake()
    assert cli.main(["precompile", "--arch", "sm_80,sm_75"]) == 2
    cap = capsys.readouterr()
    assert nat.precompile_calls == [] and cap.out == ""       # no notice, no table
    assert "--arch" in cap.err and "'sm_75'" in cap.err and "sm_90a" in cap.err
    assert cli.main(["precompile", "--arch", "sm_90"]) == 0      # sm_90 is sm_90a's alias


def test_precompile_archs_are_the_extensions():
    import ferroattn._native as native
    archs = native.precompile_archs()
    assert "sm_80" in archs and "sm_90a" in archs and "sm_75" not in archs


def test_precompile_default_arch_is_the_gpus(fake):
    nat = fake(gpu=True)
    assert cli.main(["precompile"]) == 0
    assert [c[0] for c in nat.precompile_calls] == [["sm_90a"]]


def test_precompile_spills_fail_only_with_check_spills(fake, capsys, tmp_path):
    fake(spill_arch="sm_90a")
    assert cli.main(["precompile", "--arch", "sm_80,sm_90a"]) == 0
    assert "warning" in capsys.readouterr().err
    path = tmp_path / "pre.json"
    assert cli.main(["precompile", "--arch", "sm_80,sm_90a", "--check-spills", "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert "ERROR" in err and "sm_90a" in err and "64 B stores" in err
    data = json.loads(path.read_text())
    assert data["spilled"] == 1 and len(data["kernels"]) == 4


def test_precompile_compile_error_exits_1_and_keeps_other_archs(fake, capsys):
    nat = fake(fail_arch="sm_80")
    assert cli.main(["precompile", "--arch", "sm_80,sm_90a"]) == 1
    assert [c[0] for c in nat.precompile_calls] == [["sm_80", "sm_90a"], ["sm_80"], ["sm_90a"]]
    cap = capsys.readouterr()
    assert "sm_90a" in cap.out and "CompileError" in cap.err and "sm_80" in cap.err


def test_format_table_aligns_columns():
    t = cli.format_table(("a", "long column"), [("xxxxx", "1"), ("y", "22")]).splitlines()
    assert len(t) == 4 and len({len(line.rstrip()) for line in t[:2]}) == 1


# ---- demo / bench without a GPU ---------------------------------------------------------

def test_demo_without_gpu_prints_needs_and_exits_3(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo"]) == 3
    cap = capsys.readouterr()
    assert "ferroattn demo needs:" in cap.out and "GPU" in cap.out
    lines = [line for line in cap.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_bench_without_gpu_exits_3(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "attention", "--quick"]) == 3
    assert "no CUDA GPU" in capsys.readouterr().err


def test_real_info_if_the_extension_is_built(capsys):
    try:
        cli._load_native()
    except cli._NativeImportError:
        pytest.skip("ferroattn._native is not built")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "NVRTC" in out and ("GPU 0" in out or "no CUDA driver/GPU found" in out or "Error" in out)


@pytest.mark.parametrize("extra", [["--pages", ","], ["--pages", "16,,64"], ["--rep-ms", "inf"], ["--time-budget-s", "nan"],
                                   ["--time-budget-s", "-1"], ["--rounds", "0"]])
def test_bench_decode_bad_options_exit_2(extra, capsys):
    assert cli.main(["bench", "decode", *extra]) == 2
    assert "--pages must be a non-empty list of positive ints" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "129", "x", "8,,16", "-1", "1.5"])
def test_bench_decode_bad_num_splits_exit_2(value, capsys):
    assert cli.main(["bench", "decode", "--num-splits", value]) == 2
    assert f"--num-splits: expected comma-separated ints in 1..128, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--batch", "0"], ["--batch", "1,x"], ["--batch", ""], ["--batch", "1,,2"],
                                   ["--prompt", "0"], ["--new-tokens", "1"], ["--rounds", "0"]])
def test_bench_generate_bad_options_exit_2(extra, capsys):
    assert cli.main(["bench", "generate", *extra]) == 2
    err = capsys.readouterr().err
    assert f"{extra[0]}: expected" in err and "got" in err


def test_bench_generate_checks_its_out_directory_first(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["bench", "generate", "--out", str(blocker)]) == 2
    assert "--out: expected a writable directory" in capsys.readouterr().err


def test_bench_generate_without_a_gpu_says_so(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "generate", "--batch", "1"]) == 3
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_bench_decode_checks_its_out_directory_first(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["bench", "decode", "--out", str(blocker / "sub")]) == 2
    assert "--out: expected a writable directory" in capsys.readouterr().err
