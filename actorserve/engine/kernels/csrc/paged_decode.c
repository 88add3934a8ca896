/* Decode attention that reads the paged K/V cache in place (actorserve.engine.kernels.decode_kernel).
 *
 * One query token per sequence. For sequence i and KV head h, the `g` query heads that share
 * h attend over the ctx[i] tokens the block table row i names: token p lives in slot
 * table[i * nb + p / bs] * bs + p % bs of the per-layer K and V tensors
 * [slots, nkv, d] (float32 or bfloat16, row-major). No gather: each K and V row is read
 * once, straight from the cache, converted to float32, and used by all g query heads.
 * Two passes per (i, h): scores (optionally soft-capped: tanh(s / c) * c) and a float32
 * softmax, then the weighted sum of V. Work units (i, h) are spread over OpenMP threads
 * (dynamic: contexts differ in length), or, through `paged_decode_part`, over another pool's
 * threads in shares of equal work (the fused q4 step's). Output: float32 [D, nkv, g, d].
 *
 * Speed notes (2-core EPYC, measured against torch's gather + SDPA in
 * benchmarks/decode_attention.py): the exponential is a polynomial the compiler vectorizes
 * (libm's expf is scalar and was most of the time; its rounding too, roundf, now the
 * 1.5 * 2^23 trick), blocks are walked as blocks (no division per token), bf16 rows widen to
 * float32 with a shift, and head sizes 64 and 128 take the vector copy (`unit_vec`, 3x the
 * scalar loop with the K/V in cache; docs/engine.md). */
#pragma GCC optimize("fp-contract=fast")   /* a * b + c as one FMA where the CPU has it */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "exp_neg.h"

/* `prefetch_run`: how many token rows ahead, and the locality hint (1: `prefetcht2`, into L2).
 * Measured on the 2-core AMD EPYC (benchmarks/decode_attention.py --context): 16-32 rows ahead
 * into L2 alike; into L1 (3) no better than no prefetch at all; 48 or more ahead a little worse. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 32
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 1
#endif

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

/* The specialised copies (d = 64, 128): 16-float vectors (GCC vector extensions: one AVX-512
 * register, two AVX2 ones), one KV head at a time, so a head's query rows, its 16-token
 * block's partial dot products and its output rows stay in registers:
 * - scores: per block of 16 tokens and query row, 16 vector dot products whose horizontal
 *   sums come out together as one vector of 16 scores (a shuffle tree: 15 shuffle pairs for
 *   16 sums instead of 16 separate reductions);
 * - output: per query row, d/16 vector accumulators over the whole context;
 * - the head's rows of a block are widened from bf16 once into an aligned float32 tile (L1).
 * Each K and V row is still read from the cache exactly once (a unit of several heads walks
 * the context once a head, each head's rows in turn). */
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline vf widen(const void *base, size_t at, int bf16) {
#if defined(__AVX512F__)
    if (bf16)
        return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at))), 16));
#endif
    if (bf16) {
        vu u = __builtin_convertvector(*(const vh *)((const uint16_t *)base + at), vu) << 16;
        vf f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return *(const vfu *)((const float *)base + at);
}

/* lane t of the result = the sum of a[t]'s 16 lanes */
static inline vf sum16(vf a[16]) {
    vf b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[i], b[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(b[i], b[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

static inline float vmax(vf a) {
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* Softmax of one score row in place (length L, zero-padded to a multiple of 16 past it). */
static inline void softmax_row(float *restrict sr, int L, float softcap) {
    if (softcap > 0.f)
        for (int p = 0; p < L; p++) sr[p] = tanhf(sr[p] / softcap) * softcap;
#if defined(__AVX512F__)
    {   /* 16 lanes a step (`exp16`): the compiler's vectorization of the loops below left the
         * max and the exponentials' rounding scalar (the prefill kernel measured its softmax
         * 1.7x faster this way) */
        const int full = L & ~15;
        const __mmask16 tail = (__mmask16)((1u << (L - full)) - 1u);
        __m512 mv = _mm512_set1_ps(-INFINITY), sv = _mm512_setzero_ps();
        for (int p = 0; p < full; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + p));
        mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sr + full));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        for (int p = 0; p < full; p += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + p), mx));
            _mm512_storeu_ps(sr + p, e);
            sv = _mm512_add_ps(sv, e);
        }
        const __m512 et = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + full), mx)));
        sv = _mm512_add_ps(sv, et);
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
        for (int p = 0; p < full; p += 16) _mm512_storeu_ps(sr + p, _mm512_mul_ps(_mm512_loadu_ps(sr + p), inv));
        _mm512_mask_storeu_ps(sr + full, tail, _mm512_mul_ps(et, inv));
        return;
    }
#endif
    float m = -INFINITY, sum = 0.f;
    for (int p = 0; p < L; p++) m = sr[p] > m ? sr[p] : m;
    #pragma omp simd reduction(+:sum)
    for (int p = 0; p < L; p++) { sr[p] = exp_neg(sr[p] - m); sum += sr[p]; }
    float inv = 1.f / sum;
    #pragma omp simd
    for (int p = 0; p < L; p++) sr[p] *= inv;
}

/* at[t]: where the rows of token p0 + t (t < tn) start in the cache, in elements. */
static inline void token_rows(const int32_t *tab, int p0, int tn, int bs, size_t row_stride, size_t at[16]) {
    for (int t = 0, j = p0 / bs, o = p0 % bs; t < tn; t++) {
        at[t] = ((size_t)tab[j] * bs + o) * row_stride;
        if (++o == bs) { o = 0; j++; }
    }
}

/* Ask for the rows of 16 tokens ahead of their use, into L2 (`prefetcht2`). A sequence's K
 * (then V) rows are walked as one run of 2 L token rows: position q < L is K's token q, q >= L
 * V's token q - L, so the K pass's last prefetches already bring the V pass's first rows. The
 * blocks lie anywhere in the cache and the hardware prefetchers lose the stream at every block
 * boundary: without this the attention of a decode step read its cache at a fifth to a third
 * of the machine's read bandwidth (docs/engine.md). Into L1 (`prefetcht0`) measured no better than none:
 * the L1's few miss buffers fill and the prefetches stall the loop. Only the unit's heads
 * [h0, h1) are asked for (a unit a head: the other heads are other threads' units). */
static inline void prefetch_run(const void *K, const void *V, const int32_t *tab, int q0, int L, int bs,
                                size_t row_stride, int esz, int h0, int h1, int d) {
    const size_t bytes = row_stride * (size_t)esz, from = (size_t)h0 * d * esz, to = (size_t)h1 * d * esz;
    for (int q = q0; q < q0 + 16 && q < 2 * L; q++) {
        const int p = q < L ? q : q - L;
        const char *r = (const char *)(q < L ? K : V) + ((size_t)tab[p / bs] * bs + p % bs) * bytes;
        for (size_t o = from; o < to; o += 64) __builtin_prefetch(r + o, 0, PREFETCH_HINT);
    }
}

/* The tile: the tn tokens' rows of one head (from `head` elements into each token's rows),
 * C vectors a row, widened to float32. */
static inline __attribute__((always_inline)) void widen_tile(const void *base, const size_t at[16], int tn,
                                                             size_t head, const int C, const int bf16,
                                                             float *restrict tile) {
    for (int t = 0; t < tn; t++)
        for (int c = 0; c < C; c++) ((vf *)tile)[t * C + c] = widen(base, at[t] + head + 16 * c, bf16);
}

#if defined(__AVX512BF16__)
/* Scores of head h's g query rows against tn tokens of a bf16 cache, with `vdpbf16ps`: each
 * instruction multiplies 32 bf16 pairs and adds them into 16 float32 sums, so the K rows are
 * read straight from the cache (no float32 tile) at twice the multiply-adds an instruction.
 * The query row is rounded to bf16 first; a bf16 model's queries are bf16 already (its q
 * projection's and RoPE's outputs), so that is the model's own arithmetic, and the sums stay
 * float32. C2 = d / 32 vectors a row. */
static inline __attribute__((always_inline)) void scores_bf16(
        const float *restrict qi, const void *K, const size_t at[16], int tn, size_t head, int h,
        int h0, int g, const int C2, float scale, float *restrict s, size_t stride, int p0) {
    const uint16_t *k = (const uint16_t *)K + head;
    for (int r = 0; r < g; r++) {
        const float *qr = qi + ((size_t)h * g + r) * C2 * 32;
        __m512bh qb[4];                              /* C2 <= 4 (d <= 128) */
        for (int c = 0; c < C2; c++)
            qb[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qr + 32 * c + 16), _mm512_loadu_ps(qr + 32 * c));
        vf acc[16];
        for (int t = 0; t < 16; t++) {
            __m512 a = _mm512_setzero_ps();
            if (t < tn)
                for (int c = 0; c < C2; c++)
                    a = _mm512_dpbf16_ps(a, qb[c], (__m512bh)_mm512_loadu_si512((const void *)(k + at[t] + 32 * c)));
            acc[t] = (vf)a;
        }
        vf sc = sum16(acc) * scale;
        float *dst = s + ((size_t)(h - h0) * g + r) * stride + p0;
        if (tn == 16) *(vfu *)dst = sc;
        else for (int t = 0; t < tn; t++) dst[t] = sc[t];
    }
}

/* `v_pass_bf16` for the R query rows from r0 (R a constant, so their accumulators stay in
 * registers over the tile's tokens). */
static inline __attribute__((always_inline)) void v_pass_rows(
        const uint16_t *v, const size_t at[16], int tn, int h, int h0, int g, const int C2, const int R,
        int r0, const uint32_t *restrict wb, size_t wstride, int p0, float *restrict acc) {
    __m512 o[3][8];                                  /* R <= 3 rows, 2 x C2 <= 8 vectors each */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * C2; c++) o[r][c] = _mm512_loadu_ps(acc + ((size_t)h * g + r0 + r) * C2 * 32 + 16 * c);
    for (int t = 0; t < tn; t += 2) {
        const int t1 = t + 1 < tn ? t + 1 : t;     /* an odd last token pairs with itself, weight 0 */
        __m512i x[8];
        for (int c = 0; c < C2; c++) {
            __m512i a = _mm512_loadu_si512((const void *)(v + at[t] + 32 * c));
            __m512i b = _mm512_loadu_si512((const void *)(v + at[t1] + 32 * c));
            x[2 * c] = _mm512_unpacklo_epi16(a, b);
            x[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int r = 0; r < R; r++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)wb[((size_t)(h - h0) * g + r0 + r) * wstride + (p0 + t) / 2]);
            for (int c = 0; c < 2 * C2; c++) o[r][c] = _mm512_dpbf16_ps(o[r][c], w, (__m512bh)x[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * C2; c++) _mm512_storeu_ps(acc + ((size_t)h * g + r0 + r) * C2 * 32 + 16 * c, o[r][c]);
}

/* The V pass of one head's g rows over tn tokens, with `vdpbf16ps` on token pairs: two tokens'
 * V rows interleaved (unpacklo/hi of 16-bit words: within each 128-bit lane, which puts the
 * row's elements in the order `v_order` undoes) times the pair of their bf16 weights, the
 * accumulators of up to 3 rows in registers over the tokens. `wb`: the rows' weights as bf16
 * (`weights_bf16`), `acc`: float32 accumulators in that order. The weights rounded to bf16
 * are a bf16 model's own arithmetic (HF casts the softmax to the query's dtype before
 * multiplying by V). */
static inline __attribute__((always_inline)) void v_pass_bf16(
        const void *V, const size_t at[16], int tn, size_t head, int h, int h0, int g, const int C2,
        const uint32_t *restrict wb, size_t wstride, int p0, float *restrict acc) {
    const uint16_t *v = (const uint16_t *)V + head;
    int r0 = 0;
    for (; r0 + 3 <= g; r0 += 3) v_pass_rows(v, at, tn, h, h0, g, C2, 3, r0, wb, wstride, p0, acc);
    for (; r0 < g; r0++) v_pass_rows(v, at, tn, h, h0, g, C2, 1, r0, wb, wstride, p0, acc);
}

/* A softmaxed score row (length L, float32, its row L rounded up to 32 long) as bf16 in place:
 * word p of the result is the weight of token p (the row's first half is reused; a 32-float
 * read is in registers before the 32 words it makes are written, at or behind it). */
static inline void weights_bf16(float *restrict sr, int L) {
    uint16_t *w = (uint16_t *)sr;
    for (int p = 0; p < L; p += 32) {
        __m512 a = _mm512_loadu_ps(sr + p), b = _mm512_loadu_ps(sr + p + 16);
        _mm256_storeu_si256((__m256i *)(w + p), (__m256i)_mm512_cvtneps_pbh(a));
        _mm256_storeu_si256((__m256i *)(w + p + 16), (__m256i)_mm512_cvtneps_pbh(b));
    }
    if (L & 1) w[L] = 0;           /* an odd last token's pair: its partner weighs nothing */
}

/* The accumulators of `v_pass_bf16` back in element order, 32 elements a chunk. */
static inline void v_order(float *restrict o, const int C2) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int c = 0; c < C2; c++) {
        __m512 lo = _mm512_loadu_ps(o + 32 * c), hi = _mm512_loadu_ps(o + 32 * c + 16);
        _mm512_storeu_ps(o + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(o + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

static inline __attribute__((always_inline)) void unit_vec(
        const float *restrict qi, const void *K, const void *V, const int bf16, const int32_t *tab,
        int L, int nkv, int h0, int h1, int g, const int d, int bs, float scale, float softcap,
        float *restrict s, size_t stride, float *restrict tile, float *restrict oi) {
    const int C = d / 16;                        /* vectors a row */
    const size_t row_stride = (size_t)nkv * d;   /* elements from one token's rows to the next */
    /* scores: 16 tokens at a time (a cache block may be shorter or longer than 16), every head
     * of the unit before the next 16, so the cache is read in the order it lies */
    for (int p0 = 0; p0 < L; p0 += 16) {
        const int tn = L - p0 < 16 ? L - p0 : 16;
        size_t at[16];
        token_rows(tab, p0, tn, bs, row_stride, at);
        prefetch_run(K, V, tab, p0 + PREFETCH_AHEAD, L, bs, row_stride, bf16 ? 2 : 4, h0, h1, d);
        for (int h = h0; h < h1; h++) {
#if defined(__AVX512BF16__)
            if (bf16) {              /* the K rows as they lie, bf16 pairs into float32 sums */
                scores_bf16(qi, K, at, tn, (size_t)h * d, h, h0, g, C / 2, scale, s, stride, p0);
                continue;
            }
#endif
            widen_tile(K, at, tn, (size_t)h * d, C, bf16, tile);   /* the 16 tokens' K rows of head h */
            for (int r = 0; r < g; r++) {
                const vfu *qr = (const vfu *)(qi + ((size_t)h * g + r) * d);
                vf acc[16];
                for (int t = 0; t < 16; t++) {
                    vf a = {0};
                    if (t < tn)
                        for (int c = 0; c < C; c++) a += qr[c] * ((vf *)tile)[t * C + c];
                    acc[t] = a;
                }
                vf sc = sum16(acc) * scale;
                float *dst = s + ((size_t)(h - h0) * g + r) * stride + p0;
                if (tn == 16) *(vfu *)dst = sc;
                else for (int t = 0; t < tn; t++) dst[t] = sc[t];
            }
        }
    }
    for (int r = 0; r < (h1 - h0) * g; r++) softmax_row(s + (size_t)r * stride, L, softcap);
    /* output: the weighted sum of V rows, in the same order; a row's d/16 accumulators stay in
     * registers over 16 tokens (the unit's output rows are the running sums between) */
    memset(oi + (size_t)h0 * g * d, 0, sizeof(float) * (size_t)(h1 - h0) * g * d);
#if defined(__AVX512BF16__)
    if (bf16) {
        for (int r = 0; r < (h1 - h0) * g; r++) weights_bf16(s + (size_t)r * stride, L);
        for (int p0 = 0; p0 < L; p0 += 16) {
            const int tn = L - p0 < 16 ? L - p0 : 16;
            size_t at[16];
            token_rows(tab, p0, tn, bs, row_stride, at);
            prefetch_run(K, V, tab, L + p0 + PREFETCH_AHEAD, L, bs, row_stride, 2, h0, h1, d);
            for (int h = h0; h < h1; h++)
                v_pass_bf16(V, at, tn, (size_t)h * d, h, h0, g, C / 2, (const uint32_t *)s, stride, p0, oi);
        }
        for (int r = h0 * g; r < h1 * g; r++) v_order(oi + (size_t)r * d, C / 2);
        return;
    }
#endif
    for (int p0 = 0; p0 < L; p0 += 16) {
        const int tn = L - p0 < 16 ? L - p0 : 16;
        size_t at[16];
        token_rows(tab, p0, tn, bs, row_stride, at);
        prefetch_run(K, V, tab, L + p0 + PREFETCH_AHEAD, L, bs, row_stride, bf16 ? 2 : 4, h0, h1, d);
        for (int h = h0; h < h1; h++) {
            widen_tile(V, at, tn, (size_t)h * d, C, bf16, tile);
            for (int r = 0; r < g; r++) {
                const float *w = s + ((size_t)(h - h0) * g + r) * stride + p0;
                vfu *orow = (vfu *)(oi + ((size_t)h * g + r) * d);
                vf o[8];                             /* C <= 8 (d <= 128) */
                for (int c = 0; c < C; c++) o[c] = orow[c];
                for (int t = 0; t < tn; t++)
                    for (int c = 0; c < C; c++) o[c] += w[t] * ((vf *)tile)[t * C + c];
                for (int c = 0; c < C; c++) orow[c] = o[c];
            }
        }
    }
}

#define UNIT(D_) unit(qi, K, V, bf16, tab, L, nkv, h0, h1, g, D_, bs, scale, softcap, s, stride, row, oi)
#define UNIT_VEC(D_, BF16_) unit_vec(qi, K, V, BF16_, tab, L, nkv, h0, h1, g, D_, bs, scale, softcap, s, \
                                     stride, row, oi)

/* Unit u of a step split `split` ways a sequence (whole sequences: 1; a unit per KV head:
 * nkv), computed on the calling thread with `s` as its scratch. */
static inline void one_unit(int u, int split, const float *q, const void *K, const void *V, int bf16,
                            const int32_t *table, int nb, const int32_t *ctx, int nkv, int g, int d,
                            int bs, float scale, float softcap, float *out, float *s, size_t stride) {
    const int per = nkv / split;
    int i = u / split, h0 = (u % split) * per, h1 = h0 + per, L = ctx[i];
    const int32_t *tab = table + (size_t)i * nb;
    const float *qi = q + (size_t)i * nkv * g * d;
    float *row = s + (size_t)per * g * stride, *oi = out + (size_t)i * nkv * g * d;
    if (d == 64 && bf16) UNIT_VEC(64, 1);
    else if (d == 64) UNIT_VEC(64, 0);
    else if (d == 128 && bf16) UNIT_VEC(128, 1);
    else if (d == 128) UNIT_VEC(128, 0);
    else UNIT(d);
}

static size_t score_stride(const int32_t *ctx, int D) {
    int max_ctx = 0;
    for (int i = 0; i < D; i++)
        if (ctx[i] > max_ctx) max_ctx = ctx[i];
    return ((size_t)max_ctx + 31) & ~(size_t)31;      /* 32: `weights_bf16` converts 32 at a time */
}

static float *scratch(int per, int g, size_t stride, int d) {
    /* scores, then a row's scratch (the scalar copy) or a block's widened K tile (vectors) */
    return aligned_alloc(64, sizeof(float) * ((size_t)per * g * stride + 16 * (size_t)d + 16));
}

/* Part of a step's attention, on the calling thread, for another thread pool to share out
 * (decode_step.c's step pool): the step is `split` units a sequence (see one_unit); unit u's
 * work is its context length, and its units are laid end to end in that measure, W = split x
 * sum(ctx) in all. This call computes the units that start in [w0, w1), so callers that cover
 * [0, W) between them compute every unit once, in shares of about equal work. */
int paged_decode_part(const float *q, const void *K, const void *V, int bf16,
                      const int32_t *table, int nb, const int32_t *ctx,
                      int D, int nkv, int g, int d, int bs, float scale, float softcap,
                      float *out, int split, long w0, long w1) {
    size_t stride = score_stride(ctx, D);
    float *s = NULL;
    long at = 0;
    for (int u = 0; u < D * split; u++) {
        long start = at;
        at += ctx[u / split];
        if (start < w0 || start >= w1) continue;
        if (!s && !(s = scratch(nkv / split, g, stride, d))) return -1;
        one_unit(u, split, q, K, V, bf16, table, nb, ctx, nkv, g, d, bs, scale, softcap, out, s, stride);
    }
    free(s);
    return 0;
}

int paged_decode(const float *q, const void *K, const void *V, int bf16,
                 const int32_t *table, int nb, const int32_t *ctx,
                 int D, int nkv, int g, int d, int bs, float scale, float softcap,
                 float *out, int nthreads) {
    size_t total = 0;
    for (int i = 0; i < D; i++) total += (size_t)ctx[i];
    /* a small step on one thread: waking the others costs more than they would save */
    if (total * (size_t)nkv * (size_t)d < ((size_t)1 << 18)) nthreads = 1;
    size_t stride = score_stride(ctx, D);
    /* few sequences: one unit per head, so every thread has work; else whole sequences */
    int split = D < 4 * nthreads ? nkv : 1, per = nkv / split;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = scratch(per, g, stride, d);
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < D * split; u++) {
            if (!s) continue;
            one_unit(u, split, q, K, V, bf16, table, nb, ctx, nkv, g, d, bs, scale, softcap, out, s, stride);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
