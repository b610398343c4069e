// twins.cuh -- host twins of the inline-PTX functions in cuda/ptx.cuh (same names, same
// signatures plus a defaulted call-site argument). Warp-wide instructions (mma.sync,
// ldmatrix) are full-warp rendezvous: the last lane to arrive gathers every lane's
// fragment, performs the instruction on the logical matrices following the PTX ISA
// fragment layouts (documented in cuda/ptx.cuh), and scatters the results. cp.async is
// per thread: see runtime.cpp (poison at issue, copy at the wait).
#pragma once

namespace pagedrun_sim {

constexpr uint32_t kFullWarp = 0xffffffffu;

inline float lo_f(uint32_t r, bool bf16) {
    uint16_t h = uint16_t(r & 0xffffu);
    return bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
}
inline float hi_f(uint32_t r, bool bf16) {
    uint16_t h = uint16_t(r >> 16);
    return bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
}

struct MmaLane {
    const uint32_t* a;
    const uint32_t* b;
    const float* c;
    float* d;
};

// D(16x8) = A(16x16, row) * B(16x8, col) + C, fp32 accumulate. Products of 16-bit inputs
// are exact in double; the sum is rounded once to fp32 (hardware rounds at least as often,
// so results agree to fp32 accumulation error).
template <bool BF16>
void mma_m16n8k16_exchange(void* const* lanes, uint32_t, void*) {
    float A[16][16], B[16][8], C[16][8];
    for (unsigned l = 0; l < 32; ++l) {
        const auto& x = *static_cast<const MmaLane*>(lanes[l]);
        unsigned g = l / 4, t = l % 4;
        for (unsigned j = 0; j < 2; ++j) {
            auto pick = [&](uint32_t r) { return j == 0 ? lo_f(r, BF16) : hi_f(r, BF16); };
            A[g][2 * t + j] = pick(x.a[0]);
            A[g + 8][2 * t + j] = pick(x.a[1]);
            A[g][2 * t + 8 + j] = pick(x.a[2]);
            A[g + 8][2 * t + 8 + j] = pick(x.a[3]);
            B[2 * t + j][g] = pick(x.b[0]);
            B[2 * t + 8 + j][g] = pick(x.b[1]);
            C[g][2 * t + j] = x.c[j];
            C[g + 8][2 * t + j] = x.c[2 + j];
        }
    }
    float D[16][8];
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 8; ++n) {
            double acc = C[m][n];
            for (int k = 0; k < 16; ++k) acc += double(A[m][k]) * double(B[k][n]);
            D[m][n] = float(acc);
        }
    for (unsigned l = 0; l < 32; ++l) {
        auto& x = *static_cast<MmaLane*>(lanes[l]);
        unsigned g = l / 4, t = l % 4;
        for (unsigned j = 0; j < 2; ++j) {
            x.d[j] = D[g][2 * t + j];
            x.d[2 + j] = D[g + 8][2 * t + j];
        }
    }
}

struct LdmatrixLane {
    const void* addr;
    uint32_t* r;
    const Loc* loc;
};

// N 8x8 b16 matrices; matrix i's rows are addressed by lanes 8i..8i+7.
template <int N, bool Trans>
void ldmatrix_exchange(void* const* lanes, uint32_t, void*) {
    uint16_t M[N][8][8];
    for (int i = 0; i < N; ++i)
        for (int row = 0; row < 8; ++row) {
            const auto& x = *static_cast<const LdmatrixLane*>(lanes[8 * i + row]);
            if (reinterpret_cast<uintptr_t>(x.addr) % 16 != 0)
                fail(*x.loc, "ldmatrix: row address %p from lane %d is not 16-byte aligned",
                     x.addr, 8 * i + row);
            if (!is_shared(x.addr, 16))
                fail(*x.loc, "ldmatrix: row address %p from lane %d is not in shared memory",
                     x.addr, 8 * i + row);
            std::memcpy(M[i][row], x.addr, 16);
        }
    for (unsigned l = 0; l < 32; ++l) {
        auto& x = *static_cast<LdmatrixLane*>(lanes[l]);
        unsigned r = l / 4, c = 2 * (l % 4);
        for (int i = 0; i < N; ++i) {
            uint16_t e0 = Trans ? M[i][c][r] : M[i][r][c];
            uint16_t e1 = Trans ? M[i][c + 1][r] : M[i][r][c + 1];
            x.r[i] = uint32_t(e0) | (uint32_t(e1) << 16);
        }
    }
}

template <int N, bool Trans>
void ldmatrix(uint32_t* r, const void* smem, const char* what, const Loc& loc) {
    LdmatrixLane lane{smem, r, &loc};
    warp_collective(kFullWarp, what, &lane, &ldmatrix_exchange<N, Trans>, nullptr, loc);
}

}  // namespace pagedrun_sim

#define PAGEDRUN_SIM_LOC const ::pagedrun_sim::Loc& loc = ::pagedrun_sim::Loc::current()

inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                              const float (&c)[4], PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::MmaLane lane{a, b, c, d};
    ::pagedrun_sim::warp_collective(::pagedrun_sim::kFullWarp, "mma.m16n8k16.bf16", &lane,
                                    &::pagedrun_sim::mma_m16n8k16_exchange<true>, nullptr, loc);
}
inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                             const float (&c)[4], PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::MmaLane lane{a, b, c, d};
    ::pagedrun_sim::warp_collective(::pagedrun_sim::kFullWarp, "mma.m16n8k16.f16", &lane,
                                    &::pagedrun_sim::mma_m16n8k16_exchange<false>, nullptr, loc);
}

inline void ldmatrix_x1(uint32_t (&r)[1], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<1, false>(r, smem, "ldmatrix.x1", loc);
}
inline void ldmatrix_x2(uint32_t (&r)[2], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<2, false>(r, smem, "ldmatrix.x2", loc);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<4, false>(r, smem, "ldmatrix.x4", loc);
}
inline void ldmatrix_x1_trans(uint32_t (&r)[1], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<1, true>(r, smem, "ldmatrix.x1.trans", loc);
}
inline void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<2, true>(r, smem, "ldmatrix.x2.trans", loc);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::ldmatrix<4, true>(r, smem, "ldmatrix.x4.trans", loc);
}

inline void cp_async_16(void* smem_dst, const void* gmem_src, PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::cp_async(smem_dst, gmem_src, 16, loc);
}
inline void cp_async_16_zfill(void* smem_dst, const void* gmem_src, int src_bytes,
                              PAGEDRUN_SIM_LOC) {
    ::pagedrun_sim::cp_async(smem_dst, gmem_src, src_bytes, loc);
}
inline void cp_async_commit() { ::pagedrun_sim::cp_async_commit(); }
template <int N>
inline void cp_async_wait() { ::pagedrun_sim::cp_async_wait(N); }
inline void cp_async_wait_all() {
    ::pagedrun_sim::cp_async_commit();
    ::pagedrun_sim::cp_async_wait(0);
}

#undef PAGEDRUN_SIM_LOC
