"""The GPU check's summary: one table of steps (status, seconds, limit), as Markdown and JSON.

    python tests/gpu/gpu_check_summary.py WORK --device cuda --mode full --budget 480 \
        --state finished

WORK is run_all.sh's folder: steps.tsv (one line per finished step: name, status, seconds,
limit, estimate, exit code), logs/NN_<step>.log, junit/<step>.xml for the pytest steps, and
probe.json / carry.json when those exist. Writes WORK/summary.md (what benchmarks/RESULTS.md
records: date, commit, card, the step table, per-file kernel results, the failures) and
WORK/summary.json. run_all.sh calls it after every step (state "running"), so a call cut off
at its limit still returns the table of the steps that ended.

Standard library only: it must run where the package failed to install.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STEP_KEYS = ("step", "status", "seconds", "limit_s", "estimate_s", "exit_code")
# The result column shows at most this many characters of a log's last line.
MAX_RESULT_CHARS = 90
# Failures listed by name under the table (the archive's junit and logs hold all of them).
MAX_FAILURES_LISTED = 30
# Steps whose log is a table of numbers: copied into summary.md, which is what RESULTS.md records.
BENCH_STEPS = ("bench_gemm", "bench_attention", "engine_bench")
MAX_BENCH_LINES = 150


def read_steps(work: Path) -> list[dict]:
    path = work / "steps.tsv"
    rows = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        row = dict(zip(STEP_KEYS, line.split("\t")))
        for key in STEP_KEYS[2:]:
            row[key] = int(row[key])
        rows.append(row)
    return rows


def read_junit(path: Path) -> list[dict]:
    """One dict per test case: file, name, seconds, outcome (passed/failed/error/skipped) and
    the first line of the failure message."""
    if not path.is_file():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:  # a run killed while writing it
        return []
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome = name
                message = (node.get("message") or node.text or "").strip().splitlines()
                message = message[0] if message else ""
                break
        file = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
        cases.append({"file": file, "name": case.get("name", "?"), "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    return cases


def count(cases: list[dict]) -> dict[str, int]:
    tally = {"tests": len(cases), "passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in cases:
        tally[case["outcome"]] += 1
    return tally


def _step_log(work: Path, step: str) -> Path | None:
    return next(iter(sorted((work / "logs").glob(f"*_{step}.log"))), None)


def last_line(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:MAX_RESULT_CHARS] if lines else ""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit_line(work: Path, device: str) -> str:
    carry = work / "carry.json"
    if carry.is_file() and device == "cuda":
        info = json.loads(carry.read_text())
        dirty = " + uncommitted edits" if info.get("dirty") else ""
        return (f"{info['commit'][:12]}{dirty} (the carried wheel's, built "
                f"{info['created_utc']} UTC)")
    head = _git("rev-parse", "HEAD")
    if head:
        dirty = " + uncommitted edits" if _git("status", "--porcelain", "--untracked-files=no") \
            else ""
        return f"{head[:12]}{dirty} (this tree)"
    return "unknown (no carry.json, no git)"


def card_lines(work: Path) -> list[tuple[str, str]]:
    path = work / "probe.json"
    if not path.is_file():
        return [("card", "unknown (no probe.json)")]
    probe = json.loads(path.read_text())
    cuda = probe.get("cuda")
    if probe.get("device_kind") != "cuda":
        return [("card", f"none: CPU harness (sim) on {probe.get('machine', '?')}"),
                ("software", f"Python {probe.get('python', '?')}")]
    if not isinstance(cuda, dict) or "device" not in cuda:
        return [("card", f"no usable GPU: {cuda}")]
    dev = cuda["device"]
    pkgs = probe.get("packages", {})
    return [("card", f"{dev['name']}, compute capability {dev['compute_capability']}, "
                     f"{dev['multiprocessors']} SMs, {dev['memory_gib']} GiB, "
                     f"L2 {dev['l2_mib']} MiB"),
            ("software", f"nvidia-smi: {probe.get('nvidia_smi', '?')}; driver API "
                         f"{cuda.get('driver_api')}, CUDA runtime {cuda.get('runtime')}, NVRTC "
                         f"{cuda.get('nvrtc')}, NCCL {cuda.get('nccl')}, CuPy {cuda.get('cupy')}, "
                         f"Python {probe.get('python', '?').split()[0]}, numpy "
                         f"{pkgs.get('numpy', '?')}")]


def _flags(mode: str) -> str:
    """run_all.sh's mode string ("full", "quick", "quick-dry-run") back as its flags."""
    return (" --quick" if mode.startswith("quick") else "") + \
        (" --dry-run" if mode.endswith("dry-run") else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def summarize(work: Path, device: str, mode: str, budget: int, state: str) -> dict:
    steps = read_steps(work)
    junit = {p.stem: read_junit(p) for p in sorted((work / "junit").glob("*.xml"))}
    for row in steps:
        cases = junit.get(row["step"])
        if cases:
            tally = count(cases)
            row["result"] = ", ".join(f"{tally[k]} {k}" for k in
                                      ("passed", "failed", "error", "skipped") if tally[k])
        elif row["step"] in BENCH_STEPS and row["status"] == "pass":
            row["result"] = "table below"
        else:
            log = _step_log(work, row["step"])
            row["result"] = last_line(log) if log else ""
    total = sum(r["seconds"] for r in steps)
    facts = [("date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime(
                 "%Y-%m-%d %H:%M")),
             ("commit", commit_line(work, device)), *card_lines(work),
             ("run", f"tests/gpu/run_all.sh --device {device}{_flags(mode)}: {total} s of a "
                     f"{budget} s budget, {state}")]
    lines = [f"# GPU check: {device}, {mode} ({state})", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in facts]
    lines += ["", "| # | step | status | seconds | limit | H100 est. | result |",
              "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {i} | {r['step']} | {r['status']} | {r['seconds']} | {r['limit_s']} | "
              f"{r['estimate_s']} | {_cell(r['result'])} |" for i, r in enumerate(steps, 1)]
    kernels = junit.get("kernels", [])
    if kernels:
        per_file: dict[str, list[dict]] = {}
        for case in kernels:
            per_file.setdefault(case["file"], []).append(case)
        lines += ["", "## kernels, per file", "",
                  "| file | tests | passed | failed | error | skipped | seconds |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for file, cases in sorted(per_file.items()):
            t = count(cases)
            lines.append(f"| {file} | {t['tests']} | {t['passed']} | {t['failed']} | "
                         f"{t['error']} | {t['skipped']} | "
                         f"{sum(c['seconds'] for c in cases):.1f} |")
    for step in BENCH_STEPS:
        log = _step_log(work, step)
        if log is None:
            continue
        table = log.read_text(errors="replace").splitlines()[1:]  # less run_all's header line
        if len(table) > MAX_BENCH_LINES:
            table = table[:MAX_BENCH_LINES] + [f"... ({len(table) - MAX_BENCH_LINES} more lines "
                                               f"in the archive's {log.name})"]
        lines += ["", f"## {step}", "", "```", *table, "```"]
    failures = [f"{step}: {c['file']}::{c['name']}: {c['message']}"
                for step, cases in junit.items() for c in cases
                if c["outcome"] in ("failed", "error")]
    failures += [f"{r['step']}: {r['status']} (exit {r['exit_code']}; see the archive's logs)"
                 for r in steps if r["status"] != "pass"]
    if failures:
        lines += ["", "## failures", ""]
        lines += [f"- {_cell(f)}" for f in failures[:MAX_FAILURES_LISTED]]
        if len(failures) > MAX_FAILURES_LISTED:
            lines.append(f"- ... and {len(failures) - MAX_FAILURES_LISTED} more")
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    summary = {"device": device, "mode": mode, "state": state, "budget_s": budget,
               "total_s": total, "facts": dict(facts), "steps": steps,
               "kernels_per_file": {f: count([c for c in kernels if c["file"] == f])
                                    for f in sorted({c["file"] for c in kernels})}}
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--mode", default="full")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--state", default="finished")
    args = ap.parse_args(argv)
    summarize(args.work, args.device, args.mode, args.budget, args.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
