/* The small per-layer operations of a quantized decode step (actorserve.engine.kernels.glue; built as
 * part of decode_step.c, which includes it, and used there too), one call
 * each instead of the half-dozen torch operations each takes in HF's modules: at one sequence
 * a torch operation costs a few microseconds of dispatch for a few hundred numbers, and a
 * layer had about thirty of them.
 *
 * Each follows HF's arithmetic step by step, in the same order and with the same roundings
 * (float32 math; for bfloat16 tensors each intermediate HF keeps in bfloat16 is rounded to
 * bfloat16 here too). Built with -std=c11, so the compiler does not contract a * b + c into
 * an FMA (ISO C's default), as torch's element-wise kernels do not either. The one place the
 * result can differ is the order of the float32 sum of squares in the norm. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p, size_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {     /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000) == 0x7f800000) return (uint16_t)(bits >> 16) | ((bits & 0xffff) ? 0x40 : 0);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_through(float f) {     /* f as it reads after a bfloat16 store */
    uint32_t bits = (uint32_t)bf16_round(f) << 16;
    float g;
    memcpy(&g, &bits, 4);
    return g;
}

/* For each of `rows` rows of D numbers: h += delta (when delta is not NULL; the residual add),
 * then out = w * (h * rsqrt(mean(h^2) + eps)) -- HF's Llama-style RMSNorm: the normalised
 * row is cast to the tensors' dtype before the weight multiplies it. h, delta, w and out are
 * all float32, or all bfloat16 (`bf16`); delta and out may have a row stride of their own. */
void add_rmsnorm(void *h, const void *delta, long delta_stride, const void *w, float eps,
                 void *out, long out_stride, int rows, int D, int bf16) {
    for (int r = 0; r < rows; r++) {
        float lanes[16] = {0};
        if (bf16) {
            uint16_t *hr = (uint16_t *)h + (size_t)r * D;
            const uint16_t *dr = delta ? (const uint16_t *)delta + (size_t)r * delta_stride : NULL;
            for (int i = 0; i < D; i++) {
                float v = bf16_load(hr, i);
                if (dr) {
                    hr[i] = bf16_round(v + bf16_load(dr, i));
                    v = bf16_load(hr, i);
                }
                lanes[i & 15] += v * v;
            }
        } else {
            float *hr = (float *)h + (size_t)r * D;
            const float *dr = delta ? (const float *)delta + (size_t)r * delta_stride : NULL;
            for (int i = 0; i < D; i++) {
                if (dr) hr[i] = hr[i] + dr[i];
                lanes[i & 15] += hr[i] * hr[i];
            }
        }
        float ss = 0.f;
        for (int e = 0; e < 16; e++) ss += lanes[e];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (bf16) {
            const uint16_t *hr = (const uint16_t *)h + (size_t)r * D, *wr = (const uint16_t *)w;
            uint16_t *o = (uint16_t *)out + (size_t)r * out_stride;
            for (int i = 0; i < D; i++)
                o[i] = bf16_round(bf16_load(wr, i) * bf16_through(bf16_load(hr, i) * inv));
        } else {
            const float *hr = (const float *)h + (size_t)r * D, *wr = (const float *)w;
            float *o = (float *)out + (size_t)r * out_stride;
            for (int i = 0; i < D; i++) o[i] = wr[i] * (hr[i] * inv);
        }
    }
}

/* RoPE in place on x [rows, heads, d] (row stride `row_stride` elements, heads contiguous),
 * with cos/sin [rows, rd] (rd <= d: partial rotary, the rest passes through): HF's
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) over the first rd numbers. */
void rope(void *x, long row_stride, int rows, int heads, int d, const void *cos, const void *sin,
          int rd, int bf16) {
    const int half = rd / 2;
    for (int t = 0; t < rows; t++) {
        for (int hh = 0; hh < heads; hh++) {
            const size_t at = (size_t)t * row_stride + (size_t)hh * d, cs = (size_t)t * rd;
            if (bf16) {
                uint16_t *xr = (uint16_t *)x + at;
                const uint16_t *c = (const uint16_t *)cos + cs, *s = (const uint16_t *)sin + cs;
                for (int i = 0; i < half; i++) {
                    const float a = bf16_load(xr, i), b = bf16_load(xr, i + half);
                    const float lo = bf16_through(a * bf16_load(c, i)) + bf16_through(-b * bf16_load(s, i));
                    const float hi = bf16_through(b * bf16_load(c, i + half)) + bf16_through(a * bf16_load(s, i + half));
                    xr[i] = bf16_round(lo);
                    xr[i + half] = bf16_round(hi);
                }
            } else {
                float *xr = (float *)x + at;
                const float *c = (const float *)cos + cs, *s = (const float *)sin + cs;
                for (int i = 0; i < half; i++) {
                    const float a = xr[i], b = xr[i + half];
                    const float lo = a * c[i] + (-b) * s[i];
                    const float hi = b * c[i + half] + a * s[i + half];
                    xr[i] = lo;
                    xr[i + half] = hi;
                }
            }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bfloat16 numbers widened to float32 */
static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* bf16_round of 16 numbers (nearest even; a NaN stays a quiet NaN) */
static inline __m256i bf16x16_round(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                    _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* e^x for 16 numbers: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (the
 * classic single-precision minimax coefficients), scaled by 2^n with vscalefps, which also
 * gives inf and 0 past float32's range. Within 2 ulp of expf. */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* One row: act[i] = SiLU(g[i]) * u[i], i < I: HF's act_fn(gate) * up, SiLU rounded to the
 * tensors' dtype before the multiply as torch's is. act may be g (in place). */
static inline void silu_mul_row(const void *g_, const void *u_, void *act_, int I, int bf16) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= I; i += 16) {
        if (bf16) {
            const __m512 g = bf16x16_load((const uint16_t *)g_ + i);
            const __m512 u = bf16x16_load((const uint16_t *)u_ + i);
            const __m512 sl = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round(sl)), 16));
            _mm256_storeu_si256((__m256i *)((uint16_t *)act_ + i), bf16x16_round(_mm512_mul_ps(sr, u)));
        } else {
            const __m512 g = _mm512_loadu_ps((const float *)g_ + i);
            const __m512 u = _mm512_loadu_ps((const float *)u_ + i);
            const __m512 sl = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_storeu_ps((float *)act_ + i, _mm512_mul_ps(sl, u));
        }
    }
#endif
    for (; i < I; i++) {
        if (bf16) {
            const float g = bf16_load((const uint16_t *)g_, i), u = bf16_load((const uint16_t *)u_, i);
            ((uint16_t *)act_)[i] = bf16_round(bf16_through(g / (1.0f + expf(-g))) * u);
        } else {
            const float g = ((const float *)g_)[i], u = ((const float *)u_)[i];
            ((float *)act_)[i] = g / (1.0f + expf(-g)) * u;
        }
    }
}

/* act[t] = SiLU(gate[t]) * up[t] for rows [r0, r1) of gu [rows, 2I] (gate, then up). */
void silu_mul(const void *gu, void *act, int I, int r0, int r1, int bf16) {
    const size_t es = bf16 ? 2 : 4;
    for (int t = r0; t < r1; t++)
        silu_mul_row((const char *)gu + (size_t)t * 2 * I * es, (const char *)gu + ((size_t)t * 2 * I + I) * es,
                     (char *)act + (size_t)t * I * es, I, bf16);
}

/* The same for a prompt chunk's rows outside the step pool: gate, up and act with their own row
 * strides (elements; act may be gate), the rows shared out over `nthreads` OpenMP threads in
 * contiguous ranges, each row computed by one thread with the code above. */
void silu_mul_mt(const void *g, long gs, const void *u, long us, void *act, long as, int I, int rows,
                 int bf16, int nthreads) {
    const size_t es = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < rows; t++)
        silu_mul_row((const char *)g + (size_t)t * gs * es, (const char *)u + (size_t)t * us * es,
                     (char *)act + (size_t)t * as * es, I, bf16);
}

/* The same, with the rows shared out over `nthreads` OpenMP threads in contiguous ranges (a
 * prompt chunk's rows, outside the step pool): each row is still computed by one thread with
 * the code above, so the bits do not depend on the split. */
void add_rmsnorm_mt(void *h, const void *delta, long delta_stride, const void *w, float eps,
                    void *out, long out_stride, int rows, int D, int bf16, int nthreads) {
    const size_t esz = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int r0 = (int)((long)rows * t / nthreads), r1 = (int)((long)rows * (t + 1) / nthreads);
        if (r0 < r1)
            add_rmsnorm((char *)h + (size_t)r0 * D * esz,
                        delta ? (const char *)delta + (size_t)r0 * delta_stride * esz : NULL, delta_stride, w,
                        eps, (char *)out + (size_t)r0 * out_stride * esz, out_stride, r1 - r0, D, bf16);
    }
}

void rope_mt(void *x, long row_stride, int rows, int heads, int d, const void *cos, const void *sin,
             int rd, int bf16, int nthreads) {
    const size_t esz = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int r0 = (int)((long)rows * t / nthreads), r1 = (int)((long)rows * (t + 1) / nthreads);
        if (r0 < r1)
            rope((char *)x + (size_t)r0 * row_stride * esz, row_stride, r1 - r0, heads, d,
                 (const char *)cos + (size_t)r0 * rd * esz, (const char *)sin + (size_t)r0 * rd * esz, rd, bf16);
    }
}

