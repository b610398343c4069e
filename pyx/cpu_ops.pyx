# cython: language_level=3
"""cpu_ops: the non-GEMM ops of a decoder layer in C++ for the cpu bf16 backend
(runtime/backends/cpu_bf16_backend.py); the kernels and their contract are pyx/cpu_ops_kernels.h.

    out = rms_norm(x, weight, eps)
    out, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    out = silu_and_mul(gate_up);  out = gelu_tanh_and_mul(gate_up)
    q_rot, k_rot = rotary_embedding_and_cache_write(q, k, v, positions, cos_sin_cache,
                                                    k_cache, v_cache, slot_mapping)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                 sliding_window=None)

Each has runtime/backends/numpy_ops.py's contract (arguments, the KV cache layout, negative slot
= padding, context_len >= 1, sliding window, the same ValueErrors) and one pass of C++ instead of
several numpy passes: float32 math, the kernels run without the GIL. Activations may be float32
or float16 (numpy_ops' dtype policy: a float16 input gives a float16 output, computed in float32
here through a copy; one difference: a float16 k goes into the cache as its float32 rotation,
where numpy writes the float16-rounded one). The KV caches must be float32, uint16 holding
bf16 bits (kv_cache_dtype "bfloat16": written rounded to nearest even as weights.to_bf16_bits,
read widened exactly, as numpy_ops does with such a cache) or uint8 holding fp8 e4m3 bits
(kv_cache_dtype "fp8": written rounded to nearest even and saturated to +-448 as
numpy_ops.to_fp8_e4m3_bits, scale 1.0, read widened exactly), both of one dtype, with a contiguous
last dimension (they are written or read in place). Activation strides are used as they are
(q/k/v arrive as views of the fused qkv GEMM output: no copies); only an activation whose last
dimension is not contiguous is copied. (pyx/ may not import runtime/, so numpy_ops' checks are
restated here; tests/pyx/test_cpu_ops.py holds the two to the same errors.)

Paths: "avx512" (AVX512F), "avx2" (AVX2 + FMA) and "portable" (scalar C++, any CPU), the SIMD
ones chosen at run time; "auto" picks the fastest the CPU runs, unless set_isa_cap limits it
(auto_path() names the pick). Tests force each through every op's `path=`; forcing a path the
CPU lacks raises RuntimeError.
"""
import numpy as np

from libc.stdint cimport int32_t, uint8_t, uint16_t

from pagedrun.pyx.cpu_thread_pool cimport bind_run_pair, process_run_pair, thread_pool_probe

cdef extern from "cpu_ops_kernels.h" namespace "pagedrun_ops" nogil:
    const int ACT_SILU
    const int ACT_GELU_TANH
    const int ERR_POSITION
    const int ERR_SLOT_RANGE
    const int ERR_SLOT_DUPLICATE
    const int ERR_CONTEXT_LEN
    const int ERR_CAPACITY
    const int ERR_BLOCK_ID
    const int PATH_PORTABLE
    const int PATH_AVX512
    const int PATH_AVX2
    int cpu_has_avx512f()
    int cpu_has_ops_avx2()
    int check_rotary_indices(const int32_t* positions, const int32_t* slots, int T,
                             int max_position, long num_slots, long* value)
    int check_decode_tables(const int32_t* block_tables, long ldb, int max_blocks,
                            const int32_t* context_lens, int S, int num_blocks, int block_size,
                            int* seq, long* value)
    void rms_norm_rows(int path, const float* x, long ldx, const float* w, int rows, int hidden,
                       float eps, float* out, long ldo)
    void fused_add_rms_norm_rows(int path, const float* x, long ldx, const float* res, long ldr,
                                 const float* w, int rows, int hidden, float eps, float* out,
                                 long ldo, float* new_res, long ldn)
    void act_and_mul_rows(int path, int kind, const float* gate_up, long ldg, int rows,
                          int inter, float* out, long ldo)
    # Templates over the cache element type (float32, bf16 bits, fp8 e4m3 bits: cache_t).
    void rotary_cache_write[C](
        int path, const float* q, long sq0, long sq1, const float* k, long sk0, long sk1,
        const float* v, long sv0, long sv1, const int32_t* positions, const float* cos_sin,
        const int32_t* slots, int T, int H, int KV, int D, C* k_cache, C* v_cache,
        long sc0, long sc1, long sc2, int block_size, float* q_rot, float* k_rot)
    void decode_attention_kernel "pagedrun_ops::paged_decode_attention"[C](
        int path, const float* q, long sq0, long sq1, const C* k_cache, const C* v_cache,
        long sc0, long sc1, long sc2, int block_size, const int32_t* block_tables, long ldb,
        const int32_t* context_lens, int S, int H, int KV, int D, float scale, int has_window,
        long sliding_window, float* out)

# paged_decode_attention's split runs on the process's one helper thread
# (pagedrun.pyx.cpu_thread_pool).
bind_run_pair(process_run_pair)


cdef extern from "cpu_ops_kernels.h" namespace "pagedrun_ops" nogil:
    const OpsTable* ops_table()


cdef const OpsTable* exported_ops_table() noexcept nogil:
    return ops_table()


def _thread_pool_probe():
    """(address of the run_pair this module's splits call, caller's thread id, id of the
    thread that ran the second part): tests check every module shares the one helper."""
    return thread_pool_probe()


# The KV cache element types: float32, uint16 bf16 bits, uint8 fp8 e4m3 bits.
ctypedef fused cache_t:
    float
    uint16_t
    uint8_t

PATHS = ("portable", "avx2", "avx512")
_PATH_CODE = {"portable": PATH_PORTABLE, "avx2": PATH_AVX2, "avx512": PATH_AVX512}
_PATH_NAME = {code: name for name, code in _PATH_CODE.items()}
cdef int _HAS_AVX512 = cpu_has_avx512f()
cdef int _HAS_AVX2 = cpu_has_ops_avx2()
# set_isa_cap's names: "amx" (the GEMM's top ISA) caps nothing here, these ops have no AMX path.
ISA_CAPS = ("auto", "amx", "avx512", "avx2", "portable")
_INT32_MIN, _INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_I32 = np.dtype(np.int32)
_U16 = np.dtype(np.uint16)  # a KV cache of bf16 bits
_U8 = np.dtype(np.uint8)  # a KV cache of fp8 e4m3 bits
# The cache kinds _cache_kind returns.
cdef enum:
    KV_F32 = 0
    KV_BF16 = 1
    KV_FP8 = 2


def has_avx512f():
    """True when this CPU runs the AVX512F path."""
    return bool(_HAS_AVX512)


def has_avx2():
    """True when this CPU runs the AVX2 path (AVX2 and FMA)."""
    return bool(_HAS_AVX2)


def available_paths():
    """The paths this CPU runs, fastest first."""
    return tuple(p for p, ok in (("avx512", _HAS_AVX512), ("avx2", _HAS_AVX2),
                                 ("portable", True)) if ok)


cdef str _isa_cap = "auto"
# The code "auto" resolves to, kept current by set_isa_cap: _resolve_path runs on every call.
cdef int _auto_code = _PATH_CODE[available_paths()[0]]


def set_isa_cap(name):
    """Limit what "auto" picks (a forced path= is unaffected): "auto", "amx" or "avx512" -> the
    fastest path this CPU runs; "avx2" -> avx2 where the CPU has it, else portable; "portable"
    -> portable. Returns the previous cap (to restore it)."""
    global _isa_cap, _auto_code
    if name not in ISA_CAPS:
        raise ValueError(f"isa cap must be one of {ISA_CAPS}, got {name!r}")
    allowed = {"portable": ("portable",), "avx2": ("avx2", "portable")}.get(name, PATHS)
    previous = _isa_cap
    _auto_code = _PATH_CODE[next(p for p in available_paths() if p in allowed)]
    _isa_cap = name
    return previous


def auto_path():
    """The path "auto" resolves to now (the fastest the CPU runs, within set_isa_cap's cap)."""
    return _PATH_NAME[_auto_code]


cdef int _resolve_path(path) except -1:
    if path == "auto":
        return _auto_code
    code = _PATH_CODE.get(path)
    if code is None:
        raise ValueError(f"path must be 'auto' or one of {PATHS}, got {path!r}")
    if (code == PATH_AVX512 and not _HAS_AVX512) or (code == PATH_AVX2 and not _HAS_AVX2):
        raise RuntimeError(f"this CPU cannot run the {path} path")
    return code


def path_code(path="auto"):
    """The kernels' int path code (PATH_* in cpu_ops_kernels.h) of "auto" (within the cap) or a
    forced path, checked as every op checks it: for C++ callers such as cpu_decode_step."""
    return _resolve_path(path)


cdef _activation(x):
    """(float32 array with a contiguous last dimension, the output dtype): numpy_ops' policy,
    float16 in -> float16 out, anything else computed and returned as float32."""
    x = np.asarray(x)
    out_dtype = _F16 if x.dtype == _F16 else _F32
    if x.dtype != _F32 or (x.ndim and x.shape[x.ndim - 1] > 1 and x.strides[x.ndim - 1] != 4) \
            or any(s % 4 for s in x.strides):
        x = np.ascontiguousarray(x, dtype=_F32)
    return x, out_dtype


cdef _indices(a):
    """An int32 array of an index argument; other integer dtypes are clipped into int32 first
    (a clipped value stays out of range of any cache, so the range checks still catch it)."""
    a = np.asarray(a)
    if a.dtype == _I32:
        return np.ascontiguousarray(a)
    if a.size:
        a = np.clip(a, _INT32_MIN, _INT32_MAX)
    return np.ascontiguousarray(a, dtype=_I32)


cdef _cache(c, name):
    if not isinstance(c, np.ndarray) or (c.dtype != _F32 and c.dtype != _U16
                                         and c.dtype != _U8):
        raise ValueError(f"{name} must be a float32 numpy array (it is read or written in place)"
                         ", a uint16 one of bf16 bits or a uint8 one of fp8 e4m3 bits")
    return c


cdef int _cache_kind(k_cache, v_cache) except -1:
    """KV_F32, KV_BF16 (uint16 bf16 bits) or KV_FP8 (uint8 e4m3 bits); both one dtype."""
    _cache(k_cache, "k_cache")
    _cache(v_cache, "v_cache")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} / v_cache {v_cache.dtype}: dtypes differ")
    if k_cache.dtype == _U16:
        return KV_BF16
    return KV_FP8 if k_cache.dtype == _U8 else KV_F32


cdef _rows(x):
    """x as 2-D rows over its last axis (a view where numpy can make one)."""
    return x.reshape(-1, x.shape[x.ndim - 1]) if x.ndim != 2 else x


def rotary_indices_error(int err, long value, long num_blocks, int block_size):
    """The ValueError of check_rotary_indices' error code `err` (non-zero)."""
    if err == ERR_POSITION:
        return ValueError("positions out of range of cos_sin_cache")
    if err == ERR_SLOT_RANGE:
        return ValueError(f"slot {value} out of range of {num_blocks}x{block_size} cache")
    return ValueError("slot_mapping writes the same slot twice in one step")


def decode_tables_error(int err, int seq, long value, long max_blocks, int block_size,
                        long num_blocks):
    """The ValueError of check_decode_tables' error code `err` (non-zero)."""
    if err == ERR_CONTEXT_LEN:
        return ValueError(f"sequence {seq}: context_len must be >= 1, got {value}")
    if err == ERR_CAPACITY:
        return ValueError(f"context_len {value} exceeds block table capacity "
                          f"{max_blocks} x {block_size}")
    return ValueError(f"block_tables: block id out of range [0, {num_blocks})")


def rms_norm(x, weight, double eps, *, path="auto"):
    """numpy_ops.rms_norm: out = x / sqrt(mean(x^2) + eps) * weight per row, float32 math.

    x: [..., hidden]; weight: [hidden]. Returns a new array of x's shape (x's dtype policy).
    """
    cdef int code = _resolve_path(path)
    x, out_dtype = _activation(x)
    cdef int hidden = x.shape[x.ndim - 1] if x.ndim else 0
    w = np.ascontiguousarray(weight, dtype=_F32)
    if x.ndim == 0 or w.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {w.shape} for x {x.shape}")
    out = np.empty(x.shape, _F32)
    x2 = _rows(x)
    cdef const float[:, :] xs
    cdef const float[::1] wv = w
    cdef float[:, ::1] ov = out.reshape(x2.shape)
    if x2.shape[0] and hidden:
        xs = x2
        with nogil:
            rms_norm_rows(code, &xs[0, 0], xs.strides[0] // 4, &wv[0], xs.shape[0],
                          xs.shape[1], <float>eps, &ov[0, 0], ov.shape[1])
    return out if out_dtype is _F32 else out.astype(out_dtype)


def fused_add_rms_norm(x, residual, weight, double eps, *, path="auto"):
    """numpy_ops.fused_add_rms_norm: new_residual = x + residual (float32), out =
    rms_norm(new_residual). x, residual: [..., hidden]; weight: [hidden].
    Returns (out in x's dtype policy, new_residual float32), both new arrays."""
    cdef int code = _resolve_path(path)
    x, out_dtype = _activation(x)
    residual, _ = _activation(residual)
    if x.shape != residual.shape or x.ndim == 0:
        raise ValueError(f"fused_add_rms_norm: x {x.shape} and residual {residual.shape} differ")
    cdef int hidden = x.shape[x.ndim - 1]
    w = np.ascontiguousarray(weight, dtype=_F32)
    if w.shape != (hidden,):
        raise ValueError(f"fused_add_rms_norm: weight {w.shape} for x {x.shape}")
    out = np.empty(x.shape, _F32)
    new_residual = np.empty(x.shape, _F32)
    x2, r2 = _rows(x), _rows(residual)
    cdef const float[:, :] xs
    cdef const float[:, :] rs
    cdef const float[::1] wv = w
    cdef float[:, ::1] ov = out.reshape(x2.shape)
    cdef float[:, ::1] nv = new_residual.reshape(x2.shape)
    if x2.shape[0] and hidden:
        xs, rs = x2, r2
        with nogil:
            fused_add_rms_norm_rows(code, &xs[0, 0], xs.strides[0] // 4, &rs[0, 0],
                                    rs.strides[0] // 4, &wv[0], xs.shape[0], xs.shape[1],
                                    <float>eps, &ov[0, 0], ov.shape[1], &nv[0, 0], nv.shape[1])
    return (out if out_dtype is _F32 else out.astype(out_dtype)), new_residual


cdef _act_and_mul(gate_up, int kind, path):
    cdef int code = _resolve_path(path)
    g, out_dtype = _activation(gate_up)
    if g.ndim == 0 or g.shape[g.ndim - 1] % 2:
        raise ValueError(f"gate_up width {g.shape[g.ndim - 1] if g.ndim else 0} is odd")
    cdef int inter = g.shape[g.ndim - 1] // 2
    out = np.empty(g.shape[:g.ndim - 1] + (inter,), _F32)
    g2 = _rows(g)
    cdef const float[:, :] gs
    cdef float[:, ::1] ov = out.reshape(g2.shape[0], inter)
    if g2.shape[0] and inter:
        gs = g2
        with nogil:
            act_and_mul_rows(code, kind, &gs[0, 0], gs.strides[0] // 4, gs.shape[0], inter,
                             &ov[0, 0], ov.shape[1])
    return out if out_dtype is _F32 else out.astype(out_dtype)


def silu_and_mul(gate_up, *, path="auto"):
    """numpy_ops.silu_and_mul: silu(gate) * up. gate_up: [..., 2 * inter], gate half first.
    Returns [..., inter]."""
    return _act_and_mul(gate_up, ACT_SILU, path)


def gelu_tanh_and_mul(gate_up, *, path="auto"):
    """numpy_ops.gelu_tanh_and_mul: gelu_tanh(gate) * up (GeGLU); silu_and_mul's layout."""
    return _act_and_mul(gate_up, ACT_GELU_TANH, path)


cdef void _rotary_write(int code, const float[:, :, :] qs, const float[:, :, :] ks,
                        const float[:, :, :] vs, const int32_t[::1] pv, const float[:, ::1] ts,
                        const int32_t[::1] sv, cache_t[:, :, :, ::1] kc,
                        cache_t[:, :, :, ::1] vc, float[:, :, ::1] qo, float[:, :, ::1] ko):
    """rotary_cache_write<cache_t> over the checked views (strides in elements)."""
    cdef long es = sizeof(cache_t)
    with nogil:
        rotary_cache_write(
            code, &qs[0, 0, 0], qs.strides[0] // 4, qs.strides[1] // 4, &ks[0, 0, 0],
            ks.strides[0] // 4, ks.strides[1] // 4, &vs[0, 0, 0], vs.strides[0] // 4,
            vs.strides[1] // 4, &pv[0], &ts[0, 0], &sv[0], qs.shape[0], qs.shape[1],
            ks.shape[1], qs.shape[2], &kc[0, 0, 0, 0], &vc[0, 0, 0, 0], kc.strides[0] // es,
            kc.strides[1] // es, kc.strides[2] // es, kc.shape[1], &qo[0, 0, 0], &ko[0, 0, 0])


cdef void _decode_attention(int code, const float[:, :, :] qs, const cache_t[:, :, :, ::1] kc,
                            const cache_t[:, :, :, ::1] vc, const int32_t[:, ::1] bt,
                            const int32_t[::1] lv, double scale, int has_window, long window,
                            float[:, :, ::1] ov):
    """paged_decode_attention<cache_t> over the checked views (strides in elements)."""
    cdef long es = sizeof(cache_t)
    with nogil:
        decode_attention_kernel(
            code, &qs[0, 0, 0], qs.strides[0] // 4, qs.strides[1] // 4, &kc[0, 0, 0, 0],
            &vc[0, 0, 0, 0], kc.strides[0] // es, kc.strides[1] // es, kc.strides[2] // es,
            kc.shape[1], &bt[0, 0], bt.shape[1], &lv[0], qs.shape[0], qs.shape[1],
            kc.shape[2], qs.shape[2], <float>scale, has_window, window, &ov[0, 0, 0])


def rotary_embedding_and_cache_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                     slot_mapping, *, path="auto"):
    """numpy_ops.rotary_embedding_and_cache_write: rotate q and k by their positions, write
    rotated k and raw v into the paged cache at slot_mapping (negative slot: not written).

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (strided views allowed);
    positions, slot_mapping: [T] int; cos_sin_cache: [max_position, head_dim] float32;
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] float32, uint16 bf16
    bits (k and v rounded to nearest even) or uint8 fp8 e4m3 bits (rounded to nearest even,
    saturated to +-448), in place.
    Returns (q_rot, k_rot), new contiguous arrays (q's and k's dtype policy).
    """
    cdef int code = _resolve_path(path)
    q, q_dtype = _activation(q)
    k, k_dtype = _activation(k)
    v, _ = _activation(v)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: token counts/shapes differ")
    table = np.ascontiguousarray(cos_sin_cache, dtype=_F32)
    if table.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache width {table.shape[1]} != head_dim {head_dim}")
    pos, slots = _indices(positions), _indices(slot_mapping)
    if pos.shape != (num_tokens,) or slots.shape != (num_tokens,):
        raise ValueError("positions and slot_mapping must be [num_tokens]")
    cdef int kind = _cache_kind(k_cache, v_cache)
    num_kv_heads = k.shape[1]
    if (k_cache.ndim != 4 or k_cache.shape != v_cache.shape
            or k_cache.shape[2:] != (num_kv_heads, head_dim)):
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} for k {k.shape}")
    if head_dim % 2 or num_heads == 0 or num_kv_heads == 0:
        raise ValueError(f"q {q.shape} / k {k.shape}: need an even head_dim and heads")
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    cdef const int32_t[::1] pv = pos
    cdef const int32_t[::1] sv = slots
    cdef long value = 0
    cdef int err = 0
    if num_tokens:
        err = check_rotary_indices(&pv[0], &sv[0], num_tokens, table.shape[0],
                                   <long>num_blocks * block_size, &value)
    if err:
        raise rotary_indices_error(err, value, num_blocks, block_size)
    q_rot = np.empty(q.shape, _F32)
    k_rot = np.empty(k.shape, _F32)
    if num_tokens == 0 or head_dim == 0:
        return q_rot.astype(q_dtype, copy=False), k_rot.astype(k_dtype, copy=False)
    cdef const float[:, :, :] qs = q
    cdef const float[:, :, :] ks = k
    cdef const float[:, :, :] vs = v
    cdef const float[:, ::1] ts = table
    cdef float[:, :, ::1] qo = q_rot
    cdef float[:, :, ::1] ko = k_rot
    if kind == KV_FP8:
        _rotary_write[uint8_t](code, qs, ks, vs, pv, ts, sv, k_cache, v_cache, qo, ko)
    elif kind == KV_BF16:
        _rotary_write[uint16_t](code, qs, ks, vs, pv, ts, sv, k_cache, v_cache, qo, ko)
    else:
        _rotary_write[float](code, qs, ks, vs, pv, ts, sv, k_cache, v_cache, qo, ko)
    return q_rot.astype(q_dtype, copy=False), k_rot.astype(k_dtype, copy=False)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, double scale,
                           sliding_window=None, *, path="auto"):
    """numpy_ops.paged_decode_attention: one query token per sequence over its paged context
    (with sliding_window: its last sliding_window positions, itself included).

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] float32, uint16 bf16 bits or uint8 fp8 e4m3 bits (widened exactly);
    block_tables: [num_seqs, max_blocks] int; context_lens: [num_seqs] int,
    each >= 1. Returns [num_seqs, num_heads, head_dim] (q's dtype policy).
    """
    cdef int code = _resolve_path(path)
    q, out_dtype = _activation(q)
    cdef int kind = _cache_kind(k_cache, v_cache)
    # numpy_ops._check_attention_shapes
    num_seqs, num_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape}: expected equal "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    lens = _indices(context_lens)
    tables = np.asarray(block_tables)
    if lens.shape != (num_seqs,) or tables.shape[0] != num_seqs:
        raise ValueError("block_tables / context_lens rows must match q's num_seqs")
    tables = _indices(tables)
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tables.shape}")
    out = np.empty(q.shape, _F32)
    if num_seqs == 0:
        return out.astype(out_dtype, copy=False)
    cdef const int32_t[::1] lv = lens
    cdef const int32_t[:, ::1] bt = tables if tables.shape[1] else np.zeros((num_seqs, 1), _I32)
    cdef int seq = 0
    cdef long value = 0
    cdef int err = check_decode_tables(&bt[0, 0], bt.shape[1], tables.shape[1], &lv[0],
                                       num_seqs, num_blocks, block_size, &seq, &value)
    if err:
        raise decode_tables_error(err, seq, value, tables.shape[1], block_size, num_blocks)
    if head_dim == 0:
        return out.astype(out_dtype, copy=False)
    cdef int has_window = sliding_window is not None
    cdef long window = int(sliding_window) if has_window else 0
    cdef const float[:, :, :] qs = q
    cdef float[:, :, ::1] ov = out
    if kind == KV_FP8:
        _decode_attention[uint8_t](code, qs, k_cache, v_cache, bt, lv, scale, has_window,
                                   window, ov)
    elif kind == KV_BF16:
        _decode_attention[uint16_t](code, qs, k_cache, v_cache, bt, lv, scale, has_window,
                                    window, ov)
    else:
        _decode_attention[float](code, qs, k_cache, v_cache, bt, lv, scale, has_window,
                                 window, ov)
    return out.astype(out_dtype, copy=False)
