/* One fused AdamW pass over an offloaded bucket's host state (megazoo/kernels/host_adamw.py).
 *
 * torch's fused CPU AdamW takes fp32 gradients and leaves the bf16 copy of the new
 * parameters to a second pass, so the offloaded step made three passes over memory: upcast
 * the bf16 gradient, step, cast the masters down for the upload (40 bytes per element).
 * This kernel reads the gradient as it comes (bf16 or fp32), updates master and moments in
 * place and writes the bf16 parameters into the upload buffer in the same pass (28 bytes per
 * element with a bf16 gradient). The arithmetic is torch's fused AdamW, in the same order:
 *
 *   g  = grad / grad_scale
 *   p  = p - lr * wd * p                      (decoupled weight decay)
 *   m  = m + (1 - beta1) * (g - m)            (lerp with weight < 0.5)
 *   v  = beta2 * v + (1 - beta2) * g * g
 *   p  = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
 *
 * with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) per piece (each
 * parameter keeps its own step count, as torch's optimizer does). bf16 rounding is
 * round-to-nearest-even, NaN kept NaN. Built without -ffast-math and with
 * -ffp-contract=off, so no reassociation and no fused multiply-adds change the result;
 * -fno-math-errno only drops sqrtf's errno write, which is what lets the loops vectorize.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)((nan ? (u | 0x00400000u) : rounded) >> 16);
}

static inline float adamw_one(float *p, float *m, float *v, float g, float decay, float b1,
                              float b2, float step_size, float bc2_sqrt, float eps) {
    float x = p[0] - decay * p[0];
    float mi = m[0] + (1.0f - b1) * (g - m[0]);
    float vi = b2 * v[0] + (1.0f - b2) * g * g;
    x = x - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    m[0] = mi;
    v[0] = vi;
    p[0] = x;
    return x;
}

/* One loop per (gradient type, with or without out): no branch inside, so it vectorizes. */
#define ADAMW_LOOP(LOAD_GRAD, STORE_OUT)                                                  \
    for (int64_t k = 0; k < pieces; ++k) {                                                \
        const float d = decay[k], s = step_size[k], c = bc2_sqrt[k];                      \
        _Pragma("omp for schedule(static)")                                               \
        for (int64_t i = starts[k]; i < ends[k]; ++i) {                                   \
            float g = (LOAD_GRAD) / grad_scale;                                           \
            float x = adamw_one(p + i, m + i, v + i, g, d, beta1, beta2, s, c, eps);      \
            STORE_OUT;                                                                    \
        }                                                                                 \
    }

/* Pieces [starts[k], ends[k]) of the flat state, each with its own decay (= lr * weight
 * decay), step size and bias correction. out (bf16 parameters) may be NULL. */
void megazoo_adamw(float *p, float *m, float *v, const void *grad, int grad_is_bf16,
                   uint16_t *out, int64_t pieces, const int64_t *starts, const int64_t *ends,
                   const float *decay, const float *step_size, const float *bc2_sqrt,
                   float beta1, float beta2, float eps, float grad_scale, int threads) {
    const uint16_t *g16 = (const uint16_t *)grad;
    const float *g32 = (const float *)grad;
    #pragma omp parallel num_threads(threads)
    {
        if (grad_is_bf16 && out) {
            ADAMW_LOOP(bf16_to_float(g16[i]), out[i] = float_to_bf16(x))
        } else if (grad_is_bf16) {
            ADAMW_LOOP(bf16_to_float(g16[i]), (void)x)
        } else if (out) {
            ADAMW_LOOP(g32[i], out[i] = float_to_bf16(x))
        } else {
            ADAMW_LOOP(g32[i], (void)x)
        }
    }
}
