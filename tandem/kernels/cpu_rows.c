/* The small per-row ops of a CPU forward: RMSNorm (with the residual add), rotary embedding
 * and SiLU-and-mul, on bf16 or fp16 rows.
 *
 * Their arithmetic is tiny; what they replace is cost per call: each is 3-20 PyTorch ops at
 * 3-50 us of dispatch apiece on the 2-core dev machine, against one call here. Each op rounds
 * where the PyTorch path (tandem/layers/norm.py, rotary.py, decoder.MLP) rounds, so the results
 * agree bit for bit but for two orderings: RMSNorm sums the squares in its own order (16 lane
 * sums, then a tree), and SiLU's exp is our polynomial (within an ulp or two of fp32, as
 * PyTorch's vectorized one is), so a rounded result can move by a unit in the last place. Rows
 * are independent, and every element of a row is computed the same way wherever it falls in
 * it: a row's result does not depend on the rows beside it, so a verified token sees what a
 * decoded one would.
 *
 * The element kind is a constant inside each loop (ROWS_BY_KIND), so the compiler vectorizes the
 * bf16 loops; fp16 goes through F16C one element at a time. Rows are split across an OpenMP team
 * (the caller's size, the runtime PyTorch loaded) only when there are enough elements to pay for
 * it (prefill); a decode step's few rows run on the calling thread.
 */
#include "cpu_common.h"

#define PARALLEL_MIN_ELEMS 65536
#define SILU_PARALLEL_MIN_ELEMS 4096
#define SILU_BLOCK 1024
#define LANES 16

/* Calls NAME##_rows(args..., kind) with kind a literal, so each kind gets its own loops. */
#define ROWS_BY_KIND(NAME, kind, ...)            \
    do {                                         \
        if ((kind) == H_BF16)                    \
            NAME##_rows(__VA_ARGS__, H_BF16);    \
        else                                     \
            NAME##_rows(__VA_ARGS__, H_F16);     \
    } while (0)

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Out-of-line loops: GCC 12 vectorizes a row loop as its own function, not inlined into the
 * loops over rows and heads; each kind gets its own copy (a literal kind inside). */
#define OUT_OF_LINE static __attribute__((noinline))

/* ---- RMSNorm ---- */

/* out = round(w * round(s * 1 / sqrt(mean(s^2) + eps))) for one row s of dim elements. */
ALWAYS_INLINE void norm_row(const uint16_t *s, const uint16_t *w, uint16_t *out, int64_t dim, float eps,
                            const int kind) {
    float part[LANES] = {0};
    const int64_t body = dim - dim % LANES;
    for (int64_t d = 0; d < body; d += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = from_half(s[d + l], kind);
            part[l] += v * v;
        }
    for (int64_t d = body; d < dim; d++) {
        const float v = from_half(s[d], kind);
        part[d - body] += v * v;
    }
    for (int width = LANES / 2; width > 0; width >>= 1)
        for (int l = 0; l < width; l++)
            part[l] += part[l + width];
    const float inv = 1.0f / sqrtf(part[0] / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++)
        out[d] = to_half(from_half(w[d], kind) * round_half(from_half(s[d], kind) * inv, kind), kind);
}

ALWAYS_INLINE void rms_norm_rows(const uint16_t *x, int64_t x_stride, uint16_t *residual, int64_t r_stride,
                                 const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim, float eps,
                                 int num_threads, const int kind) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *s = x + r * x_stride;
        if (residual) {
            uint16_t *res = residual + r * r_stride;
            for (int64_t d = 0; d < dim; d++)
                res[d] = to_half(from_half(res[d], kind) + from_half(s[d], kind), kind);
            s = res;
        }
        norm_row(s, w, out + r * dim, dim, eps, kind);
    }
}

/* out [rows, dim] contiguous = RMSNorm of x's rows (row stride x_stride). With residual (row
 * stride r_stride): residual = round(residual + x) first, in place, and the norm is of that. */
void tandem_rms_norm(const uint16_t *x, int64_t x_stride, uint16_t *residual, int64_t r_stride,
                     const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim, float eps, int kind,
                     int num_threads)
{
    ROWS_BY_KIND(rms_norm, kind, x, x_stride, residual, r_stride, w, out, rows, dim, eps, num_threads);
}

/* ---- rotary embedding ---- */

/* Rotate-half rotary embedding of one head in place: with c, s the position's cos / sin rows
 * (fp32, rounded to the 16-bit kind as PyTorch's .to(dtype) does),
 * x = round(round(x * c) + round(rotate_half(x) * s)), rotate_half(x) = [-x2, x1]. */
ALWAYS_INLINE void rotate_head(uint16_t *x, const float *restrict c, const float *restrict s, int64_t half,
                               const int kind) {
    uint16_t *restrict x1 = x, *restrict x2 = x + half; /* the two halves do not overlap */
    for (int64_t i = 0; i < half; i++) {
        const float a = from_half(x1[i], kind), b = from_half(x2[i], kind);
        const float c1 = round_half(c[i], kind), c2 = round_half(c[i + half], kind);
        const float s1 = round_half(s[i], kind), s2 = round_half(s[i + half], kind);
        x1[i] = to_half(round_half(a * c1, kind) + round_half(-b * s1, kind), kind);
        x2[i] = to_half(round_half(b * c2, kind) + round_half(a * s2, kind), kind);
    }
}

OUT_OF_LINE void rotate_head_bf16(uint16_t *x, const float *c, const float *s, int64_t half) {
    rotate_head(x, c, s, half, H_BF16);
}

OUT_OF_LINE void rotate_head_f16(uint16_t *x, const float *c, const float *s, int64_t half) {
    rotate_head(x, c, s, half, H_F16);
}

ALWAYS_INLINE void rotary_rows(uint16_t *q, int64_t q_stride, int64_t num_q_heads, uint16_t *k,
                               int64_t k_stride, int64_t num_k_heads, int64_t head_dim, const int64_t *positions,
                               const float *cos, const float *sin, int64_t rows, int num_threads, const int kind) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) \
        if (rows * (num_q_heads + num_k_heads) * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        void (*rotate)(uint16_t *, const float *, const float *, int64_t) =
            kind == H_BF16 ? rotate_head_bf16 : rotate_head_f16;
        for (int64_t h = 0; h < num_q_heads; h++)
            rotate(q + r * q_stride + h * head_dim, c, s, half);
        for (int64_t h = 0; h < num_k_heads; h++)
            rotate(k + r * k_stride + h * head_dim, c, s, half);
    }
}

/* q [rows, num_q_heads, head_dim] and k [rows, num_k_heads, head_dim], heads contiguous within
 * a row, rows at q_stride / k_stride elements (views of one qkv buffer): rotated in place by
 * the tables' rows cos / sin [max_positions, head_dim] at positions [rows]. */
void tandem_rotary(uint16_t *q, int64_t q_stride, int64_t num_q_heads, uint16_t *k, int64_t k_stride,
                   int64_t num_k_heads, int64_t head_dim, const int64_t *positions, const float *cos,
                   const float *sin, int64_t rows, int kind, int num_threads)
{
    ROWS_BY_KIND(rotary, kind, q, q_stride, num_q_heads, k, k_stride, num_k_heads, head_dim, positions, cos, sin,
                 rows, num_threads);
}

/* ---- SiLU-and-mul ---- */

ALWAYS_INLINE void silu_mul_row(const uint16_t *restrict g, const uint16_t *restrict u, uint16_t *restrict o,
                                int64_t inter, const int kind) {
    for (int64_t i = 0; i < inter; i++) {
        const float x = from_half(g[i], kind);
        o[i] = to_half(round_half(x / (1.0f + exp_poly(-x)), kind) * from_half(u[i], kind), kind);
    }
}

OUT_OF_LINE void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    silu_mul_row(g, u, o, inter, H_BF16);
}

OUT_OF_LINE void silu_mul_row_f16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t inter) {
    silu_mul_row(g, u, o, inter, H_F16);
}

ALWAYS_INLINE void silu_mul_rows(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t rows, int64_t inter,
                                 int num_threads, const int kind) {
    /* Elementwise and costly (an exp and a division an element): split into blocks of a row,
     * so even one decode row's 5-20 K elements spread over the team. */
    const int64_t blocks_per_row = (inter + SILU_BLOCK - 1) / SILU_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= SILU_PARALLEL_MIN_ELEMS)
    for (int64_t b = 0; b < rows * blocks_per_row; b++) {
        const int64_t r = b / blocks_per_row, i0 = b % blocks_per_row * SILU_BLOCK;
        const int64_t n = inter - i0 < SILU_BLOCK ? inter - i0 : SILU_BLOCK;
        const uint16_t *g = gu + r * gu_stride + i0, *u = gu + r * gu_stride + inter + i0;
        (kind == H_BF16 ? silu_mul_row_bf16 : silu_mul_row_f16)(g, u, out + r * inter + i0, n);
    }
}

/* out [rows, inter] contiguous = round(round(silu(gate)) * up) for gate_up rows [gate | up] of
 * 2 * inter (row stride gu_stride); silu(g) = g / (1 + e^-g) in fp32, as PyTorch computes it. */
void tandem_silu_mul(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t rows, int64_t inter,
                     int kind, int num_threads)
{
    ROWS_BY_KIND(silu_mul, kind, gu, gu_stride, out, rows, inter, num_threads);
}
