/* Inline helpers shared by tandem's CPU kernels (cpu_gemm.c, cpu_rows.c, cpu_attention.c):
 * 16-bit floats <-> fp32 (bf16 by shifts, fp16 by F16C; both round to nearest even, as
 * PyTorch's casts do) and a branch-free fp32 exp. */
#ifndef TANDEM_CPU_COMMON_H
#define TANDEM_CPU_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { H_BF16 = 0, H_F16 = 1 }; /* the 16-bit kind codes the Python side passes */

static inline float from_half(uint16_t h, int kind) {
    if (kind == H_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return _cvtsh_ss(h);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, NaN kept quiet; no branch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline uint16_t to_half(float f, int kind) {
    return kind == H_BF16 ? to_bf16(f) : (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* f rounded to the 16-bit kind and widened back: one of PyTorch's bf16 / fp16 op results. */
static inline float round_half(float f, int kind) {
    return from_half(to_half(f, kind), kind);
}

/* e^v in fp32 without branches (so loops of it vectorize): v = n ln2 + r with n = rint(v / ln2),
 * e^r by Cephes' degree-6 polynomial, times 2^n as two exact powers of two (n reaches 128 just
 * below the overflow at 88.72, past which the product is +inf). Below -87.3, ~1.2e-38 instead of
 * a subnormal or 0: 1 + that is 1 (what silu needs), and a softmax weight that small is 0 to fp32
 * sums. NaN gives NaN. */
static inline float exp_poly(float v) {
    v = v > 89.0f ? 89.0f : v;
    v = v < -87.33654f ? -87.33654f : v;
    float n = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    n = n == n ? n : 0.0f;                                           /* NaN: keep the cast defined */
    const float r = (v - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = (p * (r * r) + r) + 1.0f;
    const int32_t half_n = (int32_t)n / 2;
    const uint32_t bits1 = (uint32_t)((int32_t)n - half_n + 127) << 23, bits2 = (uint32_t)(half_n + 127) << 23;
    float scale1, scale2;
    memcpy(&scale1, &bits1, sizeof scale1);
    memcpy(&scale2, &bits2, sizeof scale2);
    return (y * scale1) * scale2;
}

#endif
