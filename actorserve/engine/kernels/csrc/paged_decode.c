/* Decode attention that reads the paged K/V cache in place (actorserve.engine.kernels.decode_kernel).
 *
 * One query token per sequence. For sequence i and KV head h, the `g` query heads that share
 * h attend over the ctx[i] tokens the block table row i names: token p lives in slot
 * table[i * nb + p / bs] * bs + p % bs of the per-layer K and V tensors
 * [slots, nkv, d] (float32 or bfloat16, row-major). No gather: each K and V row is read
 * once, straight from the cache, converted to float32, and used by all g query heads.
 * Two passes per (i, h): scores (optionally soft-capped: tanh(s / c) * c) and a float32
 * softmax, then the weighted sum of V. Work units (i, h) are spread over OpenMP threads
 * (dynamic: contexts differ in length). Output: float32 [D, nkv, g, d].
 *
 * Speed notes (2-core EPYC, measured against torch's gather + SDPA in
 * benchmarks/decode_attention.py): the exponential is a polynomial the compiler vectorizes
 * (libm's expf is scalar and was most of the time), blocks are walked as blocks (no division
 * per token), and bf16 rows widen to float32 with a shift. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max), relative error ~2e-7:
 * x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n through the exponent. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundf(x * 1.44269504089f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline void load_row(const void *base, size_t at, int bf16, int d, float *restrict dst) {
    if (bf16) {
        const uint16_t *restrict src = (const uint16_t *)base + at;
        uint32_t *restrict out = (uint32_t *)dst;
        #pragma omp simd
        for (int e = 0; e < d; e++) out[e] = (uint32_t)src[e] << 16;
    } else {
        memcpy(dst, (const float *)base + at, (size_t)d * 4);
    }
}

/* One work unit: KV heads [h0, h1) of one sequence. Its tokens are walked block by block,
 * each token's K (then V) rows of those heads read once; the blocks of all heads are
 * contiguous in the cache ([slot, nkv, d]), so a unit of every head streams whole blocks.
 * `d` is a compile-time constant in the specialised copies below (64, 128), so the loops
 * unroll and the query rows stay in registers. Scores: s[(h - h0) * g + r][p]. */
static inline __attribute__((always_inline)) void unit(
        const float *restrict qi, const void *K, const void *V, int bf16, const int32_t *tab,
        int L, int nkv, int h0, int h1, int g, const int d, int bs, float scale, float softcap,
        float *restrict s, size_t stride, float *restrict row, float *restrict oi) {
    int nblk = (L + bs - 1) / bs, esz = bf16 ? 2 : 4;
    for (int j = 0; j < nblk; j++) {
        size_t slot0 = (size_t)tab[j] * bs;
        if (j + 1 < nblk) {
            const char *next = (const char *)K + (size_t)tab[j + 1] * bs * nkv * d * esz;
            for (int c = 0; c < bs * nkv * d * esz; c += 256) __builtin_prefetch(next + c);
        }
        int tn = L - j * bs < bs ? L - j * bs : bs;
        for (int t = 0; t < tn; t++) {
            int p = j * bs + t;
            for (int h = h0; h < h1; h++) {
                load_row(K, ((slot0 + t) * nkv + h) * d, bf16, d, row);
                for (int r = 0; r < g; r++) {
                    const float *qr = qi + ((size_t)h * g + r) * d;
                    float acc = 0.f;
                    #pragma omp simd reduction(+:acc)
                    for (int e = 0; e < d; e++) acc += qr[e] * row[e];
                    s[((size_t)(h - h0) * g + r) * stride + p] = acc * scale;
                }
            }
        }
    }
    for (int r = 0; r < (h1 - h0) * g; r++) {
        float *sr = s + (size_t)r * stride, m = -INFINITY, sum = 0.f;
        if (softcap > 0.f)
            for (int p = 0; p < L; p++) sr[p] = tanhf(sr[p] / softcap) * softcap;
        for (int p = 0; p < L; p++) m = sr[p] > m ? sr[p] : m;
        #pragma omp simd reduction(+:sum)
        for (int p = 0; p < L; p++) { sr[p] = exp_neg(sr[p] - m); sum += sr[p]; }
        float inv = 1.f / sum;
        #pragma omp simd
        for (int p = 0; p < L; p++) sr[p] *= inv;
    }
    memset(oi + (size_t)h0 * g * d, 0, sizeof(float) * (size_t)(h1 - h0) * g * d);
    for (int j = 0; j < nblk; j++) {
        size_t slot0 = (size_t)tab[j] * bs;
        if (j + 1 < nblk) {
            const char *next = (const char *)V + (size_t)tab[j + 1] * bs * nkv * d * esz;
            for (int c = 0; c < bs * nkv * d * esz; c += 256) __builtin_prefetch(next + c);
        }
        int tn = L - j * bs < bs ? L - j * bs : bs;
        for (int t = 0; t < tn; t++) {
            int p = j * bs + t;
            for (int h = h0; h < h1; h++) {
                load_row(V, ((slot0 + t) * nkv + h) * d, bf16, d, row);
                for (int r = 0; r < g; r++) {
                    float w = s[((size_t)(h - h0) * g + r) * stride + p];
                    float *orow = oi + ((size_t)h * g + r) * d;
                    #pragma omp simd
                    for (int e = 0; e < d; e++) orow[e] += w * row[e];
                }
            }
        }
    }
}

#define UNIT(D_) unit(qi, K, V, bf16, tab, L, nkv, h0, h1, g, D_, bs, scale, softcap, s, stride, row, oi)

int paged_decode(const float *q, const void *K, const void *V, int bf16,
                 const int32_t *table, int nb, const int32_t *ctx,
                 int D, int nkv, int g, int d, int bs, float scale, float softcap,
                 float *out, int nthreads) {
    int max_ctx = 0;
    size_t total = 0;
    for (int i = 0; i < D; i++) {
        if (ctx[i] > max_ctx) max_ctx = ctx[i];
        total += (size_t)ctx[i];
    }
    /* a small step on one thread: waking the others costs more than they would save */
    if (total * (size_t)nkv * (size_t)d < ((size_t)1 << 18)) nthreads = 1;
    size_t stride = ((size_t)max_ctx + 15) & ~(size_t)15;
    /* few sequences: one unit per head, so every thread has work; else whole sequences */
    int split = D < 4 * nthreads ? nkv : 1, per = nkv / split;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = aligned_alloc(64, sizeof(float) * ((size_t)per * g * stride + (size_t)d + 16));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < D * split; u++) {
            if (!s) continue;
            int i = u / split, h0 = (u % split) * per, h1 = h0 + per, L = ctx[i];
            const int32_t *tab = table + (size_t)i * nb;
            const float *qi = q + (size_t)i * nkv * g * d;
            float *row = s + (size_t)per * g * stride, *oi = out + (size_t)i * nkv * g * d;
            if (d == 64) UNIT(64);
            else if (d == 128) UNIT(128);
            else UNIT(d);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
