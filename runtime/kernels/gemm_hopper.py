"""Launch wrapper of the Hopper GEMM (cuda/gemm_hopper.cu): TMA descriptors, eligibility, launch.

    module = load_module("gemm_hopper.cu", backend="sim")     # or "cuda" (an sm_90 device)
    if hopper_eligible(M, N, K, "bf16", "nk", arch):          # arch: device_arch() on a GPU
        out = gemm_hopper(module, a, b, bias=bias, residual=residual)   # a @ b.T + bias + res

a: [M, K], b: [N, K] (the "nk" HF weight layout), both contiguous, one dtype (float16, or uint16
holding bf16 bits), starting on a 16-byte boundary; bias [N] a's dtype; residual [M, N] in the
output dtype (may be out itself); out [M, N] in a's dtype or float32 (out_dtype=np.float32).
Arrays are numpy under the CPU harness and cupy on a GPU. TMA reads rows through descriptors
built here (runtime/kernels/tma.py) and passed by value in the launch's parameters (no device
copy: the GEMM runs inside CUDA graph capture too): a row stride must be a multiple of 16
bytes, so K % 8 == 0 (K = 64, 72, 192 are eligible; 65, 100 are not). Rows and K values past
the matrices arrive as zeros, so any M >= 1 and N >= 1 run.

On a GPU the kernel runs only with the launch register count its setmaxnreg hand-over is
planned for (HOPPER_LAUNCH_REGS): hopper_kernel checks the loaded function once and refuses it,
with a log line, otherwise; gemm() then takes the mma.sync GEMM.
"""
from __future__ import annotations

import logging

import numpy as np

from .gemm_plan import SKINNY_MAX_M
from .kernel_args import (UnsupportedKernelShape, array_module, ceil_div, check_gemm_operands,
                          dtype_suffix, nullable, require, require_aligned, require_pair_stores)
from .tma import ROW_STRIDE_ALIGN, cuda_descriptor, kernel_param, sim_descriptor

log = logging.getLogger("pagedrun.kernels")

# cuda/gemm_hopper.cu's constants (gemm_hopper::k*).
HOPPER_THREADS = 384
HOPPER_TILE_M = 128
HOPPER_TILE_N = 256
HOPPER_TILE_K = 64                # one 128-byte swizzled row of 16-bit values
HOPPER_STAGES = 4
HOPPER_SWIZZLE_BYTES = 128
SWIZZLE_ALIGN_BYTES = 1024        # the kernel aligns its tiles up to the swizzle period
HOPPER_SMEM_BYTES = (HOPPER_STAGES * (HOPPER_TILE_M + HOPPER_TILE_N) * HOPPER_TILE_K * 2
                     + SWIZZLE_ALIGN_BYTES)   # 197,632
HOPPER_ARCH = 90                  # compute capability the sm_90a cubin runs on (exactly)
HOPPER_DTYPES = ("f16", "bf16")
ELEMENT_BYTES = 2
# The skinny GEMM (cuda/gemm_skinny.cu) serves M <= SKINNY_MAX_M better than a 128-row tile.
HOPPER_MIN_M = SKINNY_MAX_M + 1

# The register hand-over (cuda/gemm_hopper.cu): the producer warpgroup drops to 40 registers
# per thread (setmaxnreg.dec), the two consumer warpgroups rise to 232 (setmaxnreg.inc).
# setmaxnreg only moves registers inside the CTA's launch-time allocation: .inc waits until
# the registers it asks for are free, so the launch must allocate exactly
# 128 x 40 + 256 x 232 = 64,512 = 384 x 168 (what __launch_bounds__(384, 1) gives ptxas: the
# 65,536-register file / 384, rounded down to 8). With fewer (another compiler, an
# -maxrregcount), the consumers wait forever for registers nobody frees: a hang, not an error.
HOPPER_WARPGROUP_THREADS = 128
HOPPER_PRODUCER_REGS = 40
HOPPER_CONSUMER_REGS = 232
HOPPER_LAUNCH_REGS = 168
assert (HOPPER_THREADS * HOPPER_LAUNCH_REGS == HOPPER_WARPGROUP_THREADS * HOPPER_PRODUCER_REGS
        + (HOPPER_THREADS - HOPPER_WARPGROUP_THREADS) * HOPPER_CONSUMER_REGS)


def hopper_eligible(M: int, N: int, K: int, dtype: str, layout: str, arch: int | None) -> bool:
    """Whether the Hopper GEMM serves this call: an sm_90 device (arch = major * 10 + minor,
    e.g. loader.device_arch(); None under the harness: never eligible, the tests call
    gemm_hopper directly), f16 / bf16, the "nk" layout, M past the skinny kernel's range, and
    TMA's 16-byte row strides (K % 8 == 0). Base alignment is the caller's check (vec16_aligned
    in runtime/kernels/gemm.py); gemm_hopper refuses misaligned arrays."""
    return (arch == HOPPER_ARCH and dtype in HOPPER_DTYPES and layout == "nk"
            and M >= HOPPER_MIN_M and N >= 1 and K >= 1
            and (K * ELEMENT_BYTES) % ROW_STRIDE_ALIGN == 0)


def gemm_hopper_grid(M: int, N: int) -> int:
    """CTAs of the 1-D grid: one per 128 x 256 output tile (the kernel orders them in groups)."""
    return ceil_div(M, HOPPER_TILE_M) * ceil_div(N, HOPPER_TILE_N)


def hopper_kernel_name(suffix: str, out_suffix: str) -> str:
    return f"gemm_hopper_{suffix}_nk_o{out_suffix}"


def registers_as_planned(kernel, name: str) -> bool:
    """Whether a loaded Hopper GEMM function got HOPPER_LAUNCH_REGS registers per thread
    (CuPy's RawKernel.num_regs: the driver's CU_FUNC_ATTRIBUTE_NUM_REGS); logs a refusal."""
    num_regs = getattr(kernel, "num_regs", None)
    if num_regs == HOPPER_LAUNCH_REGS:
        return True
    log.warning("%s: loaded with %s registers per thread, planned %d (setmaxnreg hands %d to "
                "the producer and %d to the consumers out of 384 x %d; another count would "
                "hang the kernel): not using the Hopper GEMM, the mma.sync GEMM serves instead",
                name, num_regs, HOPPER_LAUNCH_REGS, HOPPER_PRODUCER_REGS, HOPPER_CONSUMER_REGS,
                HOPPER_LAUNCH_REGS)
    return False


# (id(module), kernel name) -> (module, its checked function or None). The module is held so
# that its id cannot be reused; modules live for the process anyway.
_CHECKED: dict[tuple[int, str], tuple[object, object]] = {}


def hopper_kernel(module, suffix: str, out_suffix: str):
    """The module's Hopper GEMM function for these dtypes, fetched and checked once (GPU
    modules: the harness has no register file), or None where it must not run: the module lacks
    it (the cuda backend loads gemm_hopper.cu only beside the other GEMMs), or its register
    count is not the planned one (registers_as_planned logs why)."""
    name = hopper_kernel_name(suffix, out_suffix)
    hit = _CHECKED.get((id(module), name))
    if hit is not None and hit[0] is module:
        return hit[1]
    try:
        kernel = module.get_function(name)
    except (AttributeError, KeyError, RuntimeError):  # CuPy: CUDADriverError (NOT_FOUND)
        kernel = None
    if kernel is not None and not registers_as_planned(kernel, name):
        kernel = None
    _CHECKED[(id(module), name)] = (module, kernel)
    return kernel


def _descriptor(x, xp, box_rows: int) -> np.ndarray:
    """The TMA descriptor of x as a by-value kernel argument (tma.kernel_param): host bytes
    the launch copies into the kernel's parameters, nothing uploaded."""
    build = sim_descriptor if xp is np else cuda_descriptor
    return kernel_param(build(x, box_rows, HOPPER_TILE_K, HOPPER_SWIZZLE_BYTES))


def gemm_hopper(module, a, b, *, bias=None, residual=None, out=None, out_dtype=None):
    """out = a @ b.T (+ bias) (+ residual) on cuda/gemm_hopper.cu. Returns out [M, N]."""
    xp = array_module(a)
    suffix = dtype_suffix(a)
    if suffix not in HOPPER_DTYPES:
        raise UnsupportedKernelShape(f"the Hopper GEMM takes f16 / bf16, got {a.dtype}")
    M, N, K, out = check_gemm_operands(a, b, "nk", bias, residual, out, out_dtype)
    if (K * ELEMENT_BYTES) % ROW_STRIDE_ALIGN:
        raise UnsupportedKernelShape(f"the Hopper GEMM needs K % 8 == 0 (TMA's 16-byte row "
                                     f"strides), got K={K}")
    require_aligned(ROW_STRIDE_ALIGN, "the Hopper GEMM reads a and b through TMA", a=a, b=b)
    require_pair_stores(out, N)
    if M == 0 or N == 0:
        return out
    out_suffix = dtype_suffix(out)
    if xp is np:
        kernel = module.get_function(hopper_kernel_name(suffix, out_suffix))
    else:
        kernel = hopper_kernel(module, suffix, out_suffix)
        require(kernel is not None,
                lambda: f"{hopper_kernel_name(suffix, out_suffix)} is missing from the module or "
                        f"was loaded with other than {HOPPER_LAUNCH_REGS} registers per thread "
                        f"(the log says which): it would hang")
    desc_a = _descriptor(a, xp, HOPPER_TILE_M)
    desc_b = _descriptor(b, xp, HOPPER_TILE_N)
    kernel.max_dynamic_shared_size_bytes = HOPPER_SMEM_BYTES
    # The descriptors hold a's and b's addresses (the caller keeps a and b alive; a captured
    # graph replays them, so its inputs stay where they were captured, as every kernel's
    # pointers do). Their bytes go into the launch's parameter buffer.
    kernel((gemm_hopper_grid(M, N),), (HOPPER_THREADS,),
           (out, desc_a, desc_b, nullable(bias, xp), nullable(residual, xp),
            np.int32(M), np.int32(N), np.int32(K)), shared_mem=HOPPER_SMEM_BYTES)
    return out


__all__ = ["HOPPER_LAUNCH_REGS", "HOPPER_SMEM_BYTES", "gemm_hopper", "gemm_hopper_grid",
           "hopper_eligible", "hopper_kernel", "hopper_kernel_name", "registers_as_planned"]
