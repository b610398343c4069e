"""What this machine offers the device backends, for `paged-run env`: CuPy / CUDA / NVRTC / NCCL
versions, the visible GPUs, and the prebuilt kernel fatbins. The server's CLI reads it through
this module so that only the runtime names cupy and the kernel loader.
"""
from __future__ import annotations


def cuda_report() -> list[tuple[str, str]]:
    """(name, value) lines: CuPy, CUDA runtime and driver, each device, NVRTC, NCCL. Never
    raises: `paged-run env` exists for broken setups."""
    try:
        import cupy
    except Exception as exc:
        return [("cupy", f"not importable ({type(exc).__name__}: {exc})"),
                ("devices", "none (no cupy)")]
    lines = [("cupy", cupy.__version__)]
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
        lines.append(("cuda runtime", str(runtime.runtimeGetVersion())))
        lines.append(("cuda driver", str(runtime.driverGetVersion())))
        for index in range(count):
            props = runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            memory_gib = props["totalGlobalMem"] / 2**30
            lines.append((f"device {index}",
                          f"{name}, sm_{props['major']}{props['minor']}, {memory_gib:.1f} GiB"))
        if count == 0:
            lines.append(("devices", "none"))
    except Exception as exc:
        lines.append(("devices", f"none ({type(exc).__name__}: {exc})"))
    try:
        from cupy.cuda import nvrtc

        lines.append(("nvrtc", ".".join(map(str, nvrtc.getVersion()))))
    except Exception as exc:
        lines.append(("nvrtc", f"unavailable ({type(exc).__name__})"))
    try:
        from cupy.cuda import nccl

        lines.append(("nccl", str(nccl.get_version()) if nccl.available else "unavailable"))
    except Exception as exc:
        lines.append(("nccl", f"unavailable ({type(exc).__name__})"))
    return lines


def prebuilt_report() -> str:
    """Fatbins built by CMake (nvcc at install time) that match the installed kernel sources."""
    try:
        from pagedrun.runtime.kernels.prebuilt import prebuilt_summary

        return prebuilt_summary()
    except Exception as exc:  # report, never fail
        return f"unknown ({type(exc).__name__}: {exc})"
