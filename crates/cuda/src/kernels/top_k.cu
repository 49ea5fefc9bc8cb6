// ---------------------------------------------------------------------------------------------
// The k best logits of each row (hmoe_backend::Backend::top_k; the order of
// hmoe_backend::top_k_key: f32 total order, NaNs first, ties to the lower id), in two passes.
// top_k_chunks: one block per (chunk of TK_CHUNK logits, row) writes the chunk's k best keys,
// best first (0 past the chunk's end), to part[row][chunk][k]. top_k_merge: one block per row
// ranks those n_chunks * k keys and writes the k best values (the logits' own bits, read
// back by id) and ids. Both stream their keys through a shared buffer of TK_CAP keys: a key
// that does not rank before the k-th best kept so far is dropped; when the buffer cannot take
// another tile it is sorted (bitonic, best first) and cut back to k. Keys are distinct, so
// the result does not depend on the order the threads append in.
// grid = (ceil(n_vocab / TK_CHUNK), rows) and (rows), block = TK_THREADS; k <= TK_MAX_K.

#define TK_THREADS 256
#define TK_ITEMS 4
#define TK_TILE (TK_THREADS * TK_ITEMS)
#define TK_CAP 2048
#define TK_CHUNK 8192
#define TK_MAX_K 256

// hmoe_backend::top_k_key of (id, v).
__device__ __forceinline__ u64 tk_key(float v, unsigned id) {
    unsigned b = __float_as_uint(v);
    unsigned rank = v != v ? 0xffffffffu : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)rank << 32) | (u64)(0xffffffffu - id);
}

// Sorts the TK_CAP keys of buf, largest first (bitonic; every thread of the block calls it).
__device__ void tk_sort(u64* buf) {
    for (int size = 2; size <= TK_CAP; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int p = threadIdx.x; p < TK_CAP / 2; p += TK_THREADS) {
                int lo = 2 * stride * (p / stride) + p % stride;
                int hi = lo + stride;
                bool desc = (lo & size) == 0;
                u64 a = buf[lo], b = buf[hi];
                if ((a < b) == desc) {
                    buf[lo] = b;
                    buf[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}

// Sorts the c keys of buf (zeros after them) and keeps the best k: *count becomes min(c, k),
// and *kth the k-th best once there are k.
__device__ void tk_cut(u64* buf, int c, int k, int* count, u64* kth) {
    for (int i = c + threadIdx.x; i < TK_CAP; i += TK_THREADS) buf[i] = 0;
    __syncthreads();
    tk_sort(buf);
    if (threadIdx.x == 0) {
        *count = c < k ? c : k;
        if (c >= k) *kth = buf[k - 1];
    }
    __syncthreads();
}

// Streams n keys through buf: key i is tk_key(vals[i], id0 + i) when vals, else keys[i].
// Leaves the best k in buf[0] .. buf[k - 1], best first, zeros past the keys there were.
__device__ void tk_stream(const float* vals, const u64* keys, u64 n, unsigned id0, int k, u64* buf,
                          int* count, u64* kth) {
    if (threadIdx.x == 0) {
        *count = 0;
        *kth = 0;
    }
    __syncthreads();
    for (u64 base = 0; base < n; base += TK_TILE) {
        u64 floor = *kth;
        for (int j = 0; j < TK_ITEMS; j++) {
            u64 i = base + (u64)j * TK_THREADS + threadIdx.x;
            if (i >= n) break;
            u64 key = vals ? tk_key(vals[i], id0 + (unsigned)i) : keys[i];
            if (key > floor) buf[atomicAdd(count, 1)] = key;
        }
        __syncthreads();
        int c = *count;
        __syncthreads();
        if (c > TK_CAP - TK_TILE) tk_cut(buf, c, k, count, kth);
    }
    tk_cut(buf, *count, k, count, kth);
}

extern "C" __global__ void top_k_chunks(const float* logits, u64* part, int n_vocab, int k) {
    __shared__ u64 buf[TK_CAP];
    __shared__ int count;
    __shared__ u64 kth;
    int chunk = blockIdx.x, row = blockIdx.y, n_chunks = gridDim.x;
    u64 first = (u64)chunk * TK_CHUNK;
    u64 left = (u64)n_vocab - first;
    u64 n = left < TK_CHUNK ? left : TK_CHUNK;
    tk_stream(logits + (u64)row * n_vocab + first, nullptr, n, (unsigned)first, k, buf, &count, &kth);
    u64* out = part + ((u64)row * n_chunks + chunk) * k;
    for (int j = threadIdx.x; j < k; j += TK_THREADS) out[j] = buf[j];
}

extern "C" __global__ void top_k_merge(const float* logits, const u64* part, float* values, int* ids,
                                       int n_vocab, int n_chunks, int k) {
    __shared__ u64 buf[TK_CAP];
    __shared__ int count;
    __shared__ u64 kth;
    int row = blockIdx.x;
    tk_stream(nullptr, part + (u64)row * n_chunks * k, (u64)n_chunks * k, 0, k, buf, &count, &kth);
    for (int j = threadIdx.x; j < k; j += TK_THREADS) {
        unsigned id = 0xffffffffu - (unsigned)buf[j];
        values[(u64)row * k + j] = logits[(u64)row * n_vocab + id];
        ids[(u64)row * k + j] = (int)id;
    }
}
