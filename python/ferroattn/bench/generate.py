"""``python -m ferroattn bench generate``: transformers' ``generate`` with ``attn_implementation=
"ferroattn"`` against ``"sdpa"``, one process, the same model.

Model: ``LlamaForCausalLM`` from Llama-3.2-1B's published config (:data:`ferroattn.demo.LLAMA_3_2_1B`;
16 layers, GQA 32/8, head dim 64) with seeded random weights (:func:`ferroattn.demo.build_llm`, no
download), bf16, eval mode, on the GPU. Per batch size b: a prompt of ``--prompt`` seeded random
token ids per row (no padding), greedy decoding (``do_sample=False``) of exactly ``--new-tokens``
tokens (``min_new_tokens = max_new_tokens``, so no row stops early), transformers' default dynamic
cache. The implementation is switched on the same model object (``set_attn_implementation``).

Timing: paired rounds; in each round every implementation runs (in alternating order) one full
``generate`` and one prefill-only ``generate`` (``max_new_tokens=1``), each between
``torch.cuda.synchronize()`` calls, wall-clock. Reported per (implementation, b), medians over the
rounds: ``total_s``, ``prefill_s``, and ``decode_tok_s`` = b · (new_tokens − 1) / (total_s −
prefill_s), the decode steps' throughput; per b the ratio ferroattn / sdpa of decode_tok_s (> 1:
ours faster) as the median of the per-round ratios; and ``token_agreement``, the fraction of
generated tokens equal between the two implementations (random weights give near-flat logits, so
bf16 noise can flip an argmax: informative, not a pass rule).

With ``--continuous``, per b also transformers' continuous batching: ``model.generate_batch`` of
the same b prompts (as lists of ids), greedy, exactly ``--new-tokens`` tokens each (no end-of-
sequence token), under each implementation (transformers switches to ``"paged|sdpa"`` and
``"paged|ferroattn"``; :mod:`ferroattn.integrations.transformers_paged`), in the same paired
rounds: ``total_s`` of one whole ``generate_batch`` (its prefill and decode steps together),
``tok_s`` = b · new_tokens / total_s, the per-round ratio's median and the token agreement, under
``"continuous"`` in the row.

Writes ``generate_<device>_<date>.json`` (:func:`report.write_json`) into ``--out``. Exit 0, 2 for a
bad command line, 3 when a requirement (GPU, transformers) is missing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from .report import cannot_run, out_dir_error, run_metadata, write_json

__all__ = ["add_arguments", "run"]

IMPLS = ("sdpa", "ferroattn")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m ferroattn bench generate``."""
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per row (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--continuous", action="store_true",
                        help="also time continuous batching (model.generate_batch) per implementation")
    parser.add_argument("--out", metavar="DIR", default="bench/results", help="directory for the raw JSON")


def _timed_generate(model: Any, ids: Any, new_tokens: int) -> tuple[float, Any]:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _paired(rounds: int, run_one) -> None:
    """``rounds`` paired rounds: every implementation once per round, ``run_one(name, round)``,
    in alternating order (sdpa first in even rounds), so drift affects both alike."""
    for r in range(rounds):
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            run_one(name, r)


def _ratio(values: dict[str, list[float]]) -> float:
    """The median over the rounds of ferroattn / sdpa (> 1: ours faster for a rate)."""
    return statistics.median(o / s for o, s in zip(values["ferroattn"], values["sdpa"]))


def measure_batch(model: Any, b: int, prompt: int, new_tokens: int, rounds: int, vocab: int) -> dict[str, Any]:
    """One batch size: per implementation the medians, the paired ratio and the token agreement."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(b)
    ids = torch.randint(1, vocab, (b, prompt), generator=g).to("cuda")
    runs: dict[str, dict[str, list[float]]] = {n: {"total_s": [], "prefill_s": [], "decode_tok_s": []} for n in IMPLS}
    tokens: dict[str, Any] = {}
    for name in IMPLS:                      # warm-up: compiles, cuBLAS / cuDNN plans, allocator pools
        model.set_attn_implementation(name)
        _timed_generate(model, ids[:, :64], 4)

    def one(name: str, _r: int) -> None:
        model.set_attn_implementation(name)
        total, out = _timed_generate(model, ids, new_tokens)
        prefill, _ = _timed_generate(model, ids, 1)
        runs[name]["total_s"].append(total)
        runs[name]["prefill_s"].append(prefill)
        runs[name]["decode_tok_s"].append(b * (new_tokens - 1) / max(total - prefill, 1e-9))
        tokens[name] = out[:, prompt:]

    _paired(rounds, one)
    ratio = _ratio({n: runs[n]["decode_tok_s"] for n in IMPLS})
    agree = float((tokens["ferroattn"] == tokens["sdpa"]).float().mean())
    return {"b": b, "prompt": prompt, "new_tokens": new_tokens, "rounds": runs,
            "median": {n: {k: statistics.median(v) for k, v in runs[n].items()} for n in IMPLS},
            "decode_tok_s_ratio_ferroattn_vs_sdpa": ratio, "token_agreement": agree}


def _timed_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    # generate_batch steps in a thread of its own, outside the caller's inference mode, over
    # tensors it creates here: they must be normal tensors
    with torch.inference_mode(False):
        out = model.generate_batch(inputs=prompts, generation_config=config)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    if any(len(t) != new_tokens for t in tokens):   # generate_batch logs a failed step and goes on
        raise RuntimeError(f"generate_batch under {model.config._attn_implementation!r}: expected "
                           f"{new_tokens} tokens per request, got {[len(t) for t in tokens]} (see its log)")
    return elapsed, tokens


def measure_continuous(model: Any, b: int, prompt: int, new_tokens: int, rounds: int, vocab: int) -> dict[str, Any]:
    """One batch size under continuous batching: per implementation the median total_s and
    tok_s, the paired ratio of tok_s and the token agreement."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(b)
    prompts = torch.randint(1, vocab, (b, prompt), generator=g).tolist()
    runs: dict[str, dict[str, list[float]]] = {n: {"total_s": [], "tok_s": []} for n in IMPLS}
    tokens: dict[str, list[list[int]]] = {}
    for name in IMPLS:                      # warm-up
        model.set_attn_implementation(name)
        _timed_generate_batch(model, [p[:64] for p in prompts], 4)

    def one(name: str, _r: int) -> None:
        model.set_attn_implementation(name)
        total, tokens[name] = _timed_generate_batch(model, prompts, new_tokens)
        runs[name]["total_s"].append(total)
        runs[name]["tok_s"].append(b * new_tokens / max(total, 1e-9))

    _paired(rounds, one)
    same = sum(x == y for a, c in zip(tokens["ferroattn"], tokens["sdpa"]) for x, y in zip(a, c))
    return {"rounds": runs, "median": {n: {k: statistics.median(v) for k, v in runs[n].items()} for n in IMPLS},
            "tok_s_ratio_ferroattn_vs_sdpa": _ratio({n: runs[n]["tok_s"] for n in IMPLS}),
            "token_agreement": same / (b * new_tokens)}


def check_options(args: argparse.Namespace) -> tuple[list[int] | None, str | None]:
    """(the batch sizes, None) for valid options, else (None or the sizes, the first bad option's
    message naming it, what it expects and what it got). Creates ``--out``
    (:func:`report.out_dir_error`)."""
    try:
        batches = [int(x) for x in str(args.batch).split(",")]
        if min(batches) < 1:
            raise ValueError
    except ValueError:
        return None, f"--batch: expected comma-separated positive ints, got {args.batch!r}"
    for name, value, low in (("--prompt", args.prompt, 1), ("--new-tokens", args.new_tokens, 2),
                             ("--rounds", args.rounds, 1)):
        if value < low:
            return None, f"{name}: expected an int >= {low}, got {value}"
    return batches, out_dir_error(args.out)


def run(args: argparse.Namespace) -> int:
    """Exit code: 0 ok, 2 bad arguments, 3 no GPU or no transformers."""
    prog = "ferroattn bench generate"
    batches, error = check_options(args)
    if error is not None:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    code = cannot_run(prog)
    if code is not None:
        return code
    import torch
    try:
        from ..integrations import transformers as integration
        integration.register()
    except ImportError as e:
        print(f"{prog}: cannot run: transformers is not installed ({e})", file=sys.stderr)
        return 3
    from .. import demo
    model = demo.build_llm("llama-3.2-1b", "cuda", "bfloat16", "sdpa")
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        for b in batches:
            row = measure_batch(model, b, args.prompt, args.new_tokens, args.rounds, vocab)
            rows.append(row)
            m = row["median"]
            print(f"b {b:3d} prompt {args.prompt} +{args.new_tokens}: decode tok/s sdpa {m['sdpa']['decode_tok_s']:8.1f} "
                  f"ferroattn {m['ferroattn']['decode_tok_s']:8.1f} ({row['decode_tok_s_ratio_ferroattn_vs_sdpa']:.3f}x) "
                  f"| prefill s sdpa {m['sdpa']['prefill_s']:.3f} ferroattn {m['ferroattn']['prefill_s']:.3f} "
                  f"| tokens equal {row['token_agreement']:.2f}", flush=True)
            if args.continuous:
                cb = row["continuous"] = measure_continuous(model, b, args.prompt, args.new_tokens, args.rounds, vocab)
                m = cb["median"]
                print(f"      continuous batching: tok/s sdpa {m['sdpa']['tok_s']:8.1f} ferroattn "
                      f"{m['ferroattn']['tok_s']:8.1f} ({cb['tok_s_ratio_ferroattn_vs_sdpa']:.3f}x) "
                      f"| tokens equal {cb['token_agreement']:.2f}", flush=True)
    result = {"meta": run_metadata(), "config": {"model": "llama-3.2-1b", "dtype": "bfloat16", "batches": batches,
                                                "prompt": args.prompt, "new_tokens": args.new_tokens,
                                                "rounds": args.rounds, "continuous": args.continuous},
              "rows": rows,
              "summary": {"decode_tok_s_ratio_min": min(r["decode_tok_s_ratio_ferroattn_vs_sdpa"] for r in rows)}}
    if args.continuous:
        result["summary"]["continuous_tok_s_ratio_min"] = min(r["continuous"]["tok_s_ratio_ferroattn_vs_sdpa"]
                                                              for r in rows)
    path = write_json(result, args.out, kind="generate")
    print(f"raw JSON: {path}")
    return 0
