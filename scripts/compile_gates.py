#!/usr/bin/env python3
"""Compile gates for every cuda/*.cu: each kernel file must compile

  (a) through NVRTC, the path CuPy takes at run time (stricter than nvcc in places, e.g.
      `INFINITY` needs a definition NVRTC does not ship), for sm_80 and sm_90 -- to PTX for the
      virtual architecture (compute_80 / compute_90), since the ptxas step after it is (b)'s; and
  (b) with `nvcc -cubin -Xptxas -v` for sm_80 and sm_90 (sm_90a when the file uses Hopper-only
      instructions), with zero spill bytes and a 0-byte stack frame in every function, and at
      most the registers promised by the "Register budget: N" line in the file's header.
      Why the stack frame too: a frame without spills is local memory all the same -- an array
      indexed at run time (an accumulator loop the compiler did not unroll), a struct whose
      address escapes (a by-value TMA descriptor copied before its address is taken), a
      non-inlined call's ABI frame -- and costs what a spill costs, or breaks what the code
      assumed (TMA must read the descriptor parameter itself). No kernel of ours has one, so
      there is no allowlist.

nvcc builds are kept by content in ~/.cache/paged-run/cubins (--cubin-cache, --no-cache), where
scripts/kernel_report.py finds the same sm_90 / sm_90a builds instead of compiling them again.

Usage: python scripts/compile_gates.py [--only nvrtc|nvcc] [cuda/x.cu ...]
Exit status 0 when every gate passes; the report names each file, arch, kernel and number.
Needs nvcc (CUDA_HOME, default /usr/local/cuda-13.0 or /usr/local/cuda) and libnvrtc (the
`nvidia-cuda-nvrtc` wheel, or the toolkit's own); a missing tool fails the gate unless
--allow-missing is given (then that gate is reported as skipped).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import hashlib
import os
import shutil
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CUDA_DIR = REPO / "cuda"
ARCHS = ("sm_80", "sm_90")
# A file that uses any of these needs the arch-specific Hopper target.
# (the instructions, and the cuda/hopper_groundwork.cuh functions wrapping them: wgmma_*,
# mbarrier_*, tma_*; cuda/gemm_hopper.cu uses them)
HOPPER_ONLY = re.compile(r"\b(wgmma\w*|cp\.async\.bulk|mbarrier\w*|setmaxnreg|tma_\w+)\b")
BUDGET = re.compile(r"Register budget:\s*(\d+)", re.IGNORECASE)
NVRTC_SUCCESS = 0


def toolkit_root() -> Path | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 "/usr/local/cuda-13.0", "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return Path(cand)
    return None


def find_libnvrtc() -> str | None:
    candidates = []
    try:
        import nvidia  # the nvidia-cuda-nvrtc wheel installs nvidia/cu13/lib/libnvrtc.so.13

        for base in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    root = toolkit_root()
    if root:
        candidates += sorted(glob.glob(str(root / "lib64" / "libnvrtc.so*")))
    candidates = [c for c in candidates if "builtins" not in c]
    return candidates[0] if candidates else None


def hopper_arch(source: str) -> str:
    return "sm_90a" if HOPPER_ONLY.search(source) else "sm_90"


def archs_for(path: Path) -> list[str]:
    return ["sm_80", hopper_arch(path.read_text())]


@dataclass
class GateResult:
    name: str
    ok: bool
    lines: list[str] = field(default_factory=list)


# ---- NVRTC ---------------------------------------------------------------------------------
class Nvrtc:
    def __init__(self, libpath: str):
        # libnvrtc dlopens its builtins library by soname at the first compile. Pip's
        # nvidia-cuda-nvrtc wheels ship it beside libnvrtc, but not every wheel's libnvrtc finds
        # it there ("failed to open libnvrtc-builtins.so.13.0"); loaded first, the soname
        # lookup finds it already in the process.
        folder = os.path.dirname(libpath)
        for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
        self.lib = ctypes.CDLL(libpath)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, str]:
        lib = self.lib
        prog = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0,
                                    None, None)
        if rc != NVRTC_SUCCESS:
            return False, f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}"
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == NVRTC_SUCCESS, log.value.decode(errors="replace").strip()


def nvrtc_gate(nvrtc: Nvrtc, path: Path, arch: str, toolkit_include: Path | None) -> GateResult:
    # The virtual architecture: NVRTC's front end and NVVM, to PTX. What CuPy's run-time build
    # adds after that is ptxas, the nvcc gate's (a cubin here cost half of this gate's time).
    virtual = arch.replace("sm_", "compute_")
    opts = ["--std=c++17", f"--gpu-architecture={virtual}", f"-I{CUDA_DIR}", f"-I{path.parent}"]
    if toolkit_include:
        opts.append(f"-I{toolkit_include}")
    # The same translation unit the loader hands CuPy: one #include of the file.
    ok, log = nvrtc.compile(f'#include "{path.name}"\n', f"{path.stem}_tu.cu", opts)
    res = GateResult(f"nvrtc {path.name} {arch}", ok)
    if log:
        res.lines += log.splitlines()[-40:]
    return res


# ---- nvcc + ptxas ---------------------------------------------------------------------------
@dataclass
class FunctionStats:
    name: str
    entry: bool = False
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    static_smem: int = 0  # "N bytes smem" on the "Used" line: __shared__ arrays, not dynamic


_COMPILING = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(output: str) -> dict[str, FunctionStats]:
    """ptxas -v output -> per-function registers, stack frame and spill bytes."""
    stats: dict[str, FunctionStats] = {}
    current_entry = current_props = None
    for line in output.splitlines():
        if m := _COMPILING.search(line):
            current_entry = stats.setdefault(m.group(1), FunctionStats(m.group(1)))
            current_entry.entry = True
        elif m := _PROPERTIES.search(line):
            current_props = stats.setdefault(m.group(1), FunctionStats(m.group(1)))
        elif m := _FRAME.search(line):
            if current_props is not None:
                current_props.stack_frame = int(m.group(1))
                current_props.spill_stores = int(m.group(2))
                current_props.spill_loads = int(m.group(3))
        elif m := _USED.search(line):
            if current_entry is not None:
                current_entry.registers = int(m.group(1))
                if sm := _SMEM.search(line):
                    current_entry.static_smem = int(sm.group(1))
    return stats


def check_stats(stats: dict[str, FunctionStats], budget: int | None) -> list[str]:
    problems = []
    if budget is None:
        problems.append("no 'Register budget: N' line in the file header")
    for fs in stats.values():
        if fs.spill_stores or fs.spill_loads:
            problems.append(f"{fs.name}: spills {fs.spill_stores} bytes stores, "
                            f"{fs.spill_loads} bytes loads")
        if fs.stack_frame:
            problems.append(f"{fs.name}: {fs.stack_frame} bytes stack frame (local memory; "
                            f"the gate requires 0)")
        if fs.entry and budget is not None and fs.registers is not None and fs.registers > budget:
            problems.append(f"{fs.name}: {fs.registers} registers > budget {budget}")
    return problems


CUBIN_CACHE = Path.home() / ".cache" / "paged-run" / "cubins"


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: Path) -> str:
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout


def _cubin_key(nvcc: Path, path: Path, cmd: list[str]) -> str:
    """The build's inputs: nvcc's version, the command (less its output path), the file and
    every header it could include (cuda/ and the file's folder)."""
    h = hashlib.sha256(_nvcc_version(nvcc).encode())
    h.update("\0".join(cmd).encode())
    h.update(path.read_bytes())
    for folder in sorted({CUDA_DIR, path.parent}):
        for header in sorted(folder.rglob("*.cuh")) + sorted(folder.rglob("*.h")):
            h.update(str(header.relative_to(folder)).encode() + header.read_bytes())
    return h.hexdigest()[:32]


def nvcc_cubin(nvcc: Path, path: Path, arch: str, cubin: str,
               cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Compiles one kernel file to `cubin` with ptxas -v (its report is in stdout + stderr);
    scripts/kernel_report.py builds its cubins through here too. With `cache_dir`, a build
    with the same inputs (_cubin_key) is copied from there instead, with its ptxas report
    (CI's tier 3: the report reuses the gates' sm_90 / sm_90a builds)."""
    cmd = [str(nvcc), "-cubin", f"-arch={arch}", "-std=c++17", f"-I{CUDA_DIR}",
           f"-I{path.parent}", "-Xptxas", "-v", str(path)]
    stored = log = None
    if cache_dir is not None:
        stored = cache_dir / f"{path.stem}-{arch}-{_cubin_key(nvcc, path, cmd)}"
        log = stored.with_suffix(".ptxas")
        if stored.with_suffix(".cubin").is_file() and log.is_file():
            shutil.copyfile(stored.with_suffix(".cubin"), cubin)
            return subprocess.CompletedProcess(cmd, 0, log.read_text(), "")
    proc = subprocess.run(cmd[:-1] + ["-o", cubin, cmd[-1]], capture_output=True, text=True)
    if stored is not None and proc.returncode == 0:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = stored.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(cubin, tmp)
        os.replace(tmp, stored.with_suffix(".cubin"))
        tmp.write_text(proc.stdout + proc.stderr)
        os.replace(tmp, log)
    return proc


def nvcc_gate(nvcc: Path, path: Path, arch: str, cache_dir: Path | None = None) -> GateResult:
    source = path.read_text()
    m = BUDGET.search(source)
    budget = int(m.group(1)) if m else None
    with tempfile.TemporaryDirectory() as tmp:
        proc = nvcc_cubin(nvcc, path, arch, os.path.join(tmp, "out.cubin"), cache_dir)
    res = GateResult(f"nvcc {path.name} {arch}", proc.returncode == 0)
    if proc.returncode != 0:
        res.lines += (proc.stdout + proc.stderr).splitlines()[-40:]
        return res
    stats = parse_ptxas(proc.stdout + proc.stderr)
    problems = check_stats(stats, budget)
    res.ok = not problems
    res.lines += problems
    for fs in sorted(stats.values(), key=lambda s: s.name):
        if fs.entry:
            res.lines.append(f"  {fs.name}: {fs.registers} registers (budget {budget}), "
                             f"spill {fs.spill_stores}/{fs.spill_loads} B, "
                             f"stack {fs.stack_frame} B")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--only", choices=("nvrtc", "nvcc"))
    ap.add_argument("--allow-missing", action="store_true",
                    help="report a gate whose tool is missing as skipped instead of failed")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--cubin-cache", type=Path, default=CUBIN_CACHE,
                    help="where nvcc builds are kept by content for scripts/kernel_report.py "
                         "(default %(default)s)")
    ap.add_argument("--no-cache", action="store_true",
                    help="compile every nvcc gate afresh (and store nothing)")
    args = ap.parse_args(argv)
    files = [p.resolve() for p in args.files] or sorted(CUDA_DIR.glob("*.cu"))
    root = toolkit_root()
    libnvrtc = find_libnvrtc()
    jobs = []
    failed = False

    def missing(what: str) -> None:
        nonlocal failed
        print(f"{'SKIP' if args.allow_missing else 'FAIL'} {what} not found")
        failed |= not args.allow_missing

    if args.only in (None, "nvrtc"):
        if libnvrtc is None:
            missing("libnvrtc (pip install nvidia-cuda-nvrtc)")
        else:
            nvrtc = Nvrtc(libnvrtc)
            inc = root / "include" if root else None
            jobs += [(nvrtc_gate, (nvrtc, f, a, inc)) for f in files for a in archs_for(f)]
    if args.only in (None, "nvcc"):
        if root is None:
            missing("nvcc (set CUDA_HOME)")
        else:
            nvcc = root / "bin" / "nvcc"
            cache = None if args.no_cache else args.cubin_cache
            jobs += [(nvcc_gate, (nvcc, f, a, cache)) for f in files for a in archs_for(f)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda job: job[0](*job[1]), jobs))
    for res in results:
        print(f"{'PASS' if res.ok else 'FAIL'} {res.name}")
        for line in res.lines:
            print(f"    {line}")
        failed |= not res.ok
    print(f"compile gates: {sum(r.ok for r in results)}/{len(results)} passed"
          + (" (with failures)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
