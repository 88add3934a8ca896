/* Weight-only quantized matrix-vector products for decode steps (actorserve.engine.kernels.quant);
 * built as part of decode_step.c, which includes it.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T for a few rows M (decode: one row per sequence), with W held
 * in 32-weight groups along K, the layouts of GGUF's Q4_1 and Q8_0:
 *   q4: w = d * q + m, q in 0..15, two per byte: byte j of a group holds weight j (low nibble)
 *       and weight j + 16 (high nibble); d and m float16 per group.
 *   q8: w = d * q, q int8, d float16 per group.
 * Decode at a handful of rows reads every weight once per step, so it is bound by the bytes
 * read: 5 bits a weight (q4) or 8.5 (q8) instead of 16 (bf16) or 32 (fp32). Each weight group
 * is unpacked once and used for all M rows; float32 accumulation; the
 * output rows N spread over threads (the step pool below, or OpenMP). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXM 8
/* How many output rows ahead `run_rows` asks for the weights (`qgemv_prefetch`; 0: none). */
static int prefetch_rows = 4;
#define PREFETCH_MAXM 2

#ifdef __F16C__
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {                                      /* subnormal: normalise */
            exp = 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3ff;
            bits = sign | ((exp + 112) << 23) | (man << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* One output row n of q4 for M input rows, AVX-512: a group's 16 bytes widen to 16 int32,
 * whose low and high nibbles are weights 0..15 and 16..31, dequantized with one FMA each
 * (d * q + m: the offset is in the weight, so the per-group sums `xs` are not needed here).
 * M is a compile-time constant in the copies the switch below makes (1..8), so the
 * accumulators stay in registers. Each row keeps two accumulator chains (low and high
 * nibbles), four for M <= 4 (odd and even groups apart too): with one chain a sequence waited
 * on each FMA's latency. */
#define Q4_GROUP(G_, A0, A1) do {                                                          \
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qn + (G_) * 16)));   \
        __m512 dv = _mm512_set1_ps(half_to_float(dn[G_]));                                     \
        __m512 mv = _mm512_set1_ps(half_to_float(mn[G_]));                                     \
        __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, nib)), dv, mv);     \
        __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), dv, mv);      \
        for (int r = 0; r < M; r++) {                                                          \
            const float *xr = x + (size_t)r * K + (G_) * 32;                                   \
            A0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), A0[r]);                           \
            A1[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), A1[r]);                      \
        }                                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void q4_row(
        const float *restrict x, const int M, int K, const uint8_t *restrict qn,
        const uint16_t *restrict dn, const uint16_t *restrict mn, const float *restrict xs,
        float *restrict res) {
    (void)xs;
    const int G = K / 32;
    __m512 a0[MAXM], a1[MAXM], a2[MAXM], a3[MAXM];
    for (int r = 0; r < M; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi32(0xf);
    int g = 0;
    if (M <= 4)                     /* odd and even groups on their own chains too */
        for (; g + 2 <= G; g += 2) {
            Q4_GROUP(g, a0, a1);
            Q4_GROUP(g + 1, a2, a3);
        }
    for (; g < G; g++) Q4_GROUP(g, a0, a1);
    for (int r = 0; r < M; r++) {
        __m512 t = _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r]));
        res[r] = _mm512_reduce_add_ps(t);
    }
}

#if defined(__AVX512BF16__)
/* q4 with bfloat16 activations (the server's default dtype on CPUs with avx512_bf16): the
 * nibbles become bfloat16 numbers with one OR -- 0x4300 | q is exactly 128 + q -- and
 * vdpbf16ps multiplies 32 of them by the group's 32 activations at once, exactly (a product
 * of two bfloat16 numbers fits a float32), summing in float32. Per group and row that gives
 * sum((128 + q) x); the weight is d q + m, so the row's result is
 *   sum_g d_g sum((128 + q) x) + (m_g - 128 d_g) sum_g(x),
 * with the per-group activation sums `xs` (float32). About two thirds of the float path's
 * instructions per group (no int-to-float conversions, no dequantizing FMAs), and two groups
 * at a time with the activations in their order (`pair_order`): no shuffles of the weights. */
static inline __attribute__((always_inline)) void q4_row_bf16(
        const uint16_t *restrict x, const int M, int K, const uint8_t *restrict qn,
        const uint16_t *restrict dn, const uint16_t *restrict mn, const float *restrict xs,
        float *restrict res) {
    const int G = K / 32;
    __m512 a0[MAXM], a1[MAXM], off[MAXM];
    for (int r = 0; r < M; r++) a0[r] = a1[r] = off[r] = _mm512_setzero_ps();
    const __m256i nib16 = _mm256_set1_epi16(0xf);
    const __m512i nib = _mm512_set1_epi16(0xf), k128 = _mm512_set1_epi16(0x4300);
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int g0 = 0; g0 < G; g0 += 16) {            /* 16 groups' d and m at a time */
        const int ng = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 mask = (__mmask16)((1u << ng) - 1);
        const __m512 dvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dn + g0));
        const __m512 mvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + g0));
        const __m512 cvec = _mm512_fnmadd_ps(dvec, _mm512_set1_ps(128.0f), mvec);   /* m - 128 d */
        for (int r = 0; r < M; r++)
            off[r] = _mm512_fmadd_ps(cvec, _mm512_maskz_loadu_ps(mask, xs + (size_t)r * G + g0), off[r]);
        int j = 0;
        for (; j + 2 <= ng; j += 2) {           /* two groups: 32 bytes unpacked at once */
            const int g = g0 + j;
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qn + g * 16)));
            /* lanes 0-15 hold group g's weights 0..15 (lo) and 16..31 (hi), lanes 16-31 group
             * g + 1's; x comes in the same order (`pair_order`), so each 32-bit lane of the
             * dot products belongs to one group: 0-7 to g, 8-15 to g + 1, scaled by one vector */
            __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(b, nib, k128, 0xEA);   /* (b & 15) | k128 */
            __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), k128);
            __m512 dv = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(j), pair), dvec);
            for (int r = 0; r < M; r++) {
                const uint16_t *xr = x + (size_t)r * K + (size_t)g * 32;
                __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xr));
                t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(xr + 32));
                if (j & 2) a1[r] = _mm512_fmadd_ps(t, dv, a1[r]);
                else a0[r] = _mm512_fmadd_ps(t, dv, a0[r]);
            }
        }
        if (j < ng) {                           /* an odd last group */
            const int g = g0 + j;
            __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qn + g * 16)));
            __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, nib16)),
                                           _mm256_srli_epi16(b, 4), 1);
            __m512bh wb = (__m512bh)_mm512_or_si512(w, k128);
            __m512 dv = _mm512_permutexvar_ps(_mm512_set1_epi32(j), dvec);
            for (int r = 0; r < M; r++) {
                __m512bh xb = (__m512bh)_mm512_loadu_si512(x + (size_t)r * K + g * 32);
                a0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), wb, xb), dv, a0[r]);
            }
        }
    }
    for (int r = 0; r < M; r++)          /* every lane is summed: one reduction */
        res[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), off[r]));
}
#define HAVE_Q4_BF16 1
#endif

#define Q8_GROUP(G_, A0, A1) do {                                                          \
        __m512 dv = _mm512_set1_ps(half_to_float(dn[G_]));                                     \
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                     \
            _mm_loadu_si128((const __m128i *)(qn + (G_) * 32)))), dv);                         \
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                     \
            _mm_loadu_si128((const __m128i *)(qn + (G_) * 32 + 16)))), dv);                    \
        for (int r = 0; r < M; r++) {                                                          \
            const float *xr = x + (size_t)r * K + (G_) * 32;                                   \
            A0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), A0[r]);                           \
            A1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), A1[r]);                      \
        }                                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void q8_row(
        const float *restrict x, const int M, int K, const int8_t *restrict qn,
        const uint16_t *restrict dn, float *restrict res) {
    const int G = K / 32;
    __m512 a0[MAXM], a1[MAXM], a2[MAXM], a3[MAXM];
    for (int r = 0; r < M; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
    int g = 0;
    if (M <= 4)
        for (; g + 2 <= G; g += 2) {
            Q8_GROUP(g, a0, a1);
            Q8_GROUP(g + 1, a2, a3);
        }
    for (; g < G; g++) Q8_GROUP(g, a0, a1);
    for (int r = 0; r < M; r++) {
        __m512 t = _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r]));
        res[r] = _mm512_reduce_add_ps(t);
    }
}
#else
/* One output row n of q4 for M input rows; M is a compile-time constant in the copies the
 * switch below makes (1..8), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void q4_row(
        const float *restrict x, const int M, int K, const uint8_t *restrict qn,
        const uint16_t *restrict dn, const uint16_t *restrict mn, const float *restrict xs,
        float *restrict res) {
    int G = K / 32;
    float acc[MAXM][16] __attribute__((aligned(64))), macc[MAXM];
    for (int r = 0; r < M; r++) {
        macc[r] = 0.f;
        for (int e = 0; e < 16; e++) acc[r][e] = 0.f;
    }
    for (int g = 0; g < G; g++) {
        const uint8_t *qb = qn + g * 16;
        float dg = half_to_float(dn[g]), mg = half_to_float(mn[g]);
        float lo[16] __attribute__((aligned(64))), hi[16] __attribute__((aligned(64)));
        #pragma omp simd
        for (int e = 0; e < 16; e++) {
            lo[e] = (float)(qb[e] & 0xf) * dg;
            hi[e] = (float)(qb[e] >> 4) * dg;
        }
        for (int r = 0; r < M; r++) {
            const float *xr = x + (size_t)r * K + g * 32;
            #pragma omp simd
            for (int e = 0; e < 16; e++) acc[r][e] += lo[e] * xr[e] + hi[e] * xr[e + 16];
            macc[r] += mg * xs[(size_t)r * G + g];
        }
    }
    for (int r = 0; r < M; r++) {
        float s = macc[r];
        for (int e = 0; e < 16; e++) s += acc[r][e];
        res[r] = s;
    }
}

static inline __attribute__((always_inline)) void q8_row(
        const float *restrict x, const int M, int K, const int8_t *restrict qn,
        const uint16_t *restrict dn, float *restrict res) {
    int G = K / 32;
    float acc[MAXM][32] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++)
        for (int e = 0; e < 32; e++) acc[r][e] = 0.f;
    for (int g = 0; g < G; g++) {
        const int8_t *qb = qn + g * 32;
        float dg = half_to_float(dn[g]), w[32] __attribute__((aligned(64)));
        #pragma omp simd
        for (int e = 0; e < 32; e++) w[e] = (float)qb[e] * dg;
        for (int r = 0; r < M; r++) {
            const float *xr = x + (size_t)r * K + g * 32;
            #pragma omp simd
            for (int e = 0; e < 32; e++) acc[r][e] += w[e] * xr[e];
        }
    }
    for (int r = 0; r < M; r++) {
        float s = 0.f;
        for (int e = 0; e < 32; e++) s += acc[r][e];
        res[r] = s;
    }
}

#endif

#include "act8.c"     /* q4 and q8 with 8-bit activations */

#define CASES(CALL) switch (M) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; \
    default: CALL(8); }

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {      /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000) == 0x7f800000) return (uint16_t)(bits >> 16) | ((bits & 0xffff) ? 0x40 : 0);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#include "q4n16.c"    /* q4 with 8-bit activations, 16 output rows a register */
#include "q4b16.c"    /* q4 with bfloat16 activations, 16 output rows a register */
#include "q8b16.c"    /* q8 likewise (an LM head kept as Q8_0) */

/* One product's output rows [n0, n1), the unit a thread takes. */
typedef struct {
    int kind, M, K, N, G, y_bf16, n0, n1;
    const float *xf, *xs, *bias;
    const uint16_t *xb;             /* the bfloat16 input as given, or NULL */
    const int8_t *xq;               /* act8: the int8 activations (act8.c), or NULL */
    const float *xd, *xdv;          /* act8: their scales */
    const int32_t *xinit;           /* q8a8: the lanes' starting sums */
    int n16;                        /* q4n16.c's layout: n0, n1 count blocks of 16 rows */
    int b16;                        /* q4b16.c's (kind 4) or q8b16.c's (kind 8) layout (xb the
                                     * bfloat16 input): the same */
    const void *q;
    const uint16_t *d, *m;
    void *y;
    /* another kernel's work split the same way (lora.c): its units [n0, n1) of `ext` */
    void (*ext_fn)(const void *ext, int n0, int n1);
    const void *ext;
} job_t;

static void run_rows(const job_t *j) {
    if (j->ext_fn) {
        j->ext_fn(j->ext, j->n0, j->n1);
        return;
    }
    const int M = j->M, K = j->K, N = j->N, G = j->G;
    const float *xf = j->xf, *xs = j->xs;
    const uint16_t *d = j->d, *m = j->m;
#ifdef HAVE_Q4B16
    if (j->b16 && j->kind == 8) {
        for (int nb = j->n0; nb < j->n1; nb++)
            q8b16_block(j->xb, M, K, (const uint8_t *)j->q + (size_t)nb * G * Q8B16_SB, j->bias, j->y,
                        j->y_bf16, N, nb * 16);
        return;
    }
    if (j->b16) {
        for (int nb = j->n0; nb < j->n1; nb++)
            q4b16_block(j->xb, xs, M, K, (const uint8_t *)j->q + (size_t)nb * G * B16_SB,
                        j->bias, j->y, j->y_bf16, N, nb * 16);
        return;
    }
#endif
    if (j->n16) {
        for (int nb = j->n0; nb < j->n1; nb++)
            q4n16_block(j->xq, j->xd, xs, M, K, (const uint8_t *)j->q + (size_t)nb * G * N16_SB,
                        j->bias, j->y, j->y_bf16, N, nb * 16);
        return;
    }
    if (M > MAXM && !j->xq) {          /* a wide step: MAXM rows at a time, one output row */
        job_t part = *j;                /* after another, so its weights are read from memory once */
        for (int n = j->n0; n < j->n1; n++) {
            part.n0 = n, part.n1 = n + 1;
            const int step = MAXM;
            for (int r0 = 0; r0 < M; r0 += step) {
                part.M = M - r0 < step ? M - r0 : step;
                part.xf = xf + (size_t)r0 * K;
                part.xs = xs + (size_t)r0 * G;
                part.xb = j->xb ? j->xb + (size_t)r0 * K : NULL;
                part.y = j->y_bf16 ? (void *)((uint16_t *)j->y + (size_t)r0 * N)
                                   : (void *)((float *)j->y + (size_t)r0 * N);
                run_rows(&part);
            }
        }
        return;
    }
    const size_t row_bytes = j->kind == 4 ? (size_t)K / 2 : (size_t)K;
    /* one or two rows read the weights faster than the hardware prefetchers bring them (the
     * rows of a chunk follow each other, but each is only K/2 bytes in three streams); from
     * four rows on the products are the bound and prefetching measured no better */
    const int ahead = M <= PREFETCH_MAXM ? prefetch_rows : 0;
    for (int n = j->n0; n < j->n1; n++) {
        float res[MAXM];
        if (ahead && n + ahead < j->n1) {        /* the weights `ahead` rows on, from memory */
            const char *p = (const char *)j->q + (size_t)(n + ahead) * row_bytes;
            for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, 0);
            __builtin_prefetch(d + (size_t)(n + ahead) * G, 0, 0);
            if (m) __builtin_prefetch(m + (size_t)(n + ahead) * G, 0, 0);
        }
        if (j->kind == 4 && j->xq) {
#define Q4A8(M_) q4a8_row(j->xq, j->xd, j->xdv, xs, M_, K, (const uint8_t *)j->q + (size_t)n * K / 2, d + (size_t)n * G, m + (size_t)n * G, res)
            CASES(Q4A8)
        } else if (j->xq) {
#define Q8A8(M_) q8a8_row(j->xq, j->xd, j->xdv, j->xinit, M_, K, (const uint8_t *)j->q + (size_t)n * K, d + (size_t)n * G, res)
            CASES(Q8A8)
        } else if (j->kind == 4 && j->xb) {
#ifdef HAVE_Q4_BF16
#define Q4B(M_) q4_row_bf16(j->xb, M_, K, (const uint8_t *)j->q + (size_t)n * K / 2, d + (size_t)n * G, m + (size_t)n * G, xs, res)
            CASES(Q4B)
#endif
        } else if (j->kind == 4) {
#define Q4(M_) q4_row(xf, M_, K, (const uint8_t *)j->q + (size_t)n * K / 2, d + (size_t)n * G, m + (size_t)n * G, xs, res)
            CASES(Q4)
        } else {
#define Q8(M_) q8_row(xf, M_, K, (const int8_t *)j->q + (size_t)n * K, d + (size_t)n * G, res)
            CASES(Q8)
        }
        float b = j->bias ? j->bias[n] : 0.f;
        for (int r = 0; r < M; r++) {
            size_t at = (size_t)r * N + n;
            if (j->y_bf16) ((uint16_t *)j->y)[at] = float_to_bf16(res[r] + b);
            else ((float *)j->y)[at] = res[r] + b;
        }
    }
}

#include "step_pool.c"   /* the step pool: uses job_t and run_rows above */

/* Run `job`'s units [0, job->n1) on the step pool's threads while it is active (and `pool_ok`),
 * else on `nthreads` OpenMP threads, else on this one. */
static void spread(job_t *job, int pool_ok, int nthreads) {
    const int units = job->n1;
    int pooled = 0;
    if (pool_ok && atomic_load_explicit(&pool.active, memory_order_relaxed)
            && !atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) {
        pooled = atomic_load(&pool.active);     /* still: stopping takes `busy` first */
        if (!pooled) atomic_flag_clear_explicit(&pool.busy, memory_order_release);
    }
    if (pooled) {
        pool_product(job);
        atomic_flag_clear_explicit(&pool.busy, memory_order_release);
    } else if (nthreads > 1) {
        const int chunk = (units + nthreads - 1) / nthreads;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int t = 0; t < nthreads; t++) {
            job_t mine = *job;
            mine.n0 = t * chunk;
            mine.n1 = mine.n0 + chunk < units ? mine.n0 + chunk : units;
            if (mine.n0 < mine.n1) run_rows(&mine);
        }
    } else {
        run_rows(job);
    }
}

#ifdef HAVE_Q4_BF16
static int bf16_path = 1;
#else
static const int bf16_path = 0;
#endif

/* Whether the 8-bit-activation kernels are the vectorised ones (avx512_vnni), not the
 * portable C loops. */
int qgemv_act8_simd(void) {
#ifdef HAVE_Q4N16_SIMD
    return 1;
#else
    return 0;
#endif
}

/* How many output rows ahead a product prefetches its weights: rows >= 0 sets it, -1 asks. */
int qgemv_prefetch(int rows) {
    if (rows >= 0) prefetch_rows = rows;
    return prefetch_rows;
}

/* How many bytes ahead a product of at most B16_PREFETCH_MAXM rows asks for its superblocks:
 * bytes >= 0 sets it, -1 asks; -1 where the superblocks are not built. */
int qgemv_b16_prefetch(int bytes) {
#ifdef HAVE_Q4B16
    if (bytes >= 0) b16_prefetch = bytes;
    return b16_prefetch;
#else
    (void)bytes;
    return -1;
#endif
}

/* Whether q4b16.c's kernel is built here (avx512_bf16): 1 or 0. */
int qgemv_b16(void) {
#ifdef HAVE_Q4B16
    return 1;
#else
    return 0;
#endif
}

/* Whether q4 products of bfloat16 activations take the vdpbf16ps path: on = 0 or 1 sets it
 * (where the CPU has it), -1 only asks. Returns the setting, or -1 where the path is not built. */
int qgemv_bf16_path(int on) {
#ifdef HAVE_Q4_BF16
    if (on >= 0) bf16_path = on ? 1 : 0;
    return bf16_path;
#else
    (void)on;
    return -1;
#endif
}

/* The bf16 path's activations, each pair of groups (64 values) in the order of a pair of q4
 * groups unpacked at once: group g's first 16, group g + 1's first 16, g's last 16, g + 1's
 * last 16 (the low nibbles of both groups' bytes, then the high ones). An odd last group
 * stays as it is. */
static void pair_order(const uint16_t *x, int M, int K, uint16_t *out) {
    const int G = K / 32;
    for (int r = 0; r < M; r++) {
        const uint16_t *xr = x + (size_t)r * K;
        uint16_t *o = out + (size_t)r * K;
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            const uint16_t *p = xr + (size_t)g * 32;
            uint16_t *q = o + (size_t)g * 32;
            memcpy(q, p, 32);
            memcpy(q + 16, p + 32, 32);
            memcpy(q + 32, p + 16, 32);
            memcpy(q + 48, p + 48, 32);
        }
        if (g < G) memcpy(o + (size_t)g * 32, xr + (size_t)g * 32, 64);
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias): `kind` 4 (q4: q packed nibbles, d and m) or 8 (q8: q int8,
 * d; m unused), either with the flag QG_ACT8 (16) multiplying 8-bit activations (act8.c;
 * for q8 the weights are then stored offset, q + 128 as uint8), q4 with QG_ACT8 | QG_N16 (48)
 * in q4n16.c's superblocks, or q4 with QG_B16 (68) in q4b16.c's, q8 with QG_B16 (72) in
 * q8b16.c's (bfloat16 x only, where the CPU has avx512_bf16: `qgemv_b16`); x and y float32 or bfloat16 (the flags), bias float32 or
 * NULL.
 * x is widened once to float32 (with the per-group sums) before the rows are spread over the
 * threads: the step pool's while it is active, else `nthreads` OpenMP threads.
 * Returns 0, or -1 for a shape it does not take (M outside 1..WIDE_MAXM; 1..8 for act8 rows,
 * 1..N16_MAXM for the
 * superblocks; K not a multiple of 32; N not a multiple of 16 for the superblocks; QG_B16 without
 * bfloat16 x or where it is not built) or no memory. */
#define QG_ACT8 16
#define QG_N16 32       /* with QG_ACT8: q4 in q4n16.c's layout (q: the superblocks; d, m unused) */
#define QG_B16 64       /* q4 (q8) in q4b16.c's (q8b16.c's) layout (q: the superblocks; d, m unused) */
#define N16_MAXM 65536
#define WIDE_MAXM 65536   /* q4 and q8 of float activations: any width, MAXM rows a pass */

int qgemv(int kind, const void *x, int x_bf16, int M, int K, const void *q, const uint16_t *d,
          const uint16_t *m, int N, const float *bias, void *y, int y_bf16, int nthreads) {
    const int act8 = (kind & QG_ACT8) != 0, n16 = kind == (4 | QG_ACT8 | QG_N16),
              b16 = kind == (4 | QG_B16) || kind == (8 | QG_B16);
    kind &= ~(QG_ACT8 | QG_N16 | QG_B16);
    if (M < 1 || M > (n16 || b16 ? N16_MAXM : act8 ? MAXM : WIDE_MAXM) || K % 32 || (kind != 4 && kind != 8)
            || ((n16 || b16) && N % 16) || (b16 && (!x_bf16 || !qgemv_b16())))
        return -1;
    int G = K / 32;
#ifdef HAVE_Q4B16
    if (b16) {          /* the superblocks read x as it is: only q4's group sums are needed */
        float *xs = kind == 4 ? malloc(sizeof(float) * (size_t)M * G) : NULL;   /* q8: no m, no sums */
        if (kind == 4 && !xs) return -1;
        if (xs) q4b16_sums((const uint16_t *)x, (size_t)M * G, xs);
        job_t job = {.kind = kind, .M = M, .K = K, .N = N, .G = G, .y_bf16 = y_bf16, .n0 = 0,
                     .n1 = N / 16, .xs = xs, .bias = bias, .xb = (const uint16_t *)x, .b16 = 1,
                     .q = q, .d = d, .m = m, .y = y};
        spread(&job, N >= 64, nthreads);
        free(xs);
        return 0;
    }
#endif
    /* xf [M, K] and xs [M, G] float32; with act8 also xd [M, G], xdv [M, G/2, 16], xinit
     * [M, G/2, 16] (int32), xq [M, K] */
    const size_t nf = (size_t)M * K + (size_t)M * G + (act8 ? (size_t)M * G + (n16 ? 0 : (size_t)M * (G / 2) * 32) : 0);
    float *xf = malloc(sizeof(float) * nf + (act8 ? (size_t)M * K : 0));
    if (!xf) return -1;
    float *xs = xf + (size_t)M * K;
    for (size_t i = 0; i < (size_t)M * K; i++)
        xf[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    for (size_t i = 0; i < (size_t)M * G; i++) {
        float sum = 0.f;
        for (int e = 0; e < 32; e++) sum += xf[i * 32 + e];
        xs[i] = sum;
    }
    const uint16_t *xb = x_bf16 && kind == 4 && bf16_path ? (const uint16_t *)x : NULL;
    uint16_t *xpair = NULL;
    if (xb) {                   /* the order q4_row_bf16 reads: `pair_order` */
        if (!(xpair = malloc(sizeof(uint16_t) * (size_t)M * K))) { free(xf); return -1; }
        pair_order(xb, M, K, xpair);
        xb = xpair;
    }
    int8_t *xq = NULL;
    float *xd = NULL, *xdv = NULL;
    int32_t *xinit = NULL;
    if (act8) {
        xd = xs + (size_t)M * G;
        xdv = xd + (size_t)M * G;
        xinit = (int32_t *)(xdv + (size_t)M * (G / 2) * 16);
        xq = (int8_t *)(xf + nf);
        if (n16) xdv = NULL, xinit = NULL;      /* in order, and no pair-spread scales */
        quantize_act8(xf, M, K, n16 ? 8 : kind, xq, xd, xdv, xinit);
        xb = NULL;
    }
    job_t job = {.kind = kind, .M = M, .K = K, .N = N, .G = G, .y_bf16 = y_bf16, .n0 = 0,
                 .n1 = n16 ? N / 16 : N, .xf = xf, .xs = xs, .bias = bias, .xb = xb, .xq = xq,
                 .xd = xd, .xdv = xdv, .xinit = xinit, .n16 = n16, .q = q, .d = d, .m = m, .y = y};
    spread(&job, N >= 64, nthreads);
    free(xf);
    free(xpair);
    return 0;
}
