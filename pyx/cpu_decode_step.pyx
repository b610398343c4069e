# cython: language_level=3
"""cpu_decode_step: all layers of a pure-decode step in one call without the GIL, for the cpu
bf16 / int8 / gguf backends (runtime/backends/cpu_bf16_backend.py `make_decode_loop`).

    loop = DecodeLoop(layers, hidden=..., ...)     # once per model: weights, buffers
    x, residual = loop(x, positions, slot_mapping, block_tables, context_lens,
                       k_caches, v_caches)         # per decode step

The C++ (pyx/cpu_decode_step.h) runs, per layer, the kernels the Python path of
runtime/models/llama.py calls one by one (cpu_ops_kernels.h's norms, rotary + cache write,
decode attention, SiLU; cpu_gemm_kernels.h's convert_rows + TileJob with cpu_gemm's two-thread
split), with the same arguments: x, residual and the KV caches are bit for bit the Python
path's. A decode step of SmolLM2-135M makes ~270 backend calls there, each with its argument
checks and numpy allocations; here the checks run once per step (the index checks of
cpu_ops' rotary and attention wrappers, over the step's arrays) and the intermediates live in
work buffers allocated once per model, grown to the largest batch seen.

Only dense SwiGLU layers (no MoE, QK-norm, sliding window, post-sublayer norms) with weights
packed as cpu_gemm.PackedWeight, PackedInt8Weight or PackedGgufWeight (the GGUF GEMM's
quantization, kernel rows and split as cpu_gemm.gemm_gguf's, with its `activations` mode, "auto"
resolved per GEMM by the same C++ function, gguf_activations_for_rows):
the backend checks that before it builds
a loop, the model asks for one only where it applies and falls back to the Python path per step
(prefill rows, LoRA, a pipeline stage's input).
"""
import numpy as np

from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free

from pagedrun.pyx.cpu_thread_pool cimport bind_run_pair, process_run_pair, thread_pool_probe
from pagedrun.pyx.cpu_gemm cimport GemmTable, exported_gemm_table
from pagedrun.pyx.cpu_ops cimport OpsTable, exported_ops_table

from pagedrun.pyx import cpu_gemm, cpu_ops

cdef extern from "cpu_decode_step.h" namespace "pagedrun_decode" nogil:
    const int WEIGHT_BF16
    const int WEIGHT_INT8
    const int WEIGHT_GGUF
    const int KV_F32
    const int KV_BF16
    const int KV_FP8
    cdef struct Weight:
        int kind
        const uint16_t* wp
        const int8_t* wq
        const float* scales
        int group_pairs
        const uint8_t* wg
        int gguf_type, nb
        int gguf_offset
        int n, k, kp, num_tiles
        const float* bias
    cdef struct Layer:
        const float* input_norm
        const float* post_norm
        Weight qkv, o, gate_up, down
        const float* cos_sin
        void* k_cache
        void* v_cache
    cdef struct Config:
        int num_layers, hidden, H, KV, D, inter
        float eps, scale
        int ops_path, gemm_path, threads, kv_kind
        long sc0, sc1, sc2
        int block_size
        int min_tiles_per_thread
        long min_macs
        int gguf_path
        int gguf_activations
    cdef struct GgufWork:
        uint16_t* xb
        int8_t* xq
        float* xd
        float* xs
        int32_t* xcorr
        float* y2
    cdef struct Buffers:
        uint16_t* xb
        int xb_cols
        float* h
        float* qkv
        float* q_rot
        float* k_rot
        float* attn
        float* o
        float* gate_up
        float* act
        GgufWork gguf
    cdef struct Step:
        int T
        const float* x_in
        const int32_t* positions
        const int32_t* slots
        const int32_t* block_tables
        long ldb
        const int32_t* context_lens
        float* x_out
        float* residual_out
    void bind_kernel_tables(const GemmTable* gemm, const OpsTable* ops)
    void decode_layers(const Config& c, const Layer* layers, const Buffers& b, const Step& s)
    void gemm_rows(int gemm_path, int threads, int min_tiles_per_thread, long min_macs,
                   uint16_t* xb, const Weight& w, const float* x, long ldx, long ldk, int M,
                   float* y)
    void gemm_rows_gguf(int gguf_path, int activations, int threads, int min_tiles_per_thread,
                        long min_macs, const GgufWork& work, const Weight& w, const float* x,
                        long ldx, long ldk, int M, float* y)


cdef extern from "cpu_gemm_kernels.h" namespace "pagedrun_gemm" nogil:
    const int AMX_ROWS
    const int AMX_MIN_ROWS

cdef extern from "cpu_ops_kernels.h" namespace "pagedrun_ops" nogil:
    int check_rotary_indices(const int32_t* positions, const int32_t* slots, int T,
                             int max_position, long num_slots, long* value)
    int check_decode_tables(const int32_t* block_tables, long ldb, int max_blocks,
                            const int32_t* context_lens, int S, int num_blocks, int block_size,
                            int* seq, long* value)

# The loop's splits run on the process's one helper thread (pagedrun.pyx.cpu_thread_pool).
bind_run_pair(process_run_pair)
# Its kernels are cpu_gemm's and cpu_ops' compiled code (pyx/cpu_decode_step.h: why).
bind_kernel_tables(exported_gemm_table(), exported_ops_table())


def _thread_pool_probe():
    """(address of the run_pair this module's splits call, caller's thread id, id of the
    thread that ran the second part): tests check every module shares the one helper."""
    return thread_pool_probe()


_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_AMX = 3  # cpu_gemm's path code of "amx"
cdef int _MIN_TILES_PER_THREAD = cpu_gemm.MIN_TILES_PER_THREAD
cdef long _MIN_MACS = cpu_gemm.MIN_MACS_PER_THREADED_CALL["native"]
_KV_KINDS = {np.dtype(np.float32): KV_F32, np.dtype(np.uint16): KV_BF16,
             np.dtype(np.uint8): KV_FP8}


_SUPPORTED = (cpu_gemm.PackedWeight, cpu_gemm.PackedInt8Weight, cpu_gemm.PackedGgufWeight)


def weight_supported(w):
    """True for the packed weight types the loop runs (exact types: a subclass may compute
    differently)."""
    return type(w) in _SUPPORTED


cdef Weight _weight(w, bias, int k, list refs) except *:
    """The C view of a packed weight [n, k] (and its bias); refs keeps the arrays alive."""
    cdef Weight out
    cdef const uint16_t[::1] wp
    cdef const int8_t[::1] wq
    cdef const uint8_t[::1] wg
    cdef const float[::1] sc
    cdef const float[::1] bv
    if not weight_supported(w):
        raise TypeError(f"DecodeLoop: unsupported weight {type(w).__name__}")
    if w.k != k:
        raise ValueError(f"DecodeLoop: weight [{w.n}, {w.k}] where K = {k} was expected")
    out.wp = NULL
    out.wq = NULL
    out.scales = NULL
    out.group_pairs = 0
    out.wg = NULL
    out.gguf_type = out.nb = out.gguf_offset = 0
    out.kp = 0
    if type(w) is cpu_gemm.PackedGgufWeight:
        out.kind = WEIGHT_GGUF
        wg = w.flat
        out.wg = &wg[0]
        out.gguf_type, out.nb, out.gguf_offset = w.type_code, w.nb, w.offset
        refs.append(w.flat)
    elif type(w) is cpu_gemm.PackedInt8Weight:
        out.kind = WEIGHT_INT8
        wq = w.flat
        sc = w.flat_scales
        out.wq = &wq[0]
        out.scales = &sc[0]
        out.group_pairs = w.group_size // 2
        refs += [w.flat, w.flat_scales]
    else:
        out.kind = WEIGHT_BF16
        wp = w.flat
        out.wp = &wp[0]
        refs.append(w.flat)
    out.n, out.k, out.num_tiles = w.n, w.k, w.num_tiles
    if out.kind != WEIGHT_GGUF:
        out.kp = w.kp
    out.bias = NULL
    if bias is not None:
        b = np.ascontiguousarray(bias, dtype=_F32)
        if b.shape != (w.n,):
            raise ValueError(f"DecodeLoop: bias {b.shape} for a weight of {w.n} outputs")
        bv = b
        out.bias = &bv[0]
        refs.append(b)
    return out


def _gguf_options(gguf_path, activations):
    """(path code, activation mode code) of cpu_gemm.gemm_gguf's `path` and `activations`
    arguments ("auto" is resolved per call by rows, as gemm_gguf does: the same C++ function)."""
    if activations not in cpu_gemm.GGUF_ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {cpu_gemm.GGUF_ACTIVATION_MODES}, got "
                         f"{activations!r}")
    code = cpu_gemm._resolve_gguf_path(gguf_path)
    if activations == cpu_gemm.GGUF_BF16 and code != 0 and not cpu_gemm.has_gguf_bf16():
        raise RuntimeError("activations 'bf16' needs AVX512-BF16, VBMI and VNNI on this path; "
                           "gguf_path='portable' runs it on any CPU")
    return code, cpu_gemm._GGUF_ACT_CODE[activations]


cdef dict _gguf_work(GgufWork* work, int rows, int k, int n):
    """Arrays of a GgufWork for `rows` kernel rows of width <= k and <= n outputs, pointed to
    by `work`; the caller keeps the returned dict alive while `work` is used."""
    arrays = {"xb": np.empty(rows * k, np.uint16), "xq": np.empty(rows * k, np.int8),
              "xd": np.empty(rows * (k // 32), _F32),
              "xs": np.empty(rows * (k // 32), _F32),
              "xcorr": np.empty(rows * (k // 32), _I32), "y2": np.empty(rows * n, _F32)}
    cdef uint16_t[::1] xb = arrays["xb"]
    cdef int8_t[::1] q = arrays["xq"]
    cdef float[::1] d = arrays["xd"]
    cdef float[::1] xs = arrays["xs"]
    cdef int32_t[::1] corr = arrays["xcorr"]
    cdef float[::1] y2 = arrays["y2"]
    work.xb, work.xq, work.xd = &xb[0], &q[0], &d[0]
    work.xs, work.xcorr, work.y2 = &xs[0], &corr[0], &y2[0]
    return arrays


def _gguf_work_rows(int act_code, int m):
    """Kernel rows a GgufWork needs for m rows of x: 2 m unless the mode is q8 (one pass)."""
    return m if act_code == cpu_gemm._GGUF_ACT_CODE["q8"] else 2 * m


def gemm(x, packed, bias=None, *, path="auto", int threads=2, gguf_path="auto",
         activations="q8x2"):
    """y = bf16(x) @ W.T (+ bias) for a cpu_gemm.PackedWeight or PackedInt8Weight: what
    cpu_gemm.gemm_bf16 / gemm_int8 compute with pool "native" -- the same checks, conversion,
    tile split and bits -- with the process's one helper thread (pyx/cpu_thread_pool.h, the one
    cpu_gemm uses too) as the second thread; for a PackedGgufWeight what
    cpu_gemm.gemm_gguf(x, packed, bias, path=gguf_path, activations=activations) computes, the
    same way. x: [M, K] float32 (any strides); returns a new [M, N] float32 array."""
    cdef int code = cpu_gemm._resolve_path(path)
    x = np.asarray(x)
    if x.dtype != _F32:
        x = x.astype(_F32)
    if x.ndim != 2 or x.shape[1] != packed.k:
        raise ValueError(f"x must be [M, {packed.k}], got shape {x.shape}")
    if x.strides[0] % 4 or x.strides[1] % 4:
        x = np.ascontiguousarray(x)
    cdef list refs = []
    cdef Weight w = _weight(packed, bias, packed.k, refs)
    cdef int m = x.shape[0]
    y = np.empty((m, packed.n), _F32)
    if m == 0:
        return y
    cdef GgufWork work
    cdef int gguf_code, act_code
    cdef const float[:, :] xg
    cdef float[:, ::1] yg
    cdef long gx0, gx1
    if w.kind == WEIGHT_GGUF:
        gguf_code, act_code = _gguf_options(gguf_path, activations)
        refs.append(_gguf_work(&work, _gguf_work_rows(act_code, m), w.k, w.n))
        xg = x
        yg = y
        gx0, gx1 = xg.strides[0] // 4, xg.strides[1] // 4
        with nogil:
            gemm_rows_gguf(gguf_code, act_code, threads, _MIN_TILES_PER_THREAD, _MIN_MACS,
                           work, w, &xg[0, 0], gx0, gx1, m, &yg[0, 0])
        return y
    # The AMX kernel (from AMX_MIN_ROWS rows) reads x in blocks of AMX_ROWS rows.
    cdef int rows = m
    if code == _AMX and m >= AMX_MIN_ROWS:
        rows = (m + AMX_ROWS - 1) // AMX_ROWS * AMX_ROWS
    xb = np.empty(rows * packed.kp * 2, np.uint16)
    cdef uint16_t[::1] xbv = xb
    cdef const float[:, :] xv = x
    cdef float[:, ::1] yv = y
    cdef long ldx = xv.strides[0] // 4, ldk = xv.strides[1] // 4
    with nogil:
        gemm_rows(code, threads, _MIN_TILES_PER_THREAD, _MIN_MACS, &xbv[0], w, &xv[0, 0], ldx,
                  ldk, m, &yv[0, 0])
    return y


cdef const float* _vector(a, int n, list refs, name) except NULL:
    v = np.ascontiguousarray(a, dtype=_F32)
    if v.shape != (n,):
        raise ValueError(f"DecodeLoop: {name} {v.shape}, expected ({n},)")
    refs.append(v)
    cdef const float[::1] view = v
    return &view[0]


cdef class DecodeLoop:
    """The compiled decode layers of one model. layers: per layer a dict with input_norm,
    post_norm ([hidden] float32), qkv, qkv_bias, o, o_bias, gate_up, down (packed weights /
    biases or None), cos_sin ([max_position, head_dim] float32). gemm_path: cpu_gemm's path
    ("auto" or one of cpu_gemm.PATHS); ops_path: cpu_ops' ("auto" or one of its PATHS); threads:
    the GEMM's and attention's (1 or 2), or an object whose `gemm_threads` gives them at each
    call (the backend: benchmarks change it after the model is built); max_tokens: rows the
    buffers hold at first.

    The loop keeps the KV pools of its last call alive (it caches their pointers, checked by
    identity per call)."""

    cdef Config cfg
    cdef Layer* layers
    cdef Buffers buf
    cdef readonly int capacity  # token rows the work buffers hold now
    cdef int max_position
    cdef list refs
    cdef object buffers
    cdef tuple k_refs
    cdef tuple v_refs
    cdef long num_blocks
    cdef object threads_from
    cdef int gguf_k, gguf_n  # widest GGUF weight input / output (0: no GGUF weights)

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, list layers, *, int hidden, int num_heads, int num_kv_heads,
                 int head_dim, int intermediate, double eps, double scale, gemm_path="auto",
                 ops_path="auto", threads=2, int max_tokens=1, gguf_path="auto",
                 activations="q8x2"):
        cdef Config* c = &self.cfg
        cdef Layer* l
        cdef const float[:, ::1] table
        if not layers:
            raise ValueError("DecodeLoop: no layers")
        if head_dim % 2 or num_heads % num_kv_heads:
            raise ValueError(f"DecodeLoop: heads {num_heads}/{num_kv_heads} x {head_dim}")
        c.num_layers, c.hidden, c.inter = len(layers), hidden, intermediate
        c.H, c.KV, c.D = num_heads, num_kv_heads, head_dim
        # cpu_ops and cpu_gemm take eps and scale as doubles and compute with their float32.
        c.eps, c.scale = <float>eps, <float>scale
        c.gemm_path = cpu_gemm._resolve_path(gemm_path)
        # The code cpu_ops' own wrappers pass for the same name ("auto" within its ISA cap;
        # an unknown or unavailable path refused as they refuse it), so the loop and the
        # per-op path run the same kernels.
        c.ops_path = cpu_ops.path_code(ops_path)
        self.threads_from = None if isinstance(threads, int) else threads
        c.threads = threads if self.threads_from is None else threads.gemm_threads
        c.min_tiles_per_thread = _MIN_TILES_PER_THREAD
        c.min_macs = _MIN_MACS
        c.gguf_path, c.gguf_activations = _gguf_options(gguf_path, activations)
        c.kv_kind = -1
        self.gguf_k = self.gguf_n = 0
        self.refs = []
        self.layers = <Layer*>calloc(len(layers), sizeof(Layer))
        if self.layers == NULL:
            raise MemoryError()
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        xb_cols = 0
        self.max_position = -1
        for i, spec in enumerate(layers):
            l = &self.layers[i]
            l.input_norm = _vector(spec["input_norm"], hidden, self.refs, "input_norm")
            l.post_norm = _vector(spec["post_norm"], hidden, self.refs, "post_norm")
            l.qkv = _weight(spec["qkv"], spec.get("qkv_bias"), hidden, self.refs)
            l.o = _weight(spec["o"], spec.get("o_bias"), q_size, self.refs)
            l.gate_up = _weight(spec["gate_up"], None, hidden, self.refs)
            l.down = _weight(spec["down"], None, intermediate, self.refs)
            if (l.qkv.n != q_size + 2 * kv_size or l.o.n != hidden
                    or l.gate_up.n != 2 * intermediate or l.down.n != hidden):
                raise ValueError(f"DecodeLoop: layer {i}: weight shapes do not fit the config")
            t = np.ascontiguousarray(spec["cos_sin"], dtype=_F32)
            if t.ndim != 2 or t.shape[1] != head_dim or t.shape[0] < 1:
                raise ValueError(f"DecodeLoop: cos_sin {t.shape} for head_dim {head_dim}")
            table = t
            l.cos_sin = &table[0, 0]
            self.refs.append(t)
            rows = t.shape[0]
            self.max_position = rows if self.max_position < 0 else min(self.max_position, rows)
            xb_cols = max(xb_cols, 2 * l.qkv.kp, 2 * l.o.kp, 2 * l.gate_up.kp,
                          2 * l.down.kp)
            for kind, wk, wn in ((l.qkv.kind, l.qkv.k, l.qkv.n), (l.o.kind, l.o.k, l.o.n),
                                 (l.gate_up.kind, l.gate_up.k, l.gate_up.n),
                                 (l.down.kind, l.down.k, l.down.n)):
                if kind == WEIGHT_GGUF:
                    self.gguf_k = max(self.gguf_k, wk)
                    self.gguf_n = max(self.gguf_n, wn)
        self.buf.xb_cols = xb_cols
        self.capacity = 0
        self._grow(max(1, max_tokens))

    cdef _grow(self, int rows):
        """Work buffers for `rows` token rows (xb padded to AMX_ROWS rows)."""
        cdef Config* c = &self.cfg
        qkv_n = (c.H + 2 * c.KV) * c.D
        xb = np.zeros(((rows + AMX_ROWS - 1) // AMX_ROWS * AMX_ROWS) * self.buf.xb_cols,
                      np.uint16)
        floats = {name: np.empty(rows * n, _F32) for name, n in (
            ("h", c.hidden), ("qkv", qkv_n), ("q_rot", c.H * c.D), ("k_rot", c.KV * c.D),
            ("attn", c.H * c.D), ("o", c.hidden), ("gate_up", 2 * c.inter),
            ("act", c.inter))}
        cdef uint16_t[::1] xv = xb
        cdef float[::1] fv
        gguf = None
        self.buf.gguf.xq = NULL
        if self.gguf_k:
            gguf = _gguf_work(&self.buf.gguf, _gguf_work_rows(c.gguf_activations, rows),
                              self.gguf_k,
                              self.gguf_n)
        self.buf.xb = &xv[0]
        fv = floats["h"]
        self.buf.h = &fv[0]
        fv = floats["qkv"]
        self.buf.qkv = &fv[0]
        fv = floats["q_rot"]
        self.buf.q_rot = &fv[0]
        fv = floats["k_rot"]
        self.buf.k_rot = &fv[0]
        fv = floats["attn"]
        self.buf.attn = &fv[0]
        fv = floats["o"]
        self.buf.o = &fv[0]
        fv = floats["gate_up"]
        self.buf.gate_up = &fv[0]
        fv = floats["act"]
        self.buf.act = &fv[0]
        self.buffers = (xb, floats, gguf)
        self.capacity = rows

    cdef _bind_caches(self, list k_caches, list v_caches):
        """Point the layers at these KV pools (checked once per distinct list of pools)."""
        cdef Config* c = &self.cfg
        if len(k_caches) != c.num_layers or len(v_caches) != c.num_layers:
            raise ValueError(f"DecodeLoop: {len(k_caches)} / {len(v_caches)} KV caches for "
                             f"{c.num_layers} layers")
        first = k_caches[0]
        if not isinstance(first, np.ndarray) or first.dtype not in _KV_KINDS:
            raise ValueError("DecodeLoop: KV caches must be float32, uint16 or uint8 arrays")
        shape = first.shape
        if len(shape) != 4 or shape[2:] != (c.KV, c.D):
            raise ValueError(f"DecodeLoop: KV cache {shape} for {c.KV} kv heads x {c.D}")
        for cache in list(k_caches) + list(v_caches):
            if (not isinstance(cache, np.ndarray) or cache.dtype != first.dtype
                    or cache.shape != shape or not cache.flags.c_contiguous
                    or not cache.flags.writeable):
                raise ValueError("DecodeLoop: KV caches must be writeable C-contiguous arrays "
                                 "of one dtype and shape")
        for i in range(c.num_layers):
            self.layers[i].k_cache = <void*><size_t>k_caches[i].__array_interface__["data"][0]
            self.layers[i].v_cache = <void*><size_t>v_caches[i].__array_interface__["data"][0]
        c.kv_kind = _KV_KINDS[first.dtype]
        c.block_size = shape[1]
        c.sc2 = c.D
        c.sc1 = <long>c.KV * c.D
        c.sc0 = c.sc1 * shape[1]
        self.num_blocks = shape[0]
        self.k_refs, self.v_refs = tuple(k_caches), tuple(v_caches)

    cdef bint _same_caches(self, list k_caches, list v_caches):
        if self.k_refs is None or len(k_caches) != len(self.k_refs) or len(v_caches) != len(
                self.v_refs):
            return False
        for i in range(len(self.k_refs)):
            if k_caches[i] is not self.k_refs[i] or v_caches[i] is not self.v_refs[i]:
                return False
        return True

    def __call__(self, x, positions, slot_mapping, block_tables, context_lens, k_caches,
                 v_caches):
        """One decode step over every layer: x [T, hidden] float32 (the embedding), one query
        token per sequence; positions, slot_mapping [T]; block_tables [T, max_blocks];
        context_lens [T] (>= 1); k_caches, v_caches: per layer [num_blocks, block_size,
        num_kv_heads, head_dim], written in place. Returns new (x, residual) [T, hidden]
        float32: LlamaModel.forward's."""
        cdef Config* c = &self.cfg
        x = np.ascontiguousarray(x, dtype=_F32)
        if x.ndim != 2 or x.shape[1] != c.hidden or x.shape[0] < 1:
            raise ValueError(f"DecodeLoop: x {x.shape}, expected [T >= 1, {c.hidden}]")
        cdef int T = x.shape[0]
        pos = np.ascontiguousarray(positions, dtype=_I32)
        slots = np.ascontiguousarray(slot_mapping, dtype=_I32)
        tables = np.ascontiguousarray(block_tables, dtype=_I32)
        lens = np.ascontiguousarray(context_lens, dtype=_I32)
        if (pos.shape != (T,) or slots.shape != (T,) or lens.shape != (T,) or tables.ndim != 2
                or tables.shape[0] != T or tables.shape[1] < 1):
            raise ValueError("DecodeLoop: positions, slot_mapping, context_lens must be [T] and "
                             "block_tables [T, max_blocks >= 1]")
        k_caches, v_caches = list(k_caches), list(v_caches)
        if not self._same_caches(k_caches, v_caches):
            self._bind_caches(k_caches, v_caches)
        cdef const int32_t[::1] pv = pos
        cdef const int32_t[::1] sv = slots
        cdef const int32_t[::1] lv = lens
        cdef const int32_t[:, ::1] bt = tables
        cdef long value = 0
        cdef int seq = 0
        # cpu_ops' wrappers' checks, once for the step instead of once per layer.
        cdef int err = check_rotary_indices(&pv[0], &sv[0], T, self.max_position,
                                            self.num_blocks * c.block_size, &value)
        if err:
            raise cpu_ops.rotary_indices_error(err, value, self.num_blocks, c.block_size)
        err = check_decode_tables(&bt[0, 0], bt.shape[1], bt.shape[1], &lv[0], T,
                                  self.num_blocks, c.block_size, &seq, &value)
        if err:
            raise cpu_ops.decode_tables_error(err, seq, value, bt.shape[1], c.block_size,
                                              self.num_blocks)
        if self.threads_from is not None:
            c.threads = self.threads_from.gemm_threads
        if T > self.capacity:
            self._grow(T)
        x_out = np.empty((T, c.hidden), _F32)
        residual = np.empty((T, c.hidden), _F32)
        cdef const float[:, ::1] xin = x
        cdef float[:, ::1] xo = x_out
        cdef float[:, ::1] ro = residual
        cdef Step step
        cdef Layer* layers = self.layers
        cdef Buffers* buf = &self.buf
        step.T = T
        step.x_in = &xin[0, 0]
        step.positions = &pv[0]
        step.slots = &sv[0]
        step.block_tables = &bt[0, 0]
        step.ldb = bt.shape[1]
        step.context_lens = &lv[0]
        step.x_out = &xo[0, 0]
        step.residual_out = &ro[0, 0]
        with nogil:
            decode_layers(c[0], layers, buf[0], step)
        return x_out, residual
