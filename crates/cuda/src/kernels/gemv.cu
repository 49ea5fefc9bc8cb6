// ---------------------------------------------------------------------------------------------
// Dot products of one weight row with one activation row, computed by a whole warp: every
// lane returns the same value, and every lane of the warp must call them (they shuffle).
// The integer work of 32 blocks runs on the 32 lanes at once; then every lane replays the CPU
// device's float chain over those blocks in order with the shuffled block results.

// Q8_0 x Q8_0 in ggml's vec_dot order (hmoe_quant's dot_q8_0): eight accumulators; for each
// block in order d = d_w * d_a, and accumulator k takes fma(d, s_k, acc_k), s_k the integer
// sum of elements 4k..4k+3; then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)). (ggml
// forms each product as |w| * sign(a, w), which differs from w * a only for an activation of
// -128, which the quantizer gives only for NaN.) w: nb Q8_0 blocks; a: nb Q8_0 blocks.
__device__ float warp_dot_q8_0(const u8* w, const u8* a, int nb) {
    int lane = threadIdx.x % WARP;
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += WARP) {
        int b = b0 + lane;
        int s[8];
        float d = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) s[k] = 0;
        if (b < nb) {
            const u8* wb = w + (u64)b * 34u;
            const u8* ab = a + (u64)b * 34u;
            d = q8_scale(wb) * q8_scale(ab);
#pragma unroll
            for (int k = 0; k < 8; k++) {
#pragma unroll
                for (int j = 4 * k; j < 4 * k + 4; j++) {
                    s[k] += (int)(signed char)wb[2 + j] * (int)(signed char)ab[2 + j];
                }
            }
        }
        int m = nb - b0 < WARP ? nb - b0 : WARP;
        for (int j = 0; j < m; j++) {
            float dj = __shfl_sync(0xffffffffu, d, j);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                acc[k] = fmaf(dj, (float)__shfl_sync(0xffffffffu, s[k], j), acc[k]);
            }
        }
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// MXFP4 x Q8_0 in llama.cpp's block-wise order (hmoe_quant's GEMM order, which the CPU device
// uses for every MXFP4 product): for each block in order acc = fma(isum, 2^(e-128) * d_a,
// acc), isum the exact integer sum of the table values times the activation's int8.
// w: nb MXFP4 blocks; a: nb Q8_0 blocks.
__device__ float warp_dot_mxfp4(const u8* w, const u8* a, int nb) {
    int lane = threadIdx.x % WARP;
    float acc = 0.f;
    for (int b0 = 0; b0 < nb; b0 += WARP) {
        int b = b0 + lane;
        int isum = 0;
        float scale = 0.f;
        if (b < nb) {
            const u8* wb = w + (u64)b * 17u;
            const u8* ab = a + (u64)b * 34u;
            scale = e8m0_half(wb[0]) * q8_scale(ab);
            for (int j = 0; j < 16; j++) {
                u32 q = wb[1 + j];
                isum += mxfp4_int(q & 15u) * (int)(signed char)ab[2 + j];
                isum += mxfp4_int(q >> 4) * (int)(signed char)ab[18 + j];
            }
        }
        int m = nb - b0 < WARP ? nb - b0 : WARP;
        for (int j = 0; j < m; j++) {
            float sj = (float)__shfl_sync(0xffffffffu, isum, j);
            acc = fmaf(sj, __shfl_sync(0xffffffffu, scale, j), acc);
        }
    }
    return acc;
}

// F32 x F32 in ggml's vec_dot_f32 order (hmoe_quant's dot_f32): four 16-lane FMA accumulators
// over 64-element steps (element 64i + 16j + l into accumulator j, lane l), folded per lane as
// (s0 + s2) + (s1 + s3), summed by halving, then the last n % 64 elements fused in one by one.
// Half-warp h keeps accumulators h and h + 2 of lane l.
__device__ float warp_dot_f32_vec(const float* w, const float* x, int n) {
    int lane = threadIdx.x % WARP;
    int l = lane & 15, h = lane >> 4;
    int np = n & ~63;
    float lo = 0.f, hi = 0.f;
    for (int base = 0; base < np; base += 64) {
        int i = base + 16 * h + l;
        lo = fmaf(w[i], x[i], lo);
        hi = fmaf(w[i + 32], x[i + 32], hi);
    }
    float v = lo + hi;                                // s_h + s_{h+2}
    v += __shfl_xor_sync(0xffffffffu, v, 16);         // (s0 + s2) + (s1 + s3)
    v = half_warp_sum16(v);
    for (int i = np; i < n; i++) v = fmaf(w[i], x[i], v);
    return v;
}

// F32 x F32 in tinyBLAS's order (hmoe_quant's f32_lanes, the CPU's order for batches):
// element i fused into lane i % 16, then summed by halving. Both half-warps compute it.
__device__ float warp_dot_f32_lanes(const float* w, const float* x, int n) {
    int l = threadIdx.x % 16;
    float acc = 0.f;
    for (int i = l; i < n; i += 16) acc = fmaf(w[i], x[i], acc);
    return half_warp_sum16(acc);
}

// F16 or BF16 weights: the activation rounded to the weight's type (as ggml converts it), exact
// products summed in lane order (not the CPU's order).
template <int TY>
__device__ float warp_dot_rounded(const u8* w, const float* x, int n) {
    float acc = 0.f;
    for (int e = threadIdx.x % WARP; e < n; e += WARP) {
        float xv = TY == TY_F16 ? h2f(f2h(x[e])) : bf2f(f2bf(x[e]));
        acc = fmaf(load_w<TY>(w, e), xv, acc);
    }
    return warp_sum(acc);
}

// Where activation row i of n elements starts: Q8_0 blocks for Q8_0 and MXFP4 weights (from
// quantize_q8_0), f32 values otherwise.
template <int TY>
__device__ __forceinline__ const void* act_row(const void* act, u64 i, int n) {
    if (TY == TY_Q8_0 || TY == TY_MXFP4) return (const u8*)act + i * (u64)(n / 32) * 34u;
    return (const float*)act + i * (u64)n;
}

// Weight row (type TY, n elements) times an activation row from act_row. F32 sums in vec_dot
// order when `vec_order`, else in 16 lanes. Every lane returns it; every lane must call it.
template <int TY>
__device__ float warp_dot(const u8* row, const void* act, int n, bool vec_order) {
    if (TY == TY_Q8_0) return warp_dot_q8_0(row, (const u8*)act, n / 32);
    if (TY == TY_MXFP4) return warp_dot_mxfp4(row, (const u8*)act, n / 32);
    if (TY == TY_F32) {
        return vec_order ? warp_dot_f32_vec((const float*)row, (const float*)act, n)
                         : warp_dot_f32_lanes((const float*)row, (const float*)act, n);
    }
    return warp_dot_rounded<TY>(row, (const float*)act, n);
}

// ---------------------------------------------------------------------------------------------
// Matmul: y[t][r] = W[r] . x[t] (+ bias[r] when bias is not null, added to the finished sum
// as add_bias adds it) for weights of type TY. x: for Q8_0 and MXFP4 weights the
// activations as Q8_0 blocks (quantize_q8_0), else f32. F32 weights sum one token in vec_dot
// order and several in 16 lanes, as the CPU device does. One warp per output row, up to
// MM_TOKENS tokens per block (grid.y covers the rest).
// grid = (ceil(rows / ROW_WARPS), ceil(n / MM_TOKENS)), block = ROW_WARPS * 32.

template <int TY>
__device__ void matmul_impl(const u8* w, u64 row_bytes, const void* x, float* y,
                            const float* bias, int rows, int cols, int n) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;
    int t0 = blockIdx.y * MM_TOKENS;
    int nt = n - t0 < MM_TOKENS ? n - t0 : MM_TOKENS;
    const u8* row = w + (u64)r * row_bytes;
    for (int i = 0; i < nt; i++) {
        u64 t = (u64)(t0 + i);
        float s = warp_dot<TY>(row, act_row<TY>(x, t, cols), cols, n == 1);
        if (threadIdx.x % WARP == 0) y[t * rows + r] = bias != nullptr ? s + bias[r] : s;
    }
}

// The GEMV entry points of F32/F16/BF16 weights (X: f32 activations). Q8_0 and MXFP4 weights
// have their own GEMV kernels (gemv_dp4a.cu); matmul_impl's Q8_0/MXFP4 paths serve the
// per-head products.
#define MATMUL(SUFFIX, TY, X)                                                                   \
    extern "C" __global__ void matmul_##SUFFIX(const u8* w, u64 row_bytes, const X* x, float* y, \
                                               const float* bias, int rows, int cols, int n) {  \
        matmul_impl<TY>(w, row_bytes, x, y, bias, rows, cols, n);                               \
    }
MATMUL(f32, TY_F32, float)
MATMUL(f16, TY_F16, float)
MATMUL(bf16, TY_BF16, float)

