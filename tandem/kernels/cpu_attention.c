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

/* q_i . k for D elements of the 16-bit key k, q fp32: LANES partial sums in order, then a tree. */
static inline float dot_half(const float *restrict q, const uint16_t *restrict k, int64_t D, const int kind) {
    float part[LANES] = {0};
    const int64_t body = D - D % LANES;
    for (int64_t d = 0; d < body; d += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += q[d + l] * from_half(k[d + l], kind);
    for (int64_t d = body; d < D; d++)
        part[d - body] += q[d] * from_half(k[d], kind);
    for (int width = LANES / 2; width > 0; width >>= 1)
        for (int l = 0; l < width; l++)
            part[l] += part[l + width];
    return part[0];
}

/* acc[0:D] += p * v[0:D] (v 16-bit). */
static inline void axpy_half(float *restrict acc, float p, const uint16_t *restrict v, int64_t D, const int kind) {
    for (int64_t d = 0; d < D; d++)
        acc[d] += p * from_half(v[d], kind);
}

/* One row and one KV head: the rep query heads q [rep, D] (16-bit, heads D apart) against the L
 * keys at slots, into out [rep, D]. work: rep * (L + 2 D) floats. */
static inline __attribute__((always_inline)) void attend_head(
    const uint16_t *q, uint16_t *out, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
    int64_t L, int64_t rep, int64_t Hkv, int64_t hk, int64_t D, float scale, float *work, const int kind)
{
    float *scores = work, *qf = work + rep * L, *acc = qf + rep * D;
    for (int64_t i = 0; i < rep * D; i++) {
        qf[i] = from_half(q[i], kind);
        acc[i] = 0.0f;
    }
    for (int64_t j = 0; j < L; j++) {
        const uint16_t *k = k_cache + (slots[j] * Hkv + hk) * D;
        for (int64_t i = 0; i < rep; i++)
            scores[i * L + j] = dot_half(qf + i * D, k, D, kind) * scale;
    }
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
        for (int64_t j = 0; j < L; j++)
            axpy_half(acc + i * D, s[j], v_cache + (slots[j] * Hkv + hk) * D, D, kind);
        for (int64_t d = 0; d < D; d++)
            out[i * D + d] = to_half(acc[i * D + d] / sum, kind);
    }
}

static inline __attribute__((always_inline)) int attend_rows(
    const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *row_token, const int64_t *row_slot_start, const int64_t *row_len, const int64_t *slots,
    int64_t rows, int64_t H, int64_t Hkv, int64_t D, float scale, int num_threads, const int kind)
{
    const int64_t rep = H / Hkv;
    int64_t max_len = 0;
    for (int64_t r = 0; r < rows; r++)
        max_len = row_len[r] > max_len ? row_len[r] : max_len;
    const int64_t work_floats = rep * (max_len + 2 * D);
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
 * Returns 0, or -1 where a work buffer could not be allocated. */
int tandem_paged_attention(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k_new, int64_t k_stride,
                           const uint16_t *v_new, int64_t v_stride, const int64_t *slot_mapping, int64_t num_tokens,
                           uint16_t *k_cache, uint16_t *v_cache, const int64_t *row_token,
                           const int64_t *row_slot_start, const int64_t *row_len, const int64_t *slots, int64_t rows,
                           int64_t H, int64_t Hkv, int64_t D, float scale, int kind, int num_threads)
{
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slot_mapping[t] * Hkv * D, k_new + t * k_stride, (size_t)(Hkv * D) * sizeof(uint16_t));
        memcpy(v_cache + slot_mapping[t] * Hkv * D, v_new + t * v_stride, (size_t)(Hkv * D) * sizeof(uint16_t));
    }
    if (kind == H_BF16)
        return attend_rows(q, q_stride, out, k_cache, v_cache, row_token, row_slot_start, row_len, slots, rows, H,
                           Hkv, D, scale, num_threads, H_BF16);
    return attend_rows(q, q_stride, out, k_cache, v_cache, row_token, row_slot_start, row_len, slots, rows, H, Hkv,
                       D, scale, num_threads, H_F16);
}
