// Absorbed sparse MLA for prefill-sized batches on Hopper (sm_90a): out[t, h] = Σ_j softmax_j(q[t, h]·kv_j ·
// scale) kv_j over the latent rows kv_j = latent[rows[t, j]] (rows -1: empty), rank 512, bf16, fp32 softmax.
// Built and loaded by `cuda_prefill.py`; the Triton kernel (`kernels._sparse_mla_kernel`) computes the same
// attention and stays the fallback.
//
// Why a kernel of its own: in a 13K-token prefill the Triton kernel runs at ~230 TFLOP/s on an H100 (RESULTS
// S36, a third of the bf16 ceiling). Every token gathers its own ~2K rows, so the only reuse of a gathered row
// is across the 64 heads: one 64-head block is one wgmma M, and each 64-row block of keys (64 KB) feeds 8.4
// MFLOP. This kernel keeps the tensor cores fed by gathering the next block while the current one is used.
//
// CTA = (token, 64 heads), 3 warpgroups. Warpgroup 0 gathers: its 128 threads copy the query rows once and
// each 64-row block of keys (16-byte cp.async, zero-filled for empty rows) into a ring of 2 slots, in wgmma's
// 128-byte swizzle, and mark which rows are real; a full mbarrier (all 128 threads, after their copies
// landed) and an empty one (the two consumers) guard each slot. Warpgroups 1 and 2 consume: warpgroup c
// scores the 32 keys 32c.. of the block against all 64 heads (S = Q·Kᵀ, m64n32k16, Q and K from shared
// memory), the two exchange their row maxima through shared memory, write their probabilities exp2(s - m) in
// bf16 into one shared 64 × 64 tile, and each multiplies the whole tile into its half of the output, dims
// 256c.. (O += P·V, m64n256k16, V = the same key rows read MN-major). Each keeps the sum of its own
// probabilities under the common running maximum; the two sums meet at the end. A token walks its list only
// to its last real row (the indexer writes the real rows first).
//
// The running maximum moves only when a row's new maximum passes it by more than 8 (base 2: probabilities stay
// below 2^8, well inside bf16 and fp32), so most blocks skip the rescaling of the 128 output registers
// (HYLO_SPARSE_MLA_RESCALE_SLACK, a macro a benchmark can set to 0; exact either way, the output is normalised
// by sums taken under the same maximum): 10.36 -> 8.54 ms at 13312 tokens on an H100. Issuing the next
// block's scores right behind this block's values was 1.5% slower (RESULTS S40-2): the kernel is bound by
// its math (the probes: the math alone on stale slots 7.6 ms, the gather alone 4.2), the scores' m64n32
// reading all of Q from shared memory for 32 keys.
//
// Shared memory (1024-aligned): Q [64 × 512] and each slot [64 × 512] as 8 panels of 64 rows × 128 bytes
// (64 dims) in the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), the P tile (one panel), the
// row maxima and sums, the slots' row masks and the mbarriers: 201 KB.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../gemm/call_layout.cuh"
#include "../gemm/hopper.cuh"

namespace {

using namespace hopper;

constexpr int kHeads = 64;                 // heads of a CTA (the wgmma M)
constexpr int kRank = 512;                 // latent dims
constexpr int kKeys = 64;                  // key rows of a block
constexpr int kStages = 2;                 // ring slots
constexpr int kPanels = kRank / 64;        // 64-dim panels of a row tile
constexpr int kPanelBytes = 64 * 128;      // 64 rows × 128 bytes
constexpr int kTileBytes = kPanels * kPanelBytes;  // 64 KB: Q, or one slot
constexpr int kHalf = kKeys / 2;           // keys a consumer scores
constexpr int kOutHalf = kRank / 2;        // dims a consumer accumulates
constexpr int kThreads = 384;
#ifndef HYLO_SPARSE_MLA_RESCALE_SLACK
#define HYLO_SPARSE_MLA_RESCALE_SLACK 8.0f  // 0: the running maximum follows every block
#endif
constexpr float kRescaleSlack = HYLO_SPARSE_MLA_RESCALE_SLACK;
#ifndef HYLO_SPARSE_MLA_PROBE
#define HYLO_SPARSE_MLA_PROBE 0  // benchmarks only, wrong outputs: 1 gathers without the math, 2 the math on stale slots
#endif
constexpr int kProbe = HYLO_SPARSE_MLA_PROBE;
constexpr int kSmemBytes = (1 + kStages) * kTileBytes  // Q and the ring
                           + kPanelBytes               // P
                           + 2 * 2 * kHeads * 4        // row maxima and sums of each consumer
                           + kStages * 8               // row masks
                           + 2 * kStages * 8           // full / empty mbarriers
                           + 16                        // the token's block count
                           + 1024;                     // alignment slack

struct Args {
    const __nv_bfloat16* q;       // [T, H, 512]
    const __nv_bfloat16* latent;  // [S, 512] rows stride_kv apart
    const int* rows;              // [T, width] int32, -1 = empty
    __nv_bfloat16* out;           // [T, H, 512]
    long long stride_qt, stride_qh, stride_kv, stride_rt, stride_ot, stride_oh;  // elements
    int width;
    float scale_log2;  // softmax scale × log2(e): scores are kept in base 2
};

// S[64 × 32] (+)= A[64 × 16] · B[32 × 16]ᵀ, bf16 in, fp32 sums, both operands K-major in shared memory.
__device__ __forceinline__ void wgmma_m64n32k16(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate));
}

#define HYLO_F8(d, i)                                                                                        \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])

// O[64 × 256] += A[64 × 16] · B[16 × 256], bf16 in, fp32 sums; A K-major, B MN-major (dims contiguous).
__device__ __forceinline__ void wgmma_m64n256k16_mn(float* d, uint64_t a, uint64_t b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 1;\n"
        "}\n"
        : HYLO_F8(d, 0), HYLO_F8(d, 8), HYLO_F8(d, 16), HYLO_F8(d, 24), HYLO_F8(d, 32), HYLO_F8(d, 40),
          HYLO_F8(d, 48), HYLO_F8(d, 56), HYLO_F8(d, 64), HYLO_F8(d, 72), HYLO_F8(d, 80), HYLO_F8(d, 88),
          HYLO_F8(d, 96), HYLO_F8(d, 104), HYLO_F8(d, 112), HYLO_F8(d, 120)
        : "l"(a), "l"(b));
}

#undef HYLO_F8

// S[64 heads × 32 keys] of consumer c: the queries against keys 32c .. 32c + 31 of the block in `slot`, issued
// and committed as one wgmma group (not awaited).
__device__ __forceinline__ void issue_scores(float* score, const uint8_t* q_tile, const uint8_t* slot, int c) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kRank / 16; ++k) {
        const int offset = (k >> 2) * kPanelBytes + (k & 3) * 32;
        wgmma_m64n32k16(score, tile_descriptor(q_tile + offset), tile_descriptor(slot + offset + c * kHalf * 128), k);
    }
    wgmma_commit();
}

// The values v[h] of this thread's rows row0 + 8h, reduced over the quad of lanes sharing a row (maximum, or
// sum), stored by the quad's first lane to rows[row0 + 8h] (shared memory the other consumer reads).
template <bool kMaximum>
__device__ __forceinline__ void publish_rows(float* v, float* rows, int row0, int quad) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int lanes = 1; lanes <= 2; lanes *= 2) {
            const float other = __shfl_xor_sync(0xffffffff, v[h], lanes);
            v[h] = kMaximum ? fmaxf(v[h], other) : v[h] + other;
        }
        if (quad == 0) rows[row0 + 8 * h] = v[h];
    }
}

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool real) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(real ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Byte offset of 16-byte chunk `chunk` (0-63: dims 8·chunk..) of row `row` in a [64 × 512] tile of 8 panels.
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
    return (chunk >> 3) * kPanelBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// One warp of the gatherer copies rows 16·warp .. + 15 of a tile: `row_src` is this lane's row (lanes 0-15:
// rows 16·warp + lane; 16-31 repeat them), null where the row is empty (its chunks are zero-filled).
__device__ __forceinline__ void gather_rows(uint32_t tile, int warp, int lane, const __nv_bfloat16* row_src,
                                            const __nv_bfloat16* any_row) {
    // per step a warp copies half a row: 32 lanes × 16 contiguous bytes
#pragma unroll 4
    for (int step = 0; step < 32; ++step) {
        const int local = step >> 1, chunk = (step & 1) * 32 + lane;
        const __nv_bfloat16* src =
            reinterpret_cast<const __nv_bfloat16*>(__shfl_sync(0xffffffff, reinterpret_cast<uintptr_t>(row_src), local));
        copy16(tile + tile_offset(16 * warp + local, chunk), (src ? src : any_row) + 8 * chunk, src != nullptr);
    }
}

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_prefill_kernel(const Args p) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint8_t* q_tile = smem;
    uint8_t* ring = smem + kTileBytes;
    uint8_t* p_tile = ring + kStages * kTileBytes;
    float* row_max = reinterpret_cast<float*>(p_tile + kPanelBytes);  // [2 consumers][64]
    float* row_sum = row_max + 2 * kHeads;                              // [2 consumers][64]
    uint16_t* masks = reinterpret_cast<uint16_t*>(row_sum + 2 * kHeads);  // [stage][4 warps]: real rows
    uint64_t* full = reinterpret_cast<uint64_t*>(masks + 4 * kStages);
    uint64_t* empty = full + kStages;
    int* block_count = reinterpret_cast<int*>(empty + kStages);

    const long long token = blockIdx.x;
    const int head0 = blockIdx.y * kHeads;
    const int* rows = p.rows + token * p.stride_rt;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // the blocks to walk: up to the last real row of the list
    if (threadIdx.x == 0) {
        *block_count = 0;
        for (int s = 0; s < kStages; ++s) {
            bar_init(&full[s], 128);
            bar_init(&empty[s], 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int last = 0;
    for (int j = threadIdx.x; j < p.width; j += kThreads)
        if (rows[j] >= 0) last = j + 1;
    last = __reduce_max_sync(0xffffffff, last);
    if (lane == 0 && last > 0) atomicMax(block_count, last);
    __syncthreads();
    const int blocks = (*block_count + kKeys - 1) / kKeys;

    if (warp < 4) {  // the gatherer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (blocks == 0) return;
        const int local = 16 * warp + (lane & 15);
        gather_rows(smem_u32(q_tile), warp, lane, p.q + token * p.stride_qt + (long long)(head0 + local) * p.stride_qh,
                    p.latent);
        copies_commit();
        // Block b - 1 is announced as soon as it has landed (with the queries, for block 0), before the wait for
        // block b's slot: the consumers release block b - 2 just before they need block b - 1.
        for (int b = 0; b < blocks; ++b) {
            const int s = b % kStages;
            if (b > 0) {
                copies_wait<0>();  // block b - 1 is the only group in flight
                fence_async_shared();
                bar_arrive(&full[(b - 1) % kStages]);
            }
            if (b >= kStages) bar_wait(&empty[s], ((b / kStages) - 1) & 1);
            const int j = b * kKeys + local;
            const int slot = j < p.width ? rows[j] : -1;
            const unsigned real = __ballot_sync(0xffffffff, slot >= 0) & 0xffff;
            if (lane == 0) masks[s * 4 + warp] = static_cast<uint16_t>(real);
            if (kProbe != 2 || b < kStages)
                gather_rows(smem_u32(ring + s * kTileBytes), warp, lane,
                            slot >= 0 ? p.latent + (long long)slot * p.stride_kv : nullptr, p.latent);
            copies_commit();
        }
        copies_wait<0>();
        fence_async_shared();
        bar_arrive(&full[(blocks - 1) % kStages]);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    const int c = warp / 4 - 1;                   // consumer 0 or 1
    const int row0 = (warp % 4) * 16 + lane / 4;  // this thread's heads: row0 and row0 + 8 of the block
    const int quad = lane % 4;
    // accumulator register i: row row0 + 8·((i >> 1) & 1), column 8·(i >> 2) + 2·quad + (i & 1)
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m[2] = {-1.0e30f, -1.0e30f};  // finite: exp2(-inf - m) = 0, never NaN
    float l[2] = {0.f, 0.f};            // this thread's share of the sums of its own keys' probabilities

    float score[16];
    for (int b = 0; b < blocks; ++b) {
        const int s = b % kStages;
        const uint8_t* slot = ring + s * kTileBytes;
        if (kProbe == 1) {
            bar_wait(&full[s], (b / kStages) & 1);
            if ((threadIdx.x % 128) == 0) bar_arrive(&empty[s]);
            continue;
        }
        bar_wait(&full[s], (b / kStages) & 1);
        issue_scores(score, q_tile, slot, c);
        wgmma_wait<0>();

        // mask, scale, this consumer's row maxima
        const uint32_t real = masks[s * 4 + 2 * c] | (uint32_t(masks[s * 4 + 2 * c + 1]) << 16);
        float top[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int key = 8 * (i >> 2) + 2 * quad + (i & 1);  // 0-31 within this consumer's half
            score[i] = ((real >> key) & 1) ? score[i] * p.scale_log2 : -INFINITY;
            top[(i >> 1) & 1] = fmaxf(top[(i >> 1) & 1], score[i]);
        }
        publish_rows<true>(top, row_max + c * kHeads, row0, quad);
        named_barrier(1, 256);
        // The running maximum moves only past kRescaleSlack (base 2): probabilities stay below 2^kRescaleSlack,
        // and most blocks rescale nothing. Both consumers decide alike (the same maxima, max commutes).
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float seen = fmaxf(top[h], row_max[(1 - c) * kHeads + row0 + 8 * h]);
            const float next = seen > m[h] + kRescaleSlack ? seen : m[h];
            alpha[h] = exp2f(m[h] - next);
            m[h] = next;
            l[h] *= alpha[h];
        }
        // probabilities into the P tile: head row r, key 32c + col at 16-byte chunk (4c + col / 8) ^ (r % 8)
#pragma unroll
        for (int g = 0; g < 4; ++g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 4 * g + 2 * h, r = row0 + 8 * h;
                const float p0 = exp2f(score[i] - m[h]), p1 = exp2f(score[i + 1] - m[h]);
                l[h] += p0 + p1;
                const uint32_t at = r * 128 + ((((4 * c + g) ^ (r & 7))) << 4) + 4 * quad;
                *reinterpret_cast<__nv_bfloat162*>(p_tile + at) = __floats2bfloat162_rn(p0, p1);
            }
        }
        fence_async_shared();
        named_barrier(1, 256);

        if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKeys / 16; ++k)
            wgmma_m64n256k16_mn(o, tile_descriptor(p_tile + 32 * k),
                                descriptor(slot + 4 * c * kPanelBytes + k * 2048, kPanelBytes, 1024));
        wgmma_commit();
        wgmma_wait<0>();
        if ((threadIdx.x % 128) == 0) bar_arrive(&empty[s]);
    }

    // the two consumers' sums of probabilities meet; a token without rows (or a head row without) writes zeros
    publish_rows<false>(l, row_sum + c * kHeads, row0, quad);
    named_barrier(1, 256);
    float inverse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = row_sum[row0 + 8 * h] + row_sum[kHeads + row0 + 8 * h];
        inverse[h] = total > 0.f ? 1.0f / total : 0.f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        __nv_bfloat16* dst = p.out + token * p.stride_ot + (long long)(head0 + row0 + 8 * h) * p.stride_oh +
                             c * kOutHalf + 2 * quad;
#pragma unroll
        for (int g = 0; g < 32; ++g)
            *reinterpret_cast<__nv_bfloat162*>(dst + 8 * g) =
                __floats2bfloat162_rn(o[4 * g + 2 * h] * inverse[h], o[4 * g + 2 * h + 1] * inverse[h]);
    }
}

}  // namespace

// One call's operands by role; `cuda_prefill.py`'s ctypes structures mirror these field for field (the
// loader compares `hylo_sparse_mla_prefill_call_layout` with theirs). Outside the anonymous namespace: a C
// entry point taking a type of internal linkage is not exported.
struct HeadRows {  // bf16 [tokens, heads, 512], rows of 512 contiguous and 16-byte aligned
    void* data;
    long long stride_token;  // elements
    long long stride_head;
};
struct SparseMlaCall {
    HeadRows q;
    HeadRows out;
    const void* latent;  // bf16 [S, 512]
    long long latent_stride;  // elements between rows
    const int* rows;  // [tokens, width] int32, -1 = empty
    long long rows_stride;
    int width;
    int tokens;
    int heads;  // a multiple of 64
    float scale_log2;  // softmax scale × log2(e)
};

extern "C" {

int hylo_sparse_mla_prefill_call_layout(long long* out, int capacity) {
    static const long long fields[][2] = {
        HYLO_FIELD(SparseMlaCall, q.data),        HYLO_FIELD(SparseMlaCall, q.stride_token),
        HYLO_FIELD(SparseMlaCall, q.stride_head), HYLO_FIELD(SparseMlaCall, out.data),
        HYLO_FIELD(SparseMlaCall, out.stride_token), HYLO_FIELD(SparseMlaCall, out.stride_head),
        HYLO_FIELD(SparseMlaCall, latent),        HYLO_FIELD(SparseMlaCall, latent_stride),
        HYLO_FIELD(SparseMlaCall, rows),          HYLO_FIELD(SparseMlaCall, rows_stride),
        HYLO_FIELD(SparseMlaCall, width),         HYLO_FIELD(SparseMlaCall, tokens),
        HYLO_FIELD(SparseMlaCall, heads),         HYLO_FIELD(SparseMlaCall, scale_log2),
    };
    return hylo_abi::write_layout(fields, out, capacity);
}

// Launch `call` on `stream`. Returns 0 or a cudaError.
int hylo_sparse_mla_prefill(const SparseMlaCall* call, void* stream) {
    const SparseMlaCall& c = *call;
    static bool configured = false;
    if (!configured) {
        cudaError_t e =
            cudaFuncSetAttribute(sparse_mla_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        if (e != cudaSuccess) return e;
        configured = true;
    }
    if (c.tokens == 0) return 0;
    const Args args{static_cast<const __nv_bfloat16*>(c.q.data),
                    static_cast<const __nv_bfloat16*>(c.latent),
                    c.rows,
                    static_cast<__nv_bfloat16*>(c.out.data),
                    c.q.stride_token,
                    c.q.stride_head,
                    c.latent_stride,
                    c.rows_stride,
                    c.out.stride_token,
                    c.out.stride_head,
                    c.width,
                    c.scale_log2};
    const dim3 grid(c.tokens, c.heads / kHeads);
    sparse_mla_prefill_kernel<<<grid, kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(args);
    return cudaGetLastError();
}

}  // extern "C"
