"""Prebuilt fatbins: their manifests, and the choice between a fatbin and NVRTC for one source.

The CMake build (option PAGEDRUN_BUILD_FATBINS, see CMakeLists.txt) compiles each cuda/<name>.cu
with nvcc into pagedrun/cuda/prebuilt/<name>.fatbin -- cubins for sm_80 and sm_90a plus
compute_90 PTX -- and writes <name>.json next to it, with this module run as a script:

    {"source": "gemm.cu", "source_sha256": "...", "nvcc_version": "13.0.88",
     "cubins": ["sm_80", "sm_90a"], "ptx": ["compute_90"], "options": [],
     "nvcc_flags": ["-std=c++17", ...]}

`select_module_source` is the pure decision the loader makes per source file:

    select_module_source("gemm.cu", device_arch=90, prebuilt_dir=PREBUILT_DIR)
        -> ("prebuilt", Path(".../gemm.fatbin")) | ("nvrtc", "why not")

A fatbin is used only when its manifest's source hash equals the hash of the installed source
(the .cu and every .cuh under cuda/, since any included header changes the code), its options
are the caller's (prebuilt fatbins are built without extra -D options), and the device is
covered: a cubin of the same major architecture and a minor at most the device's (an `a`
cubin, like sm_90a, runs on exactly its own architecture), or PTX of a compute capability at
most the device's (the driver JIT-compiles it once and keeps it in its own cache).

This file imports only the standard library: the build runs it before pagedrun is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
PREBUILT_DIR = CUDA_DIR / "prebuilt"
FATBIN_SUFFIX = ".fatbin"
MANIFEST_SUFFIX = ".json"
# Headers a kernel source may include (directly or through common.cuh / ptx.cuh).
_HEADER_GLOB = "**/*.cuh"
_ARCH_RE = re.compile(r"^(sm|compute)_(\d)(\d+)(a?)$")


def source_sha256(name: str, cuda_dir: Path = CUDA_DIR) -> str:
    """sha256 over cuda/<name> and every .cuh under cuda/ (sorted by relative path)."""
    cuda_dir = Path(cuda_dir)
    files = [cuda_dir / name, *sorted(p for p in cuda_dir.glob(_HEADER_GLOB) if p.is_file())]
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(cuda_dir).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _parse_arch(arch: str) -> tuple[str, int, int, bool]:
    """'sm_90a' -> ('sm', 9, 0, True)."""
    m = _ARCH_RE.match(arch)
    if m is None:
        raise ValueError(f"not an architecture name: {arch!r}")
    return m.group(1), int(m.group(2)), int(m.group(3)), bool(m.group(4))


def covers(arch: str, device_arch: int) -> bool:
    """Whether code for `arch` ('sm_80', 'sm_90a', 'compute_90') runs on a device of compute
    capability `device_arch` (major * 10 + minor, e.g. 86)."""
    kind, major, minor, specific = _parse_arch(arch)
    dev_major, dev_minor = divmod(int(device_arch), 10)
    if kind == "compute":  # PTX: JIT-compiled for this or any later architecture
        return (dev_major, dev_minor) >= (major, minor)
    if specific:           # sm_90a: that exact architecture only
        return (dev_major, dev_minor) == (major, minor)
    return dev_major == major and dev_minor >= minor


def manifest_path(name: str, prebuilt_dir: Path = PREBUILT_DIR) -> Path:
    return Path(prebuilt_dir) / (Path(name).stem + MANIFEST_SUFFIX)


def fatbin_path(name: str, prebuilt_dir: Path = PREBUILT_DIR) -> Path:
    return Path(prebuilt_dir) / (Path(name).stem + FATBIN_SUFFIX)


def select_module_source(name: str, device_arch: int, prebuilt_dir: Path = PREBUILT_DIR,
                         options: Sequence[str] = (), cuda_dir: Path = CUDA_DIR
                         ) -> tuple[str, Path | str]:
    """('prebuilt', fatbin path) when the fatbin of cuda/<name> may be loaded on a device of
    compute capability `device_arch`; else ('nvrtc', the reason)."""
    fatbin, manifest = fatbin_path(name, prebuilt_dir), manifest_path(name, prebuilt_dir)
    if not fatbin.is_file() or not manifest.is_file():
        return "nvrtc", f"no prebuilt fatbin for {name} in {prebuilt_dir}"
    try:
        info = json.loads(manifest.read_text())
        want_hash = info["source_sha256"]
        archs = [*info.get("cubins", []), *info.get("ptx", [])]
        built_options = tuple(info.get("options", []))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return "nvrtc", f"unreadable manifest {manifest.name}: {exc}"
    if info.get("source") != name:
        return "nvrtc", f"manifest {manifest.name} is for {info.get('source')!r}, not {name}"
    try:
        have_hash = source_sha256(name, cuda_dir)
    except OSError as exc:
        return "nvrtc", f"cannot hash source {name}: {exc}"
    if have_hash != want_hash:
        return "nvrtc", f"stale fatbin for {name}: built from another source (sha256 differs)"
    if tuple(options) != built_options:
        return "nvrtc", (f"options {list(options)} differ from the fatbin's "
                         f"{list(built_options)}")
    try:
        covered = [a for a in archs if covers(a, device_arch)]
    except ValueError as exc:
        return "nvrtc", f"manifest {manifest.name}: {exc}"
    if not covered:
        return "nvrtc", f"fatbin for {name} has {archs}, none runs on sm_{device_arch}"
    return "prebuilt", fatbin


def prebuilt_summary(prebuilt_dir: Path = PREBUILT_DIR, cuda_dir: Path = CUDA_DIR) -> str:
    """One line for `paged-run env`: how many sources have a current fatbin, and for what."""
    sources = sorted(p.name for p in Path(cuda_dir).glob("*.cu"))
    current, archs = 0, set()
    for name in sources:
        manifest = manifest_path(name, prebuilt_dir)
        if not manifest.is_file():
            continue
        try:
            info = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if info.get("source_sha256") == source_sha256(name, cuda_dir):
            current += 1
            archs.update([*info.get("cubins", []), *info.get("ptx", [])])
    if current == 0:
        return "none (kernels compile through NVRTC on first use, then come from the cache)"
    return f"{current}/{len(sources)} sources ({', '.join(sorted(archs))})"


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def write_manifest(out: Path, name: str, cuda_dir: Path, nvcc: str, cubins: Sequence[str],
                   ptx: Sequence[str], nvcc_flags: Sequence[str]) -> dict:
    info = {"source": name, "source_sha256": source_sha256(name, cuda_dir),
            "nvcc_version": _nvcc_version(nvcc), "cubins": list(cubins), "ptx": list(ptx),
            "options": [], "nvcc_flags": list(nvcc_flags)}
    Path(out).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    """Build-time entry point: `python prebuilt.py --source gemm.cu --cuda-dir cuda --nvcc
    /usr/local/cuda/bin/nvcc --cubins sm_80 sm_90a --ptx compute_90 --nvcc-flags="-std=c++17"
    --out gemm.json`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True)
    parser.add_argument("--cuda-dir", required=True, type=Path)
    parser.add_argument("--nvcc", required=True)
    parser.add_argument("--cubins", nargs="*", default=[])
    parser.add_argument("--ptx", nargs="*", default=[])
    parser.add_argument("--nvcc-flags", default="", help="space-separated, as one argument")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    write_manifest(args.out, args.source, args.cuda_dir, args.nvcc, args.cubins, args.ptx,
                   args.nvcc_flags.split())
    return 0


if __name__ == "__main__":
    sys.exit(main())
