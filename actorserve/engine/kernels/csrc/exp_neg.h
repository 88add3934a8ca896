/* exp(x) for x <= 0, shared by the attention kernels (paged_decode.c, prefill_attn.c). */
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

#endif
