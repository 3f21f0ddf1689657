"""`bench generate`'s measurement arithmetic on the CPU, with a fake model and a fake clock:
decode tokens/s from (total - prefill), the paired per-round ratio, the alternating order of
the implementations, the token agreement."""
from __future__ import annotations

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
