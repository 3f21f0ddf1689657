"""The typed tuning knobs through ``_native`` (CPU): every knob listed with its value, a change
visible and reversible, malformed names and values rejected with an error naming them."""
from __future__ import annotations

import pytest

import ferroattn._native as native


def test_knobs_list_both_attention_families():
    knobs = native.tuning_knobs()
    assert set(knobs) >= {"attn_fwd_family", "attn_bwd_family"}
    assert all(v in ("auto", "sm80", "sm90") for k, v in knobs.items() if k.startswith("attn_"))


@pytest.mark.parametrize("name", ["attn_fwd_family", "attn_bwd_family"])
def test_knob_changes_and_restores(name):
    before = native.tuning_knobs()[name]
    try:
        native.set_tuning_knob(name, "sm80")
        assert native.tuning_knobs()[name] == "sm80"
        with pytest.raises(Exception, match="sm90") as e:
            native.set_tuning_knob(name, "hopper")
        assert "hopper" in str(e.value)
        assert native.tuning_knobs()[name] == "sm80"   # a rejected value changes nothing
    finally:
        native.set_tuning_knob(name, before)
    assert native.tuning_knobs()[name] == before


def test_unknown_knob_is_named():
    with pytest.raises(Exception, match="attn_bwd_family"):
        native.set_tuning_knob("attn_family", "sm80")
