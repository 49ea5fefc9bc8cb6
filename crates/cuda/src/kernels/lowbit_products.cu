// ---------------------------------------------------------------------------------------------
// Low-bit products (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K weights; Q8_0 too, for expert sets that
// mix it with those): activations quantized as the CPU device quantizes them (quantize_q8_0,
// quantize_q8_1, quantize_q8_k), exact integer sums, and the float chains of the CPU device's
// kernels (hmoe_quant's legacy.rs, kquants.rs, tiled.rs, repack.rs), chosen per product by a
// mode the launch code computes as the CPU device chooses its kernel:
//   LB_VEC:   ggml's vec_dot (AVX2 order): eight lanes, lane l taking elements with
//             (e % 32) / 4 == l of every block (legacy: elements 4l..4l+3 of the 32), each lane
//             fused into its own accumulator with the block's scale product, summed by halving;
//             the min terms (Q4_1/Q5_1 m*s, Q4_K/Q5_K mins) in their own chains, added last
//             (Q2_K adds its mins into the lanes first).
//   LB_TILED: K-quants from TILED_MIN_TOKENS tokens (llama.cpp's tiled matmul): per super-block
//             r = f32(s1) * d_w, r = fma(-dmin_w, f32(s2), r), acc = fma(r, d_a, acc).
//   LB_BLOCK: the repacked Q4_0/Q4_K kernels (row counts that are multiples of 8): one chain
//             per block, acc = fma(isum, d_w * d_a, acc) (Q4_K: and acc_min with the mins).
//   LB_PAIR:  repacked Q4_K in a dense matmul's complete groups of four tokens: both chains
//             advance per pair of sub-blocks.
// Each warp computes the products of one weight row with up to LB_TOKENS activation rows: its
// lanes decode up to 32 legacy blocks (a block per lane) or 4 super-blocks (eight lanes each)
// once and form each token's integer sums into shared memory, then lanes replay each token's
// float chains in block order; the results are valid in lane 0.
#define LB_VEC 0
#define LB_TILED 1
#define LB_BLOCK 2
#define LB_PAIR 3
// Tokens (or expert slots) per warp: the weight row is decoded once for all of them.
#define LB_TOKENS 8

// One block of 32 values as Q8_1, as hmoe_quant's quantize_row(Q8_1) (ggml's x86 quantizer):
// the Q8_0 quantization with d = amax / 127 and s = f16(d * sum), the sum of the int32 values
// before they saturate (a NaN gives INT_MIN there and -128 in the block).
__device__ void quantize_block_q8_1(const float* xb, u8* ob) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    float d = amax / 127.0f;
    float id = amax != 0.f ? 127.0f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        float r = rintf(xb[j] * id);
        int i = (r != r || r >= 2147483648.0f || r < -2147483648.0f) ? (int)0x80000000u : (int)r;
        sum = (int)((u32)sum + (u32)i);
        ob[4 + j] = (u8)(i < -128 ? -128 : i > 127 ? 127 : i);
    }
    u16 dh = f2h(d), sh = f2h(d * (float)sum);
    ob[0] = (u8)(dh & 0xffu);
    ob[1] = (u8)(dh >> 8);
    ob[2] = (u8)(sh & 0xffu);
    ob[3] = (u8)(sh >> 8);
}

extern "C" __global__ void quantize_q8_1(const float* x, u8* out, u64 n_blocks) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    quantize_block_q8_1(x + b * 32u, out + b * 36u);
}

// ggml's nearest_int: add 1.5 * 2^23 and read the low mantissa bits.
__device__ __forceinline__ int nearest_int(float x) {
    float v = x + 12582912.0f;
    return (int)(__float_as_uint(v) & 0x007fffffu) - 0x00400000;
}

// One super-block of 256 values as Q8_K, as hmoe_quant's quantize_row(Q8_K) (ggml's
// quantize_row_q8_K_ref): iscale = -127 / max for the first value of largest magnitude,
// q = min(127, nearest_int(iscale * x)), d = 1 / iscale, sums of 16; all zero for a zero block.
__device__ void quantize_block_q8_k(const float* xb, u8* ob) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 256; j++) {
        float a = fabsf(xb[j]);
        if (a > amax) {
            amax = a;
            max = xb[j];
        }
    }
    if (amax == 0.f) {
        for (int j = 0; j < 292; j++) ob[j] = 0;
        return;
    }
    float iscale = -127.0f / max;
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 16 * g; j < 16 * g + 16; j++) {
            int q = nearest_int(iscale * xb[j]);
            q = q < 127 ? q : 127;
            ob[4 + j] = (u8)q;
            s += (int)(signed char)(u8)q;
        }
        ob[260 + 2 * g] = (u8)((u32)s & 0xffu);
        ob[261 + 2 * g] = (u8)(((u32)s >> 8) & 0xffu);
    }
    u32 d = __float_as_uint(1.0f / iscale);
    for (int j = 0; j < 4; j++) ob[j] = (u8)(d >> (8 * j));
}

extern "C" __global__ void quantize_q8_k(const float* x, u8* out, u64 n_blocks) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    quantize_block_q8_k(x + b * 256u, out + b * 292u);
}

// bsums[i] of a Q8_K block.
__device__ __forceinline__ int q8k_bsum(const u8* a, int i) {
    return (int)(short)(u16)(a[260 + 2 * i] | (a[261 + 2 * i] << 8));
}

// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): the CPU device's hsum8.
__device__ __forceinline__ float hsum8(const float* a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// A legacy (or Q8_0) weight row of nb blocks times the Q8_0/Q8_1 activation rows act[t] of
// nt <= LB_TOKENS tokens, token t in mode[t] (LB_VEC, or LB_BLOCK for repacked Q4_0): res[t]
// in lane 0. Lane j decodes block b0 + j once for every token. Every lane must call it.
template <int TY>
__device__ __forceinline__ void warp_dot_legacy(const u8* w, const u8* const* act, const int* mode,
                                                int nt, int nb, float* res) {
    __shared__ int lsum[ROW_WARPS][LB_TOKENS][32][8];
    __shared__ float lfin[ROW_WARPS][LB_TOKENS][16];
    const bool has_min = TY == TY_Q4_1 || TY == TY_Q5_1;
    const u32 wbytes = (u32)lowbit_block_bytes(TY), abytes = has_min ? 36u : 34u;
    const int aq = has_min ? 4 : 2;
    int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP;
    float acc[LB_TOKENS], acc2[LB_TOKENS];
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) acc[t] = acc2[t] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += WARP) {
        int b = b0 + lane;
        int q[32];
        const u8* wb = w + (u64)b * wbytes;
        for (int j = 0; j < 32; j++) q[j] = b < nb ? legacy_q<TY>(wb, j) : 0;
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t >= nt) continue;
            int s[8];
            for (int k = 0; k < 8; k++) s[k] = 0;
            if (b < nb) {
                const u8* ab = act[t] + (u64)b * abytes;
                for (int j = 0; j < 32; j++) s[j / 4] += q[j] * (int)(signed char)ab[aq + j];
            }
            for (int k = 0; k < 8; k++) lsum[wi][t][lane][k] = s[k];
        }
        __syncwarp();
        int m = nb - b0 < WARP ? nb - b0 : WARP;
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t >= nt) continue;
            for (int j = 0; j < m; j++) {
                const u8* wj = w + (u64)(b0 + j) * wbytes;
                const u8* aj = act[t] + (u64)(b0 + j) * abytes;
                if (mode[t] == LB_VEC) {
                    if (lane < 8) {
                        float d = f16_at(wj, 0) * f16_at(aj, 0);
                        acc[t] = fmaf(d, (float)lsum[wi][t][j][lane], acc[t]);
                    } else if (lane == 8 && has_min) {
                        acc2[t] = fmaf(f16_at(wj, 1), f16_at(aj, 1), acc2[t]);
                    }
                } else if (lane == 0) {
                    int isum = 0;
                    for (int k = 0; k < 8; k++) isum += lsum[wi][t][j][k];
                    acc[t] = fmaf((float)isum, f16_at(wj, 0) * f16_at(aj, 0), acc[t]);
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        if (t < nt && lane < 9) lfin[wi][t][lane] = lane < 8 ? acc[t] : acc2[t];
    }
    __syncwarp();
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        if (t < nt && lane == 0) {
            if (mode[t] != LB_VEC) {
                res[t] = acc[t];
            } else {
                float r = hsum8(lfin[wi][t]);
                res[t] = has_min ? r + lfin[wi][t][8] : r;
            }
        }
    }
    __syncwarp();
}

// The mins of Q4_K/Q5_K sub-blocks 2k and 2k+1 against the activation's sums as vec_dot forms
// them: m[2k] (b[4k] + b[4k+1]) + m[2k+1] (b[4k+2] + b[4k+3]), pair sums in wrapping int16.
__device__ __forceinline__ int k4_min_prod(const u8* wb, const u8* ab, int k) {
    int p = 0;
    for (int h = 0; h < 2; h++) {
        int j = 2 * k + h;
        int pair = (int)(short)(q8k_bsum(ab, 2 * j) + q8k_bsum(ab, 2 * j + 1));
        p += k4_min(wb + 4, j) * pair;
    }
    return p;
}

// The f16 d and dmin of a K-quant super-block (dmin 0 for Q3_K/Q6_K).
template <int TY>
__device__ __forceinline__ float kq_d(const u8* b) {
    return TY == TY_Q2_K ? f16_at(b, 40) : TY == TY_Q3_K ? f16_at(b, 54)
         : TY == TY_Q6_K ? f16_at(b, 104) : f16_at(b, 0);
}
template <int TY>
__device__ __forceinline__ float kq_dmin(const u8* b) {
    return TY == TY_Q2_K ? f16_at(b, 41) : f16_at(b, 1);
}

// s2 of the tiled order: sum over the 16 groups of min * bsum (formats with mins).
template <int TY>
__device__ __forceinline__ int kq_s2(const u8* wb, const u8* ab) {
    int s2 = 0;
    for (int g = 0; g < 16; g++) {
        int m = TY == TY_Q2_K ? (wb[g] >> 4) : k4_min(wb + 4, g / 2);
        s2 += m * q8k_bsum(ab, g);
    }
    return s2;
}

// The exact min sum of Q4_K sub-blocks j0 .. j1 - 1: sum of m_j (bsum_2j + bsum_2j+1).
__device__ __forceinline__ int q4k_imin(const u8* wb, const u8* ab, int j0, int j1) {
    int s = 0;
    for (int j = j0; j < j1; j++) s += k4_min(wb + 4, j) * (q8k_bsum(ab, 2 * j) + q8k_bsum(ab, 2 * j + 1));
    return s;
}

// A K-quant weight row of nsb super-blocks times the Q8_K activation rows act[t] of nt <=
// LB_TOKENS tokens, token t in mode[t]: res[t] in lane 0. Lane 8 * i + l decodes lane l's
// elements of super-block s0 + i once, then forms each token's integer sum of them (and, for
// LB_PAIR, its part of each pair of sub-blocks); Q6_K subtracts 32 * (b[2l] sc[2l] + b[2l+1]
// sc[2l+1]) there, as vec_dot. Every lane must call it.
template <int TY>
__device__ __forceinline__ void warp_dot_kq(const u8* w, const u8* const* act, const int* mode,
                                            int nt, int nsb, float* res) {
    __shared__ int ksum[ROW_WARPS][LB_TOKENS][32];
    __shared__ int kpair[ROW_WARPS][LB_TOKENS][32][4];
    __shared__ float kfin[ROW_WARPS][LB_TOKENS][16];
    const u32 wbytes = (u32)lowbit_block_bytes(TY);
    const bool has_min = TY == TY_Q2_K || TY == TY_Q4_K || TY == TY_Q5_K;
    int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP;
    float acc[LB_TOKENS], acc2[LB_TOKENS];
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) acc[t] = acc2[t] = 0.f;
    for (int s0 = 0; s0 < nsb; s0 += 4) {
        int sb = s0 + lane / 8, l = lane % 8;
        const u8* wb = w + (u64)sb * wbytes;
        int sq[32];
        for (int g = 0; g < 8; g++) {
            for (int i = 0; i < 4; i++) {
                int e = 32 * g + 4 * l + i;
                sq[4 * g + i] = sb < nsb ? kq_sc<TY>(wb, e) * kq_q<TY>(wb, e) : 0;
            }
        }
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t >= nt) continue;
            int sv = 0, pp[4] = {0, 0, 0, 0};
            if (sb < nsb) {
                const u8* ab = act[t] + (u64)sb * 292u;
                for (int g = 0; g < 8; g++) {
                    int sub = 0;
                    for (int i = 0; i < 4; i++) {
                        sub += sq[4 * g + i] * (int)(signed char)ab[4 + 32 * g + 4 * l + i];
                    }
                    pp[g / 2] += sub;
                    sv += sub;
                }
                if (TY == TY_Q6_K) {
                    int b2 = q8k_bsum(ab, 2 * l) * kq_sc<TY>(wb, 32 * l);
                    int b3 = q8k_bsum(ab, 2 * l + 1) * kq_sc<TY>(wb, 32 * l + 16);
                    sv = (int)((u32)sv - (u32)(b2 + b3) * 32u);
                }
            }
            ksum[wi][t][lane] = sv;
            for (int p = 0; p < 4; p++) kpair[wi][t][lane][p] = pp[p];
        }
        __syncwarp();
        int m = nsb - s0 < 4 ? nsb - s0 : 4;
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t >= nt) continue;
            for (int j = 0; j < m; j++) {
                const u8* wj = w + (u64)(s0 + j) * wbytes;
                const u8* aj = act[t] + (u64)(s0 + j) * 292u;
                float da = f32_at(aj);
                if (mode[t] == LB_VEC) {
                    if (lane < 8) {
                        if (TY == TY_Q2_K) {
                            int prod = (wj[2 * lane] >> 4) * q8k_bsum(aj, 2 * lane) +
                                       (wj[2 * lane + 1] >> 4) * q8k_bsum(aj, 2 * lane + 1);
                            acc[t] = fmaf(-da * kq_dmin<TY>(wj), (float)prod, acc[t]);
                        }
                        acc[t] = fmaf(da * kq_d<TY>(wj), (float)ksum[wi][t][8 * j + lane], acc[t]);
                    } else if (TY == TY_Q4_K && lane < 12) {
                        float p = (float)k4_min_prod(wj, aj, lane - 8);
                        acc2[t] = fmaf(-da * kq_dmin<TY>(wj), p, acc2[t]);
                    } else if (TY == TY_Q5_K && lane == 8) {
                        int ps = 0;
                        for (int k = 0; k < 4; k++) ps = (int)((u32)ps + (u32)k4_min_prod(wj, aj, k));
                        acc2[t] = fmaf(-da * kq_dmin<TY>(wj), (float)ps, acc2[t]);
                    }
                } else if (lane == 0) {
                    int s1 = 0;
                    for (int i = 0; i < 8; i++) s1 = (int)((u32)s1 + (u32)ksum[wi][t][8 * j + i]);
                    if (mode[t] == LB_TILED) {
                        float r = (float)s1 * kq_d<TY>(wj);
                        if (has_min) r = fmaf(-kq_dmin<TY>(wj), (float)kq_s2<TY>(wj, aj), r);
                        acc[t] = fmaf(r, da, acc[t]);
                    } else {
                        float d = kq_d<TY>(wj) * da, dmin = kq_dmin<TY>(wj) * da;
                        if (mode[t] == LB_BLOCK) {
                            acc[t] = fmaf((float)s1, d, acc[t]);
                            acc2[t] = fmaf((float)q4k_imin(wj, aj, 0, 8), dmin, acc2[t]);
                        } else {
                            for (int p = 0; p < 4; p++) {
                                int isum = 0;
                                for (int i = 0; i < 8; i++) isum += kpair[wi][t][8 * j + i][p];
                                acc[t] = fmaf((float)isum, d, acc[t]);
                                float mn = (float)q4k_imin(wj, aj, 2 * p, 2 * p + 2);
                                acc2[t] = fmaf(mn, dmin, acc2[t]);
                            }
                        }
                    }
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        if (t < nt && lane < 12) kfin[wi][t][lane] = lane < 8 ? acc[t] : acc2[t];
    }
    __syncwarp();
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        if (t < nt && lane == 0) {
            if (mode[t] == LB_TILED) {
                res[t] = acc[t];
            } else if (mode[t] != LB_VEC) {
                res[t] = acc[t] - acc2[t];
            } else {
                const float* f = kfin[wi][t];
                float r = hsum8(f);
                if (TY == TY_Q4_K) r = r + ((f[8] + f[10]) + (f[9] + f[11]));
                if (TY == TY_Q5_K) r = r + f[8];
                res[t] = r;
            }
        }
    }
    __syncwarp();
}

// A low-bit weight row of `cols` elements times the activation rows act[t] (of the weight's
// vec_dot_type) of nt <= LB_TOKENS tokens, token t in mode[t]: res[t] in lane 0. Every lane
// must call it.
template <int TY>
__device__ __forceinline__ void warp_dot_lowbit(const u8* row, const u8* const* act,
                                                const int* mode, int nt, int cols, float* res) {
    if (is_kquant(TY)) {
        warp_dot_kq<TY>(row, act, mode, nt, cols / 256, res);
    } else {
        warp_dot_legacy<TY>(row, act, mode, nt, cols / 32, res);
    }
}

// y[t][r] = W[r] . xq[t] for low-bit weights; token t < grouped in mode_grouped, the others
// in mode_rest. A warp per row and LB_TOKENS tokens.
// grid = (ceil(rows / ROW_WARPS), ceil(n / LB_TOKENS)), block = ROW_WARPS * 32.
template <int TY>
__device__ void matmul_lowbit_impl(const u8* w, u64 row_bytes, const u8* xq, float* y, int rows,
                                   int cols, int n, int grouped, int mode_grouped,
                                   int mode_rest) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    int t0 = blockIdx.y * LB_TOKENS;
    if (r >= rows || t0 >= n) return;
    int nt = n - t0 < LB_TOKENS ? n - t0 : LB_TOKENS;
    const u8* act[LB_TOKENS];
    int mode[LB_TOKENS];
    float res[LB_TOKENS];
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        int tt = t0 + (t < nt ? t : 0);
        act[t] = xq + (u64)tt * lowbit_act_bytes(TY, cols);
        mode[t] = tt < grouped ? mode_grouped : mode_rest;
        res[t] = 0.f;
    }
    warp_dot_lowbit<TY>(w + (u64)r * row_bytes, act, mode, nt, cols, res);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t < nt) y[(u64)(t0 + t) * rows + r] = res[t];
        }
    }
}

// out[slot][r] = experts[e][r] . act[slot / act_div] for the slots of expert e grouped by
// moe_group (offsets, order), LB_TOKENS slots at a time, in the CPU device's order for an
// expert matmul: LB_BLOCK for repacked experts, LB_TILED for K-quants when at least tiled_min
// slots route to e, else LB_VEC. Experts with at least mma_from slots are left to the
// tensor-core kernels (mma_from 0: none). Slots with an id out of range are not written
// (moe_swiglu and moe_down_bias do not read them). grid = (ceil(rows / ROW_WARPS), n_expert),
// block = ROW_WARPS * 32.
template <int TY>
__device__ void moe_lowbit_impl(const u8* w, u64 row_bytes, int rows, int cols, const u8* act,
                                int act_div, const int* offsets, const int* order, int repacked,
                                int tiled_min, int mma_from, float* out) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    int e = blockIdx.y;
    if (r >= rows) return;
    int begin = offsets[e], end = offsets[e + 1];
    if (mma_from > 0 && end - begin >= mma_from) return;
    int m = repacked ? LB_BLOCK : (is_kquant(TY) && end - begin >= tiled_min ? LB_TILED : LB_VEC);
    const u8* row = w + ((u64)e * rows + r) * row_bytes;
    for (int i0 = begin; i0 < end; i0 += LB_TOKENS) {
        int nt = end - i0 < LB_TOKENS ? end - i0 : LB_TOKENS;
        const u8* a[LB_TOKENS];
        int mode[LB_TOKENS];
        float res[LB_TOKENS];
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            int slot = order[i0 + (t < nt ? t : 0)];
            a[t] = act + (u64)(slot / act_div) * lowbit_act_bytes(TY, cols);
            mode[t] = m;
            res[t] = 0.f;
        }
        warp_dot_lowbit<TY>(row, a, mode, nt, cols, res);
        if (threadIdx.x % WARP == 0) {
#pragma unroll
            for (int t = 0; t < LB_TOKENS; t++) {
                if (t < nt) out[(u64)order[i0 + t] * rows + r] = res[t];
            }
        }
    }
}

#define LOWBIT(SUFFIX, TY)                                                                      \
    extern "C" __global__ void matmul_##SUFFIX(const u8* w, u64 row_bytes, const u8* xq,       \
                                               float* y, int rows, int cols, int n,             \
                                               int grouped, int mode_grouped, int mode_rest) {  \
        matmul_lowbit_impl<TY>(w, row_bytes, xq, y, rows, cols, n, grouped, mode_grouped,       \
                               mode_rest);                                                      \
    }                                                                                           \
    extern "C" __global__ void moe_lowbit_##SUFFIX(                                            \
        const u8* w, u64 row_bytes, int rows, int cols, const u8* act, int act_div,            \
        const int* offsets, const int* order, int repacked, int tiled_min, int mma_from,        \
        float* out) {                                                                           \
        moe_lowbit_impl<TY>(w, row_bytes, rows, cols, act, act_div, offsets, order, repacked,   \
                            tiled_min, mma_from, out);                                          \
    }

LOWBIT(q4_0, TY_Q4_0)
LOWBIT(q4_1, TY_Q4_1)
LOWBIT(q5_0, TY_Q5_0)
LOWBIT(q5_1, TY_Q5_1)
LOWBIT(q2_k, TY_Q2_K)
LOWBIT(q3_k, TY_Q3_K)
LOWBIT(q4_k, TY_Q4_K)
LOWBIT(q5_k, TY_Q5_K)
LOWBIT(q6_k, TY_Q6_K)

// Q8_0 experts in a set with low-bit ones (vec_dot order, as warp_dot_q8_0).
extern "C" __global__ void moe_lowbit_q8_0(const u8* w, u64 row_bytes, int rows, int cols,
                                           const u8* act, int act_div, const int* offsets,
                                           const int* order, int repacked, int tiled_min,
                                           int mma_from, float* out) {
    moe_lowbit_impl<TY_Q8_0>(w, row_bytes, rows, cols, act, act_div, offsets, order, repacked,
                             tiled_min, mma_from, out);
}

// Per-head products of low-bit weights (MLA's attn_k_b / attn_v_b in low-bit files):
// y[(t * n_heads + h) * out + r] = W[h * out + r] . xq[t * n_heads + h], xq the head rows
// gathered to `cols` values and quantized to the weight's vec_dot_type. Head h's tokens are
// the CPU device's batch for it: token t < grouped in mode_grouped, the others in mode_rest.
// A warp per row and LB_TOKENS tokens of one head.
// grid = (ceil(out / ROW_WARPS), n_heads * ceil(n / LB_TOKENS)), block = ROW_WARPS * 32.
template <int TY>
__device__ void matmul_heads_lowbit_impl(const u8* w, u64 row_bytes, const u8* xq, float* y,
                                         int out, int cols, int n, int n_heads, int grouped,
                                         int mode_grouped, int mode_rest) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    int h = blockIdx.y % n_heads;
    int t0 = blockIdx.y / n_heads * LB_TOKENS;
    if (r >= out || t0 >= n) return;
    int nt = n - t0 < LB_TOKENS ? n - t0 : LB_TOKENS;
    const u8* act[LB_TOKENS];
    int mode[LB_TOKENS];
    float res[LB_TOKENS];
#pragma unroll
    for (int t = 0; t < LB_TOKENS; t++) {
        int tt = t0 + (t < nt ? t : 0);
        act[t] = xq + ((u64)tt * n_heads + h) * lowbit_act_bytes(TY, cols);
        mode[t] = tt < grouped ? mode_grouped : mode_rest;
        res[t] = 0.f;
    }
    warp_dot_lowbit<TY>(w + ((u64)h * out + r) * row_bytes, act, mode, nt, cols, res);
    if (threadIdx.x % WARP == 0) {
#pragma unroll
        for (int t = 0; t < LB_TOKENS; t++) {
            if (t < nt) y[((u64)(t0 + t) * n_heads + h) * out + r] = res[t];
        }
    }
}

#define HEADS_LOWBIT(SUFFIX, TY)                                                                \
    extern "C" __global__ void matmul_heads_##SUFFIX(const u8* w, u64 row_bytes, const u8* xq, \
                                                     float* y, int out, int cols, int n,        \
                                                     int n_heads, int grouped,                  \
                                                     int mode_grouped, int mode_rest) {         \
        matmul_heads_lowbit_impl<TY>(w, row_bytes, xq, y, out, cols, n, n_heads, grouped,       \
                                     mode_grouped, mode_rest);                                  \
    }

HEADS_LOWBIT(q4_0, TY_Q4_0)
HEADS_LOWBIT(q4_1, TY_Q4_1)
HEADS_LOWBIT(q5_0, TY_Q5_0)
HEADS_LOWBIT(q5_1, TY_Q5_1)
HEADS_LOWBIT(q2_k, TY_Q2_K)
HEADS_LOWBIT(q3_k, TY_Q3_K)
HEADS_LOWBIT(q4_k, TY_Q4_K)
HEADS_LOWBIT(q5_k, TY_Q5_K)
HEADS_LOWBIT(q6_k, TY_Q6_K)

