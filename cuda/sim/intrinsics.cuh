// intrinsics.cuh -- CUDA device intrinsics for the CPU harness: block barriers, warp
// shuffles and votes (as warp rendezvous that honour the mask exactly), atomics, bit and
// math intrinsics. Every collective takes the caller's source location (a defaulted
// std::source_location argument), so errors and deadlock reports name the line.
#pragma once

namespace pagedrun_sim {

// ---- shuffles ------------------------------------------------------------------------------
enum class ShflMode { Idx, Up, Down, Xor };

struct ShflLane {
    uint64_t value;
    uint64_t result;
    int arg;  // source lane, delta or lane mask
    int width;
};

template <ShflMode M>
void shfl_exchange(void* const* lanes, uint32_t mask, void* loc) {
    for (unsigned l = 0; l < 32; ++l) {
        auto* me = static_cast<ShflLane*>(lanes[l]);
        if (!me) continue;
        const int w = me->width;
        const int base = int(l) & ~(w - 1);
        int src = int(l);
        if constexpr (M == ShflMode::Idx) src = base + (me->arg & (w - 1));
        if constexpr (M == ShflMode::Up) src = int(l) - me->arg < base ? int(l) : int(l) - me->arg;
        if constexpr (M == ShflMode::Down) src = int(l) + me->arg >= base + w ? int(l) : int(l) + me->arg;
        if constexpr (M == ShflMode::Xor) src = (int(l) ^ me->arg) >= base + w ? int(l) : (int(l) ^ me->arg);
        if (src < 0 || src >= 32 || !((mask >> src) & 1u))
            fail(*static_cast<const Loc*>(loc), "shuffle: lane %u reads lane %d, which is not in mask 0x%08x "
                                 "(its value is undefined on hardware)", l, src, mask);
        me->result = static_cast<ShflLane*>(lanes[src])->value;
    }
}

template <ShflMode M, class T>
T shfl(const char* what, unsigned mask, T var, int arg, int width, const Loc& loc) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type over 8 bytes");
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail(loc, "%s width %d is not a power of two in 1..32", what, width);
    ShflLane lane{0, 0, arg, width};
    std::memcpy(&lane.value, &var, sizeof(T));
    warp_collective(mask, what, &lane, &shfl_exchange<M>, const_cast<Loc*>(&loc), loc);
    T out;
    std::memcpy(&out, &lane.result, sizeof(T));
    return out;
}

// ---- votes ---------------------------------------------------------------------------------
struct VoteLane { int pred; uint32_t ballot; };
inline void vote_exchange(void* const* lanes, uint32_t, void*) {
    uint32_t b = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (lanes[l] && static_cast<VoteLane*>(lanes[l])->pred) b |= 1u << l;
    for (unsigned l = 0; l < 32; ++l)
        if (lanes[l]) static_cast<VoteLane*>(lanes[l])->ballot = b;
}
inline uint32_t ballot(const char* what, unsigned mask, int pred, const Loc& loc) {
    VoteLane lane{pred != 0, 0};
    warp_collective(mask, what, &lane, &vote_exchange, nullptr, loc);
    return lane.ballot;
}
inline void no_exchange(void* const*, uint32_t, void*) {}

template <class T>
T atomic_update(T* p, T v, auto op) {
    std::atomic_ref<T> r(*p);
    T old = r.load();
    while (!r.compare_exchange_weak(old, op(old, v))) {}
    return old;
}

}  // namespace pagedrun_sim

// ---- block ---------------------------------------------------------------------------------
inline void __syncthreads(const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::block_barrier(0, 0, loc);
}
inline int __syncthreads_count(int pred, const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::block_barrier(1, pred, loc);
    return ::pagedrun_sim::g_thread->block_result;
}
inline int __syncthreads_and(int pred, const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::block_barrier(2, pred, loc);
    return ::pagedrun_sim::g_thread->block_result;
}
inline int __syncthreads_or(int pred, const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::block_barrier(3, pred, loc);
    return ::pagedrun_sim::g_thread->block_result;
}
// Blocks run one at a time on one OS thread: fences have nothing to order.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap(const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::fail(loc, "__trap()");
}

// ---- warp ----------------------------------------------------------------------------------
template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
              const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::shfl<::pagedrun_sim::ShflMode::Idx>("__shfl_sync", mask, var, src_lane, width, loc);
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                 const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::shfl<::pagedrun_sim::ShflMode::Up>("__shfl_up_sync", mask, var, int(delta), width, loc);
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                   const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::shfl<::pagedrun_sim::ShflMode::Down>("__shfl_down_sync", mask, var, int(delta), width, loc);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::shfl<::pagedrun_sim::ShflMode::Xor>("__shfl_xor_sync", mask, var, lane_mask, width, loc);
}
inline unsigned __ballot_sync(unsigned mask, int pred,
                              const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::ballot("__ballot_sync", mask, pred, loc);
}
inline int __any_sync(unsigned mask, int pred,
                      const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::ballot("__any_sync", mask, pred, loc) != 0;
}
inline int __all_sync(unsigned mask, int pred,
                      const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    return ::pagedrun_sim::ballot("__all_sync", mask, pred, loc) == mask;
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()) {
    ::pagedrun_sim::warp_collective(mask, "__syncwarp", nullptr, &::pagedrun_sim::no_exchange, nullptr, loc);
}
inline unsigned __activemask() { return ::pagedrun_sim::active_mask(); }

// ---- atomics (std::atomic_ref, so ThreadSanitizer sees them as atomic) --------------------
template <class T>
T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T>
T atomicSub(T* p, T v) { return std::atomic_ref<T>(*p).fetch_sub(v); }
template <class T>
T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T>
T atomicMax(T* p, T v) { return ::pagedrun_sim::atomic_update(p, v, [](T a, T b) { return a > b ? a : b; }); }
template <class T>
T atomicMin(T* p, T v) { return ::pagedrun_sim::atomic_update(p, v, [](T a, T b) { return a < b ? a : b; }); }
template <class T>
T atomicAnd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_and(v); }
template <class T>
T atomicOr(T* p, T v) { return std::atomic_ref<T>(*p).fetch_or(v); }
template <class T>
T atomicXor(T* p, T v) { return std::atomic_ref<T>(*p).fetch_xor(v); }
template <class T>
T atomicCAS(T* p, T compare, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(compare, v);
    return compare;
}

// ---- bits and math -------------------------------------------------------------------------
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(unsigned(x)); }
inline int __clzll(long long x) { return std::countl_zero((unsigned long long)x); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(unsigned(x)) + 1; }
inline int __ffsll(long long x) { return x == 0 ? 0 : std::countr_zero((unsigned long long)x) + 1; }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = (uint64_t(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline float __int2float_rn(int x) { return float(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
template <class T>
T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
