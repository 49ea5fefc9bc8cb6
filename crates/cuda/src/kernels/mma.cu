// ---------------------------------------------------------------------------------------------
// Tiled Q8_0/MXFP4 products on int8 tensor cores (sm_80+; device/matmul.rs and experts.rs pick
// them there, tiled.cu's dp4a kernels elsewhere), with the same bits as the row-per-warp
// kernels: integer MMA is exact, and its accumulator starts from zero for every 32-element
// block, so each MMA result is an exact block sum (MXFP4) or an exact 4-element partial sum
// (Q8_0), which then enters the CPU's float chain block by block, one output at a time.
//
// A block of MMA_WARPS warps multiplies MMA_ROWS_MXFP4 (or MMA_ROWS_Q8_0) weight rows by up
// to TILE_SLOTS activation rows; both are staged as int8 in shared memory (MXFP4 nibbles
// decoded, stage_weight_block) MMA_KB quant blocks at a time. Each warp owns 16 weight rows (the
// MMA's M) and a range of slots in groups of 8 (the MMA's N); a group with no live slot is
// skipped, so an expert with few routed slots costs MMAs for them only (tiles of 8, 16, 24 or
// 32 slots).
//
// MXFP4: one mma.m16n8k32 per 16 rows × 8 slots × block gives the exact block sums isum; lane
// (g, t) (g = lane / 4, t = lane % 4) keeps the outputs (row g, slots 2t, 2t+1) and (row g + 8,
// the same slots) and does acc = fmaf(isum, d_w * d_a, acc) per block, as warp_dot_mxfp4.
// Q8_0: the CPU keeps eight accumulators fed by the 4-element partial sums s_k. One
// mma.m16n8k32 per 16 rows × 1 slot × block whose B column k holds the slot's activation
// block with only elements 4k..4k+3 kept gives D[r][k] = s_k(r): lane (g, t) gets s_2t and
// s_2t+1 of rows g and g + 8 and keeps those accumulators; at the end the quad's lanes add
// them in warp_dot_q8_0's order ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).

#define MMA_WARPS 8
#define MMA_ROWS_MXFP4 128
#define MMA_ROWS_Q8_0 64
#define MMA_KB 4

// The tensor-core instructions need sm_80; older targets compile the entry points empty (the
// launch code never calls them there). The host emulator (no __CUDA_ARCH__) has them all.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define MMA_AVAILABLE 1
#else
#define MMA_AVAILABLE 0
#endif

#if MMA_AVAILABLE
// BEGIN PTX WRAPPERS: tests/emulated.rs cuts this region out; kernel_emulator.cpp defines the
// same functions for the host.

// d = A · B + c for one warp (mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32), A 16×32 and
// B 32×8 int8, exact int32 sums. With g = lane / 4, t = lane % 4, each lane holds (4 int8 per
// register, lowest byte first): a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..], a[2] =
// A[g][16+4t..], a[3] = A[g+8][16+4t..]; b[0] = B[4t..4t+3][g], b[1] = B[16+4t..][g];
// c/d[0], [1] = C[g][2t], C[g][2t+1]; c/d[2], [3] = C[g+8][2t], C[g+8][2t+1].
__device__ __forceinline__ void mma_s8_16832(int d[4], const int a[4], const int b[2],
                                             const int c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]),
          "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// Four 8×8 matrices of 16-bit elements (8 rows of 16 bytes each) from shared memory for one
// warp (ldmatrix.sync.aligned.m8n8.x4.shared.b16): lanes 8i .. 8i + 7 give the addresses of
// the rows of matrix i (16-byte aligned); lane l gets r[i] = the 32-bit word l % 4 of row l / 4
// of matrix i. The "memory" clobber: the compiler must not move the stores of the tile across
// it (it only sees an address go in).
__device__ __forceinline__ void ldmatrix_x4(int r[4], const void* row) {
    asm volatile(
        "{ .reg .u64 a; .reg .u32 s; cvta.to.shared.u64 a, %4; cvt.u32.u64 s, a; "
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [s]; }"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "l"(row)
        : "memory");
}

// END PTX WRAPPERS

// (float)i, exactly, for |i| < 2^22 (every block or partial sum here: |isum| <= 32 * 128 *
// 128), without the I2F unit: 1.5 * 2^23 + i is exact in f32, and so is the subtraction.
__device__ __forceinline__ float small_int_to_float(int i) {
    return __int_as_float(0x4B400000 + i) - 12582912.f;
}

// out[slot][r] = w[r] . act[slot / act_div] for the slots order[beg .. end] (or beg .. end
// themselves when order is null) and the rows from blockIdx.x * ROWS (ROWS = 16 * WARPS_M);
// w: rows of nb blocks of TY, act: rows of nb Q8_0 blocks. block = 32 * MMA_WARPS; warp w
// owns rows 16 * (w % WARPS_M) .. + 15 and slots SPW * (w / WARPS_M) .. + SPW - 1 of a tile.
template <int TY>
__device__ void mma_impl(const u8* w, u64 row_bytes, int rows, int nb, const u8* act,
                         int act_div, int beg, int end, const int* order, float* out) {
    const int WARPS_M = TY == TY_MXFP4 ? MMA_ROWS_MXFP4 / 16 : MMA_ROWS_Q8_0 / 16;
    const int ROWS = 16 * WARPS_M;
    const int SPW = TILE_SLOTS / (MMA_WARPS / WARPS_M);  // slots per warp
    const int NG = SPW / 8;                              // groups of 8 slots per warp
    // Row strides of 8 * MMA_KB + 4 ints: the eight 16-byte rows of an ldmatrix, and the
    // 4-byte loads of a B fragment, land in distinct banks.
    __shared__ __attribute__((aligned(16))) int ws[ROWS][8 * MMA_KB + 4];
    __shared__ float wsc[ROWS][MMA_KB];
    __shared__ int xs[TILE_SLOTS][8 * MMA_KB + 4];
    __shared__ float xsc[TILE_SLOTS][MMA_KB];
    __shared__ int slot_of[TILE_SLOTS];
    int r0 = blockIdx.x * ROWS;
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    int g = lane / 4, t = lane % 4;
    int wr = 16 * (warp % WARPS_M), wslot = SPW * (warp / WARPS_M);
    const int zero[4] = {0, 0, 0, 0};
    // MXFP4: acc[j][q] is output q of group j (as the MMA's d[q]); Q8_0: acc[8 * j + i][q] the
    // accumulator 2t + (q & 1) of row g + 8 * (q >> 1) for slot i of group j.
    const int NACC = TY == TY_MXFP4 ? NG : 8 * NG;
    for (int t0 = beg; t0 < end; t0 += TILE_SLOTS) {
        int nt = end - t0 < TILE_SLOTS ? end - t0 : TILE_SLOTS;
        __syncthreads();  // the previous tile's stores have read slot_of
        if (tid < TILE_SLOTS) slot_of[tid] = tid >= nt ? -1 : order ? order[t0 + tid] : t0 + tid;
        float acc[NACC][4];
#pragma unroll
        for (int j = 0; j < NACC; j++) {
#pragma unroll
            for (int q = 0; q < 4; q++) acc[j][q] = 0.f;
        }
        for (int kb0 = 0; kb0 < nb; kb0 += MMA_KB) {
            int kbn = nb - kb0 < MMA_KB ? nb - kb0 : MMA_KB;
            __syncthreads();  // slot_of is set; the previous chunk has been used
            for (int i = tid; i < ROWS * MMA_KB; i += blockDim.x) {
                int r = i / MMA_KB, b = i % MMA_KB;
                int* dst = &ws[r][8 * b];
                if (r0 + r < rows && b < kbn) {
                    stage_weight_block<TY>(w + (u64)(r0 + r) * row_bytes, kb0 + b, dst, &wsc[r][b]);
                } else {
                    wsc[r][b] = 0.f;
                    for (int j = 0; j < 8; j++) dst[j] = 0;
                }
            }
            for (int i = tid; i < TILE_SLOTS * MMA_KB; i += blockDim.x) {
                int s = i / MMA_KB, b = i % MMA_KB;
                int slot = slot_of[s];
                if (slot >= 0 && b < kbn) {
                    const u8* ab = act + ((u64)(slot / act_div) * (u64)nb + (u64)(kb0 + b)) * 34u;
                    stage_act_block(ab, &xs[s][8 * b], &xsc[s][b]);
                } else {
                    xsc[s][b] = 0.f;
                    for (int j = 0; j < 8; j++) xs[s][8 * b + j] = 0;
                }
            }
            __syncthreads();
            if (wslot >= nt) continue;  // no live slot for this warp (warp-uniform)
            for (int b = 0; b < kbn; b++) {
                // Lane l gives row l % 16 and bytes 16 * (l / 16) of the block: matrices 0 .. 3
                // are a[0] .. a[3] of the weight rows wr .. wr + 15.
                int a[4];
                ldmatrix_x4(a, &ws[wr + lane % 16][8 * b + 4 * (lane / 16)]);
                float wg = wsc[wr + g][b], wg8 = wsc[wr + g + 8][b];
#pragma unroll
                for (int j = 0; j < NG; j++) {
                    int s0 = wslot + 8 * j;
                    if (s0 >= nt) continue;  // warp-uniform
                    if (TY == TY_MXFP4) {
                        int bf[2] = {xs[s0 + g][8 * b + t], xs[s0 + g][8 * b + 4 + t]};
                        int c[4];
                        mma_s8_16832(c, a, bf, zero);
                        float x0 = xsc[s0 + 2 * t][b], x1 = xsc[s0 + 2 * t + 1][b];
                        acc[j][0] = fmaf(small_int_to_float(c[0]), wg * x0, acc[j][0]);
                        acc[j][1] = fmaf(small_int_to_float(c[1]), wg * x1, acc[j][1]);
                        acc[j][2] = fmaf(small_int_to_float(c[2]), wg8 * x0, acc[j][2]);
                        acc[j][3] = fmaf(small_int_to_float(c[3]), wg8 * x1, acc[j][3]);
                    } else {
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            int s = s0 + i;
                            if (s >= nt) continue;  // warp-uniform
                            // B column k = lane g keeps elements 4k .. 4k + 3: b[0] holds
                            // elements 4t.., kept by the lane with g = t; b[1] elements 16 + 4t..,
                            // kept by the lane with g = 4 + t.
                            int bf[2] = {g == t ? xs[s][8 * b + t] : 0,
                                         g == t + 4 ? xs[s][8 * b + 4 + t] : 0};
                            int c[4];
                            mma_s8_16832(c, a, bf, zero);
                            float x = xsc[s][b];
                            float dg = wg * x, dg8 = wg8 * x;
                            int n8 = 8 * j + i;
                            acc[n8][0] = fmaf(dg, small_int_to_float(c[0]), acc[n8][0]);
                            acc[n8][1] = fmaf(dg, small_int_to_float(c[1]), acc[n8][1]);
                            acc[n8][2] = fmaf(dg8, small_int_to_float(c[2]), acc[n8][2]);
                            acc[n8][3] = fmaf(dg8, small_int_to_float(c[3]), acc[n8][3]);
                        }
                    }
                }
            }
        }
        if (wslot >= nt) continue;
#pragma unroll
        for (int j = 0; j < NG; j++) {
            int s0 = wslot + 8 * j;
            if (s0 >= nt) continue;
            if (TY == TY_MXFP4) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    int s = s0 + 2 * t + (q & 1), r = r0 + wr + g + 8 * (q >> 1);
                    if (s < nt && r < rows) out[(u64)slot_of[s] * (u64)rows + (u64)r] = acc[j][q];
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    int s = s0 + i;
                    if (s >= nt) continue;
                    // Lane t holds accumulators 2t, 2t + 1; the quad adds them in the CPU's
                    // order, the lower-numbered accumulator always on the left.
                    float v[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float m0 = acc[8 * j + i][2 * h], m1 = acc[8 * j + i][2 * h + 1];
                        float o0 = __shfl_xor_sync(0xffffffffu, m0, 2);
                        float o1 = __shfl_xor_sync(0xffffffffu, m1, 2);
                        // t = 0, 2: a0 + a4, a1 + a5; t = 1, 3: a2 + a6, a3 + a7.
                        float e0 = t < 2 ? m0 + o0 : o0 + m0;
                        float e1 = t < 2 ? m1 + o1 : o1 + m1;
                        float p0 = __shfl_xor_sync(0xffffffffu, e0, 1);
                        float p1 = __shfl_xor_sync(0xffffffffu, e1, 1);
                        float f0 = (t & 1) == 0 ? e0 + p0 : p0 + e0;
                        float f1 = (t & 1) == 0 ? e1 + p1 : p1 + e1;
                        v[h] = f0 + f1;
                    }
                    int r = r0 + wr + g + 8 * (t & 1);
                    if (t < 2 && r < rows) out[(u64)slot_of[s] * (u64)rows + (u64)r] = v[t & 1];
                }
            }
        }
    }
}
#endif

// The body of an entry point: its code on sm_80+ and in the host emulator, nothing elsewhere.
#if MMA_AVAILABLE
#define MMA_BODY(...) __VA_ARGS__
#else
#define MMA_BODY(...)
#endif

// y[t][r] = W[r] . x[t] (x: n rows of Q8_0 blocks). grid = (ceil(rows / MMA_ROWS_<TY>),
// ceil(n / TILE_SLOTS)), block = 32 * MMA_WARPS; sm_80+ only.
#define MATMUL_MMA(SUFFIX, TY)                                                                  \
    extern "C" __global__ void matmul_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows, int nb, \
                                                   const u8* xq, int n, float* y) {             \
        MMA_BODY(int beg = blockIdx.y * TILE_SLOTS;                                             \
                 int end = n - beg < TILE_SLOTS ? n : beg + TILE_SLOTS;                         \
                 mma_impl<TY>(w, row_bytes, rows, nb, xq, 1, beg, end, nullptr, y);)            \
    }

// out[slot][r] = w_e[r] . act[slot / act_div] for every slot of every expert e (grouped by
// moe_group); w: [n_expert][rows] rows of nb blocks. grid = (ceil(rows / MMA_ROWS_<TY>),
// n_expert), block = 32 * MMA_WARPS; sm_80+ only.
#define MOE_MM_MMA(SUFFIX, TY)                                                                  \
    extern "C" __global__ void moe_mm_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows, int nb, \
                                                   const u8* act, int act_div,                  \
                                                   const int* offsets, const int* order,        \
                                                   float* out) {                                \
        MMA_BODY(int e = blockIdx.y;                                                            \
                 mma_impl<TY>(w + (u64)e * (u64)rows * row_bytes, row_bytes, rows, nb, act,     \
                              act_div, offsets[e], offsets[e + 1], order, out);)                \
    }

MATMUL_MMA(q8_0, TY_Q8_0)
MATMUL_MMA(mxfp4, TY_MXFP4)
MOE_MM_MMA(q8_0, TY_Q8_0)
MOE_MM_MMA(mxfp4, TY_MXFP4)
