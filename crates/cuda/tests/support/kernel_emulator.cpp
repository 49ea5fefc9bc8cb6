// Host emulation of the kernels (src/kernels/*.cu) for tests/emulated.rs: one std::thread per CUDA thread, the
// blocks of a launch one at a time (in grid order, or reversed or shuffled where an op asks:
// g_block_order; a block that finishes sees every earlier block's writes, as __threadfence and
// an atomic count give on the GPU), shuffles and __syncthreads as barriers (a shuffle that not
// every lane of the warp reaches deadlocks, which the test's timeout reports). Host libm
// stands in for the device math (fmaf, rintf, exp, ...), F16C for the two PTX conversions
// (the test replaces the inline asm with host_h2f/host_f2h), and host versions of the
// tensor-core wrappers of kernels/mma.cu below. The launches mirror src/device/.
// Usage: kernel_emulator OP DIR ARGS...: reads DIR/<input> files of raw little-endian arrays
// and writes DIR/<output> files (see main).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct uint3 { unsigned x, y, z; };
thread_local uint3 threadIdx, blockIdx;
uint3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// What the lanes of one warp hand each other in a warp-wide instruction (mma, ldmatrix).
struct WarpExchange {
    int a[32][4], b[32][2], c[32][4];
    const void* addr[32];
};
struct Ctx {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    uint64_t slots[1024];
    WarpExchange xchg[32];
};
static Ctx* g_ctx;
void __syncthreads() { g_ctx->block->arrive_and_wait(); }
void __syncwarp(unsigned = 0xffffffffu) { g_ctx->warps[threadIdx.x / 32]->arrive_and_wait(); }
template <class T> T shfl_any(T v, unsigned src) {
    unsigned w = threadIdx.x / 32;
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    g_ctx->slots[threadIdx.x] = bits;
    g_ctx->warps[w]->arrive_and_wait();
    uint64_t r = g_ctx->slots[w * 32 + (src & 31)];
    g_ctx->warps[w]->arrive_and_wait();
    T out;
    memcpy(&out, &r, sizeof(T));
    return out;
}
float __shfl_sync(unsigned, float v, int s) { return shfl_any(v, s); }
int __shfl_sync(unsigned, int v, int s) { return shfl_any(v, s); }
float __shfl_xor_sync(unsigned, float v, int m) { return shfl_any(v, (threadIdx.x % 32) ^ m); }
double __shfl_xor_sync(unsigned, double v, int m) { return shfl_any(v, (threadIdx.x % 32) ^ m); }
int __shfl_xor_sync(unsigned, int v, int m) { return shfl_any(v, (threadIdx.x % 32) ^ m); }
float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
// ((old >= limit) ? 0 : old + 1) stored, old returned, as one atomic step.
unsigned atomicInc(unsigned* p, unsigned limit) {
    unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(p, &old, old >= limit ? 0u : old + 1u, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
    return old;
}
void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // byte n of the result: byte s<4n+2:4n> of y:x
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
float host_h2f(unsigned short h) { return _cvtsh_ss(h); }
unsigned short host_f2h(float f) { return _cvtss_sh(f, 0); }

// The PTX wrappers of kernels/mma.cu (tests/emulated.rs cuts their device definitions out),
// per the PTX ISA's fragment layouts. mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32: every
// lane hands in its registers; A (16x32), B (32x8) and C (16x8) are assembled from all 32
// lanes (lane L: groupID = L >> 2, threadID_in_group = L % 4; element i of a fragment is byte
// i % 4 of register i / 4), and each lane takes its four elements of D = A B + C, exactly.
void mma_s8_16832(int d[4], const int a[4], const int b[2], const int c[4]) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    WarpExchange& x = g_ctx->xchg[w];
    memcpy(x.a[lane], a, 16);
    memcpy(x.b[lane], b, 8);
    memcpy(x.c[lane], c, 16);
    g_ctx->warps[w]->arrive_and_wait();
    int A[16][32], B[32][8], C[16][8];
    auto byte = [](int reg, int i) { return (int)(signed char)(reg >> (8 * (i % 4))); };
    for (int l = 0; l < 32; l++) {
        int gid = l >> 2, tig = l % 4;
        for (int i = 0; i < 16; i++) {
            int row = i < 4 || (i >= 8 && i < 12) ? gid : gid + 8;
            int col = tig * 4 + (i & 3) + (i >= 8 ? 16 : 0);
            A[row][col] = byte(x.a[l][i / 4], i);
        }
        for (int i = 0; i < 8; i++) B[tig * 4 + (i & 3) + (i >= 4 ? 16 : 0)][gid] = byte(x.b[l][i / 4], i);
        for (int i = 0; i < 4; i++) C[gid + (i >= 2 ? 8 : 0)][tig * 2 + (i & 1)] = x.c[l][i];
    }
    g_ctx->warps[w]->arrive_and_wait();
    int gid = lane >> 2, tig = lane % 4;
    for (int i = 0; i < 4; i++) {
        int row = gid + (i >= 2 ? 8 : 0), col = tig * 2 + (i & 1);
        int64_t sum = C[row][col];
        for (int k = 0; k < 32; k++) sum += A[row][k] * B[k][col];
        d[i] = (int)sum;  // the kernels' sums stay far inside int32
    }
}
// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i .. 8i + 7 give the row addresses of
// matrix i; lane l takes the 32-bit word l % 4 of row l / 4 of each matrix.
void ldmatrix_x4(int r[4], const void* row) {
    unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    WarpExchange& x = g_ctx->xchg[w];
    if ((uintptr_t)row % 16 != 0) { fprintf(stderr, "ldmatrix: unaligned row\n"); abort(); }
    x.addr[lane] = row;
    g_ctx->warps[w]->arrive_and_wait();
    for (int i = 0; i < 4; i++) memcpy(&r[i], (const char*)x.addr[8 * i + lane / 4] + 4 * (lane % 4), 4);
    g_ctx->warps[w]->arrive_and_wait();
}

// cp.async (cp_async_16, cp_async_4): each thread's copies wait in a queue of its own until it
// calls cp_async_wait_all, so a kernel that reads a buffer before waiting for its copies
// reads stale bytes here too; addresses must be aligned as the PTX requires.
struct PendingCopy {
    void* dst;
    const void* src;
    int n, size;
};
thread_local std::vector<PendingCopy> g_copies;
static void check_aligned(const void* p, unsigned a, const char* what) {
    if ((uintptr_t)p % a != 0) { fprintf(stderr, "%s: unaligned address\n", what); abort(); }
}
void cp_async_16(void* dst, const void* src, int src_bytes) {
    check_aligned(dst, 16, "cp_async_16 dst");
    check_aligned(src, 16, "cp_async_16 src");
    if (src_bytes < 0 || src_bytes > 16) { fprintf(stderr, "cp_async_16: %d bytes\n", src_bytes); abort(); }
    g_copies.push_back({dst, src, src_bytes, 16});
}
void cp_async_4(void* dst, const void* src) {
    check_aligned(dst, 4, "cp_async_4 dst");
    check_aligned(src, 4, "cp_async_4 src");
    g_copies.push_back({dst, src, 4, 4});
}
void cp_async_wait_all() {
    for (auto& c : g_copies) {
        memcpy(c.dst, c.src, c.n);
        memset((char*)c.dst + c.n, 0, c.size - c.n);
    }
    g_copies.clear();
}

#include "k_host.cu"

// The order launch() runs a grid's blocks in: 0 grid order (x fastest), 1 reversed, any other
// value a shuffle seeded with it (a kernel must not depend on the order blocks run in).
static unsigned g_block_order = 0;

template <class F> void launch(uint3 grid, uint3 block, F body) {
    gridDim = grid;
    blockDim = block;
    unsigned nt = block.x;
    std::vector<uint3> blocks;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) blocks.push_back({x, y, z});
    if (g_block_order == 1) std::reverse(blocks.begin(), blocks.end());
    if (g_block_order > 1) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(g_block_order));
    for (uint3 b : blocks) {
        unsigned x = b.x, y = b.y, z = b.z;
        Ctx ctx;
        ctx.block = std::make_unique<std::barrier<>>(nt);
        for (unsigned w = 0; w < (nt + 31) / 32; w++) {
            unsigned c = nt - w * 32 < 32 ? nt - w * 32 : 32;
            ctx.warps.push_back(std::make_unique<std::barrier<>>(c));
        }
        g_ctx = &ctx;
        std::vector<std::thread> ths;
        for (unsigned t = 0; t < nt; t++) {
            ths.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {x, y, z};
                body();
                if (!g_copies.empty()) { fprintf(stderr, "cp.async copies never waited for\n"); abort(); }
                ctx.block->arrive_and_drop();
                ctx.warps[t / 32]->arrive_and_drop();
            });
        }
        for (auto& th : ths) th.join();
    }
}

template <class T> std::vector<T> rd(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    std::vector<T> v(n / sizeof(T));
    if (fread(v.data(), 1, n, f) != (size_t)n) exit(2);
    fclose(f);
    return v;
}
template <class T> void wr(const char* path, const std::vector<T>& v) {
    FILE* f = fopen(path, "wb");
    fwrite(v.data(), sizeof(T), v.size(), f);
    fclose(f);
}
static unsigned cdiv(unsigned a, unsigned b) { return (a + b - 1) / b; }

static std::vector<u8> quantize(const float* x, size_t len) {
    size_t blocks = len / 32;
    std::vector<u8> out(blocks * 34);
    u8* o = out.data();
    unsigned long long nb = blocks;
    launch({cdiv(blocks, 256), 1, 1}, {256, 1, 1}, [&] { quantize_q8_0(x, o, nb); });
    return out;
}

// The low-bit weight types (ggml ids) and their activation types (ggml's vec_dot_type).
static bool lowbit(int ty) { return ty == 2 || ty == 3 || ty == 6 || ty == 7 || (ty >= 10 && ty <= 14); }
static int act_type(int ty) { return ty == 3 || ty == 7 ? 9 : ty >= 10 && ty <= 14 ? 15 : 8; }

// lowbit.rs's quantize_acts: Q8_0 (8), Q8_1 (9) or Q8_K (15) blocks of the first len values.
static std::vector<u8> quantize_act(int act, const float* x, size_t len) {
    if (act == 8) return quantize(x, len);
    size_t per = act == 9 ? 32 : 256, bytes = act == 9 ? 36 : 292, blocks = len / per;
    std::vector<u8> out(blocks * bytes);
    u8* o = out.data();
    unsigned long long nb = blocks;
    launch({cdiv(blocks, 256), 1, 1}, {256, 1, 1}, [&] {
        if (act == 9) quantize_q8_1(x, o, nb);
        else quantize_q8_k(x, o, nb);
    });
    return out;
}

#define LOWBIT_SWITCH(TY, CALL) \
    switch (TY) { \
    case 2: CALL(q4_0); break; case 3: CALL(q4_1); break; case 6: CALL(q5_0); break; \
    case 7: CALL(q5_1); break; case 10: CALL(q2_k); break; case 11: CALL(q3_k); break; \
    case 12: CALL(q4_k); break; case 13: CALL(q5_k); break; case 14: CALL(q6_k); break; \
    case 8: CALL(q8_0); break; }

// experts.rs's moe_tiles: the tile list of the tensor-core expert products for the experts with
// at least min_count slots, and its capacity (the launch's grid.y) in *max.
static std::vector<int> tile_list(const int* offsets, int ne, int slots, int min_count, unsigned* max) {
    *max = cdiv(slots, TILE_SLOTS) + (unsigned)(ne < slots ? ne : slots);
    std::vector<int> tiles(1 + 3 * *max, -7);
    int* tp = tiles.data();
    launch({1, 1, 1}, {32, 1, 1}, [&] { moe_tiles(offsets, ne, min_count, tp); });
    if (tiles[0] < 0 || tiles[0] > (int)*max) { fprintf(stderr, "moe_tiles: %d tiles\n", tiles[0]); abort(); }
    return tiles;
}

// lowbit.rs's moe_lowbit launch: products of the experts of w (type ty) for every slot; with
// mma (an sm_80+ device) the experts with at least tiled_min slots on the tensor-core kernels
// (Q8_0 and K-quant experts; tiled or repacked order), the others on the warp kernels.
static void moe_lowbit(int ty, const std::vector<u8>& w, int ne, int rows, int cols, const u8* act, int div,
                       const int* offsets, const int* order, int slots, bool mma, float* out) {
    unsigned long long rb = w.size() / ((size_t)ne * rows);
    int repacked = (ty == 2 || ty == 12) && rows % 8 == 0;  // lowbit.rs: repacked
    int tiled_min = 8;                                       // hmoe_quant::TILED_MIN_TOKENS
    int mma_from = 0;
    if (mma && (ty == 8 || (ty >= 10 && ty <= 14))) {
        int mode = repacked ? 2 : 1;  // LB_BLOCK, LB_TILED
        unsigned max = 0;
        auto tiles = tile_list(offsets, ne, slots, tiled_min, &max);
        const int* tp = tiles.data();
        unsigned rpb = ty == 8 ? MMA_ROWS_Q8_0 : MMA_ROWS_KQ;
        launch({cdiv(rows, rpb), max, 1}, {32 * MMA_WARPS, 1, 1}, [&] {
#define CALL_KQ_MOE(S) moe_mm_mma_##S(w.data(), rb, rows, cols / 256, act, div, tp, order, mode, out)
            switch (ty) {
            case 8: moe_mm_mma_q8_0(w.data(), rb, rows, cols / 32, act, div, tp, order, out); break;
            case 10: CALL_KQ_MOE(q2_k); break; case 11: CALL_KQ_MOE(q3_k); break; case 12: CALL_KQ_MOE(q4_k); break;
            case 13: CALL_KQ_MOE(q5_k); break; case 14: CALL_KQ_MOE(q6_k); break;
            }
        });
        mma_from = tiled_min;
    }
    launch({cdiv(rows, ROW_WARPS), (unsigned)ne, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
#define CALL_MOE(S) moe_lowbit_##S(w.data(), rb, rows, cols, act, div, offsets, order, repacked, tiled_min, mma_from, out)
        LOWBIT_SWITCH(ty, CALL_MOE)
    });
}

// matmul.rs's matmul_dp4a: up to three ty (8 Q8_0, 39 MXFP4) matrices of cols columns (rows 0:
// absent; mask: those with a bias) over n tokens of Q8_0 activations xq in one launch; reads
// dir's w0..w2 and b0..b2, writes y0..y2.
static void run_dp4a_group(const std::string& dir, int ty, int cols, int n, const int rows[3], int mask,
                           const std::vector<u8>& xq) {
    auto P = [&](const char* f) { static std::string s; s = dir + "/" + f; return s.c_str(); };
    std::vector<u8> w[3];
    std::vector<float> b[3], y[3];
    unsigned long long rb[3] = {0, 0, 0};
    int ends[3], end = 0;
    unsigned per_block = ROW_WARPS * (ty == 8 ? DP4A_Q8_0_ROWS : DP4A_MXFP4_ROWS);
    const char* wn[3] = {"w0", "w1", "w2"};
    const char* bn[3] = {"b0", "b1", "b2"};
    for (int i = 0; i < 3; i++) {
        if (rows[i] > 0) {
            w[i] = rd<u8>(P(wn[i]));
            rb[i] = w[i].size() / rows[i];
            if (mask >> i & 1) b[i] = rd<float>(P(bn[i]));
            y[i].assign((size_t)n * rows[i], 0.f);
            end += (int)cdiv(rows[i], per_block);
        } else {
            y[i].assign(1, 0.f);
        }
        ends[i] = end;
    }
    const u8* xqp = xq.data();
    auto wp = [&](int i) { return rows[i] > 0 ? (const u8*)w[i].data() : xqp; };
    auto bp = [&](int i) { return b[i].empty() ? (const float*)nullptr : (const float*)b[i].data(); };
    launch({(unsigned)end, cdiv(n, DP4A_TOKENS), 1}, {ROW_WARPS * 32, 1, 1}, [&] {
#define CALL_DP4A_GROUP(S) matmul_dp4a_##S(xqp, cols, n, wp(0), rb[0], y[0].data(), bp(0), rows[0], ends[0], \
                                        wp(1), rb[1], y[1].data(), bp(1), rows[1], ends[1], \
                                        wp(2), rb[2], y[2].data(), bp(2), rows[2], ends[2])
        if (ty == 8) CALL_DP4A_GROUP(q8_0);
        else CALL_DP4A_GROUP(mxfp4);
    });
    const char* yn[3] = {"y0", "y1", "y2"};
    for (int i = 0; i < 3; i++)
        if (rows[i] > 0) wr(P(yn[i]), y[i]);
}

int main(int argc, char** argv) {
    std::string op = argv[1];
    std::string dir = argv[2];
    auto P = [&](const char* n) { static std::string s; s = dir + "/" + n; return s.c_str(); };
    if (op == "quantize") {
        // Optional: the activation type (ggml id 8 Q8_0, 9 Q8_1, 15 Q8_K).
        int act = argc > 3 ? atoi(argv[3]) : 8;
        auto x = rd<float>(P("x"));
        wr(P("out"), quantize_act(act, x.data(), x.size()));
    } else if (op == "get_rows") {
        int ty = atoi(argv[3]), rows = atoi(argv[4]), cols = atoi(argv[5]);
        auto table = rd<u8>(P("w"));
        auto ids = rd<int>(P("ids"));
        int n = (int)ids.size();
        std::vector<float> out((size_t)n * cols);
        unsigned long long rb = table.size() / rows;
        float* o = out.data();
        launch({(unsigned)n, 1, 1}, {256, 1, 1}, [&] {
#define CALL_ROWS(S) get_rows_##S(table.data(), rb, rows, ids.data(), o, n, cols)
            LOWBIT_SWITCH(ty, CALL_ROWS)
        });
        wr(P("out"), out);
    } else if (op == "matmul") {
        int ty = atoi(argv[3]), rows = atoi(argv[4]), cols = atoi(argv[5]), n = atoi(argv[6]);
        // Optional: 1 = a device of sm_80+, whose Q8_0/MXFP4 batches take the tensor-core
        // kernel (here for every n, to test it alone).
        bool mma = argc > 7 && atoi(argv[7]) == 1;
        auto w = rd<u8>(P("w"));
        auto x = rd<float>(P("x"));
        std::vector<float> y((size_t)n * rows);
        unsigned long long rb = w.size() / rows;
        if (lowbit(ty)) {  // lowbit.rs: matmul_lowbit and dense_orders
            auto xq = quantize_act(act_type(ty), x.data(), (size_t)n * cols);
            bool kq = ty >= 10;
            int grouped = 0, first = 0, rest = 0;
            if ((ty == 2 || ty == 12) && rows % 8 == 0) {
                first = ty == 12 ? 3 : 2;
                rest = 2;
                grouped = ty == 12 ? n - n % 4 : 0;
            } else if (kq && n >= 8) {
                first = rest = 1;
            }
            float* yp = y.data();
            const u8 *wp = w.data(), *xqp = xq.data();
            if (mma && kq && n >= 8 && first != 0 && rest != 0) {  // lowbit.rs: matmul_lowbit
                launch({cdiv(rows, MMA_ROWS_KQ), cdiv(n, TILE_SLOTS), 1}, {32 * MMA_WARPS, 1, 1}, [&] {
#define CALL_KQ_MM(S) matmul_mma_##S(wp, rb, rows, cols / 256, xqp, n, grouped, first, rest, yp)
                    switch (ty) {
                    case 10: CALL_KQ_MM(q2_k); break; case 11: CALL_KQ_MM(q3_k); break; case 12: CALL_KQ_MM(q4_k); break;
                    case 13: CALL_KQ_MM(q5_k); break; case 14: CALL_KQ_MM(q6_k); break;
                    }
                });
                wr(P("y"), y);
                return 0;
            }
            launch({cdiv(rows, ROW_WARPS), cdiv(n, LB_TOKENS), 1}, {ROW_WARPS * 32, 1, 1}, [&] {
#define CALL_MM(S) matmul_##S(wp, rb, xqp, yp, rows, cols, n, grouped, first, rest)
                switch (ty) {
                case 2: CALL_MM(q4_0); break; case 3: CALL_MM(q4_1); break; case 6: CALL_MM(q5_0); break;
                case 7: CALL_MM(q5_1); break; case 10: CALL_MM(q2_k); break; case 11: CALL_MM(q3_k); break;
                case 12: CALL_MM(q4_k); break; case 13: CALL_MM(q5_k); break; case 14: CALL_MM(q6_k); break;
                }
            });
            wr(P("y"), y);
            return 0;
        }
        std::vector<u8> xq;
        uint3 grid = {cdiv(rows, ROW_WARPS), cdiv(n, MM_TOKENS), 1}, blk = {ROW_WARPS * 32, 1, 1};
        float* yp = y.data();
        const u8* wp = w.data();
        if (ty == 8 || ty == 39) xq = quantize(x.data(), (size_t)n * cols);
        const u8* xqp = xq.data();
        const float* xp = x.data();
        if ((ty == 8 || ty == 39) && mma) {  // capabilities.rs: tiled_kernel
            unsigned rpb = ty == 8 ? MMA_ROWS_Q8_0 : MMA_ROWS_MXFP4;
            launch({cdiv(rows, rpb), cdiv(n, TILE_SLOTS), 1}, {32 * MMA_WARPS, 1, 1}, [&] {
                if (ty == 8) matmul_mma_q8_0(wp, rb, rows, cols / 32, xqp, n, yp);
                else matmul_mma_mxfp4(wp, rb, rows, cols / 32, xqp, n, yp);
            });
            wr(P("y"), y);
            return 0;
        }
        if ((ty == 8 || ty == 39) && n >= 32) {  // matmul.rs: MM_TILED_MIN_TOKENS
            launch({cdiv(rows, 64), cdiv(n, 32), 1}, {256, 1, 1}, [&] {
                if (ty == 8) matmul_tiled_q8_0(wp, rb, rows, cols / 32, xqp, n, yp);
                else matmul_tiled_mxfp4(wp, rb, rows, cols / 32, xqp, n, yp);
            });
            wr(P("y"), y);
            return 0;
        }
        if (ty == 8 || ty == 39) {  // matmul.rs: matmul_dp4a, a group of one
            unsigned per_block = ROW_WARPS * (ty == 8 ? DP4A_Q8_0_ROWS : DP4A_MXFP4_ROWS);
            int nb = (int)cdiv(rows, per_block);
            launch({(unsigned)nb, cdiv(n, DP4A_TOKENS), 1}, blk, [&] {
#define CALL_DP4A_ONE(S) matmul_dp4a_##S(xqp, cols, n, wp, rb, yp, nullptr, rows, nb, \
                                          xqp, 0, yp, nullptr, 0, nb, xqp, 0, yp, nullptr, 0, nb)
                if (ty == 8) CALL_DP4A_ONE(q8_0);
                else CALL_DP4A_ONE(mxfp4);
            });
            wr(P("y"), y);
            return 0;
        }
        // Optional: 1 = a bias (file "b", one per row) added by the GEMV kernel.
        std::vector<float> bias;
        if (argc > 8 && atoi(argv[8]) == 1) bias = rd<float>(P("b"));
        const float* bp = bias.empty() ? nullptr : bias.data();
        launch(grid, blk, [&] {
            switch (ty) {
            case 0: matmul_f32(wp, rb, xp, yp, bp, rows, cols, n); break;
            case 1: matmul_f16(wp, rb, xp, yp, bp, rows, cols, n); break;
            case 30: matmul_bf16(wp, rb, xp, yp, bp, rows, cols, n); break;
            }
        });
        wr(P("y"), y);
    } else if (op == "matmul_group") {  // matmul.rs: matmul_shared's one dp4a launch
        // ty, cols, n, the rows of up to three matrices (0: absent) and a mask of those with a
        // bias; reads w0..w2, b0..b2 and x, writes y0..y2.
        int ty = atoi(argv[3]), cols = atoi(argv[4]), n = atoi(argv[5]);
        int rows[3] = {atoi(argv[6]), atoi(argv[7]), atoi(argv[8])}, mask = atoi(argv[9]);
        auto x = rd<float>(P("x"));
        run_dp4a_group(dir, ty, cols, n, rows, mask, quantize(x.data(), (size_t)n * cols));
    } else if (op == "norm_matmul_group") {  // matmul.rs: norm_matmul_shared's two launches
        // As matmul_group, then the norm's epsilon (its bits) and whether a residual y is added:
        // rms_norm_q8_0 of x (rows of cols; reads x, w and y) writes out, x and its Q8_0 blocks
        // q, which the dp4a group multiplies.
        int ty = atoi(argv[3]), cols = atoi(argv[4]), n = atoi(argv[5]);
        int rows[3] = {atoi(argv[6]), atoi(argv[7]), atoi(argv[8])}, mask = atoi(argv[9]);
        float eps = __uint_as_float((unsigned)strtoul(argv[10], nullptr, 10));
        bool add = atoi(argv[11]) == 1;
        auto x = rd<float>(P("x"));
        auto w = rd<float>(P("w"));
        std::vector<float> y = add ? rd<float>(P("y")) : std::vector<float>();
        int nr = (int)(x.size() / cols);
        std::vector<float> out(x.size());
        std::vector<u8> q(x.size() / 32 * 34, 0x5a);  // stale scratch
        float *xp = x.data(), *op = out.data();
        u8* qp = q.data();
        launch({(unsigned)nr, 1, 1}, {256, 1, 1}, [&] {
            if (add) add_rms_norm_q8_0_f32(xp, y.data(), w.data(), op, qp, nr, cols, eps);
            else rms_norm_q8_0_f32(xp, w.data(), op, qp, nr, cols, eps);
        });
        wr(P("out"), out);
        wr(P("x"), x);
        wr(P("q"), q);
        if (n > 0) run_dp4a_group(dir, ty, cols, n, rows, mask, q);
    } else if (op == "moe") {
        int ty = atoi(argv[3]), ne = atoi(argv[4]), d = atoi(argv[5]), ff = atoi(argv[6]),
            n = atoi(argv[7]), k = atoi(argv[8]);
        // Optional: the activation (0 clamped SwiGLU, 1 SiLU), whether there are biases, and
        // the types of up and down (default: ty).
        int act = argc > 9 ? atoi(argv[9]) : 0, hb = argc > 10 ? atoi(argv[10]) : 1;
        int up_ty = argc > 11 ? atoi(argv[11]) : ty, down_ty = argc > 12 ? atoi(argv[12]) : ty;
        // Optional: 1 = a device of sm_80+ (the tensor-core expert products, here for every
        // number of slots).
        bool mma = argc > 13 && atoi(argv[13]) == 1;
        auto gate = rd<u8>(P("gate")), up = rd<u8>(P("up")), down = rd<u8>(P("down"));
        auto bg = rd<float>(P("bg")), bu = rd<float>(P("bu")), bd = rd<float>(P("bd"));
        auto x = rd<float>(P("x"));
        auto sel = rd<int>(P("sel"));
        auto wts = rd<float>(P("wts"));
        int slots = n * k;
        std::vector<float> h((size_t)slots * ff), y((size_t)slots * d), out((size_t)n * d);
        unsigned long long rb_d = gate.size() / ((size_t)ne * ff), rb_ff = down.size() / ((size_t)ne * d);
        bool qz = ty == 8 || ty == 39;
        std::vector<u8> hq;
        float* hp = h.data();
        float* yp = y.data();
        if (lowbit(ty) || lowbit(up_ty) || lowbit(down_ty)) {  // lowbit.rs: moe_products_lowbit
            std::vector<int> offsets(ne + 1), order(slots);
            launch({1, 1, 1}, {256, 1, 1}, [&] { moe_group(sel.data(), slots, ne, offsets.data(), order.data()); });
            auto xg = quantize_act(act_type(ty), x.data(), (size_t)n * d);
            auto xu = quantize_act(act_type(up_ty), x.data(), (size_t)n * d);
            std::vector<float> g((size_t)slots * ff), u((size_t)slots * ff);
            moe_lowbit(ty, gate, ne, ff, d, xg.data(), k, offsets.data(), order.data(), slots, mma, g.data());
            moe_lowbit(up_ty, up, ne, ff, d, xu.data(), k, offsets.data(), order.data(), slots, mma, u.data());
            launch({cdiv(slots * ff, 256), 1, 1}, {256, 1, 1}, [&] {
                moe_swiglu(g.data(), u.data(), bg.data(), bu.data(), hb, sel.data(), hp, slots, ne, ff, act);
            });
            hq = quantize_act(act_type(down_ty), h.data(), (size_t)slots * ff);
            moe_lowbit(down_ty, down, ne, d, ff, hq.data(), 1, offsets.data(), order.data(), slots, mma, yp);
            launch({cdiv(slots * d, 256), 1, 1}, {256, 1, 1}, [&] { moe_down_bias(yp, bd.data(), hb, sel.data(), slots, ne, d); });
        } else if (qz && (slots >= 64 || mma)) {  // experts.rs: MOE_TILED_MIN_SLOTS
            auto xq = quantize(x.data(), (size_t)n * d);
            std::vector<int> offsets(ne + 1), order(slots);
            launch({1, 1, 1}, {256, 1, 1}, [&] { moe_group(sel.data(), slots, ne, offsets.data(), order.data()); });
            auto mm = [&](const std::vector<u8>& w, unsigned long long rb, int rows, int nb, const u8* act, int div, float* o) {
                if (mma) {  // experts.rs: moe_mm over the tile list
                    unsigned rpb = ty == 8 ? MMA_ROWS_Q8_0 : MMA_ROWS_MXFP4, max = 0;
                    auto tiles = tile_list(offsets.data(), ne, slots, 1, &max);
                    const int* tp = tiles.data();
                    launch({cdiv(rows, rpb), max, 1}, {32 * MMA_WARPS, 1, 1}, [&] {
                        if (ty == 8) moe_mm_mma_q8_0(w.data(), rb, rows, nb, act, div, tp, order.data(), o);
                        else moe_mm_mma_mxfp4(w.data(), rb, rows, nb, act, div, tp, order.data(), o);
                    });
                    return;
                }
                launch({cdiv(rows, 64), (unsigned)ne, 1}, {256, 1, 1}, [&] {
                    if (ty == 8) moe_mm_q8_0(w.data(), rb, rows, nb, act, div, offsets.data(), order.data(), o);
                    else moe_mm_mxfp4(w.data(), rb, rows, nb, act, div, offsets.data(), order.data(), o);
                });
            };
            std::vector<float> g((size_t)slots * ff), u((size_t)slots * ff);
            mm(gate, rb_d, ff, d / 32, xq.data(), k, g.data());
            mm(up, rb_d, ff, d / 32, xq.data(), k, u.data());
            launch({cdiv(slots * ff, 256), 1, 1}, {256, 1, 1}, [&] {
                moe_swiglu(g.data(), u.data(), bg.data(), bu.data(), hb, sel.data(), hp, slots, ne, ff, act);
            });
            hq = quantize(h.data(), (size_t)slots * ff);
            mm(down, rb_ff, d, ff / 32, hq.data(), 1, yp);
            launch({cdiv(slots * d, 256), 1, 1}, {256, 1, 1}, [&] { moe_down_bias(yp, bd.data(), hb, sel.data(), slots, ne, d); });
        } else if (qz) {  // experts.rs: moe_dp4a, two launches that write out
            unsigned lanes = ty == 39 ? 4 : 8, rows_per_block = ty == 39 ? DP4A_MXFP4_ROWS : DP4A_Q8_0_ROWS;
            // h's Q8_0 blocks; a slot with an out-of-range expert keeps this poison.
            hq.assign((size_t)slots * (ff / 32) * 34, 0xA5);
            u8* hqp = hq.data();
            float* op_ = out.data();
            launch({(unsigned)ff / MOE_H_ROWS, (unsigned)slots, 1}, {MOE_H_ROWS * lanes, 1, 1}, [&] {
                if (ty == 8) moe_dp4a_gate_up_q8_0(gate.data(), up.data(), bg.data(), bu.data(), hb, x.data(), sel.data(), hqp, slots, k, ne, d, ff, rb_d, act);
                else moe_dp4a_gate_up_mxfp4(gate.data(), up.data(), bg.data(), bu.data(), hb, x.data(), sel.data(), hqp, slots, k, ne, d, ff, rb_d, act);
            });
            launch({cdiv(d, rows_per_block), (unsigned)n, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
                if (ty == 8) moe_dp4a_down_q8_0(down.data(), bd.data(), hb, hqp, sel.data(), wts.data(), op_, n, k, ne, d, ff, rb_ff);
                else moe_dp4a_down_mxfp4(down.data(), bd.data(), hb, hqp, sel.data(), wts.data(), op_, n, k, ne, d, ff, rb_ff);
            });
            wr(P("out"), out);
            return 0;
        } else {
            launch({cdiv(ff, ROW_WARPS), (unsigned)slots, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
                switch (ty) {
                case 0: moe_gate_up_f32(gate.data(), up.data(), bg.data(), bu.data(), hb, x.data(), sel.data(), hp, slots, k, ne, d, ff, rb_d, act); break;
                case 1: moe_gate_up_f16(gate.data(), up.data(), bg.data(), bu.data(), hb, x.data(), sel.data(), hp, slots, k, ne, d, ff, rb_d, act); break;
                case 30: moe_gate_up_bf16(gate.data(), up.data(), bg.data(), bu.data(), hb, x.data(), sel.data(), hp, slots, k, ne, d, ff, rb_d, act); break;
                }
            });
            launch({cdiv(d, ROW_WARPS), (unsigned)slots, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
                switch (ty) {
                case 0: moe_down_f32(down.data(), bd.data(), hb, hp, sel.data(), yp, slots, ne, d, ff, rb_ff, act); break;
                case 1: moe_down_f16(down.data(), bd.data(), hb, hp, sel.data(), yp, slots, ne, d, ff, rb_ff, act); break;
                case 30: moe_down_bf16(down.data(), bd.data(), hb, hp, sel.data(), yp, slots, ne, d, ff, rb_ff, act); break;
                }
            });
        }
        float* op_ = out.data();
        launch({cdiv(n * d, 256), 1, 1}, {256, 1, 1}, [&] { moe_combine(yp, wts.data(), op_, n, k, d); });
        wr(P("out"), out);
    } else if (op == "kv_store") {  // kv_ring.rs: kv_store_pair (a second ring when ty2 >= 0)
        int ty = atoi(argv[3]), n_tokens = atoi(argv[4]), width = atoi(argv[5]), cells = atoi(argv[6]),
            pos0 = atoi(argv[7]), rot = atoi(argv[8]);
        int ty2 = argc > 9 ? atoi(argv[9]) : -1, width2 = argc > 10 ? atoi(argv[10]) : 0,
            cells2 = argc > 11 ? atoi(argv[11]) : 0, rot2 = argc > 12 ? atoi(argv[12]) : 0;
        auto src = rd<float>(P("src"));
        auto ring = rd<u8>(P("ring"));
        std::vector<float> src2 = ty2 >= 0 ? rd<float>(P("src2")) : std::vector<float>(1);
        std::vector<u8> ring2 = ty2 >= 0 ? rd<u8>(P("ring2")) : std::vector<u8>(1);
        unsigned long long items = kv_store_items(ty, rot, n_tokens, width);
        if (ty2 >= 0 && kv_store_items(ty2, rot2, n_tokens, width2) > items) items = kv_store_items(ty2, rot2, n_tokens, width2);
        u8 *r = ring.data(), *r2 = ring2.data();
        launch({cdiv(items, 256), ty2 >= 0 ? 2u : 1u, 1}, {256, 1, 1}, [&] {
            kv_store(src.data(), r, ty, rot, width, cells, src2.data(), r2, ty2 < 0 ? ty : ty2, rot2,
                     width2, cells2, n_tokens, &pos0);
        });
        wr(P("ring"), ring);
        if (ty2 >= 0) wr(P("ring2"), ring2);
    } else if (op == "attn") {
        int n_tokens = atoi(argv[3]), n_head = atoi(argv[4]), n_kv = atoi(argv[5]), hd = atoi(argv[6]),
            cells = atoi(argv[7]), pos0 = atoi(argv[8]), window = atoi(argv[9]), has_sinks = atoi(argv[10]);
        unsigned scale_bits = (unsigned)strtoul(argv[11], nullptr, 10);
        int k_ty = atoi(argv[12]), v_ty = atoi(argv[13]), k_rot = atoi(argv[14]), v_rot = atoi(argv[15]);
        int value_chains = atoi(argv[16]);
        float scale = __uint_as_float(scale_bits);
        auto q = rd<float>(P("q"));
        auto kc = rd<u8>(P("k")), vc = rd<u8>(P("v"));
        auto sinks = rd<float>(P("sinks"));
        std::vector<float> out(q.size());
        float* o = out.data();
        // attention.rs: f32/f16 values with -fa off (the others take attn_chunked below).
        launch({(unsigned)n_head, (unsigned)n_tokens, 1}, {ATT_WARPS * 32, 1, 1}, [&] {
            attn_row(q.data(), kc.data(), vc.data(), sinks.data(), has_sinks, o, n_tokens, n_head, n_kv, hd, cells, &pos0, window, scale, k_ty, v_ty, k_rot, value_chains);
        });
        wr(P("out"), out);
    } else if (op == "attn_chunked") {
        // attention_chunked.rs: the launch shape (ChunkedShape) comes from the test.
        int n_tokens = atoi(argv[3]), n_head = atoi(argv[4]), n_kv = atoi(argv[5]), hd = atoi(argv[6]),
            cells = atoi(argv[7]), pos0 = atoi(argv[8]), window = atoi(argv[9]), has_sinks = atoi(argv[10]);
        float scale = __uint_as_float((unsigned)strtoul(argv[11], nullptr, 10));
        int k_ty = atoi(argv[12]), v_ty = atoi(argv[13]), k_rot = atoi(argv[14]), v_rot = atoi(argv[15]);
        int hpc = atoi(argv[16]), tpc = atoi(argv[17]), slots = atoi(argv[18]), split = atoi(argv[19]);
        auto q = rd<float>(P("q"));
        auto kc = rd<u8>(P("k")), vc = rd<u8>(P("v"));
        auto sinks = rd<float>(P("sinks"));
        std::vector<float> out(q.size());
        // Scratch poisoned with NaN: a record the fold reads but no block wrote shows.
        std::vector<float> part(split ? (size_t)slots * n_tokens * n_head * (hd + 2) : 1, NAN);
        float *o = out.data(), *pt = part.data();
        unsigned gz = cdiv(n_tokens, tpc);
        launch({(unsigned)(n_head / hpc), split ? (unsigned)slots : 1u, gz}, {CH_THREADS, 1, 1}, [&] {
            attn_chunked(q.data(), kc.data(), vc.data(), sinks.data(), has_sinks, o, pt, n_tokens, n_head, n_kv, hd,
                         cells, &pos0, window, scale, k_ty, v_ty, k_rot, v_rot, hpc, tpc, split);
        });
        if (split) {
            launch({(unsigned)n_head, (unsigned)n_tokens, 1}, {cdiv(hd, 32) * 32, 1, 1}, [&] {
                attn_chunked_fold(pt, sinks.data(), has_sinks, o, n_tokens, n_head, hd, cells, &pos0, window, v_rot);
            });
        }
        wr(P("out"), out);
    } else if (op == "rope") {  // rowwise.rs: rope_neox_pair (kind 0) and rope_norm (kind 1)
        int kind = atoi(argv[3]), n = atoi(argv[4]), nh = atoi(argv[5]), nh2 = atoi(argv[6]),
            hd = atoi(argv[7]), first = atoi(argv[8]), nd = atoi(argv[9]);
        auto x = rd<float>(P("x"));
        std::vector<float> x2 = nh2 > 0 ? rd<float>(P("x2")) : std::vector<float>(1);
        auto pos = rd<int>(P("pos"));
        auto f = rd<float>(P("params"));  // theta_scale, freq_scale, ext_factor, attn_factor, low, high
        float *xp = x.data(), *x2p = x2.data();
        launch({(unsigned)(nh + nh2), (unsigned)n, 1}, {32, 1, 1}, [&] {
            if (kind == 0) rope_neox_f32(xp, nh, x2p, nh2, pos.data(), n, hd, nd, f[0], f[1], f[2], f[3], f[4], f[5]);
            else rope_norm_f32(xp, nh, x2p, nh2, pos.data(), n, hd, first, nd, f[0], f[1], f[2], f[3], f[4], f[5]);
        });
        wr(P("x"), x);
        if (nh2 > 0) wr(P("x2"), x2);
    } else if (op == "matmul_heads") {
        int ty = atoi(argv[3]), out = atoi(argv[4]), cols = atoi(argv[5]), n_rows = atoi(argv[6]),
            nh = atoi(argv[7]), stride = atoi(argv[8]), vec = atoi(argv[9]);
        auto w = rd<u8>(P("w"));
        auto x = rd<float>(P("x"));
        std::vector<float> y((size_t)n_rows * out);
        unsigned long long rb = w.size() / ((size_t)out * nh);
        if (lowbit(ty)) {  // lowbit.rs: matmul_heads_lowbit and heads_orders
            int n = n_rows / nh, rows = out * nh;
            std::vector<float> g((size_t)n_rows * cols);  // copy_rows_f32 when strided
            for (int i = 0; i < n_rows; i++) memcpy(&g[(size_t)i * cols], &x[(size_t)i * stride], cols * 4);
            auto xq = quantize_act(act_type(ty), g.data(), g.size());
            bool kq = ty >= 10, rep = (ty == 2 || ty == 12) && rows % 8 == 0;
            int grouped = 0, first = 0, rest = 0;
            if (stride == cols && rep) {
                first = ty == 12 ? 3 : 2;
                rest = 2;
                grouped = ty == 12 ? n - n % 4 : 0;
            } else if (rep) {
                first = rest = 2;
            } else if (kq && n >= 8) {
                first = rest = 1;
            }
            float* yp = y.data();
            const u8 *wp = w.data(), *xqp = xq.data();
            launch({cdiv(out, ROW_WARPS), cdiv(n, LB_TOKENS) * nh, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
#define CALL_HEADS(S) matmul_heads_##S(wp, rb, xqp, yp, out, cols, n, nh, grouped, first, rest)
                switch (ty) {
                case 2: CALL_HEADS(q4_0); break; case 3: CALL_HEADS(q4_1); break; case 6: CALL_HEADS(q5_0); break;
                case 7: CALL_HEADS(q5_1); break; case 10: CALL_HEADS(q2_k); break; case 11: CALL_HEADS(q3_k); break;
                case 12: CALL_HEADS(q4_k); break; case 13: CALL_HEADS(q5_k); break; case 14: CALL_HEADS(q6_k); break;
                }
            });
            wr(P("y"), y);
            return 0;
        }
        std::vector<u8> xq;
        if (ty == 8 || ty == 39) xq = quantize(x.data(), (size_t)n_rows * stride);
        const u8 *wp = w.data(), *xqp = xq.data();
        const float* xp = x.data();
        float* yp = y.data();
        launch({cdiv(out, ROW_WARPS), (unsigned)n_rows, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
            switch (ty) {
            case 0: matmul_heads_f32(wp, rb, xp, yp, out, cols, n_rows, nh, stride, vec); break;
            case 1: matmul_heads_f16(wp, rb, xp, yp, out, cols, n_rows, nh, stride, vec); break;
            case 30: matmul_heads_bf16(wp, rb, xp, yp, out, cols, n_rows, nh, stride, vec); break;
            case 8: matmul_heads_q8_0(wp, rb, xqp, yp, out, cols, n_rows, nh, stride, vec); break;
            case 39: matmul_heads_mxfp4(wp, rb, xqp, yp, out, cols, n_rows, nh, stride, vec); break;
            }
        });
        wr(P("y"), y);
    } else if (op == "rms_norm") {  // rowwise.rs: rms_norm, and add_rms_norm with a residual y
        int n = atoi(argv[3]);
        float eps = __uint_as_float((unsigned)strtoul(argv[4], nullptr, 10));  // its bits
        bool add = atoi(argv[5]) == 1;
        auto x = rd<float>(P("x"));
        auto w = rd<float>(P("w"));
        std::vector<float> y = add ? rd<float>(P("y")) : std::vector<float>();
        int rows = (int)(x.size() / n);
        std::vector<float> out(x.size());
        float *xp = x.data(), *op = out.data();
        launch({(unsigned)rows, 1, 1}, {256, 1, 1}, [&] {
            if (add) add_rms_norm_f32(xp, y.data(), w.data(), op, rows, n, eps);
            else rms_norm_f32(xp, w.data(), op, rows, n, eps);
        });
        wr(P("out"), out);
        wr(P("x"), x);
    } else if (op == "swiglu") {
        int n = atoi(argv[3]);
        auto g = rd<float>(P("g"));
        auto u = rd<float>(P("u"));
        float* gp = g.data();
        unsigned long long total = g.size();
        launch({cdiv(total, 256), 1, 1}, {256, 1, 1}, [&] { swiglu_f32(gp, u.data(), total, n); });
        wr(P("g"), g);
    } else if (op == "attn_k_only") {
        // latent_attention.rs: split (1) runs attn_k_only_scores_*, _weights_* and _values_*
        // over a scratch of stale bits, the scores' grid capped at `tiles` blocks per (group,
        // token) (KS_MAX_TILES in the launch code); else attn_k_only_*. out starts as it is in
        // the "out" file, so that a launch that writes nothing shows.
        int n = atoi(argv[3]), nh = atoi(argv[4]), kd = atoi(argv[5]), vd = atoi(argv[6]),
            cells = atoi(argv[7]), pos0 = atoi(argv[8]);
        float scale = __uint_as_float((unsigned)strtoul(argv[9], nullptr, 10));
        int ty = atoi(argv[10]);  // the ring's ggml type id
        int split = atoi(argv[11]), tiles = atoi(argv[12]);
        auto q = rd<float>(P("q"));
        auto kc = rd<u8>(P("k"));
        auto out = rd<float>(P("out"));
        float* o = out.data();
        // latent_attention.rs: the queries in the keys' vec_dot_type for block rings.
        bool blocks = ty != 0 && ty != 1 && ty != 30;
        std::vector<u8> qq;
        if (blocks) qq = quantize_act(act_type(ty), q.data(), q.size());
        const u8 *qqp = qq.data(), *kp = kc.data();
        const float* qp = q.data();
#define KO_SWITCH(CALL) \
    switch (ty) { \
    case 0: CALL(f32); break; case 1: CALL(f16); break; case 30: CALL(bf16); break; \
    case 8: CALL(q8_0); break; case 2: CALL(q4_0); break; case 3: CALL(q4_1); break; \
    case 6: CALL(q5_0); break; case 7: CALL(q5_1); break; }
        if (split) {
            std::vector<float> sc((size_t)n * nh * cells, __uint_as_float(0x7fc05a5au));
            float* sp = sc.data();
            unsigned groups = cdiv(nh, KS_HEADS), grid_x = cdiv(cells, KS_POS);
            if (grid_x > (unsigned)tiles) grid_x = tiles;
            launch({grid_x, groups, (unsigned)n}, {KO_THREADS, 1, 1}, [&] {
#define CALL_KS(S) attn_k_only_scores_##S(qp, qqp, kp, sp, n, nh, kd, cells, &pos0, scale)
                KO_SWITCH(CALL_KS)
            });
            launch({(unsigned)nh, (unsigned)n, 1}, {KO_THREADS, 1, 1}, [&] {
                if (ty == 1) attn_k_only_weights_f16(sp, n, nh, cells, &pos0);
                else if (ty == 30) attn_k_only_weights_bf16(sp, n, nh, cells, &pos0);
                else attn_k_only_weights_f32(sp, n, nh, cells, &pos0);
            });
            launch({cdiv(vd, KV_DIMS), groups, (unsigned)n}, {KO_THREADS, 1, 1}, [&] {
#define CALL_KV(S) attn_k_only_values_##S(sp, kp, o, n, nh, kd, vd, cells, &pos0)
                KO_SWITCH(CALL_KV)
            });
        } else {
            launch({(unsigned)nh, (unsigned)n, 1}, {KO_THREADS, 1, 1}, [&] {
#define CALL_KO(S) attn_k_only_##S(qp, qqp, kp, o, n, nh, kd, vd, cells, &pos0, scale)
                KO_SWITCH(CALL_KO)
            });
        }
        wr(P("out"), out);
    } else if (op == "route") {
        int n = atoi(argv[3]), ne = atoi(argv[4]), k = atoi(argv[5]), gating = atoi(argv[6]),
            groups = atoi(argv[7]), used = atoi(argv[8]), norm = atoi(argv[9]), has_bias = atoi(argv[10]);
        float wscale = __uint_as_float((unsigned)strtoul(argv[11], nullptr, 10));
        auto logits = rd<float>(P("logits"));
        auto bias = rd<float>(P("bias"));
        std::vector<int> sel((size_t)n * k);
        std::vector<float> w((size_t)n * k), probs((size_t)n * ne), scores((size_t)n * ne);
        int* sp = sel.data();
        float *wp = w.data(), *pp = probs.data(), *qp = scores.data();
        launch({cdiv(n, 64), 1, 1}, {64, 1, 1}, [&] {
            route_f32(logits.data(), bias.data(), has_bias, gating, sp, wp, pp, qp, n, ne, k, groups, used, norm, wscale);
        });
        wr(P("sel"), sel);
        wr(P("w"), w);
    } else if (op == "top_k") {
        // top_k.rs's launches: the chunks' k best keys into scratch, then each row's merge.
        int n = atoi(argv[3]), nv = atoi(argv[4]), k = atoi(argv[5]);
        auto logits = rd<float>(P("logits"));
        unsigned nc = cdiv(nv, TK_CHUNK);
        std::vector<u64> part((size_t)n * nc * k, 0x5a5a5a5a5a5a5a5aull);  // stale scratch
        std::vector<float> values((size_t)n * k);
        std::vector<int> ids((size_t)n * k);
        u64* pp = part.data();
        launch({nc, (unsigned)n, 1}, {TK_THREADS, 1, 1}, [&] { top_k_chunks(logits.data(), pp, nv, k); });
        launch({(unsigned)n, 1, 1}, {TK_THREADS, 1, 1}, [&] {
            top_k_merge(logits.data(), pp, values.data(), ids.data(), nv, (int)nc, k);
        });
        wr(P("values"), values);
        wr(P("ids"), ids);
    } else if (op == "router_logits") {  // routing.rs: router_top_k_logits's one launch
        // ty, rows (experts), cols, n, k, whether there is a bias (file "b"), the block order
        // (g_block_order) and how many launches in a row. Reads w, x and "done", the counter
        // as the last run left it; writes the last launch's y (logits), sel and w, and the
        // counter back to "done". Each launch's outputs start poisoned (NaN, -7).
        int ty = atoi(argv[3]), rows = atoi(argv[4]), cols = atoi(argv[5]), n = atoi(argv[6]),
            k = atoi(argv[7]), has_bias = atoi(argv[8]);
        g_block_order = (unsigned)atoi(argv[9]);
        int reps = atoi(argv[10]);
        auto w = rd<u8>(P("w"));
        auto x = rd<float>(P("x"));
        std::vector<float> bias = has_bias ? rd<float>(P("b")) : std::vector<float>();
        unsigned done = (unsigned)rd<int>(P("done"))[0];
        unsigned long long rb = w.size() / rows;
        std::vector<float> y, wts;
        std::vector<int> sel;
        for (int r = 0; r < reps; r++) {
            y.assign((size_t)n * rows, NAN);
            wts.assign((size_t)n * k, NAN);
            sel.assign((size_t)n * k, -7);
            const float* bp = bias.empty() ? nullptr : bias.data();
            float *yp = y.data(), *wp = wts.data();
            int* sp = sel.data();
            launch({cdiv(rows, ROW_WARPS), 1, 1}, {ROW_WARPS * 32, 1, 1}, [&] {
                switch (ty) {
                case 0: router_logits_topk_f32(w.data(), rb, x.data(), yp, bp, rows, cols, n, sp, wp, k, &done); break;
                case 1: router_logits_topk_f16(w.data(), rb, x.data(), yp, bp, rows, cols, n, sp, wp, k, &done); break;
                case 30: router_logits_topk_bf16(w.data(), rb, x.data(), yp, bp, rows, cols, n, sp, wp, k, &done); break;
                }
            });
        }
        wr(P("y"), y);
        wr(P("sel"), sel);
        wr(P("w"), wts);
        wr(P("done"), std::vector<int>{(int)done});
    } else if (op == "router") {
        int n = atoi(argv[3]), ne = atoi(argv[4]), k = atoi(argv[5]);
        auto logits = rd<float>(P("logits"));
        std::vector<int> sel((size_t)n * k);
        std::vector<float> w((size_t)n * k);
        int* sp = sel.data();
        float* wp = w.data();
        launch({cdiv(n, ROW_WARPS), 1, 1}, {ROW_WARPS * 32, 1, 1}, [&] { router_topk_softmax(logits.data(), sp, wp, n, ne, k); });
        wr(P("sel"), sel);
        wr(P("w"), w);
    }
    return 0;
}
