/* What the C sources share with each other (not exported from the library: hidden visibility). */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TSTERM_INTERNAL __attribute__((visibility("hidden")))
#define MAX_HEADS 64 /* query heads (of one rank) the decode attention takes */

/* 2^f on [-1/2, 1/2]: the degree-5 minimax polynomial every width of exp2 evaluates (exp2_256 below, its NEON twin,
 * attention.c's exp2_512), highest coefficient first; one set, so that the widths keep giving the same bits */
#define TSTERM_EXP2_C5 1.32764783e-3f
#define TSTERM_EXP2_C4 9.67554189e-3f
#define TSTERM_EXP2_C3 5.55071309e-2f
#define TSTERM_EXP2_C2 0.240221202f
#define TSTERM_EXP2_C1 0.693146944f
#define TSTERM_EXP2_C0 1.00000012f

/* One block of 32 weights as float32, in quant.py's layouts: int8 codes times the block's fp16 d (GGUF Q8_0), or
 * int4 (byte i: input i in the low nibble, input i + 16 in the high one) as code * d + m (GGUF Q4_1; d, m fp16). */
#if defined(__aarch64__)
/* aarch64 (neon/immintrin.h stands in for the x86 header): the same two blocks in NEON, the same bits (each weight
 * code * d, then + m, rounded as the x86 code rounds them). */
#include <arm_neon.h>
static inline void tsterm_q8_block(const int8_t *codes, uint16_t d_bits, float *w) {
    const float32x4_t d = vdupq_n_f32(_cvtsh_ss(d_bits));
    for (int i = 0; i < 32; i += 8) {
        const int16x8_t c = vmovl_s8(vld1_s8(codes + i));
        vst1q_f32(w + i, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(c))), d));
        vst1q_f32(w + i + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(c))), d));
    }
}
static inline void tsterm_q4_block(const uint8_t *codes, const uint16_t *dm_bits, float *w) {
    const float32x4_t d = vdupq_n_f32(_cvtsh_ss(dm_bits[0])), m = vdupq_n_f32(_cvtsh_ss(dm_bits[1]));
    const uint8x16_t bytes = vld1q_u8(codes);
    const uint8x16_t halves[2] = {vandq_u8(bytes, vdupq_n_u8(15)), vshrq_n_u8(bytes, 4)}; /* inputs 0-15, 16-31 */
    for (int h = 0; h < 2; h++) {
        const uint16x8_t parts[2] = {vmovl_u8(vget_low_u8(halves[h])), vmovl_u8(vget_high_u8(halves[h]))};
        for (int p = 0; p < 2; p++) {
            float *o = w + 16 * h + 8 * p;
            vst1q_f32(o, vaddq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(parts[p]))), d), m));
            vst1q_f32(o + 4, vaddq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(parts[p]))), d), m));
        }
    }
}
#else
static inline void tsterm_q8_block(const int8_t *codes, uint16_t d_bits, float *w) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(d_bits));
    for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(w + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                  _mm_loadl_epi64((const __m128i *)(codes + i)))), d));
}
static inline void tsterm_q4_block(const uint8_t *codes, const uint16_t *dm_bits, float *w) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dm_bits[0])), m = _mm256_set1_ps(_cvtsh_ss(dm_bits[1]));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)codes), low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)}; /* inputs 0-7, 8-15, 16-23, 24-31 */
    for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(w + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d), m));
}
#endif

/* This OpenMP thread's even share [*first, *last) of n items handed out in whole units (the last may be short). */
static inline void tsterm_thread_share(int64_t n, int64_t unit, int64_t *first, int64_t *last) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (n + unit - 1) / unit, end = units * (t + 1) / nt * unit;
    *first = units * t / nt * unit;
    *last = end < n ? end : n;
}

#if defined(__aarch64__)
/* aarch64: the helpers below in NEON, each the x86 code's arithmetic lane for lane (the same pairs summed in the
 * same order, x86's max, round-to-nearest-even where x86 rounds, the same fused multiply-adds), so attention and
 * decode give the same bits as on x86. */
static inline float tsterm_max1_x86(float a, float b) { return a > b ? a : b; }

static inline float hsum256(__m256 v) {
    const float32x4_t s = vaddq_f32(v.lo, v.hi);                         /* lanes i + (i + 4) */
    const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));  /* (s0 + s2, s1 + s3) */
    return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}

static inline float hmax256(__m256 v) {
    const float32x4_t m = tsterm_max_x86(v.lo, v.hi);
    const float a = tsterm_max1_x86(vgetq_lane_f32(m, 0), vgetq_lane_f32(m, 2));
    const float b = tsterm_max1_x86(vgetq_lane_f32(m, 1), vgetq_lane_f32(m, 3));
    return tsterm_max1_x86(a, b);
}

static inline float32x4_t tsterm_exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.0f);
    const uint32x4_t under = vcltq_f32(x, lo);
    x = tsterm_max_x86(x, lo);
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f)); /* x - n * c, fused: x86's fnmadd */
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.0f / 720.0f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(bits))), under));
}
static inline __m256 exp256(__m256 x) { return tsterm_m256(tsterm_exp4(x.lo), tsterm_exp4(x.hi)); }

static inline float32x4_t tsterm_exp2_4(float32x4_t t) {
    t = tsterm_max_x86(t, vdupq_n_f32(-125.0f));
    const float32x4_t n = vrndnq_f32(t), f = vsubq_f32(t, n);
    float32x4_t p = vdupq_n_f32(TSTERM_EXP2_C5);
    p = vfmaq_f32(vdupq_n_f32(TSTERM_EXP2_C4), p, f);
    p = vfmaq_f32(vdupq_n_f32(TSTERM_EXP2_C3), p, f);
    p = vfmaq_f32(vdupq_n_f32(TSTERM_EXP2_C2), p, f);
    p = vfmaq_f32(vdupq_n_f32(TSTERM_EXP2_C1), p, f);
    p = vfmaq_f32(vdupq_n_f32(TSTERM_EXP2_C0), p, f);
    return vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), vshlq_n_s32(vcvtnq_s32_f32(n), 23)));
}
static inline __m256 exp2_256(__m256 t) { return tsterm_m256(tsterm_exp2_4(t.lo), tsterm_exp2_4(t.hi)); }

static inline float tsterm_exp_sum(float *s, int64_t n, float max) {
    const float32x4_t log2e = vdupq_n_f32(1.44269504088896341f), neg_mv = vdupq_n_f32(-(max * 1.44269504088896341f));
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = tsterm_m256(tsterm_exp2_4(vfmaq_f32(neg_mv, vld1q_f32(s + i), log2e)), /* x86's fmsub */
                                     tsterm_exp2_4(vfmaq_f32(neg_mv, vld1q_f32(s + i + 4), log2e)));
        _mm256_storeu_ps(s + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum256(sum8);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}
#else
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* e^x for 8 lanes, x <= 0 (scores minus their max): 2^n * e^r with |r| <= ln2 / 2, a degree-6 polynomial for e^r
 * (relative error below 2e-7); inputs below -87 give 0. */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact first product */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* 2^t for 8 lanes, t <= 0 (below -125: 2^-125): 2^n p(f) with n = round(t), f = t - n in [-1/2, 1/2] and p a
 * degree-5 minimax fit of 2^f (relative error 2.1e-7 evaluated in float32); 2^n is added into p's exponent bits.
 * 11 operations where exp256 takes 17: softmax's exponentials were 12-14% of prefill attention's time. */
static inline __m256 exp2_256(__m256 t) {
    t = _mm256_max_ps(t, _mm256_set1_ps(-125.0f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(TSTERM_EXP2_C5);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(TSTERM_EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(TSTERM_EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(TSTERM_EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(TSTERM_EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(TSTERM_EXP2_C0));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}

/* s[0..n) <- e^(s - max) in place (every s <= max); returns their sum (8 lanes summed, then the tail). The lanes
 * take e^x = 2^(x log2 e), s log2 e - max log2 e in one fused multiply-subtract. */
static inline float tsterm_exp_sum(float *s, int64_t n, float max) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), mv = _mm256_set1_ps(max * 1.44269504088896341f);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp2_256(_mm256_fmsub_ps(_mm256_loadu_ps(s + i), log2e, mv));
        _mm256_storeu_ps(s + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum256(sum8);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}
#endif

/* gemv.c. Weight kinds: */
enum { TSTERM_F32 = 0, TSTERM_Q8 = 1, TSTERM_Q4 = 2 };
/* One row of x [I] -> int8 codes [I], per block of 32: dx [I/32] and dx * sum(codes) sx [I/32]. */
TSTERM_INTERNAL void tsterm_quantize_row(const float *x, int64_t in_f, int8_t *qx, float *dx, float *sx);
/* Output rows [first, last) of y [rows, O] = x @ W^T for a q8 / q4 weight, x given quantized (qx [rows, I],
 * dx and sx [rows, I/32]). */
TSTERM_INTERNAL void tsterm_quant_rows(int kind, const int8_t *qx, const float *dx, const float *sx, int64_t rows,
                                       int64_t in_f, const void *codes, const uint16_t *scales, int64_t first,
                                       int64_t last, int64_t out_f, float *y);
/* Output rows [first, last) of y [rows, O] = x [rows, I] @ W [O, I]^T, float32, few rows of x (gemm.c): the GEMM's
 * summation order, so each row's result is the bits a GEMM of any number of rows gives it. */
TSTERM_INTERNAL void tsterm_f32_rows(const float *x, int64_t rows, int64_t in_f, const float *w, int64_t first,
                                     int64_t last, int64_t out_f, float *y);

/* gemm.c: the register-blocked float32 kernel's pieces (prefill.c reuses them for attention). */
#define NR 16 /* outputs per tile: two ymm of accumulators per row */
#define MR 6  /* rows per tile */
/* packed [len][16] <- rows[0..n) (n <= 16, each [len]) transposed; outputs n..15 zero. packed 32-byte aligned. */
TSTERM_INTERNAL void tsterm_pack16(const float *const *rows, int64_t n, int64_t len, float *packed);
/* y [rows][16] (rows ldy apart) = (add: +=) x [rows][kc] (ldx apart) @ packed [kc][16]; 1 <= rows <= MR */
TSTERM_INTERNAL void tsterm_f32_tile(int64_t rows, int64_t kc, const float *x, int64_t ldx, const float *packed,
                                     float *y, int64_t ldy, int add);

/* This OpenMP thread's share of y [rows, O] = x [rows, I] (rows ldx apart) @ W [O, I]^T, in a parallel region of the
 * caller's (tsterm_f32_gemm is one such region); the threads write disjoint columns, no barrier at the end. */
TSTERM_INTERNAL void tsterm_f32_gemm_share(const float *x, int64_t ldx, int64_t rows, int64_t in_f, const float *w,
                                           int64_t out_f, float *y);

/* bf16.c: a bfloat16 linear's two pieces, for a caller's own parallel region (stack.c). isa: 2 AMX (granted), 1
 * AVX512-BF16, 0 plain C (tsterm_bf16_gemm's). The bytes of x's packed form for `rows` rows of in_f inputs: */
TSTERM_INTERNAL size_t tsterm_bf16_packed_bytes(int64_t isa, int64_t rows, int64_t in_f);
/* x [rows, in_f] float32 (rows ldx apart), rounded to bfloat16, into the form isa reads (packed: 64-byte aligned) */
TSTERM_INTERNAL void tsterm_bf16_pack(int64_t isa, const float *x, int64_t ldx, int64_t rows, int64_t in_f,
                                      void *packed);
/* Outputs [first, last) of y [rows, out_f] (rows ldy apart) = packed x @ w [out_f, in_f]^T (bfloat16, contiguous),
 * on this thread (first a multiple of 32): each output the bits tsterm_bf16_gemm gives it. */
TSTERM_INTERNAL void tsterm_bf16_rows(int64_t isa, const void *packed, int64_t rows, int64_t in_f, const uint16_t *w,
                                      int64_t first, int64_t last, int64_t out_f, float *y, int64_t ldy);

/* attention.c: the one order of arithmetic every CPU attention of a query row follows, in a prefill, an extend or a
 * decode, so that a row's output is the same bits however its context was computed and batched. Keys go in splits
 * of ATT_SPLIT positions and chunks of ATT_CHUNK, both at fixed positions (0, ATT_CHUNK, ...): scores are dot
 * products of q (scaled first) with each K row in 8 lanes, an online softmax runs over a split's chunks, and the splits' partials are merged
 * in order (tsterm_att_merge). Splits are what a decode of one long sequence spreads over the threads. */
#define ATT_CHUNK 128
#define ATT_SPLIT 128

typedef struct {
    const float *k_cache, *v_cache; /* [num_blocks, B, Hkv, D] (bfloat16 bits where kv_bf16: cast, never read as floats) */
    const int32_t *table;           /* the sequence's block table */
    int64_t block_size, num_kv_heads, head_dim;
    int64_t window; /* a sliding window: a row at position p sees keys (p - window, p] only (0: every key <= p) */
    int64_t kv_bf16; /* 1: the pools hold bfloat16, widened to float32 as they are read (exact); 0: float32; 2:
                      * bfloat16 pools and bfloat16 products on AMX tiles (TSTERM_ATT_AMX; built where TSTERM_AMX) */
} tsterm_kv;

#define TSTERM_ATT_AMX 2 /* tsterm_kv.kv_bf16: attention.c's AMX arithmetic */

#if !defined(__aarch64__)
/* r [8] (8 x 8 float32) transposed in registers: pairs of rows interleaved, pairs of those shuffled, 128-bit halves
 * swapped (gemm.c's weight packing and attention.c's transposed K) */
static inline __attribute__((always_inline)) void tsterm_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define TSTERM_AMX 1 /* AMX code is built (every CPU with AMX-BF16 has AVX512-BF16, which packs the tiles' inputs) */
/* AMX's tile configuration (palette 1): tiles 0 .. tiles - 1 are 16 rows of 64 bytes, loaded into this thread */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tsterm_tile_config;

static inline void tsterm_amx_config(int tiles) {
    tsterm_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < tiles; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* r [16] (16 x 16 float32 or 32-bit words) transposed in registers: at each of 4 levels b (8, 4, 2, 1), every pair
 * of rows i, i + b (bit b of i clear) swaps the off-diagonal halves of their 2b x 2b blocks: row i keeps its lanes
 * without bit b and takes row i + b's lanes l - b in the others; row i + b takes row i's lanes l + b in the lanes
 * without bit b and keeps its own in the others (the index vectors are constants once unrolled) */
static inline void tsterm_transpose16(__m512 r[16]) {
#pragma GCC unroll 4
    for (int b = 8; b >= 1; b >>= 1) {
        int32_t lo[16], hi[16];
        for (int l = 0; l < 16; l++) {
            lo[l] = (l & b) ? 16 + l - b : l;
            hi[l] = (l & b) ? 16 + l : l + b;
        }
        const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
        for (int i = 0; i < 16; i++)
            if (!(i & b)) {
                const __m512 a = r[i], e = r[i + b];
                r[i] = _mm512_permutex2var_ps(a, ilo, e);
                r[i + b] = _mm512_permutex2var_ps(a, ihi, e);
            }
    }
}
#else
#define TSTERM_AMX 0
#endif

/* 8 bfloat16 values -> their float32 values (exact: a bfloat16 is a float32's high 16 bits) */
#if defined(__aarch64__)
static inline __m256 tsterm_bf16x8(const uint16_t *p) {
    const uint16x8_t h = vld1q_u16(p);
    return tsterm_m256(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
                       vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16)));
}
#else
static inline __m256 tsterm_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN): torch's .to(torch.bfloat16) */
static inline uint16_t tsterm_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bfloat16 bits -> float32 (exact) */
static inline float tsterm_bf16_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to bfloat16, as a float32 */
static inline float tsterm_bf16_rounded(float f) { return tsterm_bf16_float(tsterm_bf16_round(f)); }

/* the first key a row at position p sees */
static inline int64_t tsterm_att_window_start(int64_t window, int64_t p) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* one thread's scratch for tsterm_attend_split over R rows: V panels and scores; on AMX (kv_bf16 2) the chunk's K
 * and V in tile layout, q and P in bfloat16, scores of whole 16-row tiles and a tile of outputs */
static inline size_t tsterm_att_scratch_floats(int64_t rows, int64_t head_dim) {
    const int64_t d32 = (head_dim + 31) / 32 * 32, r16 = (rows + 15) / 16 * 16;
    return (size_t)(ATT_CHUNK * d32 + r16 * ATT_CHUNK + r16 * d32 / 2 + 8 * ATT_CHUNK + 16 * d32 + 64);
}

/* R query rows of KV head h (row r at position first_pos + r / G, its q already scaled, qs [R][D]) over keys
 * [k0, k1) of one split (k0 a multiple of ATT_SPLIT, k1 <= k0 + ATT_SPLIT), each row over its keys at or before its
 * position (and within kv->window): every row at or after k0 gets its partial m [R] (max), l [R] (sum of
 * exponentials), o [R][D] (unnormalized output; m = -inf, l = 0 for a row whose window starts past the split);
 * rows before k0 are left alone. Chunks before every row's window are not read. K rows past the split, up to
 * ahead_end, are prefetched for the task that comes next (the same head's next split). scratch:
 * tsterm_att_scratch_floats(R, D), 32-byte aligned. */
TSTERM_INTERNAL void tsterm_attend_split(const tsterm_kv *kv, int64_t h, const float *qs, int64_t R, int64_t G,
                                         int64_t first_pos, int64_t k0, int64_t k1, int64_t ahead_end, float *scratch,
                                         float *m, float *l, float *o);

/* what a row's merged O is multiplied by: 1 / L, or with an attention sink (a learned logit whose value is zero,
 * gpt-oss) in the denominator, e^(M - mx) / (L e^(M - mx) + e^(sink - mx)), mx = max(M, sink) */
static inline float tsterm_att_norm(float M, float L, const float *sink) {
    if (sink == NULL) return 1.0f / L;
    const float mx = *sink > M ? *sink : M, a = expf(M - mx);
    return a / (L * a + expf(*sink - mx));
}

/* a row's running result (M, L, O [D]) <- merged with its next split's partial (m, l, o); first: its first split */
static inline void tsterm_att_merge(float *M, float *L, float *O, float m, float l, const float *o, int64_t D,
                                    int first) {
    if (first) {
        *M = m, *L = l;
        for (int64_t d = 0; d < D; d++) O[d] = o[d];
        return;
    }
    const float mx = m > *M ? m : *M, a = expf(*M - mx), b = expf(m - mx);
    for (int64_t d = 0; d < D; d++) O[d] = O[d] * a + o[d] * b; /* -ffp-contract=off: two products, one sum */
    *L = *L * a + l * b, *M = mx;
}

/* decode.c: decode attention in two phases (tasks over (sequence, split), then one merge per query row), so that a
 * caller's own parallel region can run it. */
typedef struct {
    const float *q; /* [S, Hq, D], rows q_stride apart */
    int64_t q_stride;
    const float *k_cache, *v_cache; /* [num_blocks, B, Hkv, D] (bfloat16 bits where kv_bf16) */
    const int32_t *block_tables;    /* [S, max_blocks] */
    int64_t max_blocks;
    const int32_t *seq_lens; /* [S] */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t max_splits; /* tsterm_attention_splits(seq_lens, num_seqs) */
    float *part;        /* tsterm_attention_part_bytes() of scratch, 32-byte aligned */
    const float *sinks; /* [Hq] each head's sink logit, or NULL (none) */
    int64_t window;     /* tsterm_kv's window (0: none) */
    int64_t kv_bf16;    /* tsterm_kv's: the caches hold bfloat16 */
} tsterm_attention;

TSTERM_INTERNAL int64_t tsterm_attention_splits(const int32_t *seq_lens, int64_t num_seqs);
/* one thread's scratch (floats, a multiple of 16): tsterm_attend_split's, then a KV head's G rows of q, o, m, l */
static inline size_t tsterm_attention_thread_floats(const tsterm_attention *a) {
    const int64_t G = a->num_heads / a->num_kv_heads, D = a->head_dim;
    return (tsterm_att_scratch_floats(G, D) + (size_t)(G * (2 * D + 2)) + 15) / 16 * 16;
}
/* the splits' partials [S, splits, Hq, D + 2], then a scratch per thread (up to omp_get_max_threads()) */
static inline size_t tsterm_attention_part_bytes(const tsterm_attention *a) {
    return sizeof(float) * ((size_t)(a->num_seqs * a->max_splits * a->num_heads * (a->head_dim + 2) + 16) +
                            tsterm_attention_thread_floats(a) * (size_t)omp_get_max_threads());
}
/* every task, shared by the threads of the caller's parallel region (ends at a barrier) */
TSTERM_INTERNAL void tsterm_attention_tasks(const tsterm_attention *a);
TSTERM_INTERNAL void tsterm_attention_merge(const tsterm_attention *a, int64_t row, float *out); /* row < S * Hq */

/* stack.c: out[i] = 1 / (1 + e^-x[i]) (exported: the layer path's shared-expert gate calls it too) */
void tsterm_sigmoid(const float *x, int64_t n, float *out);
/* out [H] = src * rsqrt(mean(src^2) + eps) * weight (out may be src) */
TSTERM_INTERNAL void tsterm_rms_norm_row(const float *src, const float *weight, int64_t hidden, float eps,
                                         float *out);
/* one token's heads [heads, D] rotated in place (rotate-half): cos [D], sin [D/2] */
TSTERM_INTERNAL void tsterm_rope_row(float *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin);
/* out [n] = silu(g) * u */
TSTERM_INTERNAL void tsterm_swiglu_row(const float *g, const float *u, int64_t n, float *out);
/* the new tokens' K and V rows into their slots of the paged pools (exported: the layer path calls it too) */
void tsterm_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens,
                     int64_t row_len, float *k_cache, float *v_cache, const int64_t *slots);
