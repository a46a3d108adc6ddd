/* Exact mode's attention as one call: every (row, head) computed from its own query and the
 * keys it sees, in standard decoding's order, by the same code whatever else the pass holds.
 *
 * Row r of a pass sees the cached prefix (positions 0 .. prefix-1) and then its visible block
 * entries (its tree ancestors and itself, in order: visible[r * stride_visible + 0 .. counts[r]-1],
 * offsets into the block that follows the prefix). Standard decoding, one token per pass, has
 * those same keys at consecutive positions, so a row computes what its single-token pass does:
 *
 *   score_t = dot(query, key_t) * scale           (one dot routine, fixed order of sums)
 *   weight_t = exp(score_t - max_t score_t)        (exp_nonpositive; libm's in float64)
 *   out = (sum_t weight_t * value_t) / sum_t weight_t   (sums sequential in t)
 *
 * Nothing depends on the number of rows, which rows share a call, or how the work is split
 * between threads: batch invariance holds by construction. Compiled with -ffp-contract=off so
 * that no multiply-add is fused in one place and not in another.
 *
 * Built and loaded by specdec.decoders.models.native (ctypes); SCALAR is float or double, the
 * type sums run in; the inputs are float32, float64 or bfloat16 (raw 16-bit words).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_value(uint16_t bits) {
    uint32_t word = ((uint32_t)bits) << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

static inline uint16_t bf16_bits(float value) { /* round to nearest even, as PyTorch does */
    uint32_t word;
    memcpy(&word, &value, sizeof word);
    if (isnan(value)) return 0x7FC0;
    word += 0x7FFF + ((word >> 16) & 1);
    return (uint16_t)(word >> 16);
}

/* exp(x) for x <= 0 in plain arithmetic (no libm call): the loop over a row's keys vectorises,
 * and a vector lane computes what the scalar epilogue does (no fused multiply-adds, no fast-math),
 * so an element's bits do not depend on where in the loop it falls. Range reduction by ln 2 in
 * two parts, a degree-6 polynomial on [-ln2/2, ln2/2] (Taylor; about 2 ulp), 2^k from the
 * exponent bits. Below -87 it gives 0, as expf's result underflows there. */
static inline float exp_nonpositive(float x) {
    float clamped = x < -87.0f ? -87.0f : x;
    float k = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = clamped - k * 0.693145751953125f;
    r = r - k * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* Scores of one query against 16 keys at once (AVX-512, head dimensions a multiple of 16): each
 * key's products summed in 16 lanes over the head dimension in order, then the 16 keys' lane
 * vectors reduced together by a fixed network of adds (transpose and add). A key's sum takes the
 * same additions wherever it falls: blocks start at multiples of 16 of the row's key sequence,
 * which is standard decoding's, and keys past the end are zeros that no real key's sum touches. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_SCORE_BLOCKS 1

static int block_lane[16]; /* the network's output lane of each of the 16 keys */

static __m512 reduce16(__m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

__attribute__((constructor)) static void find_block_lanes(void) {
    __m512 v[16];
    float out[16];
    for (int j = 0; j < 16; j++) v[j] = _mm512_set1_ps((float)(j + 1));
    _mm512_storeu_ps(out, reduce16(v));
    for (int lane = 0; lane < 16; lane++) block_lane[(int)(out[lane] / 16.0f) - 1] = lane;
}

static inline __m512 key_chunk_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 key_chunk_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#define DEFINE_SCORE_BLOCK(NAME, T, CHUNK)                                                             \
    /* scores[0..count) of q against keys[0..count) (count <= 16), unscaled */                        \
    static void NAME(const float *q, const T *const *keys, int count, int d, float *scores) {         \
        __m512 lanes[16];                                                                             \
        for (int j = 0; j < 16; j++) {                                                                \
            __m512 acc = _mm512_setzero_ps();                                                         \
            if (j < count)                                                                            \
                for (int i = 0; i < d; i += 16)                                                       \
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + i), CHUNK(keys[j] + i))); \
            lanes[j] = acc;                                                                           \
        }                                                                                             \
        float out[16];                                                                                \
        _mm512_storeu_ps(out, reduce16(lanes));                                                       \
        for (int j = 0; j < count; j++) scores[j] = out[block_lane[j]];                               \
    }
DEFINE_SCORE_BLOCK(score_block_float32, float, key_chunk_f32)
DEFINE_SCORE_BLOCK(score_block_bfloat16, uint16_t, key_chunk_bf16)
#endif

#define DEFINE_ATTEND(NAME, T, SCALAR, LOAD, STORE, EXP, SCORES)                                              \
    static inline SCALAR NAME##_dot(const T *a, const SCALAR *q, int d) {                            \
        SCALAR lane[LANES] = {0};                                                                     \
        int i = 0;                                                                                    \
        for (; i + LANES <= d; i += LANES)                                                            \
            for (int j = 0; j < LANES; j++) lane[j] += q[i + j] * LOAD(a[i + j]);                    \
        for (int j = 0; i < d; i++, j++) lane[j] += q[i] * LOAD(a[i]);                               \
        for (int width = LANES / 2; width > 0; width /= 2)                                            \
            for (int j = 0; j < width; j++) lane[j] += lane[j + width];                               \
        return lane[0];                                                                               \
    }                                                                                                 \
    /* one (row, head): its query qs against the keys of its kv head (key, value: that head's) */   \
    static void NAME##_one(const T *qs, const T *key, long k_pos, const T *value, long v_pos, T *os, int d,  \
                           int prefix, const int32_t *visible, int count, double scale) {               \
        int n = prefix + count;                                                                       \
        SCALAR *q = malloc(sizeof(SCALAR) * ((size_t)d * 2 + (size_t)n));                            \
        SCALAR *acc = q + d, *w = acc + d;                                                            \
        for (int i = 0; i < d; i++) q[i] = LOAD(qs[i]);                                               \
        SCALAR peak = -INFINITY;                                                                      \
        if (SCORES != NULL && d % 16 == 0) {                                                          \
            for (int t0 = 0; t0 < n; t0 += 16) {                                                      \
                const T *block[16];                                                                   \
                int count16 = n - t0 < 16 ? n - t0 : 16;                                              \
                for (int j = 0; j < count16; j++) {                                                   \
                    int t = t0 + j;                                                                   \
                    long at = t < prefix ? t : prefix + visible[t - prefix];                          \
                    block[j] = key + at * k_pos;                                                      \
                }                                                                                     \
                SCORES((const float *)q, block, count16, d, (float *)(w + t0));                       \
            }                                                                                         \
            for (int t = 0; t < n; t++) {                                                             \
                w[t] = w[t] * (SCALAR)scale;                                                          \
                if (w[t] > peak) peak = w[t];                                                         \
            }                                                                                         \
        } else {                                                                                      \
            for (int t = 0; t < n; t++) {                                                             \
                long at = t < prefix ? t : prefix + visible[t - prefix];                              \
                w[t] = NAME##_dot(key + at * k_pos, q, d) * (SCALAR)scale;                            \
                if (w[t] > peak) peak = w[t];                                                         \
            }                                                                                         \
        }                                                                                             \
        for (int t = 0; t < n; t++) w[t] = EXP(w[t] - peak);                                          \
        SCALAR total = 0;                                                                             \
        for (int t = 0; t < n; t++) total += w[t];                                                    \
        for (int i = 0; i < d; i++) acc[i] = 0;                                                       \
        for (int t = 0; t < n; t++) {                                                                 \
            long at = t < prefix ? t : prefix + visible[t - prefix];                                  \
            const T *vs = value + at * v_pos;                                                         \
            SCALAR weight = w[t];                                                                     \
            for (int i = 0; i < d; i++) acc[i] += weight * LOAD(vs[i]);                               \
        }                                                                                             \
        for (int i = 0; i < d; i++) os[i] = STORE(acc[i] / total);                                    \
        free(q);                                                                                      \
    }                                                                                                 \
    void NAME(const T *query, long q_head, long q_row, const T *key, long k_head, long k_pos,        \
              const T *value, long v_head, long v_pos, T *out, long o_head, long o_row, int heads,  \
              int kv_heads, int rows, int d, int prefix, const int32_t *visible, long stride_visible, \
              const int32_t *counts, double scale, int threads) {                                     \
        int groups = heads / kv_heads;                                                                \
        long tasks = (long)heads * rows;                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                            \
        for (long task = 0; task < tasks; task++) {                                                  \
            int h = (int)(task / rows), r = (int)(task % rows), g = h / groups;                      \
            NAME##_one(query + h * q_head + r * q_row, key + g * k_head, k_pos, value + g * v_head, v_pos, \
                       out + h * o_head + r * o_row, d, prefix, visible + r * stride_visible, counts[r], scale); \
        }                                                                                             \
    }                                                                                                 \
    /* a packed pass over several requests in one call: request i's rows are query rows           \
     * meta[i*12+7] .. +meta[i*12+8], against its own keys and values; meta per request: key,        \
     * k_head, k_pos, value, v_head, v_pos, prefix, first row, rows, visible, stride_visible, counts */ \
    void NAME##_many(const T *query, long q_head, long q_row, T *out, long o_head, long o_row, int heads, \
                     int kv_heads, int d, int requests, const long *meta, double scale, int threads) {  \
        int groups = heads / kv_heads;                                                                \
        int total = 0;                                                                                \
        for (int i = 0; i < requests; i++) total += (int)meta[i * 12 + 8];                            \
        int *owner = malloc(sizeof(int) * (size_t)(total > 0 ? total : 1));                           \
        for (int i = 0; i < requests; i++)                                                            \
            for (long r = 0; r < meta[i * 12 + 8]; r++) owner[meta[i * 12 + 7] + r] = i;              \
        long tasks = (long)heads * total;                                                             \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                            \
        for (long task = 0; task < tasks; task++) {                                                  \
            int h = (int)(task / total), row = (int)(task % total), g = h / groups;                  \
            const long *m = meta + owner[row] * 12;                                                   \
            int r = row - (int)m[7];                                                                  \
            const T *key = (const T *)m[0], *value = (const T *)m[3];                                 \
            const int32_t *visible = (const int32_t *)m[9], *counts = (const int32_t *)m[11];         \
            NAME##_one(query + h * q_head + row * q_row, key + g * m[1], m[2], value + g * m[4], m[5], \
                       out + h * o_head + row * o_row, d, (int)m[6], visible + r * m[10], counts[r], scale); \
        }                                                                                             \
        free(owner);                                                                                  \
    }

#define AS_IS(x) (x)
#define AS_FLOAT(x) ((float)(x))

#ifdef HAVE_SCORE_BLOCKS
#define BLOCKS_F32 score_block_float32
#define BLOCKS_BF16 score_block_bfloat16
#else
/* no score blocks without AVX-512: typed null pointers, so that the branch that calls them compiles */
typedef void (*f32_blocks_t)(const float *, const float *const *, int, int, float *);
typedef void (*bf16_blocks_t)(const float *, const uint16_t *const *, int, int, float *);
#define BLOCKS_F32 ((f32_blocks_t)NULL)
#define BLOCKS_BF16 ((bf16_blocks_t)NULL)
#endif
typedef void (*no_blocks_t)(const float *, const double *const *, int, int, float *);
DEFINE_ATTEND(attend_float32, float, float, AS_IS, AS_IS, exp_nonpositive, BLOCKS_F32)
DEFINE_ATTEND(attend_float64, double, double, AS_IS, AS_IS, exp, ((no_blocks_t)NULL))
DEFINE_ATTEND(attend_bfloat16, uint16_t, float, bf16_value, bf16_bits, exp_nonpositive, BLOCKS_BF16)

/* A linear layer's product for bfloat16 over a few rows, each output on its own:
 * out[m][n] = sum over k of x[m][k] * w[n][k], by AVX-512 BF16 dot products (vdpbf16ps: pairs of
 * bfloat16 products added into float lanes) in two accumulators of 16 lanes (k in steps of 32,
 * accumulator (k / 32) mod 2), then a fixed reduction. An output's bits depend on its input row
 * and its weight row alone, not on how many rows or outputs share the call: batch-invariant by
 * construction. Rows go eight, then four at a time (each weight row read once for them), then one at a time,
 * by the same arithmetic. ins: a multiple of 64 (the caller keeps other shapes off it). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int linear_available(void) { return 1; }

#define BF16_LOAD(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define FINISH(A0, A1, ROW_INDEX)                                                                      \
    {                                                                                                 \
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(A0, A1));                                      \
        y[(long)(ROW_INDEX) * y_row + n] = bf16_bits(bias ? sum + b : sum);                           \
    }
#define ROW(A0, A1, XR)                                                                                \
    A0 = _mm512_dpbf16_ps(A0, w0, BF16_LOAD(XR + k));                                                 \
    A1 = _mm512_dpbf16_ps(A1, w1, BF16_LOAD(XR + k + 32));

void linear_bfloat16(const uint16_t *x, long x_row, const uint16_t *w, long w_row, const uint16_t *bias,
                     uint16_t *y, long y_row, int rows, int outs, int ins, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < outs; n++) {
        const uint16_t *wn = w + (long)n * w_row;
        float b = bias ? bf16_value(bias[n]) : 0.0f;
        int m = 0;
        for (; m + 8 <= rows; m += 8) { /* eight rows per weight read: the same sums per output */
            const uint16_t *x0 = x + (long)m * x_row;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int k = 0; k < ins; k += 64) {
                __m512bh w0 = BF16_LOAD(wn + k), w1 = BF16_LOAD(wn + k + 32);
                for (int j = 0; j < 8; j++) {
                    ROW(a[2 * j], a[2 * j + 1], (x0 + (long)j * x_row))
                }
            }
            for (int j = 0; j < 8; j++) FINISH(a[2 * j], a[2 * j + 1], m + j)
        }
        for (; m + 4 <= rows; m += 4) {
            const uint16_t *x0 = x + (long)m * x_row, *x1 = x0 + x_row, *x2 = x1 + x_row, *x3 = x2 + x_row;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
            __m512 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
            for (int k = 0; k < ins; k += 64) {
                __m512bh w0 = BF16_LOAD(wn + k), w1 = BF16_LOAD(wn + k + 32);
                ROW(a00, a01, x0)
                ROW(a10, a11, x1)
                ROW(a20, a21, x2)
                ROW(a30, a31, x3)
            }
            FINISH(a00, a01, m)
            FINISH(a10, a11, m + 1)
            FINISH(a20, a21, m + 2)
            FINISH(a30, a31, m + 3)
        }
        for (; m < rows; m++) {
            const uint16_t *x0 = x + (long)m * x_row;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00;
            for (int k = 0; k < ins; k += 64) {
                __m512bh w0 = BF16_LOAD(wn + k), w1 = BF16_LOAD(wn + k + 32);
                ROW(a00, a01, x0)
            }
            FINISH(a00, a01, m)
        }
    }
}
#else
int linear_available(void) { return 0; }
void linear_bfloat16(const uint16_t *x, long x_row, const uint16_t *w, long w_row, const uint16_t *bias,
                     uint16_t *y, long y_row, int rows, int outs, int ins, int threads) {}
#endif

/* Weight-only int8 linear (model.quantize=int8): out[m][n] = scale[n] * sum over k of
 * x[m][k] * w[n][k] (+ bias[n]), w int8 with one float scale per output, x and out float32 or
 * bfloat16 (x_bf16, y_bf16). Each output's sum runs in two accumulators of 16 float lanes
 * (k in steps of 32, accumulator (k / 16) mod 2), reduced by one fixed routine: its bits depend
 * on its input row and weight row alone, whatever else the call holds (batch-invariant by
 * construction, as the bfloat16 linear above). Rows go eight at a time (each int8 weight row read
 * and converted once for them), then four, then one at a time. ins: a multiple of 32. */
static float *int8_inputs(const void *x, int x_bf16, long x_row, int rows, int ins) {
    float *xf = malloc(sizeof(float) * (size_t)rows * (size_t)ins);
    for (int m = 0; m < rows; m++)
        for (int k = 0; k < ins; k++)
            xf[(long)m * ins + k] = x_bf16 ? bf16_value(((const uint16_t *)x)[(long)m * x_row + k])
                                           : ((const float *)x)[(long)m * x_row + k];
    return xf;
}

static inline void int8_store(void *y, int y_bf16, long at, float value) {
    if (y_bf16)
        ((uint16_t *)y)[at] = bf16_bits(value);
    else
        ((float *)y)[at] = value;
}

#if defined(__AVX512F__)
#define I8_LOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I8_ROW(A0, A1, XR)                                                                             \
    A0 = _mm512_fmadd_ps(_mm512_loadu_ps(XR + k), w0, A0);                                            \
    A1 = _mm512_fmadd_ps(_mm512_loadu_ps(XR + k + 16), w1, A1);
#define I8_FINISH(A0, A1, ROW_INDEX)                                                                   \
    {                                                                                                 \
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(A0, A1)) * s;                                  \
        int8_store(y, y_bf16, (long)(ROW_INDEX) * y_row + n, bias ? sum + bias[n] : sum);             \
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 inputs: 64 int8 weights widened to bfloat16 (exact: |w| <= 127) once for every row,
 * then vdpbf16ps as in the bfloat16 linear (ins: a multiple of 64) */
#define I8_WIDEN(P, LANE) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(P, LANE)))
#define I8_DP_ROW(A0, A1, XR)                                                                          \
    A0 = _mm512_dpbf16_ps(A0, w0, BF16_LOAD(XR + k));                                                 \
    A1 = _mm512_dpbf16_ps(A1, w1, BF16_LOAD(XR + k + 32));
static void linear_int8_dp(const uint16_t *x, long x_row, const int8_t *w, long w_row, const float *scales,
                           const float *bias, void *y, int y_bf16, long y_row, int rows, int outs, int ins,
                           int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < outs; n++) {
        const int8_t *wn = w + (long)n * w_row;
        float s = scales[n];
        int m = 0;
        for (; m + 8 <= rows; m += 8) {
            const uint16_t *x0 = x + (long)m * x_row;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int k = 0; k < ins; k += 64) {
                __m512i p = _mm512_loadu_si512((const void *)(wn + k));
                __m512bh w0 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 1), I8_WIDEN(p, 0));
                __m512bh w1 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 3), I8_WIDEN(p, 2));
                for (int j = 0; j < 8; j++) {
                    I8_DP_ROW(a[2 * j], a[2 * j + 1], (x0 + (long)j * x_row))
                }
            }
            for (int j = 0; j < 8; j++) I8_FINISH(a[2 * j], a[2 * j + 1], m + j)
        }
        for (; m + 4 <= rows; m += 4) {
            const uint16_t *x0 = x + (long)m * x_row, *x1 = x0 + x_row, *x2 = x1 + x_row, *x3 = x2 + x_row;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
            __m512 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
            for (int k = 0; k < ins; k += 64) {
                __m512i p = _mm512_loadu_si512((const void *)(wn + k));
                __m512bh w0 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 1), I8_WIDEN(p, 0));
                __m512bh w1 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 3), I8_WIDEN(p, 2));
                I8_DP_ROW(a00, a01, x0)
                I8_DP_ROW(a10, a11, x1)
                I8_DP_ROW(a20, a21, x2)
                I8_DP_ROW(a30, a31, x3)
            }
            I8_FINISH(a00, a01, m)
            I8_FINISH(a10, a11, m + 1)
            I8_FINISH(a20, a21, m + 2)
            I8_FINISH(a30, a31, m + 3)
        }
        for (; m < rows; m++) {
            const uint16_t *x0 = x + (long)m * x_row;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00;
            for (int k = 0; k < ins; k += 64) {
                __m512i p = _mm512_loadu_si512((const void *)(wn + k));
                __m512bh w0 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 1), I8_WIDEN(p, 0));
                __m512bh w1 = _mm512_cvtne2ps_pbh(I8_WIDEN(p, 3), I8_WIDEN(p, 2));
                I8_DP_ROW(a00, a01, x0)
            }
            I8_FINISH(a00, a01, m)
        }
    }
}
#define I8_DP 1
#endif
void linear_int8(const void *x, int x_bf16, long x_row, const int8_t *w, long w_row, const float *scales,
                 const float *bias, void *y, int y_bf16, long y_row, int rows, int outs, int ins, int threads) {
#ifdef I8_DP
    if (x_bf16 && ins % 64 == 0) { /* a choice made by shapes alone, never by the rows */
        linear_int8_dp((const uint16_t *)x, x_row, w, w_row, scales, bias, y, y_bf16, y_row, rows, outs, ins, threads);
        return;
    }
#endif
    float *xf = int8_inputs(x, x_bf16, x_row, rows, ins);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < outs; n++) {
        const int8_t *wn = w + (long)n * w_row;
        float s = scales[n];
        int m = 0;
        for (; m + 8 <= rows; m += 8) {
            const float *x0 = xf + (long)m * ins;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int k = 0; k < ins; k += 32) {
                __m512 w0 = I8_LOAD(wn + k), w1 = I8_LOAD(wn + k + 16);
                for (int j = 0; j < 8; j++) {
                    I8_ROW(a[2 * j], a[2 * j + 1], (x0 + (long)j * ins))
                }
            }
            for (int j = 0; j < 8; j++) I8_FINISH(a[2 * j], a[2 * j + 1], m + j)
        }
        for (; m + 4 <= rows; m += 4) {
            const float *x0 = xf + (long)m * ins, *x1 = x0 + ins, *x2 = x1 + ins, *x3 = x2 + ins;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
            __m512 a20 = a00, a21 = a00, a30 = a00, a31 = a00;
            for (int k = 0; k < ins; k += 32) {
                __m512 w0 = I8_LOAD(wn + k), w1 = I8_LOAD(wn + k + 16);
                I8_ROW(a00, a01, x0)
                I8_ROW(a10, a11, x1)
                I8_ROW(a20, a21, x2)
                I8_ROW(a30, a31, x3)
            }
            I8_FINISH(a00, a01, m)
            I8_FINISH(a10, a11, m + 1)
            I8_FINISH(a20, a21, m + 2)
            I8_FINISH(a30, a31, m + 3)
        }
        for (; m < rows; m++) {
            const float *x0 = xf + (long)m * ins;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00;
            for (int k = 0; k < ins; k += 32) {
                __m512 w0 = I8_LOAD(wn + k), w1 = I8_LOAD(wn + k + 16);
                I8_ROW(a00, a01, x0)
            }
            I8_FINISH(a00, a01, m)
        }
    }
    free(xf);
}
#else
void linear_int8(const void *x, int x_bf16, long x_row, const int8_t *w, long w_row, const float *scales,
                 const float *bias, void *y, int y_bf16, long y_row, int rows, int outs, int ins, int threads) {
    float *xf = int8_inputs(x, x_bf16, x_row, rows, ins);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < outs; n++) {
        const int8_t *wn = w + (long)n * w_row;
        for (int m = 0; m < rows; m++) {
            const float *xm = xf + (long)m * ins;
            float lane[32] = {0};
            for (int k = 0; k < ins; k += 32)
                for (int j = 0; j < 32; j++) lane[j] += xm[k + j] * (float)wn[k + j];
            for (int width = 16; width > 0; width /= 2)
                for (int j = 0; j < width; j++) lane[j] += lane[j + width];
            float sum = lane[0] * scales[n];
            int8_store(y, y_bf16, (long)m * y_row + n, bias ? sum + bias[n] : sum);
        }
    }
    free(xf);
}
#endif
