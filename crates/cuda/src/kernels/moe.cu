// ---------------------------------------------------------------------------------------------
// MoE experts (gpt-oss): for every (token, slot) pair s = t * k + j with expert e = sel[s]:
//   g = gate_e . x_t + bg_e,  u = up_e . x_t + bu_e,
//   h_s = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)
//   y_s = down_e . h_s + bd_e
//   out_t = sum_j w[t][j] * y_{t*k+j}   (in slot order)
// Expert tensors are [n_expert][rows][cols] with contiguous rows. Out-of-range expert ids give
// zero rows. The biases are [n_expert][rows]; has_bias = 0 ignores them. The kernels below
// serve F32, F16 and BF16 experts (f32 activations; Q8_0 and MXFP4 experts of a few tokens
// take moe_dp4a.cu's kernels, larger batches tiled.cu's and mma.cu's). F32 experts sum in
// vec_dot order when only one slot of the call routes to the expert, else in 16 lanes: the CPU
// device multiplies each expert's tokens as one batch (SiLU experts, act = ACT_SILU: always
// vec_dot, as the CPU device's SwiGLU experts). The activation is gated_act(act, ...).

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

#define MOE_WRAPPERS(SUFFIX, TY)                                                                \
    extern "C" __global__ void moe_gate_up_##SUFFIX(                                           \
        const u8* gate, const u8* up, const float* bg, const float* bu, int has_bias,           \
        const float* x, const int* sel, float* h, int n_slots, int k, int n_expert, int d,      \
        int ff, u64 row_bytes, int act) {                                                       \
        moe_gate_up_impl<TY>(gate, up, bg, bu, has_bias, x, sel, h, n_slots, k, n_expert, d,    \
                             ff, row_bytes, act);                                               \
    }                                                                                           \
    extern "C" __global__ void moe_down_##SUFFIX(const u8* down, const float* bd, int has_bias, \
                                                 const float* h, const int* sel, float* y,      \
                                                 int n_slots, int n_expert, int d, int ff,      \
                                                 u64 row_bytes, int act) {                      \
        moe_down_impl<TY>(down, bd, has_bias, h, sel, y, n_slots, n_expert, d, ff, row_bytes,   \
                          act);                                                                 \
    }

MOE_WRAPPERS(f16, TY_F16)
MOE_WRAPPERS(bf16, TY_BF16)
MOE_WRAPPERS(f32, TY_F32)
