// ---------------------------------------------------------------------------------------------
// Router (gpt-oss): per token, the k largest logits (ties: lower index first), then a softmax
// over those k only (exps summed in f64, as the CPU device does). sel: [n][k] expert ids,
// weights: [n][k].

// The top-k and softmax of one row of n_expert logits into sel[0..k] and w[0..k]. Called by
// every lane of one warp (it shuffles); lane 0 writes.
__device__ void router_topk_row(const float* row, int* sel, float* w, int n_expert, int k) {
    int lane = threadIdx.x % WARP;
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
            sel[i] = bi;
            w[i] = bv;
        }
        pv = bv;
        pi = bi;
    }
    __syncwarp();
    if (lane == 0) {
        // As the CPU device's softmax: exps summed in f64, times the f32 of 1 / sum.
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

// The router of logits already computed: one warp per token.
// grid = ceil(n / ROW_WARPS), block = ROW_WARPS * 32.
extern "C" __global__ void router_topk_softmax(const float* logits, int* sel, float* weights,
                                               int n, int n_expert, int k) {
    int t = blockIdx.x * ROW_WARPS + threadIdx.x / WARP;
    if (t >= n) return;
    router_topk_row(logits + (u64)t * n_expert, sel + (u64)t * k, weights + (u64)t * k,
                    n_expert, k);
}

// The router's product and its choice in one launch (decode): logits[t][r] = W[r] . x[t]
// (+ bias[r]) as matmul_impl computes them for matmul_f32/f16/bf16 (the same device code, so
// their bits), then, in the block that finishes last, router_topk_row of each token's row.
// The hand-off: every block makes its logits visible to the grid (__threadfence) and counts
// itself done with atomicInc on `done`, which wraps to 0 on the last block's count, so the
// counter is 0 again for the next launch (and a CUDA graph's replays); the block that counted
// last reads every block's logits. `done` must be 0 before the launch and no other launch
// may use it at the same time (the device's one counter, launches on its one stream).
// n <= MM_TOKENS (one token tile: grid.y = 1). grid = ceil(rows / ROW_WARPS), block =
// ROW_WARPS * 32.
template <int TY>
__device__ void router_logits_topk_impl(const u8* w, u64 row_bytes, const float* x, float* logits,
                                        const float* bias, int rows, int cols, int n, int* sel,
                                        float* weights, int k, unsigned* done) {
    __shared__ int last;
    matmul_impl<TY>(w, row_bytes, x, logits, bias, rows, cols, n);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicInc(done, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = threadIdx.x / WARP; t < n; t += ROW_WARPS) {
        router_topk_row(logits + (u64)t * rows, sel + (u64)t * k, weights + (u64)t * k, rows, k);
    }
}

#define ROUTER_LOGITS(SUFFIX, TY)                                                                \
    extern "C" __global__ void router_logits_topk_##SUFFIX(                                      \
        const u8* w, u64 row_bytes, const float* x, float* logits, const float* bias, int rows,  \
        int cols, int n, int* sel, float* weights, int k, unsigned* done) {                      \
        router_logits_topk_impl<TY>(w, row_bytes, x, logits, bias, rows, cols, n, sel, weights,  \
                                    k, done);                                                    \
    }
ROUTER_LOGITS(f32, TY_F32)
ROUTER_LOGITS(f16, TY_F16)
ROUTER_LOGITS(bf16, TY_BF16)
