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

