/*
 * Records ggml's outputs for the deterministic inputs of `golden_case` in
 * ../src/tests_lowbit.rs (the table GGML_GOLDENS there was printed by this program).
 *
 * Not part of the build. Compile against an existing llama.cpp CPU build, e.g.
 *   L=/path/to/llama.cpp/build/bin
 *   cc -O2 -I/path/to/llama.cpp/ggml/include record_ggml_goldens.c -o record \
 *      -L$L -lggml-cpu -lggml-base -lm -Wl,-rpath,$L && ./record
 *
 * For each weight type and case it prints: the f32 bits of vec_dot, FNV-1a of the activation
 * bytes (from_float of the vec_dot_type), FNV-1a of the dequantised weights (to_float, NaNs
 * as 0x7fc00000) and FNV-1a of the activation values quantised to the weight type by
 * from_float_ref (0 where not recorded). The input generator (splitmix64) must stay identical to the Rust one.
 */
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include "ggml.h"
#include "ggml-cpu.h"

static uint64_t st;
static uint64_t u64(void) {
    st += 0x9e3779b97f4a7c15ULL;
    uint64_t z = st;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static uint64_t below(uint64_t n) { return u64() % n; }
static uint8_t byte(void) { return (uint8_t)u64(); }
static float unit(void) { return (float)(u64() >> 40) / (float)(1u << 23) - 1.0f; }
static float spread(void) { float u = unit(); int k = (int)below(17) - 8; return ldexpf(u, k); }
static uint16_t rand_f16(uint16_t lo, uint16_t hi) {
    uint16_t e = lo + (uint16_t)below(hi - lo + 1);
    uint16_t s = (uint16_t)(byte() & 1) << 15;
    return s | (uint16_t)(e << 10) | (uint16_t)(u64() & 0x3ff);
}
static void put16(uint8_t *p, uint16_t v) { p[0] = v & 0xff; p[1] = v >> 8; }

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}
static uint64_t fnv_f32(const float *x, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        uint32_t b; memcpy(&b, &x[i], 4);
        if (isnan(x[i])) b = 0x7fc00000;
        for (int k = 0; k < 4; k++) { h ^= (b >> (8 * k)) & 0xff; h *= 0x100000001b3ULL; }
    }
    return h;
}

/* offsets of the f16 scale fields in each weight block */
static int scale_fields(enum ggml_type t, int *off) {
    switch (t) {
    case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: off[0] = 0; return 1;
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: off[0] = 0; off[1] = 2; return 2;
    case GGML_TYPE_Q2_K: off[0] = 80; off[1] = 82; return 2;
    case GGML_TYPE_Q3_K: off[0] = 108; return 1;
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: off[0] = 0; off[1] = 2; return 2;
    case GGML_TYPE_Q6_K: off[0] = 208; return 1;
    default: return 0;
    }
}

int main(void) {
    ggml_cpu_init();
    enum ggml_type types[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
        GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_MXFP4};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        enum ggml_type t = types[ti];
        const struct ggml_type_traits *tr = ggml_get_type_traits(t);
        const struct ggml_type_traits_cpu *cpu = ggml_get_type_traits_cpu(t);
        enum ggml_type at = cpu->vec_dot_type;
        const struct ggml_type_traits *atr = ggml_get_type_traits(at);
        int bs = (int)tr->blck_size;
        int n = bs == 256 ? 1280 : 1440;
        int nb = n / bs;
        size_t wb = nb * tr->type_size, ab = nb * atr->type_size;
        uint8_t *w = malloc(wb), *a = malloc(ab), *q = malloc(wb);
        float *x = malloc(n * 4), *y = malloc(n * 4);
        for (int c = 0; c < 4; c++) {
            st = (uint64_t)t * 1000 + c;
            for (size_t i = 0; i < wb; i++) w[i] = byte();
            if (c < 3) {
                int off[2]; int nf = scale_fields(t, off);
                for (int b = 0; b < nb; b++) {
                    uint8_t *blk = w + b * tr->type_size;
                    for (int f = 0; f < nf; f++) put16(blk + off[f], rand_f16(8, 15));
                    if (t == GGML_TYPE_MXFP4) blk[0] = 118 + (uint8_t)below(16);
                }
            }
            tr->to_float(w, y, n);
            uint64_t hd = fnv_f32(y, n);
            uint64_t ha = 0, hq = 0; float dot = 0;
            if (c < 3) {
                for (int i = 0; i < n; i++) x[i] = spread();
                if (c == 1) {
                    for (int i = 0; i < n; i++) {
                        int ch = i / 32;
                        if (ch % 7 == 3 || i < 256) x[i] = 0;
                        if (ch % 11 == 5) x[i] *= 1e-30f;
                    }
                }
                memset(a, 0, ab);
                if (c < 2) {
                    ggml_get_type_traits_cpu(at)->from_float(x, a, n);
                } else {
                    for (size_t i = 0; i < ab; i++) a[i] = byte();
                    for (int b = 0; b < (int)(ab / atr->type_size); b++) {
                        uint8_t *blk = a + b * atr->type_size;
                        if (at == GGML_TYPE_Q8_K) { float d = spread() * 0.015625f; memcpy(blk, &d, 4); }
                        else { put16(blk, rand_f16(8, 15)); if (at == GGML_TYPE_Q8_1) put16(blk + 2, rand_f16(8, 15)); }
                    }
                }
                ha = fnv(a, ab);
                cpu->vec_dot(n, &dot, 0, w, 0, a, 0, 1);
                if (c < 2 && tr->from_float_ref) {
                    tr->from_float_ref(x, q, n);
                    hq = fnv(q, wb);
                }
            }
            uint32_t db; memcpy(&db, &dot, 4);
            char nm[16]; snprintf(nm, sizeof nm, "%s", ggml_type_name(t));
            for (char *p = nm; *p; p++) if (*p >= 'a' && *p <= 'z') *p -= 32;
            printf("    (%s, %d, 0x%08x, 0x%016llx, 0x%016llx, 0x%016llx),\n", nm, c, db,
                   (unsigned long long)ha, (unsigned long long)hd, (unsigned long long)hq);
        }
    }
    return 0;
}
