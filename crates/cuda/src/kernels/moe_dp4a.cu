// ---------------------------------------------------------------------------------------------
// The MoE block of a few tokens with Q8_0 or MXFP4 experts (decode) in two launches, with the
// bits of the CPU device (see "MoE experts" in moe.cu for the block's formula):
//
// moe_dp4a_gate_up_*: a block per 32 rows of ff and slot s = t * k + j (expert e = sel[s]).
// The block quantizes token t's row of x into shared memory (quantize_block_q8_0, the bytes
// quantize_q8_0 gives; MOE_X_BLOCKS blocks of 32 at a time), takes the gate and up products of
// its 32 rows on the dp4a chains of gemv_dp4a.cu (one lane per CPU accumulator: Q8_0 8 lanes
// per row, MXFP4 4), adds the biases, applies gated_act, and quantizes the 32 values of h into
// the slot's Q8_0 block (again quantize_block_q8_0: the bytes quantize_q8_0 gives for h rows of
// whole blocks, ff being a multiple of 32). A slot whose expert id is out of range writes
// nothing (moe_dp4a_down never reads it).
// grid = (ff / MOE_H_ROWS, n_slots), block = MOE_H_ROWS * (8 for Q8_0, 4 for MXFP4) threads.
//
// moe_dp4a_down_*: a block per DP4A_*_ROWS rows of d (the rows of one warp) and token t; warp w
// takes the token's slots j = w, w + ROW_WARPS, ...: y_j = down_e . h_s (+ bd_e) on the dp4a
// chains, then the block's first DP4A_*_ROWS threads (one per row) add the round's slots in
// slot order as REF0 combines them: out[t][r] = sum_j w[t][j] * y_j from 0, each term rounded
// as a product and then added, slots of out-of-range expert ids skipped (moe_combine adds
// their 0 * w, which gives the same bits for finite weights).
// grid = (d / DP4A_*_ROWS, n), block = ROW_WARPS * 32.
//
// Every grid depends on the shapes only: the expert ids are read here (CUDA graphs).

// Blocks of 32 columns of x a block of moe_dp4a_gate_up_* stages in shared memory at a time
// (8,192 columns; wider rows take several rounds).
#define MOE_X_BLOCKS 256
// Rows of ff per block of moe_dp4a_gate_up_*: one Q8_0 block of h.
#define MOE_H_ROWS 32

template <int TY>
__device__ void moe_dp4a_gate_up_impl(const u8* gate, const u8* up, const float* bg,
                                      const float* bu, int has_bias, const float* x,
                                      const int* sel, u8* hq, int n_slots, int k, int n_expert,
                                      int d, int ff, u64 row_bytes, int act) {
    // x's Q8_0 blocks (34 bytes each; words, so every quant word is at an even address).
    __shared__ u32 sm_x[(MOE_X_BLOCKS * 34 + 3) / 4];
    __shared__ float sm_h[MOE_H_ROWS];
    const int LANES = TY == TY_MXFP4 ? 4 : 8;
    const u64 WB = TY == TY_MXFP4 ? 17u : 34u;  // bytes of a weight block
    int slot = blockIdx.y;
    if (slot >= n_slots) return;
    int e = sel[slot];
    if (e < 0 || e >= n_expert) return;
    int i = threadIdx.x / LANES, part = threadIdx.x % LANES;
    int r = blockIdx.x * MOE_H_ROWS + i;
    u64 off = ((u64)e * ff + r) * row_bytes;
    const float* xt = x + (u64)(slot / k) * d;
    u8* xs = (u8*)sm_x;
    int nb = d / 32;
    float g = 0.f, u = 0.f;
    for (int c = 0; c < nb; c += MOE_X_BLOCKS) {
        int m = nb - c < MOE_X_BLOCKS ? nb - c : MOE_X_BLOCKS;
        if (c > 0) __syncthreads();  // every lane is done with the last round's blocks
        for (int b = threadIdx.x; b < m; b += blockDim.x) {
            quantize_block_q8_0(xt + (u64)(c + b) * 32u, xs + b * 34);
        }
        __syncthreads();
        dp4a_chains<TY, 1>(gate + off + (u64)c * WB, xs, 0, part, m, &g);
        dp4a_chains<TY, 1>(up + off + (u64)c * WB, xs, 0, part, m, &u);
    }
    if (TY == TY_Q8_0) {
        g = dp4a_q8_0_fold(g);
        u = dp4a_q8_0_fold(u);
    }
    if (part == 0) {
        if (has_bias) {
            g += bg[(u64)e * ff + r];
            u += bu[(u64)e * ff + r];
        }
        sm_h[i] = gated_act(act, g, u, r, ff);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        quantize_block_q8_0(sm_h, hq + ((u64)slot * (u64)(ff / 32) + blockIdx.x) * 34u);
    }
}

template <int TY>
__device__ void moe_dp4a_down_impl(const u8* down, const float* bd, int has_bias, const u8* hq,
                                   const int* sel, const float* wts, float* out, int n, int k,
                                   int n_expert, int d, int ff, u64 row_bytes) {
    const int LANES = TY == TY_MXFP4 ? 4 : 8;
    const int RPW = TY == TY_MXFP4 ? DP4A_MXFP4_ROWS : DP4A_Q8_0_ROWS;
    // Each warp's y of the round's slot, per row of the block.
    __shared__ float sm_y[ROW_WARPS][DP4A_MXFP4_ROWS];
    int t = blockIdx.y;
    if (t >= n) return;
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int i = lane / LANES, part = lane % LANES;
    int r = blockIdx.x * RPW + i;
    int rw = r < d ? r : 0;  // lanes past the last row compute row 0
    int nb = ff / 32;
    float acc = 0.f;
    for (int j0 = 0; j0 < k; j0 += ROW_WARPS) {
        int j = j0 + warp;
        if (j < k) {
            u64 s = (u64)t * k + j;
            int e = sel[s];
            float y = 0.f;
            if (e >= 0 && e < n_expert) {
                const u8* wr = down + ((u64)e * d + rw) * row_bytes;
                dp4a_chains<TY, 1>(wr, hq + s * (u64)nb * 34u, 0, part, nb, &y);
                if (TY == TY_Q8_0) y = dp4a_q8_0_fold(y);
                if (has_bias) y += bd[(u64)e * d + rw];
            }
            if (part == 0) sm_y[warp][i] = y;
        }
        __syncthreads();
        if (threadIdx.x < RPW) {
            for (int w = 0; w < ROW_WARPS && j0 + w < k; w++) {
                u64 s = (u64)t * k + j0 + w;
                int e = sel[s];
                if (e >= 0 && e < n_expert) acc += sm_y[w][threadIdx.x] * wts[s];
            }
        }
        __syncthreads();  // the sums have read sm_y before the next round writes it
    }
    int ro = blockIdx.x * RPW + threadIdx.x;
    if (threadIdx.x < RPW && ro < d) out[(u64)t * d + ro] = acc;
}

#define MOE_DP4A(SUFFIX, TY)                                                                    \
    extern "C" __global__ void moe_dp4a_gate_up_##SUFFIX(                                      \
        const u8* gate, const u8* up, const float* bg, const float* bu, int has_bias,           \
        const float* x, const int* sel, u8* hq, int n_slots, int k, int n_expert, int d,        \
        int ff, u64 row_bytes, int act) {                                                       \
        moe_dp4a_gate_up_impl<TY>(gate, up, bg, bu, has_bias, x, sel, hq, n_slots, k,           \
                                  n_expert, d, ff, row_bytes, act);                             \
    }                                                                                           \
    extern "C" __global__ void moe_dp4a_down_##SUFFIX(                                         \
        const u8* down, const float* bd, int has_bias, const u8* hq, const int* sel,            \
        const float* wts, float* out, int n, int k, int n_expert, int d, int ff,                \
        u64 row_bytes) {                                                                        \
        moe_dp4a_down_impl<TY>(down, bd, has_bias, hq, sel, wts, out, n, k, n_expert, d, ff,    \
                               row_bytes);                                                      \
    }

MOE_DP4A(q8_0, TY_Q8_0)
MOE_DP4A(mxfp4, TY_MXFP4)
