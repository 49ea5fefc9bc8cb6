// ---------------------------------------------------------------------------------------------
// Chunked flash attention (`-fa on`, and Q8_0/Q4_0 values whatever -fa says): the CPU
// device's chunked kernel (hmoe_backend's numerics: softmax_block, merge_softmax_chunk;
// REF0's `chunked_flash`) bit for bit, split over the positions (flash-decoding) with a fixed
// fold order.
//
// Per (query head, token) row at position pos, seeing first = max(0, pos - window + 1) ..= pos:
// - the positions fall in chunks of CH_CHUNK fixed by position (chunk c: c·256 .. c·256 + 255),
//   each its own softmax from an empty state (m = -inf, s = 0, acc = 0), stepped in blocks of
//   CH_BLOCK positions (block b: b·32 .. b·32 + 31) over the row's visible keys of the block:
//   score = dot · scale, dot by dot_chain for f32/f16 keys (one FMA chain in element order
//   from 0: fmaf(q[e], k[e], s), the query rounded to f16 for f16 keys) or ggml's vec_dot for
//   Q8_0/Q4_0 keys (block_score, the query rotated by k_rot and as Q8_0 blocks); then the
//   block's maximum M of m and the scores, ms = expf(m - M) where M > m (else 1), p =
//   expf(score - M) per key, s = s·ms, s += p key by key, m = M; acc = acc·ms, then acc =
//   fmaf(v, p, acc) key by key, v the value as f32 (Q8_0/Q4_0 values dequantized: kv_value);
// - the chunks fold in position order (merge_softmax_chunk): an empty chunk (m2 = -inf)
//   changes nothing, an empty running state takes the chunk's, else with M = max(m, m2),
//   a = expf(m - M), b = expf(m2 - M): s = fmaf(s2, b, s·a), acc = fmaf(acc2, b, acc·a);
// - the sink folds in last (sink > m: ms = expf(m - sink), acc·ms where ms != 1, s =
//   fmaf(s, ms, 1); else s += expf(sink - m)), then acc · (1 / s) (nothing for inv 1; s 0
//   gives 0), rotated back like the values (fwht_serial over each chunk of v_rot of the head;
//   v_rot 0: not rotated, as float values never are). expf is glibc's (expf_libm).
//
// attn_chunked: one block of CH_THREADS threads per (KV head, group of heads_per_cta of its
// query heads) × chunk slot × tile of tokens_per_cta tokens. It stages each CH_BLOCK of
// positions' K rows (f32/f16 keys, converted to f32) and then V rows (as f32) in shared memory
// once for all its rows (heads × tokens): thread per (row, key) scores, warp per row the softmax,
// thread per (row, dim) the value sums. Positions a token may not see (causal, window) are
// skipped per row. heads_per_cta · tokens_per_cta <= CH_MAX_ROWS rows of head_dim, at most
// CH_MAX_ROWDIMS values together; head_dim a multiple of 16, at most 256.
// - split != 0: chunk c = first(pos0) / CH_CHUNK + blockIdx.y; the block writes every row's
//   chunk state (m, s, acc[head_dim]) that sees c to `part`, record ((slot · n_tokens + t) ·
//   n_head + h) · (head_dim + 2); slots beyond the tile's positions exit at once (the grid may
//   be larger than the chunks the batch sees); attn_chunked_fold folds them.
// - split == 0 (grid.y 1): the block walks its tile's chunks in order and folds them itself,
//   then writes `out` (staged in shared memory for the rotation).
// grid = (n_kv · n_head / (n_kv · heads_per_cta), slots or 1, ceil(n_tokens / tokens_per_cta)).
#define CH_CHUNK 256
#define CH_BLOCK 32
#define CH_THREADS 256
#define CH_MAX_ROWS 64
#define CH_MAX_ROWDIMS 1024
#define CH_ACC (CH_MAX_ROWDIMS / CH_THREADS)
#define CH_MAX_HD 256

// The first position a token at pos sees.
__device__ __forceinline__ int ch_first(int pos, int window) {
    return window > 0 && pos + 1 - window > 0 ? pos + 1 - window : 0;
}

// merge_softmax_chunk of one value dimension: (m2, s2, x2) into (m, s, x); every thread of a
// row computes the same m and s.
__device__ __forceinline__ void ch_merge(float* m, float* s, float* x, float m2, float s2, float x2) {
    if (m2 == -f_inf()) return;
    if (*m == -f_inf()) {
        *m = m2;
        *s = s2;
        *x = x2;
        return;
    }
    float big = fmaxf(*m, m2);
    float a = expf_libm(*m - big), b = expf_libm(m2 - big);
    *s = fmaf(s2, b, *s * a);
    *x = fmaf(x2, b, *x * a);
    *m = big;
}

// The sink folded into (m, s, x), then x / s: FlashRow::finish for one value dimension.
__device__ __forceinline__ float ch_finish(float m, float s, float x, int has_sinks, float sink) {
    if (has_sinks) {
        if (sink > m) {
            float ms = expf_libm(m - sink);
            if (ms != 1.f) x *= ms;
            s = fmaf(s, ms, 1.f);
        } else {
            s += expf_libm(sink - m);
        }
    }
    float inv = s == 0.f ? 0.f : 1.f / s;
    return inv != 1.f ? x * inv : x;
}

extern "C" __global__ void attn_chunked(const float* q, const u8* kc, const u8* vc,
                                        const float* sinks, int has_sinks, float* out,
                                        float* part, int n_tokens, int n_head, int n_kv,
                                        int head_dim, int cells, const int* pos_at, int window,
                                        float scale, int k_ty, int v_ty, int k_rot, int v_rot,
                                        int heads_per_cta, int tokens_per_cta, int split) {
    __shared__ float sm_kv[CH_BLOCK * (CH_MAX_HD + 1)];  // K, then V, of a block's positions
    __shared__ float sm_q[CH_MAX_ROWDIMS];
    __shared__ u8 sm_qb[CH_MAX_ROWDIMS / 32 * 34];
    __shared__ float sm_p[CH_MAX_ROWS * CH_BLOCK];  // scores, then probabilities
    __shared__ float sm_m[CH_MAX_ROWS], sm_s[CH_MAX_ROWS], sm_ms[CH_MAX_ROWS];
    __shared__ float sm_tm[CH_MAX_ROWS], sm_ts[CH_MAX_ROWS];  // the fold (split == 0)
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    int hd = head_dim, stride = hd + 1;
    int group = n_head / n_kv, ctas_per_kv = group / heads_per_cta;
    int kvh = blockIdx.x / ctas_per_kv;
    int h0 = kvh * group + (blockIdx.x % ctas_per_kv) * heads_per_cta;
    int t0 = blockIdx.z * tokens_per_cta;
    int pos0 = read_pos0(pos_at, n_tokens, cells, window);
    if (t0 >= n_tokens || pos0 < 0) return;
    int nt = n_tokens - t0 < tokens_per_cta ? n_tokens - t0 : tokens_per_cta;
    int rows = heads_per_cta * nt;
    // Row r: head h0 + r % heads_per_cta, token t0 + r / heads_per_cta.
    int first_lo = ch_first(pos0 + t0, window), pos_hi = pos0 + t0 + nt - 1;
    int c_lo = first_lo / CH_CHUNK, c_hi = pos_hi / CH_CHUNK;
    if (split) {
        int c = ch_first(pos0, window) / CH_CHUNK + (int)blockIdx.y;
        if (c < c_lo || c > c_hi) return;
        c_lo = c_hi = c;
    }
    u64 width = (u64)n_kv * hd, kv_off = (u64)kvh * hd;
    bool kq = k_ty == TY_Q8_0 || k_ty == TY_Q4_0;

    // The query rows, converted for the keys.
    for (int i = tid; i < rows * hd; i += blockDim.x) {
        int r = i / hd, e = i % hd;
        float x = q[((u64)(t0 + r / heads_per_cta) * n_head + h0 + r % heads_per_cta) * hd + e];
        sm_q[i] = k_ty == TY_F16 ? h2f(f2h(x)) : x;
    }
    __syncthreads();
    if (kq && k_rot > 0) {
        for (int r = tid; r < rows; r += blockDim.x) {
            for (int c = 0; c < hd; c += k_rot) fwht_serial(sm_q + r * hd + c, k_rot);
        }
    }
    __syncthreads();
    if (kq) {
        for (int i = tid; i < rows * hd / 32; i += blockDim.x) quantize_block_q8_0(sm_q + 32 * i, sm_qb + 34 * i);
    }
    if (tid < rows) {
        sm_tm[tid] = -f_inf();
        sm_ts[tid] = 0.f;
    }
    float acc[CH_ACC], tot[CH_ACC];
#pragma unroll
    for (int k = 0; k < CH_ACC; k++) tot[k] = 0.f;
    __syncthreads();

    for (int c = c_lo; c <= c_hi; c++) {
        int lo = c * CH_CHUNK > first_lo ? c * CH_CHUNK : first_lo;
        int hi = (c + 1) * CH_CHUNK < pos_hi + 1 ? (c + 1) * CH_CHUNK : pos_hi + 1;
        if (tid < rows) {
            sm_m[tid] = -f_inf();
            sm_s[tid] = 0.f;
        }
#pragma unroll
        for (int k = 0; k < CH_ACC; k++) acc[k] = 0.f;
        __syncthreads();
        for (int b0 = lo / CH_BLOCK * CH_BLOCK; b0 < hi; b0 += CH_BLOCK) {
            int bs = b0 > lo ? b0 : lo, be = b0 + CH_BLOCK < hi ? b0 + CH_BLOCK : hi;
            // Float keys of the block's positions (any row sees) into shared memory.
            if (!kq) {
                for (int i = tid; i < (be - bs) * hd; i += blockDim.x) {
                    int pp = bs + i / hd, e = i % hd;
                    sm_kv[(pp - b0) * stride + e] = kv_float(kc, k_ty, (u64)(pp % cells) * width + kv_off + e);
                }
            }
            __syncthreads();
            // Scores: thread per (row, key) the row sees.
            for (int i = tid; i < rows * CH_BLOCK; i += blockDim.x) {
                int r = i / CH_BLOCK, j = i % CH_BLOCK, pp = b0 + j;
                int pos = pos0 + t0 + r / heads_per_cta;
                if (pp < ch_first(pos, window) || pp > pos) continue;
                const float* qr = sm_q + r * hd;
                float dot;
                if (kq) {
                    dot = block_score(sm_qb + r * (hd / 32) * 34, kc, k_ty, (u64)(pp % cells) * width + kv_off, hd);
                } else {
                    const float* kr = sm_kv + j * stride;
                    dot = 0.f;
                    for (int e = 0; e < hd; e++) dot = fmaf(qr[e], kr[e], dot);
                }
                sm_p[r * CH_BLOCK + j] = dot * scale;
            }
            __syncthreads();
            // The block's values into shared memory as f32 (the keys are no longer read).
            for (int i = tid; i < (be - bs) * hd; i += blockDim.x) {
                int pp = bs + i / hd, e = i % hd;
                sm_kv[(pp - b0) * stride + e] = kv_value(vc, v_ty, (u64)(pp % cells) * width + kv_off + e);
            }
            // softmax_block: warp per row, lane per key.
            for (int r = warp; r < rows; r += blockDim.x / WARP) {
                int pos = pos0 + t0 + r / heads_per_cta, f = ch_first(pos, window);
                int klo = f > b0 ? f - b0 : 0, khi = pos + 1 - b0 < CH_BLOCK ? pos + 1 - b0 : CH_BLOCK;
                if (klo >= khi) continue;  // the row sees no key of this block
                bool mine = lane >= klo && lane < khi;
                float x = mine ? sm_p[r * CH_BLOCK + lane] : -f_inf();
                // The largest score, NaN never winning (the CPU's `x > big` fold).
                float wmax = warp_max(x == x ? x : -f_inf());
                float m = sm_m[r];
                float big = wmax > m ? wmax : m;
                float ms = big > m ? expf_libm(m - big) : 1.f;
                if (mine) sm_p[r * CH_BLOCK + lane] = expf_libm(x - big);
                __syncwarp();
                if (lane == 0) {
                    float s = sm_s[r] * ms;
                    for (int j = klo; j < khi; j++) s += sm_p[r * CH_BLOCK + j];
                    sm_s[r] = s;
                    sm_m[r] = big;
                    sm_ms[r] = ms;
                }
                __syncwarp();
            }
            __syncthreads();
            // Values: thread per (row, dim), keys in order.
#pragma unroll
            for (int k = 0; k < CH_ACC; k++) {
                int i = tid + k * CH_THREADS;
                if (i < rows * hd) {
                    int r = i / hd, d = i % hd;
                    int pos = pos0 + t0 + r / heads_per_cta, f = ch_first(pos, window);
                    int klo = f > b0 ? f - b0 : 0, khi = pos + 1 - b0 < CH_BLOCK ? pos + 1 - b0 : CH_BLOCK;
                    if (klo < khi) {
                        float a = acc[k] * sm_ms[r];
                        for (int j = klo; j < khi; j++) a = fmaf(sm_kv[j * stride + d], sm_p[r * CH_BLOCK + j], a);
                        acc[k] = a;
                    }
                }
            }
            __syncthreads();
        }
        if (split) {
            // The chunk state of every row that sees chunk c.
            int slot = blockIdx.y;
            for (int r = tid; r < rows; r += blockDim.x) {
                int t = t0 + r / heads_per_cta, pos = pos0 + t;
                if (ch_first(pos, window) / CH_CHUNK > c || pos / CH_CHUNK < c) continue;
                float* rec = part + (((u64)slot * n_tokens + t) * n_head + h0 + r % heads_per_cta) * (hd + 2);
                rec[0] = sm_m[r];
                rec[1] = sm_s[r];
            }
#pragma unroll
            for (int k = 0; k < CH_ACC; k++) {
                int i = tid + k * CH_THREADS;
                if (i < rows * hd) {
                    int r = i / hd, d = i % hd;
                    int t = t0 + r / heads_per_cta, pos = pos0 + t;
                    if (ch_first(pos, window) / CH_CHUNK > c || pos / CH_CHUNK < c) continue;
                    part[(((u64)slot * n_tokens + t) * n_head + h0 + r % heads_per_cta) * (hd + 2) + 2 + d] = acc[k];
                }
            }
            return;
        }
        // Fold chunk c into the running state (a row that does not see c has an empty state).
#pragma unroll
        for (int k = 0; k < CH_ACC; k++) {
            int i = tid + k * CH_THREADS;
            if (i < rows * hd) {
                int r = i / hd;
                float m = sm_tm[r], s = sm_ts[r];
                ch_merge(&m, &s, &tot[k], sm_m[r], sm_s[r], acc[k]);
            }
        }
        __syncthreads();
        for (int r = tid; r < rows; r += blockDim.x) {
            float x = 0.f;
            ch_merge(&sm_tm[r], &sm_ts[r], &x, sm_m[r], sm_s[r], 0.f);
        }
        __syncthreads();
    }
    // Each row's result into sm_q (the queries are no longer read), rotated back, then out.
#pragma unroll
    for (int k = 0; k < CH_ACC; k++) {
        int i = tid + k * CH_THREADS;
        if (i < rows * hd) {
            int r = i / hd;
            float sink = has_sinks ? sinks[h0 + r % heads_per_cta] : 0.f;
            sm_q[i] = ch_finish(sm_tm[r], sm_ts[r], tot[k], has_sinks, sink);
        }
    }
    __syncthreads();
    if (v_rot > 0) {
        for (int i = tid; i < rows * hd / v_rot; i += blockDim.x) fwht_serial(sm_q + i * v_rot, v_rot);
        __syncthreads();
    }
    for (int i = tid; i < rows * hd; i += blockDim.x) {
        int r = i / hd;
        out[((u64)(t0 + r / heads_per_cta) * n_head + h0 + r % heads_per_cta) * hd + i % hd] = sm_q[i];
    }
}

// attn_chunked_fold: the chunk states attn_chunked (split != 0) wrote for each (head, token)
// folded in position order (merge_softmax_chunk), the sink added, acc / s rotated back like
// the values (v_rot, as attn_chunked) and written to out; thread d keeps value dimension d.
// grid = (n_head, n_tokens), block = head_dim rounded up to a multiple of 32.
extern "C" __global__ void attn_chunked_fold(const float* part, const float* sinks,
                                             int has_sinks, float* out, int n_tokens,
                                             int n_head, int head_dim, int cells,
                                             const int* pos_at, int window, int v_rot) {
    __shared__ float sm_o[CH_MAX_HD];
    int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    int pos0 = read_pos0(pos_at, n_tokens, cells, window);
    if (h >= n_head || t >= n_tokens || pos0 < 0) return;
    int pos = pos0 + t;
    if (d < head_dim) {
        int c0 = ch_first(pos0, window) / CH_CHUNK;
        float m = -f_inf(), s = 0.f, x = 0.f;
        for (int c = ch_first(pos, window) / CH_CHUNK; c <= pos / CH_CHUNK; c++) {
            const float* rec = part + (((u64)(c - c0) * n_tokens + t) * n_head + h) * (head_dim + 2);
            ch_merge(&m, &s, &x, rec[0], rec[1], rec[2 + d]);
        }
        float sink = has_sinks ? sinks[h] : 0.f;
        sm_o[d] = ch_finish(m, s, x, has_sinks, sink);
    }
    __syncthreads();
    if (v_rot > 0) {
        if (d < head_dim / v_rot) fwht_serial(sm_o + d * v_rot, v_rot);
        __syncthreads();
    }
    if (d < head_dim) out[((u64)t * n_head + h) * head_dim + d] = sm_o[d];
}
