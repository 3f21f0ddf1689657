"""CPU tests of the training comparison (python/ferroattn/bench/training.py) and the attention
peak-memory verdict (python/ferroattn/bench/memory.py): batch and padding construction, the pass
rules on synthetic numbers, and a whole run on CPU with a micro Llama config, where a plain-torch
reference stands in for our kernels behind the real transformers integration (dense batches
through flash_attn_func, the padded batch unpadded through flash_attn_varlen_func)."""
from __future__ import annotations

import json
import math

import pytest

from ferroattn.bench import memory, report, training


# ---- inputs -----------------------------------------------------------------------------

def test_make_batches_are_consecutive_windows():
    ids = list(range(100))
    b = training.make_batches(ids, steps=3, batch=2, seqlen=5)
    assert len(b) == 3 and all(len(step) == 2 and all(len(r) == 5 for r in step) for step in b)
    assert b[0] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] and b[2][1] == [25, 26, 27, 28, 29]
    with pytest.raises(ValueError, match="at least 30 tokens"):
        training.make_batches(ids[:29], steps=3, batch=2, seqlen=5)


def test_byte_token_ids_repeat_real_text():
    ids = training.byte_token_ids("héllo", 13)
    assert len(ids) == 13 and min(ids) >= training.BYTE_OFFSET > training.PAD_ID and max(ids) < 256 + 3
    assert ids[:6] == ids[6:12]          # 6 UTF-8 bytes, repeated
    with pytest.raises(ValueError):
        training.byte_token_ids("", 4)


def test_padding_plan_has_left_right_and_no_padding():
    plan = training.padding_plan(4, 512)
    assert plan == [(0, 131), (69, 0), (0, 0), (7, 170)]
    assert training.padding_plan(1, 512) == [(0, 131)]
    for left, right in training.padding_plan(8, 4):   # tiny rows keep a real token
        assert left + right <= 3


def test_padded_rows():
    rows = [[10, 11, 12, 13, 14, 15]] * 3
    p = training.padded_rows(rows, [(0, 2), (2, 0), (1, 1)])
    assert p["input_ids"] == [[10, 11, 12, 13, 0, 0], [0, 0, 12, 13, 14, 15], [0, 11, 12, 13, 14, 0]]
    assert p["attention_mask"] == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]]
    # padded positions and the first token after left padding are no targets
    assert p["labels"] == [[10, 11, 12, 13, -100, -100], [-100, -100, -100, 13, 14, 15],
                           [-100, -100, 12, 13, 14, -100]]
    assert p["position_ids"] == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 3]]


# ---- pass rules -------------------------------------------------------------------------

def test_loss_rule_pass_and_fail():
    losses = {"sdpa": [10.0, 9.0, 8.0], "eager": [10.001, 9.004, 8.002], "ferroattn": [10.002, 9.01, 8.0]}
    r = training.loss_rule(losses)
    assert r["noise_max"] == pytest.approx(0.004) and r["bound"] == pytest.approx(3 * 0.004 + 1e-3)
    assert r["ok"] and r["worst_step"] == 1 and r["max_diff"] == pytest.approx(0.01)
    losses["ferroattn"][2] = 8.0135                       # 0.0135 > 0.013
    r = training.loss_rule(losses)
    assert not r["ok"] and r["worst_step"] == 2
    losses["ferroattn"][2] = float("nan")
    r = training.loss_rule(losses)
    assert not r["ok"] and not r["finite"] and r["worst_step"] == 2
    with pytest.raises(ValueError, match="equally many"):
        training.loss_rule({"sdpa": [1.0], "eager": [1.0], "ferroattn": [1.0, 2.0]})


def test_loss_rule_atol_when_eager_matches_exactly():
    r = training.loss_rule({"sdpa": [5.0, 4.0], "eager": [5.0, 4.0], "ferroattn": [5.0009, 4.0]})
    assert r["noise_max"] == 0 and r["ok"]
    r = training.loss_rule({"sdpa": [5.0, 4.0], "eager": [5.0, 4.0], "ferroattn": [5.0011, 4.0]})
    assert not r["ok"]


def test_grad_rule():
    errs = {"sdpa": {"a": 0.01, "b": 0.02, "c": 0.0}, "ferroattn": {"a": 0.02, "b": 0.059, "c": 0.0},
            "eager": {"a": 0.5, "b": 0.5, "c": 0.5}}
    r = training.grad_rule(errs)
    assert r["ok"] and r["n_params"] == 3 and r["n_failed"] == 0
    assert r["worst_param"] == "b" and r["worst_ratio"] == pytest.approx(2.95)
    assert r["max_err"]["eager"] == 0.5 and {p["name"] for p in r["params"]} == {"a", "b", "c"}
    errs["ferroattn"]["a"] = 0.0301                       # > 3 * 0.01 + 1e-6
    errs["ferroattn"]["c"] = 2e-6                         # sdpa exact: only the 1e-6 slack
    r = training.grad_rule(errs)
    assert not r["ok"] and r["failed"] == ["a", "c"] and r["worst_param"] == "c" and r["worst_ratio"] == math.inf
    errs["ferroattn"]["a"] = float("nan")
    assert "a" in training.grad_rule(errs)["failed"]
    with pytest.raises(ValueError, match="missing"):
        training.grad_rule({"sdpa": {"a": 0.1}, "ferroattn": {}})


def test_overall_ok():
    good = {"gradients": {"ok": True}, "training": {"check": {"ok": True}}, "memory": None}
    assert training.overall_ok(good)
    assert training.overall_ok({**good, "memory": {"ok": True}})
    assert training.overall_ok({**good, "memory": {"ok": None}})       # SDPA-flash could not run: no verdict
    assert not training.overall_ok({**good, "memory": {"ok": False}})
    assert not training.overall_ok({**good, "gradients": {"ok": False}})
    assert not training.overall_ok({**good, "training": {}})
    assert not training.overall_ok({**good, "error": "RuntimeError: x"})


# ---- memory verdict ---------------------------------------------------------------------

def test_memory_verdict():
    assert memory.score_matrix_bytes(1, 16, 16384) == 8 * 2**30
    q = 16384 * 16 * 128 * 2                                               # 64 MiB
    v = memory.verdict(400 * 2**20, 420 * 2**20, q)
    assert v["ok"] and v["ratio"] == pytest.approx(400 / 420) and v["linear_bound_bytes"] == 2**30
    assert memory.verdict(640 * 2**20, 420 * 2**20, q)["ok"]              # 1.52x but within 1.5x + 16 MiB
    assert not memory.verdict(700 * 2**20, 420 * 2**20, q)["ok"]
    assert not memory.verdict(2**30 + 1, 2**31, q)["ok"]                  # not linear in s, whatever SDPA does
    v = memory.verdict(400 * 2**20, None, q)
    assert v["ok"] and v["vs_flash_ok"] is None
    assert memory.verdict(None, 1, q)["ok"] is None


def test_format_memory():
    m = {"shape": dict(b=1, s=16384, h=16, d=128, dtype="bfloat16"), "score_matrix_bytes": 8 * 2**30,
         "ferroattn": {"peak_extra_bytes": 400 * 2**20}, "sdpa_flash": {"peak_extra_bytes": None, "error": "RuntimeError: no"},
         "verdict": {"ratio": None}, "ok": True}
    line = memory.format_memory(m)
    assert "ferroattn 400 MiB" in line and "SDPA-flash n/a (RuntimeError: no)" in line and "8.0 GiB" in line
    assert line.endswith("PASS")


# ---- a whole run on CPU -----------------------------------------------------------------

MICRO = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=2048,
             rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture
def cpu_run(monkeypatch):
    """training.run on CPU: micro config, byte tokens, and a plain-torch attention behind the real
    transformers integration. ``state["causal_flip"]`` makes that attention wrong."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import ferroattn.integrations.transformers as hf
    from ferroattn import demo, testing

    state = {"dense": 0, "varlen": 0, "causal_flip": False}

    def fa(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        state["dense"] += 1
        c = (not causal) if state["causal_flip"] else causal
        return testing.attention_ref(q, k, v, causal=c, softmax_scale=softmax_scale, upcast=False)[0]

    def fav(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        state["varlen"] += 1
        c = (not causal) if state["causal_flip"] else causal
        return testing.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=c, softmax_scale=softmax_scale, upcast=False)[0]

    def no_tokenizer(path=None):
        raise demo.MissingRequirement("no tokenizer in this test")

    monkeypatch.setattr(hf, "flash_attn_func", fa)
    monkeypatch.setattr(hf, "flash_attn_varlen_func", fav)
    monkeypatch.setitem(demo.LLM_CONFIGS, "micro", MICRO)
    monkeypatch.setattr(demo, "find_minilm", no_tokenizer)

    def go(**kw):
        args = dict(config="micro", steps=3, batch=4, seqlen=24, lr=1e-3, device="cpu", dtype="float32",
                    memory=False, say=lambda m: None)
        args.update(kw)
        return training.run(**args)
    return go, state


def test_run_on_cpu_passes_with_a_correct_attention(cpu_run, tmp_path):
    go, state = cpu_run
    res = go()
    assert res["ok"], training.format_summary(res)
    assert state["dense"] > 0 and state["varlen"] > 0          # dense batches and the unpadded padded batch
    assert res["config"]["text"].startswith("UTF-8 bytes") and res["config"]["padding_plan"][1] == [8, 0]
    n_params = res["config"]["n_parameters"]
    assert n_params == sum(p for p in [512 * 64 + 64 + 2 * (4 * 16 * 64 + 2 * 2 * 16 * 64 + 64 * 4 * 16
                                                        + 3 * 64 * 128 + 2 * 64)])
    t = res["training"]
    assert set(t["losses"]) == {"sdpa", "ferroattn", "eager"} and all(len(v) == 3 for v in t["losses"].values())
    assert t["losses"]["sdpa"][-1] < t["losses"]["sdpa"][0]                  # it trains
    assert t["check"]["ok"] and len(t["check"]["diff"]) == 3
    g = res["gradients"]
    assert set(g["batches"]) == {"dense", "padded"} and g["ok"]
    for b in g["batches"].values():
        assert b["n_params"] == 20 and b["ok"] and set(b["losses"]) == {"fp32_sdpa", "sdpa", "ferroattn", "eager"}
        assert all(set(p["err"]) == {"sdpa", "ferroattn", "eager"} for p in b["params"])
    # the padded batch's loss is the same for every implementation (padded positions never count)
    pl = g["batches"]["padded"]["losses"]
    assert pl["ferroattn"] == pytest.approx(pl["fp32_sdpa"], abs=1e-4) and pl["eager"] == pytest.approx(pl["sdpa"], abs=1e-4)
    path = report.write_json(res, tmp_path, kind="training")
    assert path.name.startswith("training_") and json.loads(path.read_text())["ok"] is True
    text = training.format_summary(res)
    assert "step-0 gradients (padded batch)" in text and text.rstrip().endswith("overall: PASS")


def test_run_on_cpu_fails_with_a_wrong_attention(cpu_run):
    go, state = cpu_run
    state["causal_flip"] = True
    res = go(steps=2)
    assert not res["ok"]
    g = res["gradients"]
    assert not g["ok"] and g["batches"]["dense"]["n_failed"] > 0 and g["worst_ratio"] > 3
    assert "FAIL" in training.format_summary(res)


def test_run_records_an_error_and_fails(cpu_run, monkeypatch):
    go, _ = cpu_run

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(training, "gradient_check", boom)
    res = go()
    assert res["error"] == "RuntimeError: kernel exploded" and not res["ok"]
    assert "ERROR RuntimeError: kernel exploded" in training.format_summary(res)


def test_run_rejects_an_unknown_config():
    with pytest.raises(ValueError, match="--llm-config"):
        training.run(config="gpt-17", device="cpu")
