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

