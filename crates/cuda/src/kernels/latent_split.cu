// ---------------------------------------------------------------------------------------------
// Attention over a K-only ring split over positions (decode-sized calls; latent_attention.rs
// picks it): the numerics of attn_k_only_<type> (latent_attention.cu, Ref0::attention_k_only)
// bit for bit, as three kernels over a scratch s of [n_tokens][n_head][cells] floats (position
// p of token t, head h at (t * n_head + h) * cells + p; p <= pos < cells, see read_pos0):
//
// 1. attn_k_only_scores_<type>: blocks over (tile of KS_POS positions, group of KS_HEADS
//    heads, token); thread (head hl = tid % KS_HEADS, position tid / KS_HEADS) writes the
//    scaled score k_only_score_at of that head's query against that position's key (the
//    group's converted queries, or their Q8_0 / Q8_1 blocks, staged once in shared memory),
//    so a key row one thread fetches serves the group's other heads from L1. The tiles up to
//    pos, grid-stride over at most KS_MAX_TILES blocks.
// 2. attn_k_only_weights_<f32|f16|bf16>: one block per (head, token): m = the largest score,
//    expf_ggml(s - m) summed by halving per chunk of 16 positions (reduce16_serial), chunk
//    sums added in f64 in position order, inv = (f32)(1 / sum), and each position's weight
//    expf_ggml(s - m) * inv (rounded to f16 / bf16 for f16 / bf16 rings) written over its
//    score.
// 3. attn_k_only_values_<type>: blocks over (tile of KV_DIMS value dims, group of KS_HEADS
//    heads, token); per tile of KV_POS positions (a multiple of 64, so that a position's lane
//    and chain are fixed by its index in the tile) the values (load_w) and the group's weights
//    are staged in shared memory, and thread (head tid / KV_DIMS, dim tid % KV_DIMS) takes
//    fma(v, w, acc[chain][lane]) in position order, then folds the chains and sums by halving
//    as attn_k_only_<type> does. The ring's values are read once per head group.
//
// Every kernel reads pos0 on the device (read_pos0) and writes nothing when the batch would
// see past the ring; the grids depend on the ring's cells, never on the position.
#define KS_HEADS 8
#define KS_POS 32
#define KS_MAX_TILES 256
#define KV_DIMS 32
#define KV_POS 64

// The body of attn_k_only_scores_<type>: q the queries (f32), qq their blocks for block rings.
template <int TY>
__device__ void k_only_scores_body(const float* q, const u8* qq, const u8* kc, float* s,
                                   int n_tokens, int n_head, int k_dim, int cells, int pos0,
                                   float scale) {
    // The group's queries: KS_HEADS × k_dim floats, or for block rings their blocks (at most
    // KS_HEADS × KO_MAX_K / 32 × 36 bytes) in the same storage.
    __shared__ float sm_q[KS_HEADS * KO_MAX_K];
    u8* sm_qq = (u8*)sm_q;
    int h0 = blockIdx.y * KS_HEADS, t = blockIdx.z;
    if (h0 >= n_head || t >= n_tokens) return;
    int tid = threadIdx.x, hl = tid % KS_HEADS, pl = tid / KS_HEADS;
    int n_group = n_head - h0 < KS_HEADS ? n_head - h0 : KS_HEADS;
    int pos = pos0 + t;
    int lanes = n_tokens != 1 && k_dim % 16 == 0;
    u64 row_bytes = ko_row_bytes<TY>(k_dim);
    u64 qb = ko_blocks(TY) ? lowbit_act_bytes(TY, k_dim) : 0;
    ko_stage_queries<TY>(q, qq, sm_q, sm_qq, t, n_head, h0, n_group, k_dim, qb);
    __syncthreads();
    if (hl >= n_group) return;
    float* sh = s + ((u64)t * n_head + h0 + hl) * cells;
    for (int tile = blockIdx.x; tile * KS_POS <= pos; tile += gridDim.x) {
        int p = tile * KS_POS + pl;
        if (p > pos) break;
        const u8* row = kc + (u64)(p % cells) * row_bytes;
        sh[p] = k_only_score_at<TY>(sm_q + hl * k_dim, sm_qq + hl * qb, row, k_dim, lanes, scale);
    }
}

// The body of attn_k_only_weights_<type>: TY the ring's type where it rounds the weights
// (TY_F16, TY_BF16), else TY_F32.
template <int TY>
__device__ void k_only_weights_body(float* s, int n_tokens, int n_head, int cells, int pos0) {
    __shared__ float sm_e[16 * KO_THREADS];
    __shared__ float sm_red[KO_THREADS];
    __shared__ double sm_sum;
    int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tokens) return;
    int tid = threadIdx.x;
    int pos = pos0 + t;
    float* sh = s + ((u64)t * n_head + h) * cells;
    float m = -f_inf();
    for (int p = tid; p <= pos; p += KO_THREADS) m = fmaxf(m, sh[p]);
    if (tid == 0) sm_sum = 0.0;
    float big = ko_block_max(m, sm_red);
    // The denominator, 16 × KO_THREADS positions at a time: thread c sums chunk c, thread 0
    // adds the chunks in order.
    for (int base = 0; base <= pos; base += 16 * KO_THREADS) {
        for (int k = 0; k < 16; k++) {
            int i = tid + k * KO_THREADS, p = base + i;
            sm_e[i] = p <= pos ? expf_ggml(sh[p] - big) : 0.f;
        }
        __syncthreads();
        sm_red[tid] = reduce16_serial(sm_e + 16 * tid);
        __syncthreads();
        if (tid == 0) {
            for (int c = 0; c < KO_THREADS && base + 16 * c <= pos; c++) sm_sum += (double)sm_red[c];
        }
    }
    __syncthreads();
    float inv = (float)(1.0 / sm_sum);
    for (int p = tid; p <= pos; p += KO_THREADS) {
        sh[p] = ko_round_weight<TY>(expf_ggml(sh[p] - big) * inv);
    }
}

// attn_k_only_values_<type>'s accumulation with CHAINS value chains (4: one query token over
// f32/f16 rings; else 1): sm_v [KV_POS][KV_DIMS] and sm_w [KS_HEADS][KV_POS] the staging.
template <int TY, int CHAINS>
__device__ void k_only_values_chains(const float* w, const u8* kc, float* out, float* sm_v,
                                     float* sm_w, int n_tokens, int n_head, int k_dim,
                                     int v_dim, int cells, int pos0) {
    int d0 = blockIdx.x * KV_DIMS, h0 = blockIdx.y * KS_HEADS, t = blockIdx.z;
    int tid = threadIdx.x, hl = tid / KV_DIMS, dl = tid % KV_DIMS;
    int pos = pos0 + t;
    u64 row_bytes = ko_row_bytes<TY>(k_dim);
    float acc[CHAINS][16];
#pragma unroll
    for (int j = 0; j < CHAINS; j++)
#pragma unroll
        for (int l = 0; l < 16; l++) acc[j][l] = 0.f;
    for (int base = 0; base <= pos; base += KV_POS) {
        __syncthreads();
        for (int e = tid; e < KV_POS * KV_DIMS; e += KO_THREADS) {
            int p = base + e / KV_DIMS, d = d0 + e % KV_DIMS;
            sm_v[e] = p <= pos && d < v_dim ? load_w<TY>(kc + (u64)(p % cells) * row_bytes, d) : 0.f;
        }
        for (int e = tid; e < KS_HEADS * KV_POS; e += KO_THREADS) {
            int h = h0 + e / KV_POS, p = base + e % KV_POS;
            sm_w[e] = p <= pos && h < n_head ? w[((u64)t * n_head + h) * cells + p] : 0.f;
        }
        __syncthreads();
        int n = pos + 1 - base;
        // base is a multiple of 64: position base + i has lane i % 16 and chain (i / 16) % 4.
#pragma unroll
        for (int i = 0; i < KV_POS; i++) {
            if (i < n) {
                float& a = acc[CHAINS == 4 ? (i / 16) % 4 : 0][i % 16];
                a = fmaf(sm_v[i * KV_DIMS + dl], sm_w[hl * KV_POS + i], a);
            }
        }
    }
    int h = h0 + hl, d = d0 + dl;
    if (h >= n_head || d >= v_dim) return;
    // (c0 + c2) + (c1 + c3) per lane with four chains (the % keeps the one-chain
    // instantiation's indices in range).
    float folded[16];
#pragma unroll
    for (int l = 0; l < 16; l++) {
        folded[l] = CHAINS == 4 ? (acc[0][l] + acc[2 % CHAINS][l]) + (acc[1 % CHAINS][l] + acc[3 % CHAINS][l])
                                : acc[0][l];
    }
    out[((u64)t * n_head + h) * v_dim + d] = reduce16_serial(folded);
}

// The body of attn_k_only_values_<type>: w the weights attn_k_only_weights_* wrote.
template <int TY>
__device__ void k_only_values_body(const float* w, const u8* kc, float* out, int n_tokens,
                                   int n_head, int k_dim, int v_dim, int cells, int pos0) {
    __shared__ float sm_v[KV_POS * KV_DIMS];
    __shared__ float sm_w[KS_HEADS * KV_POS];
    if (blockIdx.x * KV_DIMS >= (unsigned)v_dim || blockIdx.y * KS_HEADS >= (unsigned)n_head ||
        blockIdx.z >= (unsigned)n_tokens)
        return;
    if (n_tokens == 1 && (TY == TY_F32 || TY == TY_F16)) {
        k_only_values_chains<TY, 4>(w, kc, out, sm_v, sm_w, n_tokens, n_head, k_dim, v_dim, cells, pos0);
    } else {
        k_only_values_chains<TY, 1>(w, kc, out, sm_v, sm_w, n_tokens, n_head, k_dim, v_dim, cells, pos0);
    }
}

// attn_k_only_scores_<type>(q, qq, kc, s, ...): q, qq and kc as for attn_k_only_<type>, s the
// scratch. grid = (min(ceil(cells / KS_POS), KS_MAX_TILES), ceil(n_head / KS_HEADS),
// n_tokens), block = KO_THREADS.
// attn_k_only_values_<type>(w, kc, out, ...): grid = (ceil(v_dim / KV_DIMS),
// ceil(n_head / KS_HEADS), n_tokens), block = KO_THREADS.
#define K_ONLY_SPLIT(SUFFIX, TY)                                                                  \
    extern "C" __global__ void attn_k_only_scores_##SUFFIX(                                       \
        const float* q, const u8* qq, const u8* kc, float* s, int n_tokens, int n_head,           \
        int k_dim, int cells, const int* pos_at, float scale) {                                   \
        int pos0 = read_pos0(pos_at, n_tokens, cells, 0);                                         \
        if (pos0 < 0) return;                                                                     \
        k_only_scores_body<TY>(q, qq, kc, s, n_tokens, n_head, k_dim, cells, pos0, scale);        \
    }                                                                                             \
    extern "C" __global__ void attn_k_only_values_##SUFFIX(                                       \
        const float* w, const u8* kc, float* out, int n_tokens, int n_head, int k_dim,            \
        int v_dim, int cells, const int* pos_at) {                                                \
        int pos0 = read_pos0(pos_at, n_tokens, cells, 0);                                         \
        if (pos0 < 0) return;                                                                     \
        k_only_values_body<TY>(w, kc, out, n_tokens, n_head, k_dim, v_dim, cells, pos0);          \
    }

K_ONLY_SPLIT(f32, TY_F32)
K_ONLY_SPLIT(f16, TY_F16)
K_ONLY_SPLIT(bf16, TY_BF16)
K_ONLY_SPLIT(q8_0, TY_Q8_0)
K_ONLY_SPLIT(q4_0, TY_Q4_0)
K_ONLY_SPLIT(q4_1, TY_Q4_1)
K_ONLY_SPLIT(q5_0, TY_Q5_0)
K_ONLY_SPLIT(q5_1, TY_Q5_1)

// attn_k_only_weights_<type>(s, ...): the weights over the scores in s, in place; <type> the
// weights' (f16 / bf16 for f16 / bf16 rings, else f32). grid = (n_head, n_tokens), block =
// KO_THREADS.
#define K_ONLY_WEIGHTS(SUFFIX, TY)                                                                \
    extern "C" __global__ void attn_k_only_weights_##SUFFIX(float* s, int n_tokens, int n_head,   \
                                                            int cells, const int* pos_at) {       \
        int pos0 = read_pos0(pos_at, n_tokens, cells, 0);                                         \
        if (pos0 < 0) return;                                                                     \
        k_only_weights_body<TY>(s, n_tokens, n_head, cells, pos0);                                \
    }

K_ONLY_WEIGHTS(f32, TY_F32)
K_ONLY_WEIGHTS(f16, TY_F16)
K_ONLY_WEIGHTS(bf16, TY_BF16)
