/* float32 matmul for prefill-sized x on the CPU: y[M, O] = x[M, I] @ W[O, I]^T, W in nn.Linear's layout, float32
 * or int8 / int4 blocks (tsterm_q_gemm: each panel dequantized as it is packed).
 *
 * Why not torch's (MKL's) sgemm: on these AVX2 cores MKL runs the shapes prefill gives an MoE's experts (tens of
 * rows against a 1-4 MB weight) at 100-120 GFLOP/s on two cores, while the cores peak at about 180
 * (benchmarks/prefill_kernels.py, BENCHMARKS.md). This is the textbook register-blocked kernel instead:
 *
 * - a 6 x 16 tile of y lives in 12 ymm accumulators; each step over the inputs broadcasts one value of each of the
 *   six x rows and multiplies it with 16 consecutive outputs' weights (two loads), 12 FMAs for 8 loads;
 * - those 16 outputs' weights are first packed, KC inputs at a time, into [KC][16] (an 8 x 8 transpose in
 *   registers), 16 KB that stay in L1 while every 6-row tile of x passes over them; x goes MC rows at a time (their
 *   KC inputs, 384 KB, stay in L2), so W is read from memory once per MC rows: at 2048 rows, without that
 *   blocking, x came from L3 for every panel and the kernel fell to 130 GFLOP/s against MKL's 156 (158 with it);
 * - x rows are read in place (rows `ldx` apart) and the tile of y is stored (first input block) or added to.
 *
 * Output columns are split over the OpenMP threads in whole panels of 16. A tail of fewer than 6 rows runs a
 * narrower tile of the same loop; a tail of fewer than 16 outputs is packed zero-padded and stored through a small
 * buffer. The sums run in a different order than MKL's, so results agree to float32 rounding, not bit for bit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "tsterm.h"

#define KC 256 /* inputs per packed block: [KC][16] floats = 16 KB */
#define MC 384 /* rows of x per pass over the weights */

#if defined(__aarch64__)
/* aarch64: the same tile in NEON, 16 outputs as four q registers per row (24 accumulators for 6 rows of the 32
 * registers); each output's sum is the AVX2 tile's: a chain of fused multiply-adds from zero over the block's inputs
 * in order, then added to y, so the same bits. */
#define DEFINE_TILE(ROWS)                                                                                          \
    static void tile##ROWS(int64_t kc, const float *x, int64_t ldx, const float *packed, float *y, int64_t ldy,   \
                           int add) {                                                                               \
        float32x4_t acc[ROWS][4];                                                                                   \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++)                                                      \
            acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = vdupq_n_f32(0.0f);                                      \
        for (int64_t k = 0; k < kc; k++) {                                                                          \
            const float32x4_t b0 = vld1q_f32(packed + k * NR), b1 = vld1q_f32(packed + k * NR + 4),                \
                              b2 = vld1q_f32(packed + k * NR + 8), b3 = vld1q_f32(packed + k * NR + 12);           \
            _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {                                                \
                const float32x4_t a = vld1q_dup_f32(x + r * ldx + k);                                              \
                acc[r][0] = vfmaq_f32(acc[r][0], a, b0);                                                            \
                acc[r][1] = vfmaq_f32(acc[r][1], a, b1);                                                            \
                acc[r][2] = vfmaq_f32(acc[r][2], a, b2);                                                            \
                acc[r][3] = vfmaq_f32(acc[r][3], a, b3);                                                            \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {                                                    \
            float *o = y + r * ldy;                                                                                 \
            for (int i = 0; i < 4; i++)                                                                             \
                vst1q_f32(o + 4 * i, add ? vaddq_f32(acc[r][i], vld1q_f32(o + 4 * i)) : acc[r][i]);                 \
        }                                                                                                           \
    }
#else
/* y tile [ROWS][16] (rows ldy apart) = (or +=) x rows [ROWS][kc] (ldx apart) @ packed [kc][16] */
#define DEFINE_TILE(ROWS)                                                                                          \
    static void tile##ROWS(int64_t kc, const float *x, int64_t ldx, const float *packed, float *y, int64_t ldy,   \
                           int add) {                                                                               \
        __m256 acc[ROWS][2];                                                                                        \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();         \
        for (int64_t k = 0; k < kc; k++) {                                                                          \
            const __m256 b0 = _mm256_load_ps(packed + k * NR), b1 = _mm256_load_ps(packed + k * NR + 8);            \
            _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {                                                \
                const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                                              \
                acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);                                                      \
                acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);                                                      \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {                                                    \
            float *o = y + r * ldy;                                                                                 \
            if (add) {                                                                                              \
                acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_loadu_ps(o));                                           \
                acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_loadu_ps(o + 8));                                       \
            }                                                                                                       \
            _mm256_storeu_ps(o, acc[r][0]);                                                                         \
            _mm256_storeu_ps(o + 8, acc[r][1]);                                                                     \
        }                                                                                                           \
    }
#endif

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, float *, int64_t, int);
static const tile_fn TILES[MR] = {tile1, tile2, tile3, tile4, tile5, tile6};

#if defined(__aarch64__)
/* columns k..k+3 of four rows: c[j] = (r[0][k + j], r[1][k + j], r[2][k + j], r[3][k + j]) */
static inline void transpose4(const float *const r[4], int64_t k, float32x4_t c[4]) {
    const float32x4_t r0 = vld1q_f32(r[0] + k), r1 = vld1q_f32(r[1] + k);
    const float32x4_t r2 = vld1q_f32(r[2] + k), r3 = vld1q_f32(r[3] + k);
    const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1)), t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));
    const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3)), t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));
    c[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)), c[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
    c[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)), c[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
}

void tsterm_pack16(const float *const *rows, int64_t n, int64_t len, float *packed) {
    int64_t k = 0;
    if (n == NR)
        for (; k + 4 <= len; k += 4)
            for (int g = 0; g < 4; g++) { /* rows 4g..4g+3: a 4 x 4 transpose */
                float32x4_t c[4];
                transpose4(rows + 4 * g, k, c);
                for (int j = 0; j < 4; j++) vst1q_f32(packed + (k + j) * NR + 4 * g, c[j]);
            }
    for (; k < len; k++)
        for (int64_t j = 0; j < NR; j++) packed[k * NR + j] = j < n ? rows[j][k] : 0.0f;
}
#else
/* packed [len][16] <- rows[0..n) [len] transposed (n <= 16); outputs n..15 are zero */
void tsterm_pack16(const float *const *rows, int64_t n, int64_t len, float *packed) {
    int64_t k = 0;
    if (n == NR) {
        for (; k + 8 <= len; k += 8) {
            for (int h = 0; h < 2; h++) { /* rows 8h..8h+7: an 8 x 8 transpose */
                const float *const *s = rows + 8 * h;
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(s[i] + k);
                tsterm_transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_store_ps(packed + (k + i) * NR + h * 8, r[i]);
            }
        }
    }
    for (; k < len; k++)
        for (int64_t j = 0; j < NR; j++) packed[k * NR + j] = j < n ? rows[j][k] : 0.0f;
}
#endif

void tsterm_f32_tile(int64_t rows, int64_t kc, const float *x, int64_t ldx, const float *packed, float *y,
                     int64_t ldy, int add) {
    TILES[rows - 1](kc, x, ldx, packed, y, ldy, add);
}

/* Where a panel's weights come from: float32 rows, or int8 / int4 blocks of 32 inputs (quant.py's layouts: GGUF
 * Q8_0 / Q4_1 bytes, fp16 scales), dequantized 16 rows x KC inputs at a time into an L1-sized buffer and packed from
 * there, so a quantized prefill never writes its weight out as float32 (the whole matrix, once a call, before). */
typedef struct {
    int kind; /* TSTERM_F32, TSTERM_Q8 or TSTERM_Q4 (tsterm.h) */
    const void *data; /* float rows [O, I]; int8 codes [O, I]; int4 bytes [O, I / 2] */
    const uint16_t *scales; /* q8: [O, I / 32] d; q4: [O, I / 32][2] (d, m) */
    int64_t in_f;
} wsource;

/* rows[j] <- weight row o + j's inputs [k0, k0 + kc) as float32 (kc, k0 multiples of 32 for the quantized kinds) */
static void weight_rows(const wsource *w, int64_t o, int64_t n, int64_t k0, int64_t kc, const float **rows,
                        float *scratch) {
    const int64_t in_f = w->in_f, nb = in_f / 32;
    for (int64_t j = 0; j < n; j++) {
        if (w->kind == TSTERM_F32) {
            rows[j] = (const float *)w->data + (o + j) * in_f + k0;
            continue;
        }
        float *dst = scratch + j * KC;
        rows[j] = dst;
        for (int64_t b = k0 / 32; b < (k0 + kc) / 32; b++, dst += 32) {
            if (w->kind == TSTERM_Q8)
                tsterm_q8_block((const int8_t *)w->data + (o + j) * in_f + b * 32, w->scales[(o + j) * nb + b], dst);
            else
                tsterm_q4_block((const uint8_t *)w->data + ((o + j) * nb + b) * 16, w->scales + ((o + j) * nb + b) * 2,
                                dst);
        }
    }
}

/* y[m0..m1, o..o+n) = (add: y +) x[m0..m1, k0..k0+kc) @ W[o..o+n, k0..k0+kc)^T: one packed panel of W, every
 * 6-row tile of x over it */
static void panel(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k0, int64_t kc, const wsource *w,
                  int64_t o, int64_t n, float *y, int64_t out_f, float *packed, float *scratch) {
    float edge[MR * NR]; /* a tile's outputs when fewer than 16 remain */
    const int add = k0 > 0;
    const float *w_rows[NR];
    weight_rows(w, o, n, k0, kc, w_rows, scratch);
    tsterm_pack16(w_rows, n, kc, packed);
    for (int64_t m = m0; m < m1; m += MR) {
        const int64_t mr = m1 - m < MR ? m1 - m : MR;
        float *yt = y + m * out_f + o;
        if (n == NR) {
            TILES[mr - 1](kc, x + m * ldx + k0, ldx, packed, yt, out_f, add);
            continue;
        }
        TILES[mr - 1](kc, x + m * ldx + k0, ldx, packed, edge, NR, 0);
        for (int64_t r = 0; r < mr; r++)
            for (int64_t j = 0; j < n; j++) yt[r * out_f + j] = add ? yt[r * out_f + j] + edge[r * NR + j] : edge[r * NR + j];
    }
}

#ifdef __AVX512F__
/* AVX-512 (built where the compiler targets it: -march=native on a CPU with AVX-512F): two packed panels, 32
 * outputs, side by side in two zmm accumulators per row, 8 rows a tile: 16 FMAs for 2 loads and 8 broadcasts
 * (folded into the FMAs), where the AVX2 tile does 12 for 8. Each output's sum is the AVX2 tile's exactly: per KC
 * block a chain of FMAs from zero over the block's inputs in order, then added to the earlier blocks' total, so
 * the two builds give the same bits (tests/kernels run both) and the invariance promise holds across them. */
#define MR512 8
#define PF_HINT _MM_HINT_T2 /* into L2: the next pair's 32 KB in L1 would push out this pair's packed panels */
/* one input k of a tile: 2 ROWS FMAs */
#define TILE512_STEP(ROWS)                                                                                         \
    do {                                                                                                            \
        const __m512 b0 = _mm512_load_ps(pa + k * NR), b1 = _mm512_load_ps(pb + k * NR);                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                    \
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);                                                        \
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);                                                          \
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);                                                          \
        }                                                                                                           \
    } while (0)
/* a tile of y [ROWS][32] (= or += x [ROWS][kc] @ the two packed panels); its first npf (<= kc) input steps each
 * prefetch one line of the next panel pair's weights, pf[k] */
#define DEFINE_TILE512(ROWS)                                                                                       \
    static void tile512_##ROWS(int64_t kc, const float *x, int64_t ldx, const float *pa, const float *pb,         \
                               float *y, int64_t ldy, int add, const char *const *pf, int64_t npf) {              \
        __m512 acc[ROWS][2];                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();         \
        int64_t k = 0;                                                                                              \
        for (; k < npf; k++) {                                                                                      \
            _mm_prefetch(pf[k], PF_HINT);                                                                           \
            TILE512_STEP(ROWS);                                                                                     \
        }                                                                                                           \
        for (; k < kc; k++) TILE512_STEP(ROWS);                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                                    \
            float *o = y + r * ldy;                                                                                 \
            if (add) {                                                                                              \
                acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(o));                                           \
                acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(o + NR));                                      \
            }                                                                                                       \
            _mm512_storeu_ps(o, acc[r][0]);                                                                         \
            _mm512_storeu_ps(o + NR, acc[r][1]);                                                                    \
        }                                                                                                           \
    }

DEFINE_TILE512(1)
DEFINE_TILE512(2)
DEFINE_TILE512(3)
DEFINE_TILE512(4)
DEFINE_TILE512(5)
DEFINE_TILE512(6)
DEFINE_TILE512(7)
DEFINE_TILE512(8)

typedef void (*tile512_fn)(int64_t, const float *, int64_t, const float *, const float *, float *, int64_t, int,
                           const char *const *, int64_t);
static const tile512_fn TILES512[MR512] = {tile512_1, tile512_2, tile512_3, tile512_4,
                                           tile512_5, tile512_6, tile512_7, tile512_8};

/* tsterm_pack16 for 16 rows with 512-bit shuffles: a 16 x 16 transpose is 64 of them for 256 values, where the
 * AVX2 build's two 8 x 8 ones take 96 for the same (the shuffle port is what packing waits on once W is in the
 * cache: 15% of a 54-row call). The same values land in the same places, so the bits cannot change. */
static void pack16_512(const float *const *rows, int64_t len, float *packed) {
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m512 r[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i] + k);
        for (int g = 0; g < 4; g++) { /* rows 4g..4g+3: u[4g + c] lane L = their column 4L + c */
            const __m512 t0 = _mm512_unpacklo_ps(r[4 * g], r[4 * g + 1]), t1 = _mm512_unpackhi_ps(r[4 * g], r[4 * g + 1]);
            const __m512 t2 = _mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]),
                         t3 = _mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]);
            u[4 * g] = _mm512_shuffle_ps(t0, t2, 0x44), u[4 * g + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
            u[4 * g + 2] = _mm512_shuffle_ps(t1, t3, 0x44), u[4 * g + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
        }
        for (int c = 0; c < 4; c++) { /* column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
            const __m512 s0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), s1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
            const __m512 s2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44),
                         s3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
            float *o = packed + (k + c) * NR;
            _mm512_store_ps(o + 0 * NR, _mm512_shuffle_f32x4(s0, s2, 0x88));
            _mm512_store_ps(o + 4 * NR, _mm512_shuffle_f32x4(s0, s2, 0xDD));
            _mm512_store_ps(o + 8 * NR, _mm512_shuffle_f32x4(s1, s3, 0x88));
            _mm512_store_ps(o + 12 * NR, _mm512_shuffle_f32x4(s1, s3, 0xDD));
        }
    }
    if (k < len) { /* the last inputs (len not a multiple of 16) */
        const float *tail[NR];
        for (int i = 0; i < NR; i++) tail[i] = rows[i] + k;
        tsterm_pack16(tail, NR, len - k, packed + k * NR);
    }
}

/* The bytes of W that rows o..o+31's inputs [k0, k0 + kc) take (32 runs `stride` apart, `bytes` long each): what
 * panel_pair packs next, fetched while this pair's tiles run. Packing reads W 16 rows at a time, 1 KB a row, and
 * the hardware prefetchers do not keep up with that: at 54 rows (an expert's share of a 216-token extend) packing,
 * mostly waiting for W, took 40% of the call (170 GFLOP/s with it skipped, 104 with it, one core). Spread one line
 * per input step over the tiles, the fetch overlaps the FMAs: 1.06-1.09x on the prefill shapes (BENCHMARKS.md). A
 * prefetch changes no value the sums see, so the bits are the same. */
typedef struct {
    const char *base;
    int64_t stride, bytes;
} wspan;

static wspan weight_span(const wsource *w, int64_t o, int64_t k0, int64_t kc) {
    const int64_t in_f = w->in_f;
    if (w->kind == TSTERM_F32)
        return (wspan){(const char *)w->data + (o * in_f + k0) * 4, in_f * 4, kc * 4};
    if (w->kind == TSTERM_Q8) return (wspan){(const char *)w->data + o * in_f + k0, in_f, kc};
    return (wspan){(const char *)w->data + o * (in_f / 2) + k0 / 2, in_f / 2, kc / 2}; /* int4: 16 bytes a block */
}

/* y[m0..m1, o..o+32) as `panel` computes it, two full panels of 16 at once; `next` (bytes 0: none) is prefetched,
 * its lines shared out evenly over the tiles */
static void panel_pair(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k0, int64_t kc, const wsource *w,
                       int64_t o, float *y, int64_t out_f, float *packed, float *scratch, wspan next) {
    const float *w_rows[NR];
    weight_rows(w, o, NR, k0, kc, w_rows, scratch);
    pack16_512(w_rows, kc, packed);
    weight_rows(w, o + NR, NR, k0, kc, w_rows, scratch);
    pack16_512(w_rows, kc, packed + KC * NR);
    const char *pf[2 * NR * (KC * sizeof(float) / 64)]; /* the lines of `next`, in order */
    int64_t lines = 0;
    for (int64_t row = 0; row < 2 * NR && next.bytes; row++)
        for (int64_t at = 0; at < next.bytes; at += 64) pf[lines++] = next.base + row * next.stride + at;
    const int64_t tiles = (m1 - m0 + MR512 - 1) / MR512;
    int64_t line = 0;
    for (int64_t m = m0, t = 1; m < m1; m += MR512, t++) {
        const int64_t end = lines * t / tiles, npf = end - line < kc ? end - line : kc;
        for (; line < end - npf; line++) _mm_prefetch(pf[line], PF_HINT); /* more than one a step: the rest now */
        const int64_t mr = m1 - m < MR512 ? m1 - m : MR512;
        TILES512[mr - 1](kc, x + m * ldx + k0, ldx, packed, packed + KC * NR, y + m * out_f + o, out_f, k0 > 0,
                         pf + line, npf);
        line = end;
    }
}
#define GEMM_UNIT (2 * NR)
#else
#define GEMM_UNIT NR
#endif

static void gemm_share(const float *x, int64_t ldx, int64_t rows, const wsource *w, int64_t out_f, float *y) {
    float packed[2 * KC * NR] __attribute__((aligned(64)));
    float scratch[w->kind == TSTERM_F32 ? 1 : NR * KC]; /* a quantized panel's rows, dequantized */
    const int64_t in_f = w->in_f;
    int64_t first, last;
    tsterm_thread_share(out_f, GEMM_UNIT, &first, &last);
    int64_t mc = MC;
#ifdef __AVX512F__
    /* Rows a pass: where MC rows of x overflow half of L2 (1 MB, the pair-at-a-time order below) but 128 or more fit,
     * passes of equal size that fit, W packed once a pass: at 384 rows x 1024 inputs, two passes of 192 rows. A
     * row's sums do not depend on the pass it falls in, so the bits are the same. */
    const int64_t fit = ((1 << 20) / (in_f * (int64_t)sizeof(float))) / MR512 * MR512;
    if (rows * in_f * (int64_t)sizeof(float) > (1 << 20) && fit >= 128) {
        const int64_t passes = (rows + fit - 1) / fit;
        mc = ((rows + passes - 1) / passes + MR512 - 1) / MR512 * MR512;
    }
#endif
    for (int64_t m0 = 0; m0 < rows; m0 += mc) {
        const int64_t m1 = rows - m0 < mc ? rows : m0 + mc;
        int64_t o0 = first;
#ifdef __AVX512F__
        /* Where this pass's rows of x fit in half of L2 (1 MB), each pair of panels takes all its input blocks
         * before the next pair: its 32 columns of y stay in L1 across the blocks, where going block by block over
         * every output re-read all of y from memory per block (1.15x on SmolLM2's 3072 x 576 at 256 rows, one
         * core); the blocks still go in order for each output, so the sums and the bits are the same. */
        if ((m1 - m0) * in_f * (int64_t)sizeof(float) <= (1 << 20))
            for (; o0 + 2 * NR <= last; o0 += 2 * NR)
                for (int64_t k0 = 0; k0 < in_f; k0 += KC) {
                    const int64_t kn = k0 + KC < in_f ? k0 + KC : 0, on = kn ? o0 : o0 + 2 * NR; /* the next pair */
                    const wspan next = on + 2 * NR <= last ? weight_span(w, on, kn, in_f - kn < KC ? in_f - kn : KC)
                                                           : (wspan){NULL, 0, 0};
                    panel_pair(x, ldx, m0, m1, k0, in_f - k0 < KC ? in_f - k0 : KC, w, o0, y, out_f, packed, scratch,
                               next);
                }
#endif
        for (int64_t k0 = 0; k0 < in_f; k0 += KC) {
            const int64_t kc = in_f - k0 < KC ? in_f - k0 : KC;
            int64_t o = o0;
#ifdef __AVX512F__
            for (; o + 2 * NR <= last; o += 2 * NR) {
                const int64_t kn = k0 + KC; /* the next pair: this block's next, else the next block's first */
                const wspan next = o + 4 * NR <= last ? weight_span(w, o + 2 * NR, k0, kc)
                                   : kn < in_f        ? weight_span(w, o0, kn, in_f - kn < KC ? in_f - kn : KC)
                                                      : (wspan){NULL, 0, 0};
                panel_pair(x, ldx, m0, m1, k0, kc, w, o, y, out_f, packed, scratch, next);
            }
#endif
            for (; o < last; o += NR)
                panel(x, ldx, m0, m1, k0, kc, w, o, last - o < NR ? last - o : NR, y, out_f, packed, scratch);
        }
    }
}

/* What this build's kernels use beyond AVX2 / FMA / F16C (tsterm_kernels.cpu_native reports it): bit 0 AVX-512F
 * (the GEMM's 512-bit tile), bit 1 AVX-512 VNNI or AVX-VNNI (the int8 dot products). */
int tsterm_isa(void) {
    int isa = 0;
#ifdef __AVX512F__
    isa |= 1;
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)) /* gemv.c's dot_u8s8 */
    isa |= 2;
#endif
#if defined(__aarch64__) /* bit 2: the NEON code (gemv.c, gemm.c), bit 3: with the dotprod extension's sdot */
    isa |= 4;
#if defined(__ARM_FEATURE_DOTPROD)
    isa |= 8;
#endif
#endif
    return isa;
}

void tsterm_f32_gemm_share(const float *x, int64_t ldx, int64_t rows, int64_t in_f, const float *w, int64_t out_f,
                           float *y) {
    const wsource src = {TSTERM_F32, w, NULL, in_f};
    gemm_share(x, ldx, rows, &src, out_f, y);
}

/* y [rows, O] = x [rows, I] @ W^T for W int8 (kind TSTERM_Q8) or int4 (TSTERM_Q4) blocks of 32 inputs (I a multiple
 * of 32): the same kernel and summation order as tsterm_f32_gemm on the dequantized weight, so the same bits. */
void tsterm_q_gemm(const float *x, int64_t ldx, int64_t rows, int64_t in_f, int kind, const void *codes,
                   const uint16_t *scales, int64_t out_f, float *y) {
    const wsource src = {kind, codes, scales, in_f};
#pragma omp parallel
    gemm_share(x, ldx, rows, &src, out_f, y);
}

void tsterm_f32_gemm(const float *x, int64_t ldx, int64_t rows, int64_t in_f, const float *w, int64_t out_f,
                     float *y) {
#pragma omp parallel
    tsterm_f32_gemm_share(x, ldx, rows, in_f, w, out_f, y);
}

/* Few rows of x (decode) in the GEMM's summation order, without packing the weight into memory: each output's sum
 * is, per KC block of inputs, a chain of FMAs from zero over the block's inputs in order, added to the earlier blocks'
 * total (tile##ROWS's order), so a row's result is bitwise the same whether it runs here or in a GEMM of any number
 * of rows (the engine's invariance promise: README "Same answer whatever the batch"). The weight is read in place:
 * 8 x 8 blocks (8 outputs' rows, 8 inputs) are transposed in registers into the 8 inputs' columns, and each column
 * multiplies a broadcast input of every row of x. Two blocks of 8 outputs at a time: two independent FMA chains. */
#if defined(__aarch64__)
/* aarch64: the same order in NEON: 4 x 4 blocks of the weight transposed in registers (transpose4, above), each
 * input's column of 16 outputs multiplied by that input of every row of x (a lane of the row's 4 inputs). */
static inline float32x4_t column4(const float *const r[4], int64_t k) {
    const float c[4] = {r[0][k], r[1][k], r[2][k], r[3][k]};
    return vld1q_f32(c);
}

#define DEFINE_COLS(ROWS)                                                                                          \
    static void cols##ROWS(const float *x, int64_t ldx, int64_t in_f, const float *const r[16], float *y,          \
                           int64_t ldy, int64_t n) {                                                                \
        float32x4_t total[ROWS][4] = {{vdupq_n_f32(0.0f)}}; /* (every element set by the first block) */             \
        for (int64_t k0 = 0; k0 < in_f; k0 += KC) {                                                                 \
            const int64_t k1 = in_f - k0 < KC ? in_f : k0 + KC;                                                     \
            float32x4_t acc[ROWS][4];                                                                               \
            for (int q = 0; q < ROWS; q++) for (int g = 0; g < 4; g++) acc[q][g] = vdupq_n_f32(0.0f);               \
            int64_t k = k0;                                                                                         \
            for (; k + 4 <= k1; k += 4) {                                                                           \
                float32x4_t w[4][4]; /* w[g][j]: outputs 4g..4g+3 at input k + j */                                 \
                for (int g = 0; g < 4; g++) transpose4(r + 4 * g, k, w[g]);                                         \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)                                                 \
                    for (int q = 0; q < ROWS; q++) {                                                                \
                        const float32x4_t xj = vld1q_dup_f32(x + q * ldx + k + j);                                  \
                        for (int g = 0; g < 4; g++) acc[q][g] = vfmaq_f32(acc[q][g], xj, w[g][j]);                  \
                    }                                                                                               \
            }                                                                                                       \
            for (; k < k1; k++)                                                                                     \
                for (int g = 0; g < 4; g++) {                                                                       \
                    const float32x4_t col = column4(r + 4 * g, k);                                                  \
                    for (int q = 0; q < ROWS; q++) acc[q][g] = vfmaq_f32(acc[q][g], vdupq_n_f32(x[q * ldx + k]), col); \
                }                                                                                                   \
            for (int q = 0; q < ROWS; q++) /* the tile's order: this block's chain + the blocks before */           \
                for (int g = 0; g < 4; g++) total[q][g] = k0 ? vaddq_f32(acc[q][g], total[q][g]) : acc[q][g];       \
        }                                                                                                           \
        for (int q = 0; q < ROWS; q++) {                                                                            \
            float out[16];                                                                                          \
            for (int g = 0; g < 4; g++) vst1q_f32(out + 4 * g, total[q][g]);                                        \
            for (int64_t j = 0; j < n; j++) y[q * ldy + j] = out[j];                                                \
        }                                                                                                           \
    }
#else
/* tsterm_transpose8 of columns k..k+7 of 8 rows, written out with the loads inside the unpacks: loading into an array
 * and calling tsterm_transpose8 made the AVX-512 build's expert GEMMs 7-10% slower (prefill_kernels.py, one thread) */
static inline void transpose8(const float *const r[8], int64_t k, __m256 t[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[0] + k), _mm256_loadu_ps(r[1] + k));
    const __m256 t1 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[0] + k), _mm256_loadu_ps(r[1] + k));
    const __m256 t2 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[2] + k), _mm256_loadu_ps(r[3] + k));
    const __m256 t3 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[2] + k), _mm256_loadu_ps(r[3] + k));
    const __m256 t4 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[4] + k), _mm256_loadu_ps(r[5] + k));
    const __m256 t5 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[4] + k), _mm256_loadu_ps(r[5] + k));
    const __m256 t6 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[6] + k), _mm256_loadu_ps(r[7] + k));
    const __m256 t7 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[6] + k), _mm256_loadu_ps(r[7] + k));
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    t[0] = _mm256_permute2f128_ps(s0, s4, 0x20), t[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    t[2] = _mm256_permute2f128_ps(s2, s6, 0x20), t[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    t[4] = _mm256_permute2f128_ps(s0, s4, 0x31), t[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    t[6] = _mm256_permute2f128_ps(s2, s6, 0x31), t[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* column k of 8 rows (a tail input past the last whole 8) */
static inline __m256 column8(const float *const r[8], int64_t k) {
    return _mm256_setr_ps(r[0][k], r[1][k], r[2][k], r[3][k], r[4][k], r[5][k], r[6][k], r[7][k]);
}

#define DEFINE_COLS(ROWS)                                                                                          \
    static void cols##ROWS(const float *x, int64_t ldx, int64_t in_f, const float *const r[16], float *y,          \
                           int64_t ldy, int64_t n) {                                                                \
        __m256 total[ROWS][2];                                                                                      \
        for (int64_t k0 = 0; k0 < in_f; k0 += KC) {                                                                 \
            const int64_t k1 = in_f - k0 < KC ? in_f : k0 + KC;                                                     \
            __m256 acc[ROWS][2];                                                                                    \
            for (int q = 0; q < ROWS; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();                             \
            int64_t k = k0;                                                                                         \
            for (; k + 8 <= k1; k += 8) {                                                                           \
                __m256 a[8], b[8];                                                                                  \
                transpose8(r, k, a);                                                                                \
                transpose8(r + 8, k, b);                                                                            \
                for (int j = 0; j < 8; j++)                                                                         \
                    for (int q = 0; q < ROWS; q++) {                                                                \
                        const __m256 xv = _mm256_broadcast_ss(x + q * ldx + k + j);                                 \
                        acc[q][0] = _mm256_fmadd_ps(xv, a[j], acc[q][0]);                                           \
                        acc[q][1] = _mm256_fmadd_ps(xv, b[j], acc[q][1]);                                           \
                    }                                                                                               \
            }                                                                                                       \
            for (; k < k1; k++) {                                                                                   \
                const __m256 a = column8(r, k), b = column8(r + 8, k);                                              \
                for (int q = 0; q < ROWS; q++) {                                                                    \
                    const __m256 xv = _mm256_broadcast_ss(x + q * ldx + k);                                         \
                    acc[q][0] = _mm256_fmadd_ps(xv, a, acc[q][0]);                                                  \
                    acc[q][1] = _mm256_fmadd_ps(xv, b, acc[q][1]);                                                  \
                }                                                                                                   \
            }                                                                                                       \
            for (int q = 0; q < ROWS; q++) /* the tile's order: this block's chain + the blocks before */           \
                for (int h = 0; h < 2; h++) total[q][h] = k0 ? _mm256_add_ps(acc[q][h], total[q][h]) : acc[q][h];   \
        }                                                                                                           \
        for (int q = 0; q < ROWS; q++) {                                                                            \
            float out[16];                                                                                          \
            _mm256_storeu_ps(out, total[q][0]);                                                                     \
            _mm256_storeu_ps(out + 8, total[q][1]);                                                                 \
            for (int64_t j = 0; j < n; j++) y[q * ldy + j] = out[j];                                                \
        }                                                                                                           \
    }
#endif

DEFINE_COLS(1)
DEFINE_COLS(2)
DEFINE_COLS(3)

typedef void (*cols_fn)(const float *, int64_t, int64_t, const float *const[16], float *, int64_t, int64_t);
static const cols_fn COLS[3] = {cols1, cols2, cols3};

void tsterm_f32_rows(const float *x, int64_t rows, int64_t in_f, const float *w, int64_t first, int64_t last,
                     int64_t out_f, float *y) {
    for (int64_t o = first; o < last; o += NR) {
        const int64_t n = last - o < NR ? last - o : NR;
        const float *r[NR]; /* past the last output, the first row again: its lanes are never stored */
        for (int64_t j = 0; j < NR; j++) r[j] = w + (o + (j < n ? j : 0)) * in_f;
        for (int64_t r0 = 0, m; r0 < rows; r0 += m) { /* 4 rows as 2 + 2: 8 accumulators spilled with 16 ymm */
            m = rows - r0 == 4 ? 2 : rows - r0 < 3 ? rows - r0 : 3;
            COLS[m - 1](x + r0 * in_f, in_f, in_f, r, y + r0 * out_f + o, out_f, n);
        }
    }
}

void tsterm_f32_matmul(const float *x, int64_t rows, int64_t in_f, const float *w, int64_t out_f, float *y) {
#pragma omp parallel
    {
        int64_t first, last;
        tsterm_thread_share(out_f, NR, &first, &last);
        tsterm_f32_rows(x, rows, in_f, w, first, last, out_f, y);
    }
}
