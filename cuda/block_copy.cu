// block_copy.cu -- whole-block moves of the paged KV cache: copy-on-write inside one pool,
// and the gather / scatter between a pool and a contiguous staging buffer that swap
// preemption uses (gather device blocks -> staging -> one host copy; and back).
//
// Computes, for every pair p: dst block block_pairs[p, 1] = src block block_pairs[p, 0],
// where a "block" is num_vec16_per_block 16-byte words (block_size * num_kv_heads * head_dim
// elements of any 16-bit or 32-bit dtype: the kernel moves bytes, so one instantiation
// serves every dtype and layer).
//
// Pointers:
//   dst          [num_dst_blocks, num_vec16_per_block] 16-byte words (a cache
//                [num_blocks, block_size, num_kv_heads, head_dim] or a staging buffer
//                [num_pairs, block_size, num_kv_heads, head_dim]), 16-byte aligned
//   src          [num_src_blocks, num_vec16_per_block] 16-byte words; may be the same
//                array as dst (copy-on-write) when no destination is also a source
//   block_pairs  [num_pairs, 2] int32 (src_block, dst_block); destinations distinct
// Gather for swap-out: pairs (block_id_i, i) into a staging buffer; scatter for swap-in:
// pairs (i, block_id_i) from one (runtime/kernels/cache_ops.py builds them).
//
// Launch geometry: grid (num_pairs), block 128, no shared memory; each thread moves every
// 128th 16-byte word of its pair's block (consecutive threads, consecutive words).
// Instantiations: copy_blocks. Scalar: long long num_vec16_per_block.
// Signature: (dst, src, block_pairs, num_vec16_per_block). Launched by
// runtime/kernels/cache_ops.py: move_blocks (behind copy_blocks, gather_blocks, scatter_blocks,
// swap_blocks), one launch per layer and per K / V array.
// Register budget: 40 per thread at 128 threads; the gate must show 0 spill bytes.
// Measured: no GPU numbers yet.
#include "common.cuh"

namespace block_copy {
constexpr int kThreads = 128;
}

extern "C" __global__ void __launch_bounds__(block_copy::kThreads)
    copy_blocks(uint4* dst, const uint4* src, const int* __restrict__ block_pairs,
                long long num_vec16_per_block) {
    const int pair = blockIdx.x;
    const long long src_base = block_pairs[2 * pair] * num_vec16_per_block;
    const long long dst_base = block_pairs[2 * pair + 1] * num_vec16_per_block;
    for (long long w = threadIdx.x; w < num_vec16_per_block; w += block_copy::kThreads)
        dst[dst_base + w] = src[src_base + w];
}
