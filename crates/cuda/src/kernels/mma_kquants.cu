// ---------------------------------------------------------------------------------------------
// K-quant products (Q2_K .. Q6_K weights, Q8_K activations) of batches on int8 tensor cores
// (sm_80+: device/lowbit.rs picks them for dense matmuls of TILED_MIN_TOKENS tokens or more
// and experts with that many routed slots; lowbit_products.cu's warp kernels take the rest,
// moe_lowbit_* skipping the experts these take), with the bits of the warp kernels. The CPU
// device's orders for such batches all start from exact integer sums per super-block (or per
// pair of sub-blocks):
//   LB_TILED (K-quants that are not repacked):
//             s1 = sum_g sc_g * isum_g, r = f32(s1) * d_w, r = fma(-dmin_w, f32(s2), r) with
//             s2 = sum_g m_g * bsum_g, acc = fma(r, d_a, acc);
//   LB_BLOCK (repacked Q4_K: experts, and a dense matmul's tokens after its groups of four):
//             acc = fma(f32(s1), d_w * d_a, acc), acc2 = fma(f32(s2), dmin_w * d_a, acc2),
//             acc - acc2 at the end;
//   LB_PAIR  (repacked Q4_K, a dense matmul's complete groups of four tokens): the same per
//             pair of 32-element sub-blocks.
// ggml's vec_dot order (LB_VEC: eight float chains of partial sums across the sub-blocks,
// fewer tokens) stays with the warp kernels.
//
// A block of MMA_WARPS warps multiplies MMA_ROWS_KQ weight rows by one tile of up to
// TILE_SLOTS activation rows, a super-block (256 values) at a time, double-buffered like
// mma.cu: while super-block i is decoded and multiplied, cp.async brings the raw weight bytes
// of super-block i + 1 (16-byte-aligned windows) and the whole Q8_K activation blocks (4-byte
// copies: 292-byte blocks are 4-byte aligned) into the other buffer. Decoding writes each
// weight row's 256 quants as int8 (kq_word; Q6_K's minus 32, so the sums need no correction), the
// scales and mins of its 16-value groups, d and dmin. Warp w owns rows 16 * (w % 2) .. + 15 and
// the slot group 8 * (w / 2) .. + 7 (skipped when the tile has no slot there): lane (g, t)
// keeps the outputs (row g, slots 2t, 2t + 1) and (row g + 8, the same slots). Per 32-value
// sub-block one mma.m16n8k32 gives the exact sums isum (the accumulator starts from zero);
// types with 16-value groups (Q2_K, Q3_K, Q6_K) take two, with the B fragment's other half
// zeroed, so each group's sum is separate. The lane multiplies them by its rows' scales in
// integers, and runs the order's float chain per super-block.

#define MMA_ROWS_KQ 32

#if MMA_AVAILABLE
// Words of a staged Q8_K activation block: f32 d, 64 words of quants, 8 of int16 sums; a
// stride of 76 puts the B-fragment loads of 8 slots in distinct banks.
#define KQ_ACT_WORDS 73
#define KQ_ACT_STRIDE 76

// Bytewise x - d (each byte of x at most 127, d's bytes at most 64): a byte's high bit set
// first, so no byte borrows from the next, then flipped back.
__device__ __forceinline__ u32 sub_bytes(u32 x, u32 d) {
    return ((x | 0x80808080u) - d) ^ 0x80808080u;
}

// Elements 4k .. 4k + 3 of a K-quant super-block b as int8 (the signed value kq_q<TY> gives;
// Q6_K's minus 32), one word: each format keeps four consecutive elements in four
// consecutive bytes (at the same bit position), so one word of each array does it.
template <int TY>
__device__ __forceinline__ int kq_word(const u8* b, int k) {
    int t = 4 * k % 32;  // e % 32 of the first element; e / 32 = k / 8
    if (TY == TY_Q2_K || TY == TY_Q3_K) {
        int qs = TY == TY_Q2_K ? 16 : 32;
        u32 low = ((u32)load_i8x4_bytes(b + qs + 32 * (k / 32) + t) >> (2 * (k % 32 / 8))) &
                  0x03030303u;
        if (TY == TY_Q2_K) return (int)low;
        u32 hm = ((u32)load_i8x4_bytes(b + t) >> (k / 8)) & 0x01010101u;
        return (int)sub_bytes(low | (hm << 2), 0x04040404u);
    }
    if (TY == TY_Q4_K || TY == TY_Q5_K) {
        int qs = TY == TY_Q4_K ? 16 : 48;
        u32 q = ((u32)load_i8x4_bytes(b + qs + 32 * (k / 16) + t) >> (4 * (k / 8 % 2))) &
                0x0F0F0F0Fu;
        if (TY == TY_Q5_K) q |= (((u32)load_i8x4_bytes(b + 16 + t) >> (k / 8)) & 0x01010101u) << 4;
        return (int)q;
    }
    int half = k / 32, group = k % 32 / 8;
    u32 low = ((u32)load_i8x4_bytes(b + 64 * half + 32 * (group & 1) + t) >> (4 * (group >> 1))) &
              0x0F0F0F0Fu;
    u32 high = ((u32)load_i8x4_bytes(b + 128 + 32 * half + t) >> (2 * group)) & 0x03030303u;
    return (int)sub_bytes(low | (high << 4), 0x20202020u);
}

// The sum of m_g * bsum_g over groups g0 .. g1 - 1 of a staged activation block (mins of 0
// for the types without).
__device__ __forceinline__ int kq_mma_mins(const int* mins, const int* xa, int g0, int g1) {
    int s = 0;
    for (int g = g0; g < g1; g++) {
        u32 word = (u32)xa[65 + g / 2];
        s += mins[g] * (int)(short)(u16)(g % 2 ? word >> 16 : word & 0xffffu);
    }
    return s;
}

// out[slot][r] = w[r] . act[slot / act_div] for the slots order[beg .. end] (beg .. end when
// order is null; end - beg <= TILE_SLOTS) and the MMA_ROWS_KQ rows from blockIdx.x *
// MMA_ROWS_KQ; w: rows of nsb super-blocks of TY, act: rows of nsb Q8_K blocks. Slot i of the
// tile sums in mode_grouped when beg + i < grouped, else in mode_rest (LB_TILED, LB_BLOCK or
// LB_PAIR). block = 32 * MMA_WARPS.
template <int TY>
__device__ void kq_mma_impl(const u8* w, u64 row_bytes, int rows, int nsb, const u8* act,
                            int act_div, int beg, int end, const int* order, int grouped,
                            int mode_grouped, int mode_rest, float* out) {
    const int BB = TY == TY_Q2_K ? 84 : TY == TY_Q3_K ? 110 : TY == TY_Q4_K ? 144
                 : TY == TY_Q5_K ? 176 : 210;
    const bool HAS_MIN = TY == TY_Q2_K || TY == TY_Q4_K || TY == TY_Q5_K;
    const bool GROUPS16 = TY == TY_Q2_K || TY == TY_Q3_K || TY == TY_Q6_K;
    const int WRAW = MMA_WINDOW(BB);
    __shared__ __attribute__((aligned(16))) u8 wraw[2][MMA_ROWS_KQ][WRAW];
    __shared__ __attribute__((aligned(16))) int ws[MMA_ROWS_KQ][64 + 4];
    __shared__ int xq[2][TILE_SLOTS][KQ_ACT_STRIDE];
    __shared__ int wsc[MMA_ROWS_KQ][16], wmn[MMA_ROWS_KQ][16];
    __shared__ float wd[MMA_ROWS_KQ], wdm[MMA_ROWS_KQ];
    __shared__ int slot_of[TILE_SLOTS];
    int r0 = blockIdx.x * MMA_ROWS_KQ;
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    int g = lane / 4, t = lane % 4;
    int wr = 16 * (warp % 2), s0 = 8 * (warp / 2);
    const int zero[4] = {0, 0, 0, 0};
    int nt = end - beg;
    if (tid < TILE_SLOTS) slot_of[tid] = tid >= nt ? -1 : order ? order[beg + tid] : beg + tid;
    __syncthreads();
    // Super-block sb's raw weight windows and activation blocks into buffer buf, by cp.async.
    auto issue = [&](int sb, int buf) {
        const int WP = WRAW / 16;
        for (int i = tid; i < MMA_ROWS_KQ * WP; i += blockDim.x) {
            int r = i / WP;
            if (r0 + r >= rows) continue;
            const u8* src = w + (u64)(r0 + r) * row_bytes + (u64)sb * BB;
            cp_async_window_piece(wraw[buf][r], src, BB, i % WP);
        }
        for (int i = tid; i < TILE_SLOTS * KQ_ACT_WORDS; i += blockDim.x) {
            int s = i / KQ_ACT_WORDS, k = i % KQ_ACT_WORDS, slot = slot_of[s];
            if (slot < 0) continue;
            const u8* src = act + ((u64)(slot / act_div) * (u64)nsb + (u64)sb) * 292u;
            cp_async_4(&xq[buf][s][k], src + 4 * k);
        }
    };
    // Output q of the lane: row g + 8 * (q >> 1), slot 2t + (q & 1) of the warp's group.
    int mode[4];
    float acc[4], acc2[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        mode[q] = beg + s0 + 2 * t + (q & 1) < grouped ? mode_grouped : mode_rest;
        acc[q] = acc2[q] = 0.f;
    }
    if (nsb > 0) issue(0, 0);
    for (int sb = 0; sb < nsb; sb++) {
        int buf = sb & 1;
        cp_async_wait_all();
        __syncthreads();  // super-block sb is in; the products of sb - 1 are done
        if (sb + 1 < nsb) issue(sb + 1, buf ^ 1);
        for (int i = tid; i < MMA_ROWS_KQ * 64; i += blockDim.x) {
            int r = i / 64, k = i % 64, v = 0;
            if (r0 + r < rows) {
                const u8* src = w + (u64)(r0 + r) * row_bytes + (u64)sb * BB;
                v = kq_word<TY>(wraw[buf][r] + window_shift(src), k);
            }
            ws[r][k] = v;
        }
        for (int i = tid; i < MMA_ROWS_KQ * 16; i += blockDim.x) {
            int r = i / 16, gi = i % 16, sc = 0, mn = 0;
            if (r0 + r < rows) {
                const u8* src = w + (u64)(r0 + r) * row_bytes + (u64)sb * BB;
                const u8* wb = wraw[buf][r] + window_shift(src);
                sc = kq_sc<TY>(wb, 16 * gi);
                if (TY == TY_Q2_K) mn = wb[gi] >> 4;
                if (TY == TY_Q4_K || TY == TY_Q5_K) mn = k4_min(wb + 4, gi / 2);
                if (gi == 0) {
                    wd[r] = kq_d<TY>(wb);
                    wdm[r] = HAS_MIN ? kq_dmin<TY>(wb) : 0.f;
                }
            } else if (gi == 0) {
                wd[r] = wdm[r] = 0.f;
            }
            wsc[r][gi] = sc;
            wmn[r][gi] = mn;
        }
        __syncthreads();
        if (s0 >= nt) continue;  // no live slot for this warp (warp-uniform)
        const int* xa[2] = {xq[buf][s0 + 2 * t], xq[buf][s0 + 2 * t + 1]};
        int rq[2] = {wr + g, wr + g + 8};
        int s1[4] = {0, 0, 0, 0}, pair[4] = {0, 0, 0, 0};
        for (int j = 0; j < 8; j++) {
            int a[4];
            ldmatrix_x4(a, &ws[wr + lane % 16][8 * j + 4 * (lane / 16)]);
            int b0 = xq[buf][s0 + g][1 + 8 * j + t], b1 = xq[buf][s0 + g][1 + 8 * j + 4 + t];
            int v[4];
            if (GROUPS16) {
                int lo[4], hi[4];
                int bl[2] = {b0, 0}, bh[2] = {0, b1};
                mma_s8_16832(lo, a, bl, zero);
                mma_s8_16832(hi, a, bh, zero);
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int* sc = wsc[rq[q >> 1]];
                    v[q] = sc[2 * j] * lo[q] + sc[2 * j + 1] * hi[q];
                }
            } else {
                int bf[2] = {b0, b1}, c4[4];
                mma_s8_16832(c4, a, bf, zero);
#pragma unroll
                for (int q = 0; q < 4; q++) v[q] = wsc[rq[q >> 1]][2 * j] * c4[q];
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                s1[q] += v[q];
                pair[q] += v[q];
                if (j % 2 == 1 && mode[q] == LB_PAIR) {
                    int r = rq[q >> 1];
                    float da = __int_as_float(xa[q & 1][0]);
                    float d = wd[r] * da, dmin = wdm[r] * da;
                    int mn = kq_mma_mins(wmn[r], xa[q & 1], 2 * j - 2, 2 * j + 2);
                    acc[q] = fmaf((float)pair[q], d, acc[q]);
                    acc2[q] = fmaf((float)mn, dmin, acc2[q]);
                }
                if (j % 2 == 1) pair[q] = 0;
            }
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int r = rq[q >> 1];
            float da = __int_as_float(xa[q & 1][0]);
            if (mode[q] == LB_TILED) {
                float v = (float)s1[q] * wd[r];
                if (HAS_MIN) v = fmaf(-wdm[r], (float)kq_mma_mins(wmn[r], xa[q & 1], 0, 16), v);
                acc[q] = fmaf(v, da, acc[q]);
            } else if (mode[q] == LB_BLOCK) {
                float d = wd[r] * da, dmin = wdm[r] * da;
                acc[q] = fmaf((float)s1[q], d, acc[q]);
                acc2[q] = fmaf((float)kq_mma_mins(wmn[r], xa[q & 1], 0, 16), dmin, acc2[q]);
            }
        }
    }
    if (s0 >= nt) return;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int s = s0 + 2 * t + (q & 1), r = r0 + wr + g + 8 * (q >> 1);
        float v = mode[q] == LB_TILED ? acc[q] : acc[q] - acc2[q];
        if (s < nt && r < rows) out[(u64)slot_of[s] * (u64)rows + (u64)r] = v;
    }
}
#endif

// y[t][r] = W[r] . xq[t] for K-quant weights (xq: n rows of nsb Q8_K blocks), token t <
// grouped in mode_grouped, the others in mode_rest (not LB_VEC). grid = (ceil(rows /
// MMA_ROWS_KQ), ceil(n / TILE_SLOTS)), block = 32 * MMA_WARPS; sm_80+ only.
// out[slot][r] = w_e[r] . act[slot / act_div] for the slots of every tile (e, begin, end) of
// `tiles` (moe_tiles; order from moe_group), all in `mode` (LB_TILED or LB_BLOCK); w:
// [n_expert][rows] rows of nsb super-blocks. grid = (ceil(rows / MMA_ROWS_KQ), the most tiles
// there can be), block = 32 * MMA_WARPS; sm_80+ only.
#define KQ_MMA(SUFFIX, TY)                                                                      \
    extern "C" __global__ void matmul_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows,       \
                                                   int nsb, const u8* xq, int n, int grouped,   \
                                                   int mode_grouped, int mode_rest, float* y) { \
        MMA_BODY(int beg = blockIdx.y * TILE_SLOTS;                                             \
                 int end = n - beg < TILE_SLOTS ? n : beg + TILE_SLOTS;                         \
                 kq_mma_impl<TY>(w, row_bytes, rows, nsb, xq, 1, beg, end, nullptr, grouped,    \
                                 mode_grouped, mode_rest, y);)                                  \
    }                                                                                           \
    extern "C" __global__ void moe_mm_mma_##SUFFIX(const u8* w, u64 row_bytes, int rows,       \
                                                   int nsb, const u8* act, int act_div,         \
                                                   const int* tiles, const int* order,          \
                                                   int mode, float* out) {                      \
        MMA_BODY(int j = blockIdx.y; if (j >= tiles[0]) return; int e = tiles[1 + 3 * j];       \
                 kq_mma_impl<TY>(w + (u64)e * (u64)rows * row_bytes, row_bytes, rows, nsb, act, \
                                 act_div, tiles[2 + 3 * j], tiles[3 + 3 * j], order, 0, mode,   \
                                 mode, out);)                                                   \
    }

KQ_MMA(q2_k, TY_Q2_K)
KQ_MMA(q3_k, TY_Q3_K)
KQ_MMA(q4_k, TY_Q4_K)
KQ_MMA(q5_k, TY_Q5_K)
KQ_MMA(q6_k, TY_Q6_K)
