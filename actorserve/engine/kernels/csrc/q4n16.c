/* q4 products of 8-bit activations with 16 output rows a register (``--quantization q4a8``, the
 * layout `quant.repack_n16` makes), included by qgemv.c after act8.c.
 *
 * act8.c's kernels put one output row's 64 weights in a register, so every group of every row
 * needs its own float scaling per input row (a convert, a multiply and an FMA for 64 products).
 * Here a register holds 4 weights of each of 16 output rows n: one vpdpbusd multiplies them by
 * the same 4 activations (broadcast) and adds the 4 products into each row's int32 lane, so a
 * group's 32 weights take 8 vpdpbusd into one int32 vector of 16 rows' exact group sums, scaled
 * once: per (16 rows, group, input row) 8 integer instructions and 3 float ones, for 512
 * products. It is also a matrix-matrix kernel: input rows go in tiles of up to 8 against the
 * same 16 weight rows, so prefill runs through it as well (any number of rows).
 *
 * Layout (a "superblock" of 320 bytes per 16 output rows and group g): 256 bytes of nibbles,
 * dword j (0..3) of each of the 16 rows in turn -- the rows' own packed bytes 4j..4j+3 of the
 * group, whose low nibbles are weights 4j..4j+3 and high nibbles 16+4j..16+4j+3 -- then the 16
 * rows' d, then their m (float16). The same bytes as the row layout, regrouped; activations in
 * their natural order (act8.c's q8 quantization). */
#define N16_SB 320

static inline uint32_t load_u32(const int8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* One tile of M (1..8) input rows against one block of 16 output rows: res[r] = the 16 sums. */
static inline __attribute__((always_inline)) void q4n16_tile(
        const int8_t *restrict xq, const float *restrict xd, const float *restrict xs, const int M,
        int K, const uint8_t *restrict sb, __m512 *restrict res) {
    const int G = K / 32;
    __m512 acc[MAXM];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < G; g++) {
        const uint8_t *b = sb + (size_t)g * N16_SB;
        const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 256)));
        const __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 288)));
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            __m512i w = _mm512_loadu_si512(b + 64 * j);
            lo[j] = _mm512_and_si512(w, nib);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        }
        for (int r = 0; r < M; r++) {
            const int8_t *xr = xq + (size_t)r * K + (size_t)g * 32;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {       /* two chains: low and high nibbles */
                s0 = _mm512_dpbusd_epi32(s0, lo[j], _mm512_set1_epi32((int)load_u32(xr + 4 * j)));
                s1 = _mm512_dpbusd_epi32(s1, hi[j], _mm512_set1_epi32((int)load_u32(xr + 16 + 4 * j)));
            }
            const __m512 sc = _mm512_mul_ps(d16, _mm512_set1_ps(xd[(size_t)r * G + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sc, acc[r]);
            acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xs[(size_t)r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) res[r] = acc[r];
}

static void q4n16_block(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                        const uint8_t *sb, const float *bias, void *y, int y_bf16, int N, int n0) {
    const int G = K / 32;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r0 = 0; r0 < M; r0 += MAXM) {
        const int mt = M - r0 < MAXM ? M - r0 : MAXM;
        __m512 res[MAXM];
        const int8_t *xt = xq + (size_t)r0 * K;
        const float *dt = xd + (size_t)r0 * G, *st = xs + (size_t)r0 * G;
        switch (mt) {
#define N16T(M_) case M_: q4n16_tile(xt, dt, st, M_, K, sb, res); break;
            N16T(1) N16T(2) N16T(3) N16T(4) N16T(5) N16T(6) N16T(7) default: q4n16_tile(xt, dt, st, 8, K, sb, res);
        }
        for (int r = 0; r < mt; r++) {
            const __m512 v = _mm512_add_ps(res[r], bv);
            const size_t at = (size_t)(r0 + r) * N + n0;
            if (!y_bf16) {
                _mm512_storeu_ps((float *)y + at, v);
                continue;
            }
#ifdef __AVX512BF16__
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), (__m256i)_mm512_cvtneps_pbh(v));
#else
            float f[16];
            _mm512_storeu_ps(f, v);
            for (int i = 0; i < 16; i++) ((uint16_t *)y)[at + i] = float_to_bf16(f[i]);
#endif
        }
    }
}
#define HAVE_Q4N16_SIMD 1
#endif

#ifndef HAVE_Q4N16_SIMD
/* Portable: the same integer sums, one output row at a time (kept out of the vectorizer, which
 * in GCC 12 turned a dot product of this kind into wrong sums: see q8a8_group). */
static __attribute__((optimize("no-tree-vectorize"))) void q4n16_block(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                        const uint8_t *sb, const float *bias, void *y, int y_bf16, int N, int n0) {
    const int G = K / 32;
    for (int r = 0; r < M; r++) {
        for (int i = 0; i < 16; i++) {
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                const uint8_t *b = sb + (size_t)g * N16_SB;
                const int8_t *xr = xq + (size_t)r * K + (size_t)g * 32;
                int32_t s = 0;
                for (int j = 0; j < 4; j++)
                    for (int e = 0; e < 4; e++) {
                        const uint8_t w = b[64 * j + 4 * i + e];
                        s += (int32_t)(w & 0xf) * xr[4 * j + e] + (int32_t)(w >> 4) * xr[16 + 4 * j + e];
                    }
                uint16_t dh, mh;
                memcpy(&dh, b + 256 + 2 * i, 2);
                memcpy(&mh, b + 288 + 2 * i, 2);
                acc += half_to_float(dh) * xd[(size_t)r * G + g] * (float)s + half_to_float(mh) * xs[(size_t)r * G + g];
            }
            const float v = acc + (bias ? bias[n0 + i] : 0.f);
            const size_t at = (size_t)r * N + n0 + i;
            if (y_bf16) ((uint16_t *)y)[at] = float_to_bf16(v);
            else ((float *)y)[at] = v;
        }
    }
}
#endif
