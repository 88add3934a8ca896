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
