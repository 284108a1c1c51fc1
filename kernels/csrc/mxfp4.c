/* Matmuls with an MXFP4 weight on the CPU: y[M, O] = x[M, I] @ W[O, I]^T, x float32, W read as stored
 * (tsterm_kernels.quant's "mxfp4": the OCP Microscaling format gpt-oss ships its experts in):
 *
 *   codes uint8 [O, I/2], scales uint8 [O, I/32]:   W[o, i] = e2m1(code) * 2^(scale - 127)
 *   byte j of a block's 16 holds input 2j in its low nibble and input 2j + 1 in its high one; e2m1 codes 0..7 are
 *   0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives; scale 0 is 2^-127, 255 is NaN.
 *
 * Each weight is decoded exactly: a table of the 16 values (AVX-512: one register, vpermps on the nibble; AVX2: the 8
 * magnitudes, vpermps on the low 3 bits and the sign bit moved into place) multiplied by the block's power of two
 * once per block. x stays float32 (no rounding of the activations, unlike the int8-row kernels of gemv.c).
 *
 * One order of arithmetic per (row, output), whatever the number of rows, the tile shapes and the ISA: 16 float32
 * lanes along the inputs, lane l of block b taking input 2l (the low nibbles) and then input 2l + 1 (the high ones)
 * by fused multiply-adds, blocks in order; then lanes l and l + 8 added, and hsum256's tree over the 8 sums. x's
 * rows are first permuted to that lane order (each block's even inputs, then its odd ones), so a lane's loads are
 * contiguous. AVX-512 holds the 16 lanes in one register, AVX2 in two: the same operations lane by lane, so both
 * builds give the same bits (tests/kernels run each), and a row's result is the same alone, in a batch or in a
 * prefill: the engine's invariance promise.
 *
 * Few rows (a decode, up to MX_R): each thread decodes its output rows' blocks in registers and multiplies them by
 * every row of x. More rows (a prefill): each thread decodes a panel of PANEL output rows once into float32 scratch
 * (the same values) and runs the same multiply-adds over it for every MX_R rows of x, so the decoding is paid once
 * per weight, not once per row group. Output rows are split over the OpenMP threads.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "tsterm.h"

#define MXBLOCK 32
#define PANEL 16 /* output rows a thread decodes at a time for many rows of x */

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0(uint8_t s) {
    if (s == 0) return 0x1p-127f;
    if (s == 255) return NAN;
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)s << 23};
    return v.f;
}

#if defined(__AVX512F__)
#define MX_R 4  /* rows of x per pass */
#define MX_NO 4 /* output rows per pass */
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float v16_sum(v16 a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}
/* a block's 32 weights: A (the low nibbles: inputs 0, 2, .., 30), B (the high ones: 1, 3, .., 31) */
static inline void decode_block(const uint8_t *c, uint8_t s, v16 *A, v16 *B) {
    const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(e8m0(s)));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *A = _mm512_permutexvar_ps(bytes, table); /* vpermps reads the index's low 4 bits */
    *B = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#else
#define MX_R 2
#define MX_NO 2
typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} v16;
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v16_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline float v16_sum(v16 a) { return hsum256(_mm256_add_ps(a.lo, a.hi)); }
/* 8 codes (the low nibble of each int32 lane's value) -> their values: magnitude by table, sign bit 3 -> bit 31 */
static inline __m256 decode8(__m256i codes, __m256 magnitudes) {
    const __m256 m = _mm256_permutevar8x32_ps(magnitudes, codes); /* reads the index's low 3 bits */
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(m, _mm256_castsi256_ps(sign));
}
static inline void decode_block(const uint8_t *c, uint8_t s, v16 *A, v16 *B) {
    const __m256 table = _mm256_mul_ps(_mm256_loadu_ps(E2M1), _mm256_set1_ps(e8m0(s)));
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8)));
    *A = (v16){decode8(lo, table), decode8(hi, table)};
    *B = (v16){decode8(_mm256_srli_epi32(lo, 4), table), decode8(_mm256_srli_epi32(hi, 4), table)};
}
#endif

/* xp [I] <- x [I] with each block's even inputs first, then its odd ones (the lanes' order) */
static void permute_row(const float *x, int64_t in_f, float *xp) {
    for (int64_t b = 0; b < in_f; b += MXBLOCK)
        for (int l = 0; l < 16; l++) xp[b + l] = x[b + 2 * l], xp[b + 16 + l] = x[b + 2 * l + 1];
}

#define INLINE static inline __attribute__((always_inline))

/* y[r, o] for rows [0, R) of xp and outputs [o0, o0 + NO) decoded from the codes as they go. (Inlined with
 * constant R and NO where it can be, so that the accumulators stay in registers.) */
INLINE void rows_codes(const float *xp, int64_t R, int64_t in_f, const uint8_t *codes, const uint8_t *scales,
                       int64_t o0, int64_t NO, int64_t out_f, float *y) {
    const int64_t nb = in_f / MXBLOCK;
    v16 acc[MX_R][MX_NO];
    for (int r = 0; r < MX_R; r++)
        for (int o = 0; o < MX_NO; o++) acc[r][o] = v16_zero();
    for (int64_t b = 0; b < nb; b++) {
        v16 A[MX_NO], B[MX_NO];
        for (int o = 0; o < NO; o++)
            decode_block(codes + ((o0 + o) * nb + b) * 16, scales[(o0 + o) * nb + b], &A[o], &B[o]);
        for (int r = 0; r < R; r++) {
            const v16 xa = v16_load(xp + r * in_f + b * MXBLOCK), xb = v16_load(xp + r * in_f + b * MXBLOCK + 16);
            for (int o = 0; o < NO; o++) acc[r][o] = v16_fma(xb, B[o], v16_fma(xa, A[o], acc[r][o]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < NO; o++) y[r * out_f + o0 + o] = v16_sum(acc[r][o]);
}

/* The same for outputs decoded into a panel (panel [NO][I] floats in the lanes' order). */
INLINE void rows_panel(const float *xp, int64_t R, int64_t in_f, const float *panel, int64_t o0, int64_t NO,
                       int64_t out_f, float *y) {
    v16 acc[MX_R][MX_NO];
    for (int r = 0; r < MX_R; r++)
        for (int o = 0; o < MX_NO; o++) acc[r][o] = v16_zero();
    for (int64_t k = 0; k < in_f; k += MXBLOCK) {
        v16 A[MX_NO], B[MX_NO];
        for (int o = 0; o < NO; o++) A[o] = v16_load(panel + o * in_f + k), B[o] = v16_load(panel + o * in_f + k + 16);
        for (int r = 0; r < R; r++) {
            const v16 xa = v16_load(xp + r * in_f + k), xb = v16_load(xp + r * in_f + k + 16);
            for (int o = 0; o < NO; o++) acc[r][o] = v16_fma(xb, B[o], v16_fma(xa, A[o], acc[r][o]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < NO; o++) y[r * out_f + o0 + o] = v16_sum(acc[r][o]);
}

static void codes_full(const float *xp, int64_t R, int64_t in_f, const uint8_t *codes, const uint8_t *scales,
                       int64_t o0, int64_t out_f, float *y) {
    switch (R) {
        case 1: rows_codes(xp, 1, in_f, codes, scales, o0, MX_NO, out_f, y); break;
        case 2: rows_codes(xp, 2, in_f, codes, scales, o0, MX_NO, out_f, y); break;
#if MX_R > 2
        case 3: rows_codes(xp, 3, in_f, codes, scales, o0, MX_NO, out_f, y); break;
        case 4: rows_codes(xp, 4, in_f, codes, scales, o0, MX_NO, out_f, y); break;
#endif
    }
}

static void codes_part(const float *xp, int64_t R, int64_t in_f, const uint8_t *codes, const uint8_t *scales,
                       int64_t o0, int64_t NO, int64_t out_f, float *y) {
    rows_codes(xp, R, in_f, codes, scales, o0, NO, out_f, y);
}

static void panel_full(const float *xp, int64_t in_f, const float *panel, int64_t o0, int64_t out_f, float *y) {
    rows_panel(xp, MX_R, in_f, panel, o0, MX_NO, out_f, y);
}

static void panel_part(const float *xp, int64_t R, int64_t in_f, const float *panel, int64_t o0, int64_t NO,
                       int64_t out_f, float *y) {
    rows_panel(xp, R, in_f, panel, o0, NO, out_f, y);
}

/* Returns 0, or -1 when the scratch (x permuted, the panels) could not be allocated. */
int tsterm_mxfp4_matmul(const float *x, int64_t rows, int64_t in_f, const uint8_t *codes, const uint8_t *scales,
                        int64_t out_f, float *y) {
    if (rows <= 0 || out_f <= 0) return 0;
    const int64_t nb = in_f / MXBLOCK;
    const int panels = rows > MX_R;
    const size_t panel_floats = (size_t)(PANEL * in_f);
    float *xp = aligned_alloc(64, sizeof(float) * (size_t)((rows * in_f + 15) / 16 * 16));
    float *scratch = panels ? aligned_alloc(64, sizeof(float) * panel_floats * (size_t)omp_get_max_threads()) : NULL;
    if (!xp || (panels && !scratch)) {
        free(xp), free(scratch);
        return -1;
    }
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) permute_row(x + r * in_f, in_f, xp + r * in_f);
        int64_t first, last;
        tsterm_thread_share(out_f, PANEL, &first, &last);
        float *panel = panels ? scratch + panel_floats * (size_t)omp_get_thread_num() : NULL;
        for (int64_t t0 = first; t0 < last; t0 += PANEL) {
            const int64_t t1 = t0 + PANEL < last ? t0 + PANEL : last;
            if (panels) {
                for (int64_t o = t0; o < t1; o++)
                    for (int64_t b = 0; b < nb; b++) {
                        v16 A, B;
                        decode_block(codes + (o * nb + b) * 16, scales[o * nb + b], &A, &B);
                        v16_store(panel + (o - t0) * in_f + b * MXBLOCK, A);
                        v16_store(panel + (o - t0) * in_f + b * MXBLOCK + 16, B);
                    }
                for (int64_t r0 = 0; r0 < rows; r0 += MX_R)
                    for (int64_t o = t0; o < t1; o += MX_NO) {
                        const int64_t R = rows - r0 < MX_R ? rows - r0 : MX_R, NO = t1 - o < MX_NO ? t1 - o : MX_NO;
                        if (R == MX_R && NO == MX_NO)
                            panel_full(xp + r0 * in_f, in_f, panel + (o - t0) * in_f, o, out_f, y + r0 * out_f);
                        else
                            panel_part(xp + r0 * in_f, R, in_f, panel + (o - t0) * in_f, o, NO, out_f, y + r0 * out_f);
                    }
            } else {
                for (int64_t o = t0; o < t1; o += MX_NO) {
                    if (t1 - o >= MX_NO)
                        codes_full(xp, rows, in_f, codes, scales, o, out_f, y);
                    else
                        codes_part(xp, rows, in_f, codes, scales, o, t1 - o, out_f, y);
                }
            }
        }
    }
    free(xp), free(scratch);
    return 0;
}

/* The float32 weight [O, I] of mxfp4 codes and scales, in input order (the torch fallback's twin; tests). */
void tsterm_mxfp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t out_f, int64_t in_f, float *w) {
    const int64_t nb = in_f / MXBLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out_f; o++)
        for (int64_t b = 0; b < nb; b++) {
            const float s = e8m0(scales[o * nb + b]);
            const uint8_t *c = codes + (o * nb + b) * 16;
            for (int j = 0; j < 16; j++) {
                w[o * in_f + b * MXBLOCK + 2 * j] = E2M1[c[j] & 15] * s;
                w[o * in_f + b * MXBLOCK + 2 * j + 1] = E2M1[c[j] >> 4] * s;
            }
        }
}
