"""load_module: the one place that builds a kernel module, for either backend.

    module = load_module("paged_attention_decode.cu", backend="sim")   # SimModule (CPU harness)
    module = load_module("paged_attention_decode.cu", backend="cuda")  # RawModule / fatbins
    fn = module.get_function("paged_attention_decode_bf16_d128_g1")
    fn(grid, block, (args...), shared_mem=nbytes)

Both return objects with the same get_function / launch surface, so launch wrappers in
runtime/kernels/ never branch on the backend. Sources are named relative to cuda/ and
compiled as one translation unit that #includes them, on both paths.

On cuda, each source of the module is loaded from its prebuilt fatbin (pagedrun/cuda/prebuilt,
built by CMake; runtime/kernels/prebuilt.py decides whether it matches the installed source,
the options and the device) when every source has one; otherwise the translation unit goes
through NVRTC. NVRTC results are kept by CuPy's on-disk kernel cache (~/.cupy/kernel_cache),
which keys on the code string, not on what it #includes: the code therefore starts with a
comment carrying the hash of every kernel source, so an edited header is never served stale
and an unchanged one is never recompiled at start-up.

CuPy's NVRTC path compiles for sm_XX and takes no other -arch, but the Hopper kernels
(wgmma, setmaxnreg: cuda/gemm_hopper.cu) exist only in the arch-specific sm_90a target, which
runs on exactly compute capability 9.0. On such a device the loader therefore calls NVRTC
itself for sm_90a (as the prebuilt fatbins carry an sm_90a cubin) and keeps the cubin in
runtime/paths.nvrtc_cache_dir(), keyed by the code, the options and the NVRTC version.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Sequence

from .. import paths
from . import prebuilt
from .sim_module import CUDA_DIR, SimModule

log = logging.getLogger("pagedrun.kernels")

BACKENDS = ("sim", "cuda")
# Compute capabilities whose NVRTC build targets the arch-specific cubin (sm_90a).
ARCH_SPECIFIC = {90: "sm_90a"}


def _translation_unit(source_names: Sequence[str]) -> str:
    for name in source_names:
        if not (CUDA_DIR / name).is_file():
            raise FileNotFoundError(f"no kernel source cuda/{name}")
    return "".join(f'#include "{name}"\n' for name in source_names)


def _toolkit_include() -> list[str]:
    """NVRTC needs the toolkit headers (cuda_bf16.h) on its include path."""
    root = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    inc = Path(root) / "include"
    return [f"-I{inc}"] if inc.is_dir() else []


def sources_digest(cuda_dir: Path = CUDA_DIR) -> str:
    """sha256 of every kernel source and header under cuda/ (what a translation unit may
    include), for the NVRTC code string: CuPy's cache key sees the code, not its includes."""
    h = hashlib.sha256()
    root = Path(cuda_dir)
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".h")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class FatbinModules:
    """Several prebuilt RawModules behind one get_function (a module of several sources)."""

    def __init__(self, modules) -> None:
        self.modules = list(modules)

    def get_function(self, name: str):
        errors = []
        for module in self.modules:
            try:
                return module.get_function(name)
            except Exception as exc:  # noqa: BLE001 -- CuPy raises CUDADriverError (NOT_FOUND)
                errors.append(exc)
        raise AttributeError(f"no kernel {name!r} in the prebuilt fatbins ({errors[-1]})")

    def compile(self, log_stream=None) -> None:
        """Load every fatbin now (cupy.RawModule.compile's meaning for a path module)."""
        for module in self.modules:
            module.compile(log_stream)


def device_arch(cupy=None) -> int:
    """Compute capability of the current CuPy device, as major * 10 + minor (e.g. 90)."""
    if cupy is None:
        import cupy

    return int(cupy.cuda.Device().compute_capability)


def _load_cuda(names: list[str], options: Sequence[str], name_expressions, cupy=None):
    if cupy is None:
        import cupy  # only the GPU path needs it

    arch = device_arch(cupy)
    choices = [prebuilt.select_module_source(n, arch, prebuilt.PREBUILT_DIR, options, CUDA_DIR)
               for n in names]
    if all(kind == "prebuilt" for kind, _ in choices):
        log.info("kernels %s: prebuilt fatbins (sm_%d)", ", ".join(names), arch)
        modules = [cupy.RawModule(path=str(path)) for _, path in choices]
        return modules[0] if len(modules) == 1 else FatbinModules(modules)
    reasons = "; ".join(str(why) for kind, why in choices if kind == "nvrtc")
    log.info("kernels %s: NVRTC (cached on disk by CuPy): %s", ", ".join(names), reasons)
    digest = sources_digest(CUDA_DIR)
    code = f"// pagedrun kernel sources sha256 {digest}\n" + _translation_unit(names)
    opts = (*options, "--std=c++17", f"-I{CUDA_DIR}", *_toolkit_include())
    if arch in ARCH_SPECIFIC and name_expressions is None:
        return cupy.RawModule(path=str(_arch_specific_cubin(code, opts, ARCH_SPECIFIC[arch])))
    return cupy.RawModule(code=code, options=opts, name_expressions=name_expressions)


def _arch_specific_cubin(code: str, options: Sequence[str], target: str) -> Path:
    """NVRTC `code` to a cubin for `target` (e.g. sm_90a), cached on disk; returns its path."""
    from cupy_backends.cuda.libs import nvrtc

    version = ".".join(map(str, nvrtc.getVersion()))
    key = hashlib.sha256("\0".join([code, *options, target, version]).encode()).hexdigest()
    path = paths.nvrtc_cache_dir() / f"{key[:32]}_{target}.cubin"
    if path.is_file():
        return path
    prog = nvrtc.createProgram(code, "pagedrun_tu.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, [*options, f"--gpu-architecture={target}"])
        except Exception as exc:  # noqa: BLE001 -- NVRTCError; the log says what failed
            raise RuntimeError(f"NVRTC ({target}) failed:\n{nvrtc.getProgramLog(prog)}") from exc
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")  # renamed: readers never see half
    partial.write_bytes(cubin)
    os.replace(partial, path)
    return path


def load_module(source_names: str | Sequence[str], backend: str = "sim",
                options: Sequence[str] = (), name_expressions: Sequence[str] | None = None,
                cupy=None):
    """The module of cuda/<source_names> for `backend`; cupy: the module the cuda path loads
    through (None: import it; tests pass their fake of CuPy)."""
    names = [source_names] if isinstance(source_names, str) else list(source_names)
    code = _translation_unit(names)
    if backend == "sim":
        return SimModule(code, options=options, name_expressions=name_expressions)
    if backend == "cuda":
        return _load_cuda(names, options, name_expressions, cupy)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
