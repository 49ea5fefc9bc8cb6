// ---------------------------------------------------------------------------------------------
// Decode mat-vecs of Q8_0 and MXFP4 weights with __dp4a, in the CPU device's float order
// without the warp-wide replay of warp_dot_q8_0 / warp_dot_mxfp4: each lane keeps exactly the
// float chains of the CPU's accumulators it owns, so no float is computed twice per row.
//
// Q8_0 (hmoe_quant's dot_q8_0): 8 lanes per weight row, 4 rows per warp. Lane k is the CPU's
// accumulator k: per block it loads weight quants 4k..4k+3 as one word, s_k = one dp4a with
// the activation's word, d = d_w * d_a, acc_k = fma(d, s_k, acc_k); then the xor fold over
// lanes 4, 2, 1 adds ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), hsum8's order.
// (ggml forms |w| * sign(a, w), which differs from dp4a's w * a only for an activation of
// -128, which the quantizer gives only for NaN; see warp_dot_q8_0.)
// Q8_0 blocks are 34 bytes, so every quant word starts at an even address (rows of whole
// blocks from an aligned allocation): two 16-bit loads make it.
//
// MXFP4 (the block-wise order: acc = fma(isum, 2^(e-128) * d_a, acc) per block in order):
// 4 lanes per row, 8 rows per warp. Lane l decodes nibble bytes 4l..4l+3 of each block
// (elements 4l..4l+3 and 16+4l..16+4l+3) through a byte-permute table, two dp4a with the
// activation's words, the four partial sums meet exactly by xor shuffles, and each of the 4
// lanes then runs the row's one chain (identical in all four). MXFP4 blocks are 17 bytes, so
// the weight words are assembled from byte loads.
//
// Integer sums become floats by the exact magic add (int_to_float_exact): |s_k| <= 4 * 128 *
// 127 and |isum| <= 32 * 12 * 127, both far under 2^22.
//
// A row's float chains are sequential, so a lane loads the weights of DP4A_CHUNK blocks at
// once before their products: the chunk's loads are in flight together.
//
// One entry point per weight type takes 1..DP4A_TOKENS tokens per block (grid.y covers the
// rest); each token count has its own instantiation, so a lane keeps one accumulator per token.
// It multiplies up to three matrices of the same width by the same activations in one launch
// (attention's Q, K and V; one matrix is a group of one), each with an optional bias added to
// its finished sums as add_bias adds it (one rounding), so that a layer's Q, K and V with their
// biases are one kernel instead of six.
// grid = (row blocks of all the matrices, ceil(n / DP4A_TOKENS)), block = ROW_WARPS * 32.

// Rows per warp of the Q8_0 and MXFP4 kernels, tokens per block of both, and blocks of a row
// whose weights a lane loads at once (the rest of a row one block at a time).
#define DP4A_Q8_0_ROWS 4
#define DP4A_MXFP4_ROWS 8
#define DP4A_TOKENS 8
#define DP4A_CHUNK 8

// s as a float, exactly as (float)s for |s| < 2^22: 1.5 * 2^23 + s is exact in the mantissa.
__device__ __forceinline__ float int_to_float_exact(int s) {
    return __int_as_float(s + 0x4B400000) - 12582912.0f;
}

// Two bytes at an even address, as the low half of a word.
__device__ __forceinline__ u32 load_u16_even(const u8* p) { return *(const u16*)p; }

// Four int8 at an even address as one little-endian word (for __dp4a).
__device__ __forceinline__ int load_i8x4_even(const u8* p) {
    return (int)(load_u16_even(p) | (load_u16_even(p + 2) << 16));
}

// Four int8 at any address as one little-endian word.
__device__ __forceinline__ int load_i8x4_bytes(const u8* p) {
    return (int)((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

// The f16 scale of a Q8_0 block (at an even address).
__device__ __forceinline__ float q8_scale_even(const u8* b) { return h2f((u16)load_u16_even(b)); }

// The MXFP4 table values (int8) of the eight nibbles of q: `lo` those of the low nibbles of
// bytes 0..3, `hi` those of the high nibbles.
struct mxfp4_i8x4_pair {
    int lo, hi;
};

// Each nibble indexes the 16 table bytes: its low three bits pick a byte of the positive half
// (0x0C080604'03020100) and of the negative half (0xF4F8FAFC'FDFEFF00) by __byte_perm, and its
// bit 3 picks the half. Selectors never set bit 3 of a selector nibble.
__device__ __forceinline__ mxfp4_i8x4_pair mxfp4_lut_i8x4(u32 q) {
    const u32 pos_lo = 0x03020100u, pos_hi = 0x0C080604u;
    const u32 neg_lo = 0xFDFEFF00u, neg_hi = 0xF4F8FAFCu;
    u32 mag = q & 0x77777777u;
    u32 half = (q >> 1) & 0x44444444u;
    // Bytes 0..3: the values of nibbles lo0, hi0, lo1, hi1; then lo2, hi2, lo3, hi3.
    u32 v01 = __byte_perm(__byte_perm(pos_lo, pos_hi, mag), __byte_perm(neg_lo, neg_hi, mag),
                          0x3210u | (half & 0xFFFFu));
    u32 v23 = __byte_perm(__byte_perm(pos_lo, pos_hi, mag >> 16),
                          __byte_perm(neg_lo, neg_hi, mag >> 16), 0x3210u | (half >> 16));
    mxfp4_i8x4_pair r;
    r.lo = (int)__byte_perm(v01, v23, 0x6420u);
    r.hi = (int)__byte_perm(v01, v23, 0x7531u);
    return r;
}

// Blocks b0 .. b0 + U - 1 of a Q8_0 row (wr) times NT tokens (xr, xs bytes apart) into lane
// k's accumulators: the U blocks' weight words and scales are loaded first, all in flight at
// once, then the products follow in block order.
template <int NT, int U>
__device__ __forceinline__ void dp4a_q8_0_blocks(const u8* wr, const u8* xr, u64 xs, int k,
                                                 int b0, float* acc) {
    float dw[U];
    int qw[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const u8* wb = wr + (u64)(b0 + u) * 34u;
        dw[u] = q8_scale_even(wb);
        qw[u] = load_i8x4_even(wb + 2 + 4 * k);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const u8* ab = xr + (u64)t * xs + (u64)(b0 + u) * 34u;
            int s = __dp4a(qw[u], load_i8x4_even(ab + 2 + 4 * k), 0);
            acc[t] = fmaf(dw[u] * q8_scale_even(ab), int_to_float_exact(s), acc[t]);
        }
    }
}

// Blocks b0 .. b0 + U - 1 of an MXFP4 row (wr) times NT tokens into the row's chains, lane l
// taking nibble bytes 4l..4l+3: the U blocks' exponents and weight words are loaded first,
// then the products follow in block order. Every lane of the warp must call it (it shuffles).
template <int NT, int U>
__device__ __forceinline__ void dp4a_mxfp4_blocks(const u8* wr, const u8* xr, u64 xs, int l,
                                                  int b0, float* acc) {
    u32 we[U], wq[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const u8* wb = wr + (u64)(b0 + u) * 17u;
        we[u] = wb[0];
        wq[u] = (u32)load_i8x4_bytes(wb + 1 + 4 * l);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        float scale_w = e8m0_half(we[u]);
        mxfp4_i8x4_pair v = mxfp4_lut_i8x4(wq[u]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const u8* ab = xr + (u64)t * xs + (u64)(b0 + u) * 34u;
            int isum = __dp4a(v.lo, load_i8x4_even(ab + 2 + 4 * l), 0);
            isum = __dp4a(v.hi, load_i8x4_even(ab + 18 + 4 * l), isum);
            isum += __shfl_xor_sync(0xffffffffu, isum, 1);
            isum += __shfl_xor_sync(0xffffffffu, isum, 2);
            acc[t] = fmaf(int_to_float_exact(isum), scale_w * q8_scale_even(ab), acc[t]);
        }
    }
}

// The nb blocks of one row's chains from wr (TY weights) times NT tokens from xr (Q8_0 rows xs
// bytes apart), added into acc: DP4A_CHUNK blocks at a time, then the rest one by one. part:
// the lane's part of the row (Q8_0: accumulator k of 8; MXFP4: nibble bytes 4l..4l+3 of 4).
// Every lane of the warp must call it (the MXFP4 blocks shuffle).
template <int TY, int NT>
__device__ __forceinline__ void dp4a_chains(const u8* wr, const u8* xr, u64 xs, int part, int nb,
                                            float* acc) {
    int b = 0;
    for (; b + DP4A_CHUNK <= nb; b += DP4A_CHUNK) {
        if (TY == TY_MXFP4) {
            dp4a_mxfp4_blocks<NT, DP4A_CHUNK>(wr, xr, xs, part, b, acc);
        } else {
            dp4a_q8_0_blocks<NT, DP4A_CHUNK>(wr, xr, xs, part, b, acc);
        }
    }
    for (; b < nb; b++) {
        if (TY == TY_MXFP4) {
            dp4a_mxfp4_blocks<NT, 1>(wr, xr, xs, part, b, acc);
        } else {
            dp4a_q8_0_blocks<NT, 1>(wr, xr, xs, part, b, acc);
        }
    }
}

// A Q8_0 row's sum from the accumulators of its 8 lanes (lane k holding a_k), in hsum8's
// order ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)); every lane of the 8 gets it.
__device__ __forceinline__ float dp4a_q8_0_fold(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);  // a_k + a_(k+4)
    v += __shfl_xor_sync(0xffffffffu, v, 2);  // (a0 + a4) + (a2 + a6), (a1 + a5) + (a3 + a7)
    return v + __shfl_xor_sync(0xffffffffu, v, 1);
}

// Row r of an NT-token product of TY weights (Q8_0: 8 lanes per row, DP4A_Q8_0_ROWS rows per
// warp; MXFP4: 4 lanes, DP4A_MXFP4_ROWS; the rows of the matrix's row block bx) through all nb
// blocks into acc (dp4a_chains); returns r. Lanes past the last row compute row 0. Every lane
// of the warp must call it (the MXFP4 blocks shuffle).
template <int TY, int NT>
__device__ __forceinline__ int dp4a_row_tokens(const u8* w, u64 row_bytes, const u8* x, int rows,
                                               int nb, int t0, int bx, float* acc) {
    const int LANES = TY == TY_MXFP4 ? 4 : 8;
    const int RPW = TY == TY_MXFP4 ? DP4A_MXFP4_ROWS : DP4A_Q8_0_ROWS;
    int lane = threadIdx.x % WARP;
    int r = (bx * ROW_WARPS + threadIdx.x / WARP) * RPW + lane / LANES;
    const u8* wr = w + (u64)(r < rows ? r : 0) * row_bytes;
    u64 xs = (u64)nb * 34u;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    dp4a_chains<TY, NT>(wr, x + (u64)t0 * xs, xs, lane % LANES, nb, acc);
    return r;
}

// NT tokens from t0 of a Q8_0 product (see the top), row block bx: lane k of each 8-lane
// group owns accumulator k of one row and token; bias (when not null) added to each sum.
template <int NT>
__device__ void dp4a_q8_0_tokens(const u8* w, u64 row_bytes, const u8* x, float* y,
                                 const float* bias, int rows, int nb, int t0, int bx) {
    float acc[NT];
    int r = dp4a_row_tokens<TY_Q8_0, NT>(w, row_bytes, x, rows, nb, t0, bx, acc);
    int k = threadIdx.x % 8;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = dp4a_q8_0_fold(acc[t]);
        if (bias != nullptr && r < rows) v += bias[r];
        if (k == 0 && r < rows) y[(u64)(t0 + t) * rows + r] = v;
    }
}

// NT tokens from t0 of an MXFP4 product (see the top), row block bx: lane l of each 4-lane
// group takes nibble bytes 4l..4l+3 of one row's blocks; bias (when not null) added to each sum.
template <int NT>
__device__ void dp4a_mxfp4_tokens(const u8* w, u64 row_bytes, const u8* x, float* y,
                                  const float* bias, int rows, int nb, int t0, int bx) {
    float acc[NT];
    int r = dp4a_row_tokens<TY_MXFP4, NT>(w, row_bytes, x, rows, nb, t0, bx, acc);
    if (threadIdx.x % 4 != 0 || r >= rows) return;
#pragma unroll
    for (int t = 0; t < NT; t++) y[(u64)(t0 + t) * rows + r] = bias != nullptr ? acc[t] + bias[r] : acc[t];
}

// Calls F<nt>(args...) for nt in 1..DP4A_TOKENS.
#define DP4A_BY_TOKENS(F, nt, ...)   \
    switch (nt) {                    \
    case 1: F<1>(__VA_ARGS__); break; \
    case 2: F<2>(__VA_ARGS__); break; \
    case 3: F<3>(__VA_ARGS__); break; \
    case 4: F<4>(__VA_ARGS__); break; \
    case 5: F<5>(__VA_ARGS__); break; \
    case 6: F<6>(__VA_ARGS__); break; \
    case 7: F<7>(__VA_ARGS__); break; \
    default: F<8>(__VA_ARGS__); break; \
    }

// One matrix of a group launch: its weights, rows, output and bias (null for none), and the
// end of its row blocks in grid.x (the previous matrix's end is its start).
#define DP4A_GROUP_PARAMS(i) const u8 *w##i, u64 rb##i, float *y##i, const float *b##i, int rows##i, int end##i

// The matrix of group member i's block bx (made relative to the member's first block).
#define DP4A_GROUP_PICK(i, prev_end)                                 \
    if (bx < end##i) {                                                 \
        w = w##i, rb = rb##i, y = y##i, b = b##i, rows = rows##i;      \
        bx -= prev_end;                                                \
    } else

// ys_i[t][r] = W_i[r] . x[t] (+ b_i[r]) for up to three TY (Q8_0 or MXFP4) matrices of cols
// columns and n tokens of Q8_0 activations (quantize_q8_0); members past the group's size have
// no blocks (their end equals the last one's) and are never read.
// grid = (end2, ceil(n / DP4A_TOKENS)), block = ROW_WARPS * 32.
template <int TY>
__device__ void dp4a_group(const u8* x, int cols, int n, DP4A_GROUP_PARAMS(0), DP4A_GROUP_PARAMS(1),
                           DP4A_GROUP_PARAMS(2)) {
    int bx = blockIdx.x;
    const u8* w;
    u64 rb;
    float* y;
    const float* b;
    int rows;
    DP4A_GROUP_PICK(0, 0) DP4A_GROUP_PICK(1, end0) DP4A_GROUP_PICK(2, end1) return;
    int t0 = blockIdx.y * DP4A_TOKENS;
    int nt = n - t0 < DP4A_TOKENS ? n - t0 : DP4A_TOKENS;
    if (TY == TY_MXFP4) {
        DP4A_BY_TOKENS(dp4a_mxfp4_tokens, nt, w, rb, x, y, b, rows, cols / 32, t0, bx)
    } else {
        DP4A_BY_TOKENS(dp4a_q8_0_tokens, nt, w, rb, x, y, b, rows, cols / 32, t0, bx)
    }
}

// The group product of Q8_0 weights (dp4a_group); row blocks of ROW_WARPS * DP4A_Q8_0_ROWS rows.
extern "C" __global__ void matmul_dp4a_q8_0(const u8* x, int cols, int n, DP4A_GROUP_PARAMS(0),
                                            DP4A_GROUP_PARAMS(1), DP4A_GROUP_PARAMS(2)) {
    dp4a_group<TY_Q8_0>(x, cols, n, w0, rb0, y0, b0, rows0, end0, w1, rb1, y1, b1, rows1, end1,
                        w2, rb2, y2, b2, rows2, end2);
}

// The group product of MXFP4 weights (dp4a_group); row blocks of ROW_WARPS * DP4A_MXFP4_ROWS
// rows.
extern "C" __global__ void matmul_dp4a_mxfp4(const u8* x, int cols, int n, DP4A_GROUP_PARAMS(0),
                                             DP4A_GROUP_PARAMS(1), DP4A_GROUP_PARAMS(2)) {
    dp4a_group<TY_MXFP4>(x, cols, n, w0, rb0, y0, b0, rows0, end0, w1, rb1, y1, b1, rows1, end1,
                         w2, rb2, y2, b2, rows2, end2);
}
