/* Products of 8-bit activations (``--quantization q4a8``: q4 layers, q8 LM head), included by
 * qgemv.c.
 *
 * The activations of each row are quantized per 32-element group, as the weights are, to
 * int8 with one float32 scale: x ~ dx * qx, dx = max|x| / 127, qx = round(x / dx) (llama.cpp's
 * Q8_1, which its CPU backend multiplies Q4_1 weights with). A group's dot product is then an
 * integer one, exact in int32:
 *   sum_e (d q_e + m) x_e ~ d dx sum_e q_e qx_e + m sum_e x_e
 * where the second sum is the float32 sum of the activations as they were (`xs`), so only the
 * first term sees the activations' rounding. With avx512_vnni one vpdpbusd multiplies 64
 * nibbles by 64 int8 activations -- two groups -- where the bfloat16 path needs two
 * vdpbf16ps and the float path eight FMAs plus the dequantizing; the nibbles need no
 * conversion at all, only a shift and a mask.
 *
 * Layout. The packed nibbles of two neighbouring groups g, g+1 (32 bytes) broadcast to both
 * halves of a 512-bit register and shifted by 0 (low half) or 4 (high half), then masked, give
 * [g w0..15 | g+1 w0..15 | g w16..31 | g+1 w16..31]. The quantizer writes each row's int8
 * activations in that same order, pair by pair (a last odd group alone: [w0..15 | w16..31]),
 * so no weight is ever shuffled; `xdv` holds each pair's scales spread the same way
 * (lanes of 4 int32 sums: g, g+1, g, g+1). */

/* Quantize M rows of K float32 activations: `xq` [M, K] int8 in the pair layout above, `xd`
 * [M, G] the scales, `xdv` [M, G/2, 16] the pair-spread scales (AVX-512 path); `xs` [M, G]
 * (the exact group sums) is filled by the caller. Round to nearest even (the default
 * rounding mode, in both paths). */
#include <math.h>

/* Quantize M rows of K float32 activations for a product of kind 4 or 8: `xq` [M, K] int8 (q4:
 * in the pair layout above; q8: in order), `xd` [M, G] the scales, `xdv` [M, G/2, 16] the
 * pair-spread scales (q4: lanes of 4 for g, g+1, g, g+1; q8: lanes of 8 for g, g+1) and, for
 * q8, `xinit` [M, G/2, 16] int32: -128 times each lane's four activations (q8a8 below); with
 * `xdv` NULL neither (q4n16.c reads `xq` and `xd` alone). `xs`
 * [M, G] (the exact group sums) is filled by the caller. Round to nearest even (the default
 * rounding mode, in both paths). */
static void quantize_act8(const float *restrict xf, int M, int K, int kind, int8_t *restrict xq,
                          float *restrict xd, float *restrict xdv, int32_t *restrict xinit) {
    const int G = K / 32, P = G / 2;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const float *v = xf + (size_t)r * K + (size_t)g * 32;
            const int paired = g < 2 * P;
            const size_t base = (size_t)r * K + (size_t)(g & ~1) * 32;
            int8_t *lo = kind == 8 ? xq + (size_t)r * K + (size_t)g * 32 : xq + base + (paired ? (g & 1) * 16 : 0);
            int8_t *hi = kind == 8 ? lo + 16 : xq + base + (paired ? 32 + (g & 1) * 16 : 16);
#if defined(__AVX512F__)
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            __m512 s = _mm512_set1_ps(id);
            _mm_storeu_si128((__m128i *)lo, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, s))));
            _mm_storeu_si128((__m128i *)hi, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, s))));
#else
            float amax = 0.f;
            for (int e = 0; e < 32; e++) amax = fabsf(v[e]) > amax ? fabsf(v[e]) : amax;
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            for (int e = 0; e < 16; e++) {
                lo[e] = (int8_t)nearbyintf(v[e] * id);
                hi[e] = (int8_t)nearbyintf(v[e + 16] * id);
            }
#endif
            const float dx = amax / 127.f;
            xd[(size_t)r * G + g] = dx;
            if (!paired || !xdv) continue;
            const size_t at = ((size_t)r * P + g / 2) * 16;
            if (kind == 8) {
                for (int e = 0; e < 8; e++) {
                    xdv[at + (g & 1) * 8 + e] = dx;
                    const int8_t *x4 = lo + 4 * e;
                    xinit[at + (g & 1) * 8 + e] = -128 * ((int32_t)x4[0] + x4[1] + x4[2] + x4[3]);
                }
            } else {
                for (int e = 0; e < 4; e++) xdv[at + (g & 1) * 4 + e] = xdv[at + 8 + (g & 1) * 4 + e] = dx;
            }
        }
    }
}

/* sum(q qx) of one group of q8 weights kept offset (u = q + 128) and int8 activations. Kept
 * out of the vectorizer: GCC 12 -O2/-O3 vectorized the inline loop into wrong sums. */
static __attribute__((noinline, optimize("no-tree-vectorize"))) int32_t q8a8_group(
        const uint8_t *u, const int8_t *x) {
    int32_t s = 0;
    for (int e = 0; e < 32; e++) s += ((int32_t)u[e] - 128) * x[e];
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Two groups (a pair at g) for M rows into the accumulators A. */
#define Q4A8_PAIR(G_, J_, A) do {                                                           \
        __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qn + (G_) * 16)));  \
        __m512i w = _mm512_and_si512(_mm512_srlv_epi64(b, shifts), nib);                          \
        __m512 dwv = _mm512_permutexvar_ps(_mm512_add_epi32(pat, _mm512_set1_epi32(J_)), dvec);   \
        for (int r = 0; r < M; r++) {                                                             \
            __m512i xv = _mm512_loadu_si512(xq + (size_t)r * K + (size_t)(G_) * 32);              \
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);                       \
            __m512 sc = _mm512_mul_ps(dwv, _mm512_loadu_ps(xdv + ((size_t)r * P + (G_) / 2) * 16)); \
            A[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, A[r]);                              \
        }                                                                                         \
    } while (0)

static inline __attribute__((always_inline)) void q4a8_row(
        const int8_t *restrict xq, const float *restrict xd, const float *restrict xdv,
        const float *restrict xs, const int M, int K, const uint8_t *restrict qn,
        const uint16_t *restrict dn, const uint16_t *restrict mn, float *restrict res) {
    const int G = K / 32, P = G / 2;
    __m512 a0[MAXM], a1[MAXM], off[MAXM];
    float tail[MAXM];
    for (int r = 0; r < M; r++) { a0[r] = a1[r] = off[r] = _mm512_setzero_ps(); tail[r] = 0.f; }
    const __m512i nib = _mm512_set1_epi8(0x0f), shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i pat = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int g0 = 0; g0 < G; g0 += 16) {            /* 16 groups' d and m at a time */
        const int ng = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 mask = (__mmask16)((1u << ng) - 1);
        const __m512 dvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dn + g0));
        const __m512 mvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + g0));
        for (int r = 0; r < M; r++)
            off[r] = _mm512_fmadd_ps(mvec, _mm512_maskz_loadu_ps(mask, xs + (size_t)r * G + g0), off[r]);
        int j = 0;
        for (; j + 4 <= ng; j += 4) {              /* two pairs on two accumulator chains */
            Q4A8_PAIR(g0 + j, j, a0);
            Q4A8_PAIR(g0 + j + 2, j + 2, a1);
        }
        if (j + 2 <= ng) { Q4A8_PAIR(g0 + j, j, a0); j += 2; }
        if (j < ng) {                               /* an odd last group, alone */
            const int g = g0 + j;
            __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(qn + g * 16)));
            __m256i w = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0)),
                                         _mm256_set1_epi8(0x0f));
            const float dw = half_to_float(dn[g]);
            for (int r = 0; r < M; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + (size_t)g * 32));
                __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
                tail[r] += dw * xd[(size_t)r * G + g] * (float)_mm_cvtsi128_si32(h);
            }
        }
    }
    for (int r = 0; r < M; r++)
        res[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), off[r])) + tail[r];
}

/* q8 (the LM head) with 8-bit activations. vpdpbusd multiplies unsigned by signed bytes, so the
 * weights are kept offset, u = q + 128 (`quant.QuantLinear` stores them so), and each lane's
 * accumulator starts at -128 times its four activations (`xinit`, from the quantizer): the
 * lane then ends at exactly sum(q qx). Two groups a 512-bit pass, 8 lanes each. */
static inline __attribute__((always_inline)) void q8a8_row(
        const int8_t *restrict xq, const float *restrict xd, const float *restrict xdv,
        const int32_t *restrict xinit, const int M, int K, const uint8_t *restrict un,
        const uint16_t *restrict dn, float *restrict res) {
    const int G = K / 32, P = G / 2;
    __m512 a0[MAXM], a1[MAXM];
    float tail[MAXM];
    for (int r = 0; r < M; r++) { a0[r] = a1[r] = _mm512_setzero_ps(); tail[r] = 0.f; }
    const __m512i pat = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
#define Q8A8_PAIR(G_, J_, A) do {                                                            \
        __m512i w = _mm512_loadu_si512(un + (size_t)(G_) * 32);                                   \
        __m512 dwv = _mm512_permutexvar_ps(_mm512_add_epi32(pat, _mm512_set1_epi32(J_)), dvec);   \
        for (int r = 0; r < M; r++) {                                                             \
            const size_t at = ((size_t)r * P + (G_) / 2) * 16;                                    \
            __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(xinit + at), w,                    \
                                            _mm512_loadu_si512(xq + (size_t)r * K + (size_t)(G_) * 32)); \
            A[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dwv, _mm512_loadu_ps(xdv + at)), A[r]); \
        }                                                                                         \
    } while (0)
    for (int g0 = 0; g0 < G; g0 += 16) {
        const int ng = G - g0 < 16 ? G - g0 : 16;
        const __m512 dvec = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1), dn + g0));
        int j = 0;
        for (; j + 4 <= ng; j += 4) {
            Q8A8_PAIR(g0 + j, j, a0);
            Q8A8_PAIR(g0 + j + 2, j + 2, a1);
        }
        if (j + 2 <= ng) { Q8A8_PAIR(g0 + j, j, a0); j += 2; }
        if (j < ng) {                               /* an odd last group, alone */
            const int g = g0 + j;
            const float dw = half_to_float(dn[g]);
            for (int r = 0; r < M; r++)
                tail[r] += dw * xd[(size_t)r * G + g] * (float)q8a8_group(un + (size_t)g * 32, xq + (size_t)r * K + (size_t)g * 32);
        }
    }
    for (int r = 0; r < M; r++) res[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])) + tail[r];
}
#else
/* sum(q qx) of one q4 group: low nibbles by `lo`, high ones by `hi` (out of the vectorizer,
 * as q8a8_group). */
static __attribute__((noinline, optimize("no-tree-vectorize"))) int32_t q4a8_group(
        const uint8_t *q, const int8_t *lo, const int8_t *hi) {
    int32_t s = 0;
    for (int e = 0; e < 16; e++) s += (int32_t)(q[e] & 0xf) * lo[e] + (int32_t)(q[e] >> 4) * hi[e];
    return s;
}

/* Portable: the same integer sums, one group at a time. */
static inline __attribute__((always_inline)) void q4a8_row(
        const int8_t *restrict xq, const float *restrict xd, const float *restrict xdv,
        const float *restrict xs, const int M, int K, const uint8_t *restrict qn,
        const uint16_t *restrict dn, const uint16_t *restrict mn, float *restrict res) {
    (void)xdv;
    const int G = K / 32, P = G / 2;
    for (int r = 0; r < M; r++) res[r] = 0.f;
    for (int g = 0; g < G; g++) {
        const uint8_t *qb = qn + (size_t)g * 16;
        const float dw = half_to_float(dn[g]), mw = half_to_float(mn[g]);
        const int paired = g < 2 * P;
        const int lo_at = paired ? (g & 1) * 16 : 0, hi_at = paired ? 32 + (g & 1) * 16 : 16;
        for (int r = 0; r < M; r++) {
            const int8_t *xr = xq + (size_t)r * K + (size_t)(g & ~1) * 32;
            const int32_t s = q4a8_group(qb, xr + lo_at, xr + hi_at);
            res[r] += dw * xd[(size_t)r * G + g] * (float)s + mw * xs[(size_t)r * G + g];
        }
    }
}

static inline __attribute__((always_inline)) void q8a8_row(
        const int8_t *restrict xq, const float *restrict xd, const float *restrict xdv,
        const int32_t *restrict xinit, const int M, int K, const uint8_t *restrict un,
        const uint16_t *restrict dn, float *restrict res) {
    (void)xdv, (void)xinit;
    const int G = K / 32;
    for (int r = 0; r < M; r++) res[r] = 0.f;
    for (int g = 0; g < G; g++) {
        const float dw = half_to_float(dn[g]);
        for (int r = 0; r < M; r++)
            res[r] += dw * xd[(size_t)r * G + g] * (float)q8a8_group(un + (size_t)g * 32, xq + (size_t)r * K + (size_t)g * 32);
    }
}
#endif
