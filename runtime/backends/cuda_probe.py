"""cuda_available: whether CuPy imports and sees a GPU, without importing the cuda backend (and
with it the sim backend and the kernel loaders: ~0.15 s of a cpu engine's start for
`--device auto`, the default, on a machine without CuPy)."""
from __future__ import annotations


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no driver / no device: CuPy raises its runtime error
        return False
