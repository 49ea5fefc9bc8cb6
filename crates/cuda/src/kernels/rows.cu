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
// Activations of Q8_0 and MXFP4 products: each block of 32 values becomes a Q8_0 block exactly
// as hmoe_quant::quantize_row(Q8_0) (ggml's x86 quantize_row_q8_0) makes it: amax = max |x|,
// d = amax / 127 stored as f16 (round to nearest even), q = x * (127 / amax) (0 when amax is
// 0) rounded half to even and saturated to int8 (a NaN product gives -128, as on the CPU).
// Finite inputs give the CPU's bytes. x: n_blocks blocks of 32 values back to back (rows of
// whole blocks); out: n_blocks * 34 bytes. One thread per block; grid = ceil(n_blocks / 256),
// block = 256.

// The f16 bits of the scale d of a Q8_0 block whose largest magnitude is amax, and in *id the
// factor its values are multiplied by (see quantize_q8_0).
__device__ __forceinline__ u16 q8_0_scale(float amax, float* id) {
    *id = amax != 0.f ? 127.0f / amax : 0.f;
    return f2h(amax / 127.0f);
}

// The quant of the value v in a Q8_0 block of factor id (q8_0_scale).
__device__ __forceinline__ u8 q8_0_quant(float v, float id) {
    return (u8)(int)fminf(fmaxf(rintf(v * id), -128.0f), 127.0f);
}

// The two bytes of a Q8_0 block's scale d, at ob.
__device__ __forceinline__ void q8_0_put_scale(u8* ob, u16 d) {
    ob[0] = (u8)(d & 0xffu);
    ob[1] = (u8)(d >> 8);
}

// One block of 32 values as Q8_0 (see quantize_q8_0).
__device__ void quantize_block_q8_0(const float* xb, u8* ob) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
    float id;
    q8_0_put_scale(ob, q8_0_scale(amax, &id));
    for (int j = 0; j < 32; j++) ob[2 + j] = q8_0_quant(xb[j], id);
}

// One block of 32 values held by a warp (lane j the value j) as Q8_0 at ob: quantize_block_q8_0's
// bytes. The largest magnitude is the same whatever the order of the maxima (fmaxf returns the
// other operand of a NaN, and every lane starts from 0 as quantize_block_q8_0 does, so NaNs are
// passed over in both). Every lane of the warp must call it.
__device__ void quantize_warp_q8_0(float v, u8* ob) {
    float id;
    u16 d = q8_0_scale(warp_max(fmaxf(0.f, fabsf(v))), &id);
    int lane = threadIdx.x % WARP;
    if (lane == 0) q8_0_put_scale(ob, d);
    ob[2 + lane] = q8_0_quant(v, id);
}

extern "C" __global__ void quantize_q8_0(const float* x, u8* out, u64 n_blocks) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    quantize_block_q8_0(x + b * 32u, out + b * 34u);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = x / sqrt(mean(x^2) + eps) * w. Squares in f32, summed in f64 (as the CPU
// device and ggml's CPU backend do). One block per row. With a residual y (add_rms_norm), each
// element first becomes x + y, written back to x (add_assign's bits) and normed as such. With
// q (the *_q8_0 kernels: the activations of the Q8_0/MXFP4 products that read the normed rows),
// each row of out is also written as n / 32 Q8_0 blocks at q, the bytes quantize_q8_0 gives for
// out: n is then a multiple of 32 and the block of 256 threads (a multiple of 32), so that in
// each round of the last loop warp w holds the 32 values of one block (lane j value j) and
// quantizes them together (quantize_warp_q8_0).

__device__ void rms_norm_rows(float* x, const float* y, const float* w, float* out, u8* q,
                              int n_rows, int n, float eps) {
    __shared__ double partial[32];
    int r = blockIdx.x;
    if (r >= n_rows) return;
    float* row = x + (u64)r * n;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (y) {
            v = v + y[(u64)r * n + i];
            row[i] = v;
        }
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
    // Each thread reads back only the elements it wrote above. With q, i < n is the same for
    // every lane of a warp (n and blockDim.x multiples of 32), and element i is lane i % 32 of
    // the row's block i / 32.
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i] * scale * w[i];
        out[(u64)r * n + i] = v;
        if (q) quantize_warp_q8_0(v, q + ((u64)r * (u64)(n / 32) + (u64)(i / 32)) * 34u);
    }
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, int n_rows,
                                        int n, float eps) {
    // Without a residual the row is only read.
    rms_norm_rows((float*)x, nullptr, w, out, nullptr, n_rows, n, eps);
}

// x += y, then out = RMSNorm(x) * w: add_assign then rms_norm in one launch.
extern "C" __global__ void add_rms_norm_f32(float* x, const float* y, const float* w, float* out,
                                            int n_rows, int n, float eps) {
    rms_norm_rows(x, y, w, out, nullptr, n_rows, n, eps);
}

// rms_norm_f32, out also written as Q8_0 blocks at q (quantize_q8_0's bytes of out).
extern "C" __global__ void rms_norm_q8_0_f32(const float* x, const float* w, float* out, u8* q,
                                             int n_rows, int n, float eps) {
    rms_norm_rows((float*)x, nullptr, w, out, q, n_rows, n, eps);
}

// add_rms_norm_f32, out also written as Q8_0 blocks at q (quantize_q8_0's bytes of out).
extern "C" __global__ void add_rms_norm_q8_0_f32(float* x, const float* y, const float* w,
                                                 float* out, u8* q, int n_rows, int n,
                                                 float eps) {
    rms_norm_rows(x, y, w, out, q, n_rows, n, eps);
}

