#!/usr/bin/env python3
"""Summary of one scripts/gpu_check.sh run: reads what the stages left in the work directory and
in $OUT, writes ``$OUT/gpu_check.json`` and prints a short table (the last thing gpu_check prints).

Inputs (all optional; a missing one is reported as such, never a crash):
  WORK/stages.tsv                 "name<TAB>rc<TAB>seconds<TAB>limit" per stage (rc may be "skipped")
  WORK/logs/info.json             `python -m ferroattn info --json`
  WORK/logs/precompile.json       cold compile (kernels, spills, errors, jit_stats)
  WORK/logs/first_call.json       warm-cache first-call figures (scripts/first_call.py)
  WORK/logs/junit.xml             pytest -m gpu results (else the pytest log's last line)
  WORK/logs/{memcheck,racecheck,synccheck}.log   compute-sanitizer output
  OUT/demo.json                   `python -m ferroattn demo --json`
  OUT/attention_*.json            the newest raw forward-benchmark JSON
  OUT/attention_bwd_*.json        the newest raw backward-benchmark JSON (`bench attention --backward`)
  OUT/training_*.json             the newest training comparison (`bench training`)
  OUT/fa2_summary.json            flash-attention's suite (fa2 stage; .fa2suite/summarize.py's JSON)
  WORK/logs/fa2_meta.json         the fa2 stage's sample sizes, budget and run.sh exit code

The memcheck/racecheck logs hold two sanitizer runs (scripts/sanitize_attention.py and
scripts/sanitize_attention_bwd.py): their error counts and case counts are summed, and kept per
script under ``scripts``.

``--merge A.json B.json ... --out DIR`` joins the gpu_check.json files of several calls (a run
split with GPU_CHECK_STAGES) into DIR/gpu_check.json: stages in call order, every other section
from the call that has it.

Needs no torch (versions come from importlib.metadata). Exit 0 when every stage exited 0 and
nothing was skipped, else 1.
"""
from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def parse_stages(path: Path) -> list[dict]:
    rows = []
    for line in _read_text(path).splitlines():
        parts = line.split("\t")
        if len(parts) != 4:
            continue
        name, rc, secs, limit = parts
        rows.append({"stage": name, "rc": None if rc == "skipped" else int(rc), "skipped": rc == "skipped",
                     "seconds": int(secs), "limit": int(limit), "timed_out": rc in ("124", "137")})
    return rows


def parse_junit(path: Path) -> dict | None:
    """Counts from a pytest junit XML: {tests, passed, failures, errors, skipped, failed_names}."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for s in suites:
        for k in c:
            c[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    c["failed_names"] = failed[:20]
    return c


def merge_counts(parts: list) -> dict | None:
    """The sum of :func:`parse_junit` counts (None entries left out; None when all are)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    out = {k: sum(p[k] for p in parts) for k in ("tests", "failures", "errors", "skipped", "passed")}
    out["failed_names"] = [n for p in parts for n in p["failed_names"]][:20]
    return out


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def parse_pytest_log(text: str) -> dict | None:
    """Counts from pytest's final line ('== 3 failed, 10 passed, 2 skipped in 4.2s ==')."""
    for line in reversed(text.splitlines()):
        if " in " in line and _PYTEST_COUNT.search(line):
            counts = {k if not k.startswith("error") else "errors": int(n) for n, k in _PYTEST_COUNT.findall(line)}
            return counts
        if "no tests ran" in line:
            return {"passed": 0}
    return None


def parse_sanitizer(text: str, tool: str) -> dict:
    """{ran, errors (memcheck, synccheck) or hazards/errors/warnings (racecheck), cases_passed, cases,
    scripts: {script: [passed, cases]}}, summed over every sanitizer run in the log."""
    out: dict[str, Any] = {"ran": bool(text.strip())}
    errs = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    if errs:
        out["errors"] = sum(errs)
    races = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if races:
        out.update(hazards=sum(int(r[0]) for r in races), errors=sum(int(r[1]) for r in races),
                   warnings=sum(int(r[2]) for r in races))
        # racecheck checks every kernel (gpu_check.sh); the kernels its races were reported in
        out["race_kernels"] = sorted(set(re.findall(r"Race reported between \w+ access at ([^\s+]+)", text)))
    cases = re.findall(r"(sanitize_(?:attention|gemm)\w*): (\d+)/(\d+) cases passed", text)
    if cases:
        out["cases_passed"] = sum(int(c[1]) for c in cases)
        out["cases"] = sum(int(c[2]) for c in cases)
        out["scripts"] = {c[0]: [int(c[1]), int(c[2])] for c in cases}
    if "not found on PATH" in text:
        out["ran"] = False
        out["reason"] = "compute-sanitizer not found"
    out["tool"] = tool
    return out


def newest_json(out: Path, kind: str) -> tuple[str | None, dict | None]:
    """The newest OUT/<kind>_<device>_<date>.json (kind "attention" excludes "attention_bwd")."""
    files = [f for f in glob.glob(str(out / f"{kind}_*.json"))
             if not (kind == "attention" and os.path.basename(f).startswith("attention_bwd_"))]
    files.sort(key=os.path.getmtime)
    if not files:
        return None, None
    return os.path.basename(files[-1]), _read_json(Path(files[-1]))


def newest_bench(out: Path) -> tuple[str | None, dict | None]:
    return newest_json(out, "attention")


def bench_bwd_summary(name: str, res: dict) -> dict:
    """The gpu_check view of a backward-benchmark JSON (its summary without the per-config rows)."""
    s = dict(res.get("summary") or {})
    s.pop("per_config", None)
    cfg = res.get("config") or {}
    return {"file": name, "summary": s, "partial": res.get("partial"), "deterministic": cfg.get("deterministic"),
            "ceilings": res.get("ceilings"), "elapsed_s": cfg.get("elapsed_s"), "candidates": res.get("candidates")}


def training_summary(name: str, res: dict) -> dict:
    """The gpu_check view of a training-comparison JSON: verdicts and headline figures."""
    out: dict[str, Any] = {"file": name, "ok": res.get("ok"), "error": res.get("error"),
                           "elapsed_s": res.get("elapsed_s")}
    t = res.get("training") or {}
    ck = t.get("check")
    if ck:
        out["loss"] = {k: ck.get(k) for k in ("ok", "max_diff", "worst_step", "bound", "noise_max")}
        out["loss"]["first_last"] = {k: [v[0], v[-1]] for k, v in (t.get("losses") or {}).items() if v}
        out["median_step_ms"] = t.get("median_step_ms")
    g = res.get("gradients")
    if g:
        out["grad"] = {"ok": g.get("ok"), "worst_ratio": g.get("worst_ratio"), "worst_at": g.get("worst_at"),
                       "batches": {k: {"ok": b.get("ok"), "worst_ratio": b.get("worst_ratio"),
                                       "worst_param": b.get("worst_param"), "n_failed": b.get("n_failed"),
                                       "n_params": b.get("n_params"), "max_err": b.get("max_err")}
                                   for k, b in (g.get("batches") or {}).items()}}
    m = res.get("memory")
    if m:
        mib = lambda r: None if not r or r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / 2**20  # noqa: E731
        out["memory"] = {"ok": m.get("ok"), "shape": m.get("shape"), "ferroattn_mib": mib(m.get("ferroattn")),
                         "sdpa_flash_mib": mib(m.get("sdpa_flash")), "ratio": (m.get("verdict") or {}).get("ratio"),
                         "error": m.get("error") or (m.get("ferroattn") or {}).get("error")}
    return out


def fa2_summary(res: dict, meta: dict | None) -> dict:
    """The gpu_check view of flash-attention's suite: totals per surface (core = flash_attn's old
    surface, rest = dropout/ALiBi/window/softcap/kvcache/paged), the test functions with failures
    ("name [surface]") and their most common messages."""
    total = res.get("total") or {}
    surfaces: dict[str, dict[str, int]] = {}
    for key, n in total.items():
        surf, _, state = key.partition("_")
        surfaces.setdefault(surf, {"passed": 0, "failed": 0, "skipped": 0})[state] = int(n)
    failing = sorted(f"{k.split('|')[0]} [{k.partition('|')[2]}]" for k, c in (res.get("per_test") or {}).items()
                     if (c or {}).get("failed"))
    top = {fn: [[m, n] for m, n in (msgs or [])[:2]] for fn, msgs in (res.get("top_failures") or {}).items()}
    out: dict[str, Any] = {"surfaces": surfaces, "failing_tests": failing, "top_failures": top}
    if meta:
        out.update({k: meta.get(k) for k in ("fa2_core", "fa2_rest", "budget_s", "rc")})
    return out


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def build_summary(work: Path, out: Path, elapsed: int | None = None, stages_selected: str | None = None) -> dict:
    stages = parse_stages(work / "stages.tsv")
    info = _read_json(work / "logs" / "info.json") or {}
    gpu = info.get("gpu") or {}
    pre = _read_json(work / "logs" / "precompile.json")
    first = _read_json(work / "logs" / "first_call.json")
    tests = merge_counts([parse_junit(work / "logs" / name) for name in ("junit.xml", "junit_serial.xml")]) \
        or parse_pytest_log(_read_text(work / "logs" / "pytest.log"))
    demo = _read_json(out / "demo.json")
    bench_file, bench = newest_bench(out)
    summary: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": os.environ.get("FERROATTN_COMMIT", "unknown"),
        "device": gpu.get("name") or (bench or {}).get("meta", {}).get("device"),
        "driver": (_read_text(work / "logs" / "nvidia_driver.txt") or "").strip() or None,
        "cuda_driver_api": gpu.get("driver_version") or (bench or {}).get("meta", {}).get("driver"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "ferroattn": info.get("version"),
        "nvrtc": info.get("nvrtc_version"),
        "elapsed_s": elapsed,
        "stages_selected": stages_selected,
        "stages": stages,
        "tests": tests,
        "sanitizer": {t: parse_sanitizer(_read_text(work / "logs" / f"{t}.log"), t) for t in ("memcheck", "racecheck", "synccheck")},
    }
    if pre:
        ks = pre.get("kernels", [])
        summary["precompile"] = {"archs": pre.get("archs"), "kernels": len(ks), "spilled": pre.get("spilled"),
                                 "errors": pre.get("errors"),
                                 "compile_seconds": round(sum(k.get("compile_seconds", 0) for k in ks), 3),
                                 "max_registers": max((k.get("registers", 0) for k in ks), default=None)}
    if first:
        summary["first_call"] = {"calls": first.get("calls"), "jit_stats_after": first.get("jit_stats_after")}
    if demo:
        m = demo.get("minilm") or {}
        llm = demo.get("llm") or {}
        summary["demo"] = {
            "ok": demo.get("ok"),
            "minilm_min_cosine": m.get("min_cosine"),
            "minilm_ms": {k[3:]: v for k, v in m.items() if k.startswith("ms_")},
            "minilm_error": demo.get("minilm_error"),
            "llm": {s: {k: v for k, v in r.items()} for s, r in (llm.get("seqlens") or {}).items()},
            "llm_error": demo.get("llm_error"),
        }
    if bench:
        summary["bench"] = {"file": bench_file, "summary": bench.get("summary"), "ceilings": bench.get("ceilings"),
                            "host_cost": bench.get("host_cost"), "elapsed_s": bench.get("config", {}).get("elapsed_s"),
                            "candidates": bench.get("candidates")}
    bwd_file, bwd = newest_json(out, "attention_bwd")
    if bwd:
        summary["bench_bwd"] = bench_bwd_summary(bwd_file, bwd)
    train_file, train = newest_json(out, "training")
    if train:
        summary["train"] = training_summary(train_file, train)
    fa2 = _read_json(out / "fa2_summary.json")
    if isinstance(fa2, dict):
        summary["fa2"] = fa2_summary(fa2, _read_json(work / "logs" / "fa2_meta.json"))
    summary["ok"] = bool(stages) and all(s["rc"] == 0 for s in stages)
    return summary


def merge_summaries(parts: list[dict]) -> dict:
    """Join the summaries of several gpu_check calls: stages in call order (each tagged with
    ``call``), every other key from the first call that has a value for it (the sanitizer per
    tool from the call where it ran), elapsed summed, ok = every stage of every call exited 0."""
    merged: dict[str, Any] = {"merged_from": len(parts), "stages": []}
    for i, p in enumerate(parts):
        for st in p.get("stages") or []:
            merged["stages"].append({**st, "call": i})
        for k, v in p.items():
            if k in ("stages", "ok", "elapsed_s", "sanitizer", "merged_from"):
                continue
            if merged.get(k) is None and v is not None:
                merged[k] = v
    merged["elapsed_s"] = sum(p.get("elapsed_s") or 0 for p in parts)
    san: dict[str, Any] = {}
    for p in parts:
        for tool, r in (p.get("sanitizer") or {}).items():
            if tool not in san or (r.get("ran") and not san[tool].get("ran")):
                san[tool] = r
    merged["sanitizer"] = san
    merged["ok"] = bool(merged["stages"]) and all(s["rc"] == 0 for s in merged["stages"])
    return merged


def _f(x: Any, fmt: str) -> str:
    """``x`` formatted, "—" for None, or its repr when it is not a number (a malformed record)."""
    if x is None:
        return "—"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, fmt)
    return f"{x!r} (not a number)"


def format_summary(s: dict) -> str:
    lines = ["", "================ gpu_check summary ================",
             f"{s.get('device')} | driver {s.get('driver')} | torch {s.get('torch')} | transformers "
             f"{s.get('transformers')} | ferroattn {s.get('ferroattn')} (NVRTC {s.get('nvrtc')}) | commit {s.get('commit')}",
             f"{'stage':<11} {'exit':>7} {'seconds':>8} {'limit':>6}"]
    for st in s["stages"]:
        rc = "skipped" if st["skipped"] else ("TIMEOUT" if st["timed_out"] else str(st["rc"]))
        lines.append(f"{st['stage']:<11} {rc:>7} {st['seconds']:>8} {st['limit']:>6}")
    p = s.get("precompile")
    if p:
        lines.append(f"precompile: {p['kernels']} kernels for {','.join(p['archs'] or [])} in {p['compile_seconds']} s, "
                     f"max {p['max_registers']} regs, {p['spilled']} spilling, {len(p['errors'] or [])} errors")
    fc = s.get("first_call")
    if fc and fc.get("calls"):
        c0 = fc["calls"][0]
        js = fc.get("jit_stats_after") or {}
        jit_ms = 1e3 * sum(js.get(k, 0.0) for k in ("compile_seconds", "disk_load_seconds", "module_load_seconds"))
        lines.append(f"warm cache, new process: compile-related time {jit_ms:.2f} ms (compiles {js.get('compiles')}, "
                     f"disk hits {js.get('disk_hits')}, module loads {js.get('module_loads')}); first call wall "
                     f"{_f(c0.get('first_ms'), '.1f')} ms, second {_f(c0.get('second_ms'), '.3f')} ms")
    t = s.get("tests")
    lines.append("pytest -m gpu: " + (", ".join(f"{v} {k}" for k, v in t.items() if k != "failed_names" and v)
                                      if t else "no results"))
    for tool, r in s["sanitizer"].items():
        if not r.get("ran"):
            lines.append(f"{tool}: not run{' (' + r['reason'] + ')' if r.get('reason') else ''}")
        else:
            extra = f", hazards {r['hazards']}" if "hazards" in r else ""
            if r.get("race_kernels"):
                extra += f" (in {', '.join(r['race_kernels'])})"
            lines.append(f"{tool}: errors {_f(r.get('errors'), 'd')}{extra}, cases {r.get('cases_passed', '?')}/{r.get('cases', '?')} passed")
    d = s.get("demo")
    if d:
        ms = d.get("minilm_ms") or {}
        lines.append(f"demo MiniLM: min cosine {_f(d.get('minilm_min_cosine'), '.6f')} | "
                     + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                     + (f" | ERROR {d['minilm_error']}" if d.get("minilm_error") else ""))
        for sl, r in (d.get("llm") or {}).items():
            if r.get("error"):
                lines.append(f"demo Llama-1B s={sl}: ERROR {r['error']}")
                continue
            msr = {k[3:]: v for k, v in r.items() if k.startswith("ms_")}
            lines.append(f"demo Llama-1B s={sl}: rel err {_f(r.get('rel_err'), '.2e')}, max|diff| {_f(r.get('max_abs_diff'), '.3g')}, "
                         f"argmax {_f(100 * r['argmax_agreement'] if r.get('argmax_agreement') is not None else None, '.2f')}% | "
                         + ", ".join(f"{k} {v:.2f} ms" for k, v in msr.items()))
        if d.get("llm_error"):
            lines.append(f"demo LLM: ERROR {d['llm_error']}")
        lines.append(f"demo verdict: {'PASS' if d.get('ok') else 'FAIL'}")
    b = s.get("bench")
    if b and b.get("summary"):
        bs, c = b["summary"], b.get("ceilings") or {}
        mm = (c.get("matmul_bf16") or {}).get("tflops")
        lines.append(f"bench: median ours/SDPA-{bs.get('ref_peer', 'flash')} (d 64 & 128) {_f(bs.get('median_ratio'), '.3f')}, "
                     f"min {_f(bs.get('min_ratio'), '.3f')} at {bs.get('min_ratio_at')}; best {_f(bs.get('best_pct_ceiling'), '.1f')}% "
                     f"of matmul ceiling {_f(mm, '.0f')} TFLOP/s; {bs.get('n_measured')}/{bs.get('n_points')} points")
        hc = b.get("host_cost") or {}
        parts = [f"{k} {v['host_us']:.1f} us" for k, v in hc.items() if isinstance(v, dict) and v.get("host_us") is not None]
        if parts:
            lines.append("host cost per small call: " + ", ".join(parts))
        lines += format_candidates(b.get("candidates"), "bench")
    lines += format_bench_bwd(s.get("bench_bwd"))
    lines += format_bwd_candidates((s.get("bench_bwd") or {}).get("candidates"))
    lines += format_train(s.get("train"))
    lines += format_fa2(s.get("fa2"))
    lines.append(f"overall: {'OK' if s['ok'] else 'NOT OK'} in {s.get('elapsed_s')} s")
    return "\n".join(lines)


def format_candidates(cands: Any, where: str) -> list[str]:
    """One line per A/B candidate of a benchmark (ferroattn/bench/candidate.py's summary: {label:
    {"median_speedup", "min_speedup", "min_at", "max_speedup", "n", "n_failed"}}). A malformed
    record (not a dict, or an entry that is not one) gets one line saying so instead of a traceback."""
    if cands is None:
        return []
    if not isinstance(cands, dict):
        return [f"{where} candidates: malformed record ({type(cands).__name__}, expected a dict)"]
    lines = []
    for label, c in cands.items():
        if not isinstance(c, dict):
            lines.append(f"{where} candidate {label}: malformed entry ({type(c).__name__}, expected a dict)")
            continue
        lines.append(f"{where} candidate {label}: speedup over ours median {_f(c.get('median_speedup'), '.3f')}, "
                     f"min {_f(c.get('min_speedup'), '.3f')} at {c.get('min_at')}, max {_f(c.get('max_speedup'), '.3f')}; "
                     f"{c.get('n')} points, {c.get('n_failed')} failed")
    return lines


def format_bwd_candidates(cands: Any) -> list[str]:
    """The backward's candidates, per mode ({"bwd": summary, "fwd_bwd": summary}); a record in
    another layout gets one line saying so."""
    if cands is None:
        return []
    if not isinstance(cands, dict) or not all(isinstance(v, dict) or v is None for v in cands.values()):
        return [f"bench_bwd candidates: malformed record (expected {{mode: {{label: summary}}}})"]
    lines = []
    for mode, per_mode in cands.items():
        if mode not in ("bwd", "fwd_bwd") or (per_mode and any(k in per_mode for k in ("median_speedup", "knobs"))):
            lines.append(f"bench_bwd candidates: malformed record (mode {mode!r}; expected bwd or fwd_bwd, "
                         "each {label: summary})")
            continue
        lines += format_candidates(per_mode, f"bench_bwd {mode}")
    return lines


def format_bench_bwd(b: dict | None) -> list[str]:
    if not b or not b.get("summary"):
        return []
    s = b["summary"]
    ref = s.get("ref_peer", "flash")
    ds = " & ".join(str(d) for d in s.get("head_dims", []))
    lines = []
    for mode, title in (("bwd", "bench_bwd backward"), ("fwd_bwd", "bench_bwd fwd+bwd")):
        m = (s.get("modes") or {}).get(mode)
        if not m:
            continue
        others = ", ".join(f"x{k} {_f(v.get('median_ratio'), '.3f')}" for k, v in (m.get("per_peer_sel") or {}).items()
                           if k != ref)
        lines.append(f"{title}: median ours/SDPA-{ref} (d {ds}) {_f(m.get('median_ratio'), '.3f')}, min "
                     f"{_f(m.get('min_ratio'), '.3f')} at {m.get('min_ratio_at')}; grid min {_f(m.get('grid_min_ratio'), '.3f')}"
                     + (f" at {m.get('grid_min_ratio_at')}" if m.get("grid_min_ratio_at") else "")
                     + (f"; medians (d {ds}) {others}" if others else "")
                     + f"; {m.get('n_measured')}/{m.get('n_points')} points")
    t = s.get("target")
    if t:
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t.get("met")]
        lines.append(f"bench_bwd target (median >= {t.get('median_target')}, min >= {t.get('min_target')}): {verdict}"
                     + ("" if t.get("complete") else " (grid incomplete)")
                     + (" [deterministic backward]" if b.get("deterministic") else ""))
    return lines


def format_train(t: dict | None) -> list[str]:
    if not t:
        return []
    verdict = lambda ok: {True: "PASS", False: "FAIL", None: "n/a"}[ok]  # noqa: E731
    lines = []
    if t.get("error"):
        lines.append(f"train: ERROR {t['error']}")
    lo = t.get("loss")
    if lo:
        fl = ", ".join(f"{k} {v[0]:.3f}->{v[1]:.3f}" for k, v in (lo.get("first_last") or {}).items())
        lines.append(f"train losses: max |ferroattn - sdpa| {_f(lo.get('max_diff'), '.2e')} (step {lo.get('worst_step')}) "
                     f"<= {_f(lo.get('bound'), '.2e')} (eager noise {_f(lo.get('noise_max'), '.2e')}) {verdict(lo.get('ok'))}"
                     + (f" | {fl}" if fl else ""))
    g = t.get("grad")
    if g:
        lines.append(f"train step-0 grads: worst err_ferroattn/err_sdpa {_f(g.get('worst_ratio'), '.3f')} ({g.get('worst_at')}) "
                     f"{verdict(g.get('ok'))}")
    m = t.get("memory")
    if m:
        sh = m.get("shape") or {}
        lines.append(f"train memory s={sh.get('s')}: ferroattn {_f(m.get('ferroattn_mib'), '.0f')} MiB, SDPA-flash "
                     f"{_f(m.get('sdpa_flash_mib'), '.0f')} MiB (ratio {_f(m.get('ratio'), '.2f')}) {verdict(m.get('ok'))}"
                     + (f" ERROR {m['error']}" if m.get("error") else ""))
    ms = t.get("median_step_ms") or {}
    lines.append("train verdict: " + verdict(t.get("ok"))
                 + (" | median step " + ", ".join(f"{k} {_f(v, '.1f')} ms" for k, v in ms.items()) if ms else ""))
    return lines


def format_fa2(f: dict | None) -> list[str]:
    if not f:
        return []
    parts = [f"{surf} " + ", ".join(f"{c.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
             for surf, c in sorted((f.get("surfaces") or {}).items())]
    sample = f" (FA2_CORE={f['fa2_core']}, FA2_REST={f['fa2_rest']})" if f.get("fa2_core") is not None else ""
    lines = [f"fa2 suite{sample}: " + ("; ".join(parts) if parts else "no cases")]
    failing = f.get("failing_tests") or []
    if failing:
        lines.append(f"fa2 failing tests ({len(failing)}): " + ", ".join(failing[:8]) + (" ..." if len(failing) > 8 else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="summarise a gpu_check run")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--elapsed", type=int, default=None)
    ap.add_argument("--stages", default=None, help="the GPU_CHECK_STAGES of the run (recorded)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="join these gpu_check.json files (instead of reading --work)")
    args = ap.parse_args(argv)
    if args.merge:
        parts = []
        for path in args.merge:
            part = _read_json(path)
            if not isinstance(part, dict):
                ap.error(f"--merge: {path}: not a readable gpu_check.json")
            parts.append(part)
        s = merge_summaries(parts)
    elif args.work is None:
        ap.error("--work is required (unless --merge is given)")
    else:
        s = build_summary(args.work, args.out, args.elapsed, args.stages)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
    print(format_summary(s))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
