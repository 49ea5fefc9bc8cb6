// ---------------------------------------------------------------------------------------------
// KV cache. A ring of `cells` rows of `width` values (n_kv_heads * head_dim); token t of the
// batch goes to cell (pos0 + t) % cells, pos0 = *pos_at (read on the device: see read_pos0).
// Rows are stored as the CPU device's cache stores them (ggml's set_rows): f32 as is, f16 and
// bf16 rounded to nearest even, Q8_0 by the activations' quantizer (quantize_block_q8_0), Q4_0,
// Q4_1, Q5_0 and Q5_1 by ggml's reference quantizers (hmoe_quant's quantize_row); a
// block-quantized row is first Walsh–Hadamard rotated in chunks of `rot` values (0: not
// rotated), as llama.cpp rotates quantized heads.

// The first position of a call's tokens, read on the device from the step's positions
// (`pos_at`: the entry of the call's first token), so that a launch does not depend on it and a
// captured graph serves every token; the launch's grid is sized for the ring, not the position.
// -1 when it is negative, when its batch's last position exceeds an int, or when the batch would
// see more keys than the ring's `cells` hold (every earlier position, or the last `window` of
// each token's): the kernel then writes nothing.
__device__ __forceinline__ int read_pos0(const int* pos_at, int n_tokens, int cells, int window) {
    int p = *pos_at;
    long long end = (long long)p + n_tokens, seen = end;
    long long in_window = (long long)window + n_tokens - 1;
    if (window > 0 && in_window < seen) seen = in_window;
    return p >= 0 && end <= 2147483647LL && seen <= (long long)cells ? p : -1;
}

// The CPU device's fast Walsh–Hadamard transform of the n values of x in place (n a power of two):
// scale by 1 / sqrt(n), then butterflies (u + v, u - v) over strides 1, 2, 4, ... n / 2. Its
// own inverse.
__device__ void fwht_serial(float* x, int n) {
    float scale = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= scale;
    for (int len = 1; len < n; len <<= 1) {
        for (int i = 0; i < n; i += 2 * len) {
            for (int j = i; j < i + len; j++) {
                float u = x[j], v = x[j + len];
                x[j] = u + v;
                x[j + len] = u - v;
            }
        }
    }
}

// ggml's reference Q4_0 quantizer (quantize_row_q4_0_ref) of one block of 32: d = max / -8
// with max the value of the largest magnitude (the first of equals), q = min(15,
// (int8)(x / d + 8.5)) (x * (1 / d), truncated as x86's cvttss2si), element j < 16 in the low
// nibble of byte j, element j + 16 in its high nibble.
__device__ void quantize_block_q4_0(const float* x, u8* ob) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    float d = max / -8.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    u16 dh = f2h(d);
    ob[0] = (u8)(dh & 0xffu);
    ob[1] = (u8)(dh >> 8);
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)(x[j] * id + 8.5f);
        int q1 = (int)(signed char)(int)(x[j + 16] * id + 8.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        ob[2 + j] = (u8)((q0 & 15) | ((q1 & 15) << 4));
    }
}

// The value of the largest magnitude of a block of 32 (the first of equals), as ggml's
// reference quantizers scan for it (`amax < |x|`).
__device__ __forceinline__ float signed_max32(const float* x) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

// The minimum and maximum of a block of 32 as ggml's reference quantizers scan for them
// (`x < min`, `x > max` from +-FLT_MAX).
__device__ __forceinline__ void min_max32(const float* x, float* mn, float* mx) {
    float lo = 3.40282347e38f, hi = -3.40282347e38f;
    for (int j = 0; j < 32; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

// The little-endian f16 of f at b, and the u32 v at b.
__device__ __forceinline__ void put_f16(u8* b, float f) {
    u16 h = f2h(f);
    b[0] = (u8)(h & 0xffu);
    b[1] = (u8)(h >> 8);
}
__device__ __forceinline__ void put_u32(u8* b, u32 v) {
    for (int k = 0; k < 4; k++) b[k] = (u8)(v >> (8 * k));
}

// ggml's reference Q5_0 quantizer (quantize_row_q5_0_ref): d = max / -16 (max as for Q4_0),
// q = min(31, (int8)(x / d + 16.5)); the low nibbles as Q4_0's at byte 6, the fifth bit of
// element j in bit j of the u32 at byte 2.
__device__ void quantize_block_q5_0(const float* x, u8* ob) {
    float d = signed_max32(x) / -16.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    u32 qh = 0;
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)(x[j] * id + 16.5f);
        int q1 = (int)(signed char)(int)(x[j + 16] * id + 16.5f);
        q0 = q0 < 31 ? q0 : 31;
        q1 = q1 < 31 ? q1 : 31;
        ob[6 + j] = (u8)((q0 & 15) | ((q1 & 15) << 4));
        qh |= (u32)((q0 & 0x10) >> 4) << j;
        qh |= (u32)((q1 & 0x10) >> 4) << (j + 16);
    }
    put_u32(ob + 2, qh);
}

// ggml's reference Q4_1 quantizer (quantize_row_q4_1_ref): d = (max - min) / 15, m = min,
// q = min(15, (int8)((x - min) / d + 0.5)).
__device__ void quantize_block_q4_1(const float* x, u8* ob) {
    float mn, mx;
    min_max32(x, &mn, &mx);
    float d = (mx - mn) / 15.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    put_f16(ob + 2, mn);
    for (int j = 0; j < 16; j++) {
        int q0 = (int)(signed char)(int)((x[j] - mn) * id + 0.5f);
        int q1 = (int)(signed char)(int)((x[j + 16] - mn) * id + 0.5f);
        q0 = q0 < 15 ? q0 : 15;
        q1 = q1 < 15 ? q1 : 15;
        ob[4 + j] = (u8)(q0 | (q1 << 4));
    }
}

// ggml's reference Q5_1 quantizer (quantize_row_q5_1_ref): d = (max - min) / 31, m = min,
// q = (uint8)((x - min) / d + 0.5); low nibbles at byte 8, fifth bits in the u32 at byte 4.
__device__ void quantize_block_q5_1(const float* x, u8* ob) {
    float mn, mx;
    min_max32(x, &mn, &mx);
    float d = (mx - mn) / 31.0f;
    float id = d != 0.f ? 1.0f / d : 0.f;
    put_f16(ob, d);
    put_f16(ob + 2, mn);
    u32 qh = 0;
    for (int j = 0; j < 16; j++) {
        u32 q0 = (u8)(int)((x[j] - mn) * id + 0.5f);
        u32 q1 = (u8)(int)((x[j + 16] - mn) * id + 0.5f);
        ob[8 + j] = (u8)((q0 & 15u) | ((q1 & 15u) << 4));
        qh |= ((q0 & 0x10u) >> 4) << j;
        qh |= ((q1 & 0x10u) >> 4) << (j + 16);
    }
    put_u32(ob + 4, qh);
}

#define KV_MAX_CHUNK 256

// The items of a batch's store into a ring of type ty: its values (float types) or its chunks
// of max(rot, 32) values (block-quantized types).
__device__ __forceinline__ u64 kv_store_items(int ty, int rot, int n_tokens, int width) {
    bool fl = ty == TY_F32 || ty == TY_F16 || ty == TY_BF16;
    int chunk = fl ? 1 : (rot > 32 ? rot : 32);
    return (u64)n_tokens * (u64)(width / chunk);
}

// Item i (< kv_store_items) of a batch's store into a ring of type ty: value i converted into
// its cell (float types), or chunk i of max(rot, 32) values (at most KV_MAX_CHUNK), each `rot`
// values of it rotated (rot > 0), then quantized block by block into its cell.
__device__ void kv_store_item(u64 i, const float* src, u8* cache, int ty, int rot, int width,
                              int cells, int pos0) {
    if (ty == TY_F32 || ty == TY_F16 || ty == TY_BF16) {
        int t = (int)(i / (u64)width), c = (int)(i % (u64)width);
        u64 at = (((u64)pos0 + t) % (u64)cells) * width + c;
        if (ty == TY_F32) ((float*)cache)[at] = src[i];
        else ((u16*)cache)[at] = ty == TY_F16 ? f2h(src[i]) : f2bf(src[i]);
        return;
    }
    int block_bytes = lowbit_block_bytes(ty);
    int chunk = rot > 32 ? rot : 32;
    u64 per_row = (u64)(width / chunk);
    int t = (int)(i / per_row), c = (int)(i % per_row);
    float x[KV_MAX_CHUNK];
    const float* s = src + (u64)t * width + (u64)c * chunk;
    for (int j = 0; j < chunk; j++) x[j] = s[j];
    for (int r = 0; rot > 0 && r < chunk; r += rot) fwht_serial(x + r, rot);
    u64 cell = ((u64)pos0 + t) % (u64)cells;
    u8* row = cache + cell * (u64)(width / 32) * block_bytes;
    for (int b = 0; b < chunk / 32; b++) {
        u8* ob = row + (u64)(c * (chunk / 32) + b) * block_bytes;
        switch (ty) {
        case TY_Q4_0: quantize_block_q4_0(x + 32 * b, ob); break;
        case TY_Q4_1: quantize_block_q4_1(x + 32 * b, ob); break;
        case TY_Q5_0: quantize_block_q5_0(x + 32 * b, ob); break;
        case TY_Q5_1: quantize_block_q5_1(x + 32 * b, ob); break;
        default: quantize_block_q8_0(x + 32 * b, ob); break;
        }
    }
}

// The store of a batch into one ring, or into two (grid.y = 2: the keys into the first and the
// values into the second, in one launch): ring blockIdx.y's item per thread, of width values
// per token, type ty (a ggml id of KV_TYPES) rotated in chunks of rot (block types), `cells`
// cells. grid = (ceil(max items / 256), rings), block = 256.
extern "C" __global__ void kv_store(const float* src, u8* cache, int ty, int rot, int width,
                                    int cells, const float* src2, u8* cache2, int ty2, int rot2,
                                    int width2, int cells2, int n_tokens, const int* pos_at) {
    int pos0 = *pos_at;
    if (blockIdx.y == 1) {
        src = src2, cache = cache2, ty = ty2, rot = rot2, width = width2, cells = cells2;
    }
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (pos0 < 0 || i >= kv_store_items(ty, rot, n_tokens, width)) return;
    kv_store_item(i, src, cache, ty, rot, width, cells, pos0);
}

// Element i of an f32 (ty TY_F32) or f16 ring, as f32.
__device__ __forceinline__ float kv_float(const u8* ring, int ty, u64 i) {
    return ty == TY_F16 ? h2f(((const u16*)ring)[i]) : ((const float*)ring)[i];
}

// Element j (0..31) of a Q8_0 or Q4_0 block, as its integer.
__device__ __forceinline__ int block_int(const u8* b, bool q4, int j) {
    if (!q4) return (int)(signed char)b[2 + j];
    u8 byte = b[2 + (j & 15)];
    return (int)(j < 16 ? byte & 15 : byte >> 4) - 8;
}

// Element i of an f32, f16, Q8_0 or Q4_0 ring, as f32: block elements as the CPU device's
// dequantizer (ggml's to_float) gives them, the integer times the block's f16 scale (converted
// exactly) in one rounding.
__device__ __forceinline__ float kv_value(const u8* ring, int ty, u64 i) {
    if (ty == TY_Q8_0 || ty == TY_Q4_0) {
        bool q4 = ty == TY_Q4_0;
        const u8* b = ring + i / 32 * (q4 ? 18 : 34);
        return (float)block_int(b, q4, (int)(i % 32)) * q8_scale(b);
    }
    return kv_float(ring, ty, i);
}

// Attention over a K/V ring with GQA, an optional sliding window and optional per-head sink
// logits (gpt-oss): the sink joins the softmax's denominator and adds no value. q, out:
// [n_tokens][n_head][head_dim] f32. Token t sits at position pos0 + t and sees keys
// first = max(0, pos - window + 1) ..= pos (window 0: all of 0 ..= pos). Like the CPU device,
// -fa and the value type choose the kernel: f32/f16 values with -fa off take attn_row;
// -fa on, and Q8_0/Q4_0 values whatever -fa says, attn_chunked (attention_chunked.cu); each
// with keys of f32, f16, Q8_0 or Q4_0. Both take the same arguments first: the rings' ggml
// types and the keys' rotation chunk; attn_chunked then the values' (only block-quantized
// rings are rotated, so attn_row, over float values, has nothing to rotate back).
//
// attn_row: the CPU device's row kernel (RefBackend's `ref0_kv`, hmoe_model's attention for
// float values), bit for bit: the query rounded to f16 for f16 keys, rotated and converted to
// Q8_0 blocks for Q8_0/Q4_0 keys; scores in ggml's vec_dot_f16 order for one query token and
// f16 keys, tinyBLAS's 16 lanes for several, vec_dot_f32's order for f32 keys and ggml's
// vec_dot for block keys (attn_score), times `scale`; m = the largest score (and
// sink); positions in chunks of 16 from first rounded down to a multiple of 16, each chunk's
// expf_ggml(s - m) summed by halving and added to an f64 sum in chunk order, plus the sink's
// exp; probabilities expf_ggml(s - m) * (f32)(1 / sum), rounded to f16 for f16 values; output
// dimension d sums in 16 lanes (lane i: position i of every chunk, in order) fma(v, p, acc),
// then by halving. With value_chains 4 and one query token, vec_dot's order instead: position
// p into lane p % 16 of chain (p / 16) % 4, the chains folded (c0 + c2) + (c1 + c3) per lane,
// then by halving (value_chains 1: one chain).
//
// One block per (head, token); each half-warp takes one chunk of a round of ATT_CHUNKS chunks.
// Pass 1 keeps the scores in shared memory when the token sees at most ATT_SCORE_CACHE
// positions; beyond that they are computed again in passes 2 and 3 (the same bits either way).
// head_dim must be a multiple of 16 and at most 256. grid = (n_head, n_tokens),
// block = ATT_WARPS * 32.
#define ATT_WARPS 8
#define ATT_MAX_PER_LANE 8
#define ATT_CHUNKS (2 * ATT_WARPS)
#define ATT_MAX_DIMS_PER_THREAD (ATT_MAX_PER_LANE * WARP / 16)
#define ATT_SCORE_CACHE 8192

// The score of the key at element `at` of the ring `k` against the query `q` (shared memory;
// rounded to f16 for f16 keys; as Q8_0 blocks `qb` for Q8_0/Q4_0 keys), by the 16 lanes of a
// half-warp (l: lane within the half): block keys in ggml's vec_dot order (block_score's); f32 keys, and one query token with f16 keys, in ggml's vec_dot order (four 16-lane
// FMA accumulators over 64-element steps folded (s0 + s2) + (s1 + s3), summed by halving, then
// the last hd % 64 products added one by one, in f32 for f32 keys and rounded to f32 and added
// in f64 for f16), several tokens with f16 keys in tinyBLAS's (element i into lane i % 16,
// summed by halving). Every lane of the half gets it; every lane of the warp must call it.
__device__ float attn_score(const float* q, const u8* qb, const u8* k, int k_ty, u64 at, int hd,
                            int l, int single) {
    if (k_ty == TY_Q8_0 || k_ty == TY_Q4_0) {
        // Lanes 0..7 of the half keep accumulator l of ggml's vec_dot (see block_score), folded
        // by xor-shuffles 4, 2, 1: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
        bool q4 = k_ty == TY_Q4_0;
        int bb = q4 ? 18 : 34;
        const u8* kb = k + at / 32 * bb;
        float a = 0.f;
        if (l < 8) {
            for (int b = 0; b < hd / 32; b++) {
                const u8* w = kb + b * bb;
                const u8* x = qb + b * 34;
                float d = q8_scale(w) * q8_scale(x);
                int s = 0;
                for (int e = 4 * l; e < 4 * l + 4; e++) s += block_int(w, q4, e) * (int)(signed char)x[2 + e];
                a = fmaf(d, (float)s, a);
            }
        }
        for (int o = 4; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        return __shfl_sync(0xffffffffu, a, (int)(threadIdx.x & ~15u));
    }
    if (single || k_ty == TY_F32) {
        int np = hd & ~63;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int b = 0; b < np; b += 64) {
            a0 = fmaf(q[b + l], kv_float(k, k_ty, at + b + l), a0);
            a1 = fmaf(q[b + 16 + l], kv_float(k, k_ty, at + b + 16 + l), a1);
            a2 = fmaf(q[b + 32 + l], kv_float(k, k_ty, at + b + 32 + l), a2);
            a3 = fmaf(q[b + 48 + l], kv_float(k, k_ty, at + b + 48 + l), a3);
        }
        float head = half_warp_sum16((a0 + a2) + (a1 + a3));
        if (k_ty == TY_F32) {
            for (int i = np; i < hd; i++) head += q[i] * kv_float(k, k_ty, at + i);
            return head;
        }
        double sum = (double)head;
        for (int i = np; i < hd; i++) sum += (double)(q[i] * kv_float(k, k_ty, at + i));
        return (float)sum;
    }
    float a = 0.f;
    for (int i = l; i < hd; i += 16) a = fmaf(q[i], kv_float(k, k_ty, at + i), a);
    return half_warp_sum16(a);
}

extern "C" __global__ void attn_row(const float* q, const u8* kc, const u8* vc,
                                    const float* sinks, int has_sinks, float* out, int n_tokens,
                                    int n_head, int n_kv, int head_dim, int cells,
                                    const int* pos_at, int window, float scale, int k_ty,
                                    int v_ty, int k_rot, int value_chains) {
    __shared__ float sm_q[ATT_MAX_PER_LANE * WARP];
    __shared__ u8 sm_qb[ATT_MAX_PER_LANE * 34];
    __shared__ float sm_s[ATT_SCORE_CACHE];
    __shared__ float sm_p[ATT_CHUNKS * 16];
    __shared__ float sm_red[ATT_CHUNKS];
    __shared__ float sm_max;
    __shared__ float sm_inv;
    int h = blockIdx.x, t = blockIdx.y;
    int pos0 = read_pos0(pos_at, n_tokens, cells, window);
    if (h >= n_head || t >= n_tokens || pos0 < 0) return;
    int tid = threadIdx.x;
    int lane = tid % WARP, wid = tid / WARP;
    int hw = tid / 16, l = tid % 16;  // half-warp (its chunk of each round) and lane in it
    int pos = pos0 + t;
    int first = window > 0 ? (pos + 1 - window > 0 ? pos + 1 - window : 0) : 0;
    int chunk0 = first / 16 * 16;
    int n_chunks = (pos + 1 - chunk0 + 15) / 16;
    int rounds = (n_chunks + ATT_CHUNKS - 1) / ATT_CHUNKS;
    // Score of position chunk0 + j at sm_s[j] (the same for every thread of the block).
    bool cached = n_chunks * 16 <= ATT_SCORE_CACHE;
    int single = n_tokens == 1;
    int kvh = h / (n_head / n_kv);
    u64 width = (u64)n_kv * head_dim;
    u64 kv_off = (u64)kvh * head_dim;
    bool v16 = v_ty == TY_F16;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    for (int i = tid; i < head_dim; i += blockDim.x) {
        sm_q[i] = k_ty == TY_F16 ? h2f(f2h(qh[i])) : qh[i];
    }
    __syncthreads();
    // Block keys: the query rotated like them, as Q8_0 blocks.
    bool kq = k_ty == TY_Q8_0 || k_ty == TY_Q4_0;
    if (kq && k_rot > 0 && tid == 0) {
        for (int c = 0; c < head_dim; c += k_rot) fwht_serial(sm_q + c, k_rot);
    }
    __syncthreads();
    if (kq && tid < head_dim / 32) quantize_block_q8_0(sm_q + 32 * tid, sm_qb + 34 * tid);
    __syncthreads();

    // Pass 1: the largest score (and sink). Out-of-range slots score position `pos` and are
    // ignored, so that every lane takes part in the shuffles.
    float m = -f_inf();
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        for (int i = 0; i < 16; i++) {
            int p = chunk0 + 16 * c + i;
            bool ok = c < n_chunks && p >= first && p <= pos;
            u64 cell = (u64)((ok ? p : pos) % cells);
            float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
            if (ok) m = fmaxf(m, s);
            if (ok && cached && l == i) sm_s[16 * c + i] = s;
        }
    }
    m = warp_max(m);
    if (lane == 0) sm_red[wid] = m;
    __syncthreads();
    if (tid == 0) {
        float big = has_sinks ? sinks[h] : -f_inf();
        for (int w = 0; w < ATT_WARPS; w++) big = fmaxf(big, sm_red[w]);
        sm_max = big;
    }
    __syncthreads();
    float big = sm_max;

    // Pass 2: the denominator, chunk sums added in f64 in chunk order (by thread 0).
    double total = 0.0;
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        float mine = 0.f;
        if (cached) {
            int p = chunk0 + 16 * c + l;
            if (c < n_chunks && p >= first && p <= pos) mine = expf_ggml(sm_s[16 * c + l] - big);
        } else {
            for (int i = 0; i < 16; i++) {
                int p = chunk0 + 16 * c + i;
                bool ok = c < n_chunks && p >= first && p <= pos;
                u64 cell = (u64)((ok ? p : pos) % cells);
                float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
                if (ok && l == i) mine = expf_ggml(s - big);
            }
        }
        float chunk_sum = half_warp_sum16(mine);
        if (l == 0) sm_red[hw] = chunk_sum;
        __syncthreads();
        if (tid == 0) {
            for (int j = 0; j < ATT_CHUNKS; j++) {
                if (r * ATT_CHUNKS + j < n_chunks) total += (double)sm_red[j];
            }
        }
        __syncthreads();
    }
    if (tid == 0) {
        if (has_sinks) total += (double)expf_libm(sinks[h] - big);
        sm_inv = (float)(1.0 / total);
    }
    __syncthreads();
    float inv = sm_inv;

    // Pass 3: the values. Thread (hw, l) keeps lane l of dimensions hw, hw + 16, ..., in
    // each chain.
    int nd = head_dim / 16;
    int chains = single && value_chains == 4 ? 4 : 1;
    float acc[4][ATT_MAX_DIMS_PER_THREAD];
#pragma unroll
    for (int c = 0; c < 4; c++)
#pragma unroll
        for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) acc[c][k] = 0.f;
    for (int r = 0; r < rounds; r++) {
        int c = r * ATT_CHUNKS + hw;
        float mine = 0.f;
        if (cached) {
            int p = chunk0 + 16 * c + l;
            if (c < n_chunks && p >= first && p <= pos) {
                mine = expf_ggml(sm_s[16 * c + l] - big) * inv;
            }
        } else {
            for (int i = 0; i < 16; i++) {
                int p = chunk0 + 16 * c + i;
                bool ok = c < n_chunks && p >= first && p <= pos;
                u64 cell = (u64)((ok ? p : pos) % cells);
                float s = attn_score(sm_q, sm_qb, kc, k_ty, cell * width + kv_off, head_dim, l, single) * scale;
                if (ok && l == i) mine = expf_ggml(s - big) * inv;
            }
        }
        sm_p[hw * 16 + l] = v16 ? h2f(f2h(mine)) : mine;
        __syncthreads();
        for (int j = 0; j < ATT_CHUNKS; j++) {
            int cj = r * ATT_CHUNKS + j;
            int p = chunk0 + 16 * cj + l;
            if (cj < n_chunks && p >= first && p <= pos) {
                float w = sm_p[j * 16 + l];
                u64 at = (u64)(p % cells) * width + kv_off;
                int chain = (p / 16) % chains;
#pragma unroll
                for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) {
                    if (k < nd) {
                        float x = kv_float(vc, v_ty, at + hw + 16 * k);
#pragma unroll
                        for (int c = 0; c < 4; c++) {
                            if (c == chain) acc[c][k] = fmaf(x, w, acc[c][k]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    float* oh = out + ((u64)t * n_head + h) * head_dim;
#pragma unroll
    for (int k = 0; k < ATT_MAX_DIMS_PER_THREAD; k++) {
        if (k < nd) {
            float a = chains == 1 ? acc[0][k] : (acc[0][k] + acc[2][k]) + (acc[1][k] + acc[3][k]);
            float o = half_warp_sum16(a);
            if (l == 0) oh[hw + 16 * k] = o;
        }
    }
}

// The Q8_0/Q4_0 key at element `at` of a ring of `ty` (one thread) against the query's Q8_0
// blocks `qb`, in ggml's vec_dot order (eight accumulators: for each block in order,
// accumulator k takes fma(d_k · d_q, Σ of elements 4k..4k+3, acc_k); then
// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))).
__device__ float block_score(const u8* qb, const u8* k, int ty, u64 at, int hd) {
    bool q4 = ty != TY_Q8_0;
    int bb = q4 ? 18 : 34;
    const u8* kb = k + at / 32 * bb;
    float a[8];
    for (int j = 0; j < 8; j++) a[j] = 0.f;
    for (int b = 0; b < hd / 32; b++) {
        const u8* w = kb + b * bb;
        const u8* x = qb + b * 34;
        float d = q8_scale(w) * q8_scale(x);
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int e = 4 * j; e < 4 * j + 4; e++) s += block_int(w, q4, e) * (int)(signed char)x[2 + e];
            a[j] = fmaf(d, (float)s, a[j]);
        }
    }
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
