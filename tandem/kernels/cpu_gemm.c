/* Small-batch GEMM with 16-bit (or fp8) weights for x86-64 CPUs: y = x W^T (+ b).
 *
 * x is fp32, bf16 or fp16 [M, K] (widened to fp32 first), W is bf16 or fp16 [N, K] exactly as
 * the checkpoint stores it (no packing, so loading a model costs nothing here), b is fp32 [N] or
 * NULL, y is fp32, bf16 or fp16 [M, N].
 * Decoding and verification are bound by reading W: each weight is read from memory once per
 * panel of up to PANEL_M rows and widened to fp32 in registers (bf16: a 16-bit shift; fp16: F16C),
 * so 1 + k rows cost about what one row costs.
 *
 * Builds of this file: AVX2 + FMA + F16C (8-lane vectors); with TANDEM_AVX512 defined, AVX-512
 * (16 lanes: half the FMA instructions, which prefill is bound by); and the BF16 one below. The
 * Python side loads the best one the CPU runs.
 *
 * Every output element is computed the same way whatever M is and wherever its row falls in a
 * tile: one VL-lane fp32 accumulator over the CHUNK-column chunks in order (two FMAs per chunk),
 * a fixed horizontal sum, the scalar tail k >= K - K % CHUNK in order, then the bias, then one
 * rounding. A row's result is therefore bit-identical whether it is multiplied alone (a decode
 * step) or among others (verification, prefill). (The builds sum in different orders, so their
 * results differ in the last bits; a model runs one build.)
 *
 * A third build, TANDEM_AVX512BF16 (AVX-512 with the BF16 extension): bf16 weights against rows that
 * arrive in bf16 (a bf16 model's activations) take VDPBF16PS instead: 32 exact products of bf16
 * pairs an instruction, added into the 16 fp32 lanes two at a time (denormal inputs and results
 * flushed to zero, as the instruction does), twice the multiply-adds an instruction of the widened
 * path. Same tiles, same order for every M, so rows stay bit-identical across batches; the sums
 * differ from the other builds' in the last bits. Prefill (many rows: bound by the multiply-adds)
 * runs ~1.5x faster; decode and verification (bound by the weights' bytes) alike.
 *
 * fp8 weights (tandem_gemm_w8, every build): W is float8 e4m3 [N, K] with an fp32 scale
 * per row (tandem/layers/quant.py, the fp8 target and draft). Each byte becomes an fp16 by shifts
 * (sign to bit 15, exponent and mantissa to bits 13..7: the e4m3 value over 2^8, exactly,
 * subnormals included) and F16C widens it; a row's sum is multiplied by its scale times 2^8 (a
 * power of two: exact) before the bias. Half the bytes of a bf16 weight, the same FMAs. In the
 * BF16 build, bf16 rows against fp8 weights take VDPBF16PS too: 32 bytes become 32 bf16 values
 * (exact: bf16 holds every e4m3 value over 2^8 as a normal number) and one instruction multiplies
 * them by a row, half the arithmetic instructions of the widened path, which several rows are bound
 * by (4 rows of the 1.5B's gate_up 1.83 -> 1.16 ms; 1 row 1.01 -> 0.85).
 *
 * Threads: output rows are split into contiguous blocks across an OpenMP team of the size the
 * caller passes (torch.get_num_threads()); the runtime is the libgomp.so.1 PyTorch has already
 * loaded, so both share one pool of threads.
 */
#include "cpu_common.h"

enum { W_BF16 = H_BF16, W_F16 = H_F16, W_E4M3 = 2,
       W_BF16_DP = 3, W_E4M3_DP = 4 /* bf16 / e4m3 weights x bf16 rows by VDPBF16PS */ };
enum { Y_F32 = 0, Y_BF16 = 1, Y_F16 = 2 };
enum { X_F32 = Y_F32, X_BF16 = Y_BF16, X_F16 = Y_F16 }; /* the kinds x may arrive in */

#ifdef TANDEM_AVX512
#define VL 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vloadu(p) _mm512_loadu_ps(p)
#define vfmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#else
#define VL 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vloadu(p) _mm256_loadu_ps(p)
#define vfmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif
#define CHUNK (2 * VL) /* weights a row contributes per step: two vectors */

/* Tiles: weight rows x input rows. Up to SMALL_TILE_M rows (1 + k verification rows for
 * k <= 5) run in one pass; more rows (prefill) in panels of PANEL_M rows with wider tiles.
 * One and two rows get taller tiles: each accumulator takes two dependent FMAs per chunk
 * (8 cycles of latency), so a 2 x 1 tile could not keep the FMA units busy and a decode step
 * would be latency-bound rather than bandwidth-bound (AVX2: 8 x 1; AVX-512, whose chunks are
 * twice as wide: 4 x 1). With AVX-512's 32 vector registers, a 4 x 6 tile keeping the rows'
 * x in registers paid best (on the 2-core dev machine, 4 rows of the 1.5B's gate_up / down:
 * 4.1 / 2.4 ms against 4.8 / 2.8 at 2 x 6 and 6.5 / 3.3 for the AVX2 build). */
#ifdef TANDEM_AVX512
#define ONE_TILE_N 4 /* a decode row: 8 x 1 streamed ~5% slower at 16 lanes (a 1.5B forward: 219 / 216 ms) */
#define SMALL_TILE_N 4
#define SMALL_ROWS_OUTER 1
#else
#define ONE_TILE_N 8
#define SMALL_TILE_N 2
#define SMALL_ROWS_OUTER 0
#endif
#define SMALL_TILE_M 6
#define WIDE_TILE_N 4
#define WIDE_TILE_M 2
#define PANEL_M 48
/* fp8 tiles whose rows span at most this many bytes prefetch into L1 (tile()) */
#define FP8_L1_TILE_BYTES 8192
#define MAX_TILE_N 8
#define MAX_TILE_M 6

/* CHUNK weights at p as two fp32 vectors. bf16: lo holds the even-indexed weights (shifted
 * up), hi the odd ones (low halves masked off), so x must be split the same way (split_x); fp16:
 * lo = p[0:VL], hi = p[VL:2 VL]. */
static inline void load_w16(const uint16_t *p, int wkind, vec *lo, vec *hi) {
#ifdef TANDEM_AVX512
    if (wkind == W_BF16) {
        __m512i v = _mm512_loadu_si512((const void *)p);
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 16)));
    }
#else
    if (wkind == W_BF16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)p);
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    }
#endif
}

/* e4m3 bytes in the high halves of 16-bit lanes (b << 8) -> their values over 2^8 as fp16 bits
 * (see the header): an arithmetic shift by one puts exponent and mantissa at bits 13..7 and copies
 * the sign into bit 14, which the mask clears. */
static inline __m128i e4m3_to_f16x8(__m128i high_bytes) {
    return _mm_and_si128(_mm_srai_epi16(high_bytes, 1), _mm_set1_epi16((short)0xbfff));
}

static inline float from_e4m3(uint8_t b) {  /* the scalar form: the value over 2^8 */
    return _cvtsh_ss((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)));
}

/* CHUNK weights at p (e4m3 bytes) as two fp32 vectors, in order: lo = p[0:VL], hi = p[VL:2 VL]. */
static inline void load_w8(const uint8_t *p, vec *lo, vec *hi) {
#ifdef TANDEM_AVX512  /* each 16 bytes zero-extended to 16-bit lanes and moved to their high halves */
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    const __m256i mask = _mm256_set1_epi16((short)0xbfff);
    const __m256i a = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), 8);
    const __m256i b = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), 8);
    *lo = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(a, 1), mask));
    *hi = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(b, 1), mask));
#else
    const __m128i v = _mm_loadu_si128((const __m128i *)p), zero = _mm_setzero_si128();
    *lo = _mm256_cvtph_ps(e4m3_to_f16x8(_mm_unpacklo_epi8(zero, v)));
    *hi = _mm256_cvtph_ps(e4m3_to_f16x8(_mm_unpackhi_epi8(zero, v)));
#endif
}

#ifdef TANDEM_AVX512BF16
/* 32 e4m3 bytes at p -> their values over 2^8 (as from_e4m3) as 32 bf16, in order, exactly: bf16
 * keeps every one of them normal, so a normal byte's exponent and mantissa move into place with the
 * exponent rebiased (e - 7 - 8 + 127 = e + 112, an OR: 112's low 4 bits are clear), and a subnormal
 * one (exponent 0: m * 2^-17 after the scaling) is looked up by its low 5 bits (m; the exponent's
 * low bits are 0). VDPBF16PS would read a subnormal bf16 as zero; none arises here. 7 instructions. */
static inline __m512i load_w8_bf16(const uint8_t *p) {
    const __m512i subnormal = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x3860, 0x3840, 0x3820, 0x3800, 0x37c0, 0x3780, 0x3700, 0);  /* m * 2^-17, m = 7 .. 0 */
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    /* (v << 4 & 0x07f0) | 0x3800: exponent and mantissa at bits 13..4, the exponent rebiased */
    const __m512i normal = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x07f0),
                                                     _mm512_set1_epi16(112 << 7), 0xea);
    const __m512i bits = _mm512_mask_permutexvar_epi16(normal, _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78)),
                                                       v, subnormal);
    /* bits | (v << 8 & 0x8000): the sign */
    return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(v, 8), _mm512_set1_epi16((short)0x8000), 0xf8);
}
#endif

/* Weight k of the row at p (bytes), widened (e4m3: over 2^8). */
static inline float from_w(const char *p, int64_t k, int wkind) {
    return wkind == W_E4M3 ? from_e4m3(((const uint8_t *)p)[k]) : from_half(((const uint16_t *)p)[k], wkind);
}

static inline void load_w(const char *p, int64_t k, int wkind, vec *lo, vec *hi) {
    if (wkind == W_E4M3)
        load_w8((const uint8_t *)p + k, lo, hi);
    else
        load_w16((const uint16_t *)p + k, wkind, lo, hi);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum(vec v) {
#ifdef TANDEM_AVX512
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum8(_mm256_add_ps(lo, hi));
#else
    return hsum8(v);
#endif
}

static inline void store1(void *y, int64_t at, float v, int ykind) {
    if (ykind == Y_F32)
        ((float *)y)[at] = v;
    else if (ykind == Y_BF16)
        ((uint16_t *)y)[at] = to_bf16(v);
    else
        ((uint16_t *)y)[at] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
}

/* y[m0 : m0 + mb, n0 : n0 + nb]: tn weight rows (those past N re-read row n0 and are not
 * stored) times mb input rows; tn, mb and rows_outer are constants after inlining. xs is x laid
 * out for load_w16 (CHUNK-column chunks), x the original rows (for the tail columns). rows_outer
 * only changes which operands stay in registers: every accumulator sees the same FMAs in the
 * same order either way. */
static inline __attribute__((always_inline)) void tile(
    const float *xs, const float *x, const void *w, const float *w_scale, const float *bias, void *y, int64_t K,
    int64_t N, int64_t n0, int64_t m0, const int nb, const int tn, const int mb, const int rows_outer,
    const int wkind, const int ykind)
{
    vec acc[MAX_TILE_N][MAX_TILE_M];
    const char *wr[MAX_TILE_N];
    const int64_t wsize = wkind == W_E4M3 || wkind == W_E4M3_DP ? 1 : 2; /* bytes a weight */
    for (int i = 0; i < tn; i++) {
        wr[i] = (const char *)w + (n0 + (i < nb ? i : 0)) * K * wsize;
        for (int j = 0; j < mb; j++)
            acc[i][j] = vzero();
    }
    const int64_t kc = K - K % CHUNK;
    /* The next tile's rows follow this one's in memory: fetch them at the rate this tile reads
     * (wsize * CHUNK * tn bytes a step), into L2, not L1: a tile's worth of rows ahead (12 KB to
     * 70 KB for the 1.5B's layers) would evict x and the rows being read from L1's 32 KB. Into L1
     * (_MM_HINT_T0), 4 rows streamed at ~20 GB/s on the 2-core AMD EPYC dev machine, the memory
     * stalls adding to the FMAs instead of overlapping them; into L2, 30-43 GB/s, and 1 row
     * 5-20% faster too (bench/cpu_gemm.py; docs/benchmarks.md). fp8 weights (half the bytes, more
     * widening work) read one row of short rows ~15-30% faster into L1 (the 0.5B's and 1.5B's qkv,
     * o, gate_up and the 0.5B's head: a tile of K x tn <= 8 KB), of long rows (down: 4864 and
     * 8960 columns) 10-20% faster into L2; several rows alike either way. */
    const char *ahead = (const char *)w + (n0 + tn) * K * wsize;
    const int into_l1 = wsize == 1 && K * tn <= FP8_L1_TILE_BYTES;
    for (int64_t k = 0; k < kc; k += CHUNK) {
        for (int c = 0; c < (CHUNK * tn * wsize + 63) / 64; c++) {  /* at least one line a step */
            if (into_l1)
                _mm_prefetch(ahead + k * wsize * tn + 64 * c, _MM_HINT_T0);
            else
                _mm_prefetch(ahead + k * wsize * tn + 64 * c, _MM_HINT_T1);
        }
#ifdef TANDEM_AVX512BF16
        if (wkind == W_BF16_DP || wkind == W_E4M3_DP) {  /* xs: the rows in bf16; CHUNK = 32 weights, one register */
            __m512i xv[MAX_TILE_M];
            for (int j = 0; j < mb; j++)
                xv[j] = _mm512_loadu_si512((const void *)((const uint16_t *)xs + (m0 + j) * K + k));
            for (int i = 0; i < tn; i++) {
                const __m512i wv = wkind == W_BF16_DP ? _mm512_loadu_si512((const void *)((const uint16_t *)wr[i] + k))
                                                      : load_w8_bf16((const uint8_t *)wr[i] + k);
                for (int j = 0; j < mb; j++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv, (__m512bh)xv[j]);
            }
            continue;
        }
#endif
        if (rows_outer) {  /* x of the mb rows in registers, one weight row at a time */
            vec xe[MAX_TILE_M], xo[MAX_TILE_M];
            for (int j = 0; j < mb; j++) {
                xe[j] = vloadu(xs + (m0 + j) * K + k);
                xo[j] = vloadu(xs + (m0 + j) * K + k + VL);
            }
            for (int i = 0; i < tn; i++) {
                vec lo, hi;
                load_w(wr[i], k, wkind, &lo, &hi);
                for (int j = 0; j < mb; j++) {
                    acc[i][j] = vfmadd(lo, xe[j], acc[i][j]);
                    acc[i][j] = vfmadd(hi, xo[j], acc[i][j]);
                }
            }
        } else {  /* the tn weight rows in registers, one x row at a time */
            vec lo[MAX_TILE_N], hi[MAX_TILE_N];
            for (int i = 0; i < tn; i++)
                load_w(wr[i], k, wkind, &lo[i], &hi[i]);
            for (int j = 0; j < mb; j++) {
                const vec xe = vloadu(xs + (m0 + j) * K + k);
                const vec xo = vloadu(xs + (m0 + j) * K + k + VL);
                for (int i = 0; i < tn; i++) {
                    acc[i][j] = vfmadd(lo[i], xe, acc[i][j]);
                    acc[i][j] = vfmadd(hi[i], xo, acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < nb; i++) {
        for (int j = 0; j < mb; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t k = kc; k < K; k++)
                s += from_w(wr[i], k, wkind == W_BF16_DP ? W_BF16 : wkind == W_E4M3_DP ? W_E4M3 : wkind)
                     * x[(m0 + j) * K + k];
            if (w_scale)
                s *= w_scale[n0 + i];
            if (bias)
                s += bias[n0 + i];
            store1(y, (m0 + j) * N + n0 + i, s, ykind);
        }
    }
}

/* One pass of weight rows [0, N) over input rows [p0, p1) in TN x TM tiles. A macro, not an
 * inline function: GCC outlines an OpenMP region before it inlines, so the tile shape must be
 * a literal inside the region for the accumulators to live in registers. */
#define DEFINE_SWEEP(NAME, TN, TM, ROWS_OUTER)                                                      \
static void NAME(const float *xs, const float *x, const void *w, const float *w_scale,             \
                 const float *bias, void *y, int64_t p0, int64_t p1, int64_t K, int64_t N,        \
                 int num_threads, int wkind, int ykind)                                           \
{                                                                                                 \
    const int64_t num_blocks = (N + (TN) - 1) / (TN);                                            \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                       \
    for (int64_t b = 0; b < num_blocks; b++) {                                                    \
        const int64_t n0 = b * (TN);                                                              \
        const int nb = (int)(N - n0 < (TN) ? N - n0 : (TN));                                     \
        for (int64_t m0 = p0; m0 < p1; m0 += (TM)) {                                              \
            switch ((int)(p1 - m0 < (TM) ? p1 - m0 : (TM))) {                                     \
                SWEEP_CASE(TN, TM, ROWS_OUTER, 1) SWEEP_CASE(TN, TM, ROWS_OUTER, 2)               \
                SWEEP_CASE(TN, TM, ROWS_OUTER, 3) SWEEP_CASE(TN, TM, ROWS_OUTER, 4)               \
                SWEEP_CASE(TN, TM, ROWS_OUTER, 5) SWEEP_CASE(TN, TM, ROWS_OUTER, 6)               \
                default: break;                                                                   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}

#ifdef TANDEM_AVX512BF16
#define DP_BUILD 1
#else
#define DP_BUILD 0
#endif

#define SWEEP_CASE(TN, TM, ROWS_OUTER, MB)                                                        \
    case MB:                                                                                      \
        if ((MB) <= (TM)) {                                                                       \
            if (DP_BUILD && wkind == W_BF16_DP)  /* the common cases, fully specialised */       \
                tile(xs, x, w, NULL, bias, y, K, N, n0, m0, nb, TN, MB, ROWS_OUTER, W_BF16_DP, ykind); \
            else if (DP_BUILD && wkind == W_E4M3_DP)                                              \
                tile(xs, x, w, w_scale, bias, y, K, N, n0, m0, nb, TN, MB, ROWS_OUTER, W_E4M3_DP, ykind); \
            else if (wkind == W_BF16 && ykind == Y_BF16)                                          \
                tile(xs, x, w, NULL, bias, y, K, N, n0, m0, nb, TN, MB, ROWS_OUTER, W_BF16, Y_BF16); \
            else if (wkind == W_E4M3 && ykind == Y_BF16)                                          \
                tile(xs, x, w, w_scale, bias, y, K, N, n0, m0, nb, TN, MB, ROWS_OUTER, W_E4M3,     \
                     Y_BF16);                                                                     \
            else                                                                                  \
                tile(xs, x, w, w_scale, bias, y, K, N, n0, m0, nb, TN, MB, ROWS_OUTER, wkind,      \
                     ykind);                                                                      \
        }                                                                                         \
        break;

DEFINE_SWEEP(sweep_one, ONE_TILE_N, 1, 1)
DEFINE_SWEEP(sweep_two, 4, 2, 1)
DEFINE_SWEEP(sweep_small, SMALL_TILE_N, SMALL_TILE_M, SMALL_ROWS_OUTER)
DEFINE_SWEEP(sweep_wide, WIDE_TILE_N, WIDE_TILE_M, 1)

static void gemm(const float *xs, const float *x, const void *w, const float *w_scale, const float *bias, void *y,
                 int64_t M, int64_t K, int64_t N, int num_threads, int wkind, int ykind)
{
    /* decode / verification: every weight read once from memory */
    if (M == 1) {
        sweep_one(xs, x, w, w_scale, bias, y, 0, M, K, N, num_threads, wkind, ykind);
        return;
    }
    if (M == 2) {
        sweep_two(xs, x, w, w_scale, bias, y, 0, M, K, N, num_threads, wkind, ykind);
        return;
    }
    if (M <= SMALL_TILE_M) {
        sweep_small(xs, x, w, w_scale, bias, y, 0, M, K, N, num_threads, wkind, ykind);
        return;
    }
    /* Prefill: panels of rows; 4 x 2 tiles read each x element once per 4 weight rows, which
     * keeps the x traffic from L2 within its bandwidth. */
    for (int64_t p0 = 0; p0 < M; p0 += PANEL_M) {
        const int64_t p1 = M < p0 + PANEL_M ? M : p0 + PANEL_M;
        sweep_wide(xs, x, w, w_scale, bias, y, p0, p1, K, N, num_threads, wkind, ykind);
    }
}

/* xs[m, c*CHUNK + t] = x[m, c*CHUNK + 2t] and xs[m, c*CHUNK + VL + t] = x[m, c*CHUNK + 2t + 1] for
 * t < VL: the even/odd split load_w16 gives bf16 weights. Columns past the last full chunk are
 * unused. */
static void split_x(const float *x, float *xs, int64_t M, int64_t K) {
    const int64_t kc = K - K % CHUNK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < kc; k += CHUNK)
            for (int t = 0; t < VL; t++) {
                xs[m * K + k + t] = x[m * K + k + 2 * t];
                xs[m * K + k + VL + t] = x[m * K + k + 2 * t + 1];
            }
}

/* x [M, K] of kind xkind at row stride x_stride -> fp32 [M, K] contiguous. */
static void widen_x(const void *x, int64_t x_stride, int xkind, float *out, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        if (xkind == X_F32) {
            memcpy(out + m * K, (const float *)x + m * x_stride, (size_t)K * sizeof(float));
            continue;
        }
        const uint16_t *row = (const uint16_t *)x + m * x_stride;
        const int kind = xkind == X_BF16 ? H_BF16 : H_F16;
        for (int64_t k = 0; k < K; k++)
            out[m * K + k] = from_half(row[k], kind);
    }
}

#ifdef TANDEM_AVX512BF16
/* The VDPBF16PS paths (wkind W_BF16_DP or W_E4M3_DP): bf16 rows x as they are (copied to scratch
 * when strided), widened to fp32 (at scratch + M * K) only for the columns past the last full
 * chunk. scratch: 2 * M * K floats. */
static void gemm_bf16_rows(const void *x, int64_t x_stride, const void *w, const float *w_scale, const float *bias,
                           void *y, float *scratch, int64_t M, int64_t K, int64_t N, int num_threads, int wkind,
                           int ykind)
{
    const uint16_t *rows = (const uint16_t *)x;
    if (x_stride != K) {
        uint16_t *packed = (uint16_t *)scratch;
        for (int64_t m = 0; m < M; m++)
            memcpy(packed + m * K, rows + m * x_stride, (size_t)K * sizeof(uint16_t));
        rows = packed;
    }
    float *tail_x = NULL;  /* x widened, read only by the columns past the last full chunk */
    if (K % CHUNK) {
        tail_x = scratch + M * K;
        widen_x(x, x_stride, X_BF16, tail_x, M, K);
    }
    gemm((const float *)rows, tail_x, w, w_scale, bias, y, M, K, N, num_threads, wkind, ykind);
}
#endif

/* Entry point. x: [M, K] fp32, bf16 or fp16 (xkind, the Y_* codes), rows x_stride elements
 * apart; it is widened to fp32 exactly, so the result does not depend on how x arrives (except in
 * the BF16 build, where bf16 rows against bf16 weights go to VDPBF16PS as they are).
 * scratch: 2 * M * K floats (the bf16 layout of x, and x widened when it is not fp32 rows
 * already). Returns 0, or -1 for a dtype code it does not know. */
int tandem_gemm_w16(const void *x, int64_t x_stride, int xkind, const uint16_t *w, const float *bias, void *y,
                    float *scratch, int64_t M, int64_t K, int64_t N, int wkind, int ykind, int num_threads)
{
    if ((wkind != W_BF16 && wkind != W_F16) || ykind < Y_F32 || ykind > Y_F16 || xkind < X_F32 || xkind > X_F16)
        return -1;
#ifdef TANDEM_AVX512BF16
    if (wkind == W_BF16 && xkind == X_BF16) {
        gemm_bf16_rows(x, x_stride, w, NULL, bias, y, scratch, M, K, N, num_threads, W_BF16_DP, ykind);
        return 0;
    }
#endif
    const float *xf = (const float *)x;
    if (xkind != X_F32 || x_stride != K) {
        float *plain = scratch + M * K;
        widen_x(x, x_stride, xkind, plain, M, K);
        xf = plain;
    }
    const float *xs = xf;
    if (wkind == W_BF16) {
        split_x(xf, scratch, M, K);
        xs = scratch;
    }
    gemm(xs, xf, w, NULL, bias, y, M, K, N, num_threads, wkind, ykind);
    return 0;
}

/* fp8 weights: w [N, K] float8 e4m3, w_scale [N] fp32 (each row's scale times 2^8: see the header);
 * otherwise as tandem_gemm_w16 (scratch: 2 * M * K floats), bf16 rows taking VDPBF16PS in the BF16
 * build. Returns -1 for a dtype code it does not know. */
int tandem_gemm_w8(const void *x, int64_t x_stride, int xkind, const uint8_t *w, const float *w_scale,
                   const float *bias, void *y, float *scratch, int64_t M, int64_t K, int64_t N, int ykind,
                   int num_threads)
{
    if (ykind < Y_F32 || ykind > Y_F16 || xkind < X_F32 || xkind > X_F16)
        return -1;
#ifdef TANDEM_AVX512BF16
    if (xkind == X_BF16) {  /* bf16 rows: the weights become bf16 in registers, VDPBF16PS multiplies */
        gemm_bf16_rows(x, x_stride, w, w_scale, bias, y, scratch, M, K, N, num_threads, W_E4M3_DP, ykind);
        return 0;
    }
#endif
    const float *xf = (const float *)x;
    if (xkind != X_F32 || x_stride != K) {
        widen_x(x, x_stride, xkind, scratch, M, K);
        xf = scratch;
    }
    gemm(xf, xf, w, w_scale, bias, y, M, K, N, num_threads, W_E4M3, ykind);
    return 0;
}
