"""tests/gpu/run_all.sh's plumbing on the CPU, in seconds: its steps replaced by stubs
(--dry-run), the output must still be the two files the device tool can return, with every step
in issue 34's order, a failed and a timed-out step recorded while the later ones still run, a
budget that runs out recorded as skips; the summary's per-file kernel table read from junit; and
the carry manifest catching a tree that changed after the wheel was built. CI's tier 3 runs the
real rehearsal (--device sim --quick) and checks its output with the same gpu_check_layout.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUN_ALL = HERE / "run_all.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"pagedrun_tests_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layout = _load("gpu_check_layout")
summary = _load("gpu_check_summary")
manifest = _load("gpu_carry_manifest")


def _run_all(out: Path, *args: str, stub: str = "true") -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_DRY_RUN_CMD": stub, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(RUN_ALL), "--device", "sim", "--dry-run", "--out",
                           str(out), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def _steps(out: Path) -> dict[str, str]:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        data = json.loads(tar.extractfile("gpu_check/summary.json").read())
    return {row["step"]: row["status"] for row in data["steps"]}


def test_failed_and_timed_out_steps_do_not_stop_the_run(tmp_path):
    # twins fails, kernels outlives its (1 s) limit; everything after them must still run.
    stub = 'case "$STEP" in twins) exit 3 ;; kernels) sleep 30 ;; esac'
    proc = _run_all(tmp_path, "--step-limit", "1", stub=stub)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert layout.check(tmp_path) == [], proc.stdout
    statuses = _steps(tmp_path)
    assert list(statuses) == list(layout.STEPS)
    assert statuses["twins"] == "fail" and statuses["kernels"] == "timeout"
    assert all(statuses[s] == "pass" for s in layout.STEPS if s not in ("twins", "kernels"))
    assert "FAILED steps: twins kernels" in proc.stdout
    assert layout.check(tmp_path, require_pass=True) != []
    md = (tmp_path / "summary.md").read_text()
    assert "- twins: fail (exit 3" in md and "- kernels: timeout" in md


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    proc = _run_all(tmp_path, "--budget", "5")
    assert proc.returncode == 1
    assert layout.check(tmp_path) == []
    assert set(_steps(tmp_path).values()) == {"skipped"}


def test_layout_check_refuses_extra_files_and_a_partial_run(tmp_path):
    assert _run_all(tmp_path).returncode == 0
    assert layout.check(tmp_path) == []
    (tmp_path / "stray.log").write_text("x")
    assert any("want exactly" in p for p in layout.check(tmp_path))
    # --full asks for what only a real run writes.
    (tmp_path / "stray.log").unlink()
    assert any("probe.json" in p for p in layout.check(tmp_path, full=True))


def test_summary_reads_per_file_kernel_results_from_junit(tmp_path):
    work = tmp_path / "gpu_check"
    (work / "logs").mkdir(parents=True)
    (work / "junit").mkdir()
    (work / "steps.tsv").write_text("kernels\tfail\t12\t240\t90\t1\n")
    (work / "logs" / "01_kernels.log").write_text("== kernels\n2 passed, 1 failed\n")
    (work / "junit" / "kernels.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase file="tests/kernels/test_gemm.py" name="test_a" time="1.5"/>'
        '<testcase file="tests/kernels/test_gemm.py" name="test_b" time="0.5">'
        '<failure message="AssertionError: max err 0.3">trace</failure></testcase>'
        '<testcase file="tests/kernels/test_moe_kernel.py" name="test_c" time="2">'
        '<skipped message="needs sm_90"/></testcase>'
        '</testsuite></testsuites>')
    result = summary.summarize(work, "cuda", "full", 480, "finished")
    assert result["kernels_per_file"] == {
        "tests/kernels/test_gemm.py": {"tests": 2, "passed": 1, "failed": 1, "error": 0,
                                       "skipped": 0},
        "tests/kernels/test_moe_kernel.py": {"tests": 1, "passed": 0, "failed": 0, "error": 0,
                                             "skipped": 1}}
    md = (work / "summary.md").read_text()
    assert "| 1 | kernels | fail | 12 | 240 | 90 | 1 passed, 1 failed, 1 skipped |" in md
    assert "kernels: tests/kernels/test_gemm.py::test_b: AssertionError: max err 0.3" in md


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "tree"
    for rel, text in {"cuda/gemm.cu": "kernel", "runtime/a.py": "a = 1", "pyproject.toml": "",
                      "runtime/__pycache__/a.cpython-312.pyc": "junk"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_carry_manifest_catches_a_tree_changed_after_the_build(tree, tmp_path):
    wheel = tmp_path / "carry" / "paged_run-0.1.0-cp312-cp312-linux_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"wheel")
    path = wheel.parent / "carry.json"
    record = manifest.write(path, [wheel], {"mode": "wheel"}, root=tree)
    assert set(record["files"]) == {"cuda/gemm.cu", "runtime/a.py", "pyproject.toml"}
    assert manifest.check(path, root=tree) == 0
    (tree / "cuda" / "gemm.cu").write_text("kernel, edited")
    (tree / "runtime" / "b.py").write_text("")
    assert manifest.stale_paths(json.loads(path.read_text()), root=tree) == [
        "changed since the carry was built: cuda/gemm.cu",
        "not in the carry (new file): runtime/b.py"]
    assert manifest.check(path, root=tree) == 1
    wheel.write_bytes(b"another wheel")
    (tree / "cuda" / "gemm.cu").write_text("kernel")
    (tree / "runtime" / "b.py").unlink()
    assert manifest.check(path, root=tree) == 1  # the wheel is not the one recorded
