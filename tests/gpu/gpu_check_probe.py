"""Step `probe` of tests/gpu/run_all.sh: what the machine is, before any test spends time on it.

    python tests/gpu/gpu_check_probe.py --device cuda --json probe.json

On cuda: the driver (nvidia-smi and CUDA's driver API version), CuPy, the CUDA runtime, NVRTC,
NCCL (what step tp needs), the device (name, compute capability, SMs, memory, L2), and per
kernel source whether the installed package serves it from a prebuilt fatbin or must compile it
with NVRTC (and why): a fatbin that does not cover the card shows up here, not as slow tests.
On sim (the rehearsal): the host side of the same report. Both: Python, the packages the check
uses, where pagedrun was imported from, and `paged-run env`'s lines.

Every probe is guarded and reported, never raised; the exit status is 1 only when the device
cannot be used at all (no CuPy or no visible GPU on cuda), so the later steps still run and
fail on their own terms.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("numpy", "cupy-cuda13x", "pytest", "pytest-timeout", "pytest-xdist", "pyzmq",
            "cython", "paged-run")


def _guard(fn):
    try:
        return fn()
    except Exception as exc:  # a probe reports what failed; it never stops the check
        return f"unavailable: {type(exc).__name__}: {exc}"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() or out.stderr.strip()


def _cuda_facts() -> tuple[dict, bool]:
    """(facts, usable): CuPy's view of the driver, toolkit libraries and device 0."""
    import cupy

    rt = cupy.cuda.runtime
    facts = {"cupy": cupy.__version__,
             "driver_api": _guard(rt.driverGetVersion),
             "runtime": _guard(rt.runtimeGetVersion),
             "nvrtc": _guard(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))}

    def nccl():
        from cupy.cuda import nccl as lib

        if not getattr(lib, "available", True):
            return "not available (CuPy's NCCL binding found no library)"
        return f"{lib.get_version()} (available)"

    facts["nccl"] = _guard(nccl)
    count = _guard(rt.getDeviceCount)
    facts["device_count"] = count
    if not isinstance(count, int) or count < 1:
        return facts, False
    props = rt.getDeviceProperties(0)
    name = props["name"]
    facts["device"] = {
        "name": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "multiprocessors": props["multiProcessorCount"],
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "l2_mib": round(props["l2CacheSize"] / 2**20, 1),
    }
    return facts, True


def _kernel_sources(arch: int) -> dict[str, str]:
    """cuda/<name>.cu -> "prebuilt" or "nvrtc: why", as the loader decides on this card."""
    from pagedrun.runtime.kernels.prebuilt import CUDA_DIR, select_module_source

    out = {}
    for path in sorted(Path(CUDA_DIR).glob("*.cu")):
        kind, detail = select_module_source(path.name, arch)
        out[path.name] = "prebuilt" if kind == "prebuilt" else f"nvrtc: {detail}"
    return out


def _env_report() -> dict[str, str]:
    from pagedrun.server.cli import env_report

    return {name: str(value) for name, value in env_report()}


def probe(device: str) -> tuple[dict, bool]:
    import pagedrun

    report = {"device_kind": device,
              "python": f"{sys.version.split()[0]} ({sys.executable})",
              "machine": f"{platform.node()} {platform.machine()} {platform.release()}",
              "packages": {name: _version(name) for name in PACKAGES},
              "pagedrun_from": str(Path(pagedrun.__file__).parent),
              "g++": shutil.which("g++") or "not found"}
    usable = True
    if device == "cuda":
        report["nvidia_smi"] = _guard(_nvidia_smi)
        facts = _guard(_cuda_facts)
        if isinstance(facts, str):
            report["cuda"], usable = facts, False
        else:
            report["cuda"], usable = facts
        if usable:
            major, minor = report["cuda"]["device"]["compute_capability"].split(".")
            report["kernel_sources"] = _guard(lambda: _kernel_sources(int(major) * 10 + int(minor)))
    else:
        report["harness"] = "CPU harness (cuda/sim): the kernels run on host threads"
    report["paged_run_env"] = _guard(_env_report)
    return report, usable


def _print(report: dict, indent: str = "") -> None:
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print(value, indent + "  ")
        else:
            print(f"{indent}{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    report, usable = probe(args.device)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if not usable:
        print("probe: no usable GPU through CuPy: the GPU steps below will fail")
        return 1
    # The last line is the summary table's "result" for this step.
    if args.device == "sim":
        print(f"probe: CPU harness, Python {report['python'].split()[0]}, "
              f"numpy {report['packages']['numpy']}")
        return 0
    dev = report["cuda"]["device"]
    sources = report.get("kernel_sources")
    served = "kernel sources unknown"
    if isinstance(sources, dict):
        nvrtc = [name for name, how in sources.items() if how != "prebuilt"]
        served = (f"{len(sources) - len(nvrtc)} of {len(sources)} kernel sources from "
                  f"prebuilt fatbins{' (NVRTC: ' + ', '.join(nvrtc) + ')' if nvrtc else ''}")
    print(f"probe: {dev['name']} (cc {dev['compute_capability']}), NCCL "
          f"{report['cuda']['nccl']}; {served}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
