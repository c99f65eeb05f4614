// KDA's in-chunk algebra for prefill in CUDA C++ (sm_90a; mma.sync, no wgmma), the twin of `chunk._intra_kernel`:
// per (64-token chunk, head), from the first launch's outputs (q, k, v convolved, the inverse L2 norms, the
// in-chunk cumulative gate G in log2 units, β), with q and k normalised,
//
//     X = (I + L)⁻¹,  L[i,j] = β_i k_i·k_j 2^{G_i-G_j} (i > j),  A[i,j] = q_i·k_j 2^{G_i-G_j} (i ≥ j)
//     w = X diag(β) (k ⊙ 2^G),  u = X diag(β) v,  q̄ = q ⊙ 2^G,  k̄ = k ⊙ 2^{G_C−G}
//
// stored in bf16 (A, w, u, q̄, k̄) as the Triton launch stores them. Built and loaded by `intra_cuda.py`; the
// Triton launch stays the fallback.
//
// Why: the Triton launch runs at ~52% of its bytes (1318 us at 13312 tokens x 64 heads on an H100, RESULTS
// S44-1) at 3 CTAs of 4 warps a SM, its warps waiting on the shared-memory round trips of its batched 3-D
// products. Here the chunk's tiles are staged in shared memory once (cp.async), the Gram and the outputs run
// on `mma.m16n8k16` bf16 with fragments built straight from shared memory, and the inverse is a forward
// substitution in fp32 by 16 x 16 blocks (exact where the Triton launch composes Neumann products).
//
// CTA = 4 warps (128 threads), one (chunk, head). Shared memory: q, k, v [64 x 128] bf16 in rows of 136
// elements (the 8 rows a fragment load touches fall on distinct banks), G [64 x 128] fp32 in rows of 132, L
// and then X in place [64 x 65] fp32, the norms, β and a block of scratch a warp: ~106 KB, 2 CTAs a SM.
//
// Gram: warp s owns the rows of sub-block s (16 rows) and every column sub-block t <= s. A row factor
// 2^{G_i - a_s} and a column factor 2^{a_s - G_j} per column d, with the anchor a_s = G_{16s-1} + lb·8 (the
// gate total before the sub-block plus half of the most a 16-row sub-block can take), keep both within
// 2^±58 and every product 2^{G_i - G_j} exact up to the operands' bf16 rounding; a column factor of a far
// sub-block may pass below bf16's range only where the product is below 2^-75 of 1.
//
// Work a CTA: a lane's 8 exp2 for its row operands a k-step (built once for every column sub-block) and 8 a
// column sub-block, 10 16 x 16 x 128 products of each Gram, a 16-step substitution a warp and three block rows of
// 16 x 16 products, two 64 x 64 x 128 products.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../gemm/call_layout.cuh"

namespace {

constexpr int kT = 64;          // chunk tokens
constexpr int kD = 128;         // head size
constexpr int kSub = 16;        // rows of a Gram sub-block (one warp's)
constexpr int kThreads = 128;
constexpr int kYStride = kD + 8;   // bf16 elements a staged row of q, k, v
constexpr int kGStride = kD + 4;   // fp32 elements a staged row of G
constexpr int kLStride = kT + 1;   // fp32 elements a row of L / X
constexpr int kYBytes = kT * kYStride * 2;
constexpr int kGBytes = kT * kGStride * 4;
constexpr int kLBytes = kT * kLStride * 4;
constexpr int kSmemBytes = 3 * kYBytes + kGBytes + kLBytes + 3 * kT * 4 + 3 * kSub * kSub * 4;  // + norms, β

struct Args {
    const __nv_bfloat16* y;  // [chunks, 3, H, 64, 128]: q, k, v convolved
    const float* rnorm;      // [chunks, 2, H, 64]: q's scaled and k's inverse norms
    const float* gcum;       // [chunks, H, 64, 128]: G, log2 units
    const float* beta;       // [chunks, H, 64]
    __nv_bfloat16* w;        // [chunks, H, 64, 128], and qg, kg, u alike
    __nv_bfloat16* qg;
    __nv_bfloat16* kg;
    __nv_bfloat16* u;
    __nv_bfloat16* att;      // [chunks, H, 64, 64]
    int heads;
    float anchor;            // lb·log2(e)·8
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// d += a · b, A 16 x 16 bf16 (row-major fragment), B 16 x 8 bf16 (column-major), fp32 d.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct Stage {
    __nv_bfloat16* y[3];  // q, k, v rows
    float* g;             // G rows
    float* l;             // L, then X
    float* rq;
    float* rk;
    float* bt;
    float* scratch;       // [3 x 16 x 16]: a warp's block sum in the block substitution
};

__device__ __forceinline__ float y_at(const Stage& s, int which, int r, int d) {
    return __bfloat162float(s.y[which][r * kYStride + d]);
}

__device__ __forceinline__ float g_at(const Stage& s, int r, int d) { return s.g[r * kGStride + d]; }

// Columns d, d + 1 (d even) of a staged row in one shared load: q, k or v as two floats, or G.
__device__ __forceinline__ float2 y2_at(const Stage& s, int which, int r, int d) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s.y[which] + r * kYStride + d));
}

__device__ __forceinline__ float2 g2_at(const Stage& s, int r, int d) {
    return *reinterpret_cast<const float2*>(s.g + r * kGStride + d);
}

// The anchor of sub-block `sb` at column d: the gate before it plus `anchor`.
__device__ __forceinline__ float anchor_at(const Stage& s, int sb, int d, float anchor) {
    return (sb > 0 ? g_at(s, sb * kSub - 1, d) : 0.f) + anchor;
}

// Rows of sub-block `sb` against the rows of every sub-block t <= `sb`: acc_kk, acc_qk [t][2 n-tiles][4] (m16n8
// layout: [0], [1] row g, columns 2t', 2t' + 1 of the n-tile; [2], [3] row g + 8). The row operands of a k-step
// are built once for all t.
__device__ void gram_rows(const Stage& s, int sb, float anchor, int g, int t, float (&acc_kk)[4][2][4],
                          float (&acc_qk)[4][2][4]) {
#pragma unroll
    for (int tb = 0; tb < 4; ++tb)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_kk[tb][n][i] = acc_qk[tb][n][i] = 0.f;
    const int r0 = sb * kSub + g, r1 = r0 + 8;
    for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t ak[4], aq[4];  // [0] row g cols 2t, [1] row g + 8 cols 2t, [2] row g cols 8 + 2t, [3] row g + 8
        float an[2][2];         // the anchor at this lane's columns
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // columns k0 + 2t (+1) and k0 + 8 + 2t (+1)
            const int d = k0 + 8 * half + 2 * t;
            an[half][0] = anchor_at(s, sb, d, anchor), an[half][1] = anchor_at(s, sb, d + 1, anchor);
            const float2 g0 = g2_at(s, r0, d), g1 = g2_at(s, r1, d);
            const float f00 = exp2f(g0.x - an[half][0]), f01 = exp2f(g0.y - an[half][1]);
            const float f10 = exp2f(g1.x - an[half][0]), f11 = exp2f(g1.y - an[half][1]);
            const float2 k0 = y2_at(s, 1, r0, d), k1 = y2_at(s, 1, r1, d);
            const float2 q0 = y2_at(s, 0, r0, d), q1 = y2_at(s, 0, r1, d);
            ak[2 * half] = pack_bf16(k0.x * f00, k0.y * f01);
            ak[2 * half + 1] = pack_bf16(k1.x * f10, k1.y * f11);
            aq[2 * half] = pack_bf16(q0.x * f00, q0.y * f01);
            aq[2 * half + 1] = pack_bf16(q1.x * f10, q1.y * f11);
        }
#pragma unroll
        for (int tb = 0; tb < 4; ++tb) {
            if (tb > sb) break;
#pragma unroll
            for (int n = 0; n < 2; ++n) {  // columns j = 16 tb + 8n + g of the output: B[k][j] = k_j 2^{a - G_j}
                const int j = tb * kSub + 8 * n + g;
                uint32_t b[2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int d = k0 + 8 * half + 2 * t;
                    const float2 gj = g2_at(s, j, d), kj = y2_at(s, 1, j, d);
                    b[half] = pack_bf16(kj.x * exp2f(an[half][0] - gj.x), kj.y * exp2f(an[half][1] - gj.y));
                }
                mma_16x8x16(acc_kk[tb][n], ak, b[0], b[1]);
                mma_16x8x16(acc_qk[tb][n], aq, b[0], b[1]);
            }
        }
    }
}

__global__ void __launch_bounds__(kThreads, 2) intra_kernel(Args p) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const int h = blockIdx.x % p.heads;
    const long long chunk = blockIdx.x / p.heads;
    const long long tile = (chunk * p.heads + h) * kT;  // first row of this (chunk, head) in the [.., 64, ..] buffers
    Stage s;
    uint8_t* at = smem;
    for (int i = 0; i < 3; ++i, at += kYBytes) s.y[i] = reinterpret_cast<__nv_bfloat16*>(at);
    s.g = reinterpret_cast<float*>(at), at += kGBytes;
    s.l = reinterpret_cast<float*>(at), at += kLBytes;
    s.rq = reinterpret_cast<float*>(at), s.rk = s.rq + kT, s.bt = s.rk + kT, s.scratch = s.bt + kT;

    // 1. stage q, k, v (16 chunks of 16 bytes a row), G (32 a row), the norms and β
    for (int which = 0; which < 3; ++which) {
        const __nv_bfloat16* src = p.y + ((chunk * 3 + which) * p.heads + h) * kT * kD;
        for (int c = tid; c < kT * 16; c += kThreads) {
            const int r = c / 16, col = (c % 16) * 8;
            cp_async16(s.y[which] + r * kYStride + col, src + r * kD + col);
        }
    }
    for (int c = tid; c < kT * 32; c += kThreads) {
        const int r = c / 32, col = (c % 32) * 4;
        cp_async16(s.g + r * kGStride + col, p.gcum + (tile + r) * kD + col);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    if (tid < kT) {
        const float* norms = p.rnorm + (chunk * 2 * p.heads + h) * kT;
        s.rq[tid] = norms[tid];
        s.rk[tid] = norms[p.heads * kT + tid];
        s.bt[tid] = p.beta[tile + tid];
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();

    // 2. the Gram sums of warp s's rows against sub-blocks t <= s; L (scaled, strictly lower) into shared
    // memory, A (scaled, lower with the diagonal) to global
    const int sb = warp;
    float acc_kk[4][2][4], acc_qk[4][2][4];
    gram_rows(s, sb, p.anchor, g, t, acc_kk, acc_qk);
#pragma unroll
    for (int tb = 0; tb < 4; ++tb) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = sb * kSub + g + 8 * (i / 2), col = tb * kSub + 8 * n + 2 * t + (i % 2);
                const bool live = tb <= sb;  // (blocks past the diagonal stayed 0)
                const float kk = live && col < row ? acc_kk[tb][n][i] * s.bt[row] * s.rk[row] * s.rk[col] : 0.f;
                const float qk = live && col <= row ? acc_qk[tb][n][i] * s.rq[row] * s.rk[col] : 0.f;
                s.l[row * kLStride + col] = kk;
                p.att[(tile + row) * kT + col] = __float2bfloat16_rn(qk);
            }
        }
    }
    __syncthreads();

    // 3. X = (I + L)⁻¹ in place, by 16 x 16 blocks: each warp inverts its diagonal block D_s = (I + L_ss)⁻¹ by
    // forward substitution (16 steps, no CTA barrier), then block row s = 1, 2, 3 in turn takes
    // X_st = −D_s Σ_{u=t}^{s−1} L_su X_ut (warp t; every X_st of the row in registers before any is stored)
    {
        const int c = lane % kSub, parity = lane / kSub, base = sb * kSub;
        for (int i = 1; i < kSub; ++i) {
            float sum = 0.f;
            if (c < i) {
                for (int j = c + parity; j < i; j += 2) {
                    const float x = j == c ? 1.f : s.l[(base + j) * kLStride + base + c];  // X[j][c], unit diagonal
                    sum = fmaf(s.l[(base + i) * kLStride + base + j], x, sum);
                }
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, kSub);
            __syncwarp();
            if (parity == 0 && c < i) s.l[(base + i) * kLStride + base + c] = -sum;
            __syncwarp();
        }
    }
    __syncthreads();
    for (int row_block = 1; row_block < 4; ++row_block) {
        float x_st[8];
        const int r = lane / 2, c0 = (lane % 2) * 8;  // this lane's 8 entries: row r, columns c0 .. c0 + 7
        float* const scratch = s.scratch + sb * kSub * kSub;
        if (sb < row_block) {
            const int tb = sb, rs = row_block * kSub, ct = tb * kSub;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int u = tb; u < row_block; ++u) {  // Σ_u L_su X_ut, X_ut = D_t (unit lower) where u = t
                for (int k = 0; k < kSub; ++k) {
                    const float l = s.l[(rs + r) * kLStride + u * kSub + k];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const int cc = c0 + e;
                        const float x = u != tb ? s.l[(u * kSub + k) * kLStride + ct + cc]
                                      : k == cc ? 1.f : k > cc ? s.l[(ct + k) * kLStride + ct + cc] : 0.f;
                        acc[e] = fmaf(l, x, acc[e]);
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) scratch[r * kSub + c0 + e] = acc[e];
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; ++e) {  // −D_s · (the sum): D_s unit lower, its strict part in place
                float v = scratch[r * kSub + c0 + e];
                for (int k = 0; k < r; ++k) v = fmaf(s.l[(rs + r) * kLStride + rs + k], scratch[k * kSub + c0 + e], v);
                x_st[e] = -v;
            }
        }
        __syncthreads();
        if (sb < row_block) {
#pragma unroll
            for (int e = 0; e < 8; ++e) s.l[(row_block * kSub + r) * kLStride + sb * kSub + c0 + e] = x_st[e];
        }
        __syncthreads();
    }
    for (int c = tid; c < kT * kT; c += kThreads) {  // the strictly upper part and the diagonal
        const int r = c / kT, col = c % kT;
        if (col >= r) s.l[r * kLStride + col] = col == r ? 1.f : 0.f;
    }
    __syncthreads();

    // 4. w and u: warp s's 16 rows of X [16 x 64] times diag(β) (k ⊙ 2^G) and diag(β) v [64 x 128]
    uint32_t xa[4][4];  // X's A fragments for the 4 k-steps of 16 (rows g, g + 8 of the warp's sub-block)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int r0 = sb * kSub + g, r1 = r0 + 8, c = kk * 16 + 2 * t;
        xa[kk][0] = pack_bf16(s.l[r0 * kLStride + c], s.l[r0 * kLStride + c + 1]);
        xa[kk][1] = pack_bf16(s.l[r1 * kLStride + c], s.l[r1 * kLStride + c + 1]);
        xa[kk][2] = pack_bf16(s.l[r0 * kLStride + c + 8], s.l[r0 * kLStride + c + 9]);
        xa[kk][3] = pack_bf16(s.l[r1 * kLStride + c + 8], s.l[r1 * kLStride + c + 9]);
    }
    for (int out = 0; out < 2; ++out) {  // 0: u, 1: w
        __nv_bfloat16* dst = out == 0 ? p.u : p.w;
        for (int n0 = 0; n0 < kD; n0 += 8) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            const int d = n0 + g;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {  // B rows (tokens) kk·16 + 2t + {0, 1, 8, 9} at column d
                    const int j = kk * 16 + 2 * t + (e % 2) + 8 * (e / 2);
                    v[e] = out == 0 ? s.bt[j] * y_at(s, 2, j, d)
                                    : s.bt[j] * s.rk[j] * y_at(s, 1, j, d) * exp2f(g_at(s, j, d));
                }
                mma_16x8x16(acc, xa[kk], pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
            }
            const int r0 = sb * kSub + g, col = n0 + 2 * t;
            *reinterpret_cast<uint32_t*>(dst + (tile + r0) * kD + col) = pack_bf16(acc[0], acc[1]);
            *reinterpret_cast<uint32_t*>(dst + (tile + r0 + 8) * kD + col) = pack_bf16(acc[2], acc[3]);
        }
    }

    // 5. q̄ and k̄, two columns a thread a step
    for (int c = tid; c < kT * kD / 2; c += kThreads) {
        const int r = c / (kD / 2), d = (c % (kD / 2)) * 2;
        const float2 gr = g2_at(s, r, d), last = g2_at(s, kT - 1, d), q = y2_at(s, 0, r, d), k = y2_at(s, 1, r, d);
        *reinterpret_cast<uint32_t*>(p.qg + (tile + r) * kD + d) =
            pack_bf16(q.x * s.rq[r] * exp2f(gr.x), q.y * s.rq[r] * exp2f(gr.y));
        *reinterpret_cast<uint32_t*>(p.kg + (tile + r) * kD + d) =
            pack_bf16(k.x * s.rk[r] * exp2f(last.x - gr.x), k.y * s.rk[r] * exp2f(last.y - gr.y));
    }
}

}  // namespace

struct KdaIntraCall {
    const void* y;
    const void* rnorm;
    const void* gcum;
    const void* beta;
    void* w;
    void* qg;
    void* kg;
    void* u;
    void* att;
    int chunks;
    int heads;
    int head_size;
    float lower_bound;
};

extern "C" {

int hylo_kda_intra_call_layout(long long* out, int capacity) {
    static const long long fields[][2] = {
        HYLO_FIELD(KdaIntraCall, y),      HYLO_FIELD(KdaIntraCall, rnorm),     HYLO_FIELD(KdaIntraCall, gcum),
        HYLO_FIELD(KdaIntraCall, beta),   HYLO_FIELD(KdaIntraCall, w),         HYLO_FIELD(KdaIntraCall, qg),
        HYLO_FIELD(KdaIntraCall, kg),     HYLO_FIELD(KdaIntraCall, u),         HYLO_FIELD(KdaIntraCall, att),
        HYLO_FIELD(KdaIntraCall, chunks), HYLO_FIELD(KdaIntraCall, heads),     HYLO_FIELD(KdaIntraCall, head_size),
        HYLO_FIELD(KdaIntraCall, lower_bound),
    };
    return hylo_abi::write_layout(fields, out, capacity);
}

// Launch `call` on `stream` (capture-safe). Returns the cudaError_t of the launch; unsupported arguments
// (a head size other than 128, -5 <= lower_bound < 0 not holding) return cudaErrorInvalidValue unlaunched.
int hylo_kda_intra(const KdaIntraCall* call, void* stream) {
    const KdaIntraCall& c = *call;
    if (c.head_size != kD || c.heads < 1 || c.chunks < 1 || !(c.lower_bound >= -5.f && c.lower_bound < 0.f))
        return cudaErrorInvalidValue;
    static const cudaError_t raised =
        cudaFuncSetAttribute(intra_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (raised != cudaSuccess) return raised;
    const Args p{static_cast<const __nv_bfloat16*>(c.y), static_cast<const float*>(c.rnorm),
                 static_cast<const float*>(c.gcum), static_cast<const float*>(c.beta),
                 static_cast<__nv_bfloat16*>(c.w), static_cast<__nv_bfloat16*>(c.qg),
                 static_cast<__nv_bfloat16*>(c.kg), static_cast<__nv_bfloat16*>(c.u),
                 static_cast<__nv_bfloat16*>(c.att), c.heads, c.lower_bound * 1.4426950408889634f * kSub / 2};
    intra_kernel<<<c.chunks * c.heads, kThreads, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(p);
    return cudaGetLastError();
}

}  // extern "C"
