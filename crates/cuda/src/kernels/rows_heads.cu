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
// x: [n_tokens][n_heads][head_dim] (and x2 of n_heads2), rotated in place; pos: [n_tokens].
// grid = (n_heads + n_heads2, n_tokens), block = any (threads loop over the n_dims/2 pairs).

extern "C" __global__ void rope_norm_f32(float* x, int n_heads, float* x2, int n_heads2,
                                         const int* pos, int n_tokens, int head_dim, int first,
                                         int n_dims, float theta_scale, float freq_scale,
                                         float ext_factor, float attn_factor, float corr_low,
                                         float corr_high) {
    float* head = rope_head(x, n_heads, x2, n_heads2, n_tokens, head_dim);
    if (!head) return;
    head += first;
    float p = (float)pos[blockIdx.y];
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

