# cython: language_level=3
"""cpu_gemm: the bf16-weight GEMM of the cpu backend (runtime/backends/cpu_bf16_backend.py).

    packed = PackedWeight(w)                   # w: [N, K] float32, HF [out, in]; once, at load
    y = gemm_bf16(x, packed, bias)             # x: [M, K] float32 -> y: [M, N] float32

y = bf16(x) @ bf16(W).T (+ bias), accumulated in float32: x is rounded to bf16 (RNE) once per
call, W once at packing (layout in pyx/cpu_gemm_kernels.h). The kernel runs without the GIL;
`threads=2` splits the output tiles in two halves, one on a helper thread and one on the
calling thread: pool "native" (the default) is a C++ thread that polls for work for up to
300 us after each job and then sleeps (cpu_gemm_kernels.h says why), "python" a
ThreadPoolExecutor worker that sleeps on a queue.

Paths: "avx512bf16" (vdpbf16ps), "avx2" (bf16 widened to float32, FMA), "portable" (scalar
C, any CPU); "auto" picks the first of these the CPU runs. Tests force each.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from libc.stdint cimport int8_t, uint16_t
from libc.stdlib cimport free, malloc

cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    const int TILE_N
    int cpu_has_avx512bf16()
    int cpu_has_avx2_fma()
    int amx_available()
    const int AMX_ROWS
    const int AMX_MIN_ROWS
    void convert_rows(const float* x, long stride_m, long stride_k, int M, int K,
                      uint16_t* xb, int kp2)
    void gemm_tiles(int path, const uint16_t* xb, int M, int kp, const uint16_t* wp, int N,
                    int tile_begin, int tile_end, const float* bias, float* y, long ldy)
    cdef struct TileJob:
        int path
        const uint16_t* xb
        int M, kp
        const uint16_t* wp
        const int8_t* wq
        const float* scales
        int group_pairs
        int N, tile_begin, tile_end
        const float* bias
        float* y
        long ldy
    void init_helper()
    void run_job(const TileJob& job)
    void run_split(const TileJob& mine, const TileJob& theirs)

PATHS = ("portable", "avx512bf16", "avx2", "amx")
_PATH_CODE = {"portable": 0, "avx512bf16": 1, "avx2": 2, "amx": 3}
_AMX = 3
# Below these the second thread costs more than it saves: tiles per thread (4 tiles = 64
# outputs) and multiply-adds per call. The native helper's polled hand-off costs ~1 us, so a
# one-token decode GEMM of SmolLM2 (0.3-1.8 M multiply-adds, 20-100 us) splits; the python
# pool's queue hand-off (~40 us measured) pays only from 2^22 (~45 us on one Zen 4 core).
MIN_TILES_PER_THREAD = 4
# Weights per int8 scale group. On the default model (benchmarks/bench_quant_accuracy.py,
# perplexity vs bf16): per output channel +0.64%, groups of 128 +0.74%, 64 +0.29%, 32 +0.46%;
# 64 costs 6% more bytes than per channel (a float32 scale per 64 weights), 32 twice that.
DEFAULT_INT8_GROUP_SIZE = 64
MIN_MACS_PER_THREADED_CALL = {"native": 1 << 17, "python": 1 << 22}

cdef int _HAS_BF16 = cpu_has_avx512bf16()
cdef int _HAS_AVX2 = cpu_has_avx2_fma()
cdef int _HAS_AMX = amx_available()  # CPUID and the kernel's permission (asked once)
_pool = None


def _forget_pool():
    # A forked child has no copy of the worker thread: a job queued there would never run.
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)
init_helper()
POOLS = ("native", "python")


def has_avx512bf16():
    """True when this CPU runs the vdpbf16ps path."""
    return bool(_HAS_BF16)


def has_avx2_fma():
    """True when this CPU runs the AVX2 + FMA path."""
    return bool(_HAS_AVX2)


def has_amx():
    """True when this CPU (and the kernel's permission) runs the AMX path."""
    return bool(_HAS_AMX)


def available_paths():
    """The paths this CPU runs, fastest first ("amx": AMX tiles from 8 rows of x, the
    AVX512-BF16 kernels below that)."""
    return tuple(p for p, ok in (("amx", _HAS_AMX), ("avx512bf16", _HAS_BF16),
                                 ("avx2", _HAS_AVX2), ("portable", True)) if ok)


_AVAILABLE = available_paths()
# Resolved once: a decode step calls the GEMM ~120 times, the lookup is on every call.
_RESOLVED = {p: _PATH_CODE[p] for p in _AVAILABLE}
_RESOLVED["auto"] = _PATH_CODE[_AVAILABLE[0]]


def _resolve_path(path):
    code = _RESOLVED.get(path)
    if code is not None:
        return code
    if path not in _PATH_CODE:
        raise ValueError(f"path must be 'auto' or one of {PATHS}, got {path!r}")
    raise RuntimeError(f"this CPU cannot run the {path} path")


def to_bf16_bits(x):
    """float32 array -> uint16 bf16 bits (same shape) through the kernel's own f32_to_bf16
    (cpu_gemm_kernels.h): round to nearest even, NaN kept quiet with its sign. The rules of
    runtime/weights.py's to_bf16_bits (pyx/ may not import runtime/);
    tests/foundation/test_bf16_rounding.py checks the two agree bit for bit."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    flat = a.reshape(1, -1)
    return _convert(flat, flat.shape[1]).reshape(a.shape)


def _weight_matrix(weight):
    """weight as a non-empty [N, K] float32 array (ValueError otherwise)."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be [N, K], got shape {w.shape}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"weight must be non-empty, got shape {w.shape}")
    return w


class PackedWeight:
    """A [N, K] weight as bf16 bits in the kernel's tiled layout.

    packed: [num_tiles, ceil(K / 2), TILE_N, 2] uint16, zero past N and K.
    """

    def __init__(self, weight):
        w = _weight_matrix(weight)
        self.n, self.k = int(w.shape[0]), int(w.shape[1])
        tile = TILE_N
        num_tiles = -(-self.n // tile)
        kp = -(-self.k // 2)
        padded = np.zeros((num_tiles * tile, kp * 2), dtype=np.uint16)
        padded[:self.n, :self.k] = to_bf16_bits(w)
        self.packed = np.ascontiguousarray(
            padded.reshape(num_tiles, tile, kp, 2).transpose(0, 2, 1, 3))
        self.flat = self.packed.reshape(-1)  # the kernel's view, made once
        self.num_tiles, self.kp = num_tiles, kp

    @property
    def nbytes(self):
        return self.packed.nbytes


class PackedInt8Weight:
    """A [N, K] weight quantized to int8 in groups of `group_size` along K (the last group may
    be short), in the kernel's tiled layout (cpu_gemm_kernels.h, "int8 weights"):
    W[n, k] ~= scale[n, g] * q[n, k] for k in group g, q = round(W / scale) in [-127, 127],
    scale[n, g] = max |W[n, group g]| / 127 (an all-zero group: scale 0, q 0).

    group_size: an even number of weights (default 64; None: one group of all of K, i.e. per
    output channel). packed: [num_tiles, ceil(K / 2), TILE_N, 2] int8, zero past N and K;
    scales: [num_tiles, num_groups, TILE_N] float32, zero past N. Non-finite weights are
    refused.
    """

    def __init__(self, weight, group_size=DEFAULT_INT8_GROUP_SIZE):
        w = _weight_matrix(weight)
        self.n, self.k = int(w.shape[0]), int(w.shape[1])
        if not np.isfinite(w).all():
            raise ValueError("weight has non-finite values: int8 quantization needs finite ones")
        tile = TILE_N
        num_tiles = -(-self.n // tile)
        kp = -(-self.k // 2)
        if group_size is None:
            group_size = 2 * kp
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
        q, scales = quantize_int8(w, group_size)
        num_groups = scales.shape[1]
        padded = np.zeros((num_tiles * tile, kp * 2), dtype=np.int8)
        padded[:self.n, :self.k] = q
        self.packed = np.ascontiguousarray(
            padded.reshape(num_tiles, tile, kp, 2).transpose(0, 2, 1, 3))
        tiled = np.zeros((num_tiles * tile, num_groups), dtype=np.float32)
        tiled[:self.n] = scales
        self.scales = np.ascontiguousarray(
            tiled.reshape(num_tiles, tile, num_groups).transpose(0, 2, 1))
        self.flat = self.packed.reshape(-1)  # the kernel's views, made once
        self.flat_scales = self.scales.reshape(-1)
        self.group_size, self.num_tiles, self.kp = group_size, num_tiles, kp

    @property
    def nbytes(self):
        return self.packed.nbytes + self.scales.nbytes

    def quantized(self):
        """(q [N, K] int8, scales [N, num_groups] float32) as packed."""
        q = self.packed.transpose(0, 2, 1, 3).reshape(self.num_tiles * TILE_N, self.kp * 2)
        scales = self.scales.transpose(0, 2, 1).reshape(self.num_tiles * TILE_N, -1)
        return q[:self.n, :self.k], scales[:self.n]

    def dequantized(self):
        """The [N, K] float32 weight this packing computes with: scale[n, k // group] * q."""
        q, scales = self.quantized()
        per_weight = np.repeat(scales, self.group_size, axis=1)[:, :self.k]
        return (q.astype(np.float32) * per_weight).astype(np.float32)


def quantize_int8(w, group_size):
    """Symmetric int8 in groups of `group_size` along each row: w [N, K] float32 -> (q [N, K]
    int8 in [-127, 127], scales [N, ceil(K / group_size)] float32), q = round-half-even(w /
    scale), scale = max |w| / 127 over the group (0: q 0)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    num_groups = -(-k // group_size)
    padded = np.zeros((n, num_groups * group_size), dtype=np.float32)
    padded[:, :k] = w
    groups = padded.reshape(n, num_groups, group_size)
    scales = (np.abs(groups).max(axis=2) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.clip(np.rint(groups / safe[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(n, -1)[:, :k], scales


cdef TileJob _job(const uint16_t[:, ::1] xb, packed, bias, float[:, ::1] y, int path,
                  int tile_begin, int tile_end) except *:
    """The kernel's job for tiles [tile_begin, tile_end) of y = x @ packed (+ bias). The
    pointers borrow from xb, y and the packed weight's arrays: the caller keeps them alive."""
    cdef TileJob job
    cdef const float[::1] b
    cdef const uint16_t[::1] wp
    cdef const int8_t[::1] wq
    cdef const float[::1] scales
    job.path = path
    job.xb = &xb[0, 0]
    job.M = xb.shape[0]
    job.kp = xb.shape[1] // 2
    job.wp = NULL
    job.wq = NULL
    job.scales = NULL
    job.group_pairs = 0
    if isinstance(packed, PackedInt8Weight):
        wq = packed.flat
        scales = packed.flat_scales
        job.wq = &wq[0]
        job.scales = &scales[0]
        job.group_pairs = packed.group_size // 2
    else:
        wp = packed.flat
        job.wp = &wp[0]
    job.N = packed.n
    job.tile_begin = tile_begin
    job.tile_end = tile_end
    job.bias = NULL
    if bias is not None:
        b = bias
        job.bias = &b[0]
    job.y = &y[0, 0]
    job.ldy = y.shape[1]
    return job


def _run_tiles(xb, packed, bias, y, int path, int tile_begin, int tile_end):
    """One thread's share: tiles [tile_begin, tile_end) of y, without the GIL."""
    if xb.shape[0] == 0 or tile_end <= tile_begin:
        return
    cdef TileJob job = _job(xb, packed, bias, y, path, tile_begin, tile_end)
    with nogil:
        run_job(job)


def _run_split(xb, packed, bias, y, int path, int split):
    """Tiles [0, split) on the calling thread, [split, num_tiles) on the native helper."""
    cdef TileJob mine = _job(xb, packed, bias, y, path, 0, split)
    cdef TileJob theirs = mine
    theirs.tile_begin = split
    theirs.tile_end = packed.num_tiles
    with nogil:
        run_split(mine, theirs)


def _convert(const float[:, :] x, int kp2, int row_multiple=1):
    """x: [M, K] float32, any strides -> [M, kp2] bf16 bits (zero past K); with row_multiple
    > 1 the buffer holds M rounded up to it rows, the extra ones zero (returned as the [M, kp2]
    view of that buffer: its base is what the kernels read)."""
    cdef int m = x.shape[0], k = x.shape[1]
    cdef int rows = (m + row_multiple - 1) // row_multiple * row_multiple
    out = np.empty((rows, kp2), dtype=np.uint16)
    if rows > m:
        out[m:] = 0
    cdef uint16_t[:, ::1] xb = out
    if m == 0:
        return out[:0]
    if k == 0:
        out[:] = 0
        return out[:m]
    with nogil:
        convert_rows(&x[0, 0], x.strides[0] // sizeof(float), x.strides[1] // sizeof(float),
                     m, k, &xb[0, 0], kp2)
    return out[:m]


def gemm_bf16(x, packed, bias=None, *, path="auto", threads=2, pool="native"):
    """y = bf16(x) @ W.T (+ bias), float32 accumulation.

    x: [M, K] float32 (any strides; other float dtypes are converted); packed: PackedWeight of
    W [N, K] (or a PackedInt8Weight: then `gemm_int8`); bias: [N] float32 or None. Returns a
    new [M, N] float32 array. threads 2 splits the tiles with a helper thread: pool "native" (a
    C++ thread, polled hand-off) or "python" (a ThreadPoolExecutor worker); benchmarks measure
    both.
    """
    return _gemm(x, packed, bias, path, threads, pool)


def gemm_int8(x, packed, bias=None, *, path="auto", threads=2, pool="native"):
    """y = sum over K groups of (bf16(x_g) @ q_g.T) * scale_g (+ bias) for a PackedInt8Weight,
    float32 accumulation; gemm_bf16's arguments (the same three paths)."""
    if not isinstance(packed, PackedInt8Weight):
        raise TypeError(f"gemm_int8 takes a PackedInt8Weight, got {type(packed).__name__}")
    return _gemm(x, packed, bias, path, threads, pool)


def _gemm(x, packed, bias, path, threads, pool):
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    cdef int code = _resolve_path(path)
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if x.ndim != 2 or x.shape[1] != packed.k:
        raise ValueError(f"x must be [M, {packed.k}], got shape {x.shape}")
    if x.strides[0] % 4 or x.strides[1] % 4:
        x = np.ascontiguousarray(x)
    if bias is not None:
        bias = np.ascontiguousarray(bias, dtype=np.float32)
        if bias.shape != (packed.n,):
            raise ValueError(f"bias must be [{packed.n}], got shape {bias.shape}")
    # The AMX kernel (from AMX_MIN_ROWS rows) reads x in blocks of AMX_ROWS rows: zero rows
    # pad the last block.
    amx_rows = code == _AMX and x.shape[0] >= AMX_MIN_ROWS
    xb = _convert(x, packed.kp * 2, AMX_ROWS if amx_rows else 1)
    y = np.empty((x.shape[0], packed.n), dtype=np.float32)
    num_tiles = packed.num_tiles
    if (threads < 2 or num_tiles < 2 * MIN_TILES_PER_THREAD
            or x.shape[0] * packed.n * packed.k < MIN_MACS_PER_THREADED_CALL[pool]):
        _run_tiles(xb, packed, bias, y, code, 0, num_tiles)
        return y
    # An even split point keeps both halves on the two-tile micro-kernel.
    split = (num_tiles // 2 + 1) & ~1
    if pool == "native":
        _run_split(xb, packed, bias, y, code, split)
        return y
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrun-gemm")
    job = _pool.submit(_run_tiles, xb, packed, bias, y, code, split, num_tiles)
    _run_tiles(xb, packed, bias, y, code, 0, split)
    job.result()
    return y
