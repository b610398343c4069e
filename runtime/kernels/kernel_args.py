"""Argument checks and conversions shared by the launch wrappers in runtime/kernels/.

The wrappers receive numpy arrays under the CPU harness and cupy arrays on a GPU; nothing here
branches on the backend except `array_module`. bf16 tensors travel as uint16 arrays of raw
bf16 bits (neither numpy nor cupy has a bfloat16 dtype); `to_bf16_bits` / `from_bf16_bits`
(runtime/weights.py's, the one float32 <-> bf16 conversion) convert at the edges.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from pagedrun.runtime.errors import PagedRunError
# The one float32 <-> bf16 conversion (runtime/weights.py), re-exported for the kernel wrappers.
from pagedrun.runtime.weights import from_bf16_bits, to_bf16_bits  # noqa: F401

# Kernel dtype suffix per array dtype (the `_<dtype>` part of the extern "C" names).
_DTYPE_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
                 np.dtype(np.uint16): "bf16"}

# An fp8 e4m3 KV cache (kv_cache_dtype "fp8"): uint8 codes (cuda/fp8.cuh); its kernels carry
# "_kv_fp8" after the activation dtype in their names.
FP8_KV_DTYPE = np.dtype(np.uint8)

# The CPU harness runs blocks one at a time; this only shapes the launch plans there.
SIM_NUM_SMS = 4


class UnsupportedKernelShape(PagedRunError, ValueError):
    """A launch was asked for a shape, dtype or layout no instantiation serves.

    Raised before anything runs, so an unsupported case is an error, never a wrong answer.
    """


def array_module(x):
    """numpy for numpy arrays, cupy for cupy arrays (imported only then); a device-array
    stand-in names its own module (`pagedrun_array_module`: tests/engine/test_strict_device.py
    runs the cuda backend's code over one that refuses host arrays at every launch)."""
    stand_in = getattr(type(x), "pagedrun_array_module", None)
    if stand_in is not None:
        return stand_in
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


@functools.lru_cache(maxsize=None)
def _cuda_num_sms(xp, device_id: int) -> int:
    """xp: the device's array module (cupy, or a test's fake of it)."""
    return int(xp.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _cuda_arch(xp, device_id: int) -> int:
    return int(xp.cuda.Device(device_id).compute_capability)


def device_arch(xp) -> int | None:
    """Compute capability of the current device as major * 10 + minor (e.g. 90); None under
    the harness. Cached per device, as device_num_sms."""
    if xp is np:
        return None
    return _cuda_arch(xp, xp.cuda.Device().id)


def device_num_sms(xp) -> int:
    """Streaming multiprocessors of the current device (SIM_NUM_SMS under the harness).

    Cached per device: CuPy's Device.attributes queries every attribute, and the GEMM and
    decode-attention wrappers ask on each launch they plan."""
    if xp is np:
        return SIM_NUM_SMS
    return _cuda_num_sms(xp, xp.cuda.Device().id)


def dtype_suffix(x) -> str:
    """'f32' | 'f16' | 'bf16' for a float32 / float16 / uint16 (bf16 bits) array."""
    suffix = _DTYPE_SUFFIX.get(np.dtype(x.dtype))
    if suffix is None:
        raise UnsupportedKernelShape(f"dtype {x.dtype} has no kernel: use float32, float16 or "
                                     "uint16 holding bf16 bits")
    return suffix


def cache_suffix(x, k_cache, v_cache) -> str:
    """The `_<dtype>` part of a cache-typed kernel's name (rotary cache write, attention): x's
    suffix when both caches hold x's dtype, that plus "_kv_fp8" when both are uint8 arrays of
    fp8 e4m3 codes (kv_cache_dtype "fp8"); any other pairing is refused."""
    suffix = dtype_suffix(x)
    cache_dtype = k_cache.dtype  # a numpy dtype for numpy and cupy arrays alike
    require(cache_dtype == v_cache.dtype,
            lambda: f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} dtypes differ")
    if cache_dtype == FP8_KV_DTYPE:
        return suffix + "_kv_fp8"
    require(cache_dtype == x.dtype,
            lambda: f"KV cache dtype {cache_dtype} is neither the activations' ({x.dtype}) nor "
                    "uint8 fp8 e4m3 codes")
    return suffix


def require(cond: bool, message: str | Callable[[], str]) -> None:
    """Raise UnsupportedKernelShape(message) unless cond. Pass a message that formats arrays'
    dtypes or shapes as a lambda: the wrappers check every launch, and formatting a dtype costs
    ~3 us, which across a decode step's ~300 launches was a third of its host time
    (benchmarks/bench_host_overhead.py)."""
    if not cond:
        raise UnsupportedKernelShape(message() if callable(message) else message)


def require_contiguous(name: str, x) -> None:
    require(x.flags.c_contiguous, lambda: f"{name} must be C-contiguous, got strides {x.strides}")


def require_int32(name: str, x, ndim: int) -> None:
    require(np.dtype(x.dtype) == np.int32, lambda: f"{name} must be int32, got {x.dtype}")
    require(x.ndim == ndim, lambda: f"{name} must be {ndim}-D, got shape {x.shape}")
    require_contiguous(name, x)


VEC16_BYTES = 16  # 16-byte loads, stores and cp.async need 16-byte aligned addresses


def data_ptr(x) -> int:
    """The address of x's first element (numpy under the harness, CuPy on a GPU)."""
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def vec16_aligned(*arrays) -> bool:
    """Every array starts on a 16-byte boundary (16-byte loads and cp.async need it; a row
    view of a larger matrix may not)."""
    return all(data_ptr(x) % VEC16_BYTES == 0 for x in arrays)


def require_aligned(alignment: int, access: str, *, rows: bool = True, **arrays) -> None:
    """Raise UnsupportedKernelShape unless every array starts on an `alignment`-byte boundary
    and, with rows (the default), every row does too (each stride but the innermost is a
    multiple of it). A kernel's vector access (16-byte loads, cp.async, 8-byte loads, pair
    stores) traps on a GPU at a misaligned address, and the CPU harness cannot show it: x86
    loads any address. So the wrappers check before launching. `access` names that access for
    the message; an array given as None (an absent optional pointer) is skipped."""
    for name, x in arrays.items():
        if x is None:
            continue
        ptr = data_ptr(x)
        if ptr % alignment or (rows and any(s % alignment for s in x.strides[:-1])):
            raise UnsupportedKernelShape(
                f"{name} (address {ptr:#x}, strides {x.strides}) is not {alignment}-byte "
                f"aligned{' per row' if rows and not ptr % alignment else ''}: {access}")


def require_pair_stores(out, n_cols: int) -> None:
    """cuda/gemm_epilogue.cuh's epilogue stores two adjacent outputs at once when the row width
    n_cols is even (float2 / __half2): out must then start on a 2-element boundary (its rows
    do, given its start)."""
    if n_cols % 2 == 0:
        require_aligned(2 * out.itemsize, "the GEMM epilogue stores output pairs", rows=False,
                        out=out)


def nullable(x, xp):
    """An optional pointer argument: None under the harness (a NULL pointer there); on CuPy an
    explicit 8-byte 0, because CuPy passes None as 0xffffffff, not NULL (cupy/cupy#9046), and
    the kernels test `bias != nullptr`."""
    if x is not None or xp is np:
        return x
    return np.uint64(0)


def check_gemm_operands(a, b, b_layout: str, bias, residual, out, out_dtype):
    """The GEMM wrappers' shared contract (gemm.py, gemm_hopper.py): a [M, K] and b ([N, K] for
    "nk", [K, N] for "kn") 2-D, one dtype, contiguous; bias [N] in a's dtype; residual and out
    [M, N] in out_dtype (a's dtype, the default, or float32). Makes out when it is None.
    Returns (M, N, K, out)."""
    require(a.ndim == 2 and b.ndim == 2, lambda: f"a {a.shape} and b {b.shape} must be 2-D")
    require(b.dtype == a.dtype, lambda: f"a ({a.dtype}) and b ({b.dtype}) dtypes differ")
    require(b_layout in ("nk", "kn"), lambda: f"b_layout must be 'nk' or 'kn', got {b_layout!r}")
    M, K = a.shape
    N = b.shape[0] if b_layout == "nk" else b.shape[1]
    require((b.shape[1] if b_layout == "nk" else b.shape[0]) == K,
            lambda: f"a {a.shape} and b {b.shape} ({b_layout}) disagree on K")
    require_contiguous("a", a)
    require_contiguous("b", b)
    out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
    require(out_dtype in (np.dtype(a.dtype), np.dtype(np.float32)),
            lambda: f"out_dtype {out_dtype}: only a's dtype or float32")
    if bias is not None:
        require(bias.shape == (N,) and bias.dtype == a.dtype,
                lambda: f"bias must be [{N}] {a.dtype}, got {bias.shape} {bias.dtype}")
        require_contiguous("bias", bias)
    if residual is not None:
        require(residual.shape == (M, N) and residual.dtype == out_dtype,
                lambda: f"residual must be [{M}, {N}] {out_dtype}, got {residual.shape} "
                        f"{residual.dtype}")
        require_contiguous("residual", residual)
    if out is None:
        out = array_module(a).empty((M, N), dtype=out_dtype)
    require(out.shape == (M, N) and out.dtype == out_dtype,
            lambda: f"out must be [{M}, {N}] {out_dtype}, got {out.shape} {out.dtype}")
    require_contiguous("out", out)
    return M, N, K, out


# Dynamic shared memory a launch gets without opting in (CUDA's default per-block limit);
# above it the wrapper sets the kernel's max_dynamic_shared_size_bytes first.
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


def opt_in_smem(kernel, nbytes: int) -> None:
    """Raises the kernel's dynamic shared memory limit to nbytes when the default is too small
    (cupy.RawKernel / Function attribute; the sim harness checks the same attribute)."""
    if nbytes > DEFAULT_DYNAMIC_SMEM_LIMIT:
        kernel.max_dynamic_shared_size_bytes = nbytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_exact(value: int, name: str) -> int:
    require(value > 0 and value & (value - 1) == 0, lambda: f"{name} {value} is not a power of two")
    return value.bit_length() - 1
