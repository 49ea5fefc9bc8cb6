// ---------------------------------------------------------------------------------------------
// Tiled products for large batches of Q8_0 or MXFP4 weights: each block multiplies TILE_ROWS
// weight rows by up to TILE_SLOTS activation rows at a time, both staged in shared memory as
// int8 (MXFP4 decoded), so a weight row is read once per tile instead of once per token. Each
// output keeps the row-per-warp kernels' float chain (warp_dot_q8_0 / warp_dot_mxfp4): block
// by block in order with exact integer block sums, so the bits do not depend on the tiling.
// Dense matmuls tile the tokens (matmul_tiled_*); the MoE block groups the expert slots by
// expert first (moe_group) and tiles each expert's slots (moe_mm_*), then moe_swiglu and
// moe_down_bias finish what moe_gate_up_* and moe_down_* do after their products.

// offsets[e] .. offsets[e + 1]: where expert e's slots sit in `order` (ids outside
// 0 .. n_expert are left out). One block; n_expert <= MOE_MAX_EXPERTS.
extern "C" __global__ void moe_group(const int* sel, int n_slots, int n_expert, int* offsets,
                                     int* order) {
    __shared__ int count[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        int e = sel[s];
        if (e >= 0 && e < n_expert) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int start = 0;
        for (int e = 0; e < n_expert; e++) {
            int c = count[e];
            offsets[e] = start;
            count[e] = start;
            start += c;
        }
        offsets[n_expert] = start;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
        int e = sel[s];
        if (e >= 0 && e < n_expert) order[atomicAdd(&count[e], 1)] = s;
    }
}

// Four int8 values as one int (little-endian), for __dp4a.
__device__ __forceinline__ int pack_i8x4(int a, int b, int c, int d) {
    return (int)(((u32)(u8)a) | ((u32)(u8)b << 8) | ((u32)(u8)c << 16) | ((u32)(u8)d << 24));
}

// Stages weight block kb of row `wrow` (TY: Q8_0 or MXFP4) as 8 ints of int8 values 0..31
// and its scale (the f16 d, or 2^(e-128)).
template <int TY>
__device__ __forceinline__ void stage_weight_block(const u8* wrow, int kb, int* dst, float* scale) {
    if (TY == TY_MXFP4) {
        const u8* wb = wrow + (u64)kb * 17u;
        *scale = e8m0_half(wb[0]);
        // Low nibbles are values 0..15 of the block, high nibbles 16..31.
        for (int j = 0; j < 4; j++) {
            const u8* q = wb + 1 + 4 * j;
            dst[j] = pack_i8x4(mxfp4_int(q[0] & 15u), mxfp4_int(q[1] & 15u),
                               mxfp4_int(q[2] & 15u), mxfp4_int(q[3] & 15u));
            dst[4 + j] = pack_i8x4(mxfp4_int(q[0] >> 4), mxfp4_int(q[1] >> 4),
                                   mxfp4_int(q[2] >> 4), mxfp4_int(q[3] >> 4));
        }
    } else {
        const u8* wb = wrow + (u64)kb * 34u;
        *scale = q8_scale(wb);
        for (int j = 0; j < 8; j++) {
            const u8* q = wb + 2 + 4 * j;
            dst[j] = pack_i8x4(q[0], q[1], q[2], q[3]);
        }
    }
}

// Stages the Q8_0 activation block at ab as 8 ints of int8 values 0..31 and its scale.
__device__ __forceinline__ void stage_act_block(const u8* ab, int* dst, float* scale) {
    *scale = q8_scale(ab);
    for (int j = 0; j < 8; j++) {
        const u8* q = ab + 2 + 4 * j;
        dst[j] = pack_i8x4(q[0], q[1], q[2], q[3]);
    }
}

// Decodes a k-tile of kbn <= KB quant blocks into the int8 tiles of a tiled product (the
// block's threads together): weight row r's blocks from wrow(r) (TY: Q8_0 or MXFP4; null for a
// row past the matrix) into ws[r] and wsc[r], slot s's Q8_0 activation blocks from xrow(s)
// (null for no slot) into xs[s] and xsc[s]; zeros for the rest.
template <int TY, int ROWS, int KB, int WST, int XST, class WRow, class XRow>
__device__ __forceinline__ void stage_k_tile(int (*ws)[WST], float (*wsc)[KB], int (*xs)[XST],
                                             float (*xsc)[KB], int kbn, WRow wrow, XRow xrow) {
    for (int i = threadIdx.x; i < ROWS * KB; i += blockDim.x) {
        int r = i / KB, b = i % KB;
        int* dst = &ws[r][8 * b];
        const u8* row = b < kbn ? wrow(r) : nullptr;
        if (row) {
            stage_weight_block<TY>(row, b, dst, &wsc[r][b]);
        } else {
            wsc[r][b] = 0.f;
            for (int j = 0; j < 8; j++) dst[j] = 0;
        }
    }
    for (int i = threadIdx.x; i < TILE_SLOTS * KB; i += blockDim.x) {
        int s = i / KB, b = i % KB;
        int* dst = &xs[s][8 * b];
        const u8* row = b < kbn ? xrow(s) : nullptr;
        if (row) {
            stage_act_block(row + 34 * b, dst, &xsc[s][b]);
        } else {
            xsc[s][b] = 0.f;
            for (int j = 0; j < 8; j++) dst[j] = 0;
        }
    }
}

// out[slot][r] = w[r] . act[slot / act_div] for the slots order[beg .. end] (or beg .. end
// themselves when order is null) and the TILE_ROWS rows from blockIdx.x * TILE_ROWS; w: rows
// of nb blocks of TY, act: rows of nb Q8_0 blocks. block = 256: thread t owns row
// t % TILE_ROWS of the tile and slots 8 * (t / TILE_ROWS) .. + 7 of each tile of slots.
template <int TY>
__device__ void tiled_impl(const u8* w, u64 row_bytes, int rows, int nb, const u8* act,
                           int act_div, int beg, int end, const int* order, float* out) {
    // Row stride of 8 * TILE_KB + 4 ints: the 16-byte loads of 8 threads in a row land in
    // distinct banks.
    __shared__ int ws[TILE_ROWS][8 * TILE_KB + 4];
    __shared__ float wsc[TILE_ROWS][TILE_KB];
    __shared__ int xs[TILE_SLOTS][8 * TILE_KB];
    __shared__ float xsc[TILE_SLOTS][TILE_KB];
    __shared__ int slot_of[TILE_SLOTS];
    int r0 = blockIdx.x * TILE_ROWS;
    int tid = threadIdx.x;
    int my_row = tid % TILE_ROWS;
    int my_slots = 8 * (tid / TILE_ROWS);
    // MXFP4 keeps one accumulator per output, Q8_0 eight (ggml's vec_dot order).
    const int n_acc = TY == TY_MXFP4 ? 1 : 8;
    for (int t0 = beg; t0 < end; t0 += TILE_SLOTS) {
        int nt = end - t0 < TILE_SLOTS ? end - t0 : TILE_SLOTS;
        __syncthreads();  // the previous tile's stores have read slot_of
        if (tid < TILE_SLOTS) slot_of[tid] = tid >= nt ? -1 : order ? order[t0 + tid] : t0 + tid;
        float acc[8][8];
        for (int i = 0; i < 8; i++)
            for (int k = 0; k < n_acc; k++) acc[i][k] = 0.f;
        for (int kb0 = 0; kb0 < nb; kb0 += TILE_KB) {
            int kbn = nb - kb0 < TILE_KB ? nb - kb0 : TILE_KB;
            __syncthreads();  // slot_of is set; the previous chunk has been used
            const int WB = TY == TY_MXFP4 ? 17 : 34;
            stage_k_tile<TY, TILE_ROWS, TILE_KB, 8 * TILE_KB + 4, 8 * TILE_KB>(
                ws, wsc, xs, xsc, kbn,
                [&](int r) -> const u8* {
                    if (r0 + r >= rows) return nullptr;
                    return w + (u64)(r0 + r) * row_bytes + (u64)kb0 * WB;
                },
                [&](int s) -> const u8* {
                    int slot = slot_of[s];
                    if (slot < 0) return nullptr;
                    return act + ((u64)(slot / act_div) * (u64)nb + (u64)kb0) * 34u;
                });
            __syncthreads();
            for (int b = 0; b < kbn; b++) {
                int wv[8];
                for (int j = 0; j < 8; j++) wv[j] = ws[my_row][8 * b + j];
                float wscale = wsc[my_row][b];
                for (int i = 0; i < 8; i++) {
                    const int* xv = &xs[my_slots + i][8 * b];
                    float d = wscale * xsc[my_slots + i][b];
                    if (TY == TY_MXFP4) {
                        int isum = 0;
                        for (int j = 0; j < 8; j++) isum = __dp4a(wv[j], xv[j], isum);
                        acc[i][0] = fmaf((float)isum, d, acc[i][0]);
                    } else {
                        for (int k = 0; k < 8; k++) {
                            acc[i][k] = fmaf(d, (float)__dp4a(wv[k], xv[k], 0), acc[i][k]);
                        }
                    }
                }
            }
        }
        if (r0 + my_row < rows) {
            for (int i = 0; i < 8; i++) {
                int s = my_slots + i;
                if (s >= nt) continue;
                float v = acc[i][0];
                if (TY == TY_Q8_0) {
                    v = ((acc[i][0] + acc[i][4]) + (acc[i][2] + acc[i][6])) +
                        ((acc[i][1] + acc[i][5]) + (acc[i][3] + acc[i][7]));
                }
                out[(u64)slot_of[s] * (u64)rows + (u64)(r0 + my_row)] = v;
            }
        }
    }
}

// y[t][r] = W[r] . x[t] (x: n rows of Q8_0 blocks). grid = (ceil(rows / TILE_ROWS),
// ceil(n / TILE_SLOTS)), block = 256.
#define MATMUL_TILED(SUFFIX, TY)                                                                \
    extern "C" __global__ void matmul_tiled_##SUFFIX(const u8* w, u64 row_bytes, int rows,     \
                                                     int nb, const u8* xq, int n, float* y) {  \
        int beg = blockIdx.y * TILE_SLOTS;                                                      \
        int end = n - beg < TILE_SLOTS ? n : beg + TILE_SLOTS;                                  \
        tiled_impl<TY>(w, row_bytes, rows, nb, xq, 1, beg, end, nullptr, y);                    \
    }

// out[slot][r] = w_e[r] . act[slot / act_div] for every slot of every expert e (grouped by
// moe_group); w: [n_expert][rows] rows of nb blocks. grid = (ceil(rows / TILE_ROWS), n_expert),
// block = 256.
#define MOE_MM(SUFFIX, TY)                                                                      \
    extern "C" __global__ void moe_mm_##SUFFIX(const u8* w, u64 row_bytes, int rows, int nb,   \
                                               const u8* act, int act_div, const int* offsets,  \
                                               const int* order, float* out) {                  \
        int e = blockIdx.y;                                                                     \
        tiled_impl<TY>(w + (u64)e * (u64)rows * row_bytes, row_bytes, rows, nb, act, act_div,   \
                       offsets[e], offsets[e + 1], order, out);                                 \
    }

MATMUL_TILED(q8_0, TY_Q8_0)
MATMUL_TILED(mxfp4, TY_MXFP4)
MOE_MM(q8_0, TY_Q8_0)
MOE_MM(mxfp4, TY_MXFP4)

// h[s][r] = gated_act(act, g[s][r] + bg[e][r], u[s][r] + bu[e][r]) for slot s of expert e = sel[s];
// 0 where e is out of range. One thread per element.
extern "C" __global__ void moe_swiglu(const float* g, const float* u, const float* bg,
                                      const float* bu, int has_bias, const int* sel, float* h,
                                      int n_slots, int n_expert, int ff, int act) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_slots * ff) return;
    u64 s = i / (u64)ff, r = i % (u64)ff;
    int e = sel[s];
    if (e < 0 || e >= n_expert) {
        h[i] = 0.f;
        return;
    }
    float gv = g[i], uv = u[i];
    if (has_bias) {
        gv += bg[(u64)e * ff + r];
        uv += bu[(u64)e * ff + r];
    }
    h[i] = gated_act(act, gv, uv, (int)r, ff);
}

// y[s][c] += bd[e][c] for slot s of expert e = sel[s]; 0 where e is out of range.
extern "C" __global__ void moe_down_bias(float* y, const float* bd, int has_bias, const int* sel,
                                         int n_slots, int n_expert, int d) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_slots * d) return;
    u64 s = i / (u64)d, c = i % (u64)d;
    int e = sel[s];
    if (e < 0 || e >= n_expert) {
        y[i] = 0.f;
    } else if (has_bias) {
        y[i] += bd[(u64)e * d + c];
    }
}

// out[t][c] = sum_j w[t][j] * y[t*k+j][c], slots in order. One thread per output element.
extern "C" __global__ void moe_combine(const float* y, const float* w, float* out, int n, int k,
                                       int d) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * d) return;
    u64 t = i / (u64)d, c = i % (u64)d;
    float acc = 0.f;
    for (int j = 0; j < k; j++) {
        acc += y[(t * k + j) * d + c] * w[t * k + j];
    }
    out[i] = acc;
}

