/* q4 products of bfloat16 activations with 16 output rows a register (the layout
 * `formats.repack_b16` makes), included by qgemv.c.
 *
 * Why. `q4_row_bf16` puts one output row's weights in a register: every input row then loads
 * its activations again for each output row, and each output row ends in a horizontal sum, so
 * past a few input rows it spends more instructions around its vdpbf16ps than in them. Here a
 * register holds one pair of weights of each of 16 output rows (as bfloat16 numbers 128 + q,
 * exact: see q4_row_bf16), and one vdpbf16ps multiplies it by an input row's matching pair of
 * activations, broadcast from memory: 32 products into 16 rows' float32 lanes. Per (16 output
 * rows, group, input row): 16 vdpbf16ps, then two FMAs apply the group's d and m - 128 d, with
 * no reduction at the end. The weights of a block are unpacked once per tile of input rows
 * (`B16_MT`), and a block's weights stay in L1 between its tiles, so any number of rows reads
 * the weights from memory once.
 *
 * Layout (a superblock of 320 bytes per 16 output rows and group g): four vectors S_j (j 0..3)
 * of 16 dwords, one per output row n, then the 16 rows' d, then their m (float16). Nibble s
 * (s 0..3) of the low half of S_j's dword n is q[n][8j + 2s], of its high half
 * q[n][8j + 2s + 1]: shifted right by 4s and masked with 0x000f000f, the dword holds the pair
 * of weights 8j + 2s, 8j + 2s + 1, as the activations lie in memory. */
#define B16_SB 320
#define B16_MT 12       /* input rows a tile: 12 rows' sums and accumulators fill 24 of the 32
                         * registers; 3-10% faster than 8 at 32 and 64 rows (AMD EPYC) */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Up to B16_PREFETCH_MAXM input rows a product is bound by how fast its superblocks arrive,
 * not by its arithmetic: it asks for the superblock `b16_prefetch` bytes on (0: none) as it
 * starts each one. Whole decode steps of SmolLM2 (engine alone, AMD EPYC, none / 1,024 / 2,048
 * / 4,096 bytes alternated every 10 steps, 600 steps, medians): 1 row 5.52 / 5.07 / 5.14 /
 * 5.11 ms, 2 rows 6.44 / 5.99 / 5.92 / 6.36, 4 rows 8.24 / 7.61 / 7.37 / 7.52; 8 rows (none /
 * 1,024 / 2,048, two runs) 14.68 / 13.68 / 14.04 and 13.30 / 12.67 / 12.56; 16 rows (two tiles,
 * the second reading the block from L1) 23.33 / 23.36 / 23.26. The q8 head (q8b16.c) measured
 * no better with it (caches flushed, 1-4 rows). */
#define B16_PREFETCH_MAXM 8
static int b16_prefetch = 2048;

/* One tile of M (1..B16_MT) input rows x (row stride K) against one block of 16 output rows:
 * res[r] = the 16 sums. NC accumulator chains a row (few rows: the vdpbf16ps latency). */
static inline __attribute__((always_inline)) void q4b16_tile(
        const uint16_t *restrict x, const float *restrict xs, const int M, const int NC, int K,
        const uint8_t *restrict sb, __m512 *restrict res, const int pf) {
    const int G = K / 32;
    __m512 acc[B16_MT];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi32(0x000f000f), k128 = _mm512_set1_epi32(0x43004300);
    for (int g = 0; g < G; g++) {
        const uint8_t *b = sb + (size_t)g * B16_SB;
        if (pf)                 /* the superblock `pf` bytes on: five lines, as this one's */
            for (int o = 0; o < B16_SB; o += 64) __builtin_prefetch(b + pf + o, 0, 0);
        __m512 t[B16_MT][4];
        for (int r = 0; r < M; r++)
            for (int c = 0; c < NC; c++) t[r][c] = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) {
            const __m512i S = _mm512_loadu_si512(b + 64 * j);
            for (int s = 0; s < 4; s++) {
                const __m512i v = s ? _mm512_srli_epi32(S, 4 * s) : S;
                const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(v, mask, k128, 0xEA);
                const int p = 4 * j + s;            /* the pair: weights 2p, 2p + 1 */
                for (int r = 0; r < M; r++) {
                    int32_t xp;
                    memcpy(&xp, x + (size_t)r * K + (size_t)g * 32 + 2 * p, 4);
                    t[r][p % NC] = _mm512_dpbf16_ps(t[r][p % NC], w, (__m512bh)_mm512_set1_epi32(xp));
                }
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 256)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 288)));
        const __m512 cv = _mm512_fnmadd_ps(dv, _mm512_set1_ps(128.0f), mv);     /* m - 128 d */
        for (int r = 0; r < M; r++) {
            __m512 tr = t[r][0];
            for (int c = 1; c < NC; c++) tr = _mm512_add_ps(tr, t[r][c]);
            acc[r] = _mm512_fmadd_ps(tr, dv, acc[r]);
            acc[r] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xs[(size_t)r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) res[r] = acc[r];
}

/* xs[i] = the float32 sum of the i-th group of 32 bfloat16 numbers of x, for n groups. */
static void q4b16_sums(const uint16_t *x, size_t n, float *xs) {
    for (size_t i = 0; i < n; i++) {
        const __m512i v = _mm512_loadu_si512(x + i * 32);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
        xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

/* A tile's mt rows of 16 sums (plus the bias) into y, row r at y[at + r N], float32 or bf16. */
static inline void b16_store(const __m512 *res, int mt, __m512 bv, void *y, int y_bf16, size_t at, int N) {
    for (int r = 0; r < mt; r++, at += (size_t)N) {
        const __m512 v = _mm512_add_ps(res[r], bv);
        if (y_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), (__m256i)_mm512_cvtneps_pbh(v));
        else _mm512_storeu_ps((float *)y + at, v);
    }
}

/* Block nb of 16 output rows for all M input rows: tiles of B16_MT rows, the block's weights
 * staying in L1 from one tile to the next. */
static void q4b16_block(const uint16_t *x, const float *xs, int M, int K, const uint8_t *sb,
                        const float *bias, void *y, int y_bf16, int N, int n0) {
    const int G = K / 32;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    const int pf = M <= B16_PREFETCH_MAXM ? b16_prefetch : 0;
    for (int r0 = 0; r0 < M; r0 += B16_MT) {
        const int mt = M - r0 < B16_MT ? M - r0 : B16_MT;
        __m512 res[B16_MT];
        const uint16_t *xt = x + (size_t)r0 * K;
        const float *st = xs + (size_t)r0 * G;
        switch (mt) {
#define B16T(M_, NC_) case M_: q4b16_tile(xt, st, M_, NC_, K, sb, res, pf); break;
            B16T(1, 4) B16T(2, 4) B16T(3, 2) B16T(4, 2) B16T(5, 1) B16T(6, 1) B16T(7, 1) B16T(8, 1)
            B16T(9, 1) B16T(10, 1) B16T(11, 1)
            default: q4b16_tile(xt, st, B16_MT, 1, K, sb, res, 0);
#undef B16T
        }
        b16_store(res, mt, bv, y, y_bf16, (size_t)r0 * N + n0, N);
    }
}
#define HAVE_Q4B16 1
#endif
