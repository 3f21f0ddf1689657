"""`bench generate`'s measurement arithmetic on the CPU, with a fake model and a fake clock:
decode tokens/s from (total - prefill), the paired per-round ratio, the alternating order of
the implementations, the token agreement."""
from __future__ import annotations

import pytest
import torch

from ferroattn.bench import generate


class FakeModel:
    """generate() advances a fake clock: prefill 0.1 s, then per new token 0.01 s (sdpa) or
    0.008 s (ferroattn); the tokens are 7 for sdpa and 7 or 8 (every other one) for ferroattn."""

    def __init__(self, clock):
        self.clock, self.impl, self.order = clock, None, []

    def set_attn_implementation(self, name):
        self.impl = name

    def generate(self, input_ids, attention_mask, do_sample, max_new_tokens, min_new_tokens, pad_token_id):
        assert not do_sample and max_new_tokens == min_new_tokens and attention_mask.shape == input_ids.shape
        self.order.append((self.impl, max_new_tokens))
        step = 0.01 if self.impl == "sdpa" else 0.008
        self.clock[0] += 0.1 + step * (max_new_tokens - 1)
        b, s = input_ids.shape
        new = torch.full((b, max_new_tokens), 7)
        if self.impl == "ferroattn":
            new[:, 1::2] = 8
        return torch.cat([input_ids, new], dim=1)


def test_decode_throughput_ratio_and_agreement(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(generate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)      # ids stay on the CPU
    model = FakeModel(clock)
    row = generate.measure_batch(model, b=2, prompt=16, new_tokens=11, rounds=3, vocab=100)
    med = row["median"]
    assert abs(med["sdpa"]["prefill_s"] - 0.1) < 1e-9 and abs(med["sdpa"]["total_s"] - 0.2) < 1e-9
    assert abs(med["sdpa"]["decode_tok_s"] - 2 * 10 / 0.1) < 1e-6                # b (n - 1) / (total - prefill)
    assert abs(med["ferroattn"]["decode_tok_s"] - 2 * 10 / 0.08) < 1e-6
    assert abs(row["decode_tok_s_ratio_ferroattn_vs_sdpa"] - 1.25) < 1e-9
    assert abs(row["token_agreement"] - 6 / 11) < 1e-6                            # tokens 0, 2, 4, ... agree
    timed = [o for o in model.order if o[1] == 11]                                # warm-up: 4 tokens
    assert [impl for impl, _ in timed] == ["sdpa", "ferroattn", "ferroattn", "sdpa", "sdpa", "ferroattn"]


class FakeBatchModel:
    """generate_batch() advances the fake clock by 0.2 s (sdpa) or 0.16 s (ferroattn) per call of
    b requests x n tokens (0.002 s for a warm-up call); tokens 5, ferroattn's last one 6; with
    ``short`` ferroattn's requests come back empty (a failed step)."""

    def __init__(self, clock, short=False):
        self.clock, self.short, self.order = clock, short, []
        self.config = type("Config", (), {"_attn_implementation": None})()

    def set_attn_implementation(self, name):
        self.config._attn_implementation = name

    def generate_batch(self, inputs, generation_config):
        impl, n = self.config._attn_implementation, generation_config.max_new_tokens
        assert not generation_config.do_sample
        self.order.append((impl, n, len(inputs[0])))
        self.clock[0] += 0.002 if n == 4 else (0.2 if impl == "sdpa" else 0.16)
        out = {}
        for i, _ in enumerate(inputs):
            toks = [5] * n
            if impl == "ferroattn":
                toks[-1] = 6
            if self.short and impl == "ferroattn":
                toks = []
            out[f"req_{i}"] = type("Out", (), {"generated_tokens": toks})()
        return out


def test_continuous_batching_throughput_ratio_and_agreement(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(generate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model = FakeBatchModel(clock)
    cb = generate.measure_continuous(model, b=3, prompt=100, new_tokens=10, rounds=2, vocab=50)
    med = cb["median"]
    assert abs(med["sdpa"]["tok_s"] - 3 * 10 / 0.2) < 1e-6 and abs(med["ferroattn"]["tok_s"] - 3 * 10 / 0.16) < 1e-6
    assert abs(cb["tok_s_ratio_ferroattn_vs_sdpa"] - 1.25) < 1e-9
    assert abs(cb["token_agreement"] - 0.9) < 1e-9                                # 9 of 10 tokens per request
    # warm-up on 64-token prompts, then the paired rounds on the whole prompts in alternating order
    assert model.order[:2] == [("sdpa", 4, 64), ("ferroattn", 4, 64)]
    assert model.order[2:] == [("sdpa", 10, 100), ("ferroattn", 10, 100), ("ferroattn", 10, 100), ("sdpa", 10, 100)]


def test_continuous_batching_refuses_a_run_with_missing_tokens(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(generate.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with pytest.raises(RuntimeError, match="'ferroattn': expected 4 tokens per request, got \\[0, 0\\]"):
        generate.measure_continuous(FakeBatchModel(clock, short=True), b=2, prompt=80, new_tokens=10, rounds=1,
                                    vocab=50)


def test_generate_batch_runs_inside_the_callers_inference_mode(monkeypatch):
    """`bench generate` runs under torch.inference_mode(); transformers' generate_batch steps in a
    thread of its own over tensors created by the call, which must then not be inference tensors
    (else every request fails: "Inplace update to inference tensor outside InferenceMode")."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with torch.inference_mode():
        _, tokens = generate._timed_generate_batch(model, [[3, 4, 5], [6, 7]], 4)
    assert [len(t) for t in tokens] == [4, 4]
