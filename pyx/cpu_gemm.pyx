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

from libc.stdint cimport uint16_t
from libc.stdlib cimport free, malloc

cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    const int TILE_N
    int cpu_has_avx512bf16()
    int cpu_has_avx2_fma()
    void convert_rows(const float* x, long stride_m, long stride_k, int M, int K,
                      uint16_t* xb, int kp2)
    void gemm_tiles(int path, const uint16_t* xb, int M, int kp, const uint16_t* wp, int N,
                    int tile_begin, int tile_end, const float* bias, float* y, long ldy)
    cdef struct TileJob:
        int path
        const uint16_t* xb
        int M, kp
        const uint16_t* wp
        int N, tile_begin, tile_end
        const float* bias
        float* y
        long ldy
    void init_helper()
    void run_split(const TileJob& mine, const TileJob& theirs)

PATHS = ("portable", "avx512bf16", "avx2")
_PATH_CODE = {"portable": 0, "avx512bf16": 1, "avx2": 2}
# Below these the second thread costs more than it saves: tiles per thread (4 tiles = 64
# outputs) and multiply-adds per call. The native helper's polled hand-off costs ~1 us, so a
# one-token decode GEMM of SmolLM2 (0.3-1.8 M multiply-adds, 20-100 us) splits; the python
# pool's queue hand-off (~40 us measured) pays only from 2^22 (~45 us on one Zen 4 core).
MIN_TILES_PER_THREAD = 4
MIN_MACS_PER_THREADED_CALL = {"native": 1 << 17, "python": 1 << 22}

cdef int _HAS_BF16 = cpu_has_avx512bf16()
cdef int _HAS_AVX2 = cpu_has_avx2_fma()
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


def available_paths():
    """The paths this CPU runs, fastest first."""
    return tuple(p for p, ok in (("avx512bf16", _HAS_BF16), ("avx2", _HAS_AVX2),
                                 ("portable", True)) if ok)


def _resolve_path(path):
    if path == "auto":
        return _PATH_CODE[available_paths()[0]]
    if path not in _PATH_CODE:
        raise ValueError(f"path must be 'auto' or one of {PATHS}, got {path!r}")
    if path not in available_paths():
        raise RuntimeError(f"this CPU cannot run the {path} path")
    return _PATH_CODE[path]


def to_bf16_bits(x):
    """float32 array -> uint16 bf16 bits (same shape) through the kernel's own f32_to_bf16
    (cpu_gemm_kernels.h): round to nearest even, NaN kept quiet with its sign. The rules of
    runtime/weights.py's to_bf16_bits (pyx/ may not import runtime/);
    tests/foundation/test_bf16_rounding.py checks the two agree bit for bit."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    flat = a.reshape(1, -1)
    return _convert(flat, flat.shape[1]).reshape(a.shape)


class PackedWeight:
    """A [N, K] weight as bf16 bits in the kernel's tiled layout.

    packed: [num_tiles, ceil(K / 2), TILE_N, 2] uint16, zero past N and K.
    """

    def __init__(self, weight):
        w = np.asarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"weight must be [N, K], got shape {w.shape}")
        self.n, self.k = int(w.shape[0]), int(w.shape[1])
        if self.n < 1 or self.k < 1:
            raise ValueError(f"weight must be non-empty, got shape {w.shape}")
        tile = TILE_N
        num_tiles = -(-self.n // tile)
        kp = -(-self.k // 2)
        padded = np.zeros((num_tiles * tile, kp * 2), dtype=np.uint16)
        padded[:self.n, :self.k] = to_bf16_bits(w)
        self.packed = np.ascontiguousarray(
            padded.reshape(num_tiles, tile, kp, 2).transpose(0, 2, 1, 3))
        self.num_tiles, self.kp = num_tiles, kp

    @property
    def nbytes(self):
        return self.packed.nbytes


def _run_tiles(const uint16_t[:, ::1] xb, const uint16_t[::1] wp, int n, int tile_begin,
               int tile_end, bias, float[:, ::1] y, int path):
    """One thread's share: tiles [tile_begin, tile_end) of y, without the GIL."""
    cdef const float[::1] b
    cdef const float* bias_ptr = NULL
    if bias is not None:
        b = bias
        bias_ptr = &b[0]
    cdef int m = xb.shape[0]
    cdef int kp = xb.shape[1] // 2
    if m == 0 or tile_end <= tile_begin:
        return
    with nogil:
        gemm_tiles(path, &xb[0, 0], m, kp, &wp[0], n, tile_begin, tile_end, bias_ptr,
                   &y[0, 0], y.shape[1])


def _run_split(const uint16_t[:, ::1] xb, const uint16_t[::1] wp, int n, int split,
               int num_tiles, bias, float[:, ::1] y, int path):
    """Tiles [0, split) on the calling thread, [split, num_tiles) on the native helper."""
    cdef const float[::1] b
    cdef const float* bias_ptr = NULL
    if bias is not None:
        b = bias
        bias_ptr = &b[0]
    cdef TileJob mine, theirs
    mine.path = path
    mine.xb = &xb[0, 0]
    mine.M = xb.shape[0]
    mine.kp = xb.shape[1] // 2
    mine.wp = &wp[0]
    mine.N = n
    mine.tile_begin = 0
    mine.tile_end = split
    mine.bias = bias_ptr
    mine.y = &y[0, 0]
    mine.ldy = y.shape[1]
    theirs = mine
    theirs.tile_begin = split
    theirs.tile_end = num_tiles
    with nogil:
        run_split(mine, theirs)


def _convert(const float[:, :] x, int kp2):
    """x: [M, K] float32, any strides -> [M, kp2] bf16 bits (zero past K)."""
    cdef int m = x.shape[0], k = x.shape[1]
    out = np.empty((m, kp2), dtype=np.uint16)
    cdef uint16_t[:, ::1] xb = out
    if m == 0:
        return out
    if k == 0:
        out[:] = 0
        return out
    with nogil:
        convert_rows(&x[0, 0], x.strides[0] // sizeof(float), x.strides[1] // sizeof(float),
                     m, k, &xb[0, 0], kp2)
    return out


def gemm_bf16(x, packed, bias=None, *, path="auto", threads=2, pool="native"):
    """y = bf16(x) @ W.T (+ bias), float32 accumulation.

    x: [M, K] float32 (any strides; other float dtypes are converted); packed: PackedWeight of
    W [N, K]; bias: [N] float32 or None. Returns a new [M, N] float32 array. threads 2 splits
    the tiles with a helper thread: pool "native" (a C++ thread on a condition variable) or
    "python" (a ThreadPoolExecutor worker); benchmarks measure both.
    """
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
    xb = _convert(x, packed.kp * 2)
    y = np.empty((x.shape[0], packed.n), dtype=np.float32)
    wp = packed.packed.reshape(-1)
    num_tiles = packed.num_tiles
    if (threads < 2 or num_tiles < 2 * MIN_TILES_PER_THREAD
            or x.shape[0] * packed.n * packed.k < MIN_MACS_PER_THREADED_CALL[pool]):
        _run_tiles(xb, wp, packed.n, 0, num_tiles, bias, y, code)
        return y
    # An even split point keeps both halves on the two-tile micro-kernel.
    split = (num_tiles // 2 + 1) & ~1
    if pool == "native":
        _run_split(xb, wp, packed.n, split, num_tiles, bias, y, code)
        return y
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrun-gemm")
    job = _pool.submit(_run_tiles, xb, wp, packed.n, split, num_tiles, bias, y, code)
    _run_tiles(xb, wp, packed.n, 0, split, bias, y, code)
    job.result()
    return y
