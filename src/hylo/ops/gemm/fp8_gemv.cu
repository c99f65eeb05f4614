// y[M, N] = x[M, K] · (W[N, K] ⊙ scale)ᵀ for M ≤ 16: bf16 x, e4m3 W with one fp32 scale per [128, 128]
// block, bf16 y with fp32 accumulation. Hopper (sm_90a); built and loaded by `gemv_cuda.py`.
//
// Why tensor cores in a GEMV: at M = 8-16 a CUDA-core GEMV issues M FMAs per weight byte, more than the
// SM can issue at HBM rate (an H200 streams ~16 weight bytes per SM per clock; 16 FMAs each is twice the
// FP32 issue rate). So the product runs on `mma.sync.m16n8k16` (bf16 in, fp32 out) with the operands
// swapped: 16 weight rows are the MMA's M side, the (up to 8) rows of x its N side. The MMA's cost is then
// independent of M; what is left per weight byte is its conversion to bf16 (a few integer ops, below).
//
// Work split. A CTA is 8 warps over 64 weight rows: 4 warps side by side over rows (a 16-row tile each)
// times 2 over K (SLICES; 4, a CTA of 16 warps, where one wave of CTAs leaves each SM too few warps to
// keep its schedulers issuing: the widening below makes this kernel issue-bound before HBM-bound, RESULTS
// S32-4; `gemv_cuda.slices_for` chooses). A cluster of SPLIT CTAs (1, 2, 4 or 8, along grid y) shares the same 64 rows and splits
// K further, so that every shape fills the SMs (N = 2048 makes 32 row groups; SPLIT = 8 makes 256 CTAs).
// Each warp walks a contiguous run of 128-k blocks (the scale block): per block each lane loads 16 bytes
// from row g and 16 from row g + 8 of its tile at k offsets 16t and 64 + 16t (g = lane / 4, t = lane % 4),
// so one load instruction reads 64 contiguous bytes of each of 8 rows. Loads run DEPTH blocks ahead in a
// register ring (memory-level parallelism is what a GEMV's bandwidth is made of: 8 warps × 2 CTAs × DEPTH
// × 64 bytes a lane is 64-96 KB in flight per SM, above what HBM's latency × bandwidth asks).
//
// The MMA's K order is free as long as both operands agree: MMA j (0..3) of half h takes k-slots
// {2t, 2t+1} ↔ k = 64h + 16t + 4j + {0, 1} and {2t+8, 2t+9} ↔ 64h + 16t + 4j + {2, 3}. Then the A
// fragment is the lane's own loaded bytes (word j of its 16-byte load) and the B fragment is x[g][64h +
// 16t + 4j ...], two consecutive bf16 pairs of the lane's own 16-element slice of x: no shuffles.
// The block's 8 MMAs accumulate a partial that is multiplied by the block's scale once and added to the
// fp32 accumulator (the scale applied per (row, 128-k block) partial, as DeepSeek-V3's FP8 GEMMs promote).
// x is read with L1-cached loads: the 4 row warps of a CTA (and CTAs on the same SM) read the same x
// slice, so x costs L2 about 2·M/64 bytes per weight byte at most. Weight loads bypass L1.
//
// Programmatic dependent launch (PDL, sm_90; `ops.dependent_launch`): launched with `dependent`, a GEMV
// starts while the kernel before it finishes. Its weights and scales do not depend on that kernel, so the
// first DEPTH blocks of every warp are loaded before `griddepcontrol.wait` (so the kernel before it must
// not be the one that wrote them); x is read and `out` written only after it. Right after its wait each CTA lets the next kernel launch (`launch_dependents`; letting it
// go after the main loop instead was no faster, RESULTS S32-2); that kernel's own wait still holds it
// until this one has finished and its stores are visible.
//
// The end: each warp writes its partial tile to shared memory; after a cluster barrier (a CTA barrier where
// SPLIT is 1), CTA r of the cluster sums rows [r·64/SPLIT, (r+1)·64/SPLIT) over the SPLIT CTAs (distributed
// shared memory) and the 2 K warps, in a fixed order (deterministic), and writes bf16; a second barrier keeps
// each CTA's shared memory alive until the others have read it. One launch, no workspace, no atomics.
//
// Supported: 1 ≤ M ≤ 16, any N, K a multiple of 16 (16-byte loads; a 128-k block may be partial), rows of
// x and W 16-byte aligned. `gemv_cuda.refusal` checks these before a call.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "call_layout.cuh"

namespace cg = cooperative_groups;

// Blocks in flight per warp (the register ring) and the CTAs a SM must be able to hold (the register
// budget) of the 8-warp CTAs, by rows of x: `-D` overrides are for `benchmarks/kernels/fp8_gemv_cuda.py
// --variants`; the defaults are the measured choice in the decode replay (deeper rings at one CTA a SM were no
// faster on N = 4096 and slower on multi-wave shapes, RESULTS S32-2). Back to back, two blocks a warp at three
// CTAs a SM up to 8 rows (`-DHYLO_GEMV_DEPTH_8=2 -DHYLO_GEMV_MIN_CTAS_8=3`: 78 registers, the 388 CTAs of the
// 24832-row projection in one wave) ran 3-18% faster than these defaults on every measured shape (S53-2), against a
// build whose wait ptxas had hoisted over its first loads (S53-3); it is not the default until a decode replay
// with dependent launches measures it.
#ifndef HYLO_GEMV_DEPTH_8
#define HYLO_GEMV_DEPTH_8 3  // up to 8 rows of x
#endif
#ifndef HYLO_GEMV_DEPTH_16
#define HYLO_GEMV_DEPTH_16 2  // 9 to 16 rows of x
#endif
#ifndef HYLO_GEMV_MIN_CTAS_8
#define HYLO_GEMV_MIN_CTAS_8 2
#endif
#ifndef HYLO_GEMV_MIN_CTAS_16
#define HYLO_GEMV_MIN_CTAS_16 2
#endif
// KiB of weights the whole grid asks L2 to fetch, past the register ring, before its dependent-launch wait
// (`l2_prefetch`; 0: none). A benchmark variant, not yet timed on a GPU: the ring's first fill already asks for
// ~13 MB before the wait on the wide shapes (about 4 us of HBM), so it can only pay behind longer kernels.
#ifndef HYLO_GEMV_L2_AHEAD_KIB
#define HYLO_GEMV_L2_AHEAD_KIB 0
#endif


namespace {

constexpr int kRowWarps = 4;  // warps side by side over rows, a 16-row tile each
constexpr int kTileRows = 16;  // the MMA's M side
constexpr int kCtaRows = kRowWarps * kTileRows;
constexpr int kBlockK = 128;  // the scale block, one step of a warp

// One lane's share of one 128-k block: 16 bytes of rows g and g + 8 at k halves 0 and 1, and the scale.
struct Step {
    uint4 w[2][2];  // [row g / g + 8][k half]
    float scale;
};

__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
    uint4 v;
    // weights are read once: keep them out of L1 (x lives there) and let L2 fetch 256-byte runs
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Two e4m3 bytes, each at the top of a 16-bit half ([b1 00 b0 00]), as bf16x2 bits of 2^-120 times their
// values: e4m3's sign goes to bit 15 and its 4 exponent and 3 mantissa bits to bf16's bits 4..10 (the low
// exponent bits and the top mantissa bits), so exponent bias 7 reads as 127 and e4m3's subnormals land on
// bf16's subnormals of the same significand: exact for every byte (NaN 0x7f/0xff aside).
__device__ __forceinline__ uint32_t spread_e4m3x2_to_scaled_bf16x2(uint32_t spread) {
    return (spread & 0x80008000u) | ((spread >> 4) & 0x07F007F0u);
}

// 2^120 as bf16x2: undoes the conversion's 2^-120 exactly (a power of two into the normal range).
__device__ __forceinline__ uint32_t unscale_bf16x2(uint32_t bits) {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&bits);
    const __nv_bfloat162 two_pow_120 = __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
    const __nv_bfloat162 r = __hmul2(v, two_pow_120);
    return *reinterpret_cast<const uint32_t*>(&r);
}

// Four e4m3 bytes [b3 b2 b1 b0] (k, k+1, k+2, k+3) as two bf16x2: lo = (b0, b1), hi = (b2, b3).
__device__ __forceinline__ void e4m3x4_to_bf16x2x2(uint32_t q, uint32_t& lo, uint32_t& hi) {
    lo = unscale_bf16x2(spread_e4m3x2_to_scaled_bf16x2(__byte_perm(q, 0u, 0x1404)));
    hi = unscale_bf16x2(spread_e4m3x2_to_scaled_bf16x2(__byte_perm(q, 0u, 0x3424)));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// d += a · b for a 16 x 16 bf16 A (row-major fragment), a 16 x 8 bf16 B (column-major), fp32 d.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Problem {
    const __nv_bfloat16* x;
    int64_t x_stride;  // elements between rows of x
    const uint8_t* w;  // [N, K] e4m3, rows contiguous
    const float* scale;
    int64_t scale_stride;  // elements between rows of scale
    __nv_bfloat16* out;    // [M, N] contiguous
    int m, n, k;
};

// One lane's read positions along its warp's run of 128-k blocks, set once before the main loop: the weight
// rows g and g + 8 and x's rows 8nt + g at k = 128·begin + 16t, the tile's scale row at block `begin`. A step
// i blocks into the run reads at fixed offsets from them (i·128 + 64h), so the loop does no address arithmetic
// beyond an add per load (recomputing rows, strides and clamps every step had cost ~100 instructions a step
// against the ~170 that widen and multiply its weights).
template <int NT>
struct Cursor {
    const uint8_t* g;
    const uint8_t* g8;
    const float* scale;
    const __nv_bfloat16* x[NT];  // rows past m read row m - 1: they only make output rows that are never stored
    int k;            // 128·begin + 16t: the k of the first byte at `g`
    int k_end;        // p.k
};

// `v` through an opaque move: the compiler keeps the value in a register instead of recomputing it from the
// kernel's parameters wherever it is used (which it otherwise prefers, at the cost of that recomputation in
// every step of the main loop).
template <typename T>
__device__ __forceinline__ T* kept(T* v) {
    uint64_t bits = reinterpret_cast<uint64_t>(v);
    asm volatile("mov.b64 %0, %0;" : "+l"(bits));
    return reinterpret_cast<T*>(bits);
}

__device__ __forceinline__ int kept(int v) {
    asm volatile("mov.b32 %0, %0;" : "+r"(v));
    return v;
}

template <int NT>
__device__ __forceinline__ Cursor<NT> cursor(const Problem& p, int tile_row, int begin, int g, int t) {
    Cursor<NT> c;
    const int k = begin * kBlockK + 16 * t;
    // rows past N read row N - 1 (their results are never stored)
    c.g = kept(p.w + static_cast<int64_t>(min(tile_row + g, p.n - 1)) * p.k + k);
    c.g8 = kept(p.w + static_cast<int64_t>(min(tile_row + g + 8, p.n - 1)) * p.k + k);
    c.scale = kept(p.scale + static_cast<int64_t>(min(tile_row, p.n - 1) / 128) * p.scale_stride + begin);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        c.x[nt] = kept(p.x + static_cast<int64_t>(min(8 * nt + g, p.m - 1)) * p.x_stride + k);
    }
    c.k = kept(k);
    c.k_end = p.k;
    return c;
}

// Issue the loads of block `i` of the run into `step` (zeros past K; FULL: K is a multiple of 128, so every
// block is whole and no load needs a bound).
template <int NT, bool FULL>
__device__ __forceinline__ void load_step(Step& step, const Cursor<NT>& c, int i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int offset = i * kBlockK + 64 * h;
        // K is a multiple of 16: a 16-byte chunk is all in or all out
        const bool inside = FULL || c.k + offset < c.k_end;
        step.w[0][h] = inside ? load_streaming(c.g + offset) : make_uint4(0, 0, 0, 0);
        step.w[1][h] = inside ? load_streaming(c.g8 + offset) : make_uint4(0, 0, 0, 0);
    }
    step.scale = __ldg(c.scale + i);
}

// Ask L2 for the blocks of the warp's run after its ring's first DEPTH, as many as the grid's share of
// HYLO_GEMV_L2_AHEAD_KIB gives each warp: one bulk prefetch per weight row (lanes t = 0 take row g, t = 1 row g + 8),
// no registers held. Issued before the dependent-launch wait, these stream while the kernel before this one runs
// (in a decode step mostly a short latency-bound kernel, whose time HBM otherwise spends idle).
template <int NT, int DEPTH, int WARPS>
__device__ __forceinline__ void l2_prefetch(const Cursor<NT>& c, int blocks, int t) {
    constexpr long long kBudget = static_cast<long long>(HYLO_GEMV_L2_AHEAD_KIB) << 10;
    if constexpr (kBudget > 0) {
        const long long warps = static_cast<long long>(gridDim.x) * gridDim.y * WARPS;
        const int ahead = min(blocks - DEPTH, static_cast<int>(kBudget / (warps * kTileRows * kBlockK)));
        if (ahead <= 0 || t > 1) return;
        const uint8_t* row = (t == 0 ? c.g : c.g8 - 16) + DEPTH * kBlockK;  // k = 128·(begin + DEPTH)
        const int first = c.k - 16 * t + DEPTH * kBlockK;
        const int bytes = min(ahead * kBlockK, c.k_end - first);  // a partial last block: K is a multiple of 16
        if (bytes > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(bytes) : "memory");
    }
}

// acc += scale · (W block i of the run) · x rows: 8 MMAs per 8 rows of x into a partial, then one scaled add.
template <int NT, bool FULL>
__device__ __forceinline__ void multiply_step(float (&acc)[NT][4], const Step& step, const Cursor<NT>& c, int i) {
    float part[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int offset = i * kBlockK + 64 * h;
        const bool inside = FULL || c.k + offset < c.k_end;
        uint4 xs[NT][2];  // x[8nt + g][k .. k + 16)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint4* src = reinterpret_cast<const uint4*>(c.x[nt] + offset);
            xs[nt][0] = inside ? __ldg(src) : make_uint4(0, 0, 0, 0);
            xs[nt][1] = inside ? __ldg(src + 1) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t g_lo, g_hi, g8_lo, g8_hi;
            e4m3x4_to_bf16x2x2(word(step.w[0][h], j), g_lo, g_hi);
            e4m3x4_to_bf16x2x2(word(step.w[1][h], j), g8_lo, g8_hi);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint4& xv = xs[nt][j / 2];
                const int first = 2 * (j % 2);
                mma_16x8x16(part[nt], g_lo, g8_lo, g_hi, g8_hi, word(xv, first), word(xv, first + 1));
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = fmaf(part[nt][i], step.scale, acc[nt][i]);
    }
}

// NT: tiles of 8 rows of x (1 for M ≤ 8, 2 for M ≤ 16). SPLIT: CTAs of a cluster splitting K. FULL: K is a
// multiple of 128 (every projection of the model), so the loads take no bounds.
// DEPTH: 128-k blocks in flight per warp. SLICES: warps of a CTA side by side over K (2: two CTAs of 8
// warps fit a SM; 4: one of 16, for single-wave shapes whose 8 warps a SM leave the schedulers idle, RESULTS
// S32-4).
template <int NT, int SPLIT, int DEPTH, int SLICES, bool FULL>
__global__ void __launch_bounds__(kRowWarps * SLICES * 32,
                                  SLICES == 2 ? (NT == 1 ? HYLO_GEMV_MIN_CTAS_8 : HYLO_GEMV_MIN_CTAS_16) : 1)
    __cluster_dims__(1, SPLIT, 1) fp8_gemv_kernel(Problem p) {
    constexpr int kSliceWarps = SLICES;
    constexpr int kThreads = kRowWarps * SLICES * 32;
    __shared__ float partials[kSliceWarps][kCtaRows][8 * NT];
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int row_warp = warp % kRowWarps, slice_warp = warp / kRowWarps;
    const int tile_row = blockIdx.x * kCtaRows + row_warp * kTileRows;

    // this warp's contiguous run of 128-k blocks: slice (rank, slice_warp) of SPLIT × kSliceWarps
    const int kblocks = (p.k + kBlockK - 1) / kBlockK;
    const int slices = SPLIT * kSliceWarps, slice = rank * kSliceWarps + slice_warp;
    const int begin = kblocks * slice / slices;
    const int end = tile_row < p.n ? kblocks * (slice + 1) / slices : begin;  // a tile past N has no work

    const Cursor<NT> c = cursor<NT>(p, tile_row, begin, g, t);
    const int blocks = end - begin;

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

    Step ring[DEPTH];
    // One trip of a loop whose count the compiler cannot see: ptxas does not move the wait below into or above
    // it, where it otherwise hoists the wait over these (predicated, branch-free) loads to the kernel's first
    // instruction and the weights no longer stream while the kernel before this one finishes (S53-3).
    for (int pass = kept(0); pass < 1; ++pass) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            if (d < blocks) load_step<NT, FULL>(ring[d], c, d);
        }
        l2_prefetch<NT, DEPTH, kRowWarps * SLICES>(c, blocks, t);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x and out: after the kernel before this one
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int i = 0; i < blocks; i += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            if (i + d < blocks) {
                multiply_step<NT, FULL>(acc, ring[d], c, i + d);
                if (i + d + DEPTH < blocks) load_step<NT, FULL>(ring[d], c, i + d + DEPTH);
            }
        }
    }

    // fragment layout of the accumulator: [0], [1] are weight row g, x rows 8nt + 2t, +1; [2], [3] row g + 8
    const int local = row_warp * kTileRows + g;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        partials[slice_warp][local][8 * nt + 2 * t] = acc[nt][0];
        partials[slice_warp][local][8 * nt + 2 * t + 1] = acc[nt][1];
        partials[slice_warp][local + 8][8 * nt + 2 * t] = acc[nt][2];
        partials[slice_warp][local + 8][8 * nt + 2 * t + 1] = acc[nt][3];
    }
    // A cluster of one CTA needs only a CTA barrier: the cluster barrier's release and acquire compile to a
    // GPU-wide memory barrier and an L1 invalidation, and its shared-memory reads to generic loads.
    if constexpr (SPLIT == 1) {
        __syncthreads();
    } else {
        cluster.sync();
    }

    constexpr int kRowsPerRank = kCtaRows / SPLIT;
    for (int e = threadIdx.x; e < kRowsPerRank * 8 * NT; e += kThreads) {
        const int r = rank * kRowsPerRank + e % kRowsPerRank, m = e / kRowsPerRank;
        const int n = blockIdx.x * kCtaRows + r;
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < SPLIT; ++s) {
            const float* theirs = SPLIT == 1 ? &partials[0][0][0] : cluster.map_shared_rank(&partials[0][0][0], s);
#pragma unroll
            for (int w = 0; w < kSliceWarps; ++w) sum += theirs[(w * kCtaRows + r) * 8 * NT + m];
        }
        if (m < p.m && n < p.n) p.out[static_cast<int64_t>(m) * p.n + n] = __float2bfloat16_rn(sum);
    }
    if constexpr (SPLIT > 1) cluster.sync();  // the other CTAs of the cluster may still be reading these partials
}

template <int NT, int SPLIT, int SLICES>
cudaError_t launch(const Problem& p, bool dependent, cudaStream_t stream) {
    constexpr int depth = NT == 1 ? HYLO_GEMV_DEPTH_8 : HYLO_GEMV_DEPTH_16;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((p.n + kCtaRows - 1) / kCtaRows, SPLIT);
    config.blockDim = dim3(kRowWarps * SLICES * 32);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = dependent ? 1 : 0;
    if (p.k % kBlockK == 0) return cudaLaunchKernelEx(&config, fp8_gemv_kernel<NT, SPLIT, depth, SLICES, true>, p);
    return cudaLaunchKernelEx(&config, fp8_gemv_kernel<NT, SPLIT, depth, SLICES, false>, p);
}

template <int NT, int SLICES>
cudaError_t launch_split(const Problem& p, int split, bool dependent, cudaStream_t stream) {
    switch (split) {
        case 1: return launch<NT, 1, SLICES>(p, dependent, stream);
        case 2: return launch<NT, 2, SLICES>(p, dependent, stream);
        case 4: return launch<NT, 4, SLICES>(p, dependent, stream);
        case 8: return launch<NT, 8, SLICES>(p, dependent, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

// One call's operands by role; `gemv_cuda.py`'s ctypes structures mirror these field for field (the loader
// compares `hylo_fp8_gemv_call_layout` with theirs). Outside the anonymous namespace: a C entry point taking a
// type of internal linkage is not exported.
struct GemvRows {  // x: bf16 [m, k], rows `stride` elements apart (a multiple of 8)
    const void* data;
    long long stride;
    int m;
};
struct BlockScaledWeight {  // e4m3 [n, k], rows contiguous, with fp32 128 × 128 block scales
    const void* data;
    const void* scale;
    long long scale_stride;  // elements between rows of scale
    int n;
    int k;
};
struct GemvPlan {
    int split;  // CTAs of a cluster over K
    int slices;  // warps of a CTA over K: 2, or 4 for up to 8 rows of x
    int dependent;  // nonzero: a programmatic dependent of the launch before it
};
struct GemvCall {
    GemvRows x;
    BlockScaledWeight w;
    void* out;  // bf16 [m, n] contiguous
    GemvPlan plan;
};

extern "C" {

// 64 weight rows per CTA: `gemv_cuda.split_for` sizes the grid with it.
int hylo_fp8_gemv_cta_rows() { return kCtaRows; }

int hylo_fp8_gemv_call_layout(long long* out, int capacity) {
    static const long long fields[][2] = {
        HYLO_FIELD(GemvCall, x.data),         HYLO_FIELD(GemvCall, x.stride),      HYLO_FIELD(GemvCall, x.m),
        HYLO_FIELD(GemvCall, w.data),         HYLO_FIELD(GemvCall, w.scale),       HYLO_FIELD(GemvCall, w.scale_stride),
        HYLO_FIELD(GemvCall, w.n),            HYLO_FIELD(GemvCall, w.k),           HYLO_FIELD(GemvCall, out),
        HYLO_FIELD(GemvCall, plan.split),     HYLO_FIELD(GemvCall, plan.slices),   HYLO_FIELD(GemvCall, plan.dependent),
    };
    return hylo_abi::write_layout(fields, out, capacity);
}

// Launch `call` on `stream` (a cudaStream_t; capture-safe: no allocation, no synchronisation). Returns the
// cudaError_t of the launch (0: launched); unsupported arguments return cudaErrorInvalidValue unlaunched.
int hylo_fp8_gemv(const GemvCall* call, void* stream) {
    const GemvCall& c = *call;
    const int m = c.x.m, n = c.w.n, k = c.w.k, split = c.plan.split, slices = c.plan.slices;
    const bool dependent = c.plan.dependent != 0;
    if (m < 1 || m > 16 || n < 1 || k < 16 || k % 16 || c.x.stride % 8) return cudaErrorInvalidValue;
    const Problem p{static_cast<const __nv_bfloat16*>(c.x.data), c.x.stride, static_cast<const uint8_t*>(c.w.data),
                    static_cast<const float*>(c.w.scale), c.w.scale_stride, static_cast<__nv_bfloat16*>(c.out),
                    m, n, k};
    const auto s = static_cast<cudaStream_t>(stream);
    if (slices == 4 && m <= 8) return launch_split<1, 4>(p, split, dependent, s);
    if (slices != 2) return cudaErrorInvalidValue;
    return m <= 8 ? launch_split<1, 2>(p, split, dependent, s) : launch_split<2, 2>(p, split, dependent, s);
}

}  // extern "C"
