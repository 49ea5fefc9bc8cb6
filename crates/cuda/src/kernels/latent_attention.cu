// ---------------------------------------------------------------------------------------------
// Attention over a K-only ring (multi-head latent attention in its absorbed form) of any K/V
// type (TY: f32, f16, bf16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; not rotated): every query head
// against the one key head; the value of a position is the first v_dim elements of its key.
// q: [n_tokens][n_head][k_dim] f32, out: [n_tokens][n_head][v_dim]. Token t sits at position
// pos0 + t and sees 0 ..= pos (pos0 read on the device: read_pos0).
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
// What runs when (latent_attention.rs): a call of at most 16 Mi scores (n_tokens × n_head ×
// cells, hmoe_backend's K_ONLY_SCORES_MAX: short prefill), or of one token and at most 64 Mi
// (K_ONLY_DECODE_SCORES_MAX: decode, up to DeepSeek-V3's whole context) runs split over
// positions
// (latent_split.cu: scores, weights, values through a scratch of those scores, every key and
// value read once per group of heads); a larger one (long prefill) runs attn_k_only_<type>
// here, which needs no scratch but scores every position three times per head. Both take
// k_dim <= KO_MAX_K, v_dim <= KO_THREADS * KO_DIMS_PER_THREAD; block rings: k_dim and v_dim
// multiples of 32. This file also holds the scoring and reduction helpers both use.
//
// attn_k_only_<type>: one block per (head, token), KO_THREADS threads, three passes over the
// positions (the largest score, the denominator, the values): each thread scores one
// position of a tile of KO_THREADS positions (whole chunks) at a time, serially in the CPU's
// order; thread d accumulates value dims d, d + KO_THREADS.
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

// The bytes of one key row of k_dim values of TY.
template <int TY>
__device__ __forceinline__ u64 ko_row_bytes(int k_dim) {
    return ko_blocks(TY) ? (u64)(k_dim / 32) * (u32)lowbit_block_bytes(TY)
                         : (u64)k_dim * (TY == TY_F32 ? 4u : 2u);
}

// Stages the queries of heads h0 .. h0 + count - 1 of token t (consecutive in q and qq) in
// shared memory, as the keys' vec_dot takes them: into sm_qq their blocks (qb bytes each) for
// block rings, else into sm_q converted (f16 / bf16 rounded for f16 / bf16 keys). The caller
// synchronises.
template <int TY>
__device__ void ko_stage_queries(const float* q, const u8* qq, float* sm_q, u8* sm_qq, int t,
                                 int n_head, int h0, int count, int k_dim, u64 qb) {
    int tid = threadIdx.x;
    if (ko_blocks(TY)) {
        const u8* qg = qq + ((u64)t * n_head + h0) * qb;
        for (u64 i = tid; i < (u64)count * qb; i += KO_THREADS) sm_qq[i] = qg[i];
    } else {
        const float* qg = q + ((u64)t * n_head + h0) * k_dim;
        for (int i = tid; i < count * k_dim; i += KO_THREADS) {
            float v = qg[i];
            sm_q[i] = TY == TY_F16 ? h2f(f2h(v)) : TY == TY_BF16 ? bf2f(f2bf(v)) : v;
        }
    }
}

// A probability as the values' products take it: rounded to f16 / bf16 for f16 / bf16 rings.
template <int TY>
__device__ __forceinline__ float ko_round_weight(float w) {
    return TY == TY_F16 ? h2f(f2h(w)) : TY == TY_BF16 ? bf2f(f2bf(w)) : w;
}

// The largest of the block's threads' m (sm_red: KO_THREADS floats of scratch, free again on
// return).
__device__ float ko_block_max(float m, float* sm_red) {
    int tid = threadIdx.x;
    sm_red[tid] = m;
    __syncthreads();
    if (tid == 0) {
        float big = -f_inf();
        for (int i = 0; i < KO_THREADS; i++) big = fmaxf(big, sm_red[i]);
        sm_red[0] = big;
    }
    __syncthreads();
    float big = sm_red[0];
    __syncthreads();
    return big;
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
    u64 row_bytes = ko_row_bytes<TY>(k_dim);
    u64 qb = ko_blocks(TY) ? lowbit_act_bytes(TY, k_dim) : 0;
    ko_stage_queries<TY>(q, qq, sm_q, sm_qq, t, n_head, h, 1, k_dim, qb);
    if (tid == 0) sm_sum = 0.0;
    __syncthreads();
    int n_tiles = (pos + KO_THREADS) / KO_THREADS;

    // Pass 1: the largest score.
    float m = -f_inf();
    for (int tile = 0; tile < n_tiles; tile++) {
        int p = tile * KO_THREADS + tid;
        if (p <= pos) m = fmaxf(m, k_only_score_at<TY>(sm_q, sm_qq, kc + (u64)(p % cells) * row_bytes, k_dim, lanes, scale));
    }
    float big = ko_block_max(m, sm_red);

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
            w = ko_round_weight<TY>(expf_ggml(k_only_score_at<TY>(sm_q, sm_qq, kc + (u64)(p % cells) * row_bytes, k_dim, lanes, scale) - big) * inv);
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
                                                    int k_dim, int v_dim, int cells,            \
                                                    const int* pos_at, float scale) {           \
        int pos0 = read_pos0(pos_at, n_tokens, cells, 0);                                       \
        if (pos0 < 0) return;                                                                   \
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

