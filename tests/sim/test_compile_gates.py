"""scripts/compile_gates.py catches what each gate promises, on probe kernels in
tests/sim/kernels/gates/: NVRTC-only errors (INFINITY), register budget overruns, spills;
and passes a clean file. Skips when nvcc or libnvrtc is absent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent / "kernels" / "gates"


def _load_gates():
    spec = importlib.util.spec_from_file_location("compile_gates",
                                                  REPO / "scripts" / "compile_gates.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gates = _load_gates()


@pytest.fixture(scope="module")
def gate_report():
    from pagedrun.runtime.kernels.sim_module import sanitizer_mode

    if sanitizer_mode() != "plain":
        pytest.skip("NVRTC does not run under a preloaded sanitizer; the plain job gates")
    if gates.toolkit_root() is None or gates.find_libnvrtc() is None:
        pytest.skip("needs nvcc and libnvrtc (scripts/install.sh installs nvidia-cuda-nvrtc)")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = gates.main([str(p) for p in sorted(PROBES.glob("*.cu"))])
    return rc, buf.getvalue()


def verdicts(report: str) -> dict[str, str]:
    out = {}
    for line in report.splitlines():
        if line.startswith(("PASS ", "FAIL ")):
            verdict, gate, name, arch = line.split()
            out[f"{gate} {name} {arch}"] = verdict
    return out


def test_gates_fail_overall_on_probes(gate_report):
    rc, _ = gate_report
    assert rc == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_clean_kernel_passes_both_gates(gate_report, arch):
    v = verdicts(gate_report[1])
    assert v[f"nvrtc gate_good.cu {arch}"] == "PASS"
    assert v[f"nvcc gate_good.cu {arch}"] == "PASS"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_infinity_fails_nvrtc_only(gate_report, arch):
    v = verdicts(gate_report[1])
    assert v[f"nvrtc gate_infinity.cu {arch}"] == "FAIL"
    assert v[f"nvcc gate_infinity.cu {arch}"] == "PASS"
    assert 'identifier "INFINITY" is undefined' in gate_report[1]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_register_budget_and_spills_fail_nvcc(gate_report, arch):
    v = verdicts(gate_report[1])
    assert v[f"nvcc gate_over_budget.cu {arch}"] == "FAIL"
    assert v[f"nvcc gate_spills.cu {arch}"] == "FAIL"
    assert "registers > budget 16" in gate_report[1]
    assert "gate_spills: spills" in gate_report[1]


def test_parse_ptxas_output():
    text = """ptxas info    : Compiling entry function 'k1' for 'sm_80'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 368 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k2' for 'sm_80'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, 368 bytes cmem[0]
"""
    stats = gates.parse_ptxas(text)
    assert stats["k1"].registers == 40 and stats["k1"].spill_stores == 4
    assert stats["k1"].spill_loads == 12 and stats["k2"].registers == 12
    assert not stats["_Z6helperv"].entry
    problems = gates.check_stats(stats, budget=32)
    assert any("k1: spills 4" in p for p in problems)
    assert any("k1: 40 registers > budget 32" in p for p in problems)
    assert not any(p.startswith("k2") for p in problems)
    assert gates.check_stats({}, budget=None) == ["no 'Register budget: N' line in the file header"]


def test_hopper_only_instructions_select_sm90a():
    assert gates.hopper_arch("asm volatile(\"wgmma.mma_async.sync ...\");") == "sm_90a"
    assert gates.hopper_arch("mma_m16n8k16_bf16(d, a, b, c);") == "sm_90"


def test_cubin_cache_replays_a_build_and_misses_on_any_changed_input(tmp_path, monkeypatch):
    """nvcc_cubin's content cache (the kernel report reuses the gates' builds through it): the
    same inputs give the stored cubin and ptxas report without running nvcc; a changed file,
    header or architecture is built afresh."""
    from pagedrun.runtime.kernels.sim_module import sanitizer_mode

    if sanitizer_mode() != "plain":
        pytest.skip("nvcc would run under the preloaded sanitizer; the plain job covers it")
    root = gates.toolkit_root()
    if root is None:
        pytest.skip("needs nvcc")
    nvcc = root / "bin" / "nvcc"
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.cuh").write_text("#define SCALE 2.0f\n")
    kernel = src / "probe.cu"
    kernel.write_text('#include "probe.cuh"\n'
                      'extern "C" __global__ void probe(float* x) { x[threadIdx.x] *= SCALE; }\n')
    cache = tmp_path / "cache"
    first = gates.nvcc_cubin(nvcc, kernel, "sm_80", str(tmp_path / "a.cubin"), cache)
    assert first.returncode == 0 and "probe" in first.stdout + first.stderr

    runs = []
    real_run = gates.subprocess.run

    def counting_run(cmd, *args, **kwargs):
        if cmd and str(cmd[0]).endswith("nvcc") and "-cubin" in cmd:
            runs.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(gates.subprocess, "run", counting_run)
    again = gates.nvcc_cubin(nvcc, kernel, "sm_80", str(tmp_path / "b.cubin"), cache)
    assert runs == [] and again.returncode == 0
    assert again.stdout == first.stdout + first.stderr
    assert (tmp_path / "b.cubin").read_bytes() == (tmp_path / "a.cubin").read_bytes()

    gates.nvcc_cubin(nvcc, kernel, "sm_90", str(tmp_path / "c.cubin"), cache)
    assert len(runs) == 1                      # another architecture
    (src / "probe.cuh").write_text("#define SCALE 3.0f\n")
    gates.nvcc_cubin(nvcc, kernel, "sm_80", str(tmp_path / "d.cubin"), cache)
    assert len(runs) == 2                      # a header changed
    assert (tmp_path / "d.cubin").read_bytes() != (tmp_path / "a.cubin").read_bytes()
