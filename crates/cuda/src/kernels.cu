// hmoe CUDA kernels for gpt-oss's dense part and MoE experts.
//
// Compiled at start-up by NVRTC (see kernels.rs). Header-free on purpose: no cuda_fp16.h or
// cuda_bf16.h, which NVRTC can only find with the toolkit's include path. Half and bfloat16
// values travel as `unsigned short` bits and are converted with one PTX instruction (f16) or
// a shift (bf16). Compiled with --fmad=false: every fused multiply-add below is an explicit
// fmaf, so the rounding follows the CPU device's order.
//
// Weight types (ggml ids): F32 0, F16 1, Q8_0 8, BF16 30, MXFP4 39, and the low-bit types
// (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q2_K 10 .. Q6_K 14; see "Low-bit weights"); K/V rings also
// Q4_0 2. Rows of a weight matrix
// are contiguous; a row of `cols` elements takes `row_bytes` bytes (GGUF layout).
//   Q8_0:  blocks of 32 = f16 scale d (2 bytes) + 32 int8 q;  x = q * d.
//   MXFP4: blocks of 32 = E8M0 byte e + 16 bytes of nibbles; element j < 16 is the low nibble
//          of byte j, element j >= 16 the high nibble of byte j - 16; x = KV[nib] * 2^(e-128)
//          with KV the E2M1 table doubled {0,1,2,3,4,6,8,12,-0,-1,-2,-3,-4,-6,-8,-12}.
//
// Numerics: the CPU device's (ggml's CPU backend's), which RefBackend (reference.rs) computes
// on the host in the same steps. Products convert activations to the weight type's
// `vec_dot_type` as ggml does: Q8_0 blocks for Q8_0 and MXFP4 weights (quantize_q8_0, once
// per activation row), f16 or bf16 for F16 or BF16 weights, f32 for F32; integer block sums
// are exact, and the float sums follow the CPU device's orders for Q8_0, MXFP4 and F32 (see
// the warp_dot_* functions). Attention rounds the query and the probabilities to f16 (as ggml
// does for f16 K/V) and sums in the CPU device's orders with ggml's vectorised expf. Where
// the CPU calls libm's expf (sinks, flash attention, router softmax, SwiGLU) the kernels
// compute glibc's expf bit for bit (expf_libm).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q8_0 8
#define TY_BF16 30
#define TY_MXFP4 39
// The low-bit weight types of GGUF files (see "Low-bit weights" below).
#define TY_Q4_1 3
#define TY_Q5_0 6
#define TY_Q5_1 7
#define TY_Q2_K 10
#define TY_Q3_K 11
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
// Warps per block of the row-per-warp kernels; tokens per block of the matmul kernel.
#define ROW_WARPS 4
#define MM_TOKENS 8
// The tiled Q8_0/MXFP4 products: weight rows and tokens (or expert slots) per tile, quant
// blocks staged in shared memory at a time, and the most experts the grouping kernel handles.
#define TILE_ROWS 64
#define TILE_SLOTS 32
#define TILE_KB 8
#define MOE_MAX_EXPERTS 1024

__device__ __forceinline__ float f_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The f16 bits are widened to 32 bits inside the asm: with a 16-bit ("h") output, ptxas 13.0
// (the driver's JIT of CUDA 13.0 too) stored stale registers for `st.u8` of the value's low
// byte in some kernels (quantize_q8_1, quantize_block_q4_0's rings: the low bytes of d came out
// wrong on an H200 while the host emulation was exact).
__device__ __forceinline__ u16 f2h(float f) {
    u32 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));
    return (u16)h;
}

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even; NaNs made quiet (as the CPU's f32 -> bf16).
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 64u);
    }
    return (u16)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// 2^(e-128): half of the E8M0 scale, exact for every byte (e < 2 gives subnormals).
__device__ __forceinline__ float e8m0_half(u32 e) {
    return e < 2 ? __uint_as_float(0x00200000u << e) : __uint_as_float((e - 1u) << 23);
}

// The MXFP4 table value of a nibble: the doubled E2M1 magnitudes {0,1,2,3,4,6,8,12} packed
// as nibbles of one constant, the sign in bit 3 (ggml's kvalues_mxfp4).
__device__ __forceinline__ int mxfp4_int(u32 nib) {
    int v = (int)((0xC8643210u >> (4u * (nib & 7u))) & 15u);
    return (nib & 8u) ? -v : v;
}

__device__ __forceinline__ float mxfp4_value(u32 nib) { return (float)mxfp4_int(nib); }

// The f16 scale of a Q8_0 block.
__device__ __forceinline__ float q8_scale(const u8* b) { return h2f((u16)(b[0] | (b[1] << 8))); }

// x * 2^n without intermediate overflow or underflow (as vscalefps).
__device__ __forceinline__ float scale_by_pow2(float x, int n) {
    while (n > 127) {
        x *= __uint_as_float(0x7f000000u);
        n -= 127;
    }
    while (n < -126) {
        x *= __uint_as_float(0x00800000u);
        n += 126;
    }
    return x * __uint_as_float((u32)(n + 127) << 23);
}

// e^x as ggml's vectorised expf computes it (hmoe_model::ops::expf_ggml, bit for bit): range
// reduction by n = round(x log2 e), a polynomial in the remainder, then scaling by 2^n.
__device__ float expf_ggml(float x) {
    const float r = __uint_as_float(0x4b400000u);  // 1.5 * 2^23
    float z = fmaf(x, __uint_as_float(0x3fb8aa3bu), r);
    float n = z - r;
    float b = fmaf(-n, __uint_as_float(0x3f317200u), x);
    b = fmaf(-n, __uint_as_float(0x35bfbe8eu), b);
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : f_inf();
    float u = b * b;
    float p45 = fmaf(__uint_as_float(0x3c072010u), b, __uint_as_float(0x3d2b9f17u));
    float p23 = fmaf(__uint_as_float(0x3e2aaf33u), b, __uint_as_float(0x3efffedbu));
    float p01 = fmaf(__uint_as_float(0x3f7ffff6u), b, 1.0f);
    float j = fmaf(fmaf(p45, u, p23), u, p01);
    return scale_by_pow2(j, (int)n);
}

// 2^(i/32) as f64 bits, minus i << 47 (glibc's __exp2f_data table, as hmoe_quant's exp.rs).
__device__ const u64 EXP2F_TAB[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

// e^x bit for bit as glibc's expf on x86-64 with FMA (the CPU device's f32::exp; hmoe_quant's
// expf computes the same, see exp.rs there): with xd = x as f64, kds = fma(32/ln2, xd,
// 0x1.8p52) (k = round(x * 32/ln2) in its low bits), r = fma(32/ln2, xd, -(kds - 0x1.8p52)),
// s = 2^(k/32) as the table entry plus k << 47, y = fma(fma(C0, r, C1), r * r, fma(C2, r, 1)),
// and (float)(y * s); |x| >= 88 and NaN take glibc's special cases.
__device__ float expf_libm(float x) {
    u32 bits = __float_as_uint(x);
    u32 abs = bits & 0x7fffffffu;
    if (abs >= 0x42b00000u) {
        if (bits == 0xff800000u) return 0.f;
        if (abs >= 0x7f800000u) return x + x;
        if (x > __uint_as_float(0x42b17217u)) return f_inf();
        if (x < __uint_as_float(0xc2cff1b4u)) return 0.f;
        if (x < __uint_as_float(0xc2ce8ecfu)) return __uint_as_float(1u);
    }
    double inv_ln2_n = __longlong_as_double(0x40471547652b82fell);
    double shift = __longlong_as_double(0x4338000000000000ll);
    double xd = (double)x;
    double kds = fma(inv_ln2_n, xd, shift);
    u64 ki = (u64)__double_as_longlong(kds);
    double kd = kds - shift;
    double r = fma(inv_ln2_n, xd, -kd);
    double s = __longlong_as_double((long long)(EXP2F_TAB[ki % 32] + (ki << 47)));
    double z = fma(__longlong_as_double(0x3ebc6af84b912394ll), r,
                   __longlong_as_double(0x3f2ebfce50fac4f3ll));
    double r2 = r * r;
    double y = fma(__longlong_as_double(0x3f962e42ff0c52d6ll), r, 1.0);
    y = fma(z, r2, y);
    return (float)(y * s);
}

// ---------------------------------------------------------------------------------------------
// Low-bit weights: the legacy 32-element blocks Q4_0, Q4_1, Q5_0, Q5_1 and the 256-element
// K-quant super-blocks Q2_K .. Q6_K (layouts as hmoe_quant's legacy.rs / kquants.rs):
//   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; x = (q - 8) d.
//   Q4_1 (20): f16 d, f16 m, nibbles; x = q d + m.    Q5_0 (22): f16 d, u32 qh, nibbles; (q - 16) d.
//   Q5_1 (24): f16 d, f16 m, u32 qh, nibbles; x = q d + m. Element j < 16 is the low nibble of
//   byte j, j >= 16 the high nibble of byte j - 16; the fifth bit of element j is bit j of qh.
//   Q2_K (84): scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), f16 d, f16 dmin.
//   Q3_K (110): hmask[32], qs[64], scales[12] (16 6-bit scales - 32), f16 d.
//   Q4_K (144): f16 d, f16 dmin, scales[12] (8 6-bit scales and mins), qs[128] (nibbles).
//   Q5_K (176): as Q4_K with qh[32] before qs.   Q6_K (210): ql[128], qh[64], int8 scales[16], f16 d.
// Their activations (ggml's vec_dot_type): Q8_0 for Q4_0/Q5_0, Q8_1 (36 bytes: f16 d, f16 s =
// d * sum q, 32 int8) for Q4_1/Q5_1, Q8_K (292 bytes: f32 d, 256 int8, 16 int16 sums of 16) for
// the K-quants.

__device__ __forceinline__ bool is_kquant(int ty) { return ty >= TY_Q2_K && ty <= TY_Q6_K; }

// Bytes of a weight block of TY (legacy types and Q8_0: 32 elements; K-quants: 256).
__device__ __forceinline__ int lowbit_block_bytes(int ty) {
    switch (ty) {
    case TY_Q4_0: return 18;
    case TY_Q4_1: return 20;
    case TY_Q5_0: return 22;
    case TY_Q5_1: return 24;
    case TY_Q8_0: return 34;
    case TY_Q2_K: return 84;
    case TY_Q3_K: return 110;
    case TY_Q4_K: return 144;
    case TY_Q5_K: return 176;
    default: return 210;  // Q6_K
    }
}

// Bytes of an activation row of `cols` values in the vec_dot_type of TY.
__device__ __forceinline__ u64 lowbit_act_bytes(int ty, int cols) {
    if (is_kquant(ty)) return (u64)(cols / 256) * 292u;
    return (u64)(cols / 32) * ((ty == TY_Q4_1 || ty == TY_Q5_1) ? 36u : 34u);
}

// The little-endian f16 at half-word i of b, and the f32 at byte 0.
__device__ __forceinline__ float f16_at(const u8* b, int i) {
    return h2f((u16)(b[2 * i] | (b[2 * i + 1] << 8)));
}
__device__ __forceinline__ float f32_at(const u8* b) {
    return __uint_as_float((u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24));
}

// The integer value of element j of a legacy block (Q8_0 included): signed for Q4_0/Q5_0/Q8_0,
// the unsigned code for Q4_1/Q5_1.
template <int TY>
__device__ __forceinline__ int legacy_q(const u8* b, int j) {
    if (TY == TY_Q8_0) return (int)(signed char)b[2 + j];
    int off = TY == TY_Q4_0 ? 2 : TY == TY_Q4_1 ? 4 : TY == TY_Q5_0 ? 6 : 8;
    u32 byte = b[off + (j & 15)];
    int q = (int)(j < 16 ? (byte & 15u) : (byte >> 4));
    if (TY == TY_Q5_0 || TY == TY_Q5_1) {
        int qh = TY == TY_Q5_0 ? 2 : 4;
        q |= ((b[qh + j / 8] >> (j % 8)) & 1) << 4;
    }
    if (TY == TY_Q4_0) q -= 8;
    if (TY == TY_Q5_0) q -= 16;
    return q;
}

// Scale and min of 32-element sub-block j of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4;
// q = the 12 scale bytes).
__device__ __forceinline__ int k4_scale(const u8* q, int j) {
    return j < 4 ? (q[j] & 63) : ((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
}
__device__ __forceinline__ int k4_min(const u8* q, int j) {
    return j < 4 ? (q[j + 4] & 63) : ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
}

// Scale of 16-element group i of a Q3_K super-block, 32 subtracted.
__device__ __forceinline__ int q3k_scale(const u8* b, int i) {
    const u8* r = b + 96;
    int low = i < 8 ? (r[i] & 15) : (r[i - 8] >> 4);
    int high = (r[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

// The 2-bit field of element e from the 64 bytes at qs (Q2_K, Q3_K).
__device__ __forceinline__ int low2(const u8* b, int qs, int e) {
    return (b[qs + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

// The quant of element e of a K-quant super-block: Q2_K 0..3, Q3_K -4..3, Q4_K 0..15, Q5_K
// 0..31, Q6_K unsigned 0..63 (the value is this minus 32).
template <int TY>
__device__ __forceinline__ int kq_q(const u8* b, int e) {
    if (TY == TY_Q2_K) return low2(b, 16, e);
    if (TY == TY_Q3_K) return low2(b, 32, e) - (((b[e % 32] >> (e / 32)) & 1) ? 0 : 4);
    if (TY == TY_Q4_K || TY == TY_Q5_K) {
        int qs = TY == TY_Q4_K ? 16 : 48;
        int q = (b[qs + 32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 15;
        if (TY == TY_Q5_K) q |= ((b[16 + e % 32] >> (e / 32)) & 1) << 4;
        return q;
    }
    int half = e / 128, group = (e % 128) / 32, t = e % 32;
    int low = (b[64 * half + 32 * (group & 1) + t] >> (4 * (group >> 1))) & 15;
    int high = (b[128 + 32 * half + t] >> (2 * group)) & 3;
    return low | (high << 4);
}

// The scale of element e (as an integer factor of d): Q2_K the low nibble, Q3_K the 6-bit scale
// minus 32, Q4_K/Q5_K the 6-bit sub-block scale, Q6_K the int8 scale.
template <int TY>
__device__ __forceinline__ int kq_sc(const u8* b, int e) {
    if (TY == TY_Q2_K) return b[e / 16] & 15;
    if (TY == TY_Q3_K) return q3k_scale(b, e / 16);
    if (TY == TY_Q4_K || TY == TY_Q5_K) return k4_scale(b + 4, e / 32);
    return (int)(signed char)b[192 + e / 16];
}

// Element e of a low-bit weight row, dequantised as hmoe_quant's dequantize_row (ggml's
// dequantize_row_*: each product rounded on its own).
template <int TY>
__device__ __forceinline__ float load_lowbit(const u8* row, int e) {
    if (!is_kquant(TY)) {
        const u8* b = row + (u64)(e >> 5) * (u32)lowbit_block_bytes(TY);
        float q = (float)legacy_q<TY>(b, e & 31);
        if (TY == TY_Q4_1 || TY == TY_Q5_1) return q * f16_at(b, 0) + f16_at(b, 1);
        return q * f16_at(b, 0);
    }
    const u8* b = row + (u64)(e >> 8) * (u32)lowbit_block_bytes(TY);
    int i = e & 255;
    if (TY == TY_Q2_K) {
        int sc = b[i / 16];
        float dl = f16_at(b, 40) * (float)(sc & 15), ml = f16_at(b, 41) * (float)(sc >> 4);
        return dl * (float)kq_q<TY>(b, i) - ml;
    }
    if (TY == TY_Q3_K) return f16_at(b, 54) * (float)q3k_scale(b, i / 16) * (float)kq_q<TY>(b, i);
    if (TY == TY_Q6_K) {
        return f16_at(b, 104) * (float)kq_sc<TY>(b, i) * (float)(kq_q<TY>(b, i) - 32);
    }
    float dl = f16_at(b, 0) * (float)k4_scale(b + 4, i / 32);
    float ml = f16_at(b, 1) * (float)k4_min(b + 4, i / 32);
    return dl * (float)kq_q<TY>(b, i) - ml;
}

// Element `e` of a weight row of type TY.
template <int TY>
__device__ __forceinline__ float load_w(const u8* row, int e) {
    if (TY == TY_F32) {
        return ((const float*)row)[e];
    } else if (TY == TY_F16) {
        return h2f(((const u16*)row)[e]);
    } else if (TY == TY_BF16) {
        return bf2f(((const u16*)row)[e]);
    } else if (TY == TY_Q8_0) {
        const u8* b = row + (u64)(e >> 5) * 34u;
        float d = h2f((u16)(b[0] | (b[1] << 8)));
        return (float)(signed char)b[2 + (e & 31)] * d;
    } else if (TY != TY_MXFP4) {
        return load_lowbit<TY>(row, e);
    } else {
        const u8* b = row + (u64)(e >> 5) * 17u;
        int j = e & 31;
        u32 byte = b[1 + (j & 15)];
        u32 nib = j < 16 ? (byte & 15u) : (byte >> 4);
        return mxfp4_value(nib) * e8m0_half(b[0]);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// The sum of v over the 16 lanes of each half-warp by halving: lanes i and i+8, then +4, +2,
// +1 (_mm512_reduce_add_ps; the CPU device's hsum16). Every lane of the half gets it (in
// another but commutation-equal order); every lane of the warp must call it.
__device__ __forceinline__ float half_warp_sum16(float v) {
    for (int o = 8; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// ---------------------------------------------------------------------------------------------
// Embedding: out[t] = dequantised row ids[t] of `table`.

// Ids outside 0 .. n_rows give zero rows. grid = n_tokens, block = any.
template <int TY>
__device__ void get_rows_impl(const u8* table, u64 row_bytes, int n_rows, const int* ids,
                              float* out, int n_tokens, int cols) {
    int t = blockIdx.x;
    if (t >= n_tokens) return;
    int id = ids[t];
    bool ok = id >= 0 && id < n_rows;
    const u8* row = table + (u64)(ok ? id : 0) * row_bytes;
    for (int e = threadIdx.x; e < cols; e += blockDim.x) {
        out[(u64)t * cols + e] = ok ? load_w<TY>(row, e) : 0.f;
    }
}

#define GET_ROWS(SUFFIX, TY)                                                                    \
    extern "C" __global__ void get_rows_##SUFFIX(const u8* table, u64 row_bytes, int n_rows,   \
                                                 const int* ids, float* out, int n_tokens,      \
                                                 int cols) {                                    \
        get_rows_impl<TY>(table, row_bytes, n_rows, ids, out, n_tokens, cols);                  \
    }
GET_ROWS(f32, TY_F32)
GET_ROWS(f16, TY_F16)
GET_ROWS(bf16, TY_BF16)
GET_ROWS(q8_0, TY_Q8_0)
GET_ROWS(mxfp4, TY_MXFP4)
GET_ROWS(q4_0, TY_Q4_0)
GET_ROWS(q4_1, TY_Q4_1)
GET_ROWS(q5_0, TY_Q5_0)
GET_ROWS(q5_1, TY_Q5_1)
GET_ROWS(q2_k, TY_Q2_K)
GET_ROWS(q3_k, TY_Q3_K)
GET_ROWS(q4_k, TY_Q4_K)
GET_ROWS(q5_k, TY_Q5_K)
GET_ROWS(q6_k, TY_Q6_K)

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = x / sqrt(mean(x^2) + eps) * w. Squares in f32, summed in f64 (as the CPU
// device and ggml's CPU backend do). One block per row.

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, int n_rows,
                                        int n, float eps) {
    __shared__ double partial[32];
    int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* row = x + (u64)r * n;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        s += (double)(v * v);
    }
    s = warp_sum_d(s);
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = (blockDim.x + WARP - 1) / WARP;
    if (lane == 0) partial[wid] = s;
    __syncthreads();
    if (wid == 0) {
        double t = lane < nw ? partial[lane] : 0.0;
        t = warp_sum_d(t);
        if (lane == 0) partial[0] = t;
    }
    __syncthreads();
    float mean = (float)(partial[0] / (double)n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[(u64)r * n + i] = row[i] * scale * w[i];
    }
}

// ---------------------------------------------------------------------------------------------
// Activations of Q8_0 and MXFP4 products: each block of 32 values becomes a Q8_0 block exactly
// as hmoe_quant::quantize_row(Q8_0) (ggml's x86 quantize_row_q8_0) makes it: amax = max |x|,
// d = amax / 127 stored as f16 (round to nearest even), q = x * (127 / amax) (0 when amax is
// 0) rounded half to even and saturated to int8 (a NaN product gives -128, as on the CPU).
// Finite inputs give the CPU's bytes. x: n_blocks blocks of 32 values back to back (rows of
// whole blocks); out: n_blocks * 34 bytes. One thread per block; grid = ceil(n_blocks / 256),
// block = 256.

// One block of 32 values as Q8_0 (see quantize_q8_0).
__device__ void quantize_block_q8_0(const float* xb, u8* ob) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    u16 d = f2h(amax / 127.0f);
    float id = amax != 0.f ? 127.0f / amax : 0.f;
    ob[0] = (u8)(d & 0xffu);
    ob[1] = (u8)(d >> 8);
    for (int j = 0; j < 32; j++) {
        float q = fminf(fmaxf(rintf(xb[j] * id), -128.0f), 127.0f);
        ob[2 + j] = (u8)(int)q;
    }
}

extern "C" __global__ void quantize_q8_0(const float* x, u8* out, u64 n_blocks) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    quantize_block_q8_0(x + b * 32u, out + b * 34u);
}

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
// Matmul: y[t][r] = W[r] . x[t] for weights of type TY. x: for Q8_0 and MXFP4 weights the
// activations as Q8_0 blocks (quantize_q8_0), else f32. F32 weights sum one token in vec_dot
// order and several in 16 lanes, as the CPU device does. One warp per output row, up to
// MM_TOKENS tokens per block (grid.y covers the rest).
// grid = (ceil(rows / ROW_WARPS), ceil(n / MM_TOKENS)), block = ROW_WARPS * 32.

template <int TY>
__device__ void matmul_impl(const u8* w, u64 row_bytes, const void* x, float* y, int rows,
                            int cols, int n) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;
    int t0 = blockIdx.y * MM_TOKENS;
    int nt = n - t0 < MM_TOKENS ? n - t0 : MM_TOKENS;
    const u8* row = w + (u64)r * row_bytes;
    for (int i = 0; i < nt; i++) {
        u64 t = (u64)(t0 + i);
        float s = warp_dot<TY>(row, act_row<TY>(x, t, cols), cols, n == 1);
        if (threadIdx.x % WARP == 0) y[t * rows + r] = s;
    }
}

// The GEMV entry points: X is the activations' type (f32, or Q8_0 blocks for Q8_0/MXFP4).
#define MATMUL(SUFFIX, TY, X)                                                                   \
    extern "C" __global__ void matmul_##SUFFIX(const u8* w, u64 row_bytes, const X* x, float* y, \
                                               int rows, int cols, int n) {                     \
        matmul_impl<TY>(w, row_bytes, x, y, rows, cols, n);                                     \
    }
MATMUL(f32, TY_F32, float)
MATMUL(f16, TY_F16, float)
MATMUL(bf16, TY_BF16, float)
MATMUL(q8_0, TY_Q8_0, u8)
MATMUL(mxfp4, TY_MXFP4, u8)

// ---------------------------------------------------------------------------------------------
// Element-wise.

// x += y (the residual add).
extern "C" __global__ void add_inplace_f32(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[r][c] += bias[c] for every row r.
extern "C" __global__ void add_bias_f32(float* x, const float* bias, u64 n, int cols) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % (u64)cols];
}

// f32 -> f16 / bf16 bits (activations for the cuBLAS GEMMs).
extern "C" __global__ void f32_to_f16(const float* x, u16* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
extern "C" __global__ void f32_to_bf16(const float* x, u16* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(x[i]);
}

// ---------------------------------------------------------------------------------------------
// RoPE, NeoX layout (element i pairs with i + n_dims/2), with YaRN, as the CPU device computes
// it: theta = pos * theta_scale^i by repeated multiplication, interpolation/extrapolation blend
// by the ramp between the (floored/ceiled) correction dims, magnitude attn_factor (times
// 1 + 0.1 ln(1/freq_scale) when ext_factor != 0), rotations as fmaf(x0, c, -(x1 s)).
// x: [n_tokens][n_heads][head_dim], rotated in place; pos: [n_tokens].
// grid = (n_heads, n_tokens), block = any (threads loop over the n_dims/2 pairs).

// The (cos, sin) of rotated pair i at position p, as the CPU device's RoPE tables: theta =
// p * theta_scale^i by repeated multiplication, the YaRN blend by the ramp between the
// correction dims, magnitude attn_factor (times 1 + 0.1 ln(1/freq_scale) with YaRN).
__device__ void rope_cos_sin(float p, int i, float theta_scale, float freq_scale,
                             float ext_factor, float attn_factor, float corr_low,
                             float corr_high, float* c, float* s) {
    float theta_extrap = p;
    for (int j = 0; j < i; j++) theta_extrap *= theta_scale;
    float theta_interp = freq_scale * theta_extrap;
    float theta = theta_interp;
    float mscale = attn_factor;
    if (ext_factor != 0.0f) {
        float y = ((float)i - corr_low) / fmaxf(0.001f, corr_high - corr_low);
        float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
        theta = theta_interp * (1.0f - ramp) + theta_extrap * ramp;
        mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
    }
    *c = cosf(theta) * mscale;
    *s = sinf(theta) * mscale;
}

extern "C" __global__ void rope_neox_f32(float* x, const int* pos, int n_tokens, int n_heads,
                                         int head_dim, int n_dims, float theta_scale,
                                         float freq_scale, float ext_factor, float attn_factor,
                                         float corr_low, float corr_high) {
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_heads || t >= n_tokens) return;
    float* head = x + ((u64)t * n_heads + h) * head_dim;
    int half = n_dims / 2;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(p, i, theta_scale, freq_scale, ext_factor, attn_factor, corr_low, corr_high,
                     &c, &s);
        float x0 = head[i], x1 = head[i + half];
        head[i] = fmaf(x0, c, -(x1 * s));
        head[i + half] = fmaf(x0, s, x1 * c);
    }
}

// ---------------------------------------------------------------------------------------------
// KV cache. A ring of `cells` rows of `width` values (n_kv_heads * head_dim); token t of the
// batch goes to cell (pos0 + t) % cells. Rows are stored as the CPU device's cache stores them
// (ggml's set_rows): f32 as is, f16 and bf16 rounded to nearest even, Q8_0 by the
// activations' quantizer (quantize_block_q8_0), Q4_0, Q4_1, Q5_0 and Q5_1 by ggml's reference
// quantizers (hmoe_quant's quantize_row); a block-quantized row is first Walsh–Hadamard
// rotated in chunks of `rot` values (0: not rotated), as llama.cpp rotates quantized heads.

// A ring of a float type (T), element by element: CONV converts an f32 to T (nothing for f32).
#define KV_STORE_FLOAT(SUFFIX, T, CONV)                                                         \
    extern "C" __global__ void kv_store_##SUFFIX(const float* src, T* cache, int n_tokens,     \
                                                 int width, int cells, int pos0) {              \
        u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;                                     \
        if (i >= (u64)n_tokens * width) return;                                                 \
        int t = (int)(i / (u64)width), c = (int)(i % (u64)width);                               \
        u64 cell = (u64)((pos0 + t) % cells);                                                   \
        cache[cell * width + c] = CONV(src[i]);                                                 \
    }
KV_STORE_FLOAT(f16, u16, f2h)
KV_STORE_FLOAT(bf16, u16, f2bf)
KV_STORE_FLOAT(f32, float, )

// The CPU device's fast Walsh–Hadamard transform of the n values of x in place (n a power of two):
// scale by 1 / sqrt(n), then butterflies (u + v, u - v) over strides 1, 2, 4, ... n / 2. Its
// own inverse.
__device__ void fwht_serial(float* x, int n) {
    float scale = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= scale;
    for (int len = 1; len < n; len <<= 1) {
        for (int i = 0; i < n; i += 2 * len) {
            for (int j = i; j < i + len; j++) {
                float u = x[j], v = x[j + len];
                x[j] = u + v;
                x[j + len] = u - v;
            }
        }
    }
}

// ggml's reference Q4_0 quantizer (quantize_row_q4_0_ref) of one block of 32: d = max / -8
// with max the value of the largest magnitude (the first of equals), q = min(15,
// (int8)(x / d + 8.5)) (x * (1 / d), truncated as x86's cvttss2si), element j < 16 in the low
// nibble of byte j, element j + 16 in its high nibble.
__device__ void quantize_block_q4_0(const float* x, u8* ob) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    float d = max / -8.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    u16 dh = f2h(d);
    ob[0] = (u8)(dh & 0xffu);
    ob[1] = (u8)(dh >> 8);
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)(x[j] * id + 8.5f);
        int q1 = (int)(signed char)(int)(x[j + 16] * id + 8.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        ob[2 + j] = (u8)((q0 & 15) | ((q1 & 15) << 4));
    }
}

// The value of the largest magnitude of a block of 32 (the first of equals), as ggml's
// reference quantizers scan for it (`amax < |x|`).
__device__ __forceinline__ float signed_max32(const float* x) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

// The minimum and maximum of a block of 32 as ggml's reference quantizers scan for them
// (`x < min`, `x > max` from +-FLT_MAX).
__device__ __forceinline__ void min_max32(const float* x, float* mn, float* mx) {
    float lo = 3.40282347e38f, hi = -3.40282347e38f;
    for (int j = 0; j < 32; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

// The little-endian f16 of f at b, and the u32 v at b.
__device__ __forceinline__ void put_f16(u8* b, float f) {
    u16 h = f2h(f);
    b[0] = (u8)(h & 0xffu);
    b[1] = (u8)(h >> 8);
}
__device__ __forceinline__ void put_u32(u8* b, u32 v) {
    for (int k = 0; k < 4; k++) b[k] = (u8)(v >> (8 * k));
}

// ggml's reference Q5_0 quantizer (quantize_row_q5_0_ref): d = max / -16 (max as for Q4_0),
// q = min(31, (int8)(x / d + 16.5)); the low nibbles as Q4_0's at byte 6, the fifth bit of
// element j in bit j of the u32 at byte 2.
__device__ void quantize_block_q5_0(const float* x, u8* ob) {
    float d = signed_max32(x) / -16.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    u32 qh = 0;
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)(x[j] * id + 16.5f);
        int q1 = (int)(signed char)(int)(x[j + 16] * id + 16.5f);
        q0 = q0 < 31 ? q0 : 31;
        q1 = q1 < 31 ? q1 : 31;
        ob[6 + j] = (u8)((q0 & 15) | ((q1 & 15) << 4));
        qh |= (u32)((q0 & 0x10) >> 4) << j;
        qh |= (u32)((q1 & 0x10) >> 4) << (j + 16);
    }
    put_u32(ob + 2, qh);
}

// ggml's reference Q4_1 quantizer (quantize_row_q4_1_ref): d = (max - min) / 15, m = min,
// q = min(15, (int8)((x - min) / d + 0.5)).
__device__ void quantize_block_q4_1(const float* x, u8* ob) {
    float mn, mx;
    min_max32(x, &mn, &mx);
    float d = (mx - mn) / 15.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    put_f16(ob + 2, mn);
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)((x[j] - mn) * id + 0.5f);
        int q1 = (int)(signed char)(int)((x[j + 16] - mn) * id + 0.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        ob[4 + j] = (u8)(q0 | (q1 << 4));
    }
}

// ggml's reference Q5_1 quantizer (quantize_row_q5_1_ref): d = (max - min) / 31, m = min,
// q = (uint8)((x - min) / d + 0.5); low nibbles at byte 8, fifth bits in the u32 at byte 4.
__device__ void quantize_block_q5_1(const float* x, u8* ob) {
    float mn, mx;
    min_max32(x, &mn, &mx);
    float d = (mx - mn) / 31.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    put_f16(ob + 2, mn);
    u32 qh = 0;
    for (int j = 0; j < 16; j++) {
        u32 q0 = (u8)(int)((x[j] - mn) * id + 0.5f);
        u32 q1 = (u8)(int)((x[j + 16] - mn) * id + 0.5f);
        ob[8 + j] = (u8)((q0 & 15u) | ((q1 & 15u) << 4));
        qh |= ((q0 & 0x10u) >> 4) << j;
        qh |= ((q1 & 0x10u) >> 4) << (j + 16);
    }
    put_u32(ob + 4, qh);
}

#define KV_MAX_CHUNK 256

// One thread per chunk of max(rot, 32) values (at most KV_MAX_CHUNK) of the batch's rows:
// each `rot` values of it rotated (rot > 0), then quantized block by block into its cell.
__device__ void kv_store_blocks(const float* src, u8* cache, int n_tokens, int width, int cells,
                                int pos0, int rot, int ty) {
    int block_bytes = lowbit_block_bytes(ty);
    int chunk = rot > 32 ? rot : 32;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 per_row = (u64)(width / chunk);
    if (i >= (u64)n_tokens * per_row) return;
    int t = (int)(i / per_row), c = (int)(i % per_row);
    float x[KV_MAX_CHUNK];
    const float* s = src + (u64)t * width + (u64)c * chunk;
    for (int j = 0; j < chunk; j++) x[j] = s[j];
    for (int r = 0; rot > 0 && r < chunk; r += rot) fwht_serial(x + r, rot);
    u64 cell = (u64)((pos0 + t) % cells);
    u8* row = cache + cell * (u64)(width / 32) * block_bytes;
    for (int b = 0; b < chunk / 32; b++) {
        u8* ob = row + (u64)(c * (chunk / 32) + b) * block_bytes;
        switch (ty) {
        case TY_Q4_0: quantize_block_q4_0(x + 32 * b, ob); break;
        case TY_Q4_1: quantize_block_q4_1(x + 32 * b, ob); break;
        case TY_Q5_0: quantize_block_q5_0(x + 32 * b, ob); break;
        case TY_Q5_1: quantize_block_q5_1(x + 32 * b, ob); break;
        default: quantize_block_q8_0(x + 32 * b, ob); break;
        }
    }
}

#define KV_STORE_BLOCKS(SUFFIX, TY)                                                             \
    extern "C" __global__ void kv_store_##SUFFIX(const float* src, u8* cache, int n_tokens,    \
                                                 int width, int cells, int pos0, int rot) {     \
        kv_store_blocks(src, cache, n_tokens, width, cells, pos0, rot, TY);                     \
    }

KV_STORE_BLOCKS(q8_0, TY_Q8_0)
KV_STORE_BLOCKS(q4_0, TY_Q4_0)
KV_STORE_BLOCKS(q4_1, TY_Q4_1)
KV_STORE_BLOCKS(q5_0, TY_Q5_0)
KV_STORE_BLOCKS(q5_1, TY_Q5_1)

// Element i of an f32 (ty TY_F32) or f16 ring, as f32.
__device__ __forceinline__ float kv_float(const u8* ring, int ty, u64 i) {
    return ty == TY_F16 ? h2f(((const u16*)ring)[i]) : ((const float*)ring)[i];
}

// Attention over a K/V ring with GQA, an optional sliding window and optional per-head sink
// logits (gpt-oss): the sink joins the softmax's denominator and adds no value. q, out:
// [n_tokens][n_head][head_dim] f32. Token t sits at position pos0 + t and sees keys
// first = max(0, pos - window + 1) ..= pos (window 0: all of 0 ..= pos). Like the CPU device,
// the value type chooses the kernel: f32/f16 values attn_row, Q8_0/Q4_0 values attn_flash, each
// with keys of f32, f16, Q8_0 or Q4_0. Both take the same arguments: the rings' ggml types and
// their rotation chunks (only block-quantized rings are rotated).
//
// attn_row: the CPU device's row kernel (RefBackend's `ref0_kv`, hmoe_model's attention for
// float values), bit for bit: the query rounded to f16 for f16 keys, rotated and converted to
// Q8_0 blocks for Q8_0/Q4_0 keys; scores in ggml's vec_dot_f16 order for one query token and
// f16 keys, tinyBLAS's 16 lanes for several, vec_dot_f32's order for f32 keys and ggml's
// vec_dot for block keys (attn_score), times `scale`; m = the largest score (and
// sink); positions in chunks of 16 from first rounded down to a multiple of 16, each chunk's
// expf_ggml(s - m) summed by halving and added to an f64 sum in chunk order, plus the sink's
// exp; probabilities expf_ggml(s - m) * (f32)(1 / sum), rounded to f16 for f16 values; output
// dimension d sums in 16 lanes (lane i: position i of every chunk, in order) fma(v, p, acc),
// then by halving. With value_chains 4 and one query token, vec_dot's order instead: position
// p into lane p % 16 of chain (p / 16) % 4, the chains folded (c0 + c2) + (c1 + c3) per lane,
// then by halving (value_chains 1: one chain).
//
// One block per (head, token); each half-warp takes one chunk of a round of ATT_CHUNKS chunks.
// Pass 1 keeps the scores in shared memory when the token sees at most ATT_SCORE_CACHE
// positions; beyond that they are computed again in passes 2 and 3 (the same bits either way).
// head_dim must be a multiple of 16 and at most 256. grid = (n_head, n_tokens),
// block = ATT_WARPS * 32.
#define ATT_WARPS 8
#define ATT_MAX_PER_LANE 8
#define ATT_CHUNKS (2 * ATT_WARPS)
#define ATT_MAX_DIMS_PER_THREAD (ATT_MAX_PER_LANE * WARP / 16)
#define ATT_SCORE_CACHE 8192

// Element j (0..31) of a Q8_0 or Q4_0 block, as its integer.
__device__ __forceinline__ int block_int(const u8* b, bool q4, int j) {
    if (!q4) return (int)(signed char)b[2 + j];
    u8 byte = b[2 + (j & 15)];
    return (int)(j < 16 ? byte & 15 : byte >> 4) - 8;
}

// The score of the key at element `at` of the ring `k` against the query `q` (shared memory;
// rounded to f16 for f16 keys; as Q8_0 blocks `qb` for Q8_0/Q4_0 keys), by the 16 lanes of a
// half-warp (l: lane within the half): block keys in ggml's vec_dot order (flash_score's); f32 keys, and one query token with f16 keys, in ggml's vec_dot order (four 16-lane
// FMA accumulators over 64-element steps folded (s0 + s2) + (s1 + s3), summed by halving, then
// the last hd % 64 products added one by one, in f32 for f32 keys and rounded to f32 and added
// in f64 for f16), several tokens with f16 keys in tinyBLAS's (element i into lane i % 16,
// summed by halving). Every lane of the half gets it; every lane of the warp must call it.
__device__ float attn_score(const float* q, const u8* qb, const u8* k, int k_ty, u64 at, int hd,
                            int l, int single) {
    if (k_ty == TY_Q8_0 || k_ty == TY_Q4_0) {
        // Lanes 0..7 of the half keep accumulator l of ggml's vec_dot (see flash_score), folded
        // by xor-shuffles 4, 2, 1: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
        bool q4 = k_ty == TY_Q4_0;
        int bb = q4 ? 18 : 34;
        const u8* kb = k + at / 32 * bb;
        float a = 0.f;
        if (l < 8) {
            for (int b = 0; b < hd / 32; b++) {
                const u8* w = kb + b * bb;
                const u8* x = qb + b * 34;
                float d = q8_scale(w) * q8_scale(x);
                int s = 0;
                for (int e = 4 * l; e < 4 * l + 4; e++) s += block_int(w, q4, e) * (int)(signed char)x[2 + e];
                a = fmaf(d, (float)s, a);
            }
        }
        for (int o = 4; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        return __shfl_sync(0xffffffffu, a, (int)(threadIdx.x & ~15u));
    }
    if (single || k_ty == TY_F32) {
        int np = hd & ~63;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int b = 0; b < np; b += 64) {
            a0 = fmaf(q[b + l], kv_float(k, k_ty, at + b + l), a0);
            a1 = fmaf(q[b + 16 + l], kv_float(k, k_ty, at + b + 16 + l), a1);
            a2 = fmaf(q[b + 32 + l], kv_float(k, k_ty, at + b + 32 + l), a2);
            a3 = fmaf(q[b + 48 + l], kv_float(k, k_ty, at + b + 48 + l), a3);
        }
        float head = half_warp_sum16((a0 + a2) + (a1 + a3));
        if (k_ty == TY_F32) {
            for (int i = np; i < hd; i++) head += q[i] * kv_float(k, k_ty, at + i);
            return head;
        }
        double sum = (double)head;
        for (int i = np; i < hd; i++) sum += (double)(q[i] * kv_float(k, k_ty, at + i));
        return (float)sum;
    }
    float a = 0.f;
    for (int i = l; i < hd; i += 16) a = fmaf(q[i], kv_float(k, k_ty, at + i), a);
    return half_warp_sum16(a);
}

extern "C" __global__ void attn_row(const float* q, const u8* kc, const u8* vc,
                                    const float* sinks, int has_sinks, float* out, int n_tokens,
                                    int n_head, int n_kv, int head_dim, int cells, int pos0,
                                    int window, float scale, int k_ty, int v_ty, int k_rot,
                                    int v_rot, int value_chains) {
    __shared__ float sm_q[ATT_MAX_PER_LANE * WARP];
    __shared__ u8 sm_qb[ATT_MAX_PER_LANE * 34];
    __shared__ float sm_s[ATT_SCORE_CACHE];
    __shared__ float sm_p[ATT_CHUNKS * 16];
    __shared__ float sm_red[ATT_CHUNKS];
    __shared__ float sm_max;
    __shared__ float sm_inv;
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tokens) return;
    int tid = threadIdx.x;
    int lane = tid % WARP, wid = tid / WARP;
    int hw = tid / 16, l = tid % 16;  // half-warp (its chunk of each round) and lane in it
    int pos = pos0 + t;
    int first = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    int chunk0 = first / 16 * 16;
    int n_chunks = (pos + 1 - chunk0 + 15) / 16;
    int rounds = (n_chunks + ATT_CHUNKS - 1) / ATT_CHUNKS;
    // Score of position chunk0 + j at sm_s[j] (the same for every thread of the block).
    bool cached = n_chunks * 16 <= ATT_SCORE_CACHE;
    int single = n_tokens == 1;
    int kvh = h / (n_head / n_kv);
    u64 width = (u64)n_kv * head_dim;
    u64 kv_off = (u64)kvh * head_dim;
    bool v16 = v_ty == TY_F16;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    for (int i = tid; i < head_dim; i += blockDim.x) {
        sm_q[i] = k_ty == TY_F16 ? h2f(f2h(qh[i])) : qh[i];
    }
    __syncthreads();
    // Block keys: the query rotated like them, as Q8_0 blocks.
    bool kq = k_ty == TY_Q8_0 || k_ty == TY_Q4_0;
    if (kq && k_rot > 0 && tid == 0) {
        for (int c = 0; c < head_dim; c += k_rot) fwht_serial(sm_q + c, k_rot);
    }
    __syncthreads();
    if (kq && tid < head_dim / 32) quantize_block_q8_0(sm_q + 32 * tid, sm_qb + 34 * tid);
    __syncthreads();

    // Pass 1: the largest score (and sink). Out-of-range slots score position `pos` and are
    // ignored, so that every lane takes part in the shuffles.
    float m = -f_inf();
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        for (int i = 0; i < 16; i++) {
            int p = chunk0 + 16 * c + i;
            bool ok = c < n_chunks && p >= first && p <= pos;
            u64 cell = (u64)((ok ? p : pos) % cells);
            float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
            if (ok) m = fmaxf(m, s);
            if (ok && cached && l == i) sm_s[16 * c + i] = s;
        }
    }
    m = warp_max(m);
    if (lane == 0) sm_red[wid] = m;
    __syncthreads();
    if (tid == 0) {
        float big = has_sinks ? sinks[h] : -f_inf();
        for (int w = 0; w < ATT_WARPS; w++) big = fmaxf(big, sm_red[w]);
        sm_max = big;
    }
    __syncthreads();
    float big = sm_max;

    // Pass 2: the denominator, chunk sums added in f64 in chunk order (by thread 0).
    double total = 0.0;
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        float mine = 0.f;
        if (cached) {
            int p = chunk0 + 16 * c + l;
            if (c < n_chunks && p >= first && p <= pos) mine = expf_ggml(sm_s[16 * c + l] - big);
        } else {
            for (int i = 0; i < 16; i++) {
                int p = chunk0 + 16 * c + i;
                bool ok = c < n_chunks && p >= first && p <= pos;
                u64 cell = (u64)((ok ? p : pos) % cells);
                float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
                if (ok && l == i) mine = expf_ggml(s - big);
            }
        }
        float chunk_sum = half_warp_sum16(mine);
        if (l == 0) sm_red[hw] = chunk_sum;
        __syncthreads();
        if (tid == 0) {
            for (int j = 0; j < ATT_CHUNKS; j++) {
                if (r * ATT_CHUNKS + j < n_chunks) total += (double)sm_red[j];
            }
        }
        __syncthreads();
    }
    if (tid == 0) {
        if (has_sinks) total += (double)expf_libm(sinks[h] - big);
        sm_inv = (float)(1.0 / total);
    }
    __syncthreads();
    float inv = sm_inv;

    // Pass 3: the values. Thread (hw, l) keeps lane l of dimensions hw, hw + 16, ..., in
    // each chain.
    int nd = head_dim / 16;
    int chains = single && value_chains == 4 ? 4 : 1;
    float acc[4][ATT_MAX_DIMS_PER_THREAD];
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) acc[c][k] = 0.f;
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        float mine = 0.f;
        if (cached) {
            int p = chunk0 + 16 * c + l;
            if (c < n_chunks && p >= first && p <= pos) {
                mine = expf_ggml(sm_s[16 * c + l] - big) * inv;
            }
        } else {
            for (int i = 0; i < 16; i++) {
                int p = chunk0 + 16 * c + i;
                bool ok = c < n_chunks && p >= first && p <= pos;
                u64 cell = (u64)((ok ? p : pos) % cells);
                float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
                if (ok && l == i) mine = expf_ggml(s - big) * inv;
            }
        }
        sm_p[hw * 16 + l] = v16 ? h2f(f2h(mine)) : mine;
        __syncthreads();
        for (int j = 0; j < ATT_CHUNKS; j++) {
            int cj = r * ATT_CHUNKS + j;
            int p = chunk0 + 16 * cj + l;
            if (cj < n_chunks && p >= first && p <= pos) {
                float w = sm_p[j * 16 + l];
                u64 at = (u64)(p % cells) * width + kv_off;
                int chain = (p / 16) % chains;
#pragma unroll
                for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) {
                    if (k < nd) {
                        float x = kv_float(vc, v_ty, at + hw + 16 * k);
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            if (c == chain) acc[c][k] = fmaf(x, w, acc[c][k]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    float* oh = out + ((u64)t * n_head + h) * head_dim;
#pragma unroll
    for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) {
        if (k < nd) {
            float a = chains == 1 ? acc[0][k] : (acc[0][k] + acc[2][k]) + (acc[1][k] + acc[3][k]);
            float o = half_warp_sum16(a);
            if (l == 0) oh[hw + 16 * k] = o;
        }
    }
}

// The key at element `at` of a ring of `ty` (one thread): f32 keys against the query `q` in
// vec_dot_f32's order, f16 keys against the f16-rounded query in vec_dot_f16's (see
// attn_score: four 16-lane chains per 64 elements, the tail in f32 or f64), Q8_0/Q4_0 keys
// against the query's Q8_0 blocks `qb` in ggml's vec_dot order (eight accumulators: for each
// block in order, accumulator k takes fma(d_k · d_q, Σ of elements 4k..4k+3, acc_k); then
// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))).
__device__ float flash_score(const float* q, const u8* qb, const u8* k, int ty, u64 at, int hd) {
    if (ty == TY_F32 || ty == TY_F16) {
        int np = hd & ~63;
        float lanes[4][16];
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 16; i++) lanes[j][i] = 0.f;
        for (int b = 0; b < np; b += 64)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 16; i++) {
                    int e = b + 16 * j + i;
                    lanes[j][i] = fmaf(q[e], kv_float(k, ty, at + e), lanes[j][i]);
                }
        float f[16];
        for (int i = 0; i < 16; i++) f[i] = (lanes[0][i] + lanes[2][i]) + (lanes[1][i] + lanes[3][i]);
        for (int step = 8; step > 0; step >>= 1)
            for (int i = 0; i < step; i++) f[i] += f[i + step];
        if (ty == TY_F32) {
            float sum = f[0];
            for (int i = np; i < hd; i++) sum += q[i] * kv_float(k, ty, at + i);
            return sum;
        }
        double sum = (double)f[0];
        for (int i = np; i < hd; i++) sum += (double)(q[i] * kv_float(k, ty, at + i));
        return (float)sum;
    }
    bool q4 = ty != TY_Q8_0;
    int bb = q4 ? 18 : 34;
    const u8* kb = k + at / 32 * bb;
    float a[8];
    for (int j = 0; j < 8; j++) a[j] = 0.f;
    for (int b = 0; b < hd / 32; b++) {
        const u8* w = kb + b * bb;
        const u8* x = qb + b * 34;
        float d = q8_scale(w) * q8_scale(x);
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int e = 4 * j; e < 4 * j + 4; e++) s += block_int(w, q4, e) * (int)(signed char)x[2 + e];
            a[j] = fmaf(d, (float)s, a[j]);
        }
    }
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// attn_flash: the CPU device's flash attention (ggml's CPU kernel; RefBackend's `ref0_kv`),
// for Q8_0/Q4_0 values: the query rotated like the keys (k_rot), converted to the keys'
// vec_dot type (f16-rounded for f16 keys, Q8_0 blocks for Q8_0/Q4_0 keys); then per key in
// position order, score s = dot · scale: a new maximum (s > m) gives ms = expf(m - s), vs = 1
// and m = s, else ms = 1, vs = expf(s - m); S = fma(S, ms, vs); acc *= ms (when ms != 1);
// acc = fma(v, vs, acc) with v the dequantized value (q · d). The sink folds in last (a sink
// above m rescales acc and S as a key would, without a value; else S += expf(sink - m)), then
// acc · (1 / S), rotated back like the values (v_rot). expf is glibc's (expf_libm).
//
// One warp per (head, token): its lanes score 32 positions at a time (one each), then every
// lane runs the online softmax over them in order for the dimensions it keeps (lane, lane + 32,
// ...). head_dim a multiple of 32, at most 256. grid = (n_head, n_tokens), block = 32.
extern "C" __global__ void attn_flash(const float* q, const u8* kc, const u8* vc,
                                      const float* sinks, int has_sinks, float* out,
                                      int n_tokens, int n_head, int n_kv, int head_dim,
                                      int cells, int pos0, int window, float scale, int k_ty,
                                      int v_ty, int k_rot, int v_rot) {
    __shared__ float sm_q[ATT_MAX_PER_LANE * WARP];
    __shared__ u8 sm_qb[ATT_MAX_PER_LANE * 34];
    __shared__ float sm_s[WARP];
    __shared__ float sm_o[ATT_MAX_PER_LANE * WARP];
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tokens) return;
    int lane = threadIdx.x;
    int pos = pos0 + t;
    int first = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    int kvh = h / (n_head / n_kv);
    u64 width = (u64)n_kv * head_dim;
    u64 kv_off = (u64)kvh * head_dim;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) sm_q[i] = qh[i];
    __syncwarp();
    if (lane == 0 && k_rot > 0) {
        for (int c = 0; c < head_dim; c += k_rot) fwht_serial(sm_q + c, k_rot);
    }
    __syncwarp();
    if (k_ty == TY_F16) {
        for (int i = lane; i < head_dim; i += WARP) sm_q[i] = h2f(f2h(sm_q[i]));
    }
    if (k_ty != TY_F32 && k_ty != TY_F16) {
        if (lane < head_dim / 32) quantize_block_q8_0(sm_q + 32 * lane, sm_qb + 34 * lane);
    }
    __syncwarp();
    bool vq4 = v_ty != TY_Q8_0;
    int vbb = vq4 ? 18 : 34;
    int nd = head_dim / WARP;
    float acc[ATT_MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < ATT_MAX_PER_LANE; k++) acc[k] = 0.f;
    float m = -f_inf(), S = 0.f;
    for (int base = first; base <= pos; base += WARP) {
        int p = base + lane;
        if (p <= pos) {
            u64 at = (u64)(p % cells) * width + kv_off;
            sm_s[lane] = flash_score(sm_q, sm_qb, kc, k_ty, at, head_dim) * scale;
        }
        __syncwarp();
        int n = pos + 1 - base < WARP ? pos + 1 - base : WARP;
        for (int i = 0; i < n; i++) {
            float s = sm_s[i];
            float ms = 1.f, vs = 1.f;
            if (s > m) {
                ms = expf_libm(m - s);
                m = s;
            } else {
                vs = expf_libm(s - m);
            }
            S = fmaf(S, ms, vs);
            const u8* vrow = vc + ((u64)((base + i) % cells) * width + kv_off) / 32 * vbb;
#pragma unroll
            for (int k = 0; k < ATT_MAX_PER_LANE; k++) {
                if (k < nd) {
                    int e = lane + WARP * k;
                    const u8* b = vrow + (e / 32) * vbb;
                    float v = (float)block_int(b, vq4, e % 32) * q8_scale(b);
                    if (ms != 1.f) acc[k] *= ms;
                    acc[k] = fmaf(v, vs, acc[k]);
                }
            }
        }
        __syncwarp();
    }
    if (has_sinks) {
        float sink = sinks[h];
        if (sink > m) {
            float ms = expf_libm(m - sink);
#pragma unroll
            for (int k = 0; k < ATT_MAX_PER_LANE; k++) {
                if (k < nd && ms != 1.f) acc[k] *= ms;
            }
            S = fmaf(S, ms, 1.f);
        } else {
            S += expf_libm(sink - m);
        }
    }
    float inv = S == 0.f ? 0.f : 1.f / S;
#pragma unroll
    for (int k = 0; k < ATT_MAX_PER_LANE; k++) {
        if (k < nd) sm_o[lane + WARP * k] = inv != 1.f ? acc[k] * inv : acc[k];
    }
    __syncwarp();
    if (lane == 0 && v_rot > 0) {
        for (int c = 0; c < head_dim; c += v_rot) fwht_serial(sm_o + c, v_rot);
    }
    __syncwarp();
    float* oh = out + ((u64)t * n_head + h) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) oh[i] = sm_o[i];
}

// ---------------------------------------------------------------------------------------------
// Router: per token, the k largest logits (ties: lower index first), then a softmax over
// those k only (exps summed in f64, as the CPU device does). sel: [n][k] expert ids, weights: [n][k]. One warp per token;
// grid = ceil(n / ROW_WARPS), block = ROW_WARPS * 32. k <= 64.

extern "C" __global__ void router_topk_softmax(const float* logits, int* sel, float* weights,
                                               int n, int n_expert, int k) {
    int t = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (t >= n) return;
    int lane = threadIdx.x % WARP;
    const float* row = logits + (u64)t * n_expert;
    float pv = f_inf();
    int pi = -1;
    for (int i = 0; i < k; i++) {
        float bv = -f_inf();
        int bi = 0x7fffffff;
        for (int e = lane; e < n_expert; e += WARP) {
            float v = row[e];
            bool after_prev = v < pv || (v == pv && e > pi);
            bool better = v > bv || (v == bv && e < bi);
            if (after_prev && better) {
                bv = v;
                bi = e;
            }
        }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi == 0x7fffffff) bi = 0;  // only NaNs were left
        if (lane == 0) {
            sel[(u64)t * k + i] = bi;
            weights[(u64)t * k + i] = bv;
        }
        pv = bv;
        pi = bi;
    }
    __syncwarp();
    if (lane == 0) {
        // As the CPU device's softmax: exps summed in f64, times the f32 of 1 / sum.
        float* w = weights + (u64)t * k;
        float mx = w[0];
        double sum = 0.0;
        for (int i = 0; i < k; i++) {
            w[i] = expf_libm(w[i] - mx);
            sum += (double)w[i];
        }
        float inv = (float)(1.0 / sum);
        for (int i = 0; i < k; i++) w[i] *= inv;
    }
}

// ---------------------------------------------------------------------------------------------
// MoE experts (gpt-oss): for every (token, slot) pair s = t * k + j with expert e = sel[s]:
//   g = gate_e . x_t + bg_e,  u = up_e . x_t + bu_e,
//   h_s = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)
//   y_s = down_e . h_s + bd_e
//   out_t = sum_j w[t][j] * y_{t*k+j}   (in slot order)
// Expert tensors are [n_expert][rows][cols] with contiguous rows. Out-of-range expert ids give
// zero rows. The biases are [n_expert][rows]; has_bias = 0 ignores them. Activations as for
// matmul: for Q8_0 and MXFP4 experts x and h are Q8_0 blocks (quantize_q8_0 of each token's
// row, and of each slot's h between the two kernels), else f32. F32 experts sum in vec_dot
// order when only one slot of the call routes to the expert, else in 16 lanes: the CPU device
// multiplies each expert's tokens as one batch (SiLU experts, act = ACT_SILU: always vec_dot,
// as the CPU device's SwiGLU experts). The activation is gated_act(act, ...).

__device__ __forceinline__ float swiglu_oai(float g, float u) {
    float x = fminf(g, 7.0f);
    float y = fminf(fmaxf(u, -7.0f), 7.0f);
    return x / (1.0f + expf_libm(-1.702f * x)) * (y + 1.0f);
}

// The experts' gated activation of element r of a row of ff: act 0 the clamped SwiGLU above
// (gpt-oss), act 1 SwiGLU silu(g) * u as the CPU device's swiglu (expf_ggml in the row's whole
// 16-blocks, libm's expf after them; Qwen3-MoE, DeepSeek).
#define ACT_CLAMPED_SWIGLU 0
#define ACT_SILU 1
__device__ __forceinline__ float gated_act(int act, float g, float u, int r, int ff) {
    if (act == ACT_SILU) {
        float e = r < ff / 16 * 16 ? expf_ggml(0.0f - g) : expf_libm(-g);
        return g / (1.0f + e) * u;
    }
    return swiglu_oai(g, u);
}

// Whether F32 products for expert e sum in vec_dot order: e is routed to by one slot only.
// Every lane of the warp gets it; every lane must call it.
template <int TY>
__device__ bool moe_vec_order(const int* sel, int n_slots, int e) {
    if (TY != TY_F32) return true;
    int c = 0;
    for (int j = threadIdx.x % WARP; j < n_slots; j += WARP) c += sel[j] == e ? 1 : 0;
    for (int o = WARP / 2; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    return c == 1;
}

// grid = (ceil(ff / ROW_WARPS), n_slots), block = ROW_WARPS * 32. h: [n_slots][ff].
template <int TY>
__device__ void moe_gate_up_impl(const u8* gate, const u8* up, const float* bg, const float* bu,
                                 int has_bias, const void* x, const int* sel, float* h,
                                 int n_slots, int k, int n_expert, int d, int ff, u64 row_bytes,
                                 int act) {
    int slot = blockIdx.y;
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (slot >= n_slots || r >= ff) return;
    int e = sel[slot];
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x % WARP == 0) h[(u64)slot * ff + r] = 0.f;
        return;
    }
    u64 off = ((u64)e * ff + r) * row_bytes;
    const void* xt = act_row<TY>(x, (u64)(slot / k), d);
    bool vec = act == ACT_SILU || moe_vec_order<TY>(sel, n_slots, e);
    float g = warp_dot<TY>(gate + off, xt, d, vec);
    float u = warp_dot<TY>(up + off, xt, d, vec);
    if (threadIdx.x % WARP == 0) {
        if (has_bias) {
            g += bg[(u64)e * ff + r];
            u += bu[(u64)e * ff + r];
        }
        h[(u64)slot * ff + r] = gated_act(act, g, u, r, ff);
    }
}

// grid = (ceil(d / ROW_WARPS), n_slots), block = ROW_WARPS * 32. y: [n_slots][d].
template <int TY>
__device__ void moe_down_impl(const u8* down, const float* bd, int has_bias, const void* h,
                              const int* sel, float* y, int n_slots, int n_expert, int d, int ff,
                              u64 row_bytes, int act) {
    int slot = blockIdx.y;
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (slot >= n_slots || r >= d) return;
    int e = sel[slot];
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x % WARP == 0) y[(u64)slot * d + r] = 0.f;
        return;
    }
    u64 off = ((u64)e * d + r) * row_bytes;
    bool vec = act == ACT_SILU || moe_vec_order<TY>(sel, n_slots, e);
    float s = warp_dot<TY>(down + off, act_row<TY>(h, (u64)slot, ff), ff, vec);
    if (threadIdx.x % WARP == 0) {
        if (has_bias) s += bd[(u64)e * d + r];
        y[(u64)slot * d + r] = s;
    }
}

// ACT: the activation pointer type (const u8* for Q8_0 blocks, const float* for f32).
#define MOE_WRAPPERS(SUFFIX, TY, ACT)                                                           \
    extern "C" __global__ void moe_gate_up_##SUFFIX(                                           \
        const u8* gate, const u8* up, const float* bg, const float* bu, int has_bias, ACT x,    \
        const int* sel, float* h, int n_slots, int k, int n_expert, int d, int ff,              \
        u64 row_bytes, int act) {                                                               \
        moe_gate_up_impl<TY>(gate, up, bg, bu, has_bias, x, sel, h, n_slots, k, n_expert, d,    \
                             ff, row_bytes, act);                                               \
    }                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(const u8* down, const float* bd, int has_bias, \
                                                 ACT h, const int* sel, float* y, int n_slots,  \
                                                 int n_expert, int d, int ff, u64 row_bytes,    \
                                                 int act) {                                     \
        moe_down_impl<TY>(down, bd, has_bias, h, sel, y, n_slots, n_expert, d, ff, row_bytes,   \
                          act);                                                                 \
    }

MOE_WRAPPERS(mxfp4, TY_MXFP4, const u8*)
MOE_WRAPPERS(q8_0, TY_Q8_0, const u8*)
MOE_WRAPPERS(f16, TY_F16, const float*)
MOE_WRAPPERS(bf16, TY_BF16, const float*)
MOE_WRAPPERS(f32, TY_F32, const float*)

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
            for (int i = tid; i < TILE_ROWS * TILE_KB; i += blockDim.x) {
                int r = i / TILE_KB, b = i % TILE_KB;
                int* dst = &ws[r][8 * b];
                if (r0 + r < rows && b < kbn) {
                    stage_weight_block<TY>(w + (u64)(r0 + r) * row_bytes, kb0 + b, dst, &wsc[r][b]);
                } else {
                    wsc[r][b] = 0.f;
                    for (int j = 0; j < 8; j++) dst[j] = 0;
                }
            }
            for (int i = tid; i < TILE_SLOTS * TILE_KB; i += blockDim.x) {
                int s = i / TILE_KB, b = i % TILE_KB;
                int slot = slot_of[s];
                int* dst = &xs[s][8 * b];
                if (slot >= 0 && b < kbn) {
                    const u8* ab = act + ((u64)(slot / act_div) * (u64)nb + (u64)(kb0 + b)) * 34u;
                    xsc[s][b] = q8_scale(ab);
                    for (int j = 0; j < 8; j++) {
                        const u8* q = ab + 2 + 4 * j;
                        dst[j] = pack_i8x4(q[0], q[1], q[2], q[3]);
                    }
                } else {
                    xsc[s][b] = 0.f;
                    for (int j = 0; j < 8; j++) dst[j] = 0;
                }
            }
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
// slots route to e, else LB_VEC. Slots with an id out of range are not written (moe_swiglu and
// moe_down_bias do not read them). grid = (ceil(rows / ROW_WARPS), n_expert),
// block = ROW_WARPS * 32.
template <int TY>
__device__ void moe_lowbit_impl(const u8* w, u64 row_bytes, int rows, int cols, const u8* act,
                                int act_div, const int* offsets, const int* order, int repacked,
                                int tiled_min, float* out) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    int e = blockIdx.y;
    if (r >= rows) return;
    int begin = offsets[e], end = offsets[e + 1];
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
        const int* offsets, const int* order, int repacked, int tiled_min, float* out) {        \
        moe_lowbit_impl<TY>(w, row_bytes, rows, cols, act, act_div, offsets, order, repacked,   \
                            tiled_min, out);                                                    \
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
                                           float* out) {
    moe_lowbit_impl<TY_Q8_0>(w, row_bytes, rows, cols, act, act_div, offsets, order, repacked,
                             tiled_min, out);
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

// ---------------------------------------------------------------------------------------------
// Strided row copies: row r of width values from src[r * src_stride + src_off] to
// dst[r * dst_stride + dst_off]. One thread per element.

extern "C" __global__ void copy_rows_f32(const float* src, float* dst, int n_rows, int width,
                                         u64 src_stride, u64 src_off, u64 dst_stride,
                                         u64 dst_off) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_rows * width) return;
    u64 r = i / (u64)width, c = i % (u64)width;
    dst[r * dst_stride + dst_off + c] = src[r * src_stride + src_off + c];
}

// ---------------------------------------------------------------------------------------------
// RoPE, normal layout (element 2i pairs with 2i + 1) over dims first .. first + n_dims of each
// head, with YaRN: the same angles and rotation as rope_neox_f32.
// x: [n_tokens][n_heads][head_dim], rotated in place; pos: [n_tokens].
// grid = (n_heads, n_tokens), block = any (threads loop over the n_dims/2 pairs).

extern "C" __global__ void rope_norm_f32(float* x, const int* pos, int n_tokens, int n_heads,
                                         int head_dim, int first, int n_dims, float theta_scale,
                                         float freq_scale, float ext_factor, float attn_factor,
                                         float corr_low, float corr_high) {
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_heads || t >= n_tokens) return;
    float* head = x + ((u64)t * n_heads + h) * head_dim + first;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < n_dims / 2; i += blockDim.x) {
        float c, s;
        rope_cos_sin(p, i, theta_scale, freq_scale, ext_factor, attn_factor, corr_low, corr_high,
                     &c, &s);
        float x0 = head[2 * i], x1 = head[2 * i + 1];
        head[2 * i] = fmaf(x0, c, -(x1 * s));
        head[2 * i + 1] = fmaf(x0, s, x1 * c);
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head products: y[(t * n_heads + h) * out + r] = W[h * out + r] . x_row(t * n_heads + h),
// the activation rows x_stride values apart, of which the first cols are used (for Q8_0 and
// MXFP4 weights x_stride is a multiple of 32 and x the Q8_0 blocks of all of it). F32 sums in
// vec_dot order when vec_order, else in 16 lanes. One warp per output row.
// grid = (ceil(out / ROW_WARPS), n * n_heads), block = ROW_WARPS * 32.

template <int TY>
__device__ void matmul_heads_impl(const u8* w, u64 row_bytes, const void* x, float* y, int out,
                                  int cols, int n_rows, int n_heads, int x_stride,
                                  int vec_order) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    int i = blockIdx.y;
    if (r >= out || i >= n_rows) return;
    int h = i % n_heads;
    const u8* row = w + ((u64)h * out + r) * row_bytes;
    float s = warp_dot<TY>(row, act_row<TY>(x, (u64)i, x_stride), cols, vec_order != 0);
    if (threadIdx.x % WARP == 0) y[(u64)i * out + r] = s;
}

#define MATMUL_HEADS(SUFFIX, TY, ACT)                                                           \
    extern "C" __global__ void matmul_heads_##SUFFIX(const u8* w, u64 row_bytes, ACT x,        \
                                                     float* y, int out, int cols, int n_rows,   \
                                                     int n_heads, int x_stride,                 \
                                                     int vec_order) {                           \
        matmul_heads_impl<TY>(w, row_bytes, x, y, out, cols, n_rows, n_heads, x_stride,         \
                              vec_order);                                                       \
    }

MATMUL_HEADS(f32, TY_F32, const float*)
MATMUL_HEADS(f16, TY_F16, const float*)
MATMUL_HEADS(bf16, TY_BF16, const float*)
MATMUL_HEADS(q8_0, TY_Q8_0, const u8*)
MATMUL_HEADS(mxfp4, TY_MXFP4, const u8*)

// ---------------------------------------------------------------------------------------------
// SwiGLU of rows of n values in place, gate = silu(gate) * up, as the CPU device's swiglu: the
// whole 16-blocks of a row with expf_ggml, the rest of the row with libm's expf. One thread per
// element.

extern "C" __global__ void swiglu_f32(float* gate, const float* up, u64 total, int n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int c = (int)(i % (u64)n);
    float x = gate[i];
    float e = c < n / 16 * 16 ? expf_ggml(0.0f - x) : expf_libm(-x);
    gate[i] = x / (1.0f + e) * up[i];
}

// ---------------------------------------------------------------------------------------------
// Attention over a K-only ring (multi-head latent attention in its absorbed form) of any K/V
// type (TY: f32, f16, bf16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; not rotated): every query head
// against the one key head; the value of a position is the first v_dim elements of its key.
// q: [n_tokens][n_head][k_dim] f32, out: [n_tokens][n_head][v_dim]. Token t sits at position
// pos0 + t and sees 0 ..= pos.
//
// The CPU device's numerics (Ref0::attention_k_only), bit for bit: the query as the keys'
// vec_dot takes it (f32 as is; rounded to f16 or bf16; for block keys its Q8_0 blocks, Q8_1
// for Q4_1/Q5_1, in qq from quantize_acts); scores: f32 keys in vec_dot_f32 order, f16 keys
// in vec_dot_f16 order (one query token, or a key not whole 16-lane steps long) or tinyBLAS's
// 16 lanes, bf16 keys in ggml's bf16 vec_dot order, block keys in ggml's vec_dot order (see
// k_only_score_blocks); times scale; m = the largest score; expf_ggml(s - m) summed by halving
// per chunk of 16 positions, chunk sums added in f64 in order; probabilities expf_ggml(s - m)
// * (f32)(1 / sum), rounded to f16 / bf16 for f16 / bf16 rings; values read as
// dequantize_row reads them; value dimension d sums fma(v, p, acc) per (chain, lane) with
// lane = position % 16 and chain = (position / 16) % 4 for one query token over f32/f16 keys
// (vec_dot's four chains; else 1 chain), then (c0 + c2) + (c1 + c3) per lane and by halving.
//
// One block per (head, token), KO_THREADS threads: each thread scores one position of a tile
// of KO_THREADS positions (whole chunks) at a time, serially in the CPU's order; thread d
// accumulates value dims d, d + KO_THREADS. k_dim <= KO_MAX_K, v_dim <= KO_THREADS *
// KO_DIMS_PER_THREAD; block rings: k_dim and v_dim multiples of 32.
// grid = (n_head, n_tokens), block = KO_THREADS.
#define KO_THREADS 256
#define KO_MAX_K 1024
#define KO_DIMS_PER_THREAD 2

__device__ float reduce16_serial(const float* a) {
    float t8[8];
    for (int i = 0; i < 8; i++) t8[i] = a[i] + a[i + 8];
    float t4[4];
    for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// Whether K-only rings of TY are block-quantized (their query as blocks).
__device__ __forceinline__ bool ko_blocks(int ty) {
    return ty != TY_F32 && ty != TY_F16 && ty != TY_BF16;
}

// f32 keys (TY_F32) or f16 keys (TY_F16) against the query qf (f16-rounded for f16 keys): with
// `lanes` (f16 only) element i fused into lane i % 16, summed by halving; else vec_dot's four
// 16-lane chains over 64-element steps folded (s0 + s2) + (s1 + s3), summed by halving, then
// the last kd % 64 products added one by one (in f32 for f32, in f64 for f16).
template <int TY>
__device__ float k_only_score_float(const float* qf, const u8* row, int kd, int lanes) {
    float acc[4][16];
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 16; l++) acc[j][l] = 0.f;
    if (TY == TY_F16 && lanes) {
        for (int i = 0; i < kd; i++) acc[0][i % 16] = fmaf(qf[i], load_w<TY>(row, i), acc[0][i % 16]);
        return reduce16_serial(acc[0]);
    }
    int np = kd / 64 * 64;
    for (int b = 0; b < np; b += 64)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 16; l++) {
                int i = b + 16 * j + l;
                acc[j][l] = fmaf(qf[i], load_w<TY>(row, i), acc[j][l]);
            }
    float folded[16];
    for (int l = 0; l < 16; l++) folded[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    float head = reduce16_serial(folded);
    if (TY == TY_F32) {
        for (int i = np; i < kd; i++) head = head + qf[i] * load_w<TY>(row, i);
        return head;
    }
    double sum = (double)head;
    for (int i = np; i < kd; i++) sum += (double)(qf[i] * load_w<TY>(row, i));
    return (float)sum;
}

// bf16 keys against the bf16-rounded query in ggml's bf16 vec_dot order (hmoe_quant's
// dot_bf16): two 16-lane accumulators over 32-element steps (elements 32s + l and
// 32s + 16 + l) adding unfused products, each summed by halving and added in f64 from zero,
// then the last kd % 32 products in f64.
__device__ float k_only_score_bf16(const float* qf, const u8* row, int kd) {
    float c1[16], c2[16];
    for (int l = 0; l < 16; l++) c1[l] = c2[l] = 0.f;
    int np = kd / 32 * 32;
    for (int b = 0; b < np; b += 32)
        for (int l = 0; l < 16; l++) {
            c1[l] = c1[l] + load_w<TY_BF16>(row, b + l) * qf[b + l];
            c2[l] = c2[l] + load_w<TY_BF16>(row, b + 16 + l) * qf[b + 16 + l];
        }
    double sum = 0.0;
    sum += (double)reduce16_serial(c1);
    sum += (double)reduce16_serial(c2);
    for (int i = np; i < kd; i++) sum += (double)(load_w<TY_BF16>(row, i) * qf[i]);
    return (float)sum;
}

// A key of nb legacy blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) against the query's Q8_0 (Q8_1)
// blocks qb, serially in ggml's vec_dot order (warp_dot_legacy's LB_VEC chain): for each
// block in order, accumulator k takes fma(d_k · d_q, Σ of elements 4k..4k+3, acc_k); Q4_1/Q5_1
// fuse m_k · s_q into a chain of their own; hsum8 of the eight, plus that chain.
template <int TY>
__device__ float k_only_score_blocks(const u8* qb, const u8* k, int nb) {
    const bool has_min = TY == TY_Q4_1 || TY == TY_Q5_1;
    const u32 kbytes = (u32)lowbit_block_bytes(TY), abytes = has_min ? 36u : 34u;
    const int aq = has_min ? 4 : 2;
    float acc[8], acc2 = 0.f;
    for (int j = 0; j < 8; j++) acc[j] = 0.f;
    for (int b = 0; b < nb; b++) {
        const u8* kb = k + (u64)b * kbytes;
        const u8* ab = qb + (u64)b * abytes;
        float d = f16_at(kb, 0) * f16_at(ab, 0);
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int i = 4 * j; i < 4 * j + 4; i++) s += legacy_q<TY>(kb, i) * (int)(signed char)ab[aq + i];
            acc[j] = fmaf(d, (float)s, acc[j]);
        }
        if (has_min) acc2 = fmaf(f16_at(kb, 1), f16_at(ab, 1), acc2);
    }
    float r = hsum8(acc);
    return has_min ? r + acc2 : r;
}

// The scaled score of the key at `row` (float keys against the converted query qf, block keys
// against the query's blocks qb).
template <int TY>
__device__ float k_only_score_at(const float* qf, const u8* qb, const u8* row, int k_dim,
                                 int lanes, float scale) {
    float s;
    if (TY == TY_F32 || TY == TY_F16) {
        s = k_only_score_float<TY>(qf, row, k_dim, lanes);
    } else if (TY == TY_BF16) {
        s = k_only_score_bf16(qf, row, k_dim);
    } else {
        s = k_only_score_blocks<TY>(qb, row, k_dim / 32);
    }
    return s * scale;
}

// The body of attn_k_only_<type>: q the queries (f32), qq their blocks for block rings.
template <int TY>
__device__ void attn_k_only_body(const float* q, const u8* qq, const u8* kc, float* out,
                                 int n_tokens, int n_head, int k_dim, int v_dim, int cells,
                                 int pos0, float scale) {
    __shared__ float sm_q[KO_MAX_K];
    __shared__ u8 sm_qq[KO_MAX_K / 32 * 36];
    __shared__ float sm_e[KO_THREADS];
    __shared__ float sm_red[KO_THREADS];
    __shared__ double sm_sum;
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tokens) return;
    int tid = threadIdx.x;
    int pos = pos0 + t;
    int single = n_tokens == 1;
    int lanes = !single && k_dim % 16 == 0;
    int chains = single && (TY == TY_F32 || TY == TY_F16) ? 4 : 1;
    const bool blocks = ko_blocks(TY);
    u64 row_bytes = blocks ? (u64)(k_dim / 32) * (u32)lowbit_block_bytes(TY)
                           : (u64)k_dim * (TY == TY_F32 ? 4u : 2u);
    if (blocks) {
        u64 qb = lowbit_act_bytes(TY, k_dim);
        const u8* qh = qq + ((u64)t * n_head + h) * qb;
        for (u64 i = tid; i < qb; i += KO_THREADS) sm_qq[i] = qh[i];
    } else {
        const float* qh = q + ((u64)t * n_head + h) * k_dim;
        for (int i = tid; i < k_dim; i += KO_THREADS) {
            float v = qh[i];
            sm_q[i] = TY == TY_F16 ? h2f(f2h(v)) : TY == TY_BF16 ? bf2f(f2bf(v)) : v;
        }
    }
    __syncthreads();
    int n_tiles = (pos + KO_THREADS) / KO_THREADS;

    // Pass 1: the largest score.
    float m = -f_inf();
    for (int tile = 0; tile < n_tiles; tile++) {
        int p = tile * KO_THREADS + tid;
        if (p <= pos) m = fmaxf(m, k_only_score_at<TY>(sm_q, sm_qq, kc + (u64)(p % cells) * row_bytes, k_dim, lanes, scale));
    }
    sm_red[tid] = m;
    __syncthreads();
    if (tid == 0) {
        float big = -f_inf();
        for (int i = 0; i < KO_THREADS; i++) big = fmaxf(big, sm_red[i]);
        sm_red[0] = big;
        sm_sum = 0.0;
    }
    __syncthreads();
    float big = sm_red[0];
    __syncthreads();

    // Pass 2: the denominator, chunk by chunk in order.
    for (int tile = 0; tile < n_tiles; tile++) {
        int p = tile * KO_THREADS + tid;
        float e = 0.f;
        if (p <= pos) e = expf_ggml(k_only_score_at<TY>(sm_q, sm_qq, kc + (u64)(p % cells) * row_bytes, k_dim, lanes, scale) - big);
        sm_e[tid] = e;
        __syncthreads();
        if (tid == 0) {
            for (int c = 0; c < KO_THREADS / 16; c++) {
                if (tile * KO_THREADS + 16 * c <= pos) sm_sum += (double)reduce16_serial(sm_e + 16 * c);
            }
        }
        __syncthreads();
    }
    float inv = (float)(1.0 / sm_sum);

    // Pass 3: the values.
    float acc[KO_DIMS_PER_THREAD][4][16];
    for (int k = 0; k < KO_DIMS_PER_THREAD; k++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 16; l++) acc[k][j][l] = 0.f;
    for (int tile = 0; tile < n_tiles; tile++) {
        int p = tile * KO_THREADS + tid;
        float w = 0.f;
        if (p <= pos) {
            w = expf_ggml(k_only_score_at<TY>(sm_q, sm_qq, kc + (u64)(p % cells) * row_bytes, k_dim, lanes, scale) - big) * inv;
            if (TY == TY_F16) w = h2f(f2h(w));
            if (TY == TY_BF16) w = bf2f(f2bf(w));
        }
        __syncthreads();
        sm_e[tid] = w;
        __syncthreads();
        for (int i = 0; i < KO_THREADS; i++) {
            int pp = tile * KO_THREADS + i;
            if (pp > pos) break;
            const u8* row = kc + (u64)(pp % cells) * row_bytes;
            int chain = (pp / 16) % chains, lane = pp % 16;
            for (int k = 0; k < KO_DIMS_PER_THREAD; k++) {
                int d = tid + k * KO_THREADS;
                if (d >= v_dim) continue;
                acc[k][chain][lane] = fmaf(load_w<TY>(row, d), sm_e[i], acc[k][chain][lane]);
            }
        }
    }
    float* oh = out + ((u64)t * n_head + h) * v_dim;
    for (int k = 0; k < KO_DIMS_PER_THREAD; k++) {
        int d = tid + k * KO_THREADS;
        if (d >= v_dim) continue;
        float folded[16];
        for (int l = 0; l < 16; l++) {
            folded[l] = chains == 4 ? (acc[k][0][l] + acc[k][2][l]) + (acc[k][1][l] + acc[k][3][l])
                                    : acc[k][0][l];
        }
        oh[d] = reduce16_serial(folded);
    }
}

// attn_k_only_<type>(q, qq, kc, out, ...): q the queries (f32; read for f32/f16/bf16 rings),
// qq their Q8_0 or Q8_1 blocks ([n_tokens][n_head][k_dim / 32]; read for block rings), kc the
// ring's bytes (aligned for its element type).
#define K_ONLY(SUFFIX, TY)                                                                      \
    extern "C" __global__ void attn_k_only_##SUFFIX(const float* q, const u8* qq, const u8* kc, \
                                                    float* out, int n_tokens, int n_head,       \
                                                    int k_dim, int v_dim, int cells, int pos0,  \
                                                    float scale) {                              \
        attn_k_only_body<TY>(q, qq, kc, out, n_tokens, n_head, k_dim, v_dim, cells, pos0,       \
                             scale);                                                            \
    }

K_ONLY(f32, TY_F32)
K_ONLY(f16, TY_F16)
K_ONLY(bf16, TY_BF16)
K_ONLY(q8_0, TY_Q8_0)
K_ONLY(q4_0, TY_Q4_0)
K_ONLY(q4_1, TY_Q4_1)
K_ONLY(q5_0, TY_Q5_0)
K_ONLY(q5_1, TY_Q5_1)

// ---------------------------------------------------------------------------------------------
// Expert choice (the CPU device's gate_probs + Routing::select), one thread per token: gate
// probabilities (gating 0: ggml's softmax, whole 16-blocks with expf_ggml summed by halving
// and added in f64, the rest with libm's expf; 1: sigmoid 1 / (1 + expf(-x))); selection
// scores p + bias; with groups > 1, a group scores the f64 sum of its two best scores and only
// the `used` best groups stay eligible; the k best eligible experts (ties: lower id) with
// weights p[e], divided by their f64 sum (at least 2^-14) when norm, times scale unless it is
// 0 or 1. probs and scores: [n][n_expert] scratch. grid = ceil(n / 64), block = 64.

// The index of the largest of the first n values of v not yet taken (taken[i] != 0), ties to
// the lower index.
__device__ int route_best(const float* v, int n, const unsigned char* taken) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

#define ROUTE_MAX_EXPERTS 512
#define ROUTE_MAX_GROUPS 64

extern "C" __global__ void route_f32(const float* logits, const float* bias, int has_bias,
                                     int gating, int* sel, float* weights, float* probs,
                                     float* scores, int n, int n_expert, int k, int n_groups,
                                     int n_used, int norm, float wscale) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* row = logits + (u64)t * n_expert;
    float* p = probs + (u64)t * n_expert;
    float* s = scores + (u64)t * n_expert;
    if (gating == 0) {
        float mx = -f_inf();
        for (int e = 0; e < n_expert; e++) mx = fmaxf(mx, row[e]);
        double sum = 0.0;
        int blocks = n_expert / 16 * 16;
        for (int b = 0; b < blocks; b += 16) {
            for (int l = 0; l < 16; l++) p[b + l] = expf_ggml(row[b + l] - mx);
            sum += (double)reduce16_serial(p + b);
        }
        for (int e = blocks; e < n_expert; e++) {
            p[e] = expf_libm(row[e] - mx);
            sum += (double)p[e];
        }
        float inv = (float)(1.0 / sum);
        for (int e = 0; e < n_expert; e++) p[e] *= inv;
    } else {
        for (int e = 0; e < n_expert; e++) p[e] = 1.0f / (1.0f + expf_libm(-row[e]));
    }
    for (int e = 0; e < n_expert; e++) s[e] = has_bias ? p[e] + bias[e] : p[e];
    unsigned char taken[ROUTE_MAX_EXPERTS];
    if (n_groups > 1) {
        int per = n_expert / n_groups;
        float gs[ROUTE_MAX_GROUPS];
        for (int g = 0; g < n_groups; g++) {
            for (int i = 0; i < per; i++) taken[i] = 0;
            int two = per < 2 ? per : 2;
            double sum = 0.0;
            for (int j = 0; j < two; j++) {
                int b = route_best(s + g * per, per, taken);
                taken[b] = 1;
                sum += (double)s[g * per + b];
            }
            gs[g] = (float)sum;
        }
        unsigned char keep[ROUTE_MAX_GROUPS];
        for (int g = 0; g < n_groups; g++) keep[g] = 0;
        for (int j = 0; j < n_used; j++) keep[route_best(gs, n_groups, keep)] = 1;
        for (int g = 0; g < n_groups; g++) {
            if (!keep[g]) {
                for (int i = 0; i < per; i++) s[g * per + i] = -f_inf();
            }
        }
    }
    for (int e = 0; e < n_expert; e++) taken[e] = 0;
    int* st = sel + (u64)t * k;
    float* wt = weights + (u64)t * k;
    for (int j = 0; j < k; j++) {
        int b = route_best(s, n_expert, taken);
        taken[b] = 1;
        st[j] = b;
        wt[j] = p[b];
    }
    if (norm) {
        double sum = 0.0;
        for (int j = 0; j < k; j++) sum += (double)wt[j];
        float d = fmaxf((float)sum, 6.103515625e-5f);
        for (int j = 0; j < k; j++) wt[j] /= d;
    }
    if (wscale != 0.0f && wscale != 1.0f) {
        for (int j = 0; j < k; j++) wt[j] *= wscale;
    }
}
