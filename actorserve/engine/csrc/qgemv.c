/* Weight-only quantized matrix-vector products for decode steps (actorserve.engine.quant).
 *
 * y[M, N] = x[M, K] @ W[N, K]^T for a few rows M (decode: one row per sequence), with W held
 * in 32-weight groups along K, the layouts of GGUF's Q4_1 and Q8_0:
 *   q4: w = d * q + m, q in 0..15, two per byte: byte j of a group holds weight j (low nibble)
 *       and weight j + 16 (high nibble); d and m float16 per group.
 *   q8: w = d * q, q int8, d float16 per group.
 * Decode at a handful of rows reads every weight once per step, so it is bound by the bytes
 * read: 5 bits a weight (q4) or 8.5 (q8) instead of 16 (bf16) or 32 (fp32). Each weight group
 * is unpacked once and used for all M rows; float32 accumulation; OpenMP over N. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXM 8

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

/* y[M, N] = x[M, K] @ W^T (+ bias): `kind` 4 (q4: q packed nibbles, d and m) or 8 (q8: q int8,
 * d; m unused); x and y float32 or bfloat16 (the flags), bias float32 or NULL. x is widened
 * once to float32 (with q4's per-group sums) before the rows are spread over the threads.
 * Returns 0, or -1 for a shape it does not take (M outside 1..8, K not a multiple of 32) or
 * no memory. */
int qgemv(int kind, const void *x, int x_bf16, int M, int K, const void *q, const uint16_t *d,
          const uint16_t *m, int N, const float *bias, void *y, int y_bf16, int nthreads) {
    if (M < 1 || M > MAXM || K % 32 || (kind != 4 && kind != 8)) return -1;
    int G = K / 32;
    float *xf = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * G));
    if (!xf) return -1;
    float *xs = xf + (size_t)M * K;
    for (size_t i = 0; i < (size_t)M * K; i++)
        xf[i] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    for (size_t i = 0; i < (size_t)M * G; i++) {
        float sum = 0.f;
        for (int e = 0; e < 32; e++) sum += xf[i * 32 + e];
        xs[i] = sum;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = 0; n < N; n++) {
        float res[MAXM];
        if (kind == 4) {
#define Q4(M_) q4_row(xf, M_, K, (const uint8_t *)q + (size_t)n * K / 2, d + (size_t)n * G, m + (size_t)n * G, xs, res)
            CASES(Q4)
        } else {
#define Q8(M_) q8_row(xf, M_, K, (const int8_t *)q + (size_t)n * K, d + (size_t)n * G, res)
            CASES(Q8)
        }
        float b = bias ? bias[n] : 0.f;
        for (int r = 0; r < M; r++) {
            size_t at = (size_t)r * N + n;
            if (y_bf16) ((uint16_t *)y)[at] = float_to_bf16(res[r] + b);
            else ((float *)y)[at] = res[r] + b;
        }
    }
    free(xf);
    return 0;
}
