// Hopper (sm_90a) building blocks shared by hylo's CUDA kernels: shared-memory addresses, mbarriers, wgmma's
// fences and its shared-memory matrix descriptors. Included by the kernels' sources (`cuda_build` hashes an
// included header with the source that includes it, so a change here rebuilds every kernel).
#pragma once

#include <cuda.h>
#include <stdint.h>

namespace hopper {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// A TMA load of the box at (inner, outer) of a 2-D tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int inner, int outer, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(smem_u32(bar))
        : "memory");
}

// The generic proxy's shared-memory writes made so far by this thread (stores, completed cp.async copies)
// ordered before the async proxy's later reads (wgmma operands, TMA stores).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A barrier among `threads` threads (a multiple of 32) of the CTA, numbered `id` (1-15: 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// wgmma's shared-memory matrix descriptor of a tile in the 128-byte swizzle (8-row atoms of 128-byte rows,
// 1024-byte aligned). K-major operands: `stride` is the distance between 8-row atoms along M/N and `leading`
// is unused (1). MN-major operands: `leading` is the distance between 64-element (128-byte) groups along
// M/N, `stride` the distance between 8-row groups along K. Both in bytes.
__device__ __forceinline__ uint64_t descriptor(const void* p, uint32_t leading, uint32_t stride) {
    const uint64_t address = smem_u32(p);
    return ((address & 0x3FFFF) >> 4) | (uint64_t((leading >> 4) & 0x3FFF) << 16) |
           (uint64_t((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// K-major tile in the 128-byte swizzle with atoms 1024 bytes apart (TMA's 128-byte swizzle of 128-byte rows).
__device__ __forceinline__ uint64_t tile_descriptor(const void* p) { return descriptor(p, 16, 1024); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// All but the newest N committed groups done.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins 64 accumulator registers at this point of the program: reads of them are not moved above an earlier wait.
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace hopper
