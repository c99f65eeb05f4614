// The MoE's FP8 grouped GEMMs for prefill-sized batches on Hopper (sm_90a), per row block of the routing's
// alignment: down, out[pair] = bf16(w_pair · Σ_kb (h[slot, kb] · W_e[:, kb]ᵀ) · sa[slot, kb] · sb[e, n/128, kb]),
// and gate|up, h = e4m3 SwiGLU(x · W_gate ᵀ, x · W_up ᵀ) with one scale a row's 128 columns; e4m3 operands,
// fp32 block scales, one 128-deep scale block per K step. Built and loaded by `grouped_cuda.py`; the Triton TMA
// kernels (`kernels._gate_up_tma_kernel`, `kernels._down_tma_kernel`) compute the same sums and stay the
// fallback.
//
// Why a kernel of its own: the Triton kernel (64-row blocks, one warpgroup a tile) is bound by L2 → SM
// traffic (Nsight, RESULTS S7-14: L2 throughput 81%, tensor pipe ~44%), three quarters of it weights: every
// 64-row block pulls its expert's weight tile through L2 for itself. Here one CTA takes two neighbouring
// 64-row blocks of the alignment (a "pair"); when both belong to the same expert (most pairs: an expert
// holds ~6 blocks at 13K tokens) one weight tile in shared memory serves 128 rows, halving the weight
// traffic per row. The alignment stays the 64-row one (128-row alignment padded 22% more rows, S7-11).
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer: one thread issues TMA loads of each K step's
// activation rows (64 per block) and weight tile (128 columns × 128 deep) into a ring of STAGES slots,
// each guarded by a full and an empty mbarrier. Warpgroups 1 and 2 are the consumers, one per block of the
// pair: per K step four `wgmma.m64n128k32` e4m3 products into a fresh fp32 tile, then that tile scaled by
// the rows' and the weights' scales and added to the running sum (DeepSeek-V3's promotion, the order the
// Triton kernel sums in). When the pair's blocks belong to different experts, the ring alternates block 0's
// and block 1's K steps, each with its own expert's weights, so both consumers multiply at once, each on
// its own slots (a consumer still waits for and releases every slot, so both walk the ring in step).
//
// The schedule (RESULTS S43-1): one CTA a SM, each taking its next tile from a global counter, so that its
// producer fills the next tile's first slots during the consumers' epilogue; down's CTAs take 256 columns (two
// weight tiles a slot) as gate|up's do.
//
// Benchmark variants (macros below, `benchmarks/kernels/moe_grouped_cuda.py --variants`): S42's one CTA a tile,
// other schedules, ring depths and epilogues; probes that take the time apart. Clusters of CTAs sharing a pair's
// rows or two pairs' weight tiles by TMA multicast (and the pipelined consumers, whose gate|up split its groups
// across a cluster, S42-1) were measured and removed, less L2 traffic having bought no time: gate|up at 13312
// tokens on an H100 took 4990 us in this build, 5156 in clusters of two sharing rows (5246 one CTA a tile), and
// under Nsight 4.73 ms against 4.81 (rows shared) and 5.79 (weight tiles shared: L2 throughput 77.9% against
// 83.7%), while the 2 x 2 clusters computed wrong rows and failed in a CUDA graph (RESULTS S44-0).
//
// Shared memory: 1024-aligned slots of [A0 64×128 | A1 64×128 | B 128×128] bytes, TMA's 128-byte swizzle,
// which is the layout wgmma's K-major descriptors read (8-row atoms 1024 bytes apart; a 32-deep K step
// advances the start address by 32 bytes inside the atom).

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "../gemm/call_layout.cuh"
#include "../gemm/hopper.cuh"

#ifndef HYLO_GROUPED_STAGES
#define HYLO_GROUPED_STAGES 5
#endif
#ifndef HYLO_GROUPED_GATE_UP_STAGES
#define HYLO_GROUPED_GATE_UP_STAGES 4
#endif
#ifndef HYLO_GROUPED_PERSISTENT
#define HYLO_GROUPED_PERSISTENT 1  // one CTA a SM walks the tiles (0: one CTA a tile)
#endif
#ifndef HYLO_GROUPED_GROUP
#define HYLO_GROUPED_GROUP 8  // pairs that sweep the column tiles together (their weight tiles stay in L2)
#endif

#ifndef HYLO_GROUPED_MIXED_SEQUENTIAL
#define HYLO_GROUPED_MIXED_SEQUENTIAL 0  // 1: a mixed pair's ring carries block 0's K steps, then block 1's
#endif
#ifndef HYLO_GROUPED_PROBE
#define HYLO_GROUPED_PROBE 0  // benchmarks only, wrong outputs: 1 loads without the math, 2 the math on stale slots
#endif
// Probes 3-5 run on stale slots as 2 does, to tell where the math's time goes: 3 one consumer alone (its
// chain's latency), 4 without the promotion (the MMAs and their waits), 5 the MMAs alone, never waited on
// inside the tile (the tensor cores' rate from shared memory). Two more at 18200ad (RESULTS S43-1: gate's and
// up's chains interleaved, one m64n256k32 product a step) ran as fast as 5 and were dropped.
constexpr bool kStaleSlots = HYLO_GROUPED_PROBE >= 2;
#ifndef HYLO_GROUPED_PROBE_REPEAT
#define HYLO_GROUPED_PROBE_REPEAT 1  // R > 1, stale-slot probes only: every tile walks its K steps R times
#endif
// A probe's time at R = 1 and 2 separates a tile's fixed cost (its setup, the ring's first fill, the epilogue)
// from its K steps': t(1) - (t(2) - t(1)) is the fixed part.
constexpr int kRepeat = HYLO_GROUPED_PROBE_REPEAT;
static_assert(kRepeat == 1 || (kStaleSlots && !HYLO_GROUPED_MIXED_SEQUENTIAL), "repeats are for stale-slot probes");
constexpr bool kOneConsumer = HYLO_GROUPED_PROBE == 3;
constexpr bool kPromote = HYLO_GROUPED_PROBE != 4 && HYLO_GROUPED_PROBE != 5;
constexpr bool kWaitEachStep = HYLO_GROUPED_PROBE != 5;

#ifndef HYLO_GROUPED_EARLY_RELEASE
#define HYLO_GROUPED_EARLY_RELEASE 0  // 1: a slot is released once its last product is in registers, before promoting
#endif
#ifndef HYLO_GROUPED_FAST_EPILOGUE
#define HYLO_GROUPED_FAST_EPILOGUE 0  // 1: gate|up's epilogue multiplies by reciprocals (sigmoid, quantisation)
#endif
constexpr bool kEarlyRelease = HYLO_GROUPED_EARLY_RELEASE && kWaitEachStep;

#ifndef HYLO_GROUPED_DYNAMIC
#define HYLO_GROUPED_DYNAMIC HYLO_GROUPED_PERSISTENT  // persistent: each CTA's next tile from a counter (0: a stride)
#endif
// A persistent CTA striding the tiles drifts from the others (a mixed pair takes twice the steps), so the tiles
// in flight spread over many pairs' weights and rows; one CTA a SM taking the next tile from a global counter
// keeps them a contiguous window of the grid's order, as a one-tile-a-CTA launch's scheduler does, while its
// producer fills the next tile's slots during the consumers' epilogue. The producer thread takes each tile
// index and hands it to the consumers through a two-entry ring in shared memory.
constexpr bool kDynamic = HYLO_GROUPED_DYNAMIC;
static_assert(!kDynamic || HYLO_GROUPED_PERSISTENT, "dynamic tiles: persistent");


namespace {

constexpr int kBlockM = 64;     // rows of an alignment block (a consumer's wgmma M)
constexpr int kBlockN = 128;    // output columns of a CTA (one weight scale block)
constexpr int kBlockK = 128;    // K step = one scale block = one 128-byte swizzle row of e4m3
constexpr int kStages = HYLO_GROUPED_STAGES;
constexpr int kGateUpStages = HYLO_GROUPED_GATE_UP_STAGES;
constexpr int kGroup = HYLO_GROUPED_GROUP;
constexpr bool kPersistent = HYLO_GROUPED_PERSISTENT;
constexpr int kABytes = kBlockM * kBlockK;  // 8 KB
constexpr int kBBytes = kBlockN * kBlockK;  // 16 KB
#ifndef HYLO_GROUPED_WIDE_DOWN
#define HYLO_GROUPED_WIDE_DOWN 1  // down CTAs of 256 columns (two weight tiles a slot)
#endif
// Weight tiles a ring slot holds: gate|up's gate and up rows of its 128 columns; down's one 128-column tile, or
// two neighbouring ones (wide).
__host__ __device__ constexpr int tiles_of(bool gate_up) { return gate_up || HYLO_GROUPED_WIDE_DOWN ? 2 : 1; }
// Output columns of one CTA.
__host__ __device__ constexpr int columns_of(bool gate_up) { return gate_up ? kBlockN : tiles_of(false) * kBlockN; }
// Ring slots: fewer where a slot holds two weight tiles.
__host__ __device__ constexpr int stages_of(bool gate_up) { return tiles_of(gate_up) == 2 ? kGateUpStages : kStages; }
constexpr int kTileRingBytes = 2 * 2 * 8 + 2 * 4;  // dynamic tiles: full and empty barriers, then the indices
constexpr int smem_bytes(int stages, int tiles) {  // the ring, its barriers, the tile ring, slack
    return stages * (2 * kABytes + tiles * kBBytes) + 2 * stages * 8 + kTileRingBytes + 1024;
}
constexpr int kConsumerWarps = 8;

struct Args {
    const float* a_scale;        // [slots, K/128]: the rows' group scales
    const float* w_scale;        // [E, rows/128, K/128]
    const int* block_expert;     // [num_blocks]
    const int* block_rows;       // [num_blocks]
    const int* pairs;            // [num_blocks * 64] (down)
    const float* pair_weight;    // [pairs] (down)
    void* out;                   // down: bf16 [pairs, N]; gate|up: e4m3 h [slots, N]
    float* out_scale;            // gate|up: h's group scales [slots, N/128]
    long long a_scale_stride;    // elements between rows of a_scale
    long long w_scale_expert;    // elements between experts of w_scale
    long long w_scale_row;       // elements between 128-row blocks of w_scale
    long long out_stride;        // elements between rows of out
    long long out_scale_stride;  // elements between rows of out_scale
    float limit;                 // gate|up: the SwiGLU clamp
    int num_blocks;
    int n;                       // output columns (gate|up: the intermediate I); a multiple of 128
    int k_steps;                 // K / 128
    int* tile_counter;           // dynamic tiles: the next tile's index, zeroed before the launch
};

using namespace hopper;

// d[64] += A[64×32] · B[128×32]ᵀ (e4m3, fp32 sums); `accumulate` 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n128k32(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

// The work of one CTA tile: a pair of row blocks × its output columns (`columns_of`); kGroup pairs sweep the
// column tiles together (their weight tiles stay in L2).
struct Tile {
    int block0, expert0, expert1, n0;
    bool active0, active1, same;
    int steps;  // ring slots the tile takes: K steps once for a pair of one expert, once per active block else
};

// The grid's order: pairs of blocks times column tiles.
__host__ __device__ __forceinline__ int pairs_of(int num_blocks) { return (num_blocks + 1) / 2; }

// Tile `index` of the grid's order, of `columns` output columns.
__device__ __forceinline__ Tile tile_of(int index, const Args& p, int columns) {
    const int pairs = pairs_of(p.num_blocks);
    const int per_group = kGroup * (p.n / columns);
    const int first = (index / per_group) * kGroup;
    const int group_rows = min(pairs - first, kGroup);
    const int pair = first + (index % per_group) % group_rows, column_tile = (index % per_group) / group_rows;
    Tile t;
    t.n0 = column_tile * columns;
    t.block0 = 2 * pair;
    t.expert0 = p.block_expert[t.block0];
    t.expert1 = t.block0 + 1 < p.num_blocks ? p.block_expert[t.block0 + 1] : -1;
    t.active0 = t.expert0 >= 0;
    t.active1 = t.expert1 >= 0;
    t.same = t.active0 && t.active1 && t.expert0 == t.expert1;
    t.steps = kRepeat * (t.same ? p.k_steps : (int(t.active0) + int(t.active1)) * p.k_steps);
    return t;
}

// Where a CTA's tiles come from: first, first + stride, ... (a one-tile-a-CTA launch, or a persistent one
// striding), or (kDynamic) the global counter: the producer thread takes each index and hands it to the consumers
// through a two-entry ring, each entry with a full barrier (the producer's arrival, which releases the index) and
// an empty one (every consumer warp's, once it has read it). An index past the last tile ends every walk.
struct TileSource {
    int first, stride;
    int* counter;
    uint64_t* full;   // [2]
    uint64_t* empty;  // [2]
    int* index;       // [2]

    // The producer's q-th tile (its one thread calls it).
    __device__ __forceinline__ int hand_out(int q) const {
        if (!kDynamic) return first + q * stride;
        const int u = q & 1;
        if (q >= 2) bar_wait(&empty[u], ((q >> 1) - 1) & 1);
        const int tile = atomicAdd(counter, 1);
        index[u] = tile;
        bar_arrive(&full[u]);
        return tile;
    }

    // A consumer warp's q-th tile (all its lanes call it).
    __device__ __forceinline__ int take(int q, int lane) const {
        if (!kDynamic) return first + q * stride;
        const int u = q & 1;
        bar_wait(&full[u], (q >> 1) & 1);
        const int tile = index[u];
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[u]);
        return tile;
    }
};

// Which blocks of the pair a ring position serves: both (kBoth), or block 0 / 1 alone.
constexpr int kBoth = 2;

struct Step {
    int which;  // kBoth, 0 or 1
    int k;      // the K step (of 128) it carries
};

// Ring position j of tile t (0 <= j < t.steps).
__device__ __forceinline__ Step step_of(int j, const Tile& t, int k_steps) {
    if (t.same) return {kBoth, kRepeat == 1 ? j : j % k_steps};
    if (!(t.active0 && t.active1)) return {t.active0 ? 0 : 1, kRepeat == 1 ? j : j % k_steps};
    if (HYLO_GROUPED_MIXED_SEQUENTIAL) return {j < k_steps ? 0 : 1, j % k_steps};
    return {j & 1, kRepeat == 1 ? j >> 1 : (j >> 1) % k_steps};
}

// SwiGLU of 64 registers in place (gate[i] becomes h = silu(clamped gate) · clamped up[i]), and the largest |h|
// of each of this thread's two rows over its quad (the 4 lanes holding the rows' columns).
__device__ __forceinline__ void swiglu_rows(const Args& p, float* gate, const float* up, float* amax) {
    amax[0] = amax[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const float g = fminf(gate[i], p.limit);
        const float u = fminf(fmaxf(up[i], -p.limit), p.limit);
        gate[i] = HYLO_GROUPED_FAST_EPILOGUE ? g * __frcp_rn(1.0f + __expf(-g)) * u : g * (1.0f / (1.0f + expf(-g))) * u;
        amax[(i >> 1) & 1] = fmaxf(amax[(i >> 1) & 1], fabsf(gate[i]));
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffff, amax[half], 1));
        amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffff, amax[half], 2));
    }
}

// `body(half, r)` for this thread's rows r = row0 and row0 + 8 (half 0, 1) of `block` that hold a pair.
template <typename Body>
__device__ __forceinline__ void for_my_rows(const Args& p, int block, int row0, Body&& body) {
    const int valid = p.block_rows[block];
#pragma unroll
    for (int half = 0; half < 2; ++half)
        if (row0 + 8 * half < valid) body(half, row0 + 8 * half);
}

// This thread's two rows of h (16 8-column groups from n0) quantised to e4m3 with one scale a row, amax / 448 (the
// row's 128-column group's largest |h|), as `kernels._gate_up_tma_kernel` does.
__device__ __forceinline__ void write_quantised(const Args& p, int block, int n0, int row0, int lane, const float* h,
                                                const float* amax) {
    const int col = n0 + 2 * (lane % 4);
    for_my_rows(p, block, row0, [&](int half, int r) {
        const long long slot_row = (long long)block * kBlockM + r;
        const float scale = __fdiv_rn(fmaxf(amax[half], 1e-12f), 448.0f);
        const float inverse = __frcp_rn(scale);
        uint8_t* dst = static_cast<uint8_t*>(p.out) + slot_row * p.out_stride + col;
#pragma unroll
        for (int g = 0; g < 16; ++g) {
            const float x0 = h[4 * g + 2 * half], x1 = h[4 * g + 2 * half + 1];
            const float2 v = HYLO_GROUPED_FAST_EPILOGUE ? make_float2(x0 * inverse, x1 * inverse)
                                                        : make_float2(__fdiv_rn(x0, scale), __fdiv_rn(x1, scale));
            const __nv_fp8x2_e4m3 q(v);
            *reinterpret_cast<__nv_fp8x2_storage_t*>(dst + 8 * g) = q.__x;
        }
        if (lane % 4 == 0) p.out_scale[slot_row * p.out_scale_stride + n0 / 128] = scale;
    });
}

// gate|up's epilogue (one consumer's 64 rows × 128 columns): SwiGLU(gate, up), then each row's 128 columns (its
// quad's 4 lanes × 32) quantised with one scale.
__device__ __forceinline__ void write_gate_up(const Args& p, int block, int n0, int row0, int lane, float* sum,
                                              const float* sum_up) {
    float amax[2];
    swiglu_rows(p, sum, sum_up, amax);
    write_quantised(p, block, n0, row0, lane, sum, amax);
}

// down's epilogue: one consumer's 64 rows × 128 (wide: 256) columns, weighted by each row's routing weight, to
// the rows of their pairs.
template <int kTiles>
__device__ __forceinline__ void write_down(const Args& p, int block, int n0, int row0, int lane, const float* sum,
                                           const float* sum_up) {
    const int col = n0 + 2 * (lane % 4);
    for_my_rows(p, block, row0, [&](int half, int r) {
        const int pair_index = p.pairs[block * kBlockM + r];
        const float w = p.pair_weight[pair_index];
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (long long)pair_index * p.out_stride + col;
#pragma unroll
        for (int g = 0; g < 16; ++g) {
            const float v0 = sum[4 * g + 2 * half] * w, v1 = sum[4 * g + 2 * half + 1] * w;
            *reinterpret_cast<__nv_bfloat162*>(dst + 8 * g) = __floats2bfloat162_rn(v0, v1);
            if (kTiles == 2) {  // wide: the second tile's 128 columns
                const float u0 = sum_up[4 * g + 2 * half] * w, u1 = sum_up[4 * g + 2 * half + 1] * w;
                *reinterpret_cast<__nv_bfloat162*>(dst + kBlockN + 8 * g) = __floats2bfloat162_rn(u0, u1);
            }
        }
    });
}

// One consumer's view of a tile: its block of the pair, whether that block holds rows, and the scales it reads a
// K step: its two rows' (sa0, sa1), the weight tile's (sb) and the slot's second weight tile's (sb_up: gate|up's up
// rows, a wide down's next 128 columns).
struct Mine {
    int block;
    bool active;
    const float *sa0, *sa1, *sb, *sb_up;
};

template <bool GATE_UP>
__device__ __forceinline__ Mine mine_of(const Tile& t, const Args& p, int c, int row0) {
    Mine m;
    m.block = t.block0 + c;
    m.active = c == 0 ? t.active0 : t.active1;
    const int expert = c == 0 ? t.expert0 : t.expert1;
    m.sa0 = p.a_scale + (long long)(m.block * kBlockM + row0) * p.a_scale_stride;
    m.sa1 = m.sa0 + 8 * p.a_scale_stride;
    m.sb = p.w_scale + (long long)(m.active ? expert : 0) * p.w_scale_expert + (long long)(t.n0 / 128) * p.w_scale_row;
    m.sb_up = m.sb + (long long)(GATE_UP ? p.n / 128 : 1) * p.w_scale_row;
    return m;
}

// The producer thread: every step's loads into the ring.
template <bool GATE_UP>
__device__ __forceinline__ void produce(const CUtensorMap& a_map, const CUtensorMap& b_map, const Args& p,
                                        uint8_t* smem, uint64_t* full, uint64_t* empty, const TileSource& tiles,
                                        int num_tiles, int expert_rows) {
    constexpr int kTiles = tiles_of(GATE_UP);
    constexpr int kStagesHere = stages_of(GATE_UP);
    constexpr int kSlot = 2 * kABytes + kTiles * kBBytes;
    int ring = 0;
    for (int q = 0, index = tiles.hand_out(0); index < num_tiles; index = tiles.hand_out(++q)) {
        const Tile t = tile_of(index, p, columns_of(GATE_UP));
        for (int j = 0; j < t.steps; ++j, ++ring) {
            const int s = ring % kStagesHere;
            if (ring >= kStagesHere) bar_wait(&empty[s], ((ring / kStagesHere) - 1) & 1);
            const Step step = step_of(j, t, p.k_steps);
            const int which = step.which;
            const int k0 = step.k * kBlockK;
            uint8_t* slot = smem + s * kSlot;
            if (kStaleSlots && ring >= kStagesHere) {  // a stale slot
                bar_arrive(&full[s]);
                continue;
            }
            bar_expect(&full[s], kTiles * kBBytes + (which == kBoth ? 2 : 1) * kABytes);
            if (which != 1) tma_load(slot, &a_map, k0, t.block0 * kBlockM, &full[s]);
            if (which != 0) tma_load(slot + kABytes, &a_map, k0, (t.block0 + 1) * kBlockM, &full[s]);
            const int row = (which == 1 ? t.expert1 : t.expert0) * expert_rows + t.n0;
            const int second = GATE_UP ? p.n : kBlockN;  // the slot's second weight tile: up's rows, the next columns
            tma_load(slot + 2 * kABytes, &b_map, k0, row, &full[s]);
            if (kTiles == 2) tma_load(slot + 2 * kABytes + kBBytes, &b_map, k0, row + second, &full[s]);
        }
    }
}

// The consumer warpgroups: warpgroup c (0 or 1) owns block c of each pair.
template <bool GATE_UP>
__device__ __forceinline__ void consume(const Args& p, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                        const TileSource& tiles, int num_tiles, int warp, int lane) {
    constexpr int kTiles = tiles_of(GATE_UP);
    constexpr int kStagesHere = stages_of(GATE_UP);
    constexpr int kSlot = 2 * kABytes + kTiles * kBBytes;
    auto release = [&](int s) {  // a warp's release of ring slot s: its lane 0 arrives
        if (lane == 0) bar_arrive(&empty[s]);
    };

    const int c = warp / 4 - 1;
    const int row0 = (warp % 4) * 16 + lane / 4;  // this thread's rows: row0 and row0 + 8 of the block
    int ring = 0;
    for (int q = 0, index = tiles.take(0, lane); index < num_tiles; index = tiles.take(++q, lane)) {
        const Tile t = tile_of(index, p, columns_of(GATE_UP));
        const int n0 = t.n0;
        const Mine own = mine_of<GATE_UP>(t, p, c, row0);

        // register i of 8-column group g: row row0 + 8·((i >> 1) & 1), column 8g + 2·(lane % 4) + (i & 1)
        float sum[64], sum_up[kTiles == 2 ? 64 : 1], part[64];
        if (!kPromote) {  // the probes without promotion chain every product into part
#pragma unroll
            for (int i = 0; i < 64; ++i) part[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = 0.f;
#pragma unroll
        for (int i = 0; i < (kTiles == 2 ? 64 : 1); ++i) sum_up[i] = 0.f;

        for (int j = 0; j < t.steps; ++j, ++ring) {
            const int s = ring % kStagesHere;
            const Step step = step_of(j, t, p.k_steps);
            const int which = step.which;
            const bool mine = HYLO_GROUPED_PROBE != 1 && !(kOneConsumer && c == 1) && (which == kBoth || which == c);
            float a0 = 0.f, a1 = 0.f, b = 0.f, b_up = 0.f;
            if (mine) {  // the scales' loads go out before the wait
                const int kb = step.k;
                a0 = own.sa0[kb];
                a1 = own.sa1[kb];
                b = own.sb[kb];
                if (kTiles == 2) b_up = own.sb_up[kb];
            }
            bar_wait(&full[s], (ring / kStagesHere) & 1);
            if (mine) {
                const uint8_t* slot = smem + s * kSlot;
                const uint8_t* a = slot + c * kABytes;  // the warpgroup's 64 rows
                const uint8_t* w = slot + 2 * kABytes;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kBlockK / 32; ++kk)
                    wgmma_m64n128k32(part, tile_descriptor(a + 32 * kk), tile_descriptor(w + 32 * kk), kk || !kPromote);
                wgmma_commit();
                if (kWaitEachStep) wgmma_wait_all();
                if (kTiles == 1 && kEarlyRelease) release(s);
                const float scale0 = a0 * b, scale1 = a1 * b;
                if (kPromote) {
#pragma unroll
                    for (int i = 0; i < 64; ++i) sum[i] += part[i] * ((i & 2) ? scale1 : scale0);
                }
                if (kTiles == 2) {
                    if (kWaitEachStep) wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < kBlockK / 32; ++kk)
                        wgmma_m64n128k32(part, tile_descriptor(a + 32 * kk), tile_descriptor(w + kBBytes + 32 * kk),
                                         kk || !kPromote);
                    wgmma_commit();
                    if (kWaitEachStep) wgmma_wait_all();
                    if (kEarlyRelease) release(s);
                    const float up0 = a0 * b_up, up1 = a1 * b_up;
                    if (kPromote) {
#pragma unroll
                        for (int i = 0; i < 64; ++i) sum_up[i] += part[i] * ((i & 2) ? up1 : up0);
                    }
                }
            }
            if (!(kEarlyRelease && mine)) release(s);
        }
        if (!kPromote) {  // the probes' MMAs need a reader to be kept
            wgmma_wait_all();
#pragma unroll
            for (int i = 0; i < 64; ++i) sum[i] = part[i];
        }
        if (!own.active) continue;

        if constexpr (GATE_UP)
            write_gate_up(p, own.block, n0, row0, lane, sum, sum_up);
        else
            write_down<kTiles>(p, own.block, n0, row0, lane, sum, sum_up);
    }
}

// One CTA walks tiles blockIdx.x, + gridDim.x, ... (one tile where the grid has one CTA a tile; persistent where
// it has one a SM: the producer then fills the next tile's slots during the consumers' epilogue), the ring's slots
// and phases running on across its tiles. GATE_UP: the columns are 128 of the intermediate, whose gate rows
// (n0 ..) and up rows (N + n0 ..) of the expert's [2N, K] weight are two tiles of a ring slot; the epilogue writes
// SwiGLU(gate, up) quantised per 128-column group (one group: the tile) with its scale, as
// `kernels._gate_up_tma_kernel` does. Else (down) the columns are 128 (wide: 256) of D, written weighted by each
// row's routing weight to the row of its pair.
template <bool GATE_UP>
__global__ void __launch_bounds__(384, 1)
    grouped_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                   const Args p) {
    constexpr int kTiles = tiles_of(GATE_UP);
    constexpr int kStagesHere = stages_of(GATE_UP);
    constexpr int kSlot = 2 * kABytes + kTiles * kBBytes;
    extern __shared__ uint8_t smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStagesHere * kSlot);
    uint64_t* empty = full + kStagesHere;
    uint64_t* tile_full = empty + kStagesHere;
    uint64_t* tile_empty = tile_full + 2;
    const int num_tiles = pairs_of(p.num_blocks) * (p.n / columns_of(GATE_UP));
    const int expert_rows = (GATE_UP ? 2 : 1) * p.n;  // rows of one expert's weight
    const TileSource tiles{int(blockIdx.x), int(gridDim.x), p.tile_counter, tile_full, tile_empty,
                           reinterpret_cast<int*>(tile_empty + 2)};

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStagesHere; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], kConsumerWarps);
        }
        for (int u = 0; kDynamic && u < 2; ++u) {
            bar_init(&tile_full[u], 1);
            bar_init(&tile_empty[u], kConsumerWarps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp < 4) {  // the producer warpgroup: one thread issues every load
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 0) produce<GATE_UP>(a_map, b_map, p, smem, full, empty, tiles, num_tiles, expert_rows);
        __syncwarp();
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    consume<GATE_UP>(p, smem, full, empty, tiles, num_tiles, warp, lane);
}

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
    static PFN_cuTensorMapEncodeTiled_v12000 function = nullptr;
    if (function == nullptr) {
        void* found = nullptr;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &found, 12000, cudaEnableDefault, &status) ==
                cudaSuccess &&
            status == cudaDriverEntryPointSuccess)
            function = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(found);
    }
    return function;
}

// A 2-D e4m3 (bytes) map over `rows` rows of `cols` bytes, `stride` bytes apart, boxes of box_rows × 128.
int make_map(CUtensorMap* map, const void* base, long long rows, long long cols, long long stride, int box_rows) {
    auto encode = encode_function();
    if (encode == nullptr) return 1;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)stride};
    cuuint32_t box[2] = {128, (cuuint32_t)box_rows};
    cuuint32_t element_strides[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
                        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : 2;
}

template <bool GATE_UP>
int launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const Args& args, cudaStream_t stream) {
    constexpr int smem = smem_bytes(stages_of(GATE_UP), tiles_of(GATE_UP));
    static bool configured = false;  // per instantiation
    if (!configured) {
        cudaError_t e = cudaFuncSetAttribute(grouped_kernel<GATE_UP>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return e;
        configured = true;
    }
    int grid = pairs_of(args.num_blocks) * (args.n / columns_of(GATE_UP));
    if (kPersistent) {
        static int sms = 0;
        if (sms == 0) {
            int device = 0;
            cudaGetDevice(&device);
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        }
        grid = min(grid, sms);
    }
    Args launched = args;
    if (kDynamic) {  // one counter a device, allocated at its first (eager) launch, zeroed before every one
        static int* counters[64] = {};
        int device = 0;
        cudaGetDevice(&device);
        if (counters[device] == nullptr) {
            cudaError_t e = cudaMalloc(&counters[device], sizeof(int));
            if (e != cudaSuccess) return e;
        }
        launched.tile_counter = counters[device];
        cudaError_t e = cudaMemsetAsync(launched.tile_counter, 0, sizeof(int), stream);
        if (e != cudaSuccess) return e;
    }
    grouped_kernel<GATE_UP><<<grid, 384, smem, stream>>>(a_map, b_map, launched);
    return cudaGetLastError();
}

}  // namespace

// One call's operands by role, as `grouped_cuda.py` bundles them; its ctypes structures mirror these field for
// field (the loader compares `hylo_grouped_gemm_call_layout` with theirs). Outside the anonymous
// namespace: a C entry point taking a type of internal linkage is not exported.
struct ScaledRows {  // e4m3 rows in the alignment's slot order, with their 128-column group scales
    const void* data;
    long long stride;  // bytes between rows
    long long count;
    const float* scale;  // [count, K/128]
    long long scale_stride;  // elements between rows of scale
};
struct ScaledExperts {  // the experts' e4m3 weights [count, rows, K], contiguous (gate|up: gate rows then up rows)
    const void* data;
    long long rows;
    long long count;
    const float* scale;  // [count, rows/128, K/128]
    long long scale_expert;  // elements between experts of scale
    long long scale_row;  // elements between 128-row blocks of scale
};
struct Blocks {  // the alignment: each 64-row block's expert (-1: none) and real rows, the pair of each slot
    const int* expert;
    const int* rows;
    const int* pairs;
    int count;
};
struct Output {  // gate|up: e4m3 h [slots, N] and its group scales; down: bf16 [pairs, N], scale unused
    void* data;
    long long stride;  // elements between rows
    float* scale;
    long long scale_stride;
};
struct GroupedCall {
    int gate_up;
    int n;  // output columns (gate|up: the intermediate I)
    int k;
    float limit;  // gate|up: the SwiGLU clamp
    ScaledRows a;
    ScaledExperts w;
    Blocks blocks;
    const float* pair_weight;  // down: the pairs' routing weights
    Output out;
};

extern "C" {

int hylo_grouped_gemm_call_layout(long long* out, int capacity) {
    static const long long fields[][2] = {
        HYLO_FIELD(GroupedCall, gate_up),        HYLO_FIELD(GroupedCall, n),
        HYLO_FIELD(GroupedCall, k),              HYLO_FIELD(GroupedCall, limit),
        HYLO_FIELD(GroupedCall, a.data),         HYLO_FIELD(GroupedCall, a.stride),
        HYLO_FIELD(GroupedCall, a.count),        HYLO_FIELD(GroupedCall, a.scale),
        HYLO_FIELD(GroupedCall, a.scale_stride), HYLO_FIELD(GroupedCall, w.data),
        HYLO_FIELD(GroupedCall, w.rows),         HYLO_FIELD(GroupedCall, w.count),
        HYLO_FIELD(GroupedCall, w.scale),        HYLO_FIELD(GroupedCall, w.scale_expert),
        HYLO_FIELD(GroupedCall, w.scale_row),    HYLO_FIELD(GroupedCall, blocks.expert),
        HYLO_FIELD(GroupedCall, blocks.rows),    HYLO_FIELD(GroupedCall, blocks.pairs),
        HYLO_FIELD(GroupedCall, blocks.count),   HYLO_FIELD(GroupedCall, pair_weight),
        HYLO_FIELD(GroupedCall, out.data),       HYLO_FIELD(GroupedCall, out.stride),
        HYLO_FIELD(GroupedCall, out.scale),      HYLO_FIELD(GroupedCall, out.scale_stride),
    };
    return hylo_abi::write_layout(fields, out, capacity);
}

// Launch one grouped GEMM on `stream`. Returns 0, a cudaError, or 1000 + a tensor map failure (1: no driver
// entry point, 2: encode) or 1003 (N not a multiple of a CTA's columns).
int hylo_grouped_gemm(const GroupedCall* call, void* stream) {
    const GroupedCall& c = *call;
    if (c.n % columns_of(c.gate_up) != 0) return 1003;
    CUtensorMap a_map, b_map;
    int failed = make_map(&a_map, c.a.data, c.a.count, c.k, c.a.stride, kBlockM);
    if (!failed) failed = make_map(&b_map, c.w.data, c.w.count * c.w.rows, c.k, c.k, kBlockN);
    if (failed) return 1000 + failed;
    const Args args{c.a.scale, c.w.scale, c.blocks.expert, c.blocks.rows, c.blocks.pairs, c.pair_weight,
                    c.out.data, c.out.scale, c.a.scale_stride, c.w.scale_expert, c.w.scale_row, c.out.stride,
                    c.out.scale_stride, c.limit, c.blocks.count, c.n, c.k / kBlockK};
    const auto s = static_cast<cudaStream_t>(stream);
    return c.gate_up ? launch<true>(a_map, b_map, args, s) : launch<false>(a_map, b_map, args, s);
}

}  // extern "C"
