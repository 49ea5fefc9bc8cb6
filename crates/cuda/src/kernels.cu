// hmoe CUDA kernels for gpt-oss's dense part and MoE experts.
//
// Compiled at start-up by NVRTC (see kernels.rs). Header-free on purpose: no cuda_fp16.h or
// cuda_bf16.h, which NVRTC can only find with the toolkit's include path. Half and bfloat16
// values travel as `unsigned short` bits and are converted with one PTX instruction (f16) or
// a shift (bf16). Compiled with --fmad=false: every fused multiply-add below is an explicit
// fmaf, so the rounding follows the CPU engine's order where it matters (RoPE).
//
// Weight types (ggml ids): F32 0, F16 1, Q8_0 8, BF16 30, MXFP4 39. Rows of a weight matrix
// are contiguous; a row of `cols` elements takes `row_bytes` bytes (GGUF layout).
//   Q8_0:  blocks of 32 = f16 scale d (2 bytes) + 32 int8 q;  x = q * d.
//   MXFP4: blocks of 32 = E8M0 byte e + 16 bytes of nibbles; element j < 16 is the low nibble
//          of byte j, element j >= 16 the high nibble of byte j - 16; x = KV[nib] * 2^(e-128)
//          with KV the E2M1 table doubled {0,1,2,3,4,6,8,12,-0,-1,-2,-3,-4,-6,-8,-12}.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define TY_F32 0
#define TY_F16 1
#define TY_Q8_0 8
#define TY_BF16 30
#define TY_MXFP4 39
// Warps per block of the row-per-warp kernels; tokens per block of the matmul kernel.
#define ROW_WARPS 4
#define MM_TOKENS 8

__device__ __forceinline__ float f_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
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

__device__ __forceinline__ float mxfp4_value(u32 nib) {
    // Doubled E2M1 values; the sign is bit 3.
    const float mag[8] = {0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f};
    float v = mag[nib & 7u];
    return (nib & 8u) ? -v : v;
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

// Lane's partial dot product of one weight row with one f32 vector (elements lane, lane+32, ...).
template <int TY>
__device__ __forceinline__ float row_dot_partial(const u8* row, const float* x, int cols) {
    float acc = 0.f;
    for (int e = threadIdx.x % WARP; e < cols; e += WARP) {
        acc = fmaf(load_w<TY>(row, e), x[e], acc);
    }
    return acc;
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

extern "C" __global__ void get_rows_f32(const u8* table, u64 row_bytes, int n_rows,
    const int* ids, float* out, int n_tokens, int cols) {
    get_rows_impl<TY_F32>(table, row_bytes, n_rows, ids, out, n_tokens, cols);
}
extern "C" __global__ void get_rows_f16(const u8* table, u64 row_bytes, int n_rows,
    const int* ids, float* out, int n_tokens, int cols) {
    get_rows_impl<TY_F16>(table, row_bytes, n_rows, ids, out, n_tokens, cols);
}
extern "C" __global__ void get_rows_bf16(const u8* table, u64 row_bytes, int n_rows,
    const int* ids, float* out, int n_tokens, int cols) {
    get_rows_impl<TY_BF16>(table, row_bytes, n_rows, ids, out, n_tokens, cols);
}
extern "C" __global__ void get_rows_q8_0(const u8* table, u64 row_bytes, int n_rows,
    const int* ids, float* out, int n_tokens, int cols) {
    get_rows_impl<TY_Q8_0>(table, row_bytes, n_rows, ids, out, n_tokens, cols);
}
extern "C" __global__ void get_rows_mxfp4(const u8* table, u64 row_bytes, int n_rows,
    const int* ids, float* out, int n_tokens, int cols) {
    get_rows_impl<TY_MXFP4>(table, row_bytes, n_rows, ids, out, n_tokens, cols);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = x / sqrt(mean(x^2) + eps) * w. Squares in f32, summed in f64 (as the CPU
// engine and ggml's CPU backend do). One block per row.

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
// Matmul: y[t][r] = sum_c W[r][c] * x[t][c] for weights of type TY, f32 activations. One warp
// per output row, up to MM_TOKENS tokens per block (grid.y covers the rest).
// grid = (ceil(rows / ROW_WARPS), ceil(n / MM_TOKENS)), block = ROW_WARPS * 32.

template <int TY>
__device__ void matmul_impl(const u8* w, u64 row_bytes, const float* x, float* y, int rows,
                            int cols, int n) {
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (r >= rows) return;
    int t0 = blockIdx.y * MM_TOKENS;
    int nt = n - t0 < MM_TOKENS ? n - t0 : MM_TOKENS;
    const u8* row = w + (u64)r * row_bytes;
    float acc[MM_TOKENS];
#pragma unroll
    for (int i = 0; i < MM_TOKENS; i++) acc[i] = 0.f;
    for (int e = threadIdx.x % WARP; e < cols; e += WARP) {
        float wv = load_w<TY>(row, e);
#pragma unroll
        for (int i = 0; i < MM_TOKENS; i++) {
            if (i < nt) acc[i] = fmaf(wv, x[(u64)(t0 + i) * cols + e], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < MM_TOKENS; i++) {
        float s = warp_sum(acc[i]);
        if (i < nt && threadIdx.x % WARP == 0) y[(u64)(t0 + i) * rows + r] = s;
    }
}

extern "C" __global__ void matmul_f32(const u8* w, u64 row_bytes, const float* x, float* y,
                                      int rows, int cols, int n) {
    matmul_impl<TY_F32>(w, row_bytes, x, y, rows, cols, n);
}
extern "C" __global__ void matmul_f16(const u8* w, u64 row_bytes, const float* x, float* y,
                                      int rows, int cols, int n) {
    matmul_impl<TY_F16>(w, row_bytes, x, y, rows, cols, n);
}
extern "C" __global__ void matmul_bf16(const u8* w, u64 row_bytes, const float* x, float* y,
                                       int rows, int cols, int n) {
    matmul_impl<TY_BF16>(w, row_bytes, x, y, rows, cols, n);
}
extern "C" __global__ void matmul_q8_0(const u8* w, u64 row_bytes, const float* x, float* y,
                                       int rows, int cols, int n) {
    matmul_impl<TY_Q8_0>(w, row_bytes, x, y, rows, cols, n);
}
extern "C" __global__ void matmul_mxfp4(const u8* w, u64 row_bytes, const float* x, float* y,
                                        int rows, int cols, int n) {
    matmul_impl<TY_MXFP4>(w, row_bytes, x, y, rows, cols, n);
}

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
// RoPE, NeoX layout (element i pairs with i + n_dims/2), with YaRN, as the CPU engine computes
// it: theta = pos * theta_scale^i by repeated multiplication, interpolation/extrapolation blend
// by the ramp between the (floored/ceiled) correction dims, magnitude attn_factor (times
// 1 + 0.1 ln(1/freq_scale) when ext_factor != 0), rotations as fmaf(x0, c, -(x1 s)).
// x: [n_tokens][n_heads][head_dim], rotated in place; pos: [n_tokens].
// grid = (n_heads, n_tokens), block = any (threads loop over the n_dims/2 pairs).

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
        float c = cosf(theta) * mscale;
        float s = sinf(theta) * mscale;
        float x0 = head[i], x1 = head[i + half];
        head[i] = fmaf(x0, c, -(x1 * s));
        head[i + half] = fmaf(x0, s, x1 * c);
    }
}

// ---------------------------------------------------------------------------------------------
// KV cache. Row `width` = n_kv_heads * head_dim values per cell; the cache is a ring of
// `cells` cells and token t of the batch goes to cell (pos0 + t) % cells.

extern "C" __global__ void kv_store_f16(const float* src, u16* cache, int n_tokens, int width,
                                        int cells, int pos0) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n_tokens * width) return;
    int t = (int)(i / (u64)width), c = (int)(i % (u64)width);
    u64 cell = (u64)((pos0 + t) % cells);
    cache[cell * width + c] = f2h(src[i]);
}

// Attention over an f16 KV cache with GQA, an optional sliding window and optional per-head
// sink logits (gpt-oss): the sink joins the softmax's denominator and adds no value.
// q, out: [n_tokens][n_head][head_dim] f32 (q already rotated). Token t sits at position
// pos0 + t and sees keys max(0, pos - window + 1) ..= pos (window 0: all of 0 ..= pos).
// One block per (head, token); each warp runs an online softmax over every nw-th key, lanes
// own dims lane, lane+32, ...; the warps' partial states are merged at the end.
// head_dim must be a multiple of 32 and at most 256. grid = (n_head, n_tokens),
// block = ATT_WARPS * 32.
#define ATT_WARPS 8
#define ATT_MAX_PER_LANE 8

extern "C" __global__ void attn_f16(const float* q, const u16* kc, const u16* vc,
                                    const float* sinks, int has_sinks, float* out, int n_tokens,
                                    int n_head, int n_kv, int head_dim, int cells, int pos0,
                                    int window, float scale) {
    __shared__ float sm_m[ATT_WARPS];
    __shared__ float sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][ATT_MAX_PER_LANE * WARP];
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tokens) return;
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    int per = head_dim / WARP;
    int pos = pos0 + t;
    int first = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    int kvh = h / (n_head / n_kv);
    u64 width = (u64)n_kv * head_dim;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    float qv[ATT_MAX_PER_LANE], acc[ATT_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATT_MAX_PER_LANE; i++) {
        qv[i] = i < per ? qh[i * WARP + lane] : 0.f;
        acc[i] = 0.f;
    }
    float m = -f_inf(), l = 0.f;
    for (int p = first + wid; p <= pos; p += ATT_WARPS) {
        u64 base = (u64)(p % cells) * width + (u64)kvh * head_dim;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < ATT_MAX_PER_LANE; i++) {
            if (i < per) s = fmaf(qv[i], h2f(kc[base + i * WARP + lane]), s);
        }
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);
        float e = expf(s - m_new);
        l = fmaf(l, corr, e);
#pragma unroll
        for (int i = 0; i < ATT_MAX_PER_LANE; i++) {
            if (i < per) acc[i] = fmaf(acc[i], corr, e * h2f(vc[base + i * WARP + lane]));
        }
        m = m_new;
    }
    if (lane == 0) {
        sm_m[wid] = m;
        sm_l[wid] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_MAX_PER_LANE; i++) {
        if (i < per) sm_acc[wid][i * WARP + lane] = acc[i];
    }
    __syncthreads();
    float big = has_sinks ? sinks[h] : -f_inf();
    for (int w = 0; w < ATT_WARPS; w++) big = fmaxf(big, sm_m[w]);
    float denom = has_sinks ? expf(sinks[h] - big) : 0.f;
    for (int w = 0; w < ATT_WARPS; w++) {
        if (sm_m[w] != -f_inf()) denom += sm_l[w] * expf(sm_m[w] - big);
    }
    float* oh = out + ((u64)t * n_head + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) {
            if (sm_m[w] != -f_inf()) v += sm_acc[w][d] * expf(sm_m[w] - big);
        }
        oh[d] = denom > 0.f ? v / denom : 0.f;
    }
}

// ---------------------------------------------------------------------------------------------
// Router: per token, the k largest logits (ties: lower index first), then a softmax over
// those k only. sel: [n][k] expert ids, weights: [n][k]. One warp per token;
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
        float* w = weights + (u64)t * k;
        float mx = w[0];
        float sum = 0.f;
        for (int i = 0; i < k; i++) {
            w[i] = expf(w[i] - mx);
            sum += w[i];
        }
        float inv = 1.0f / sum;
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
// zero rows. The biases are [n_expert][rows]; has_bias = 0 ignores them.

__device__ __forceinline__ float swiglu_oai(float g, float u) {
    float x = fminf(g, 7.0f);
    float y = fminf(fmaxf(u, -7.0f), 7.0f);
    return x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
}

// grid = (ceil(ff / ROW_WARPS), n_slots), block = ROW_WARPS * 32. h: [n_slots][ff].
template <int TY>
__device__ void moe_gate_up_impl(const u8* gate, const u8* up, const float* bg, const float* bu,
                                 int has_bias, const float* x, const int* sel, float* h,
                                 int n_slots, int k, int n_expert, int d, int ff, u64 row_bytes) {
    int slot = blockIdx.y;
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (slot >= n_slots || r >= ff) return;
    int e = sel[slot];
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x % WARP == 0) h[(u64)slot * ff + r] = 0.f;
        return;
    }
    u64 off = ((u64)e * ff + r) * row_bytes;
    const float* xt = x + (u64)(slot / k) * d;
    float g = warp_sum(row_dot_partial<TY>(gate + off, xt, d));
    float u = warp_sum(row_dot_partial<TY>(up + off, xt, d));
    if (threadIdx.x % WARP == 0) {
        if (has_bias) {
            g += bg[(u64)e * ff + r];
            u += bu[(u64)e * ff + r];
        }
        h[(u64)slot * ff + r] = swiglu_oai(g, u);
    }
}

// grid = (ceil(d / ROW_WARPS), n_slots), block = ROW_WARPS * 32. y: [n_slots][d].
template <int TY>
__device__ void moe_down_impl(const u8* down, const float* bd, int has_bias, const float* h,
                              const int* sel, float* y, int n_slots, int n_expert, int d, int ff,
                              u64 row_bytes) {
    int slot = blockIdx.y;
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (slot >= n_slots || r >= d) return;
    int e = sel[slot];
    if (e < 0 || e >= n_expert) {
        if (threadIdx.x % WARP == 0) y[(u64)slot * d + r] = 0.f;
        return;
    }
    u64 off = ((u64)e * d + r) * row_bytes;
    float s = warp_sum(row_dot_partial<TY>(down + off, h + (u64)slot * ff, ff));
    if (threadIdx.x % WARP == 0) {
        if (has_bias) s += bd[(u64)e * d + r];
        y[(u64)slot * d + r] = s;
    }
}

#define MOE_WRAPPERS(SUFFIX, TY)                                                                \
    extern "C" __global__ void moe_gate_up_##SUFFIX(                                           \
        const u8* gate, const u8* up, const float* bg, const float* bu, int has_bias,           \
        const float* x, const int* sel, float* h, int n_slots, int k, int n_expert, int d,      \
        int ff, u64 row_bytes) {                                                                \
        moe_gate_up_impl<TY>(gate, up, bg, bu, has_bias, x, sel, h, n_slots, k, n_expert, d,    \
                             ff, row_bytes);                                                    \
    }                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(const u8* down, const float* bd, int has_bias, \
                                                 const float* h, const int* sel, float* y,      \
                                                 int n_slots, int n_expert, int d, int ff,      \
                                                 u64 row_bytes) {                               \
        moe_down_impl<TY>(down, bd, has_bias, h, sel, y, n_slots, n_expert, d, ff, row_bytes);  \
    }

MOE_WRAPPERS(mxfp4, TY_MXFP4)
MOE_WRAPPERS(q8_0, TY_Q8_0)
MOE_WRAPPERS(f16, TY_F16)
MOE_WRAPPERS(bf16, TY_BF16)
MOE_WRAPPERS(f32, TY_F32)

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
