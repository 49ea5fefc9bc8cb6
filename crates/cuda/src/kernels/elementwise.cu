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
// x: [n_tokens][n_heads][head_dim] (and x2 of n_heads2), rotated in place; pos: [n_tokens].
// grid = (n_heads + n_heads2, n_tokens), block = any (threads loop over the n_dims/2 pairs).

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

// The head a RoPE block rotates: head blockIdx.x of x (n_heads of them), then of x2 (n_heads2;
// none when x2 is unused), of token blockIdx.y; null past them.
__device__ __forceinline__ float* rope_head(float* x, int n_heads, float* x2, int n_heads2,
                                            int n_tokens, int head_dim) {
    int h = blockIdx.x, t = blockIdx.y;
    if (t >= n_tokens) return nullptr;
    if (h < n_heads) return x + ((u64)t * n_heads + h) * head_dim;
    h -= n_heads;
    return h < n_heads2 ? x2 + ((u64)t * n_heads2 + h) * head_dim : nullptr;
}

// x and x2 (the queries and the keys) rotated at the same positions; grid = (n_heads +
// n_heads2, n_tokens).
extern "C" __global__ void rope_neox_f32(float* x, int n_heads, float* x2, int n_heads2,
                                         const int* pos, int n_tokens, int head_dim, int n_dims,
                                         float theta_scale, float freq_scale, float ext_factor,
                                         float attn_factor, float corr_low, float corr_high) {
    float* head = rope_head(x, n_heads, x2, n_heads2, n_tokens, head_dim);
    if (!head) return;
    int half = n_dims / 2;
    float p = (float)pos[blockIdx.y];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        rope_cos_sin(p, i, theta_scale, freq_scale, ext_factor, attn_factor, corr_low, corr_high,
                     &c, &s);
        float x0 = head[i], x1 = head[i + half];
        head[i] = fmaf(x0, c, -(x1 * s));
        head[i + half] = fmaf(x0, s, x1 * c);
    }
}

