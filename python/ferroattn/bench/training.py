"""Training comparison: ferroattn against torch SDPA inside transformers, on a real ~1B config.

``python -m ferroattn bench training [--steps 20] [--batch 4] [--seqlen 512] [--lr 1e-4] [--out DIR]``

Model: ``LlamaForCausalLM`` from Llama-3.2-1B's published config (:data:`ferroattn.demo.LLAMA_3_2_1B`:
16 layers, 32 query heads, 8 KV heads (GQA), head dim 64, 1.24 B parameters) with seeded random
weights (:func:`ferroattn.demo.build_llm`, no download), bf16 parameters, train mode (the config
has no dropout). Text: ``data/passage.txt`` + ``data/sentences.txt`` tokenised with the MiniLM
WordPiece tokenizer the demo uses (found as the demo finds it; ids < 30522) or, when no tokenizer
is there, as UTF-8 bytes (ids 3..258); repeated until long enough. Step i's batch is the
``batch`` consecutive ``seqlen``-token windows starting at token ``i·batch·seqlen``; labels =
input ids (transformers shifts them).

1. Step-0 gradients. The same initial weights, cast to fp32, run with ``attn_implementation=
   "sdpa"`` (TF32 off) on the step-0 batch: the reference gradients g_fp32. The bf16 model runs the
   same batch with "sdpa", "ferroattn" and "eager". Per parameter p the relative error
   ``err_impl(p) = ||g_impl(p) - g_fp32(p)|| / ||g_fp32(p)||`` (Frobenius, in fp32). Twice: on the
   dense batch and on a PADDED batch (same rows; :func:`padding_plan`: right, left, none and
   left+right padding; padded positions hold token 0, label -100, and an ``attention_mask`` of 0,
   so transformers' "ferroattn" path unpads to varlen; a token right after left padding is no
   target either; position ids = cumsum(mask) - 1, at least 0).
   Pass rule, every parameter of both batches: ``err_ferroattn(p) <= 3 · err_sdpa(p) + 1e-6``
   (the 1e-6 only matters if sdpa-bf16 were exact). ``worst_ratio`` = max err_ferroattn/err_sdpa.

2. Training. From the same initial weights, for each of "sdpa", "ferroattn", "eager": a fresh
   ``torch.optim.AdamW(lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)`` (fused on CUDA) and
   ``steps`` steps over the same batches; the loss of each step (before its update) is recorded.
   Eager is a third correct bf16 attention (softmax in fp32, matmuls in bf16): its distance from
   sdpa is the bf16 noise of the whole training trajectory. Pass rule, at every step i:
   ``|loss_ferroattn(i) - loss_sdpa(i)| <= 3 · max_j |loss_eager(j) - loss_sdpa(j)| + 1e-3``
   (all losses finite).

3. Memory: :func:`ferroattn.bench.memory.measure` (attention alone, b=1 s=16k h=16 d=128 bf16,
   forward + backward peak, ours vs SDPA-flash; its pass rule is in that module).

Writes ``training_<device>_<date>.json`` (:func:`report.write_json`) into ``--out``: ``meta``
(device, driver, torch, commit, date), ``config``, ``gradients`` (per batch: per-parameter errors
of every implementation, ratios, verdict), ``training`` (per-step losses and milliseconds, the
loss-rule figures), ``memory``, ``ok``. Exit 0 when every check passes, 1 when one fails, 2 for a
bad command line, 3 when a requirement (GPU, torch, transformers, the integration) is missing.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from . import report

IMPL, REF_IMPL, NOISE_IMPL = "ferroattn", "sdpa", "eager"
IMPLS = (REF_IMPL, IMPL, NOISE_IMPL)
LOSS_FACTOR, LOSS_ATOL = 3.0, 1e-3
GRAD_FACTOR, GRAD_ATOL = 3.0, 1e-6
PAD_ID = 0                     # [PAD] of the MiniLM vocabulary; below every byte id
BYTE_OFFSET = 3                # UTF-8 fallback: byte b -> id b + 3
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
LOSS_RULE = (f"|loss_{IMPL}(i) - loss_{REF_IMPL}(i)| <= {LOSS_FACTOR:g} * max_j |loss_{NOISE_IMPL}(j) - "
             f"loss_{REF_IMPL}(j)| + {LOSS_ATOL:g} at every step i")
GRAD_RULE = (f"for every parameter p: ||g_{IMPL} - g_fp32|| / ||g_fp32|| <= {GRAD_FACTOR:g} * "
             f"||g_{REF_IMPL}_bf16 - g_fp32|| / ||g_fp32|| + {GRAD_ATOL:g} (g_fp32: the same weights in fp32 with "
             f"{REF_IMPL}, same batch)")


def _say(msg: str) -> None:
    print(f"[training {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class MissingRequirement(RuntimeError):
    """A requirement is missing; the message is the one-line reason."""


# ---- inputs (pure Python) ---------------------------------------------------------------

def byte_token_ids(text: str, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of ``text`` as UTF-8 bytes (id = byte + BYTE_OFFSET), repeated."""
    ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
    if not ids:
        raise ValueError("text: expected some text, got an empty string")
    return (ids * math.ceil(n_tokens / len(ids)))[:n_tokens]


def make_batches(ids: Sequence[int], steps: int, batch: int, seqlen: int) -> list[list[list[int]]]:
    """Step i, row j = ids[(i·batch + j)·seqlen : (i·batch + j + 1)·seqlen]. ValueError when
    ``ids`` is shorter than steps·batch·seqlen."""
    need = steps * batch * seqlen
    if len(ids) < need:
        raise ValueError(f"ids: expected at least {need} tokens (steps {steps} x batch {batch} x seqlen {seqlen}), "
                         f"got {len(ids)}")
    return [[list(ids[(i * batch + j) * seqlen:(i * batch + j + 1) * seqlen]) for j in range(batch)]
            for i in range(steps)]


def padding_plan(batch: int, seqlen: int) -> list[tuple[int, int]]:
    """(left, right) padding per row, cycling through: right (seqlen/4 + 3), left (seqlen/8 + 5),
    none, left 7 + right seqlen/3; each row keeps at least one real token."""
    patterns = [(0, seqlen // 4 + 3), (seqlen // 8 + 5, 0), (0, 0), (7, seqlen // 3)]
    plan = []
    for j in range(batch):
        left, right = patterns[j % len(patterns)]
        left = min(left, seqlen - 1)
        right = min(right, seqlen - 1 - left)
        plan.append((left, right))
    return plan


def padded_rows(rows: Sequence[Sequence[int]], plan: Sequence[tuple[int, int]]) -> dict[str, list[list[int]]]:
    """Apply a padding plan to equal-length rows: padded positions get PAD_ID, mask 0, label
    -100; the first real token after left padding gets label -100 too (it would be predicted
    from a padded position); position ids are cumsum(mask) - 1, at least 0. Returns lists for
    input_ids, attention_mask, labels, position_ids."""
    out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": [], "position_ids": []}
    for row, (left, right) in zip(rows, plan):
        n = len(row)
        mask = [0] * left + [1] * (n - left - right) + [0] * right
        ids = [t if m else PAD_ID for t, m in zip(row, mask)]
        pos, c = [], 0
        for m in mask:
            c += m
            pos.append(max(c - 1, 0))
        out["input_ids"].append(ids)
        out["attention_mask"].append(mask)
        # label t is predicted from position t - 1 (transformers shifts): a token right after a
        # padded position is no target, or a padded position's output would enter the loss
        out["labels"].append([t if m and (i == 0 or mask[i - 1]) else -100 for i, (t, m) in enumerate(zip(row, mask))])
        out["position_ids"].append(pos)
    return out


# ---- pass rules (pure Python) -----------------------------------------------------------

def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def loss_rule(losses: dict[str, Sequence[float]], impl: str = IMPL, ref: str = REF_IMPL,
              noise: str = NOISE_IMPL, factor: float = LOSS_FACTOR, atol: float = LOSS_ATOL) -> dict:
    """The loss rule (module docstring) on per-step losses of ``impl``, ``ref`` and ``noise``."""
    a, r, n = list(losses[impl]), list(losses[ref]), list(losses[noise])
    if not (len(a) == len(r) == len(n)) or not a:
        raise ValueError(f"losses: expected equally many (> 0) steps, got {impl} {len(a)}, {ref} {len(r)}, "
                         f"{noise} {len(n)}")
    finite = all(_finite(x) for x in a + r + n)
    diff = [abs(x - y) for x, y in zip(a, r)]
    noise_diff = [abs(x - y) for x, y in zip(n, r)]
    noise_max = max(noise_diff)
    bound = factor * noise_max + atol
    worst = max(range(len(diff)), key=lambda i: diff[i] if math.isfinite(diff[i]) else math.inf)
    return {"rule": LOSS_RULE, "factor": factor, "atol": atol, "diff": diff, "noise_diff": noise_diff,
            "noise_max": noise_max, "bound": bound, "max_diff": diff[worst], "worst_step": worst,
            "finite": finite, "ok": bool(finite and all(d <= bound for d in diff))}


def grad_rule(errors: dict[str, dict[str, float]], impl: str = IMPL, ref: str = REF_IMPL,
              factor: float = GRAD_FACTOR, atol: float = GRAD_ATOL) -> dict:
    """The gradient rule (module docstring). ``errors[impl_name][param_name]`` = relative error of
    that implementation's gradient against the fp32 reference."""
    names = list(errors[ref])
    missing = [n for n in names if n not in errors[impl]]
    if missing or not names:
        raise ValueError(f"errors: expected the same parameters for {impl} and {ref}, missing {missing[:5]}")
    params, failed = [], []
    worst_name, worst_ratio = None, -1.0
    for name in names:
        e_i, e_r = errors[impl][name], errors[ref][name]
        ok = _finite(e_i) and _finite(e_r) and e_i <= factor * e_r + atol
        ratio = (e_i / e_r) if (_finite(e_i) and _finite(e_r) and e_r > 0) else (0.0 if e_i == 0 else math.inf)
        params.append({"name": name, "err": {k: v.get(name) for k, v in errors.items()}, "ratio": ratio, "ok": ok})
        if not ok:
            failed.append(name)
        if ratio > worst_ratio or worst_name is None:
            worst_name, worst_ratio = name, ratio
    return {"rule": GRAD_RULE, "factor": factor, "atol": atol, "n_params": len(names), "n_failed": len(failed),
            "failed": failed[:20], "worst_ratio": worst_ratio, "worst_param": worst_name,
            "max_err": {k: max(v.values()) for k, v in errors.items()},
            "median_err": {k: statistics.median(v.values()) for k, v in errors.items()},
            "params": params, "ok": not failed}


def overall_ok(result: dict) -> bool:
    """Every gradient check, the loss check, and the memory check when it ran."""
    g = result.get("gradients") or {}
    t = (result.get("training") or {}).get("check") or {}
    m = result.get("memory")
    checks = [bool(g.get("ok")), bool(t.get("ok"))]
    if m is not None:
        checks.append(m.get("ok") is not False)
    return all(checks) and not result.get("error")


# ---- GPU / torch parts ------------------------------------------------------------------

def text_token_ids(n_tokens: int, minilm: str | None = None) -> tuple[list[int], str, int]:
    """(ids, how they were made, tokens in one copy of the text). MiniLM tokenizer when found
    (``minilm`` given and unusable -> MissingRequirement), else UTF-8 bytes."""
    from ferroattn import demo
    try:
        model_dir = demo.find_minilm(minilm)
    except demo.MissingRequirement as e:
        if minilm is not None:
            raise MissingRequirement(str(e)) from None
        text = demo.long_text()
        return byte_token_ids(text, n_tokens), "UTF-8 bytes of data/passage.txt + data/sentences.txt (no tokenizer found)", \
            len(text.encode("utf-8"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids, per_copy = demo.token_ids_for(tok, n_tokens)
    return ids, f"data/passage.txt + data/sentences.txt, MiniLM tokenizer ({model_dir})", per_copy


def _tensor_batch(rows: dict[str, list[list[int]]] | list[list[int]], device: str) -> dict[str, Any]:
    import torch
    if isinstance(rows, dict):
        b = {k: torch.tensor(v, device=device) for k, v in rows.items()}
    else:
        ids = torch.tensor(rows, device=device)
        b = {"input_ids": ids, "labels": ids}
    b["use_cache"] = False
    return b


def rel_err(g: Any, ref: Any) -> float:
    """||g - ref|| / ||ref|| in fp32 (||g - ref|| when ref is 0; inf when g is None)."""
    if g is None:
        return math.inf
    d = float((g.float() - ref).norm())
    n = float(ref.norm())
    return d / n if n > 0 else d


def _grads(model: Any, batch: dict) -> tuple[dict[str, Any], float]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, float(out.loss.detach())


def gradient_check(model: Any, ref_model: Any, batch: dict, impls: Sequence[str] = IMPLS) -> dict:
    """Step-0 gradients of ``model`` (bf16) with each implementation against ``ref_model`` (the
    same weights in fp32, sdpa) on one batch: per-parameter relative errors and :func:`grad_rule`."""
    ref_grads, ref_loss = _grads(ref_model, batch)
    errors: dict[str, dict[str, float]] = {}
    losses = {"fp32_" + REF_IMPL: ref_loss}
    for impl in impls:
        model.set_attn_implementation(impl)
        grads, loss = _grads(model, batch)
        errors[impl] = {n: rel_err(g, ref_grads[n]) for n, g in grads.items()}
        losses[impl] = loss
        model.zero_grad(set_to_none=True)
    ref_model.zero_grad(set_to_none=True)
    del ref_grads
    res = grad_rule(errors)
    res["losses"] = losses
    return res


def train(model: Any, init_state: dict, impl: str, batches: Sequence[dict], lr: float, device: str) -> dict:
    """``len(batches)`` AdamW steps from ``init_state`` with ``impl``: per-step loss and ms."""
    import torch
    model.load_state_dict(init_state)
    model.set_attn_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.startswith("cuda"), **ADAMW)
    losses, ms = [], []
    cuda = device.startswith("cuda")
    for batch in batches:
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        if cuda:
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss.detach()))
    opt.zero_grad(set_to_none=True)
    del opt
    if cuda:
        torch.cuda.empty_cache()
    return {"losses": losses, "step_ms": ms,
            "median_step_ms": statistics.median(ms[1:]) if len(ms) > 1 else (ms[0] if ms else None)}


def _require(device: str) -> None:
    try:
        import torch
    except ImportError as e:
        raise MissingRequirement(f"torch is not importable ({e})") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MissingRequirement("no CUDA GPU found (torch.cuda.is_available() is False)")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise MissingRequirement(f"transformers is not importable ({e})") from None
    try:
        from ferroattn.integrations.transformers import register
    except Exception as e:
        raise MissingRequirement(f"ferroattn.integrations.transformers is not importable ({type(e).__name__}: {e})") from None
    register()


def run(config: str = "llama-3.2-1b", steps: int = 20, batch: int = 4, seqlen: int = 512, lr: float = 1e-4,
        device: str = "cuda", dtype: str = "bfloat16", minilm: str | None = None, memory: bool = True,
        memory_seqlen: int = 16384, seed: int = 0, say: Callable[[str], None] = _say) -> dict:
    """Run the three parts (module docstring); return the result dict (``ok`` = the verdict).
    Raises MissingRequirement; a part that raises is recorded (``error``) and fails the verdict."""
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ferroattn import demo
    if config not in demo.LLM_CONFIGS:
        raise ValueError(f"--llm-config: expected one of {sorted(demo.LLM_CONFIGS)}, got {config!r}")
    _require(device)
    import torch

    t0 = time.monotonic()
    meta = report.run_metadata()
    ids, text_how, per_copy = text_token_ids(steps * batch * seqlen, minilm)
    rows = make_batches(ids, steps, batch, seqlen)
    plan = padding_plan(batch, seqlen)
    result: dict[str, Any] = {
        "meta": meta,
        "config": {"model": config, "dtype": dtype, "steps": steps, "batch": batch, "seqlen": seqlen, "lr": lr,
                   "optimizer": {"name": "AdamW", "lr": lr, **ADAMW, "fused": device.startswith("cuda")},
                   "impls": list(IMPLS), "seed": seed, "device": device,
                   "text": text_how, "text_tokens_per_copy": per_copy,
                   "padding_plan": [list(p) for p in plan],
                   "loss_rule": LOSS_RULE, "grad_rule": GRAD_RULE},
    }
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        say(f"building {config} ({dtype}, seeded random weights) on {device}; text: {text_how}")
        model = demo.build_llm(config, device, dtype, REF_IMPL, seed=seed).train()
        result["config"]["n_parameters"] = sum(p.numel() for p in model.parameters())
        init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        batches = [_tensor_batch(r, device) for r in rows]
        padded = _tensor_batch(padded_rows(rows[0], plan), device)

        say("step-0 gradients vs the fp32 reference (dense and padded batch)")
        ref_model = copy.deepcopy(model).float()
        ref_model.set_attn_implementation(REF_IMPL)
        grads = {}
        for name, b in (("dense", batches[0]), ("padded", padded)):
            grads[name] = gradient_check(model, ref_model, b)
            say(f"  {name}: worst ratio err_{IMPL}/err_{REF_IMPL} {grads[name]['worst_ratio']:.3f} "
                f"({grads[name]['worst_param']}), {grads[name]['n_failed']} of {grads[name]['n_params']} "
                f"parameters over the bound")
        del ref_model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        worst = max(grads, key=lambda k: grads[k]["worst_ratio"])
        result["gradients"] = {"reference": f"fp32 copy of the initial weights, attn_implementation={REF_IMPL!r}, "
                                            "TF32 off",
                               "batches": grads, "ok": all(g["ok"] for g in grads.values()),
                               "worst_ratio": grads[worst]["worst_ratio"],
                               "worst_at": f"{worst}: {grads[worst]['worst_param']}"}

        runs = {}
        for impl in IMPLS:
            say(f"training {steps} steps with {impl}")
            runs[impl] = train(model, init_state, impl, batches, lr, device)
        losses = {k: v["losses"] for k, v in runs.items()}
        result["training"] = {"losses": losses, "step_ms": {k: v["step_ms"] for k, v in runs.items()},
                              "median_step_ms": {k: v["median_step_ms"] for k, v in runs.items()},
                              "check": loss_rule(losses)}
        del model, init_state, batches, padded
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception as e:
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    result["memory"] = None
    if memory and device.startswith("cuda"):
        from . import memory as memory_mod
        say(f"attention peak memory at s={memory_seqlen}")
        try:
            result["memory"] = memory_mod.measure(s=memory_seqlen)
        except Exception as e:
            traceback.print_exc()
            result["memory"] = {"error": f"{type(e).__name__}: {e}", "ok": False}
    result["elapsed_s"] = time.monotonic() - t0
    result["ok"] = overall_ok(result)
    return result


# ---- output -----------------------------------------------------------------------------

def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def format_summary(res: dict) -> str:
    """The human-readable summary (from the result dict)."""
    from . import memory as memory_mod
    c = res.get("config", {})
    m = res.get("meta", {})
    lines = ["", "=== ferroattn training comparison ===",
             f"device {m.get('device')} | torch {m.get('torch')} | commit {m.get('commit')}",
             f"{c.get('model')} ({_f((c.get('n_parameters') or 0) / 1e9 or None, '.2f')} B params, {c.get('dtype')}), "
             f"{c.get('steps')} steps of batch {c.get('batch')} x {c.get('seqlen')} tokens, AdamW lr {c.get('lr')}"]
    if res.get("error"):
        lines.append(f"ERROR {res['error']}")
    g = res.get("gradients")
    if g:
        for name, b in g["batches"].items():
            e = b["max_err"]
            lines.append(f"step-0 gradients ({name} batch): worst err_{IMPL}/err_{REF_IMPL} {_f(b['worst_ratio'], '.3f')} "
                         f"at {b['worst_param']}; max rel err {IMPL} {_f(e.get(IMPL), '.3e')}, {REF_IMPL} "
                         f"{_f(e.get(REF_IMPL), '.3e')}, {NOISE_IMPL} {_f(e.get(NOISE_IMPL), '.3e')}; "
                         f"{b['n_failed']}/{b['n_params']} over the bound  {'PASS' if b['ok'] else 'FAIL'}")
    t = res.get("training")
    if t:
        ck = t["check"]
        ls = t["losses"]
        lines.append(f"losses step 0 -> {len(ls[REF_IMPL]) - 1}: " + ", ".join(
            f"{k} {v[0]:.4f} -> {v[-1]:.4f}" for k, v in ls.items()))
        lines.append(f"max |loss_{IMPL} - loss_{REF_IMPL}| {ck['max_diff']:.2e} (step {ck['worst_step']}) <= bound "
                     f"{ck['bound']:.2e} = {ck['factor']:g} x eager noise {ck['noise_max']:.2e} + {ck['atol']:g}  "
                     f"{'PASS' if ck['ok'] else 'FAIL'}")
        ms = t.get("median_step_ms") or {}
        lines.append("median step time: " + ", ".join(f"{k} {_f(v, '.1f')} ms" for k, v in ms.items()))
    if res.get("memory"):
        lines.append(memory_mod.format_memory(res["memory"]) if "shape" in res["memory"]
                     else f"memory: ERROR {res['memory'].get('error')}")
    lines.append(f"overall: {'PASS' if res.get('ok') else 'FAIL'}")
    return "\n".join(lines)


def main_from_args(args: argparse.Namespace) -> int:
    """``bench training``: validate (exit 2), check requirements (exit 3), run, write JSON."""
    from ferroattn import demo
    prog = "ferroattn bench training"
    if args.llm_config not in demo.LLM_CONFIGS:
        print(f"{prog}: --llm-config: expected one of {sorted(demo.LLM_CONFIGS)}, got {args.llm_config!r}",
              file=sys.stderr)
        return 2
    try:
        res = run(args.llm_config, args.steps, args.batch, args.seqlen, args.lr, minilm=args.minilm,
                  memory=not args.no_memory, memory_seqlen=args.memory_seqlen)
    except MissingRequirement as e:
        print(f"{prog}: cannot run: {e}", file=sys.stderr)
        return 3
    path = report.write_json(res, args.out, kind="training")
    print(format_summary(res))
    print(f"raw JSON: {path}")
    return 0 if res["ok"] else 1
