/* What the C sources share with each other (not exported from the library: hidden visibility). */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#define TSTERM_INTERNAL __attribute__((visibility("hidden")))
#define MAX_HEADS 64 /* query heads (of one rank) the decode attention takes */

/* One block of 32 weights as float32, in quant.py's layouts: int8 codes times the block's fp16 d (GGUF Q8_0), or
 * int4 (byte i: input i in the low nibble, input i + 16 in the high one) as code * d + m (GGUF Q4_1; d, m fp16). */
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

/* This OpenMP thread's even share [*first, *last) of n items handed out in whole units (the last may be short). */
static inline void tsterm_thread_share(int64_t n, int64_t unit, int64_t *first, int64_t *last) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (n + unit - 1) / unit, end = units * (t + 1) / nt * unit;
    *first = units * t / nt * unit;
    *last = end < n ? end : n;
}

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
    __m256 p = _mm256_set1_ps(1.32764783e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.67554189e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55071309e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.240221202f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.693146944f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.00000012f));
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

/* attention.c: the one order of arithmetic every CPU attention of a query row follows, in a prefill, an extend or a
 * decode, so that a row's output is the same bits however its context was computed and batched. Keys go in splits
 * of ATT_SPLIT positions and chunks of ATT_CHUNK, both at fixed positions (0, ATT_CHUNK, ...): scores are dot
 * products of q (scaled first) with each K row in 8 lanes, an online softmax runs over a split's chunks, and the splits' partials are merged
 * in order (tsterm_att_merge). Splits are what a decode of one long sequence spreads over the threads. */
#define ATT_CHUNK 128
#define ATT_SPLIT 128

typedef struct {
    const float *k_cache, *v_cache; /* [num_blocks, B, Hkv, D] */
    const int32_t *table;           /* the sequence's block table */
    int64_t block_size, num_kv_heads, head_dim;
    int64_t window; /* a sliding window: a row at position p sees keys (p - window, p] only (0: every key <= p) */
} tsterm_kv;

/* the first key a row at position p sees */
static inline int64_t tsterm_att_window_start(int64_t window, int64_t p) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* one thread's scratch for tsterm_attend_split over R rows: V panels, scores */
static inline size_t tsterm_att_scratch_floats(int64_t rows, int64_t head_dim) {
    return (size_t)(ATT_CHUNK * head_dim + rows * ATT_CHUNK + 32);
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
    const float *k_cache, *v_cache; /* [num_blocks, B, Hkv, D] */
    const int32_t *block_tables;    /* [S, max_blocks] */
    int64_t max_blocks;
    const int32_t *seq_lens; /* [S] */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t max_splits; /* tsterm_attention_splits(seq_lens, num_seqs) */
    float *part;        /* tsterm_attention_part_bytes() of scratch, 32-byte aligned */
    const float *sinks; /* [Hq] each head's sink logit, or NULL (none) */
    int64_t window;     /* tsterm_kv's window (0: none) */
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
