/* exp(x) for x <= 0, shared by the attention kernels (paged_decode.c, prefill_attn.c): one lane
 * (`exp_neg`) and, with AVX-512, 16 (`exp16`). */
#ifndef ACTORSERVE_EXP_NEG_H
#define ACTORSERVE_EXP_NEG_H
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max), relative error ~2e-7:
 * x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n through the exponent. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round to nearest by the 1.5 * 2^23 trick: plain arithmetic, so the loop vectorizes
     * (roundf is a libm call the compiler cannot widen; it was a scalar call per score) */
    float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) of 16 lanes, x <= 0: exp_neg's arithmetic (x = n ln2 + r, the same polynomial), with
 * n rounded to nearest even by `vrndscaleps` and 2^n applied by `vscalefps`. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
