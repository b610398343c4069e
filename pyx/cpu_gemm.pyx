# cython: language_level=3
"""cpu_gemm: the bf16-weight GEMM of the cpu backend (runtime/backends/cpu_bf16_backend.py).

    packed = PackedWeight(w)                   # w: [N, K] float32, HF [out, in]; once, at load
    y = gemm_bf16(x, packed, bias)             # x: [M, K] float32 -> y: [M, N] float32

y = bf16(x) @ bf16(W).T (+ bias), accumulated in float32: x is rounded to bf16 (RNE) once per
call, W once at packing (layout in pyx/cpu_gemm_kernels.h). The kernel runs without the GIL;
`threads=2` splits the output tiles in two halves, one on a helper thread and one on the
calling thread: pool "native" (the default) is the process's one C++ helper thread (shared
with cpu_ops and cpu_decode_step), which polls for work for up to 300 us after each job and
then sleeps (pyx/cpu_thread_pool.h says why), "python" a ThreadPoolExecutor worker that sleeps
on a queue.

Paths: "avx512bf16" (vdpbf16ps), "avx2" (bf16 widened to float32, FMA), "portable" (scalar
C, any CPU); "auto" picks the first of these the CPU runs. Tests force each.

GGUF weights kept quantized (Q4_0 / Q4_1 / Q8_0 / Q5_0 blocks, Q4_K / Q5_K / Q6_K / Q3_K
super-blocks):

    packed = PackedGgufWeight(raw, "Q4_1", k)  # raw: uint8 [N, row_bytes], the file's blocks
    y = gemm_gguf(x, packed, bias)             # x: [M, K] float32 -> y: [M, N] float32

x is quantized per row per 32-wide block to int8 (llama.cpp's q8 activations; or, with
activations="q8x2", two int8 passes: the second over the first one's residual) once per
call, and the integer dot products run on AMX-INT8 tiles (GGUF path "amx", from 8 kernel
rows) or vpdpbusd (GGUF paths "avx512vnni", "portable"); or, activations="bf16", x is rounded
to bf16 and each weight tile unpacked to bf16 for vdpbf16ps (pyx/cpu_gguf_bf16_kernels.h;
activations="auto" takes it from BF16_MIN_ROWS rows on CPUs without AMX-INT8); the
math and the packed layout are in pyx/cpu_quant_kernels.h. Q4_K / Q6_K super-blocks run through the
same per-32 kernels with float32 scales that are exact products of their fp16 super-scales and
small int scales (K a multiple of 256); dequantize() is bit-exact against gguf's.

AWQ / GPTQ int4 (not a GGML type, "I4Z": W = s * (q - z) per group of 32 / 64 / 128, fp16 s,
int z) runs on the Q4_1 kernels with per-32 d = s and an exact min -s * z:

    packed = PackedGgufWeight.from_int4(q, s, z, group)   # or (int4_rows(...), "I4Z", k)
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from pagedrun.pyx.cpu_thread_pool cimport bind_run_pair, process_run_pair, thread_pool_probe

cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    const int TILE_N
    cdef struct GgufJob:
        int type
        int path
        const uint8_t* wq
        int nb
        int M
        const int8_t* xq
        const float* xd
        const float* xs
        const int32_t* xcorr
        const uint16_t* xb
    int cpu_has_avx512vnni()
    int cpu_has_gguf_avx2()
    int gguf_bf16_available()
    int gguf_activations_for_rows(int path, int activations, int M)
    const int GGUF_BF16_MIN_ROWS
    const int GGUF_ACT_Q8, GGUF_ACT_Q8X2, GGUF_ACT_BF16, GGUF_ACT_AUTO
    int gguf_amx_int8_available()
    int gguf_block_bytes_of(int type)
    int gguf_offset(int type)
    void gguf_quantize_rows(int path, const float* x, long stride_m, long stride_k, int M,
                            int K, int offset, int residual, int8_t* xq, float* xd, float* xs,
                            int32_t* xcorr)
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
        const GgufJob* gguf
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
# Splits run on the process's one helper thread (pagedrun.pyx.cpu_thread_pool).
bind_run_pair(process_run_pair)


cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    const GemmTable* gemm_table()


cdef const GemmTable* exported_gemm_table() noexcept nogil:
    return gemm_table()
POOLS = ("native", "python")


def _thread_pool_probe():
    """(address of the run_pair this module's splits call, caller's thread id, id of the
    thread that ran the second part): tests check every module shares the one helper."""
    return thread_pool_probe()


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


# The ISA levels "auto" may be capped at (set_isa_cap; runtime/cpu_isa.py owns the names): the
# paths of each GEMM a level allows, fastest first.
ISA_CAPS = ("auto", "amx", "avx512", "avx2", "portable")
_CAP_ALLOWS = {"auto": None, "amx": None,
               "avx512": ("avx512bf16", "avx512vnni", "avx2", "portable"),
               "avx2": ("avx2", "portable"), "portable": ("portable",)}
_isa_cap = "auto"


def set_isa_cap(name):
    """Cap what path="auto" resolves to, for the bf16 / int8 GEMMs and the GGUF GEMM, at an ISA
    level (ISA_CAPS; "auto" and "amx": no cap): the fastest path the CPU runs that the level
    allows. Explicitly named paths are unaffected. Process-wide, like oneDNN's max CPU ISA:
    tests and benchmarks run the AVX2 path on an AVX-512 box with it."""
    global _isa_cap
    if name not in ISA_CAPS:
        raise ValueError(f"isa cap must be one of {ISA_CAPS}, got {name!r}")
    allows = _CAP_ALLOWS[name]
    _isa_cap = name
    _RESOLVED["auto"] = _PATH_CODE[next(p for p in _AVAILABLE if allows is None or p in allows)]
    gguf = available_gguf_paths()
    _GGUF_RESOLVED["auto"] = _GGUF_PATH_CODE[next(p for p in gguf
                                                  if allows is None or p in allows)]


def isa_cap():
    """The cap set_isa_cap set ("auto": none)."""
    return _isa_cap


def auto_paths():
    """(GEMM path, GGUF GEMM path) that path="auto" runs now, as names."""
    gemm = next(p for p, c in _PATH_CODE.items() if c == _RESOLVED["auto"])
    gguf = next(p for p, c in _GGUF_PATH_CODE.items() if c == _GGUF_RESOLVED["auto"])
    return gemm, gguf


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
    job.gguf = NULL
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


def _gemm_operands(x, packed, bias):
    """(x, bias) as the kernels take them: x [M, K] float32 with 4-byte strides (a copy only
    when needed), bias [N] contiguous float32 or None; a wrong shape is a ValueError."""
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
    return x, bias


def _gemm(x, packed, bias, path, threads, pool):
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    cdef int code = _resolve_path(path)
    x, bias = _gemm_operands(x, packed, bias)
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


# ------------------------------------------------------------------------- GGUF blocks
GGUF_NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q3_K")
# INT4_TYPE "I4Z", not a GGML type (so not in GGUF_NATIVE_TYPES): AWQ / GPTQ int4
# (runtime/quantization/hf_int4.py), W = s * (q - z) per group of INT4_GROUPS weights along k
# (s fp16, z 0..15). Its raw rows (this module's own format): k / 2 bytes of nibbles (byte i: k 2i low,
# k 2i + 1 high), then k / g fp16 s, then k / g bytes z.
INT4_TYPE = "I4Z"
INT4_GROUPS = (32, 64, 128)
GGUF_PATHS = ("portable", "avx2", "avx512vnni", "amx")
# The "amx" kernel with its tile instructions done in scalar C++ (pyx/cpu_quant_kernels.h):
# never chosen by "auto", there so tests check the AMX kernel's layout and epilogue on any
# AVX512-VNNI CPU. Slow.
GGUF_AMX_EMULATED = "amx-emulated"
GGUF_BLOCK = 32  # weights per GGUF block
GGUF_SUPER_BLOCK = 256  # weights per K-quant super-block (Q4_K, Q6_K): k must be a multiple
# Activation quantization of gemm_gguf: "q8" (llama.cpp's: int8 per 32-wide block, error <=
# dx / 2 per activation) or "q8x2" (a second int8 pass over the residual, error <= dx / 256:
# twice the multiply-adds, the same weight bytes). Measured on the default model's GEMMs with
# its real activations: "q8" 0.6-0.9% relative error per GEMM (the greedy answer to "What is
# the capital of France?" changes), the float product of the same weights answers "Paris".
GGUF_ACTIVATIONS = ("q8", "q8x2")
# Beyond the int8 modes: "bf16" (x rounded to bf16, each weight tile unpacked to bf16 into a
# cache-resident panel, the bf16 GEMM's vdpbf16ps micro-kernel: pyx/cpu_gguf_bf16_kernels.h),
# and "auto": "bf16" from GGUF_BF16_MIN_ROWS rows of x on the avx512vnni path of a CPU that
# runs it (has_gguf_bf16), "q8x2" otherwise (fewer rows: memory-bound, the int8 kernel wins;
# an AMX-INT8 path: TDPBSUD). gguf_activations_for(m) names the choice.
GGUF_BF16 = "bf16"
GGUF_ACTIVATION_MODES = GGUF_ACTIVATIONS + (GGUF_BF16, "auto")
_GGUF_ACT_CODE = {"q8": GGUF_ACT_Q8, "q8x2": GGUF_ACT_Q8X2, GGUF_BF16: GGUF_ACT_BF16,
                  "auto": GGUF_ACT_AUTO}
_GGUF_ACT_NAME = {code: name for name, code in _GGUF_ACT_CODE.items()}
BF16_MIN_ROWS = GGUF_BF16_MIN_ROWS  # "auto"'s threshold (rows of x), measured: see the header
# Q5_0 runs as Q8_0 (its q - 16 as int8 bytes, the same d): the Q8_0 kernel. Q3_K runs as
# Q6_K (its q in -4..3 and 6-bit scales are Q6_K values exactly, the same d): the Q6_K kernel,
# at Q6_K's bytes (1.9x Q3_K's; still 0.27x bf16's).
_GGUF_TYPE_CODE = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4, "I4Z": 5,
                   "Q5_0": 2, "Q5_K": 6, "Q3_K": 4}
# Bytes of one block in the file: fp16 d (+ fp16 m for Q4_1), then the quants; Q4_K: fp16 d,
# fp16 dmin, 12 bytes of 6-bit scales / mins, 128 of nibbles; Q6_K: 128 bytes of low nibbles,
# 64 of high 2 bits, 16 int8 scales, fp16 d; Q5_0: fp16 d, 4 bytes of 5th bits (bit i: weight
# i), 16 of nibbles (as Q4_0's); Q5_K: Q4_K's first 16 bytes, 32 of 5th bits (bit j of byte l:
# weight l of 32-block j), 128 of nibbles (as Q4_K's); Q3_K: 32 bytes of high bits, 64 of 2-bit
# pairs, 12 of 6-bit scales, fp16 d (_q3_k_as_q6_k reads them).
_GGUF_FILE_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210, "Q5_0": 22,
                    "Q5_K": 176, "Q3_K": 110}
_GGUF_K_TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q3_K")
_GGUF_PATH_CODE = {"portable": 0, "avx512vnni": 1, "amx": 2, GGUF_AMX_EMULATED: 3, "avx2": 4}
cdef int _HAS_VNNI = cpu_has_avx512vnni()
cdef int _HAS_GGUF_AVX2 = cpu_has_gguf_avx2()
cdef int _HAS_AMX_INT8 = gguf_amx_int8_available()  # CPUID and the kernel's permission


def has_avx512vnni():
    """True when this CPU runs the GGUF GEMM's vpdpbusd path (AVX512F+BW+VL+VNNI)."""
    return bool(_HAS_VNNI)


def has_gguf_bf16():
    """True when this CPU runs the GGUF GEMM's bf16-activation kernel on vectors (AVX512-BF16,
    VBMI and VNNI); without them activations "bf16" runs only on the portable path."""
    return bool(gguf_bf16_available())


def gguf_activations_for(int m, path="auto", activations="auto"):
    """The activation mode gemm_gguf(x [m, K], path=path, activations=activations) runs (one of
    GGUF_ACTIVATIONS or "bf16"): `activations` itself unless it is "auto"."""
    if activations not in GGUF_ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {GGUF_ACTIVATION_MODES}, got "
                         f"{activations!r}")
    return _GGUF_ACT_NAME[gguf_activations_for_rows(_resolve_gguf_path(path),
                                                    _GGUF_ACT_CODE[activations], m)]


def has_amx_int8():
    """True when this CPU (and the kernel's permission) runs the GGUF GEMM's AMX-INT8 path."""
    return bool(_HAS_AMX_INT8)


def available_gguf_paths():
    """The GGUF GEMM paths this CPU runs, fastest first ("amx": TDPBSUD from 8 kernel rows,
    the vpdpbusd kernel below)."""
    return tuple(p for p, ok in (("amx", _HAS_AMX_INT8), ("avx512vnni", _HAS_VNNI),
                                 ("avx2", _HAS_GGUF_AVX2), ("portable", True)) if ok)


_GGUF_RESOLVED = {p: _GGUF_PATH_CODE[p] for p in available_gguf_paths()}
if _HAS_VNNI:
    _GGUF_RESOLVED[GGUF_AMX_EMULATED] = _GGUF_PATH_CODE[GGUF_AMX_EMULATED]
_GGUF_RESOLVED["auto"] = _GGUF_PATH_CODE[available_gguf_paths()[0]]


def _resolve_gguf_path(path):
    code = _GGUF_RESOLVED.get(path)
    if code is not None:
        return code
    if path not in _GGUF_PATH_CODE:
        raise ValueError(f"path must be 'auto' or one of {GGUF_PATHS}, got {path!r}")
    raise RuntimeError(f"this CPU cannot run the {path} path")


def _tile_scales(a, t, per):
    """[t * 16, U, per] bytes (per output) -> [t, U, per * 16]: [per][16 outputs] per unit."""
    u = a.shape[1]
    return a.reshape(t, TILE_N, u, per).transpose(0, 2, 3, 1).reshape(t, u, per * TILE_N)


def _pack_plain(blocks, int n, int scale_bytes, bint to_unsigned, int num_tiles,
                int block_bytes):
    """Q4_0 / Q4_1 / Q8_0 file blocks [>= n, nb, fb] (rows from n: zero outputs) -> the
    kernel layout [num_tiles, nb, block_bytes]: per tile-block the quants [g][16 n][4] (byte
    (g, n, j) = qs[4 g + j] of output n; Q8_0 XOR 0x80: int8 q -> u8 q + 128), then d[16] and
    (Q4_1) m[16] fp16. One pass in C (numpy's transposes took ~0.25 s of the default model's
    start)."""
    cdef const uint8_t[:, :, ::1] src = np.ascontiguousarray(blocks)
    cdef int nb = src.shape[1], fb = src.shape[2]
    cdef int groups = (fb - scale_bytes) // 4
    out = np.zeros((num_tiles, nb, block_bytes), dtype=np.uint8)
    cdef uint8_t[:, :, ::1] dst = out
    cdef int t, b, i, g, j, row
    cdef uint8_t flip = 0x80 if to_unsigned else 0
    cdef const uint8_t* sb
    cdef uint8_t* db
    with nogil:
        for t in range(num_tiles):
            for b in range(nb):
                db = &dst[t, b, 0]
                for i in range(TILE_N):
                    row = t * TILE_N + i
                    if row >= n:
                        continue
                    sb = &src[row, b, 0]
                    for g in range(groups):
                        for j in range(4):
                            db[(g * TILE_N + i) * 4 + j] = sb[scale_bytes + 4 * g + j] ^ flip
                    db[groups * 64 + 2 * i] = sb[0]
                    db[groups * 64 + 2 * i + 1] = sb[1]
                    if scale_bytes == 4:
                        db[groups * 64 + 32 + 2 * i] = sb[2]
                        db[groups * 64 + 32 + 2 * i + 1] = sb[3]
    return out


def _tile_halves(a, t):
    """[t * 16, U, 2] (one fp16 per output) -> [t, U, 32]: 16 fp16 per unit."""
    u = a.shape[1]
    return a.reshape(t, TILE_N, u, 2).transpose(0, 2, 1, 3).reshape(t, u, 2 * TILE_N)


def _untile_halves(part, t, u):
    """[t, U, 32] -> float32 [t * 16, U, 1], the inverse of _tile_halves."""
    part = np.ascontiguousarray(part.reshape(t, u, TILE_N, 2).transpose(0, 2, 1, 3))
    return part.reshape(t * TILE_N, u * 2).view(np.float16).astype(np.float32)[:, :, None]


def _k_scales_mins(blocks):
    """The 6-bit (sc, m) [N, U, 8] of Q4_K / Q5_K super-blocks (their bytes 4:16)."""
    n, u = blocks.shape[0], blocks.shape[1]
    scales = blocks[:, :, 4:16].reshape(n, u, 3, 4)
    lo, hi, both = scales[:, :, 0], scales[:, :, 1], scales[:, :, 2]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=2)
    mn = np.concatenate([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], axis=2)
    return sc, mn


def _pack_q4_k(blocks, t):
    """Q4_K super-blocks [t * 16, U, 144] -> [t, U, 2368]: per 32-block j the Q4_1 nibble
    form (byte i: k i low, k 16 + i high) tiled as Q4_1's, then sc[8][16], m[8][16] (the
    6-bit ints as bytes), d[16], dmin[16] fp16."""
    n, u = blocks.shape[0], blocks.shape[1]
    sc, mn = _k_scales_mins(blocks)
    # ggml's Q4_K nibbles: per 64 weights, 32 bytes: low nibble k l, high nibble k 32 + l.
    qs = blocks[:, :, 16:].reshape(n, u, 4, 1, 32)
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=3).reshape(n, u, 8, 32)
    nib = q[:, :, :, :16] | (q[:, :, :, 16:] << np.uint8(4))
    quants = (nib.reshape(t, TILE_N, u, 8, 4, 4).transpose(0, 2, 3, 4, 1, 5)
              .reshape(t, u, 8 * 256))
    return np.concatenate([quants, _tile_scales(sc, t, 8), _tile_scales(mn, t, 8),
                           _tile_halves(blocks[:, :, 0:2], t),
                           _tile_halves(blocks[:, :, 2:4], t)], axis=2)


def _pack_q5_k(blocks, t):
    """Q5_K super-blocks [t * 16, U, 176] -> [t, U, 4416]: per 32-block j the 5-bit q as one
    byte a weight (0..31) tiled as Q8_0's, then Q4_K's sc[8][16], m[8][16], d[16], dmin[16]."""
    n, u = blocks.shape[0], blocks.shape[1]
    sc, mn = _k_scales_mins(blocks)
    # ggml's: per 64 weights 32 bytes of nibbles (low: block 2c, high: block 2c + 1), and bit
    # j of qh byte l is the 5th bit of weight l of block j.
    ql = blocks[:, :, 48:176].reshape(n, u, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[:, :, 16:48].reshape(n, u, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = ((ql & np.uint8(0x0F)).reshape(n, u, 8, 32)
         | ((qh & np.uint8(1)) << np.uint8(4)))
    quants = (q.reshape(t, TILE_N, u, 8, 8, 4).transpose(0, 2, 3, 4, 1, 5)
              .reshape(t, u, 8 * 512))
    return np.concatenate([quants, _tile_scales(sc, t, 8), _tile_scales(mn, t, 8),
                           _tile_halves(blocks[:, :, 0:2], t),
                           _tile_halves(blocks[:, :, 2:4], t)], axis=2)


def _q5_0_as_q8_0(blocks):
    """Q5_0 blocks [N, nb, 22] -> Q8_0 blocks [N, nb, 34] of the same values: d, then the
    int8 q - 16 (q = nibble | 5th bit << 4, gguf's order: byte i holds weights i and 16 + i)."""
    qh = np.ascontiguousarray(blocks[:, :, 2:6]).view(np.uint32)  # [N, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    qs = blocks[:, :, 6:22]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2) | (high << np.uint8(4))
    signed = (q.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return np.concatenate([blocks[:, :, 0:2], signed], axis=2)


def _q3_k_as_q6_k(blocks):
    """Q3_K super-blocks [N, U, 110] -> Q6_K super-blocks [N, U, 210] of the same values.

    Q3_K (ggml's block_q3_K): weight e = 128 h + 32 s + l (h 0..1, s 0..3, l 0..31) has the 2
    bits (qs[32 h + l] >> 2 s) & 3 and the high bit (hmask[l] >> (4 h + s)) & 1; its value is
    d * (sc[e // 16] - 32) * q with q = 2 bits - 4 unless the high bit is set (-4..3); the 16
    6-bit sc: low 4 bits (scales[i % 8] >> 4 (i // 8)) & 15, high 2 bits (scales[8 + i % 4] >>
    2 (i // 4)) & 3. Q6_K holds it exactly: q6 = q + 32 (28..35 of 0..63), its int8 scale
    sc - 32, the same d; ql / qh laid out as _pack_q6_k reads them."""
    n, u = blocks.shape[0], blocks.shape[1]
    hmask = blocks[:, :, 0:32].reshape(n, u, 1, 1, 32)
    qs = blocks[:, :, 32:96].reshape(n, u, 2, 1, 32)
    s = np.arange(4, dtype=np.uint8).reshape(1, 4, 1)
    h = np.arange(2, dtype=np.uint8).reshape(2, 1, 1)
    two_bits = (qs >> (np.uint8(2) * s)) & np.uint8(3)                  # [N, U, 2, 4, 32]
    high = (hmask >> (np.uint8(4) * h + s)) & np.uint8(1)
    q6 = two_bits + np.uint8(28) + (high << np.uint8(2))                # q + 32, q = bits - 4 + 4 high
    i = np.arange(16)
    raw_scales = blocks[:, :, 96:108]
    low4 = (raw_scales[:, :, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & np.uint8(0x0F)
    high2 = (raw_scales[:, :, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & np.uint8(3)
    scales = ((low4 | (high2 << np.uint8(4))).astype(np.int16) - 32).astype(np.int8)
    nibbles = (q6 & np.uint8(0x0F)).reshape(n, u, 2, 2, 64)             # [h][s // 2][32 (s % 2) + l]
    ql = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << np.uint8(4))).reshape(n, u, 128)
    pairs = (q6 >> np.uint8(4)) << (np.uint8(2) * s)                    # [h][s][l] at bits 2 s
    qh = np.bitwise_or.reduce(pairs, axis=3).reshape(n, u, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), blocks[:, :, 108:110]], axis=2)


def _pack_q6_k(blocks, t):
    """Q6_K super-blocks [t * 16, U, 210] -> [t, U, 4384]: per 32-block j the 6-bit q as one
    byte a weight (0..63, the -32 goes to the activations' 16-sums) tiled as Q8_0's, then the
    int8 scales [8 j][2 halves][16], d[16] fp16."""
    n, u = blocks.shape[0], blocks.shape[1]
    ql = blocks[:, :, 0:128].reshape(n, u, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = blocks[:, :, 128:192].reshape(n, u, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                    np.uint8)[:, None]
    q = (ql & np.uint8(0x0F)).reshape(n, u, 256) | ((qh & np.uint8(3)).reshape(n, u, 256)
                                                    << np.uint8(4))
    quants = (q.reshape(t, TILE_N, u, 8, 8, 4).transpose(0, 2, 3, 4, 1, 5)
              .reshape(t, u, 8 * 512))
    return np.concatenate([quants, _tile_scales(blocks[:, :, 192:208], t, 16),
                           _tile_halves(blocks[:, :, 208:210], t)], axis=2)


class PackedGgufWeight:
    """A [N, K] GGUF-quantized weight (GGUF_NATIVE_TYPES; Q5_0 as Q8_0) in the kernel's tiled
    layout (pyx/cpu_quant_kernels.h): packed [num_tiles, units, unit_bytes] uint8, a unit = a
    block of 32 k (Q4_0 / Q4_1 / Q8_0: the quants of 16 outputs x 32 k interleaved for
    vpdpbusd, then their fp16 d (and m)) or a K-quant super-block of 256 k (8 such quant
    blocks, then the small int scales and the fp16 super-scales).

    raw: uint8 [N, K / block weights * file block bytes], the tensor's blocks exactly as in
    the file (row n = output n); ggml_type: one of GGUF_NATIVE_TYPES; k: weights per row (a
    multiple of 32, of 256 for Q4_K / Q6_K). Repacked once; the values are not changed
    (dequantize() gives gguf's dequantization).
    """

    def __init__(self, raw, ggml_type, k):
        if ggml_type not in _GGUF_TYPE_CODE:
            raise ValueError(f"ggml_type must be one of {GGUF_NATIVE_TYPES} or {INT4_TYPE!r}, "
                             f"got {ggml_type!r}")
        k = int(k)
        unit = GGUF_SUPER_BLOCK if ggml_type in _GGUF_K_TYPES else GGUF_BLOCK
        if k < unit or k % unit:
            raise ValueError(f"k must be a positive multiple of {unit} for {ggml_type}, got {k}")
        raw = np.asarray(raw)
        if ggml_type == "I4Z":
            self._init_int4(raw, k)
            return
        fb = _GGUF_FILE_BLOCK[ggml_type]
        nb = k // GGUF_BLOCK
        units = k // unit
        if (raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[0] < 1
                or raw.shape[1] != units * fb):
            raise ValueError(f"raw must be uint8 [N >= 1, {units * fb}] for {ggml_type} with k "
                             f"{k}, got {raw.dtype} {raw.shape}")
        code = _GGUF_TYPE_CODE[ggml_type]
        n = int(raw.shape[0])
        tile = TILE_N
        num_tiles = -(-n // tile)
        if ggml_type in ("Q4_0", "Q4_1", "Q8_0"):  # straight from the file's rows
            packed = _pack_plain(raw.reshape(n, units, fb), n, 4 if ggml_type == "Q4_1" else 2,
                                 ggml_type == "Q8_0", num_tiles, gguf_block_bytes_of(code))
            self._finish(packed, n, k, ggml_type, code, nb, num_tiles)
            return
        blocks = np.zeros((num_tiles * tile, units, fb), dtype=np.uint8)
        blocks[:n] = raw.reshape(n, units, fb)
        if ggml_type == "Q5_0":  # the Q8_0 form of the same values (its kernel and layout)
            blocks, ggml_as = _q5_0_as_q8_0(blocks), "Q8_0"
        elif ggml_type == "Q3_K":  # the Q6_K form of the same values
            blocks, ggml_as = _q3_k_as_q6_k(blocks), "Q6_K"
        else:
            ggml_as = ggml_type
        if ggml_type == "Q4_K":
            packed = _pack_q4_k(blocks, num_tiles)
        elif ggml_type == "Q5_K":
            packed = _pack_q5_k(blocks, num_tiles)
        elif ggml_as == "Q6_K":
            packed = _pack_q6_k(blocks, num_tiles)
        else:
            packed = _pack_plain(blocks, n, 4 if ggml_type == "Q4_1" else 2, ggml_as == "Q8_0",
                                 num_tiles, gguf_block_bytes_of(code))
        self._finish(packed, n, k, ggml_type, code, nb, num_tiles)

    def _finish(self, packed, n, k, ggml_type, code, nb, num_tiles):
        self.packed = np.ascontiguousarray(packed)
        if self.packed.shape[2] != gguf_block_bytes_of(code):
            raise AssertionError("packed block size disagrees with cpu_quant_kernels.h")
        self.flat = self.packed.reshape(-1)  # the kernel's view, made once
        self.n, self.k, self.ggml_type = n, k, ggml_type
        self.type_code, self.nb, self.num_tiles = code, nb, num_tiles
        # W = d * (u - offset): the activations' correction (Q6_K: -1, per-16 sums packed)
        self.offset = gguf_offset(code)

    @classmethod
    def from_int4(cls, q, s, z, group):
        """An "I4Z" weight from q uint8 [N, K] (0..15), s float16 [N, K / group], z uint8
        [N, K / group] (0..15): W = s * (q - z) per group of `group` (INT4_GROUPS) along K."""
        return cls(int4_rows(q, s, z, group), "I4Z", np.asarray(q).shape[1])

    def _init_int4(self, raw, k):
        """The I4Z raw rows (INT4_GROUPS' comment) -> the Q4_1 quant tiles, s[16] fp16, z[16]
        per 32-block (a group of 64 / 128 repeats its s, z in each of its 32-blocks)."""
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[0] < 1:
            raise ValueError(f"raw must be uint8 [N >= 1, row bytes] for I4Z, got {raw.dtype} "
                             f"{raw.shape}")
        extra = raw.shape[1] - k // 2
        groups = extra // 3 if extra > 0 and extra % 3 == 0 else 0
        group = k // groups if groups and k % groups == 0 else 0
        if group not in INT4_GROUPS or k % group:
            raise ValueError(f"raw rows of {raw.shape[1]} bytes are no I4Z layout for k {k} "
                             f"(groups of {INT4_GROUPS})")
        n, nb, tile = int(raw.shape[0]), k // GGUF_BLOCK, TILE_N
        num_tiles = -(-n // tile)
        nib = raw[:, :k // 2]
        q = np.stack([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=2).reshape(n, nb, 32)
        rep = group // GGUF_BLOCK
        s = np.repeat(np.ascontiguousarray(raw[:, k // 2:k // 2 + 2 * groups]).view(np.uint16),
                      rep, axis=1)
        z = np.repeat(raw[:, k // 2 + 2 * groups:], rep, axis=1)
        qs = np.zeros((num_tiles * tile, nb, 16), dtype=np.uint8)
        qs[:n] = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))  # Q4_1's pairing: k i, k 16 + i
        quants = (qs.reshape(num_tiles, tile, nb, 4, 4).transpose(0, 2, 3, 1, 4)
                  .reshape(num_tiles, nb, 256))
        halves = np.zeros((num_tiles * tile, nb), dtype=np.uint16)
        halves[:n] = s
        zs = np.zeros((num_tiles * tile, nb), dtype=np.uint8)
        zs[:n] = z
        self.packed = np.ascontiguousarray(np.concatenate([
            quants, _tile_halves(halves.view(np.uint8).reshape(-1, nb, 2), num_tiles),
            zs.reshape(num_tiles, tile, nb).transpose(0, 2, 1)], axis=2))
        if self.packed.shape[2] != gguf_block_bytes_of(_GGUF_TYPE_CODE["I4Z"]):
            raise AssertionError("packed block size disagrees with cpu_quant_kernels.h")
        self.flat = self.packed.reshape(-1)
        self.n, self.k, self.ggml_type, self.group = n, k, "I4Z", group
        self.type_code, self.nb, self.num_tiles = _GGUF_TYPE_CODE["I4Z"], nb, num_tiles
        self.offset = gguf_offset(self.type_code)

    @property
    def nbytes(self):
        return self.packed.nbytes

    def dequantize(self):
        """float32 [N, K] from the packed form, with gguf.quants.dequantize's float32 ops."""
        t, nb, tile = self.num_tiles, self.nb, TILE_N
        if self.ggml_type == "Q4_K":
            return self._dequantize_q4_k()
        if self.ggml_type in ("Q6_K", "Q3_K"):  # Q3_K: as Q6_K, d * (sc - 32) * q the same
            return self._dequantize_q6_k()
        if self.ggml_type == "Q5_K":
            return self._dequantize_q5_k()
        as_q8 = self.ggml_type in ("Q8_0", "Q5_0")  # Q5_0: d * (q - 16), the int8 q - 16
        qbytes = 512 if as_q8 else 256
        groups = qbytes // (tile * 4)
        quants = (self.packed[:, :, :qbytes].reshape(t, nb, groups, tile, 4)
                  .transpose(0, 3, 1, 2, 4).reshape(t * tile, nb, groups * 4)[:self.n])

        def scale(off):
            part = self.packed[:, :, qbytes + off:qbytes + off + 32].reshape(t, nb, tile, 2)
            part = np.ascontiguousarray(part.transpose(0, 2, 1, 3)).reshape(t * tile, nb * 2)
            return part[:self.n].view(np.float16).astype(np.float32)[:, :, None]

        d = scale(0)
        if as_q8:
            w = (quants ^ np.uint8(0x80)).view(np.int8).astype(np.float32) * d
        else:
            q = np.concatenate([quants & np.uint8(0x0F), quants >> np.uint8(4)], axis=2)
            if self.ggml_type == "Q4_1":
                w = (d * q.astype(np.float32)) + scale(32)
            elif self.ggml_type == "I4Z":  # s * (q - z): exact in float32
                z = (self.packed[:, :, 288:304].transpose(0, 2, 1).reshape(t * tile, nb)
                     [:self.n, :, None])
                w = d * (q.astype(np.float32) - z.astype(np.float32))
            else:
                w = d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)
        return w.reshape(self.n, self.k)

    def _dequantize_q4_k(self):
        """gguf's float32 ops: (d * sc) * q - dmin * m per 32-block."""
        t, u, tile = self.num_tiles, self.packed.shape[1], TILE_N
        p = self.packed
        nib = (p[:, :, :2048].reshape(t, u, 8, 4, tile, 4).transpose(0, 4, 1, 2, 3, 5)
               .reshape(t * tile, u, 8, 16))
        q = np.concatenate([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=3).astype(np.float32)

        def ints(off):
            part = p[:, :, off:off + 128].reshape(t, u, 8, tile).transpose(0, 3, 1, 2)
            return part.reshape(t * tile, u, 8).astype(np.float32)

        d = _untile_halves(p[:, :, 2304:2336], t, u) * ints(2048)
        dm = _untile_halves(p[:, :, 2336:2368], t, u) * ints(2176)
        w = d[:, :, :, None] * q - dm[:, :, :, None]
        return w.reshape(t * tile, self.k)[:self.n]

    def _dequantize_q5_k(self):
        """gguf's float32 ops: (d * sc) * q - dmin * m per 32-block."""
        t, u, tile = self.num_tiles, self.packed.shape[1], TILE_N
        p = self.packed
        q = (p[:, :, :4096].reshape(t, u, 8, 8, tile, 4).transpose(0, 4, 1, 2, 3, 5)
             .reshape(t * tile, u, 8, 32).astype(np.float32))

        def ints(off):
            part = p[:, :, off:off + 128].reshape(t, u, 8, tile).transpose(0, 3, 1, 2)
            return part.reshape(t * tile, u, 8).astype(np.float32)

        d = _untile_halves(p[:, :, 4352:4384], t, u) * ints(4096)
        dm = _untile_halves(p[:, :, 4384:4416], t, u) * ints(4224)
        w = d[:, :, :, None] * q - dm[:, :, :, None]
        return w.reshape(t * tile, self.k)[:self.n]

    def _dequantize_q6_k(self):
        """gguf's float32 ops: (d * sc) * (q - 32) per 16 weights."""
        t, u, tile = self.num_tiles, self.packed.shape[1], TILE_N
        p = self.packed
        q = (p[:, :, :4096].reshape(t, u, 8, 8, tile, 4).transpose(0, 4, 1, 2, 3, 5)
             .reshape(t * tile, u, 16, 16))
        q = (q.astype(np.int8) - np.int8(32)).astype(np.float32)
        sc = (p[:, :, 4096:4352].reshape(t, u, 16, tile).transpose(0, 3, 1, 2)
              .reshape(t * tile, u, 16).view(np.int8).astype(np.float32))
        d = _untile_halves(p[:, :, 4352:4384], t, u) * sc
        w = d[:, :, :, None] * q
        return w.reshape(t * tile, self.k)[:self.n]


def int4_rows(q, s, z, group):
    """The I4Z raw rows (INT4_GROUPS' comment) of q uint8 [N, K] (0..15), s float16
    [N, K / group], z uint8 [N, K / group] (0..15)."""
    q, z = np.asarray(q), np.asarray(z)
    s = np.asarray(s, dtype=np.float16)
    if group not in INT4_GROUPS:
        raise ValueError(f"group must be one of {INT4_GROUPS}, got {group!r}")
    if q.ndim != 2 or q.shape[1] % group or s.shape != (q.shape[0], q.shape[1] // group) \
            or z.shape != s.shape:
        raise ValueError(f"q [N, K], s and z [N, K / {group}] expected, got {q.shape}, "
                         f"{s.shape}, {z.shape}")
    if q.max(initial=0) > 15 or z.max(initial=0) > 15:
        raise ValueError("q and z must be 4-bit (0..15)")
    q = q.astype(np.uint8)
    nib = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(np.concatenate(
        [nib, np.ascontiguousarray(s).view(np.uint8), z.astype(np.uint8)], axis=1))


cdef void _gguf_tiles(GgufJob* g, int n, const float* bias, float* y, long ldy, int tile_begin,
                      int tile_end, int split) noexcept nogil:
    """Tiles [tile_begin, tile_end) of y on this thread, or (split >= 0) [tile_begin, split)
    here and [split, tile_end) on the native helper."""
    cdef TileJob mine
    memset(&mine, 0, sizeof(TileJob))
    mine.gguf = g
    mine.N = n
    mine.tile_begin = tile_begin
    mine.tile_end = tile_end if split < 0 else split
    mine.bias = bias
    mine.y = y
    mine.ldy = ldy
    cdef TileJob theirs = mine
    theirs.tile_begin = split
    theirs.tile_end = tile_end
    if split < 0:
        run_job(mine)
    else:
        run_split(mine, theirs)


cdef const float* _bias_ptr(bias) except? NULL:
    cdef const float[::1] b
    if bias is None:
        return NULL
    b = bias
    return &b[0]  # borrowed: the caller holds `bias`


cdef GgufJob _gguf_job(packed, int path, int rows) except *:
    """A GgufJob over packed's blocks for `rows` activation rows; activation pointers unset.
    g.wq points into packed.flat: the caller keeps packed alive while the job runs."""
    cdef const uint8_t[::1] wq = packed.flat
    cdef GgufJob g
    memset(&g, 0, sizeof(GgufJob))
    g.type = packed.type_code
    g.path = path
    g.wq = &wq[0]
    g.nb = packed.nb
    g.M = rows
    return g


def _gguf_native(const float[:, :] x, packed, bias, float[:, ::1] y, int path, int split,
                 int residual):
    """The whole call on the calling thread (+ the native helper from tile `split` when >= 0):
    activations quantized into one malloc'ed workspace, then the tiles, without the GIL.
    residual: y has 2M rows, the second M those of the residual pass."""
    cdef const float* b = _bias_ptr(bias)
    cdef int m = x.shape[0], k = x.shape[1], nb = packed.nb, n = packed.n
    cdef int rows = 2 * m if residual else m
    cdef int num_tiles = packed.num_tiles, offset = packed.offset
    cdef GgufJob g = _gguf_job(packed, path, rows)
    cdef size_t per_block = (<size_t>rows) * nb
    # xd, xs, xcorr (4-byte aligned: malloc's alignment), then xq.
    cdef char* work = <char*>malloc(per_block * 12 + (<size_t>rows) * k)
    if work == NULL:
        raise MemoryError()
    g.xd = <float*>work
    g.xs = <float*>(work + per_block * 4)
    g.xcorr = <int32_t*>(work + per_block * 8)
    g.xq = <int8_t*>(work + per_block * 12)
    with nogil:
        gguf_quantize_rows(path, &x[0, 0], x.strides[0] // sizeof(float),
                           x.strides[1] // sizeof(float), m, k, offset, residual,
                           <int8_t*>g.xq, <float*>g.xd, <float*>g.xs, <int32_t*>g.xcorr)
        _gguf_tiles(&g, n, b, &y[0, 0], y.shape[1], 0, num_tiles, split)
    free(work)


def _gguf_run(const int8_t[:, ::1] xq, const float[:, ::1] xd, const float[:, ::1] xs,
              const int32_t[:, ::1] xcorr, packed, bias, float[:, ::1] y, int path,
              int tile_begin, int tile_end):
    """Tiles [tile_begin, tile_end) of y from activations quantized by _gguf_quantize (the
    python pool's share), without the GIL."""
    cdef const float* b = _bias_ptr(bias)
    cdef GgufJob g = _gguf_job(packed, path, xq.shape[0])
    g.xq = &xq[0, 0]
    g.xd = &xd[0, 0]
    g.xs = &xs[0, 0]
    g.xcorr = &xcorr[0, 0]
    cdef int n = packed.n
    with nogil:
        _gguf_tiles(&g, n, b, &y[0, 0], y.shape[1], tile_begin, tile_end, -1)


def _gguf_bf16_run(const uint16_t[:, ::1] xb, packed, bias, float[:, ::1] y, int path,
                   int tile_begin, int tile_end, int split=-1):
    """activations "bf16": tiles [tile_begin, tile_end) of y from x rounded to bf16 (xb [M, K],
    _convert's), on this thread (+ the native helper from tile `split` when >= 0), without the
    GIL."""
    cdef const float* b = _bias_ptr(bias)
    cdef GgufJob g = _gguf_job(packed, path, xb.shape[0])
    g.xb = &xb[0, 0]
    cdef int n = packed.n
    with nogil:
        _gguf_tiles(&g, n, b, &y[0, 0], y.shape[1], tile_begin, tile_end, split)


def _gguf_quantize(const float[:, :] x, int path, int offset, int residual, xq, xd, xs, xcorr):
    cdef int8_t[:, ::1] q = xq
    cdef float[:, ::1] d = xd
    cdef float[:, ::1] s = xs
    cdef int32_t[:, ::1] t = xcorr
    with nogil:
        gguf_quantize_rows(path, &x[0, 0], x.strides[0] // sizeof(float),
                           x.strides[1] // sizeof(float), x.shape[0], x.shape[1], offset,
                           residual, &q[0, 0], &d[0, 0], &s[0, 0], &t[0, 0])


def gemm_gguf(x, packed, bias=None, *, path="auto", threads=2, pool="native",
              activations="q8"):
    """y = x @ W.T (+ bias) for a PackedGgufWeight W, with x quantized to int8 per row per
    32-wide block (pyx/cpu_quant_kernels.h has the exact math).

    x: [M, K] float32 (any strides; other float dtypes are converted); bias: [N] float32 or
    None. Returns a new [M, N] float32 array. path: "auto" or one of GGUF_PATHS; threads and
    pool as gemm_bf16; activations: one of GGUF_ACTIVATION_MODES ("q8x2": y = the kernel's
    rows of the first pass + those of the residual pass, + bias; "bf16": y = bf16(x) @
    bf16(W).T + bias in float32, W the packed weight's dequantize(); "auto": one of those two
    by rows, gguf_activations_for).
    """
    if not isinstance(packed, PackedGgufWeight):
        raise TypeError(f"gemm_gguf takes a PackedGgufWeight, got {type(packed).__name__}")
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    cdef int code = _resolve_gguf_path(path)
    if activations not in GGUF_ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {GGUF_ACTIVATION_MODES}, got "
                         f"{activations!r}")
    x, bias = _gemm_operands(x, packed, bias)
    m = x.shape[0]
    if m == 0:
        return np.empty((0, packed.n), dtype=np.float32)
    cdef int mode = gguf_activations_for_rows(code, _GGUF_ACT_CODE[activations], m)
    if mode == GGUF_ACT_BF16:
        if code != 0 and not gguf_bf16_available():
            raise RuntimeError("activations 'bf16' needs AVX512-BF16, VBMI and VNNI on this "
                               "path; path='portable' runs it on any CPU")
        return _gemm_gguf_bf16(x, packed, bias, code, threads, pool)
    cdef int residual = mode == GGUF_ACT_Q8X2
    rows = 2 * m if residual else m
    y = np.empty((rows, packed.n), dtype=np.float32)
    kernel_bias = None if residual else bias
    num_tiles = packed.num_tiles
    split = -1
    if not (threads < 2 or num_tiles < 2 * MIN_TILES_PER_THREAD
            or rows * packed.n * packed.k < MIN_MACS_PER_THREADED_CALL[pool]):
        split = (num_tiles // 2 + 1) & ~1  # even: both halves on the two-tile micro-kernel
    if pool == "native" or split < 0:
        _gguf_native(x, packed, kernel_bias, y, code, split, residual)
        return _gguf_finish(y, m, bias, residual)
    xq = np.empty((rows, packed.k), dtype=np.int8)
    xd = np.empty((rows, packed.nb), dtype=np.float32)
    xs = np.empty((rows, packed.nb), dtype=np.float32)
    xcorr = np.empty((rows, packed.nb), dtype=np.int32)
    _gguf_quantize(x, code, packed.offset, residual, xq, xd, xs, xcorr)
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrun-gemm")
    job = _pool.submit(_gguf_run, xq, xd, xs, xcorr, packed, kernel_bias, y, code, split,
                       num_tiles)
    _gguf_run(xq, xd, xs, xcorr, packed, kernel_bias, y, code, 0, split)
    job.result()
    return _gguf_finish(y, m, bias, residual)


def _gemm_gguf_bf16(x, packed, bias, int code, threads, pool):
    """gemm_gguf's "bf16" mode: x rounded to bf16 once, the tiles split as the int8 modes'."""
    m = x.shape[0]
    xb = _convert(x, packed.k)
    y = np.empty((m, packed.n), dtype=np.float32)
    num_tiles = packed.num_tiles
    if (threads < 2 or num_tiles < 2 * MIN_TILES_PER_THREAD
            or m * packed.n * packed.k < MIN_MACS_PER_THREADED_CALL[pool]):
        _gguf_bf16_run(xb, packed, bias, y, code, 0, num_tiles)
        return y
    split = (num_tiles // 2 + 1) & ~1  # even: both halves on the two-tile micro-kernel
    if pool == "native":
        _gguf_bf16_run(xb, packed, bias, y, code, 0, num_tiles, split)
        return y
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrun-gemm")
    job = _pool.submit(_gguf_bf16_run, xb, packed, bias, y, code, split, num_tiles)
    _gguf_bf16_run(xb, packed, bias, y, code, 0, split)
    job.result()
    return y


def _gguf_finish(y, m, bias, residual):
    """The kernel's rows -> the [M, N] result: as they are, or (residual) the two passes'
    rows summed, then the bias."""
    if not residual:
        return y
    out = np.add(y[:m], y[m:])
    if bias is not None:
        out += bias
    return out
