/* Paged attention on the CPU for every query token of a step, one row at a time, with the
 * step's K/V stored first: the CPU form of tandem/layers/attention.py's reference.
 *
 * A row is one query token: its position in q, and its visible keys, the first row_len[r] of
 * its slot list (slots + row_slot_start[r]). Decodes, verifications, the draft's catch-up and
 * prompts all take this one form (the metadata builds the rows once per step; see
 * tandem/kernels/cpu_attention.py). Each (row, KV head) is computed alone, in fp32: the scores
 * q.k * scale, their max, e^(s - max) and its sum, the V rows weighted in key order, one
 * division and one rounding. So a token's output never depends on the rows beside it (a
 * verified token sees what a decoded one would), and GQA reads each key once for the
 * num_heads / num_kv_heads query heads that share it.
 */
#include <stdlib.h>

#include "cpu_common.h"

#define LANES 16

/* Sixteen fp32 lanes: one AVX-512 register, or two AVX2 ones. GCC did not vectorize the scalar
 * form of the dot product below (16 partial sums in an array), which ran the whole kernel at ~2
 * GMAC/s; these run the same operations in the same order (a product rounded, then added: the
 * build contracts nothing), so the results are the scalar form's, bit for bit. */
#ifdef TANDEM_AVX512
typedef __m512 lanes;
static inline lanes lanes_zero(void) { return _mm512_setzero_ps(); }
static inline lanes lanes_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void lanes_store(float *p, lanes a) { _mm512_storeu_ps(p, a); }
static inline lanes lanes_set1(float x) { return _mm512_set1_ps(x); }
static inline lanes lanes_muladd(lanes acc, lanes a, lanes b) { return _mm512_add_ps(acc, _mm512_mul_ps(a, b)); }
static inline __m256 lanes_fold(lanes a) {  /* lane l + lane l + 8, for l < 8 */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline lanes lanes_half(const uint16_t *p, const int kind) {  /* 16 bf16 / fp16 values, widened */
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kind == H_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#else
typedef struct { __m256 lo, hi; } lanes;
static inline lanes lanes_zero(void) { return (lanes){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline lanes lanes_load(const float *p) { return (lanes){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void lanes_store(float *p, lanes a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline lanes lanes_set1(float x) { return (lanes){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline lanes lanes_muladd(lanes acc, lanes a, lanes b) {
    return (lanes){_mm256_add_ps(acc.lo, _mm256_mul_ps(a.lo, b.lo)), _mm256_add_ps(acc.hi, _mm256_mul_ps(a.hi, b.hi))};
}
static inline __m256 lanes_fold(lanes a) { return _mm256_add_ps(a.lo, a.hi); }
static inline __m256 half8(const uint16_t *p, const int kind) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == H_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
static inline lanes lanes_half(const uint16_t *p, const int kind) { return (lanes){half8(p, kind), half8(p + 8, kind)}; }
#endif

/* The sum of 16 lanes as a tree: l + (l + 8), then + 4, + 2, + 1. */
static inline float lanes_sum(lanes a) {
    const __m256 s8 = lanes_fold(a);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* q . k for D elements of the 16-bit key k, q fp32: lane l sums the products of elements
 * d = l (mod 16) in order (a tail past the last 16 into lanes 0, 1, ...), then the tree. */
static inline float dot_half(const float *restrict q, const uint16_t *restrict k, int64_t D, const int kind) {
    lanes part = lanes_zero();
    const int64_t body = D - D % LANES;
    for (int64_t d = 0; d < body; d += LANES)
        part = lanes_muladd(part, lanes_load(q + d), lanes_half(k + d, kind));
    if (body < D) {
        float tail[LANES];
        lanes_store(tail, part);
        for (int64_t d = body; d < D; d++)
            tail[d - body] += q[d] * from_half(k[d], kind);
        part = lanes_load(tail);
    }
    return lanes_sum(part);
}

/* q . k for D elements of fp32 rows (an fp8 cache's key, widened): dot_half's lanes and tree. */
static inline float dot_f32(const float *restrict q, const float *restrict k, int64_t D) {
    lanes part = lanes_zero();
    const int64_t body = D - D % LANES;
    for (int64_t d = 0; d < body; d += LANES)
        part = lanes_muladd(part, lanes_load(q + d), lanes_load(k + d));
    if (body < D) {
        float tail[LANES];
        lanes_store(tail, part);
        for (int64_t d = body; d < D; d++)
            tail[d - body] += q[d] * k[d];
        part = lanes_load(tail);
    }
    return lanes_sum(part);
}

/* D bytes of an fp8 (e4m3) cache row as fp32, through lut: the 256 byte values' exact widths. */
static inline void widen_fp8(float *restrict dst, const uint8_t *restrict src, int64_t D, const float *restrict lut) {
    for (int64_t d = 0; d < D; d++)
        dst[d] = lut[src[d]];
}

/* The rep rows of scores [rep, L] in place -> e^(s - max) each, their sums into sums [rep]. */
static inline void softmax_rows(float *scores, int64_t rep, int64_t L, float *sums) {
    for (int64_t i = 0; i < rep; i++) {
        float *s = scores + i * L;
        float m = -INFINITY;
        for (int64_t j = 0; j < L; j++)
            m = s[j] > m ? s[j] : m;
        float sum = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            s[j] = exp_poly(s[j] - m);
            sum += s[j];
        }
        sums[i] = sum;
    }
}

/* The weighted sum of the values, PV_HEADS query heads x PV_VECS * 16 columns at a time with the
 * sums in registers (AVX2 has half the registers of AVX-512, and each `lanes` takes two):
 * acc[h, d] = sum over the keys j, in order, of p[h, j] * v_j[d] (each product rounded, then
 * added). Each V row is widened once for the heads of a tile. */
#ifdef TANDEM_AVX512
#define PV_HEADS 2
#define PV_VECS 8
#else
#define PV_HEADS 1
#define PV_VECS 4
#endif

/* acc[(i0 + h) * D + d0 + c * 16 + l] for h < nh, c < nv (nh, nv constants after inlining). */
static inline __attribute__((always_inline)) void pv_tile(
    float *acc, const float *p, const uint16_t *v_cache, const int64_t *slots, int64_t L, int64_t Hkv, int64_t hk,
    int64_t D, int64_t d0, int64_t i0, const int nh, const int nv, const int kind)
{
    lanes sum[PV_HEADS][PV_VECS];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++)
            sum[h][c] = lanes_zero();
    for (int64_t j = 0; j < L; j++) {
        const uint16_t *v = v_cache + (slots[j] * Hkv + hk) * D + d0;
        lanes w[PV_HEADS];
        for (int h = 0; h < nh; h++)
            w[h] = lanes_set1(p[(i0 + h) * L + j]);
        for (int c = 0; c < nv; c++) {
            const lanes x = lanes_half(v + c * LANES, kind);
            for (int h = 0; h < nh; h++)
                sum[h][c] = lanes_muladd(sum[h][c], w[h], x);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nv; c++)
            lanes_store(acc + (i0 + h) * D + d0 + c * LANES, sum[h][c]);
}

#define PV_CASE(NH, NV)                                                                                \
    case (NH) * 16 + (NV):                                                                             \
        if ((NH) <= PV_HEADS && (NV) <= PV_VECS)                                                       \
            pv_tile(acc, p, v_cache, slots, L, Hkv, hk, D, d0, i0, NH, NV, kind);                      \
        break;
#define PV_CASES(NH) PV_CASE(NH, 1) PV_CASE(NH, 2) PV_CASE(NH, 3) PV_CASE(NH, 4) PV_CASE(NH, 5) PV_CASE(NH, 6) \
    PV_CASE(NH, 7) PV_CASE(NH, 8)

/* acc [rep, D] = p [rep, L] times the L value rows at slots (heads of KV head hk). */
static inline __attribute__((always_inline)) void weigh_values(
    float *acc, const float *p, const uint16_t *v_cache, const int64_t *slots, int64_t L, int64_t rep, int64_t Hkv,
    int64_t hk, int64_t D, const int kind)
{
    const int64_t body = D - D % LANES;
    for (int64_t d0 = 0; d0 < body; d0 += PV_VECS * LANES) {
        const int nv = (int)(body - d0 < PV_VECS * LANES ? (body - d0) / LANES : PV_VECS);
        for (int64_t i0 = 0; i0 < rep; i0 += PV_HEADS) {
            const int nh = (int)(rep - i0 < PV_HEADS ? rep - i0 : PV_HEADS);
            switch (nh * 16 + nv) {
                PV_CASES(1) PV_CASES(2)
                default: break;
            }
        }
    }
    for (int64_t i = 0; i < rep; i++)  /* columns past the last 16, one at a time */
        for (int64_t d = body; d < D; d++) {
            float a = 0.0f;
            for (int64_t j = 0; j < L; j++)
                a += p[i * L + j] * from_half(v_cache[(slots[j] * Hkv + hk) * D + d], kind);
            acc[i * D + d] = a;
        }
}

/* One row and one KV head: the rep query heads q [rep, D] (16-bit, heads D apart) against the L
 * keys at slots, into out [rep, D]. work: rep * (L + 2 D) floats. */
static inline __attribute__((always_inline)) void attend_head(
    const uint16_t *q, uint16_t *out, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
    int64_t L, int64_t rep, int64_t Hkv, int64_t hk, int64_t D, float scale, float *work, const int kind)
{
    float *scores = work, *qf = work + rep * L, *acc = qf + rep * D;
    for (int64_t i = 0; i < rep * D; i++)
        qf[i] = from_half(q[i], kind);
    for (int64_t j = 0; j < L; j++) {
        const uint16_t *k = k_cache + (slots[j] * Hkv + hk) * D;
        for (int64_t i = 0; i < rep; i++)
            scores[i * L + j] = dot_half(qf + i * D, k, D, kind) * scale;
    }
    float sums[rep];
    softmax_rows(scores, rep, L, sums);
    weigh_values(acc, scores, v_cache, slots, L, rep, Hkv, hk, D, kind);
    for (int64_t i = 0; i < rep; i++)
        for (int64_t d = 0; d < D; d++)
            out[i * D + d] = to_half(acc[i * D + d] / sums[i], kind);
}

/* attend_head over an fp8 (e4m3) cache: each key and value row widened through lut (exact) into
 * row, then the same fp32 arithmetic, the values summed in key order (a product rounded, then
 * added). work: rep * (L + 2 D) + D floats. */
static inline __attribute__((always_inline)) void attend_head_fp8(
    const uint16_t *q, uint16_t *out, const uint8_t *k_cache, const uint8_t *v_cache, const int64_t *slots,
    int64_t L, int64_t rep, int64_t Hkv, int64_t hk, int64_t D, float scale, float *work, const float *lut,
    const int kind)
{
    float *scores = work, *qf = work + rep * L, *acc = qf + rep * D, *row = acc + rep * D;
    for (int64_t i = 0; i < rep * D; i++) {
        qf[i] = from_half(q[i], kind);
        acc[i] = 0.0f;
    }
    for (int64_t j = 0; j < L; j++) {
        widen_fp8(row, k_cache + (slots[j] * Hkv + hk) * D, D, lut);
        for (int64_t i = 0; i < rep; i++)
            scores[i * L + j] = dot_f32(qf + i * D, row, D) * scale;
    }
    float sums[rep];
    softmax_rows(scores, rep, L, sums);
    for (int64_t j = 0; j < L; j++) {
        widen_fp8(row, v_cache + (slots[j] * Hkv + hk) * D, D, lut);
        for (int64_t i = 0; i < rep; i++) {
            const float w = scores[i * L + j];
            float *a = acc + i * D;
            for (int64_t d = 0; d < D; d++)
                a[d] += w * row[d];
        }
    }
    for (int64_t i = 0; i < rep; i++)
        for (int64_t d = 0; d < D; d++)
            out[i * D + d] = to_half(acc[i * D + d] / sums[i], kind);
}

static inline __attribute__((always_inline)) int attend_rows(
    const uint16_t *q, int64_t q_stride, uint16_t *out, const void *k_cache, const void *v_cache,
    const int64_t *row_token, const int64_t *row_slot_start, const int64_t *row_len, const int64_t *slots,
    int64_t rows, int64_t H, int64_t Hkv, int64_t D, float scale, int num_threads, const float *fp8_lut,
    const int kind)
{
    const int64_t rep = H / Hkv;
    int64_t max_len = 0;
    for (int64_t r = 0; r < rows; r++)
        max_len = row_len[r] > max_len ? row_len[r] : max_len;
    const int64_t work_floats = rep * (max_len + 2 * D) + D;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) if (rows * max_len * H * D >= 65536)
    {
        float *work = malloc((size_t)work_floats * sizeof(float));
        if (!work) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * Hkv; task++) {
            if (!work)
                continue;
            const int64_t r = task / Hkv, hk = task % Hkv, t = row_token[r];
            if (fp8_lut)
                attend_head_fp8(q + t * q_stride + hk * rep * D, out + (t * H + hk * rep) * D, k_cache, v_cache,
                                slots + row_slot_start[r], row_len[r], rep, Hkv, hk, D, scale, work, fp8_lut, kind);
            else
                attend_head(q + t * q_stride + hk * rep * D, out + (t * H + hk * rep) * D, k_cache, v_cache,
                            slots + row_slot_start[r], row_len[r], rep, Hkv, hk, D, scale, work, kind);
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* Store the step's K/V rows (k_new, v_new [num_tokens, Hkv, D], rows at k_stride / v_stride) at
 * slot_mapping [num_tokens] in the caches [num_slots, Hkv, D], then attend every row: out [T, H, D]
 * contiguous gets row r's output at token row_token[r]; q rows [T, H, D] at q_stride, heads D apart.
 * fp8_lut (NULL: 16-bit caches of q's kind): the caches hold fp8 (e4m3) bytes, read through this
 * table of the 256 values; the caller has stored the step's rows (num_tokens 0: nothing to copy).
 * Returns 0, or -1 where a work buffer could not be allocated. */
int tandem_paged_attention(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k_new, int64_t k_stride,
                           const uint16_t *v_new, int64_t v_stride, const int64_t *slot_mapping, int64_t num_tokens,
                           void *k_cache, void *v_cache, const int64_t *row_token,
                           const int64_t *row_slot_start, const int64_t *row_len, const int64_t *slots, int64_t rows,
                           int64_t H, int64_t Hkv, int64_t D, float scale, int kind, int num_threads,
                           const float *fp8_lut)
{
    for (int64_t t = 0; t < num_tokens && !fp8_lut; t++) {
        memcpy((uint16_t *)k_cache + slot_mapping[t] * Hkv * D, k_new + t * k_stride, (size_t)(Hkv * D) * sizeof(uint16_t));
        memcpy((uint16_t *)v_cache + slot_mapping[t] * Hkv * D, v_new + t * v_stride, (size_t)(Hkv * D) * sizeof(uint16_t));
    }
    if (kind == H_BF16)
        return attend_rows(q, q_stride, out, k_cache, v_cache, row_token, row_slot_start, row_len, slots, rows, H,
                           Hkv, D, scale, num_threads, fp8_lut, H_BF16);
    return attend_rows(q, q_stride, out, k_cache, v_cache, row_token, row_slot_start, row_len, slots, rows, H, Hkv,
                       D, scale, num_threads, fp8_lut, H_F16);
}
