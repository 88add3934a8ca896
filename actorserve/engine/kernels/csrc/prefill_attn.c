/* Causal attention of a bfloat16 prompt chunk (actorserve.engine.kernels.prefill_kernel).
 *
 * The chunk's n queries are the tokens at positions start .. start + n - 1; the query at
 * position p attends over keys 0 .. p of k / v ([L, nkv, d] rows, `ks` elements from one token
 * to the next, L >= start + n; no key past start + n - 1 is read). The g query heads sharing a
 * KV head are rows of one work unit: (KV head h, QB queries), so each K and V row a unit reads
 * serves g * QB query rows.
 *
 * Arithmetic: the decode kernel's steps and roundings (paged_decode.c, with its exponential 16
 * lanes at a time; other sum orders): q . k as bf16 pairs into float32 sums (`vdpbf16ps`),
 * times the scale in float32, a float32 softmax, the weights rounded to bf16, their products
 * with V summed in float32, the output rounded to bf16 (nearest even).
 * transformers' eager attention rounds the scores to bf16 as well; this keeps them float32.
 *
 * Layout (packed once a call, by all threads, before any unit starts):
 * - K of head h as tiles of 16 keys: dword (tile, c, t) = the pair of dimensions 2c, 2c + 1 of
 *   key 16 tile + t, so one `vdpbf16ps` with a query's pair c broadcast adds that pair's
 *   products to 16 keys' scores;
 * - V of head h as key pairs: dword (j, e) = dimension e of keys 2j and 2j + 1, so one
 *   `vdpbf16ps` with a row's two weights broadcast adds both keys' terms to 16 dimensions.
 * Keys past the last one a unit sees are zeros in the packs and weigh zero.
 *
 * Only with AVX512-BF16 (`prefill_attn_supported`); elsewhere the caller keeps torch's
 * blocked products. Head sizes 64 and 128. */
#pragma GCC optimize("fp-contract=fast")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "exp_neg.h"

#define QB 16      /* queries a unit */
#define MR 8       /* score rows a register block (times two key tiles) */
#define MAX_GROUP 16   /* query heads a KV head, at most */

int prefill_attn_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* Scores of M rows (their queries packed: row i's pair c at qp[i * C2 + c]) against key tiles
 * T and T + 1 (`two`), C2 = d / 2 pairs; s[i * stride + 16 T ..] = scale * q . k. */
static inline __attribute__((always_inline)) void qk_rows(
        const uint32_t *restrict qp, const uint32_t *restrict kp, int T, int two, const int C2,
        const int M, float scale, float *restrict s, size_t stride) {
    __m512 a0[MR], a1[MR];
    for (int i = 0; i < M; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    const uint32_t *k0 = kp + (size_t)T * C2 * 16, *k1 = k0 + (size_t)C2 * 16;
    if (two) {
        for (int c = 0; c < C2; c++) {
            __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * c);
            __m512bh x1 = (__m512bh)_mm512_loadu_si512(k1 + 16 * c);
            for (int i = 0; i < M; i++) {
                __m512bh b = (__m512bh)_mm512_set1_epi32((int)qp[(size_t)i * C2 + c]);
                a0[i] = _mm512_dpbf16_ps(a0[i], b, x0);
                a1[i] = _mm512_dpbf16_ps(a1[i], b, x1);
            }
        }
    } else {
        for (int c = 0; c < C2; c++) {
            __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * c);
            for (int i = 0; i < M; i++)
                a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_set1_epi32((int)qp[(size_t)i * C2 + c]), x0);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < M; i++) {
        _mm512_storeu_ps(s + i * stride + 16 * (size_t)T, _mm512_mul_ps(a0[i], sc));
        if (two) _mm512_storeu_ps(s + i * stride + 16 * (size_t)T + 16, _mm512_mul_ps(a1[i], sc));
    }
}

/* M rows' weighted sums of V over the key pairs [0, np): w = the rows' bf16 weights (row i's
 * pair j at w[i * wstride + j]), vp = V's pairs ([np][d] dwords), C = d / 16 vectors a row;
 * the rows' outputs rounded to bf16 at o[i]. */
static inline __attribute__((always_inline)) void pv_rows(
        const uint32_t *restrict w, size_t wstride, const uint32_t *restrict vp, int np, const int C,
        const int M, uint16_t *const *o) {
    __m512 acc[6][8];                               /* M * C <= 24 */
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++) acc[i][c] = _mm512_setzero_ps();
    for (int j = 0; j < np; j++) {
        __m512bh x[8];
        for (int c = 0; c < C; c++) x[c] = (__m512bh)_mm512_loadu_si512(vp + (size_t)j * C * 16 + 16 * c);
        for (int i = 0; i < M; i++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[i * wstride + j]);
            for (int c = 0; c < C; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], b, x[c]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_si256((__m256i *)(o[i] + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[i][c]));
}

/* Row r of the unit's scores (length `lim`, its causal limit): softmax, written back as bf16
 * weights in the row's first half, zeros from `lim` to `upto` (even). Three passes of 16 lanes:
 * the max, the exponentials and their sum, then scaled and rounded to bf16 (a 32-float read
 * precedes the 32 words it makes, so the words may overwrite the floats read). */
static inline void softmax_weights(float *restrict sr, int lim, int upto) {
    const int full = lim & ~15;
    const __mmask16 tail = (__mmask16)((1u << (lim - full)) - 1u);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int p = 0; p < full; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + p));
    if (tail) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sr + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int p = 0; p < full; p += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + p), m));
        _mm512_storeu_ps(sr + p, e);
        sum = _mm512_add_ps(sum, e);
    }
    const int padded = (upto + 31) & ~31;
    if (full < padded) {                        /* the tail, then zeros to a whole 32 */
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + full), m);
        const __m512 e = _mm512_maskz_mov_ps(tail, exp16(x));
        _mm512_storeu_ps(sr + full, e);
        sum = _mm512_add_ps(sum, e);
        for (int p = full + 16; p < padded; p += 16) _mm512_storeu_ps(sr + p, _mm512_setzero_ps());
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    uint16_t *w = (uint16_t *)sr;
    for (int p = 0; p < upto; p += 32) {
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(sr + p), inv);
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(sr + p + 16), inv);
        _mm256_storeu_si256((__m256i *)(w + p), (__m256i)_mm512_cvtneps_pbh(a));
        _mm256_storeu_si256((__m256i *)(w + p + 16), (__m256i)_mm512_cvtneps_pbh(b));
    }
}

#define QK(M_) qk_rows(qp + (size_t)r0 * C2, kp, T, two, C2, M_, scale, s + (size_t)r0 * stride, stride)
#define PV(M_) pv_rows((const uint32_t *)(s + (size_t)r0 * stride), stride, vp, np, C, M_, o + r0)

/* One unit: KV head h, queries [t0, t1) of the chunk (d a constant in each copy). */
static inline __attribute__((always_inline)) void unit(
        const uint16_t *q, long qs, uint16_t *out, long os, const uint32_t *kp, const uint32_t *vp,
        int t0, int t1, int start, int h, int g, const int d, float scale,
        uint32_t *restrict qp, float *restrict s, size_t stride) {
    const int C2 = d / 2, C = d / 16, R = (t1 - t0) * g, MP = 24 / C;
    uint16_t *o[QB * MAX_GROUP];
    for (int r = 0; r < R; r++) {                   /* row r: query t0 + r / g, head h g + r % g */
        const int t = t0 + r / g, hq = h * g + r % g;
        memcpy(qp + (size_t)r * C2, q + t * qs + (size_t)hq * d, (size_t)d * 2);
        o[r] = out + t * os + (size_t)hq * d;
    }
    for (int r0 = 0; r0 < R; r0 += MR) {
        const int M = R - r0 < MR ? R - r0 : MR;
        const int seen = start + t0 + (r0 + M - 1) / g + 1;      /* the block's last row's keys */
        const int tiles = (seen + 15) / 16;
        for (int T = 0; T < tiles; T += 2) {
            const int two = T + 1 < tiles;
            switch (M) {
                case 8: QK(8); break; case 7: QK(7); break; case 6: QK(6); break; case 5: QK(5); break;
                case 4: QK(4); break; case 3: QK(3); break; case 2: QK(2); break; default: QK(1);
            }
        }
    }
    const int last = start + t1, upto = (last + 1) & ~1;
    for (int r = 0; r < R; r++) softmax_weights(s + (size_t)r * stride, start + t0 + r / g + 1, upto);
    for (int r0 = 0; r0 < R; r0 += MP) {
        const int M = R - r0 < MP ? R - r0 : MP;
        const int np = (start + t0 + (r0 + M - 1) / g + 1 + 1) / 2;
        if (C == 4) {
            switch (M) {
                case 6: PV(6); break; case 5: PV(5); break; case 4: PV(4); break;
                case 3: PV(3); break; case 2: PV(2); break; default: PV(1);
            }
        } else {                                     /* d = 128: C = 8, MP = 3 */
            switch (M) { case 3: PV(3); break; case 2: PV(2); break; default: PV(1); }
        }
    }
}
#endif

/* out (bf16, token t's head j at out + t * os + j * d) = causal attention of the n queries at
 * q (t * qs + j * d) over k / v (token p's KV head h at p * ks + h * d). Returns 0, -1 when
 * out of memory, -2 where it cannot run (no AVX512-BF16, a head size other than 64 or 128). */
int prefill_attn(const uint16_t *q, long qs, const uint16_t *k, const uint16_t *v, long ks,
                 int n, int start, int nh, int nkv, int d, float scale,
                 uint16_t *out, long os, int nthreads) {
#if defined(__AVX512BF16__)
    if ((d != 64 && d != 128) || nkv <= 0 || nh % nkv != 0 || nh / nkv > MAX_GROUP || n <= 0) return -2;
    const int g = nh / nkv, L = start + n, C2 = d / 2;
    const int tiles = (L + 15) / 16, pairs = (L + 1) / 2;
    const size_t kph = (size_t)tiles * 16 * C2, vph = (size_t)pairs * d;     /* dwords a head */
    const size_t stride = ((size_t)L + 31) & ~(size_t)31;
    uint32_t *kpack = aligned_alloc(64, ((kph * nkv * 4 + 63) & ~(size_t)63));
    uint32_t *vpack = aligned_alloc(64, ((vph * nkv * 4 + 63) & ~(size_t)63));
    if (!kpack || !vpack) { free(kpack); free(vpack); return -1; }
    const int nq = (n + QB - 1) / QB, units = nq * nkv;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int x = 0; x < nkv * tiles; x++) {     /* K: (head, tile) */
            const int h = x / tiles, T = x % tiles;
            uint32_t *dst = kpack + h * kph + (size_t)T * 16 * C2;
            for (int t = 0; t < 16; t++) {
                const int p = T * 16 + t;
                const uint32_t *src = (const uint32_t *)(k + (size_t)p * ks + (size_t)h * d);
                if (p < L) for (int c = 0; c < C2; c++) dst[c * 16 + t] = src[c];
                else for (int c = 0; c < C2; c++) dst[c * 16 + t] = 0;
            }
        }
        #pragma omp for schedule(static)
        for (int x = 0; x < nkv * pairs; x++) {     /* V: (head, key pair) */
            const int h = x / pairs, j = x % pairs;
            uint32_t *dst = vpack + h * vph + (size_t)j * d;
            const uint16_t *a = v + (size_t)(2 * j) * ks + (size_t)h * d;
            if (2 * j + 1 < L) {
                const uint16_t *b = a + ks;
                #pragma omp simd
                for (int e = 0; e < d; e++) dst[e] = (uint32_t)a[e] | (uint32_t)b[e] << 16;
            } else {
                for (int e = 0; e < d; e++) dst[e] = (uint32_t)a[e];
            }
        }
        uint32_t *qp = aligned_alloc(64, (size_t)QB * g * d * 2 + 64);
        float *s = aligned_alloc(64, sizeof(float) * QB * g * stride + 64);
        if (!qp || !s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {          /* the longest units (the last queries) first */
            if (!qp || !s) continue;
            const int b = nq - 1 - u / nkv, h = u % nkv;
            const int t0 = b * QB, t1 = t0 + QB < n ? t0 + QB : n;
            const uint32_t *kh = kpack + h * kph, *vh = vpack + h * vph;
            if (d == 64) unit(q, qs, out, os, kh, vh, t0, t1, start, h, g, 64, scale, qp, s, stride);
            else unit(q, qs, out, os, kh, vh, t0, t1, start, h, g, 128, scale, qp, s, stride);
        }
        free(qp);
        free(s);
    }
    free(kpack);
    free(vpack);
    return failed ? -1 : 0;
#else
    (void)q; (void)qs; (void)k; (void)v; (void)ks; (void)n; (void)start; (void)nh; (void)nkv; (void)d;
    (void)scale; (void)out; (void)os; (void)nthreads;
    return -2;
#endif
}
