"""Where paged-run keeps files between runs: the cache root, the converted-model cache and the
CPU kernel harness's build cache
and the NVRTC cubin cache. Every path under the cache root is made here, nowhere else.

The root follows the XDG base-directory convention every Linux tool uses:
`$XDG_CACHE_HOME/pagedrun`, or `~/.cache/pagedrun` when XDG_CACHE_HOME is unset or empty.
Nothing here creates directories; the writers do, when they first write.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_NAME = "pagedrun"
MODELS_DIR_NAME = "models"
SIM_DIR_NAME = "sim"
NVRTC_DIR_NAME = "nvrtc"


def cache_root() -> Path:
    """paged-run's cache directory (not created)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / CACHE_DIR_NAME


def models_cache_dir() -> Path:
    """Directory holding models converted from GGUF, one sub-directory each (not created)."""
    return cache_root() / MODELS_DIR_NAME


def sim_cache_dir() -> Path:
    """Directory of the CPU kernel harness's compiled modules (runtime/kernels/sim_module.py;
    not created)."""
    return cache_root() / SIM_DIR_NAME


def nvrtc_cache_dir() -> Path:
    """Directory of the arch-specific (sm_90a) cubins NVRTC builds when no prebuilt fatbin
    matches (runtime/kernels/loader.py; not created)."""
    return cache_root() / NVRTC_DIR_NAME
