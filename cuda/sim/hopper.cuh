// hopper.cuh -- host twins of the Hopper-only functions in cuda/hopper_groundwork.cuh
// (mbarrier, TMA, wgmma, setmaxnreg; used by cuda/gemm_hopper.cu). They work on the logical
// tile, at the level the instruction acts on:
//   * mbarrier: the 64-bit word in shared memory holds the whole barrier state (pending and
//     expected arrivals, phase, transaction bytes), so it is reset with the block's shared
//     memory; an uninitialised (poisoned, all-ones) word is reported. A wait blocks the
//     fiber until its phase completes; a wait nothing can complete is a deadlock report.
//   * TMA (tma_load_2d): the issuing thread reads the whole box at issue (zero outside the
//     tensor), poisons the destination with NaN and parks the bytes on the barrier; they
//     land, and complete their transaction bytes, when some thread waits on that barrier.
//     A kernel that reads the tile without waiting reads NaN every time.
//   * wgmma: a warpgroup rendezvous (128 threads) that queues the operation and poisons its
//     accumulator registers with NaN; commit_group and wait_group<N> are rendezvous too. The
//     wait that retires a group reads A and B from shared memory through the descriptors
//     (then, not at issue), computes each 64xNx16 product in double and scatters D in the
//     PTX ISA fragment layout (cuda/hopper_groundwork.cuh). So a kernel that reads the
//     accumulators before the wait, or lets TMA refill a stage before the wait of the wgmmas
//     reading it (the TMA twin poisons at issue), reads NaN every time. wgmma_fence is a
//     no-op; setmaxnreg (warpgroup_reg_alloc / dealloc) checks its operand only.
// Swizzling is a function of the shared-memory address (16-byte chunk bits 4.. XOR address
// bits 7..), as on the hardware, so TMA writes and wgmma reads agree whatever the offsets.
// Included by cuda/hopper_groundwork.cuh under PAGEDRUN_SIM (after ptx.cuh and twins.cuh);
// never include directly.
#pragma once
#include <deque>
#include <limits>
#include <vector>

// Harness form of the tensor map: 128 bytes like a CUtensorMap, built by
// pagedrun.runtime.kernels.tma.sim_descriptor (word order fixed there).
struct __attribute__((aligned(64))) TmaDescriptor {
    uint64_t magic;         // kTmaMagic: a descriptor not built for the harness is refused
    uint64_t base;          // address of element [0][0]
    uint64_t dims[2];       // elements: inner (contiguous), outer
    uint64_t outer_stride;  // bytes between consecutive outer indices
    uint32_t box[2];        // box elements: inner, outer
    uint32_t elem_bytes;
    uint32_t swizzle_bytes;  // 0, 32, 64 or 128
    uint64_t reserved[9];
};
static_assert(sizeof(TmaDescriptor) == 128, "TmaDescriptor is 128 bytes like CUtensorMap");

namespace pagedrun_sim {

constexpr uint64_t kTmaMagic = 0x31414d5452444150ull;  // "PADRTMA1"
constexpr unsigned kWarpgroupThreads = 128;
constexpr unsigned kMaxWarpgroups = 1024 / kWarpgroupThreads;
constexpr unsigned kWgmmaM = 64, kWgmmaK = 16, kMaxWgmmaN = 256;

// ---- synchronisation for the sanitizers -----------------------------------------------------
inline bool always_ready(void*) { return true; }
// A release + acquire point without blocking. Twins call it on entry (to see what other
// threads' twins did to the side state) and after changing shared state, so ThreadSanitizer
// orders them as the hardware's barriers do. The barrier word itself is accessed atomically:
// the scheduler polls it between fiber runs.
inline void sync_point(const Loc& loc) { wait_until(&always_ready, nullptr, "sync", loc); }

// ---- mbarrier -----------------------------------------------------------------------------
// Word layout: bits 0..19 pending arrivals, 20..39 expected arrivals, 40 phase parity,
// 41..61 transaction bytes + kTxBias (signed: a TMA may complete before its expect_tx),
// 62 "TMA bytes parked on this barrier", 63 zero (the poison byte pattern sets it: "never
// initialised").
constexpr uint64_t kArriveMask = (1u << 20) - 1;
constexpr int64_t kTxBias = int64_t(1) << 20;
constexpr int64_t kTxLimit = (int64_t(1) << 20) - 1;
constexpr uint64_t kTxFieldMask = (uint64_t(1) << 21) - 1;
constexpr uint64_t kParkedBit = uint64_t(1) << 62;

struct Mbarrier {
    uint32_t pending, expected, phase;
    int64_t tx;
    bool parked;
};

inline uint64_t mbar_word(const uint64_t* bar) { return __atomic_load_n(bar, __ATOMIC_RELAXED); }

inline bool mbar_load(const uint64_t* bar, Mbarrier& m) {
    uint64_t w = mbar_word(bar);
    if (w >> 63) return false;
    m.pending = uint32_t(w & kArriveMask);
    m.expected = uint32_t((w >> 20) & kArriveMask);
    m.phase = uint32_t((w >> 40) & 1);
    m.tx = int64_t((w >> 41) & kTxFieldMask) - kTxBias;
    m.parked = (w & kParkedBit) != 0;
    return m.expected != 0;
}
inline void mbar_store(uint64_t* bar, Mbarrier m) {
    if (m.pending == 0 && m.tx == 0) {  // phase complete: the next one starts
        m.phase ^= 1;
        m.pending = m.expected;
    }
    uint64_t w = uint64_t(m.pending) | (uint64_t(m.expected) << 20) | (uint64_t(m.phase) << 40) |
                 (uint64_t(m.tx + kTxBias) << 41) | (m.parked ? kParkedBit : 0);
    __atomic_store_n(bar, w, __ATOMIC_RELAXED);
}

inline Mbarrier mbar_checked(const uint64_t* bar, const char* what, const Loc& loc) {
    if (reinterpret_cast<uintptr_t>(bar) % 8 != 0 || !is_shared(bar, 8))
        fail(loc, "%s: mbarrier %p is not an 8-byte aligned shared-memory word", what,
             static_cast<const void*>(bar));
    Mbarrier m;
    if (!mbar_load(bar, m))
        fail(loc, "%s: mbarrier %p was never initialised (mbarrier_init) in this block", what,
             static_cast<const void*>(bar));
    return m;
}

// TMA bytes waiting to land: they complete on their barrier when a thread waits on it.
struct TmaInFlight {
    uint64_t block;
    uint64_t* bar;
    unsigned char* dst;
    std::vector<unsigned char> bytes;  // already in shared-memory (swizzled) order
};
inline std::vector<TmaInFlight>& tma_in_flight() {
    static std::vector<TmaInFlight> v;
    return v;
}

// Lands every TMA parked on bar (and forgets those of earlier blocks), in the calling thread.
// Returns false if the transaction count would leave its range.
inline bool tma_land(uint64_t* bar) {
    auto& v = tma_in_flight();
    const uint64_t block = block_serial();
    bool ok = true;
    std::size_t keep = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
        if (v[i].block == block && v[i].bar == bar) {
            std::memcpy(v[i].dst, v[i].bytes.data(), v[i].bytes.size());
            Mbarrier m;
            if (mbar_load(bar, m)) {
                m.tx -= int64_t(v[i].bytes.size());
                ok &= m.tx >= -kTxLimit;
                mbar_store(bar, m);
            }
        } else if (v[i].block == block) {
            if (keep != i) v[keep] = std::move(v[i]);
            ++keep;
        }
    }
    v.resize(keep);
    Mbarrier m;
    if (mbar_load(bar, m) && m.parked) {
        m.parked = false;
        mbar_store(bar, m);
    }
    return ok;
}

inline void mbarrier_init(uint64_t* bar, int arrive_count, const Loc& loc) {
    if (reinterpret_cast<uintptr_t>(bar) % 8 != 0 || !is_shared(bar, 8))
        fail(loc, "mbarrier_init: %p is not an 8-byte aligned shared-memory word",
             static_cast<void*>(bar));
    if (arrive_count < 1 || uint64_t(arrive_count) > kArriveMask)
        fail(loc, "mbarrier_init: arrive count %d outside 1..%llu", arrive_count,
             static_cast<unsigned long long>(kArriveMask));
    sync_point(loc);
    auto& v = tma_in_flight();  // a re-initialised barrier owns no earlier transfers
    v.erase(std::remove_if(v.begin(), v.end(), [&](const TmaInFlight& t) { return t.bar == bar; }),
            v.end());
    // (completes nothing: pending = count > 0)
    mbar_store(bar, Mbarrier{uint32_t(arrive_count), uint32_t(arrive_count), 0, 0, false});
    sync_point(loc);
}

inline void mbarrier_arrive_tx(uint64_t* bar, int tx_bytes, const char* what, const Loc& loc) {
    sync_point(loc);  // the arrival releases what this thread wrote before it
    Mbarrier m = mbar_checked(bar, what, loc);
    if (tx_bytes < 0) fail(loc, "%s: negative transaction bytes %d", what, tx_bytes);
    if (m.pending == 0)
        fail(loc, "%s: more arrivals than the barrier's count %u in this phase", what,
             m.expected);
    m.tx += tx_bytes;
    if (m.tx > kTxLimit)
        fail(loc, "%s: %lld pending transaction bytes exceed the mbarrier's range", what,
             static_cast<long long>(m.tx));
    m.pending -= 1;
    mbar_store(bar, m);
}

struct PhaseWait {
    uint64_t* bar;
    uint32_t parity;
};
// Polled by the scheduler (reads the word only): has the phase of parity w->parity completed,
// or are there TMA bytes to land?
inline bool phase_done_or_parked(void* ctx) {
    auto* w = static_cast<PhaseWait*>(ctx);
    Mbarrier m;
    return mbar_load(w->bar, m) && (m.phase != w->parity || m.parked);
}

// try_wait may return false on hardware only after a time limit; the twin blocks instead, so
// a spin loop on try_wait that can never succeed is reported as a deadlock, not a hang.
inline bool mbarrier_wait(uint64_t* bar, int phase, const char* what, const Loc& loc) {
    mbar_checked(bar, what, loc);
    PhaseWait w{bar, uint32_t(phase & 1)};
    for (;;) {
        wait_until(&phase_done_or_parked, &w, what, loc);
        Mbarrier m = mbar_checked(bar, what, loc);
        if (m.parked) {  // land the bytes here, in a thread, then publish them
            if (!tma_land(bar)) fail(loc, "%s: transaction bytes out of range", what);
            sync_point(loc);
            m = mbar_checked(bar, what, loc);
        }
        if (m.phase != w.parity) return true;
    }
}

// ---- TMA ----------------------------------------------------------------------------------
inline uintptr_t swizzle_address(uintptr_t a, unsigned swizzle_bytes) {
    if (swizzle_bytes == 0) return a;
    uintptr_t chunk_mask = swizzle_bytes / 16 - 1;
    return a ^ (((a >> 7) & chunk_mask) << 4);
}

inline void tma_load_2d(void* smem_dst, const TmaDescriptor* desc, int coord_inner,
                        int coord_outer, uint64_t* bar, const Loc& loc) {
    const char* what = "tma_load_2d";
    if (desc->magic != kTmaMagic)
        fail(loc, "%s: descriptor %p was not built by pagedrun.runtime.kernels.tma."
                  "sim_descriptor", what, static_cast<const void*>(desc));
    const unsigned e = desc->elem_bytes, sw = desc->swizzle_bytes;
    const std::size_t row_bytes = std::size_t(desc->box[0]) * e;
    const std::size_t bytes = row_bytes * desc->box[1];
    auto dst = reinterpret_cast<uintptr_t>(smem_dst);
    const unsigned align = sw ? 1024 : 128;
    if (dst % align != 0 || !is_shared(smem_dst, bytes))
        fail(loc, "%s: destination %p (+%zu bytes) must be %u-byte aligned shared memory",
             what, smem_dst, bytes, align);
    if (row_bytes % 16 != 0 || (sw && row_bytes != sw))
        fail(loc, "%s: box row of %zu bytes: needs a multiple of 16%s", what, row_bytes,
             sw ? " equal to the swizzle width" : "");
    sync_point(loc);
    mbar_checked(bar, what, loc);
    TmaInFlight t{block_serial(), bar, static_cast<unsigned char*>(smem_dst),
                  std::vector<unsigned char>(bytes, 0)};
    const auto* base = reinterpret_cast<const unsigned char*>(desc->base);
    for (uint32_t j = 0; j < desc->box[1]; ++j) {
        int64_t y = int64_t(coord_outer) + j;
        for (uint32_t i = 0; i < desc->box[0]; ++i) {
            int64_t x = int64_t(coord_inner) + i;
            if (x < 0 || y < 0 || uint64_t(x) >= desc->dims[0] || uint64_t(y) >= desc->dims[1])
                continue;  // out of the tensor: stays zero
            uintptr_t at = swizzle_address(dst + j * row_bytes + i * e, sw) - dst;
            std::memcpy(&t.bytes[at], base + uint64_t(y) * desc->outer_stride + uint64_t(x) * e,
                        e);
        }
    }
    std::memset(smem_dst, 0xFF, bytes);  // NaN until a wait on bar lands the box
    tma_in_flight().push_back(std::move(t));
    Mbarrier m = mbar_checked(bar, what, loc);
    m.parked = true;
    mbar_store(bar, m);
    sync_point(loc);
}

// ---- wgmma --------------------------------------------------------------------------------
inline uint64_t make_smem_desc(const void* smem, int swizzle, uint32_t lbo, uint32_t sbo,
                               const Loc& loc) {
    // The descriptor's 14-bit address field holds the offset into dynamic shared memory
    // (at most 227 KiB, so it fits); static __shared__ lives elsewhere on the host.
    auto* p = static_cast<const unsigned char*>(smem);
    if (!g_launch.dyn_smem || p < g_launch.dyn_smem ||
        p >= g_launch.dyn_smem + g_launch.dyn_smem_bytes)
        fail(loc, "make_smem_desc: %p is not in dynamic shared memory (the harness models "
                  "wgmma operands there only)", smem);
    uint64_t off = uint64_t(p - g_launch.dyn_smem);
    if (off % 16 != 0) fail(loc, "make_smem_desc: %p is not 16-byte aligned", smem);
    return ((off >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
           (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(swizzle & 3) << 62);
}

// Element (row, k) of a K-major 16-bit operand through descriptor `desc`.
inline float smem_operand(uint64_t desc, unsigned row, unsigned k, bool bf16, const Loc& loc) {
    static constexpr unsigned kSwizzleBytes[4] = {0, 128, 64, 32};
    const uint64_t start = (desc & 0x3FFF) << 4;
    const uint64_t lbo = ((desc >> 16) & 0x3FFF) << 4;
    const uint64_t sbo = ((desc >> 32) & 0x3FFF) << 4;
    const unsigned sw = kSwizzleBytes[desc >> 62];
    if ((desc >> 49) & 7) fail(loc, "wgmma: descriptor base offset is not modelled (use 0)");
    uint64_t off;
    if (sw == 0)
        off = start + (row / 8) * sbo + (k / 8) * lbo + (row % 8) * 16 + (k % 8) * 2;
    else
        off = start + (row / 8) * sbo + (row % 8) * sw + k * 2;
    uintptr_t a = swizzle_address(reinterpret_cast<uintptr_t>(g_launch.dyn_smem) + off, sw);
    auto* p = reinterpret_cast<const unsigned char*>(a);
    if (p < g_launch.dyn_smem || p + 2 > g_launch.dyn_smem + g_launch.dyn_smem_bytes)
        fail(loc, "wgmma: operand element (%u, %u) at dynamic shared memory offset %lld is "
                  "outside the launch's %zu bytes", row, k,
             static_cast<long long>(p - g_launch.dyn_smem), g_launch.dyn_smem_bytes);
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return bf16 ? bf16_bits_to_f32(bits) : f16_bits_to_f32(bits);
}

struct WgmmaLane {
    uint64_t desc_a, desc_b;
    float* d;
    int scale_d;
};

struct WarpgroupSlot {
    uint64_t block = 0;
    unsigned arrived = 0;
    uint64_t generation = 0;
    const char* what = nullptr;
    void* lanes[kWarpgroupThreads]{};
};
inline WarpgroupSlot* warpgroup_slots() {
    static WarpgroupSlot slots[kMaxWarpgroups];
    return slots;
}

struct GenerationWait {
    const WarpgroupSlot* slot;
    uint64_t generation;
};
inline bool generation_moved(void* ctx) {  // polled by the scheduler: atomic read
    auto* w = static_cast<GenerationWait*>(ctx);
    return __atomic_load_n(&w->slot->generation, __ATOMIC_RELAXED) != w->generation;
}

using WarpgroupFn = void (*)(void* const* lanes, const Loc& loc);

// All 128 threads of the caller's warpgroup meet here; the last runs fn once.
inline void warpgroup_collective(const char* what, void* lane_data, WarpgroupFn fn,
                                 const Loc& loc) {
    const unsigned t = g_thread->linear;
    const unsigned nthreads = g_launch.block_dim.x * g_launch.block_dim.y * g_launch.block_dim.z;
    const unsigned group = t / kWarpgroupThreads;
    if ((group + 1) * kWarpgroupThreads > nthreads)
        fail(loc, "%s: warpgroup %u is incomplete (block of %u threads; a warpgroup is 128)",
             what, group, nthreads);
    sync_point(loc);  // see the arrivals of the warpgroup's other threads
    WarpgroupSlot& s = warpgroup_slots()[group];
    if (s.block != block_serial()) s = WarpgroupSlot{block_serial()};
    if (s.arrived && std::strcmp(s.what, what) != 0)
        fail(loc, "mismatched warpgroup operations: this thread calls %s while others of "
                  "warpgroup %u wait at %s", what, group, s.what);
    s.what = what;
    s.lanes[t % kWarpgroupThreads] = lane_data;
    GenerationWait w{&s, s.generation};
    if (++s.arrived == kWarpgroupThreads) {
        fn(s.lanes, loc);
        s.arrived = 0;
        __atomic_store_n(&s.generation, s.generation + 1, __ATOMIC_RELAXED);
    }
    wait_until(&generation_moved, &w, what, loc);
}

// ---- wgmma as an asynchronous operation ----------------------------------------------------
// An issued wgmma is queued on its warpgroup with the accumulator values it starts from; its
// registers read NaN until a wgmma_wait_group retires the committed group that holds it. Only
// then are A and B read from shared memory and the product written back, so a kernel that
// reads the accumulators without the wait, or lets TMA refill a stage before the wait that
// retires the wgmmas reading it (the twin TMA poisons its destination at issue), gets NaN.
// Chained wgmmas on the same registers (scale_d = 1) take their predecessor's result.
struct WgmmaOp {
    unsigned n;
    bool bf16;
    uint64_t desc_a, desc_b;
    int scale_d;
    uint64_t group;  // commit-group number; kOpenGroup until a commit_group closes it
    float* lane_d[kWarpgroupThreads];
    std::vector<float> in;  // logical [64][n] start value (unused when scale_d == 0)
};
constexpr uint64_t kOpenGroup = ~uint64_t(0);
struct WgmmaQueue {
    uint64_t block = 0;
    uint64_t next_group = 0, oldest_group = 0;  // committed and not retired: [oldest, next)
    std::deque<WgmmaOp> ops;                    // issue order
};
inline WgmmaQueue& wgmma_queue() {  // the calling thread's warpgroup, reset per block
    static WgmmaQueue queues[kMaxWarpgroups];
    WgmmaQueue& q = queues[g_thread->linear / kWarpgroupThreads];
    if (q.block != block_serial()) q = WgmmaQueue{block_serial()};
    return q;
}

// D fragment position of register r of warpgroup thread t (cuda/ptx.cuh).
inline void wgmma_d_position(unsigned t, unsigned r, unsigned& row, unsigned& col) {
    unsigned w = t / 32, g = (t % 32) / 4, q = t % 4, i = r / 4, j = r % 4;
    row = 16 * w + g + 8 * (j / 2);
    col = 8 * i + 2 * q + (j % 2);
}

template <unsigned N, bool BF16>
void wgmma_issue(void* const* lanes, const Loc& loc) {
    const auto& first = *static_cast<const WgmmaLane*>(lanes[0]);
    for (unsigned t = 1; t < kWarpgroupThreads; ++t) {
        const auto& x = *static_cast<const WgmmaLane*>(lanes[t]);
        if (x.desc_a != first.desc_a || x.desc_b != first.desc_b || x.scale_d != first.scale_d)
            fail(loc, "wgmma: thread %u of the warpgroup passes descriptors/scale_d "
                      "(0x%llx, 0x%llx, %d) unlike thread 0 (0x%llx, 0x%llx, %d)", t,
                 static_cast<unsigned long long>(x.desc_a),
                 static_cast<unsigned long long>(x.desc_b), x.scale_d,
                 static_cast<unsigned long long>(first.desc_a),
                 static_cast<unsigned long long>(first.desc_b), first.scale_d);
    }
    WgmmaQueue& q = wgmma_queue();
    WgmmaOp op{N, BF16, first.desc_a, first.desc_b, first.scale_d, kOpenGroup, {}, {}};
    for (unsigned t = 0; t < kWarpgroupThreads; ++t)
        op.lane_d[t] = static_cast<const WgmmaLane*>(lanes[t])->d;
    bool chained = false;  // an earlier pending op writes these registers: it supplies `in`
    for (const auto& other : q.ops) chained |= other.lane_d[0] == op.lane_d[0];
    op.in.assign(std::size_t(kWgmmaM) * N, 0.f);
    for (unsigned t = 0; t < kWarpgroupThreads; ++t)
        for (unsigned r = 0; r < N / 2; ++r) {
            unsigned row, col;
            wgmma_d_position(t, r, row, col);
            if (!chained) op.in[row * N + col] = op.lane_d[t][r];
            op.lane_d[t][r] = std::numeric_limits<float>::quiet_NaN();  // in flight
        }
    q.ops.push_back(std::move(op));
}

// Retires the oldest op: reads A and B now, D = A B (+ in); hands D to the next pending op on
// the same registers, or writes it to them.
inline void wgmma_retire_front(WgmmaQueue& q, const Loc& loc) {
    WgmmaOp op = std::move(q.ops.front());
    q.ops.pop_front();
    const unsigned N = op.n;
    static thread_local float A[kWgmmaM][kWgmmaK], B[kMaxWgmmaN][kWgmmaK];
    for (unsigned m = 0; m < kWgmmaM; ++m)
        for (unsigned k = 0; k < kWgmmaK; ++k)
            A[m][k] = smem_operand(op.desc_a, m, k, op.bf16, loc);
    for (unsigned n = 0; n < N; ++n)
        for (unsigned k = 0; k < kWgmmaK; ++k)
            B[n][k] = smem_operand(op.desc_b, n, k, op.bf16, loc);
    // Products of 16-bit inputs are exact in double; one rounding to f32 per element.
    std::vector<float> D(std::size_t(kWgmmaM) * N);
    for (unsigned m = 0; m < kWgmmaM; ++m)
        for (unsigned n = 0; n < N; ++n) {
            double acc = op.scale_d ? op.in[m * N + n] : 0.0;
            for (unsigned k = 0; k < kWgmmaK; ++k) acc += double(A[m][k]) * double(B[n][k]);
            D[m * N + n] = float(acc);
        }
    for (auto& next : q.ops)
        if (next.lane_d[0] == op.lane_d[0]) {
            next.in = std::move(D);
            return;
        }
    for (unsigned t = 0; t < kWarpgroupThreads; ++t)
        for (unsigned r = 0; r < N / 2; ++r) {
            unsigned row, col;
            wgmma_d_position(t, r, row, col);
            op.lane_d[t][r] = D[row * N + col];
        }
}

inline void wgmma_commit(void* const*, const Loc&) {
    WgmmaQueue& q = wgmma_queue();
    for (auto& op : q.ops)
        if (op.group == kOpenGroup) op.group = q.next_group;
    ++q.next_group;  // an empty group is a group too, as on the hardware
}

template <int kPending>
void wgmma_wait(void* const*, const Loc& loc) {
    WgmmaQueue& q = wgmma_queue();
    for (; q.next_group - q.oldest_group > uint64_t(kPending); ++q.oldest_group)
        while (!q.ops.empty() && q.ops.front().group == q.oldest_group) wgmma_retire_front(q, loc);
}

}  // namespace pagedrun_sim

#define PAGEDRUN_SIM_LOC const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()

inline void mbarrier_init(uint64_t* bar, int arrive_count, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::mbarrier_init(bar, arrive_count, loc);
}
inline void mbarrier_arrive_expect_tx(uint64_t* bar, int tx_bytes, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::mbarrier_arrive_tx(bar, tx_bytes, "mbarrier_arrive_expect_tx", loc);
}
inline void mbarrier_arrive(uint64_t* bar, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::mbarrier_arrive_tx(bar, 0, "mbarrier_arrive", loc);
}
inline bool mbarrier_try_wait_parity(uint64_t* bar, int phase, PAGEDRUN_SIM_LOC) {
    return ::pagedrun_sim::mbarrier_wait(bar, phase, "mbarrier_try_wait_parity", loc);
}
inline void mbarrier_wait_parity(uint64_t* bar, int phase, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::mbarrier_wait(bar, phase, "mbarrier_wait_parity", loc);
}
inline void tma_load_2d(void* smem_dst, const TmaDescriptor* desc, int coord_inner,
                        int coord_outer, uint64_t* bar, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::tma_load_2d(smem_dst, desc, coord_inner, coord_outer, bar, loc);
}
inline uint64_t make_smem_desc(const void* smem, int swizzle, uint32_t leading_byte_offset,
                               uint32_t stride_byte_offset, PAGEDRUN_SIM_LOC) {
    return ::pagedrun_sim::make_smem_desc(smem, swizzle, leading_byte_offset,
                                          stride_byte_offset, loc);
}
inline void fence_proxy_async() {}
inline void wgmma_fence() {}
inline void wgmma_commit_group(PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::warpgroup_collective("wgmma.commit_group", nullptr,
                                         &::pagedrun_sim::wgmma_commit, loc);
}
template <int N>
inline void wgmma_wait_group(PAGEDRUN_SIM_LOC) {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group N: 0..7");
    static const char* const what[8] = {"wgmma.wait_group 0", "wgmma.wait_group 1",
                                        "wgmma.wait_group 2", "wgmma.wait_group 3",
                                        "wgmma.wait_group 4", "wgmma.wait_group 5",
                                        "wgmma.wait_group 6", "wgmma.wait_group 7"};
    ::pagedrun_sim::warpgroup_collective(what[N], nullptr, &::pagedrun_sim::wgmma_wait<N>, loc);
}
// setmaxnreg moves registers between warpgroups; the harness has no register file to move.
template <int kRegs>
inline void warpgroup_reg_dealloc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, x8");
}
template <int kRegs>
inline void warpgroup_reg_alloc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, x8");
}

#define PAGEDRUN_SIM_WGMMA(n, ty, bf16)                                                       \
    inline void wgmma_m64n##n##k16_##ty(float (&d)[n / 2], uint64_t desc_a, uint64_t desc_b, \
                                        int scale_d, PAGEDRUN_SIM_LOC) {                     \
        ::pagedrun_sim::WgmmaLane lane{desc_a, desc_b, d, scale_d};                          \
        ::pagedrun_sim::warpgroup_collective("wgmma.m64n" #n "k16." #ty, &lane,              \
                                             &::pagedrun_sim::wgmma_issue<n, bf16>, loc);    \
    }
PAGEDRUN_SIM_WGMMA(64, bf16, true)
PAGEDRUN_SIM_WGMMA(64, f16, false)
PAGEDRUN_SIM_WGMMA(128, bf16, true)
PAGEDRUN_SIM_WGMMA(128, f16, false)
PAGEDRUN_SIM_WGMMA(256, bf16, true)
PAGEDRUN_SIM_WGMMA(256, f16, false)
#undef PAGEDRUN_SIM_WGMMA

#undef PAGEDRUN_SIM_LOC
