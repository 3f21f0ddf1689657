"""The typed tuning knobs through ``_native`` and ``ferroattn.knobs`` (CPU): every knob listed with its
value, a change visible and reversible, malformed names and values rejected with an error naming them,
a malformed environment variable rejected naming the variable."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ferroattn._native as native
from ferroattn.errors import ArgumentError
from ferroattn.knobs import override

#: a value other than the default of every knob (text form), and malformed values
OTHER = {
    "attn_fwd_family": "sm80", "attn_bwd_family": "sm90", "attn_sm90_fwd_kv_release": "separate",
    "attn_sm90_fwd_stages": "3", "attn_sm90_fwd_persistent": "1", "attn_sm90_fwd_varlen": "1", "attn_sm90_fwd_d192": "1",
    "attn_sm90_bwd_dq_overlap": "1", "attn_sm90_bwd_varlen": "1", "attn_sm90_bwd_dq_tiled": "1",
    "attn_sm90_bwd_mask_warps": "1",
    "gemm_sm90_schedule": "auto",
    "gemm_sm90_fast_epilogue": "0", "gemm_sm90_splitk": "0", "gemm_wmma_group": "16", "gemm_wmma_streamk": "off",
    "gemm_wmma_tile": "128,128,32,2,4,4,1,1,1", "persistent_grid": "full", "sparse24_wgmma": "0",
    "sparse24_tile": "64,64,2,2,3", "sparse24_splitk": "3", "sparse24_splitk_fuse": "1", "wgmma_sp_tile": "band:4",
    "wgmma_sp_streamk": "dp:8", "wgmma_sp_epilogue": "direct", "wgmma_sp_mainloop": "pipe",
}
BAD = [("attn_fwd_family", "hopper"), ("attn_sm90_fwd_kv_release", "split"), ("attn_sm90_fwd_stages", "1"),
       ("attn_sm90_fwd_stages", "9"), ("attn_sm90_bwd_dq_overlap", "2"), ("gemm_sm90_schedule", "cooperative"), ("gemm_sm90_splitk", "yes"),
       ("gemm_wmma_streamk", "2"), ("gemm_wmma_streamk", "yes"), ("gemm_wmma_group", "0"), ("gemm_wmma_group", "x"),
       ("gemm_wmma_tile", "128,128"), ("persistent_grid", "0"), ("sparse24_splitk", "lots"),
       ("sparse24_splitk_fuse", "yes"), ("sparse24_tile", "65,64,2,2,3"), ("wgmma_sp_tile", "64"),
       ("wgmma_sp_tile", "band:0"), ("wgmma_sp_streamk", "dp:x"), ("wgmma_sp_streamk", "1"),
       ("wgmma_sp_epilogue", "fast"), ("wgmma_sp_mainloop", "3")]


def test_knobs_list_every_knob():
    knobs = native.tuning_knobs()
    assert set(knobs) == set(OTHER)
    assert all(v in ("auto", "sm80", "sm90") for k, v in knobs.items() if k.endswith("_family"))


@pytest.mark.parametrize("name", sorted(OTHER))
def test_knob_changes_and_restores(name):
    before = native.tuning_knobs()[name]
    with override(**{name: OTHER[name]}):
        assert native.tuning_knobs()[name] == OTHER[name]
        native.set_tuning_knob(name, "")                     # empty: the default
        native.set_tuning_knob(name, OTHER[name])
        assert native.tuning_knobs()[name] == OTHER[name]
    assert native.tuning_knobs()[name] == before


@pytest.mark.parametrize("name,value", BAD)
def test_malformed_value_names_the_knob_and_changes_nothing(name, value):
    before = native.tuning_knobs()
    with pytest.raises(ArgumentError, match=name) as e:
        native.set_tuning_knob(name, value)
    assert f'"{value}"' in str(e.value)
    assert native.tuning_knobs() == before


@pytest.mark.parametrize("args, match", [(("attn_fwd_family", None), "^value: expected a str, got NoneType"),
                                         (("attn_fwd_family", 1), "^value: expected a str, got int"),
                                         ((None, "sm80"), "^name: expected a str, got NoneType")])
def test_a_name_or_value_that_is_not_a_str_is_named(args, match):
    before = native.tuning_knobs()
    with pytest.raises(ArgumentError, match=match):
        native.set_tuning_knob(*args)
    assert native.tuning_knobs() == before


def test_unknown_knob_is_named():
    with pytest.raises(ArgumentError, match="attn_bwd_family") as e:
        native.set_tuning_knob("attn_family", "sm80")
    assert "attn_family" in str(e.value)


def test_override_restores_after_an_error():
    before = native.tuning_knobs()
    with pytest.raises(ArgumentError, match="gemm_wmma_group"):
        with override(sparse24_splitk="4", gemm_wmma_group="x"):
            pass
    with pytest.raises(RuntimeError):
        with override(sparse24_splitk="4"):
            assert native.tuning_knobs()["sparse24_splitk"] == "4"
            raise RuntimeError("inside")
    assert native.tuning_knobs() == before


def test_override_with_none_means_the_default():
    before = native.tuning_knobs()
    with override(attn_sm90_fwd_stages="3"):
        with override(attn_sm90_fwd_stages=None):
            assert native.tuning_knobs()["attn_sm90_fwd_stages"] == "auto"
        assert native.tuning_knobs()["attn_sm90_fwd_stages"] == "3"
    assert native.tuning_knobs() == before


def test_override_blocks_in_threads_run_one_after_the_other():
    """Two threads' overlapping blocks: the second waits for the first, each sees its own value
    throughout its block, and the knobs end as they began (no thread restores a value it did not find)."""
    import threading

    before = native.tuning_knobs()
    first_in = threading.Event()
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def block(tag, value, hold):
        with override(attn_sm90_fwd_stages=value):
            if tag == "a":
                first_in.set()
            for _ in range(5):
                seen[tag].append(native.tuning_knobs()["attn_sm90_fwd_stages"])
                hold.wait(0.01)

    hold = threading.Event()
    a = threading.Thread(target=block, args=("a", "3", hold))
    a.start()
    assert first_in.wait(10)
    b = threading.Thread(target=block, args=("b", "4", hold))
    b.start()
    a.join(10)
    b.join(10)
    assert seen == {"a": ["3"] * 5, "b": ["4"] * 5}
    assert native.tuning_knobs() == before


_BEFORE_FIXTURE: dict = {}


def test_knob_fixture_sets(knob):
    _BEFORE_FIXTURE.update(native.tuning_knobs())
    knob("wgmma_sp_tile", "128")
    knob("wgmma_sp_tile", "256")
    assert native.tuning_knobs()["wgmma_sp_tile"] == "256"


def test_knob_fixture_restored_after_the_test():
    assert not _BEFORE_FIXTURE or native.tuning_knobs() == _BEFORE_FIXTURE


@pytest.mark.parametrize("var,value", [("FERROATTN_SPARSE24_SPLITK", "lots"), ("FERROATTN_GEMM_SM90_SCHEDULE", "coperative"),
                                       ("FERROATTN_PERSISTENT_GRID", "0")])
def test_malformed_environment_variable_raises_naming_it(var, value):
    """The environment is read once, at the first use of the knobs: a malformed variable is an
    ArgumentError naming it, its values and the value given (in a fresh process)."""
    code = ("import ferroattn._native as n\n"
            "try:\n    n.tuning_knobs()\nexcept ValueError as e:\n    print('ERR', e)\n")
    env = {**os.environ, var: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR") and var in out.stdout and value in out.stdout, out.stdout


def test_environment_sets_the_initial_value():
    code = "import ferroattn._native as n\nprint(n.tuning_knobs()['sparse24_splitk'], n.tuning_knobs()['wgmma_sp_tile'])\n"
    env = {**os.environ, "FERROATTN_SPARSE24_SPLITK": " 3 ", "FERROATTN_WGMMA_SP_TILE": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3", "auto"], out.stdout + out.stderr


def test_non_utf8_environment_value_is_malformed():
    """A value that is not UTF-8 is an error naming the variable, not ignored."""
    code = ("import ferroattn._native as n\n"
            "try:\n    n.tuning_knobs()\nexcept ValueError as e:\n    print('ERR', e)\n")
    env = {**{k: v for k, v in os.environb.items()}, b"FERROATTN_ATTN_BWD_FAMILY": b"\xff"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR") and "FERROATTN_ATTN_BWD_FAMILY" in out.stdout, out.stdout


def test_setting_a_knob_replaces_its_malformed_variable_only():
    """With FERROATTN_ATTN_BWD_FAMILY malformed, setting that knob works (its variable is not
    read) and the knobs are then usable; setting another knob still names the bad variable."""
    code = ("import ferroattn._native as n\n"
            "try:\n    n.set_tuning_knob('sparse24_splitk', '2')\nexcept ValueError as e:\n    print('ERR', e)\n"
            "n.set_tuning_knob('attn_bwd_family', 'sm80')\n"
            "k = n.tuning_knobs()\nprint(k['attn_bwd_family'], k['sparse24_splitk'])\n")
    env = {**os.environ, "FERROATTN_ATTN_BWD_FAMILY": "bogus", "FERROATTN_SPARSE24_SPLITK": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ERR") and "FERROATTN_ATTN_BWD_FAMILY" in lines[0], out.stdout
    assert lines[1].split() == ["sm80", "3"], out.stdout


@pytest.mark.parametrize("var,module", [("FERROATTN_CHECK_CU_SEQLENS", "ferroattn.ops.attention"),
                                        ("FERROATTN_EAGER_FASTPATH", "ferroattn.ops._eager")])
def test_on_off_environment_switches_take_the_knobs_rule(var, module):
    """The on / off switches outside the knobs: 0 / off turn them off, a malformed value is an
    ArgumentError naming the variable (at the import that reads it)."""
    attr = "CHECK_CU_SEQLENS_VALUES" if "CHECK" in var else "ENABLED"
    code = f"import {module} as m\nprint(m.{attr})\n"
    for value, want in (("off", "False"), ("0", "False"), ("on", "True"), ("", "True")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: value}, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: "false"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "ArgumentError" in out.stderr and var in out.stderr, out.stderr
