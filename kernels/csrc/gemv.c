/* Weight-only quantized matmuls for few rows on the CPU: y[M, O] = x[M, I] @ W[O, I]^T, reading only the quantized
 * bytes of W. The layouts (tsterm_kernels.quant), in blocks of 32 inputs along each row:
 *
 *   q8: codes int8 [O, I], scales fp16 [O, I/32]:           W[o, i] = code * d
 *   q4: codes uint8 [O, I/2], scales fp16 [O, I/32, 2]:     W[o, i] = code * d + m, code in [0, 15]
 *       byte j of a block's 16 holds input j in its low nibble and input j + 16 in its high nibble (GGUF's order,
 *       so Q4_0 / Q4_1 blocks repack by copying their bytes).
 *
 * Each row of x is first quantized to int8 per block of 32 (dx = max|x| / 127, qx = round-half-even(x / dx), as
 * llama.cpp does for these formats), so a block's dot product is an exact integer sum of 32 products
 * (_mm256_maddubs_epi16, then _mm256_madd_epi16): q8: d * dx * sum(code * qx); q4: d * dx * sum(code * qx) +
 * m * dx * sum(qx). (d * dx is rounded to float32 before it scales the integer sum.) `tsterm_kernels.quant.reference_matmul` is the same arithmetic in torch.
 *
 * Output rows are split over the OpenMP threads (libgomp: the runtime torch's CPU build already loaded), in tiles of
 * 16 rows; each tile is read from memory once and multiplied by every row of x (4 rows of x at a time), so the
 * weight stream does not grow with M.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "tsterm.h"

#define QBLOCK 32
#define TILE 16

#if defined(__aarch64__)
/* aarch64: NEON, the same integers and the same float arithmetic as the x86 code below (so the same bits: each
 * block's 32 products summed exactly into 8 lanes of 4 neighbouring products, converted, one fused multiply-add per
 * lane with the block's d * dx into the even or the odd blocks' accumulator, then x86's horizontal sum), for every
 * row count. The dot products of 16 int8 pairs into 4 lanes: sdot where the target has it (ARMv8.2 dotprod), else
 * widening products (int16: no product of two int8 reaches its bound) summed pairwise twice; exact either way. */
void tsterm_quantize_row(const float *x, int64_t in_f, int8_t *qx, float *dx_out, float *sx_out) {
    for (int64_t b = 0; b < in_f / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        float32x4_t v[8];
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < 8; k++) v[k] = vld1q_f32(xb + 4 * k);
        for (int k = 0; k < 4; k++) /* x86's max over the four 8-lane vectors, then across the lanes */
            amax = tsterm_m256(tsterm_max_x86(amax.lo, vabsq_f32(v[2 * k])),
                               tsterm_max_x86(amax.hi, vabsq_f32(v[2 * k + 1])));
        const float dx = hmax256(amax) / 127.0f;
        const float32x4_t inv = vdupq_n_f32(dx > 0.0f ? 1.0f / dx : 0.0f);
        int32x4_t q[8], sum = vdupq_n_s32(0);
        for (int k = 0; k < 8; k++) {
            q[k] = vcvtnq_s32_f32(vmulq_f32(v[k], inv)); /* round half to even */
            sum = vaddq_s32(sum, q[k]);
        }
        for (int k = 0; k < 4; k++) { /* saturating narrowing, as packs */
            const int16x8_t h = vcombine_s16(vqmovn_s32(q[2 * k]), vqmovn_s32(q[2 * k + 1]));
            vst1_s8(qx + b * QBLOCK + 8 * k, vqmovn_s16(h));
        }
        dx_out[b] = dx;
        sx_out[b] = dx * (float)vaddvq_s32(sum);
    }
}

/* lane j: the sum of a[4j + i] * b[4j + i] over i < 4 */
static inline int32x4_t dot_s8x16(int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), a, b);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi));
#endif
}

/* fp16 bits [4] -> floats */
static inline float32x4_t load_half4(const uint16_t *s) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s))); }

/* acc (lanes 0-3, 4-7) += the block's 8 partial sums (a against x's first 16 codes, b against the last 16) * dd */
static inline void block_fma(float32x4_t acc[2], int8x16_t a, int8x16_t b, const int8_t *xr, float dd) {
    const float32x4_t d = vdupq_n_f32(dd);
    acc[0] = vfmaq_f32(acc[0], vcvtq_f32_s32(dot_s8x16(a, vld1q_s8(xr))), d);
    acc[1] = vfmaq_f32(acc[1], vcvtq_f32_s32(dot_s8x16(b, vld1q_s8(xr + 16))), d);
}

/* x86's hsum256(acc even + acc odd) */
static inline float sum_accs(float32x4_t acc[2][2]) {
    return hsum256(tsterm_m256(vaddq_f32(acc[0][0], acc[1][0]), vaddq_f32(acc[0][1], acc[1][1])));
}

/* Output rows [o_begin, o_end) times ROWS (1..4) quantized rows of x, as the x86 q4_rows below. */
#define DEFINE_Q4(ROWS)                                                                                      \
    static void q4_rows##ROWS(const int8_t *qx, const float *dx, const float *sx, int64_t in_f,             \
                              const uint8_t *codes, const uint16_t *scales, int64_t o_begin, int64_t o_end,  \
                              int64_t out_f, float *y) {                                                     \
        const int64_t nb = in_f / QBLOCK;                                                                    \
        float dd[ROWS][nb];                                                                                  \
        for (int64_t o = o_begin; o < o_end; o++) {                                                          \
            const uint8_t *c = codes + o * nb * 16;                                                          \
            const uint16_t *s = scales + o * nb * 2;                                                         \
            float32x4_t acc[ROWS][2][2], mt[ROWS][2]; /* [row][even / odd block][lanes 0-3 / 4-7] */         \
            float mrest[ROWS];                                                                               \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = vdupq_n_f32(0.0f);               \
                mt[r][0] = mt[r][1] = vdupq_n_f32(0.0f), mrest[r] = 0.0f;                                     \
            }                                                                                                \
            int64_t b = 0;                                                                                   \
            for (; b + 8 <= nb; b += 8) {                                                                    \
                const uint16x8x2_t dm = vld2q_u16(s + 2 * b); /* the d's, the m's */                         \
                const float32x4_t d[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(dm.val[0]))),       \
                                          vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(dm.val[0])))};     \
                const float32x4_t m[2] = {vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(dm.val[1]))),       \
                                          vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(dm.val[1])))};     \
                for (int r = 0; r < ROWS; r++)                                                               \
                    for (int h = 0; h < 2; h++) {                                                            \
                        vst1q_f32(&dd[r][b + 4 * h], vmulq_f32(d[h], vld1q_f32(dx + r * nb + b + 4 * h)));    \
                        mt[r][h] = vfmaq_f32(mt[r][h], m[h], vld1q_f32(sx + r * nb + b + 4 * h));            \
                    }                                                                                        \
            }                                                                                                \
            for (; b < nb; b++)                                                                              \
                for (int r = 0; r < ROWS; r++) {                                                             \
                    dd[r][b] = _cvtsh_ss(s[2 * b]) * dx[r * nb + b];                                          \
                    mrest[r] += _cvtsh_ss(s[2 * b + 1]) * sx[r * nb + b];                                     \
                }                                                                                            \
            for (b = 0; b < nb; b++) {                                                                       \
                const uint8x16_t bytes = vld1q_u8(c + b * 16);                                               \
                const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(15)));                   \
                const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));                              \
                for (int r = 0; r < ROWS; r++)                                                               \
                    block_fma(acc[r][b & 1], lo, hi, qx + r * in_f + b * QBLOCK, dd[r][b]);                  \
            }                                                                                                \
            for (int r = 0; r < ROWS; r++)                                                                   \
                y[r * out_f + o] = sum_accs(acc[r]) + hsum256(tsterm_m256(mt[r][0], mt[r][1])) + mrest[r];   \
        }                                                                                                    \
    }

#define DEFINE_Q8(ROWS)                                                                                      \
    static void q8_rows##ROWS(const int8_t *qx, const float *dx, const float *sx, int64_t in_f,             \
                              const int8_t *codes, const uint16_t *scales, int64_t o_begin, int64_t o_end,   \
                              int64_t out_f, float *y) {                                                     \
        (void)sx;                                                                                            \
        const int64_t nb = in_f / QBLOCK;                                                                    \
        float dd[ROWS][nb];                                                                                  \
        for (int64_t o = o_begin; o < o_end; o++) {                                                          \
            const int8_t *c = codes + o * in_f;                                                              \
            const uint16_t *s = scales + o * nb;                                                             \
            float32x4_t acc[ROWS][2][2];                                                                     \
            for (int r = 0; r < ROWS; r++)                                                                   \
                acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = vdupq_n_f32(0.0f);               \
            int64_t b = 0;                                                                                   \
            for (; b + 4 <= nb; b += 4) {                                                                    \
                const float32x4_t d = load_half4(s + b);                                                     \
                for (int r = 0; r < ROWS; r++) vst1q_f32(&dd[r][b], vmulq_f32(d, vld1q_f32(dx + r * nb + b))); \
            }                                                                                                \
            for (; b < nb; b++)                                                                              \
                for (int r = 0; r < ROWS; r++) dd[r][b] = _cvtsh_ss(s[b]) * dx[r * nb + b];                  \
            for (b = 0; b < nb; b++) {                                                                       \
                const int8x16_t lo = vld1q_s8(c + b * QBLOCK), hi = vld1q_s8(c + b * QBLOCK + 16);           \
                for (int r = 0; r < ROWS; r++)                                                               \
                    block_fma(acc[r][b & 1], lo, hi, qx + r * in_f + b * QBLOCK, dd[r][b]);                  \
            }                                                                                                \
            for (int r = 0; r < ROWS; r++) y[r * out_f + o] = sum_accs(acc[r]);                              \
        }                                                                                                    \
    }
#else
void tsterm_quantize_row(const float *x, int64_t in_f, int8_t *qx, float *dx_out, float *sx_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < in_f / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
        }
        const float dx = hmax256(amax) / 127.0f;
        const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  /* round half to even */
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_hadd_epi32(s, s);
        s = _mm_hadd_epi32(s, s);
        /* packs work within 128-bit lanes: the permute puts the 32 codes back in order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(qx + b * QBLOCK), _mm256_permutevar8x32_epi32(p, order));
        dx_out[b] = dx;
        sx_out[b] = dx * (float)_mm_cvtsi128_si32(s);
    }
}

/* sum over 32 lanes of u8 a * s8 b, as 8 int32 partial sums (each of 4 neighbouring products) converted to float.
 * With VNNI (AVX-VNNI, or AVX-512 VNNI on 256-bit registers) one vpdpbusd; else maddubs (pairs into int16) and
 * madd (pairs of those into int32). The same integers either way: no pair of products here reaches the int16
 * bound maddubs saturates at (|a| <= 127 against |b| <= 127 for q8, a <= 15 for q4), so the builds agree bit for
 * bit (tests/kernels run each). */
static inline __m256 dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b));
#else
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p);
#endif
}

static inline __m256i q4_codes(const uint8_t *c) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)c);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* Software prefetch of the weight rows PREFETCH_BYTES ahead of the one being multiplied (codes and scales, into L1).
 * One thread's decode reads ~100 MB of weights a token straight from memory, and the hardware prefetchers alone
 * kept too few cache-line misses in flight: the whole default model's GEMVs ran at 7.2-7.7 GB/s of the ~12 GB/s one
 * core copies at, 10-11 GB/s with this (Sapphire Rapids, one thread; 1-2 KB ahead all within 2%, 512 bytes and 4 KB
 * slower, and an added L2 prefetch 4-8 KB ahead lost the whole gain). Loads only: the arithmetic and its bits are
 * unchanged. */
#define PREFETCH_BYTES 1024

/* whole rows of `row_bytes` that cover PREFETCH_BYTES */
static inline int64_t rows_ahead(int64_t row_bytes) { return (PREFETCH_BYTES + row_bytes - 1) / row_bytes; }

/* the cache lines of one row's codes (c, c_bytes) and scales (s, s_bytes) `ahead` rows on (past the matrix's end:
 * prefetches do not fault) */
static inline void prefetch_row(const void *c, int64_t c_bytes, const void *s, int64_t s_bytes, int64_t ahead) {
    const char *pc = (const char *)c + ahead * c_bytes, *ps = (const char *)s + ahead * s_bytes;
    for (int64_t k = 0; k < c_bytes; k += 64) _mm_prefetch(pc + k, _MM_HINT_T0);
    for (int64_t k = 0; k < s_bytes; k += 64) _mm_prefetch(ps + k, _MM_HINT_T0);
}

/* 8 fp16 scales -> floats; and 8 interleaved (d, m) fp16 pairs -> d and m in block order. */
static inline __m256 load_half8(const uint16_t *s) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)); }

static inline void load_dm8(const uint16_t *s, __m256 *d, __m256 *m) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)s);
    const __m256 a = _mm256_cvtph_ps(_mm256_castsi256_si128(raw)), b = _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1));
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    *d = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), order);
    *m = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)), order);
}

/* Output rows [o_begin, o_end) times ROWS (1..4) quantized rows of x (codes qx [ROWS, I], block scales dx and
 * dx * sum(codes) sx [ROWS, I/32]). Per output row, the block scales are first combined with x's, 8 blocks at a
 * time (dd = d * dx; the m terms summed as m . sx), so the loop over blocks is the integer dot product and one
 * multiply-add. */
#define DEFINE_Q4(ROWS)                                                                                      \
    static void q4_rows##ROWS(const int8_t *qx, const float *dx, const float *sx, int64_t in_f,             \
                              const uint8_t *codes, const uint16_t *scales, int64_t o_begin, int64_t o_end,  \
                              int64_t out_f, float *y) {                                                     \
        const int64_t nb = in_f / QBLOCK;                                                                    \
        const int64_t ahead = rows_ahead(nb * 16);                                                           \
        float dd[ROWS][nb];                                                                                  \
        for (int64_t o = o_begin; o < o_end; o++) {                                                          \
            const uint8_t *c = codes + o * nb * 16;                                                          \
            const uint16_t *s = scales + o * nb * 2;                                                         \
            prefetch_row(c, nb * 16, s, nb * 4, ahead);                                                      \
            __m256 acc[ROWS][2], mt[ROWS];                                                                   \
            float mrest[ROWS];                                                                               \
            for (int r = 0; r < ROWS; r++)                                                                   \
                acc[r][0] = acc[r][1] = mt[r] = _mm256_setzero_ps(), mrest[r] = 0.0f;                        \
            int64_t b = 0;                                                                                   \
            for (; b + 8 <= nb; b += 8) {                                                                    \
                __m256 d, m;                                                                                 \
                load_dm8(s + 2 * b, &d, &m);                                                                 \
                for (int r = 0; r < ROWS; r++) {                                                             \
                    _mm256_storeu_ps(&dd[r][b], _mm256_mul_ps(d, _mm256_loadu_ps(dx + r * nb + b)));         \
                    mt[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + r * nb + b), mt[r]);                     \
                }                                                                                            \
            }                                                                                                \
            for (; b < nb; b++)                                                                              \
                for (int r = 0; r < ROWS; r++) {                                                             \
                    dd[r][b] = _cvtsh_ss(s[2 * b]) * dx[r * nb + b];                                          \
                    mrest[r] += _cvtsh_ss(s[2 * b + 1]) * sx[r * nb + b];                                     \
                }                                                                                            \
            for (b = 0; b < nb; b += 2) { /* two blocks, two accumulators: one FMA chain bounded the loop */  \
                const __m256i w0 = q4_codes(c + b * 16);                                                     \
                const __m256i w1 = b + 1 < nb ? q4_codes(c + b * 16 + 16) : _mm256_setzero_si256();          \
                for (int r = 0; r < ROWS; r++) {                                                             \
                    const int8_t *xr = qx + r * in_f + b * QBLOCK;                                           \
                    acc[r][0] = _mm256_fmadd_ps(dot_u8s8(w0, _mm256_loadu_si256((const __m256i *)xr)),       \
                                                _mm256_broadcast_ss(&dd[r][b]), acc[r][0]);                  \
                    if (b + 1 < nb)                                                                          \
                        acc[r][1] = _mm256_fmadd_ps(dot_u8s8(w1, _mm256_loadu_si256((const __m256i *)(xr + QBLOCK))), \
                                                    _mm256_broadcast_ss(&dd[r][b + 1]), acc[r][1]);          \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < ROWS; r++)                                                                   \
                y[r * out_f + o] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1])) + hsum256(mt[r]) + mrest[r];  \
        }                                                                                                    \
    }

#define DEFINE_Q8(ROWS)                                                                                      \
    static void q8_rows##ROWS(const int8_t *qx, const float *dx, const float *sx, int64_t in_f,             \
                              const int8_t *codes, const uint16_t *scales, int64_t o_begin, int64_t o_end,   \
                              int64_t out_f, float *y) {                                                     \
        (void)sx;                                                                                            \
        const int64_t nb = in_f / QBLOCK;                                                                    \
        const int64_t ahead = rows_ahead(in_f);                                                              \
        float dd[ROWS][nb];                                                                                  \
        for (int64_t o = o_begin; o < o_end; o++) {                                                          \
            const int8_t *c = codes + o * in_f;                                                              \
            const uint16_t *s = scales + o * nb;                                                             \
            prefetch_row(c, in_f, s, nb * 2, ahead);                                                         \
            __m256 acc[ROWS][2];                                                                             \
            for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                      \
            int64_t b = 0;                                                                                   \
            for (; b + 8 <= nb; b += 8) {                                                                    \
                const __m256 d = load_half8(s + b);                                                          \
                for (int r = 0; r < ROWS; r++)                                                               \
                    _mm256_storeu_ps(&dd[r][b], _mm256_mul_ps(d, _mm256_loadu_ps(dx + r * nb + b)));         \
            }                                                                                                \
            for (; b < nb; b++)                                                                              \
                for (int r = 0; r < ROWS; r++) dd[r][b] = _cvtsh_ss(s[b]) * dx[r * nb + b];                  \
            for (b = 0; b < nb; b += 2) {                                                                    \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(c + b * QBLOCK));                    \
                const __m256i w1 = b + 1 < nb ? _mm256_loadu_si256((const __m256i *)(c + b * QBLOCK + QBLOCK)) \
                                              : _mm256_setzero_si256();                                      \
                const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);                  \
                for (int r = 0; r < ROWS; r++) {                                                             \
                    const int8_t *xr = qx + r * in_f + b * QBLOCK;                                           \
                    acc[r][0] = _mm256_fmadd_ps(                                                             \
                        dot_u8s8(a0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xr), w0)),         \
                        _mm256_broadcast_ss(&dd[r][b]), acc[r][0]);                                          \
                    if (b + 1 < nb)                                                                          \
                        acc[r][1] = _mm256_fmadd_ps(                                                         \
                            dot_u8s8(a1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + QBLOCK)), w1)), \
                            _mm256_broadcast_ss(&dd[r][b + 1]), acc[r][1]);                                  \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < ROWS; r++) y[r * out_f + o] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));  \
        }                                                                                                    \
    }
#endif

DEFINE_Q4(1)
DEFINE_Q4(2)
DEFINE_Q4(3)
DEFINE_Q4(4)
DEFINE_Q8(1)
DEFINE_Q8(2)
DEFINE_Q8(3)
DEFINE_Q8(4)

typedef void (*rows_fn)(const int8_t *, const float *, const float *, int64_t, const void *, const uint16_t *,
                        int64_t, int64_t, int64_t, float *);
static const rows_fn Q4_ROWS[4] = {(rows_fn)q4_rows1, (rows_fn)q4_rows2, (rows_fn)q4_rows3, (rows_fn)q4_rows4};
static const rows_fn Q8_ROWS[4] = {(rows_fn)q8_rows1, (rows_fn)q8_rows2, (rows_fn)q8_rows3, (rows_fn)q8_rows4};

static void quant_rows(const rows_fn *fns, const int8_t *qx, const float *dx, const float *sx, int64_t rows,
                       int64_t in_f, const void *codes, const uint16_t *scales, int64_t first, int64_t last,
                       int64_t out_f, float *y) {
    const int64_t nb = in_f / QBLOCK;
    for (int64_t o = first; o < last; o += TILE) {  /* a tile of weight rows is read once for every row of x */
        const int64_t o_end = o + TILE < last ? o + TILE : last;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t n = rows - r0 < 4 ? rows - r0 : 4;
            fns[n - 1](qx + r0 * in_f, dx + r0 * nb, sx + r0 * nb, in_f, codes, scales, o, o_end, out_f, y + r0 * out_f);
        }
    }
}

void tsterm_quant_rows(int kind, const int8_t *qx, const float *dx, const float *sx, int64_t rows, int64_t in_f,
                       const void *codes, const uint16_t *scales, int64_t first, int64_t last, int64_t out_f, float *y) {
    quant_rows(kind == TSTERM_Q4 ? Q4_ROWS : Q8_ROWS, qx, dx, sx, rows, in_f, codes, scales, first, last, out_f, y);
}

/* Returns 0, or -1 when the scratch for x's codes could not be allocated. */
static int matmul(const rows_fn *fns, const float *x, int64_t rows, int64_t in_f, const void *codes,
                  const uint16_t *scales, int64_t out_f, float *y) {
    const int64_t nb = in_f / QBLOCK;
    int8_t *qx = aligned_alloc(64, (size_t)((rows * in_f + 63) / 64 * 64));
    float *dsx = malloc(sizeof(float) * (size_t)(rows * nb * 2));  /* dx [rows, I/32], then sx [rows, I/32] */
    if (!qx || !dsx) {
        free(qx);
        free(dsx);
        return -1;
    }
    float *const sx = dsx + rows * nb;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) tsterm_quantize_row(x + r * in_f, in_f, qx + r * in_f, dsx + r * nb, sx + r * nb);
        int64_t first, last;
        tsterm_thread_share(out_f, TILE, &first, &last);
        quant_rows(fns, qx, dsx, sx, rows, in_f, codes, scales, first, last, out_f, y);
    }
    free(qx);
    free(dsx);
    return 0;
}

int tsterm_q4_matmul(const float *x, int64_t rows, int64_t in_f, const uint8_t *codes, const uint16_t *scales,
                     int64_t out_f, float *y) {
    return matmul(Q4_ROWS, x, rows, in_f, codes, scales, out_f, y);
}

int tsterm_q8_matmul(const float *x, int64_t rows, int64_t in_f, const int8_t *codes, const uint16_t *scales,
                     int64_t out_f, float *y) {
    return matmul(Q8_ROWS, x, rows, in_f, codes, scales, out_f, y);
}

/* The float32 weight of q4 / q8 rows [O, I] (a prefill's many rows multiply it with torch's GEMM). */
void tsterm_q4_dequantize(const uint8_t *codes, const uint16_t *scales, int64_t out_f, int64_t in_f, float *w) {
    const int64_t nb = in_f / QBLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out_f; o++)
        for (int64_t b = 0; b < nb; b++)
            tsterm_q4_block(codes + (o * nb + b) * 16, scales + (o * nb + b) * 2, w + o * in_f + b * QBLOCK);
}

void tsterm_q8_dequantize(const int8_t *codes, const uint16_t *scales, int64_t out_f, int64_t in_f, float *w) {
    const int64_t nb = in_f / QBLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out_f; o++)
        for (int64_t b = 0; b < nb; b++)
            tsterm_q8_block(codes + o * in_f + b * QBLOCK, scales[o * nb + b], w + o * in_f + b * QBLOCK);
}
