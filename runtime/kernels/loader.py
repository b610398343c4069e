"""load_module: the one place that builds a kernel module, for either backend.

    module = load_module("paged_attention.cu", backend="sim")      # SimModule (CPU harness)
    module = load_module("paged_attention.cu", backend="cuda")     # cupy.RawModule (NVRTC)
    fn = module.get_function("paged_attention_decode_bf16_hd128_bs16")
    fn(grid, block, (args...), shared_mem=nbytes)

Both return objects with the same get_function / launch surface, so launch wrappers in
runtime/kernels/ never branch on the backend. Sources are named relative to cuda/ and
compiled as one translation unit that #includes them, on both paths.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .sim_module import CUDA_DIR, SimModule

BACKENDS = ("sim", "cuda")


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


def load_module(source_names: str | Sequence[str], backend: str = "sim",
                options: Sequence[str] = (), name_expressions: Sequence[str] | None = None):
    names = [source_names] if isinstance(source_names, str) else list(source_names)
    code = _translation_unit(names)
    if backend == "sim":
        return SimModule(code, options=options, name_expressions=name_expressions)
    if backend == "cuda":
        import cupy  # only the GPU path needs it

        opts = (*options, "--std=c++17", f"-I{CUDA_DIR}", *_toolkit_include())
        return cupy.RawModule(code=code, options=opts, name_expressions=name_expressions)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
