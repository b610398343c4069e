"""The CPU instruction-set level the compiled cpu kernels dispatch to (EngineConfig.cpu_isa,
`--cpu-isa`).

Each compiled module (pagedrun.pyx.cpu_gemm: the bf16 / int8 and GGUF GEMMs; cpu_ops: norms,
rotary, decode attention; cpu_decode_step runs both) builds every path for any x86-64 and picks
one per call at run time: "auto" is the fastest the CPU runs. A level caps "auto", as oneDNN's
max CPU ISA does, so one box runs the path another CPU would get:

    amx       AMX tiles where the CPU has them (bf16 GEMM, GGUF AMX-INT8), else as avx512
    avx512    AVX512-BF16 / AVX512-VNNI GEMMs, AVX512F ops (Zen 4, Sapphire Rapids)
    avx2      AVX2 + FMA + F16C (Zen 2/3, Haswell and later): what most x86-64 CPUs run
    portable  the plain C++ reference

"auto" caps nothing. The cap is process-wide (the modules are): make_backend applies a cpu
engine's EngineConfig.cpu_isa, never above the process ceiling that `set_ceiling` sets (the test
suite's `--cpu-isa` option, so every engine a test builds runs the capped path). A level above
the CPU's runs the CPU's best.
"""
from __future__ import annotations

import platform

from pagedrun.runtime.engine_config import CPU_ISAS


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detected_isa() -> str:
    """The highest level this CPU runs (and this process may use: AMX needs the kernel's
    permission)."""
    from pagedrun.pyx import cpu_gemm, cpu_ops

    if cpu_gemm.has_amx() or cpu_gemm.has_amx_int8():
        return "amx"
    if cpu_gemm.has_avx512vnni() or cpu_gemm.has_avx512bf16() or cpu_ops.has_avx512f():
        return "avx512"
    if cpu_gemm.has_avx2_fma():
        return "avx2"
    return "portable"


_ceiling = "auto"


def _check(isa: str) -> None:
    if isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {CPU_ISAS}, got {isa!r}")


def lower(a: str, b: str) -> str:
    """The lower of two levels ("auto" is the highest)."""
    _check(a)
    _check(b)
    return a if CPU_ISAS.index(a) >= CPU_ISAS.index(b) else b


def set_ceiling(isa: str) -> None:
    """The highest level any later `apply` may set in this process (tests, benchmarks), applied
    now."""
    global _ceiling
    _check(isa)
    _ceiling = isa
    apply("auto")


def apply(isa: str) -> str:
    """Cap every compiled module's "auto" at `isa` (CPU_ISAS), or at the process ceiling if that
    is lower. Returns the level applied."""
    level = lower(isa, _ceiling)
    from pagedrun.pyx import cpu_gemm, cpu_ops

    cpu_gemm.set_isa_cap(level)
    cpu_ops.set_isa_cap(level)
    return level


def paths() -> dict[str, str]:
    """The path "auto" runs now in each module: {"gemm", "gguf", "ops"}."""
    from pagedrun.pyx import cpu_gemm, cpu_ops

    gemm, gguf = cpu_gemm.auto_paths()
    return {"gemm": gemm, "gguf": gguf, "ops": cpu_ops.auto_path()}


def describe(isa: str = "auto") -> str:
    """One line for the start-up log: the CPU, its level, the cap and the paths chosen."""
    p = paths()
    level = lower(isa, _ceiling)
    cap = "" if level == "auto" else f", capped at {level} (--cpu-isa)"
    return (f"cpu kernels: {cpu_name()}, {detected_isa()}{cap}: bf16/int8 GEMM {p['gemm']}, "
            f"GGUF GEMM {p['gguf']}, ops {p['ops']}")
