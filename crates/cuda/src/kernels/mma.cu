// ---------------------------------------------------------------------------------------------
// Tiled Q8_0/MXFP4 products on int8 tensor cores (sm_80+; device/matmul.rs and experts.rs pick
// them there, tiled.cu's dp4a kernels elsewhere), with the same bits as the row-per-warp
// kernels: integer MMA is exact, and its accumulator starts from zero for every 32-element
// block, so each MMA result is an exact block sum (MXFP4) or an exact 4-element partial sum
// (Q8_0), which then enters the CPU's float chain block by block, one output at a time.
//
// A block of MMA_WARPS warps multiplies MMA_ROWS_MXFP4 (or MMA_ROWS_Q8_0) weight rows by one
// tile of up to TILE_SLOTS activation rows, MMA_KB_<TY> quant blocks (a k-tile) at a time. The
// k-tiles are double-buffered: while k-tile i is decoded and multiplied, cp.async brings the
// raw bytes of k-tile i + 1 (each row's 16-byte-aligned window, cp_async_window_piece) into
// the other buffer; decoding turns the raw bytes into int8 in shared memory (MXFP4 nibbles
// through stage_weight_block, Q8_0 quants repacked as words) with their scales. Each warp owns
// 16 weight rows (the MMA's M) and a range of slots in groups of 8 (the MMA's N); a group with
// no live slot is skipped, so a tile of 8 or 16 slots costs MMAs for them only. The MoE
// products take their tiles from a list (moe_tiles): every expert's slots split into tiles of
// near-equal width (a multiple of 8, at most TILE_SLOTS), one block per tile and row tile, so
// an expert with many routed slots is spread over many blocks instead of looping in one. The
// bits do not depend on the tiling: every output's chain runs over its own row's blocks.
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
#define MMA_KB_MXFP4 2
#define MMA_KB_Q8_0 4

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

// Asynchronous copies global -> shared (cp.async, sm_80): cp_async_16 copies 16 bytes from a
// 16-byte-aligned global address to a 16-byte-aligned shared one, reading only the first
// src_bytes (0 .. 16) and zero-filling the rest; cp_async_4 copies 4 bytes (both 4-byte
// aligned). cp_async_wait_all waits for every copy this thread issued (a __syncthreads after
// it makes all threads' copies visible). The "memory" clobbers keep the compiler from moving
// shared-memory accesses across them.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile(
        "{ .reg .u64 a, g; .reg .u32 s; cvta.to.shared.u64 a, %0; cvt.u32.u64 s, a; "
        "cvta.to.global.u64 g, %1; cp.async.cg.shared.global [s], [g], 16, %2; }"
        :
        : "l"(dst), "l"(src), "r"(src_bytes)
        : "memory");
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
    asm volatile(
        "{ .reg .u64 a, g; .reg .u32 s; cvta.to.shared.u64 a, %0; cvt.u32.u64 s, a; "
        "cvta.to.global.u64 g, %1; cp.async.ca.shared.global [s], [g], 4; }"
        :
        : "l"(dst), "l"(src)
        : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// END PTX WRAPPERS

// (float)i, exactly, for |i| < 2^22 (every block or partial sum here: |isum| <= 32 * 128 *
// 128), without the I2F unit: 1.5 * 2^23 + i is exact in f32, and so is the subtraction.
__device__ __forceinline__ float small_int_to_float(int i) {
    return __int_as_float(0x4B400000 + i) - 12582912.f;
}

// Piece p (16 bytes) of the 16-byte-aligned window that holds the bytes src .. src + bytes - 1,
// by cp.async into dst + 16 p (dst 16-byte aligned; src[0] lands at dst + window_shift(src)).
// Pieces past the window are skipped, and bytes from src + bytes on are zero-filled, not read;
// the bytes before src in its window are read (they lie in the same allocation: buffers start
// 16-byte aligned).
__device__ __forceinline__ int window_shift(const u8* src) { return (int)((u64)src & 15u); }
__device__ __forceinline__ void cp_async_window_piece(u8* dst, const u8* src, int bytes, int p) {
    int shift = window_shift(src);
    int n = shift + bytes - 16 * p;
    if (n > 0) cp_async_16(dst + 16 * p, src - shift + 16 * p, n < 16 ? n : 16);
}

// Bytes of a raw window buffer for `bytes` bytes at any alignment (a multiple of 16).
#define MMA_WINDOW(bytes) (((bytes) + 30) / 16 * 16)

// out[slot][r] = w[r] . act[slot / act_div] for the slots order[beg .. end] (or beg .. end
// themselves when order is null; end - beg <= TILE_SLOTS) and the rows from blockIdx.x * ROWS
// (ROWS = 16 * WARPS_M); w: rows of nb blocks of TY, act: rows of nb Q8_0 blocks. block = 32 *
// MMA_WARPS; warp w owns rows 16 * (w % WARPS_M) .. + 15 and slots SPW * (w / WARPS_M) .. + SPW
// - 1 of the tile.
template <int TY>
__device__ void mma_impl(const u8* w, u64 row_bytes, int rows, int nb, const u8* act,
                         int act_div, int beg, int end, const int* order, float* out) {
    const int WARPS_M = TY == TY_MXFP4 ? MMA_ROWS_MXFP4 / 16 : MMA_ROWS_Q8_0 / 16;
    const int ROWS = 16 * WARPS_M;
    const int SPW = TILE_SLOTS / (MMA_WARPS / WARPS_M);  // slots per warp
    const int NG = SPW / 8;                              // groups of 8 slots per warp
    const int KB = TY == TY_MXFP4 ? MMA_KB_MXFP4 : MMA_KB_Q8_0;
    const int WB = TY == TY_MXFP4 ? 17 : 34;  // bytes of a weight block
    const int WRAW = MMA_WINDOW(KB * WB), XRAW = MMA_WINDOW(KB * 34);
    // The raw k-tiles (double-buffered), and the decoded one. Row strides of 8 * KB + 4 ints:
    // the eight 16-byte rows of an ldmatrix, and the 4-byte loads of a B fragment, land in
    // distinct banks.
    __shared__ __attribute__((aligned(16))) u8 wraw[2][ROWS][WRAW];
    __shared__ __attribute__((aligned(16))) u8 xraw[2][TILE_SLOTS][XRAW];
    __shared__ __attribute__((aligned(16))) int ws[ROWS][8 * KB + 4];
    __shared__ float wsc[ROWS][KB];
    __shared__ int xs[TILE_SLOTS][8 * KB + 4];
    __shared__ float xsc[TILE_SLOTS][KB];
    __shared__ int slot_of[TILE_SLOTS];
    int r0 = blockIdx.x * ROWS;
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    int g = lane / 4, t = lane % 4;
    int wr = 16 * (warp % WARPS_M), wslot = SPW * (warp / WARPS_M);
    const int zero[4] = {0, 0, 0, 0};
    int nt = end - beg;
    if (tid < TILE_SLOTS) slot_of[tid] = tid >= nt ? -1 : order ? order[beg + tid] : beg + tid;
    __syncthreads();
    // The raw bytes of k-tile kb0 (kbn blocks) into buffer buf, by cp.async.
    auto issue = [&](int kb0, int kbn, int buf) {
        const int WP = WRAW / 16, XP = XRAW / 16;
        for (int i = tid; i < ROWS * WP; i += blockDim.x) {
            int r = i / WP;
            if (r0 + r >= rows) continue;
            const u8* src = w + (u64)(r0 + r) * row_bytes + (u64)kb0 * WB;
            cp_async_window_piece(wraw[buf][r], src, kbn * WB, i % WP);
        }
        for (int i = tid; i < TILE_SLOTS * XP; i += blockDim.x) {
            int s = i / XP, slot = slot_of[s];
            if (slot < 0) continue;
            const u8* src = act + ((u64)(slot / act_div) * (u64)nb + (u64)kb0) * 34u;
            cp_async_window_piece(xraw[buf][s], src, kbn * 34, i % XP);
        }
    };
    // MXFP4: acc[j][q] is output q of group j (as the MMA's d[q]); Q8_0: acc[8 * j + i][q] the
    // accumulator 2t + (q & 1) of row g + 8 * (q >> 1) for slot i of group j.
    const int NACC = TY == TY_MXFP4 ? NG : 8 * NG;
    float acc[NACC][4];
#pragma unroll
    for (int j = 0; j < NACC; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) acc[j][q] = 0.f;
    }
    if (nb > 0) issue(0, nb < KB ? nb : KB, 0);
    for (int kb0 = 0, c = 0; kb0 < nb; kb0 += KB, c++) {
        int kbn = nb - kb0 < KB ? nb - kb0 : KB, buf = c & 1;
        cp_async_wait_all();
        __syncthreads();  // k-tile c is in; the products of k-tile c - 1 are done
        if (kb0 + KB < nb) issue(kb0 + KB, nb - kb0 - KB < KB ? nb - kb0 - KB : KB, buf ^ 1);
        stage_k_tile<TY, ROWS, KB, 8 * KB + 4, 8 * KB + 4>(
            ws, wsc, xs, xsc, kbn,
            [&](int r) -> const u8* {
                if (r0 + r >= rows) return nullptr;
                const u8* src = w + (u64)(r0 + r) * row_bytes + (u64)kb0 * WB;
                return wraw[buf][r] + window_shift(src);
            },
            [&](int s) -> const u8* {
                int slot = slot_of[s];
                if (slot < 0) return nullptr;
                const u8* src = act + ((u64)(slot / act_div) * (u64)nb + (u64)kb0) * 34u;
                return xraw[buf][s] + window_shift(src);
            });
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
                    int c4[4];
                    mma_s8_16832(c4, a, bf, zero);
                    float x0 = xsc[s0 + 2 * t][b], x1 = xsc[s0 + 2 * t + 1][b];
                    acc[j][0] = fmaf(small_int_to_float(c4[0]), wg * x0, acc[j][0]);
                    acc[j][1] = fmaf(small_int_to_float(c4[1]), wg * x1, acc[j][1]);
                    acc[j][2] = fmaf(small_int_to_float(c4[2]), wg8 * x0, acc[j][2]);
                    acc[j][3] = fmaf(small_int_to_float(c4[3]), wg8 * x1, acc[j][3]);
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
                        int c4[4];
                        mma_s8_16832(c4, a, bf, zero);
                        float x = xsc[s][b];
                        float dg = wg * x, dg8 = wg8 * x;
                        int n8 = 8 * j + i;
                        acc[n8][0] = fmaf(dg, small_int_to_float(c4[0]), acc[n8][0]);
                        acc[n8][1] = fmaf(dg, small_int_to_float(c4[1]), acc[n8][1]);
                        acc[n8][2] = fmaf(dg8, small_int_to_float(c4[2]), acc[n8][2]);
                        acc[n8][3] = fmaf(dg8, small_int_to_float(c4[3]), acc[n8][3]);
                    }
                }
            }
        }
    }
    if (wslot >= nt) return;
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
#endif

// The body of an entry point: its code on sm_80+ and in the host emulator, nothing elsewhere.
#if MMA_AVAILABLE
#define MMA_BODY(...) __VA_ARGS__
#else
#define MMA_BODY(...)
#endif

// The tile list of the grouped expert products: every expert e with at least min_count
// routed slots (offsets from moe_group; min_count >= 1) gets ceil(c / TILE_SLOTS) tiles of its
// c slots, of near-equal width (a multiple of 8 but the last); tiles[0] = their count, then
// (e, begin, end) per tile, at most ceil(slots / TILE_SLOTS) + min(n_expert, slots) of them.
// One block, one thread working (n_expert <= MOE_MAX_EXPERTS).
extern "C" __global__ void moe_tiles(const int* offsets, int n_expert, int min_count, int* tiles) {
    if (threadIdx.x != 0) return;
    int n = 0;
    for (int e = 0; e < n_expert; e++) {
        int b = offsets[e], c = offsets[e + 1] - b;
        if (c <= 0 || c < min_count) continue;
        int parts = (c + TILE_SLOTS - 1) / TILE_SLOTS;
        int width = ((c + parts - 1) / parts + 7) / 8 * 8;
        for (int s = b; s < b + c; s += width) {
            tiles[1 + 3 * n] = e;
            tiles[2 + 3 * n] = s;
            tiles[3 + 3 * n] = s + width < b + c ? s + width : b + c;
            n++;
        }
    }
    tiles[0] = n;
}

// y[t][r] = W[r] . x[t] (x: n rows of Q8_0 blocks). grid = (ceil(rows / MMA_ROWS_<TY>),
// ceil(n / TILE_SLOTS)), block = 32 * MMA_WARPS; sm_80+ only.
#define MATMUL_MMA(SUFFIX, TY)                                                                  \
    extern "C" __global__ void matmul_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows, int nb, \
                                                   const u8* xq, int n, float* y) {             \
        MMA_BODY(int beg = blockIdx.y * TILE_SLOTS;                                             \
                 int end = n - beg < TILE_SLOTS ? n : beg + TILE_SLOTS;                         \
                 mma_impl<TY>(w, row_bytes, rows, nb, xq, 1, beg, end, nullptr, y);)            \
    }

// out[slot][r] = w_e[r] . act[slot / act_div] for the slots of every tile (e, begin, end) of
// `tiles` (moe_tiles; order from moe_group); w: [n_expert][rows] rows of nb blocks. grid =
// (ceil(rows / MMA_ROWS_<TY>), the most tiles there can be), block = 32 * MMA_WARPS; sm_80+
// only.
#define MOE_MM_MMA(SUFFIX, TY)                                                                  \
    extern "C" __global__ void moe_mm_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows, int nb, \
                                                   const u8* act, int act_div, const int* tiles, \
                                                   const int* order, float* out) {              \
        MMA_BODY(int j = blockIdx.y; if (j >= tiles[0]) return; int e = tiles[1 + 3 * j];       \
                 mma_impl<TY>(w + (u64)e * (u64)rows * row_bytes, row_bytes, rows, nb, act,     \
                              act_div, tiles[2 + 3 * j], tiles[3 + 3 * j], order, out);)        \
    }

MATMUL_MMA(q8_0, TY_Q8_0)
MATMUL_MMA(mxfp4, TY_MXFP4)
MOE_MM_MMA(q8_0, TY_Q8_0)
MOE_MM_MMA(mxfp4, TY_MXFP4)
