"""Launch wrapper of the GEMM kernels (cuda/gemm.cu, cuda/gemm_skinny.cu), executing a plan.

    module = load_module(["gemm.cu", "gemm_skinny.cu"], backend="sim")   # or "cuda"
    out = gemm(module, a, b, b_layout="nk", bias=bias)                   # a @ b.T + bias
    out = linear(module, x, weight, bias)                                # numpy_ops.linear

a: [M, K]; b: [N, K] ("nk", the HF weight layout) or [K, N] ("kn", pre-transposed); bias [N];
residual [M, N] (added in the epilogue); all contiguous, one dtype (float32, float16, or uint16
holding bf16 bits). out: [M, N] in a's dtype, or float32 (out_dtype=np.float32, e.g. logits).
Arrays are numpy under the CPU harness and cupy on a GPU. The plan (runtime/kernels/gemm_plan.py)
picks the skinny or the tensor-core kernel; shapes no kernel serves raise UnsupportedKernelShape.
On a compute capability 9.0 GPU, with gemm_hopper.cu in the module, the shapes it serves
(gemm_hopper.hopper_eligible: f16 / bf16, "nk", M > 64, K % 8 == 0) run on the Hopper GEMM,
inside CUDA graph capture too (its TMA descriptors travel in the launch's parameters), unless
its kernel was loaded with another register count than planned (gemm_hopper.hopper_kernel logs
it once; the mma.sync GEMM serves instead).
"""
from __future__ import annotations

import numpy as np

from .gemm_plan import (SKINNY, SKINNY_ROWS_PER_WARP, SKINNY_TC, SKINNY_TC_BK, SKINNY_TC_BM,
                        SKINNY_TC_BN, SKINNY_TC_STAGES, SKINNY_TC_THREADS, SKINNY_THREADS,
                        SKINNY_WARPS, TC_BK,
                        TC_STAGES, TC_THREADS, TC_TILE, TENSOR_CORE, GemmPlan, plan_gemm,
                        tc_aligned)
from .gemm_hopper import HOPPER_ARCH, gemm_hopper, hopper_eligible, hopper_kernel
from .kernel_args import (VEC16_BYTES, array_module, ceil_div,  # noqa: F401 (VEC16_BYTES)
                          check_gemm_operands, device_arch, device_num_sms, dtype_suffix,
                          nullable, opt_in_smem, require, require_pair_stores, vec16_aligned)

SKINNY_SMEM_BYTES_PER_ROW = 512  # one k-tile of a row: 32 lanes x 16 bytes
# gemm_skinny_tc_*: SKINNY_TC_STAGES x (weight + activation rows) x SKINNY_TC_BK 16-bit elements
# = 49,152 bytes (the 48 KiB default limit).
SKINNY_TC_SMEM_BYTES = SKINNY_TC_STAGES * (SKINNY_TC_BN + SKINNY_TC_BM) * SKINNY_TC_BK * 2


def gemm_smem_bytes(dtype_name: str) -> int:
    """Dynamic shared memory of a tensor-core CTA (the fp32 path uses static memory only)."""
    if dtype_name == "f32":
        return 0
    tile_m, tile_n = TC_TILE[dtype_name]
    return TC_STAGES * (tile_m + tile_n) * TC_BK * 2


def _reduce_splits(module, suffix: str, out, partial, bias_arg, residual_arg):
    """out = sum over splits of partial [splits, M, N] f32 (+ bias) (+ residual), by
    gemm_splitk_reduce (cuda/gemm_skinny.cu) for both split-K paths: bias and residual are
    applied once (residual may alias out: each element is read before it is written).
    suffix: the inputs' dtype (bias is in it)."""
    splits, M, N = partial.shape
    reduce = module.get_function(f"gemm_splitk_reduce_{suffix}_o{dtype_suffix(out)}")
    reduce((ceil_div(M * N, SKINNY_THREADS),), (SKINNY_THREADS,),
           (out, partial, bias_arg, residual_arg, np.int32(M), np.int32(N), np.int32(splits)))
    return out


def gemm(module, a, b, *, b_layout: str = "nk", bias=None, residual=None, out=None,
         out_dtype=None, plan: GemmPlan | None = None, num_sms: int | None = None):
    """out = a @ B (+ bias) (+ residual); B = b.T for "nk", b for "kn". Returns out [M, N]."""
    xp = array_module(a)
    suffix = dtype_suffix(a)
    M, N, K, out = check_gemm_operands(a, b, b_layout, bias, residual, out, out_dtype)
    out_suffix = dtype_suffix(out)
    require(K > 0, "K must be >= 1 (an empty reduction has no kernel)")
    if M == 0 or N == 0:
        return out
    base_aligned = vec16_aligned(a, b)  # else the unaligned tensor-core instantiation
    # Every path but the skinny one stores output pairs (gemm_epilogue.cuh); a misaligned out is
    # refused for all, as no caller makes one (it takes a view at an odd element offset).
    require_pair_stores(out, N)
    # Shape first, then the device, then the kernel (fetched and register-checked once per
    # module: only on an sm_90 device, where the sm_90a cubin loads).
    if (plan is None and xp is not np and base_aligned
            and hopper_eligible(M, N, K, suffix, b_layout, HOPPER_ARCH)
            and device_arch(xp) == HOPPER_ARCH
            and hopper_kernel(module, suffix, out_suffix) is not None):
        return gemm_hopper(module, a, b, bias=bias, residual=residual, out=out,
                           out_dtype=out.dtype)
    if plan is None:
        plan = plan_gemm(M, N, K, dtype_name=suffix, b_layout=b_layout,
                         num_sms=num_sms or device_num_sms(xp))
        if not base_aligned:  # element-wise loads (and the fp32 SIMT path) take any address
            plan = plan._replace(kind=TENSOR_CORE, m_tile=TC_TILE[suffix][0], num_splits=1,
                                 k_split=K, aligned=False)
    require(base_aligned or (plan.kind not in (SKINNY, SKINNY_TC)
                             and (suffix == "f32" or not plan.aligned)),
            "a or b does not start on a 16-byte boundary: only the unaligned tensor-core "
            "instantiation can read it")
    scalars = (np.int32(M), np.int32(N), np.int32(K))
    bias_arg, residual_arg = nullable(bias, xp), nullable(residual, xp)
    null = nullable(None, xp)
    if plan.kind in (SKINNY, SKINNY_TC):
        require(b_layout == "nk", "the skinny GEMM reads weights in the 'nk' layout only")
        require(K % (16 // a.dtype.itemsize) == 0,
                lambda: f"the skinny GEMM needs K % {16 // a.dtype.itemsize} == 0, got K={K}")
        if plan.kind == SKINNY_TC:
            require(suffix != "f32", "the tensor-core skinny GEMM takes f16 / bf16 only")
            grid = (ceil_div(N, SKINNY_TC_BN), ceil_div(M, SKINNY_TC_BM), plan.num_splits)
            block, smem = (SKINNY_TC_THREADS,), SKINNY_TC_SMEM_BYTES
            kernel = module.get_function(f"gemm_skinny_tc_{suffix}_o{out_suffix}")
        else:
            rows_per_cta = SKINNY_WARPS * SKINNY_ROWS_PER_WARP[plan.m_tile]
            grid = (ceil_div(N, rows_per_cta), ceil_div(M, plan.m_tile), plan.num_splits)
            block, smem = (SKINNY_THREADS,), plan.m_tile * SKINNY_SMEM_BYTES_PER_ROW
            kernel = module.get_function(f"gemm_skinny_{suffix}_o{out_suffix}_m{plan.m_tile}")
        if plan.num_splits == 1:
            kernel(grid, block, (out, null, a, b, bias_arg, residual_arg, *scalars,
                                 np.int32(plan.k_split)), shared_mem=smem)
            return out
        partial = xp.empty((plan.num_splits, M, N), dtype=np.float32)
        kernel(grid, block, (null, partial, a, b, null, null, *scalars, np.int32(plan.k_split)),
               shared_mem=smem)
        return _reduce_splits(module, suffix, out, partial, bias_arg, residual_arg)
    aligned = tc_aligned(N, K, b_layout)
    require(not plan.aligned or aligned or suffix == "f32",
            lambda: f"an aligned tensor-core plan needs K % 8 == 0 (and N % 8 for 'kn'), got "
                    f"N={N}, K={K}")
    name = f"gemm_{suffix}_{b_layout}_o{out_suffix}"
    if suffix != "f32" and not plan.aligned:
        require(out_suffix == suffix, "unaligned shapes have no fp32-output instantiation")
        name += "_unaligned"
    tile_m, tile_n = TC_TILE[suffix]
    grid = (ceil_div(N, tile_n), ceil_div(M, tile_m))
    smem = gemm_smem_bytes(suffix)
    if plan.num_splits == 1:
        kernel = module.get_function(name)
        opt_in_smem(kernel, smem)
        kernel(grid, (TC_THREADS,), (out, a, b, bias_arg, residual_arg, *scalars),
               shared_mem=smem)
        return out
    require(suffix != "f32" and plan.aligned and plan.k_split % TC_BK == 0,
            lambda: f"a split-K tensor-core plan needs an aligned 16-bit shape and whole "
                    f"{TC_BK}-element k-tiles per split, got {suffix} {plan}")
    partial = xp.empty((plan.num_splits, M, N), dtype=np.float32)
    kernel = module.get_function(f"gemm_{suffix}_{b_layout}_splitk")
    opt_in_smem(kernel, smem)
    kernel((*grid, plan.num_splits), (TC_THREADS,),
           (partial, a, b, *scalars, np.int32(plan.k_split)), shared_mem=smem)
    return _reduce_splits(module, suffix, out, partial, bias_arg, residual_arg)


def linear(module, x, weight, bias=None, *, residual=None, out_dtype=None, num_sms=None):
    """numpy_ops.linear on kernels: x [M, K] @ weight.T (+ bias). weight is the logical HF
    [N, K] matrix; a contiguous one runs as "nk", the transposed view of a contiguous [K, N]
    array (the model's pre-transposed storage) as "kn"."""
    if weight.flags.c_contiguous:
        b, layout = weight, "nk"
    else:
        require(weight.T.flags.c_contiguous,
                lambda: f"weight must be contiguous or the transpose of a contiguous array, "
                        f"strides "
                f"{weight.strides}")
        b, layout = weight.T, "kn"
    return gemm(module, x, b, b_layout=layout, bias=bias, residual=residual,
                out_dtype=out_dtype, num_sms=num_sms)


__all__ = ["gemm", "gemm_smem_bytes", "linear"]
