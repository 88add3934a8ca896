/* q8 products of bfloat16 activations with 16 output rows a register (the layout
 * `formats.repack_q8b16` makes), included by qgemv.c beside q4b16.c.
 *
 * Why. A q4 GGUF keeps its tied embedding, so SmolLM2's LM head (49152 x 576), as Q8_0 blocks:
 * w = d q, q int8, d float16 per 32 weights. Without a bf16 dot path its products took the
 * float loops (`q8_row`) up to 4 rows and the packed dense bf16 weight (56 MB, twice q8's bytes)
 * from 5: 2.3-3.6 ms of an 8-row decode step of ~16. Here a q8 weight pair of 16 output rows is
 * widened to bfloat16 in registers (|q| <= 128 is exact in bf16: q -> float32 -> its top half),
 * then multiplied like q4b16.c's: one vdpbf16ps per (pair, input row) into 16 rows' lanes, and
 * one FMA a group applies d. The widening is shared by a tile of input rows (`B16_MT`).
 *
 * Layout (a superblock of 544 bytes per 16 output rows and group g): for each pair p (0..15),
 * 16 bytes of q[n][2p] (n = 0..15), then 16 of q[n][2p + 1]; then the 16 rows' d (float16). */
#define Q8B16_SB 544

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* One tile of M (1..B16_MT) input rows (row stride K) against one block of 16 output rows. */
static inline __attribute__((always_inline)) void q8b16_tile(
        const uint16_t *restrict x, const int M, int K, const uint8_t *restrict sb, __m512 *restrict res) {
    const int G = K / 32;
    __m512 acc[B16_MT];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const __m512i top = _mm512_set1_epi32((int)0xffff0000);
    for (int g = 0; g < G; g++) {
        const uint8_t *b = sb + (size_t)g * Q8B16_SB;
        __m512 t[B16_MT];
        for (int r = 0; r < M; r++) t[r] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p++) {
            /* the pair's two weights of each row as float32 (exact), then as one dword of two
             * bfloat16: the first weight's top half low, the second's high */
            const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 32 * p)))));
            const __m512i c = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 32 * p + 16)))));
            const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(c, top, _mm512_srli_epi32(a, 16), 0xEA);
            for (int r = 0; r < M; r++) {
                int32_t xp;
                memcpy(&xp, x + (size_t)r * K + (size_t)g * 32 + 2 * p, 4);
                t[r] = _mm512_dpbf16_ps(t[r], w, (__m512bh)_mm512_set1_epi32(xp));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 512)));
        for (int r = 0; r < M; r++) acc[r] = _mm512_fmadd_ps(t[r], dv, acc[r]);
    }
    for (int r = 0; r < M; r++) res[r] = acc[r];
}

/* Block nb of 16 output rows for all M input rows, tiles of B16_MT rows. */
static void q8b16_block(const uint16_t *x, int M, int K, const uint8_t *sb, const float *bias,
                        void *y, int y_bf16, int N, int n0) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r0 = 0; r0 < M; r0 += B16_MT) {
        const int mt = M - r0 < B16_MT ? M - r0 : B16_MT;
        __m512 res[B16_MT];
        const uint16_t *xt = x + (size_t)r0 * K;
        switch (mt) {
#define Q8T(M_) case M_: q8b16_tile(xt, M_, K, sb, res); break;
            Q8T(1) Q8T(2) Q8T(3) Q8T(4) Q8T(5) Q8T(6) Q8T(7) Q8T(8) Q8T(9) Q8T(10) Q8T(11)
            default: q8b16_tile(xt, B16_MT, K, sb, res);
#undef Q8T
        }
        b16_store(res, mt, bv, y, y_bf16, (size_t)r0 * N + n0, N);
    }
}
#endif
