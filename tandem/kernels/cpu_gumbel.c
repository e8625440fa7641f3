/* The uniforms of seeded Gumbel-max sampling (tandem/sampling/gumbel.py) for whole rows of the
 * vocabulary: u[r, v] = uniform(keys[r], v), the 32-bit murmur3 finaliser of the row's key
 * mixed with the token id, its top 23 bits + 0.5 scaled by 2^-23.
 *
 * Bit for bit the reference's: it is integer arithmetic (the reference emulates these uint32
 * wrap-around multiplications in int64 tensors, ~20 passes over [rows, vocab] temporaries:
 * 3.6 ms a row of Qwen's 151936 tokens on the 2-core dev machine) and a conversion that is exact
 * (a 23-bit integer, + 0.5, times a power of two). The logs of g = -log(-log u) stay PyTorch's
 * (the caller's), so the noise keeps the reference's bits too.
 */
#include "cpu_common.h"

#define UNIFORM_CHUNK 16384            /* tokens a task of the OpenMP team */
#define UNIFORM_PARALLEL_MIN 65536     /* elements below which one thread does all */

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

/* out [rows, vocab] fp32 (contiguous) = uniform(keys[r], v) for every token v; keys [rows] int64
 * in [0, 2^32) (noise_key's). */
void tandem_uniform_rows(const int64_t *keys, int64_t rows, int64_t vocab, float *out, int num_threads) {
    const int64_t chunks = (vocab + UNIFORM_CHUNK - 1) / UNIFORM_CHUNK;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * vocab >= UNIFORM_PARALLEL_MIN)
    for (int64_t task = 0; task < rows * chunks; task++) {
        const int64_t r = task / chunks, start = (task % chunks) * UNIFORM_CHUNK;
        const int64_t end = start + UNIFORM_CHUNK < vocab ? start + UNIFORM_CHUNK : vocab;
        const uint32_t key = (uint32_t)keys[r];
        float *o = out + r * vocab;
        for (int64_t v = start; v < end; v++) {
            const uint32_t h = fmix32(key ^ ((uint32_t)v * 0x27D4EB2Du));
            o[v] = ((float)(int32_t)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
        }
    }
}
