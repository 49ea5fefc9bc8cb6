// ---------------------------------------------------------------------------------------------
// Expert choice (the CPU device's gate_probs + Routing::select), one thread per token: gate
// probabilities (gating 0: ggml's softmax, whole 16-blocks with expf_ggml summed by halving
// and added in f64, the rest with libm's expf; 1: sigmoid 1 / (1 + expf(-x))); selection
// scores p + bias; with groups > 1, a group scores the f64 sum of its two best scores and only
// the `used` best groups stay eligible; the k best eligible experts (ties: lower id) with
// weights p[e], divided by their f64 sum (at least 2^-14) when norm, times scale unless it is
// 0 or 1. probs and scores: [n][n_expert] scratch. grid = ceil(n / 64), block = 64.

// The index of the largest of the first n values of v not yet taken (taken[i] != 0), ties to
// the lower index.
__device__ int route_best(const float* v, int n, const unsigned char* taken) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

#define ROUTE_MAX_EXPERTS 512
#define ROUTE_MAX_GROUPS 64

extern "C" __global__ void route_f32(const float* logits, const float* bias, int has_bias,
                                     int gating, int* sel, float* weights, float* probs,
                                     float* scores, int n, int n_expert, int k, int n_groups,
                                     int n_used, int norm, float wscale) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* row = logits + (u64)t * n_expert;
    float* p = probs + (u64)t * n_expert;
    float* s = scores + (u64)t * n_expert;
    if (gating == 0) {
        float mx = -f_inf();
        for (int e = 0; e < n_expert; e++) mx = fmaxf(mx, row[e]);
        double sum = 0.0;
        int blocks = n_expert / 16 * 16;
        for (int b = 0; b < blocks; b += 16) {
            for (int l = 0; l < 16; l++) p[b + l] = expf_ggml(row[b + l] - mx);
            sum += (double)reduce16_serial(p + b);
        }
        for (int e = blocks; e < n_expert; e++) {
            p[e] = expf_libm(row[e] - mx);
            sum += (double)p[e];
        }
        float inv = (float)(1.0 / sum);
        for (int e = 0; e < n_expert; e++) p[e] *= inv;
    } else {
        for (int e = 0; e < n_expert; e++) p[e] = 1.0f / (1.0f + expf_libm(-row[e]));
    }
    for (int e = 0; e < n_expert; e++) s[e] = has_bias ? p[e] + bias[e] : p[e];
    unsigned char taken[ROUTE_MAX_EXPERTS];
    if (n_groups > 1) {
        int per = n_expert / n_groups;
        float gs[ROUTE_MAX_GROUPS];
        for (int g = 0; g < n_groups; g++) {
            for (int i = 0; i < per; i++) taken[i] = 0;
            int two = per < 2 ? per : 2;
            double sum = 0.0;
            for (int j = 0; j < two; j++) {
                int b = route_best(s + g * per, per, taken);
                taken[b] = 1;
                sum += (double)s[g * per + b];
            }
            gs[g] = (float)sum;
        }
        unsigned char keep[ROUTE_MAX_GROUPS];
        for (int g = 0; g < n_groups; g++) keep[g] = 0;
        for (int j = 0; j < n_used; j++) keep[route_best(gs, n_groups, keep)] = 1;
        for (int g = 0; g < n_groups; g++) {
            if (!keep[g]) {
                for (int i = 0; i < per; i++) s[g * per + i] = -f_inf();
            }
        }
    }
    for (int e = 0; e < n_expert; e++) taken[e] = 0;
    int* st = sel + (u64)t * k;
    float* wt = weights + (u64)t * k;
    for (int j = 0; j < k; j++) {
        int b = route_best(s, n_expert, taken);
        taken[b] = 1;
        st[j] = b;
        wt[j] = p[b];
    }
    if (norm) {
        double sum = 0.0;
        for (int j = 0; j < k; j++) sum += (double)wt[j];
        float d = fmaxf((float)sum, 6.103515625e-5f);
        for (int j = 0; j < k; j++) wt[j] /= d;
    }
    if (wscale != 0.0f && wscale != 1.0f) {
        for (int j = 0; j < k; j++) wt[j] *= wscale;
    }
}
