// cpu_decode_step.h: every layer of a pure-decode step of a dense Llama-family model in one C++
// call (pyx/cpu_decode_step.pyx wraps it for runtime/backends/cpu_bf16_backend.py).
//
// Per layer, exactly the backend calls runtime/models/llama.py's `forward` makes, on the same
// kernels with the same arguments, so x and residual and the KV caches come out bit for bit
// the same as the Python path's:
//   h = rms_norm(x) (layer 0; residual = x) | h, residual = fused_add_rms_norm(x, residual)
//   qkv = h @ Wqkv (+ bias)                           GEMM: convert_rows + TileJob (cpu_gemm)
//   q_rot = rotary(q, k) and k_rot, v -> paged cache  rotary_cache_write<C>   (cpu_ops)
//   attn = paged_decode_attention(q_rot)              decode_seq_range<C>     (cpu_ops)
//   o = attn @ Wo (+ bias);  h, residual = fused_add_rms_norm(o, residual)
//   gate_up = h @ Wgu;  act = silu(gate) * up;  x = act @ Wdown
// The GEMM's thread split is cpu_gemm.pyx's `_gemm` (native pool): one thread below
// MIN_TILES_PER_THREAD tiles per thread or MIN_MACS multiply-adds, else tiles [0, split) here
// and [split, num_tiles) on the helper, split = (num_tiles / 2 + 1) & ~1; AMX (path 3) from
// AMX_MIN_ROWS rows reads x in blocks of AMX_ROWS rows, the pad rows zero.
// Threads: the GEMM halves and, from two sequences up, the two halves of decode attention (split
// at half the total context, as cpu_ops' attention splits large batches: each sequence is
// computed alone, so the split does not change a bit) run on the process's one helper thread
// (cpu_thread_pool.h's run_pair, the same helper cpu_gemm and cpu_ops use). cpu_ops splits its
// attention only from 8 M multiply-adds; the polled hand-off costs ~1 us, so here every batch
// of two or more splits.
//
// The caller (the .pyx) validates shapes, dtypes and index ranges once per step; everything
// here trusts its inputs and runs without the GIL.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "cpu_gemm_kernels.h"
#include "cpu_ops_kernels.h"
#include "cpu_thread_pool.h"

namespace pagedrun_decode {

// The kernels, as cpu_gemm and cpu_ops compiled them: their tables (GemmTable, OpsTable: why
// there), bound once at import by pyx/cpu_decode_step.pyx before any loop can run. This header
// calls no kernel directly, so its module compiles none of them.
static const pagedrun_gemm::GemmTable* g_gemm = nullptr;
static const pagedrun_ops::OpsTable* g_ops = nullptr;

static inline void bind_kernel_tables(const pagedrun_gemm::GemmTable* gemm,
                                      const pagedrun_ops::OpsTable* ops) {
    g_gemm = gemm;
    g_ops = ops;
}

// The packed forms of a GEMM weight this loop runs: cpu_gemm.PackedWeight (bf16),
// PackedInt8Weight, and PackedGgufWeight (GGUF blocks, pyx/cpu_quant_kernels.h: its TileJob
// carries a GgufJob over x quantized by gguf_quantize_rows instead of xb; gemm_rows_gguf).
enum { WEIGHT_BF16 = 0, WEIGHT_INT8 = 1, WEIGHT_GGUF = 2 };
// The KV cache element: float32, bf16 bits, fp8 e4m3 bits.
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

struct Weight {
    int kind;
    const uint16_t* wp;    // WEIGHT_BF16
    const int8_t* wq;      // WEIGHT_INT8, with scales and group_pairs
    const float* scales;
    int group_pairs;
    const uint8_t* wg;     // WEIGHT_GGUF: PackedGgufWeight.flat, with its type, blocks per row
    int gguf_type, nb;     // and the activations' correction offset (gguf_offset)
    int gguf_offset;
    int n, k, kp, num_tiles;
    const float* bias;     // [n] or nullptr
};

struct Layer {
    const float* input_norm;
    const float* post_norm;
    Weight qkv, o, gate_up, down;
    const float* cos_sin;  // [max_position, D]
    void* k_cache;         // [NB, BS, KV, D] C-contiguous, element per kv_kind
    void* v_cache;
};

struct Config {
    int num_layers, hidden, H, KV, D, inter;
    float eps, scale;
    int ops_path, gemm_path, threads, kv_kind;
    long sc0, sc1, sc2;
    int block_size;
    int min_tiles_per_thread;
    long min_macs;  // per threaded call
    int gguf_path;      // cpu_gemm's GGUF path code (0 portable, 1 avx512vnni, 2 amx, 3 amx-emulated)
    int gguf_activations;  // cpu_gemm's GGUF activation mode code (GGUF_ACT_*; auto per call)
};

// gemm_gguf's workspace for up to R kernel rows (2 M with the residual pass) of width <= Kmax
// and outputs <= Nmax: xq [R, Kmax] int8, xd / xs / xcorr [R, Kmax / 32], y2 [R, Nmax] (the two
// passes' rows before they are summed); xb [R, Kmax] bf16 (activations "bf16").
struct GgufWork {
    uint16_t* xb;
    int8_t* xq;
    float* xd;
    float* xs;
    int32_t* xcorr;
    float* y2;
};

// Work buffers, each for at least T rows (the .pyx owns them). xb: rows rounded up to AMX_ROWS,
// xb_cols uint16 per row (the widest 2 * kp of the four weights).
struct Buffers {
    uint16_t* xb;
    int xb_cols;
    float *h, *qkv, *q_rot, *k_rot, *attn, *o, *gate_up, *act;
    GgufWork gguf;  // null pointers when no layer has GGUF weights
};

struct Step {
    int T;
    const float* x_in;            // [T, hidden], the embedding
    const int32_t* positions;     // [T]
    const int32_t* slots;         // [T]
    const int32_t* block_tables;  // [T, ldb]
    long ldb;
    const int32_t* context_lens;  // [T]
    float* x_out;                 // [T, hidden]
    float* residual_out;          // [T, hidden]
};

// All of `job`'s tiles: on this thread alone below cpu_gemm's thresholds (tiles per thread,
// multiply-adds `macs` of the call), else split at cpu_gemm's point -- an even tile, so both
// halves stay on the two-tile micro-kernel -- with the loop's worker taking the second half.
static inline void run_tiles(pagedrun_gemm::TileJob& job, int num_tiles, int threads,
                             int min_tiles_per_thread, long macs, long min_macs) {
    if (threads < 2 || num_tiles < 2 * min_tiles_per_thread || macs < min_macs) {
        job.tile_begin = 0;
        job.tile_end = num_tiles;
        g_gemm->run_job(job);
        return;
    }
    const int split = (num_tiles / 2 + 1) & ~1;
    pagedrun_gemm::TileJob mine = job, theirs = job;
    mine.tile_begin = 0;
    mine.tile_end = split;
    theirs.tile_begin = split;
    theirs.tile_end = num_tiles;
    g_gemm->run_split(mine, theirs);
}

// y [M, w.n] = x [M, w.k] (strides ldx, ldk) @ W.T (+ bias): cpu_gemm._gemm's native path,
// x converted into xb (M rows, or M rounded up to AMX_ROWS on the AMX path).
static inline void gemm_rows(int gemm_path, int threads, int min_tiles_per_thread,
                             long min_macs, uint16_t* xb, const Weight& w, const float* x,
                             long ldx, long ldk, int M, float* y) {
    using namespace pagedrun_gemm;
    TileJob job;
    memset(&job, 0, sizeof(job));
    const int kp2 = w.kp * 2;
    const bool amx_rows = gemm_path == 3 && M >= AMX_MIN_ROWS;
    const int rows = amx_rows ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;
    g_gemm->convert_rows(x, ldx, ldk, M, w.k, xb, kp2);
    if (rows > M) memset(xb + (long)M * kp2, 0, sizeof(uint16_t) * (size_t)(rows - M) * kp2);
    job.path = gemm_path;
    job.xb = xb;
    job.M = M;
    job.kp = w.kp;
    if (w.kind == WEIGHT_INT8) {
        job.wq = w.wq;
        job.scales = w.scales;
        job.group_pairs = w.group_pairs;
    } else {
        job.wp = w.wp;
    }
    job.N = w.n;
    job.bias = w.bias;
    job.y = y;
    job.ldy = w.n;
    run_tiles(job, w.num_tiles, threads, min_tiles_per_thread, (long)M * w.n * w.k, min_macs);
}

// y [M, w.n] = x [M, w.k] @ W.T (+ bias) for GGUF blocks: cpu_gemm.gemm_gguf's native path
// step for step (the same activation mode for M rows, quantization, kernel rows, split point
// and sums, so the same bits): x quantized into `work`, the kernel's rows (2 M with the
// residual pass, summed after, then the bias) split over the two threads at the same tile; or
// ("bf16") x rounded to bf16 into work.xb and the unpacking kernel, bias in its epilogue.
static inline void gemm_rows_gguf(int gguf_path, int activations, int threads,
                                  int min_tiles_per_thread, long min_macs, const GgufWork& work,
                                  const Weight& w, const float* x, long ldx, long ldk, int M,
                                  float* y) {
    using namespace pagedrun_gemm;
    const int mode = g_gemm->gguf_activations_for_rows(gguf_path, activations, M);
    GgufJob g;
    memset(&g, 0, sizeof(g));
    g.type = w.gguf_type;
    g.path = gguf_path;
    g.wq = w.wg;
    g.nb = w.nb;
    g.M = M;
    TileJob job;
    memset(&job, 0, sizeof(job));
    job.gguf = &g;
    job.N = w.n;
    job.ldy = w.n;
    if (mode == GGUF_ACT_BF16) {
        g_gemm->convert_rows(x, ldx, ldk, M, w.k, work.xb, w.k);
        g.xb = work.xb;
        job.bias = w.bias;
        job.y = y;
        run_tiles(job, w.num_tiles, threads, min_tiles_per_thread, (long)M * w.n * w.k,
                  min_macs);
        return;
    }
    const int residual = mode == GGUF_ACT_Q8X2;
    const int rows = residual ? 2 * M : M;
    g_gemm->gguf_quantize_rows(gguf_path, x, ldx, ldk, M, w.k, w.gguf_offset, residual,
                               work.xq, work.xd, work.xs, work.xcorr);
    g.M = rows;
    g.xq = work.xq;
    g.xd = work.xd;
    g.xs = work.xs;
    g.xcorr = work.xcorr;
    job.bias = residual ? nullptr : w.bias;
    job.y = residual ? work.y2 : y;
    run_tiles(job, w.num_tiles, threads, min_tiles_per_thread, (long)rows * w.n * w.k, min_macs);
    if (!residual) return;
    // cpu_gemm._gguf_finish: (first pass + residual pass), then + bias, in float32.
    const long n = w.n, total = (long)M * n;
    const float* y2 = work.y2;
    for (long i = 0; i < total; ++i) y[i] = y2[i] + y2[total + i];
    if (w.bias != nullptr)
        for (long r = 0; r < M; ++r)
            for (long j = 0; j < n; ++j) y[r * n + j] += w.bias[j];
}

static inline void linear(const Config& c, const Buffers& b, const Weight& w, const float* x,
                          long ldx, int M, float* y) {
    if (w.kind == WEIGHT_GGUF) {
        gemm_rows_gguf(c.gguf_path, c.gguf_activations, c.threads, c.min_tiles_per_thread,
                       c.min_macs, b.gguf, w, x, ldx, 1, M, y);
        return;
    }
    gemm_rows(c.gemm_path, c.threads, c.min_tiles_per_thread, c.min_macs, b.xb, w, x, ldx, 1, M,
              y);
}

// Decode attention over sequences [0, split) and [split, S): the two parts of a run_pair.
template <typename C>
struct AttentionJob {
    const Config* c;
    const C* k_cache;
    const C* v_cache;
    const Buffers* b;
    const Step* s;
    int split;

    void run(int begin, int end) const {
        g_ops->for_cache<C>().attention(
            c->ops_path, b->q_rot, (long)c->H * c->D, c->D, k_cache, v_cache, c->sc0, c->sc1,
            c->sc2, c->block_size, s->block_tables, s->ldb, s->context_lens, begin, end, c->H,
            c->KV, c->D, c->scale, 0, 0, b->attn);
    }
    static void part(const void* ctx, int part) {
        const AttentionJob* j = static_cast<const AttentionJob*>(ctx);
        if (part == 0) j->run(0, j->split);
        else j->run(j->split, j->s->T);
    }
};

template <typename C>
static inline void attention_part(const Config& c, const Layer& l, const Buffers& b,
                                  const Step& s) {
    const int q_size = c.H * c.D, kv_size = c.KV * c.D;
    const long ld = q_size + 2L * kv_size;  // the fused qkv row
    C* kc = static_cast<C*>(l.k_cache);
    C* vc = static_cast<C*>(l.v_cache);
    g_ops->for_cache<C>().rotary(
        c.ops_path, b.qkv, ld, c.D, b.qkv + q_size, ld, c.D, b.qkv + q_size + kv_size, ld, c.D,
        s.positions, l.cos_sin, s.slots, s.T, c.H, c.KV, c.D, kc, vc, c.sc0, c.sc1, c.sc2,
        c.block_size, b.q_rot, b.k_rot);
    AttentionJob<C> job{&c, kc, vc, &b, &s, s.T};
    if (c.threads >= 2 && s.T >= 2) {
        // paged_decode_attention's split point: half the total visible context.
        long total = 0, running = 0;
        for (int i = 0; i < s.T; ++i) total += s.context_lens[i];
        for (job.split = 0; job.split < s.T - 1 && running * 2 < total; ++job.split)
            running += s.context_lens[job.split];
    }
    if (job.split <= 0 || job.split >= s.T) {
        job.run(0, s.T);
        return;
    }
    pagedrun_threads::run_pair(AttentionJob<C>::part, &job);
}

static inline void decode_layers(const Config& c, const Layer* layers, const Buffers& b,
                                 const Step& s) {
    using namespace pagedrun_ops;
    const int T = s.T, hidden = c.hidden;
    float* x = s.x_out;
    float* res = s.residual_out;
    for (int i = 0; i < c.num_layers; ++i) {
        const Layer& l = layers[i];
        if (i == 0) {
            memcpy(res, s.x_in, sizeof(float) * (size_t)T * hidden);
            g_ops->rms_norm_rows(c.ops_path, s.x_in, hidden, l.input_norm, T, hidden, c.eps, b.h,
                          hidden);
        } else {
            // new residual in place: each element is read before it is written.
            g_ops->fused_add_rms_norm_rows(c.ops_path, x, hidden, res, hidden, l.input_norm, T, hidden,
                                    c.eps, b.h, hidden, res, hidden);
        }
        linear(c, b, l.qkv, b.h, hidden, T, b.qkv);
        if (c.kv_kind == KV_BF16)
            attention_part<uint16_t>(c, l, b, s);
        else if (c.kv_kind == KV_FP8)
            attention_part<uint8_t>(c, l, b, s);
        else
            attention_part<float>(c, l, b, s);
        linear(c, b, l.o, b.attn, (long)c.H * c.D, T, b.o);
        g_ops->fused_add_rms_norm_rows(c.ops_path, b.o, hidden, res, hidden, l.post_norm, T, hidden,
                                c.eps, b.h, hidden, res, hidden);
        linear(c, b, l.gate_up, b.h, hidden, T, b.gate_up);
        g_ops->act_and_mul_rows(c.ops_path, ACT_SILU, b.gate_up, 2L * c.inter, T, c.inter, b.act,
                         c.inter);
        linear(c, b, l.down, b.act, c.inter, T, x);
    }
}

}  // namespace pagedrun_decode
