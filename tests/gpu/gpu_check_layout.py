"""What tests/gpu/run_all.sh must leave in its output folder, checked (CI's rehearsal, tests).

    python tests/gpu/gpu_check_layout.py OUT_DIR [--full] [--require-pass]

The device tool returns at most 8 files from $OUT, so the check writes exactly two:
    summary.md          the step table (tests/gpu/gpu_check_summary.py), readable in the reply
    gpu_check.tar.gz    gpu_check/{summary.md, summary.json, steps.tsv, logs/NN_<step>.log,
                        junit/<pytest step>.xml, probe.json, carry.json (when carried)}
The steps, in this order (issue 34): install, then the environment probe, the PTX twins before
any long kernel work, the kernel tests, the benchmarks, the engine. --full also asks for what
a real (not --dry-run) run leaves: probe.json, a junit file per pytest step, a per-file kernel
table naming every tests/kernels/test_*.py. --require-pass: every step passed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

STEPS = ("install", "probe", "twins", "kernels", "bench_gemm", "bench_attention", "engine",
         "engine_bench", "tp")
PYTEST_STEPS = ("twins", "kernels", "engine")
OUT_FILES = {"summary.md", "gpu_check.tar.gz"}
# The device tool's limit on files returned from $OUT.
MAX_OUT_FILES = 8
STATUSES = {"pass", "fail", "timeout", "skipped"}
KERNEL_TESTS = Path(__file__).resolve().parents[1] / "kernels"


def check(out_dir: Path, full: bool = False, require_pass: bool = False) -> list[str]:
    problems = []
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    if len(files) > MAX_OUT_FILES:
        problems.append(f"{len(files)} files in {out_dir}: the device returns at most "
                        f"{MAX_OUT_FILES}")
    if set(files) != OUT_FILES:
        problems.append(f"output files {files}, want exactly {sorted(OUT_FILES)}")
    archive = out_dir / "gpu_check.tar.gz"
    if not archive.is_file():
        return problems
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        read = {name: tar.extractfile(m).read() for name, m in members.items()
                if name.endswith((".md", ".json"))}
    want = {"gpu_check/summary.md", "gpu_check/summary.json", "gpu_check/steps.tsv"}
    want |= {f"gpu_check/logs/{i:02d}_{step}.log" for i, step in enumerate(STEPS, 1)}
    if full:
        want |= {"gpu_check/probe.json"}
        want |= {f"gpu_check/junit/{step}.xml" for step in PYTEST_STEPS}
    problems += [f"archive lacks {name}" for name in sorted(want - members.keys())]
    problems += [f"archive member outside gpu_check/: {name}" for name in members
                 if not name.startswith("gpu_check/")]
    if "gpu_check/summary.md" in read and (out_dir / "summary.md").is_file() and \
            read["gpu_check/summary.md"] != (out_dir / "summary.md").read_bytes():
        problems.append("summary.md differs from the archive's")
    if "gpu_check/summary.json" not in read:
        return problems
    summary = json.loads(read["gpu_check/summary.json"])
    names = [row["step"] for row in summary["steps"]]
    if names != list(STEPS):
        problems.append(f"steps {names}, want {list(STEPS)} in that order")
    if summary.get("state") != "finished":
        problems.append(f"summary state {summary.get('state')!r}, want 'finished'")
    md = read["gpu_check/summary.md"].decode()
    rows = [ln.split("|")[2].strip() for ln in md.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    if rows != list(STEPS):
        problems.append(f"summary.md step rows {rows}, want {list(STEPS)}")
    for row in summary["steps"]:
        if row["status"] not in STATUSES:
            problems.append(f"step {row['step']}: status {row['status']!r}")
        if require_pass and row["status"] != "pass":
            problems.append(f"step {row['step']}: {row['status']} ({row.get('result', '')})")
    if full:
        want_files = {f"tests/kernels/{p.name}" for p in KERNEL_TESTS.glob("test_*.py")}
        have_files = set(summary.get("kernels_per_file", {}))
        problems += [f"no kernel test ran from {f}" for f in sorted(want_files - have_files)]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--full", action="store_true", help="a real run, not --dry-run")
    ap.add_argument("--require-pass", action="store_true")
    args = ap.parse_args(argv)
    problems = check(args.out_dir, args.full, args.require_pass)
    for line in problems:
        print(f"gpu_check_layout: {line}")
    if problems:
        return 1
    print(f"gpu_check_layout: {args.out_dir}: summary.md + gpu_check.tar.gz, steps "
          f"{', '.join(STEPS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
